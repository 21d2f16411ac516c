"""Embedded JAX sampler throughput against transformers and SGLang, and its step time against the memory-bandwidth floor.

Peers: Hugging Face ``transformers`` ``generate`` and a real SGLang server (through hetrl's
SGLang pool client). All run the same tiny Qwen3 checkpoint on the CPU in float32 (the embedded
sampler with the exact ``fp32`` reference profile, transformers in torch eager mode, SGLang 0.5.23's CPU engine
with torch-native attention from ``.venv-sglang``, see tests/sglang_server/) with the same
sampling (temperature 1, top_k 50, top_p 0.95), at batch sizes 1 / 8 / 32, prompts of 64 random
tokens and exactly 128 new tokens (no stop token; transformers gets ``min_new_tokens=128``,
SGLang ``ignore_eos``). The embedded sampler and the SGLang pool additionally record, per token,
its log-prob and the kept support with log-probs (SGLang: its native sampling mask);
transformers only returns token ids. The SGLang batch is sent as
concurrent HTTP requests, which the server batches; client and server share the machine's cores.
Two phases, each interleaved: transformers vs embedded, then (server started) embedded vs SGLang;
the server's processes are up only in the second, since they slow torch's threads in the first.
Each ratio compares engines timed in the same phase.

The model is realistic-but-cheap: hidden 256, 4 layers, 4 query / 2 KV heads of dim 64,
intermediate 768, vocabulary 8192 (7.3M parameters; the LM head is 29% of them). Compilation
(jit) and transformers' first call are warm-ups, excluded from the timings and the compile time
reported separately. The two engines are timed interleaved (alternating which goes first in each
repeat), so machine load shifts both alike; tokens/s = B * 128 / wall time, reported as the median
over repeats and as the best (fastest) repeat: on a shared machine torch's OpenMP threads stall
now and then (a repeat can take 10x the usual), which inflates transformers' median, so the
best-vs-best speedup is the conservative figure.

**The floor.** A decode step reads at least every weight once (the input embedding only for
the batch's rows) and the KV cache as the engine holds it: attention reads every allocated slot,
``P + N/2`` slots for the first half of the steps and ``P + N`` for the rest (see
:mod:`hetrl.samplers.embedded`), so at batch 32 about 20.9 MB of fp32 weights and 16.8-25.2 MB
of cache. Those bytes over the machine's memory bandwidth are the step's floor. The bandwidth is
measured in the same run, before and after the timed phase: a copy of a 1 GiB float64 numpy
array into another, bytes read + written / time, best of 5, on one thread and with the array
split over one thread per core (numpy's copy releases the GIL); the floor uses the best figure.
Step time = the embedded engine's median call time / new tokens (prefill included, so it is an
upper bound on a decode step); ratio = step time / floor (1.0 would be memory speed; a step whose
bytes fit in the last-level cache can come out below 1, as the floor is DRAM's).

    .venv/bin/python bench/sampler_throughput.py [--repeats 5] [--out bench/results] [--no-sglang] [--quick]

Writes ``sampler_throughput.json`` and ``sampler_throughput.png`` to ``--out``. ``--quick``:
one batch of 2, prompts of 16 and 16 new tokens, 1 repeat, a 64 MiB bandwidth array, and no
SGLang phase unless ``--sglang`` is given (the server takes a minute to start on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import statistics
import tempfile
import threading
import time

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hetrl.bench_command import output_dir, script_parser
from hetrl.core.schema import SamplingParams
from hetrl.models.config import ModelConfig
from hetrl.models.tiny import build_tiny_checkpoint
from hetrl.samplers.base import GenerationRequest
from hetrl.samplers.embedded import EmbeddedSampler, _bucket, _decode_segments
from hetrl.samplers.profiles import REFERENCE_KIND, sampler_numerics

BENCH_MODEL = ModelConfig(
    model_type="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    rope_theta=10_000.0, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
)
SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Size:
    """What one run measures: batch sizes, prompt and new-token lengths, timed repeats, and the
    bytes of the array the bandwidth copy reads."""

    batch_sizes: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    repeats: int
    bandwidth_bytes: int


FULL = Size((1, 8, 32), prompt_len=64, new_tokens=128, repeats=5, bandwidth_bytes=1 << 30)
QUICK = Size((2,), prompt_len=16, new_tokens=16, repeats=1, bandwidth_bytes=64 << 20)


# ====================================================================== the floor
def memory_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Bytes per second of copying an ``nbytes`` float64 array into another (read + written,
    ``2 · nbytes`` per copy), the array split into ``threads`` contiguous slices copied by one
    thread each; the best of ``repeats`` copies (the first also faults the destination's pages in)."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)

    def copy(i: int) -> None:
        np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]])

    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return 2.0 * src.nbytes / best


def decode_step_bytes(config: ModelConfig, sampler: EmbeddedSampler, batch: int, prompt_len: int, new_tokens: int,
                      dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one decode step reads at least, averaged over a call's decode steps: ``weights``
    (every parameter once; of an untied input embedding only the batch's rows) and ``kv_cache``
    (every allocated slot of every layer's K and V, for the batch, shape and cache segments the
    engine compiles for this call)."""
    B = _bucket(batch, sampler.batch_buckets)
    P, N = _bucket(prompt_len, sampler.length_buckets), _bucket(new_tokens, sampler.length_buckets)
    embedding = config.vocab_size * config.hidden_size
    weights = config.parameter_count() - (0 if config.tie_word_embeddings else embedding - B * config.hidden_size)
    slot = B * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim  # K and V, all layers
    segments = _decode_segments(N)
    slots = [P + next(end for end in segments if n <= end) for n in range(1, N)]  # decode steps n = 1 .. N - 1
    return dict(weights=float(weights * dtype_bytes), kv_cache=float(slot * statistics.mean(slots or [P]) * dtype_bytes))


