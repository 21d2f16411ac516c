"""Throughput of the embedded JAX sampler against Hugging Face ``transformers`` ``generate`` and
a real SGLang server (through hetrl's SGLang pool client).

All run the same tiny Qwen3 checkpoint on the CPU in float32 (the embedded sampler with the
exact ``fp32`` reference profile, transformers in torch eager mode, SGLang 0.5.23's CPU engine
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

    .venv/bin/python bench/sampler_throughput.py [--repeats 5] [--out bench/results] [--no-sglang]

Writes ``sampler_throughput.json`` and ``sampler_throughput.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hetrl.core.schema import SamplingParams
from hetrl.models.config import ModelConfig
from hetrl.models.tiny import build_tiny_checkpoint
from hetrl.samplers.base import GenerationRequest
from hetrl.samplers.embedded import EmbeddedSampler
from hetrl.samplers.profiles import REFERENCE_KIND, sampler_numerics

BENCH_MODEL = ModelConfig(
    model_type="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    rope_theta=10_000.0, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
)
BATCH_SIZES = (1, 8, 32)
PROMPT_LEN = 64
NEW_TOKENS = 128
SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)


def make_engines(directory: pathlib.Path) -> dict:
    """``{"hf": run_hf, "embedded": run_embedded}``: each takes prompts [B, 64] int32 and
    returns new tokens [B, 128]."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def run_hf(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(prompts.astype(np.int64))
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=SAMPLING.temperature,
                              top_k=SAMPLING.top_k, top_p=SAMPLING.top_p, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, pad_token_id=BENCH_MODEL.pad_token_id)
        return out[:, PROMPT_LEN:].numpy()

    sampler = EmbeddedSampler.from_checkpoint(directory, sampler_numerics(REFERENCE_KIND), seed=0)

    def run_embedded(prompts: np.ndarray) -> np.ndarray:
        reqs = [GenerationRequest(f"r{i}", p, SAMPLING, NEW_TOKENS) for i, p in enumerate(prompts)]
        return np.stack([g.token_ids for g in sampler.generate(reqs)])

    return {"hf": run_hf, "embedded": run_embedded}


def make_sglang(directory: pathlib.Path, work: pathlib.Path):
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
        reqs = [GenerationRequest(f"r{i}", p, SAMPLING, NEW_TOKENS) for i, p in enumerate(prompts)]
        return np.stack([g.token_ids for g in sampler.generate(reqs)])

    return server, run_sglang


def timed(fn, prompts) -> float:
    start = time.perf_counter()
    out = fn(prompts)
    elapsed = time.perf_counter() - start
    assert out.shape == (prompts.shape[0], NEW_TOKENS), out.shape
    return elapsed


def time_interleaved(engines: dict, prompts: dict, repeats: int, progress: Progress, what: str):
    """``(first-call seconds, times)`` of ``engines`` at every batch size: one warm-up call each,
    then ``repeats`` rounds interleaving the engines (rotating which goes first), so machine load
    shifts them alike. ``times[b][name]`` lists the seconds of each round."""
    task = progress.add_task(f"{what}: warm-up", total=len(BATCH_SIZES) * len(engines) * (1 + repeats))
    warmup = {b: {} for b in BATCH_SIZES}
    for b in BATCH_SIZES:
        for name, fn in engines.items():
            warmup[b][f"{name}_first_call_s"] = timed(fn, prompts[b])
            progress.advance(task)
    progress.update(task, description=f"{what}: timing (interleaved)")
    times = {b: {name: [] for name in engines} for b in BATCH_SIZES}
    order = list(engines.items())
    for rep in range(repeats):
        for b in BATCH_SIZES:
            for name, fn in order[rep % len(order):] + order[: rep % len(order)]:
                times[b][name].append(timed(fn, prompts[b]))
                progress.advance(task)
    return warmup, times