# ====================================================================== engines
def make_engines(directory: pathlib.Path, size: Size) -> dict:
    """``{"hf": run_hf, "embedded": run_embedded}``: each takes prompts [B, prompt_len] int32 and
    returns new tokens [B, new_tokens]; the sampler itself is under ``"sampler"``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def run_hf(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(prompts.astype(np.int64))
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=SAMPLING.temperature,
                              top_k=SAMPLING.top_k, top_p=SAMPLING.top_p, max_new_tokens=size.new_tokens,
                              min_new_tokens=size.new_tokens, pad_token_id=BENCH_MODEL.pad_token_id)
        return out[:, size.prompt_len:].numpy()

    sampler = EmbeddedSampler.from_checkpoint(directory, sampler_numerics(REFERENCE_KIND), seed=0)

    def run_embedded(prompts: np.ndarray) -> np.ndarray:
        reqs = [GenerationRequest(f"r{i}", p, SAMPLING, size.new_tokens) for i, p in enumerate(prompts)]
        return np.stack([g.token_ids for g in sampler.generate(reqs)])

    return {"hf": run_hf, "embedded": run_embedded, "sampler": sampler}


def make_sglang(directory: pathlib.Path, work: pathlib.Path, size: Size):
    """``(server, run_sglang)``: an SGLang server on ``directory`` and a one-replica SGLang pool
    client over it (same signature as the other engines)."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from sglang_server.server import SGLangServer

    from hetrl.samplers.fleet import PoolConfig
    from hetrl.samplers.sglang import ServerSampler

    server = SGLangServer(directory, log_path=work / "sglang.log").start()
    pool = PoolConfig(name="sglang", engine="sglang", accelerator="h100", endpoints=(server.url,),
                      server={"top_logprobs_num": 64})
    sampler = ServerSampler(pool, pool.numerics(), model_dir=directory, weights_dir=work / "weights")

    def run_sglang(prompts: np.ndarray) -> np.ndarray:
        reqs = [GenerationRequest(f"r{i}", p, SAMPLING, size.new_tokens) for i, p in enumerate(prompts)]
        return np.stack([g.token_ids for g in sampler.generate(reqs)])

    return server, run_sglang


def timed(fn, prompts, new_tokens: int) -> float:
    start = time.perf_counter()
    out = fn(prompts)
    elapsed = time.perf_counter() - start
    assert out.shape == (prompts.shape[0], new_tokens), out.shape
    return elapsed


def time_interleaved(engines: dict, prompts: dict, size: Size, progress: Progress, what: str):
    """``(first-call seconds, times)`` of ``engines`` at every batch size: one warm-up call each,
    then ``repeats`` rounds interleaving the engines (rotating which goes first), so machine load
    shifts them alike. ``times[b][name]`` lists the seconds of each round."""
    task = progress.add_task(f"{what}: warm-up", total=len(size.batch_sizes) * len(engines) * (1 + size.repeats))
    warmup = {b: {} for b in size.batch_sizes}
    for b in size.batch_sizes:
        for name, fn in engines.items():
            warmup[b][f"{name}_first_call_s"] = timed(fn, prompts[b], size.new_tokens)
            progress.advance(task)
    progress.update(task, description=f"{what}: timing (interleaved)")
    times = {b: {name: [] for name in engines} for b in size.batch_sizes}
    order = list(engines.items())
    for rep in range(size.repeats):
        for b in size.batch_sizes:
            for name, fn in order[rep % len(order):] + order[: rep % len(order)]:
                times[b][name].append(timed(fn, prompts[b], size.new_tokens))
                progress.advance(task)
    return warmup, times


def plot(rows: list[dict], size: Size, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    engines = [e for e in (("hf", "transformers generate (torch CPU)"), ("embedded", "hetrl embedded (JAX CPU)"),
                           ("sglang", "SGLang 0.5.23 server (CPU) via hetrl pool")) if f"{e[0]}_tokens_per_s" in rows[0]]
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for j, (name, label) in enumerate(engines):
        dx = (j - (len(engines) - 1) / 2) * width
        med = [r[f"{name}_tokens_per_s"] for r in rows]
        best = [r[f"{name}_best_tokens_per_s"] for r in rows]
        ax.bar(x + dx, med, width, label=f"{label}, median")
        ax.scatter(x + dx, best, marker="_", s=200, color="black", linewidths=2, zorder=3)
    ax.scatter([], [], marker="_", s=200, color="black", label="best repeat")
    for i, r in enumerate(rows):
        top = max(r["embedded_tokens_per_s"], r["embedded_best_tokens_per_s"])
        ax.annotate(f"vs hf {r['speedup']:.1f}x / {r['best_speedup']:.1f}x\nstep {r['step_over_floor']:.1f}x floor",
                    (x[i], top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [f"batch {r['batch_size']}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the annotations under the title
    ax.set_ylabel("new tokens / s (speedup: median / best)")
    ax.set_title(f"Sampler throughput: prompt {size.prompt_len}, {size.new_tokens} new tokens, fp32, top-k 50 / top-p 0.95")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, with --quick 1)")
    parser.add_argument("--sglang", action=argparse.BooleanOptionalAction, default=None,
                        help="time a real SGLang server too (default: yes, with --quick no)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.repeats:
        size = dataclasses.replace(size, repeats=args.repeats)
    with_sglang = not args.quick if args.sglang is None else args.sglang
    out = output_dir(args, __file__)
    console = Console(width=140)
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(3, BENCH_MODEL.vocab_size, size=(b, size.prompt_len)).astype(np.int32)
               for b in size.batch_sizes}
    threads = os.cpu_count() or 1

    def bandwidths() -> dict[str, float]:
        return {f"{n}_thread": memory_bandwidth(size.bandwidth_bytes, n) for n in sorted({1, threads})}

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_tiny_checkpoint(pathlib.Path(tmp) / "bench-model", BENCH_MODEL, seed=0)
        engines = make_engines(directory, size)
        sampler = engines.pop("sampler")
        with Progress(console=console, transient=True) as progress:
            bandwidth = {"before": bandwidths()}
            warmup, times = time_interleaved(engines, prompts, size, progress, "transformers vs embedded")
            bandwidth["after"] = bandwidths()
            if with_sglang:  # a second phase: the server's processes would slow torch's threads in the first
                server, run_sglang = make_sglang(directory, pathlib.Path(tmp), size)
                try:
                    warm_b, times_b = time_interleaved({"embedded": engines["embedded"], "sglang": run_sglang},
                                                       prompts, size, progress, "embedded vs SGLang")
                finally:
                    server.close()
                for b in size.batch_sizes:
                    warmup[b]["sglang_first_call_s"] = warm_b[b]["sglang_first_call_s"]
                    times[b]["sglang"] = times_b[b]["sglang"]
                    times[b]["embedded_with_server"] = times_b[b]["embedded"]
    machine_bandwidth = max(v for phase in bandwidth.values() for v in phase.values())

    rows = []
    new = size.new_tokens
    for b in size.batch_sizes:
        hf_s, emb_s = statistics.median(times[b]["hf"]), statistics.median(times[b]["embedded"])
        step_bytes = decode_step_bytes(BENCH_MODEL, sampler, b, size.prompt_len, new)
        floor_s = sum(step_bytes.values()) / machine_bandwidth
        rows.append(dict(
            batch_size=b, hf_s=hf_s, embedded_s=emb_s,
            hf_tokens_per_s=b * new / hf_s, embedded_tokens_per_s=b * new / emb_s,
            speedup=hf_s / emb_s, best_speedup=min(times[b]["hf"]) / min(times[b]["embedded"]),
            hf_best_tokens_per_s=b * new / min(times[b]["hf"]),
            embedded_best_tokens_per_s=b * new / min(times[b]["embedded"]),
            step_bytes_weights=step_bytes["weights"], step_bytes_kv_cache=step_bytes["kv_cache"],
            embedded_step_s=emb_s / new, embedded_best_step_s=min(times[b]["embedded"]) / new, floor_step_s=floor_s,
            step_over_floor=emb_s / new / floor_s, best_step_over_floor=min(times[b]["embedded"]) / new / floor_s,
            hf_all_s=times[b]["hf"], embedded_all_s=times[b]["embedded"], **warmup[b],
        ))
        if "sglang" in times[b]:  # ratios within the second phase (both timed with the server up)
            sg, peer = times[b]["sglang"], times[b]["embedded_with_server"]
            rows[-1].update(sglang_s=statistics.median(sg), sglang_tokens_per_s=b * new / statistics.median(sg),
                            sglang_best_tokens_per_s=b * new / min(sg), sglang_all_s=sg,
                            embedded_with_server_all_s=peer,
                            embedded_vs_sglang=statistics.median(sg) / statistics.median(peer),
                            embedded_vs_sglang_best=min(sg) / min(peer))

    table = Table(title=f"Sampler throughput (new tokens/s; median and best of {size.repeats})")
    sglang = "sglang_tokens_per_s" in rows[0]
    for col in ("batch", "transformers", "embedded", "speedup", "transformers best", "embedded best",
                "best speedup", "embedded 1st call s") + ("sglang", "sglang best", "embedded / sglang") * sglang:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch_size"]), f"{r['hf_tokens_per_s']:.0f}", f"{r['embedded_tokens_per_s']:.0f}",
                      f"{r['speedup']:.2f}x", f"{r['hf_best_tokens_per_s']:.0f}", f"{r['embedded_best_tokens_per_s']:.0f}",
                      f"{r['best_speedup']:.2f}x", f"{r['embedded_first_call_s']:.1f}",
                      *((f"{r['sglang_tokens_per_s']:.0f}", f"{r['sglang_best_tokens_per_s']:.0f}",
                         f"{r['embedded_vs_sglang']:.2f}x") if sglang else ()))
    console.print(table)
    floor = Table(title=f"Embedded decode step against the memory-bandwidth floor ({machine_bandwidth / 1e9:.1f} GB/s)")
    for col in ("batch", "weights MB", "KV cache MB", "floor ms", "step ms (median / best)", "step / floor"):
        floor.add_column(col, justify="right")
    for r in rows:
        floor.add_row(str(r["batch_size"]), f"{r['step_bytes_weights'] / 1e6:.1f}", f"{r['step_bytes_kv_cache'] / 1e6:.1f}",
                      f"{1e3 * r['floor_step_s']:.2f}", f"{1e3 * r['embedded_step_s']:.2f} / {1e3 * r['embedded_best_step_s']:.2f}",
                      f"{r['step_over_floor']:.2f}x / {r['best_step_over_floor']:.2f}x")
    console.print(floor)
    console.print("memory bandwidth (GB/s, copy, read + written): " + "; ".join(
        f"{phase} " + ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f}" for k, v in bw.items()) for phase, bw in bandwidth.items()))

    import jax
    import torch
    import transformers

    meta = dict(date=datetime.date.today().isoformat(), machine=platform.machine(), cores=os.cpu_count(),
                quick=args.quick, repeats=size.repeats, batch_sizes=list(size.batch_sizes), prompt_len=size.prompt_len,
                new_tokens=new, sampling=SAMPLING.model_dump(), model=BENCH_MODEL.model_dump(),
                parameters=BENCH_MODEL.parameter_count(), jax=jax.__version__, torch=torch.__version__,
                transformers=transformers.__version__,
                memory_bandwidth_bytes_per_s=dict(bandwidth, machine=machine_bandwidth, array_bytes=size.bandwidth_bytes),
                load_average_1_5_15min=dict(before=load_before, after=os.getloadavg()))
    (out / "sampler_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, size, out / "sampler_throughput.png")
    console.print(f"wrote {out / 'sampler_throughput.json'} and {out / 'sampler_throughput.png'}")


if __name__ == "__main__":
    main()