def plot(rows: list[dict], path: pathlib.Path) -> None:
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
        ax.annotate(f"vs hf {r['speedup']:.1f}x / {r['best_speedup']:.1f}x", (x[i], top), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(x, [f"batch {r['batch_size']}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("new tokens / s (speedup: median / best)")
    ax.set_title(f"Sampler throughput: prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, fp32, top-k 50 / top-p 0.95")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    parser.add_argument("--no-sglang", dest="sglang", action="store_false", help="leave the SGLang server out")
    args = parser.parse_args()
    console = Console(width=140)
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(3, BENCH_MODEL.vocab_size, size=(b, PROMPT_LEN)).astype(np.int32) for b in BATCH_SIZES}

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_tiny_checkpoint(pathlib.Path(tmp) / "bench-model", BENCH_MODEL, seed=0)
        engines = make_engines(directory)
        with Progress(console=console, transient=True) as progress:
            warmup, times = time_interleaved(engines, prompts, args.repeats, progress, "transformers vs embedded")
            if args.sglang:  # a second phase: the server's processes would slow torch's threads in the first
                server, run_sglang = make_sglang(directory, pathlib.Path(tmp))
                try:
                    warm_b, times_b = time_interleaved({"embedded": engines["embedded"], "sglang": run_sglang},
                                                       prompts, args.repeats, progress, "embedded vs SGLang")
                finally:
                    server.close()
                for b in BATCH_SIZES:
                    warmup[b]["sglang_first_call_s"] = warm_b[b]["sglang_first_call_s"]
                    times[b]["sglang"] = times_b[b]["sglang"]
                    times[b]["embedded_with_server"] = times_b[b]["embedded"]

    rows = []
    for b in BATCH_SIZES:
        hf_s, emb_s = statistics.median(times[b]["hf"]), statistics.median(times[b]["embedded"])
        rows.append(dict(
            batch_size=b, hf_s=hf_s, embedded_s=emb_s,
            hf_tokens_per_s=b * NEW_TOKENS / hf_s, embedded_tokens_per_s=b * NEW_TOKENS / emb_s,
            speedup=hf_s / emb_s, best_speedup=min(times[b]["hf"]) / min(times[b]["embedded"]),
            hf_best_tokens_per_s=b * NEW_TOKENS / min(times[b]["hf"]),
            embedded_best_tokens_per_s=b * NEW_TOKENS / min(times[b]["embedded"]),
            hf_all_s=times[b]["hf"], embedded_all_s=times[b]["embedded"], **warmup[b],
        ))
        if "sglang" in times[b]:  # ratios within the second phase (both timed with the server up)
            sg, peer = times[b]["sglang"], times[b]["embedded_with_server"]
            rows[-1].update(sglang_s=statistics.median(sg), sglang_tokens_per_s=b * NEW_TOKENS / statistics.median(sg),
                            sglang_best_tokens_per_s=b * NEW_TOKENS / min(sg), sglang_all_s=sg,
                            embedded_with_server_all_s=peer,
                            embedded_vs_sglang=statistics.median(sg) / statistics.median(peer),
                            embedded_vs_sglang_best=min(sg) / min(peer))

    table = Table(title=f"Sampler throughput (new tokens/s; median and best of {args.repeats})")
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

    import jax
    import torch
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), machine=platform.machine(), cores=os.cpu_count(),
                repeats=args.repeats, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, sampling=SAMPLING.model_dump(),
                model=BENCH_MODEL.model_dump(), parameters=BENCH_MODEL.parameter_count(), jax=jax.__version__,
                torch=torch.__version__, transformers=transformers.__version__,
                load_average_1_5_15min=dict(before=load_before, after=os.getloadavg()))
    (args.out / "sampler_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "sampler_throughput.png")
    console.print(f"wrote {args.out / 'sampler_throughput.json'} and {args.out / 'sampler_throughput.png'}")


if __name__ == "__main__":
    main()
