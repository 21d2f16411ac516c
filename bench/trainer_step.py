"""Training step of the JAX trainer against the Megatron trainer, with each one's MFU against the measured matmul peak.

Throughput and model-FLOPs utilization (MFU) against this machine's matmul peak measured in the
same run. One step = forward + backward + AdamW update (global-norm clipping at 1.0) with the ``hetrl``
correction preset (mask replay over a kept support of 8 ids, token + geometric MIS, score
centering), on the same model and the same batch: a Qwen3 layout with hidden 512, 4 layers,
8 query / 4 KV heads of dim 64, intermediate 1536, vocabulary 8192, untied (21.0M parameters,
16.8M of them in matmuls), random weights; 8 rows x 256 positions (prompt 32 + response 224
tokens, all trainable, :func:`hetrl.parity.random_batch`). Both trainers take all rows in one micro-batch, in fp32
(``compute_dtype=fp32`` for both trainers) and in bf16 (JaxTrainer: BF16
matmul inputs over FP32 master weights; MegatronTrainer: ``Float16Module`` BF16 weights and
activations, FP32 master weights in the mixed-precision optimizer).

Model FLOPs of one step (the PaLM convention; recomputation and padding waste not discounted):

    F = 6 · N_mm · T  +  12 · n_layers · n_heads · head_dim · S · T

with T = B · S tokens (B rows, S positions), N_mm = the parameters of every matmul a token goes
through (per layer q/k/v/o and gate/up/down projections, plus the LM head V · H; the input
embedding is a lookup and norms are elementwise, so neither counts): 6 = 2 (multiply-add) x 3
(forward, and backward for activations and weights). The second term is attention's score and
value matmuls, 2 · 2 · S · n_heads · head_dim per token and layer forward, x 3 with the backward,
counted over the full S x S square. MFU = F / step time / peak, where peak (per dtype) is the
best of ``jax.numpy.matmul`` and ``torch.matmul`` on an ``n x n`` by ``n x n`` product
(2 n³ FLOPs, n = 2048) in that dtype, median over repeats; fp32 steps are set against the fp32
peak, bf16 steps against the bf16 peak.

Timing: after two warm-up calls each (compilation), every repeat runs one step of each trainer
and one matmul of each library, in an order reversed every other repeat, so machine load shifts
steps and peak alike; the figures are medians, tokens/s = T / median step time, and the speed
ratio against Megatron is the median over repeats of (Megatron step time / step time) in the same
repeat. On a shared machine torch's OpenMP threads stall now and then (a step can take several
times the usual), so the best repeat is reported too, with an MFU of best step against best
matmul.

    .venv/bin/python bench/trainer_step.py [--repeats 7] [--dtypes fp32,bf16] [--out bench/results] [--quick]

Writes ``trainer_step.json`` (with the load averages before and after) and ``trainer_step.png``
to ``--out``. ``--quick``: a 0.1M-parameter model (hidden 64, 1 layer), 2 rows x 32 positions,
a 256 x 256 matmul peak, 2 repeats, both dtypes.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hetrl.models import ModelConfig
from hetrl.models.tiny import build_tiny_checkpoint
from hetrl.bench_command import output_dir, script_parser
from hetrl.parity import random_batch


@dataclass(frozen=True)
class Size:
    """What one run measures: the model, the batch (``rows`` x prompt + response tokens) and the
    side of the square matmul that measures the peak."""

    model: ModelConfig
    rows: int
    prompt_len: int
    response_len: int
    peak_n: int


BENCH_MODEL = ModelConfig(
    model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
    rope_theta=10_000.0, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
)
FULL = Size(BENCH_MODEL, rows=8, prompt_len=32, response_len=224, peak_n=2048)  # S = 255 positions, padded to 256
QUICK = Size(BENCH_MODEL.model_copy(update=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
             rows=2, prompt_len=8, response_len=24, peak_n=256)
OPTIMIZER = dict(learning_rate=1e-5, grad_clip=1.0)


def matmul_parameters(config: ModelConfig) -> int:
    """N_mm of the module docstring: parameters of the per-layer projections and the LM head."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return config.num_hidden_layers * (H * q + 2 * H * kv + q * H + 3 * H * I) + V * H


def step_flops(config: ModelConfig, rows: int, positions: int) -> float:
    """F of the module docstring for a batch of ``rows`` x ``positions``."""
    tokens = rows * positions
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * positions * tokens
    return 6.0 * matmul_parameters(config) * tokens + attention


# ====================================================================== timed work
def matmul_fns(dtype: str, n: int, torch_device: str = "cpu") -> dict[str, Callable[[], object]]:
    """``{"jax matmul": fn, "torch matmul": fn}``: one n x n by n x n product each (2 n³ FLOPs),
    JAX on its default device, torch on ``torch_device``; each fn returns once the product is done
    (on CUDA, torch's asynchronous launch is followed by a synchronize)."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(n, n)).astype(np.float32) for _ in range(2))
    jdt, tdt = {"fp32": (jnp.float32, torch.float32), "bf16": (jnp.bfloat16, torch.bfloat16)}[dtype]
    ja, jb, jmm = jnp.asarray(a, jdt), jnp.asarray(b, jdt), jax.jit(jnp.matmul)
    ta, tb = (torch.from_numpy(x).to(device=torch_device, dtype=tdt) for x in (a, b))
    sync = torch.cuda.synchronize if torch.device(torch_device).type == "cuda" else (lambda: None)
    return {"jax matmul": lambda: jmm(ja, jb).block_until_ready(), "torch matmul": lambda: (torch.matmul(ta, tb), sync())}


def build_trainers(checkpoint: pathlib.Path, dtype: str) -> dict[str, object]:
    """``{"jax": JaxTrainer, "megatron": MegatronTrainer}`` built on ``checkpoint`` in ``dtype``
    (the configurations of the module docstring)."""
    from hetrl.trainer_jax import JaxTrainer, JaxTrainerConfig, MeshConfig
    from hetrl.trainer_megatron import MegatronTrainer, MegatronTrainerConfig

    jax_config = JaxTrainerConfig(compute_dtype=dtype, mesh=MeshConfig(data=1, fsdp=1, tensor=1), optimizer=OPTIMIZER)
    megatron_config = MegatronTrainerConfig(compute_dtype=dtype, optimizer=OPTIMIZER)
    return {"jax": JaxTrainer.from_hf(checkpoint, jax_config), "megatron": MegatronTrainer.from_hf(checkpoint, megatron_config)}


def step_fns(trainers: dict[str, object], batch) -> dict[str, Callable[[], object]]:
    """``{name: fn}``: one ``train_step`` on ``batch`` of each trainer (its metrics are host
    floats, so the call returns once the step is done)."""
    return {name: (lambda trainer=trainer: trainer.train_step(batch)) for name, trainer in trainers.items()}


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, progress, task) -> dict[str, list[float]]:
    """Seconds per call of every fn: two warm-up calls each (compilation), then ``repeats``
    rounds calling each once, in an order reversed every other round, so load drifts hit all alike."""
    for fn in fns.values():
        fn(), fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
        progress.advance(task)
    return times


# ====================================================================== output
def plot(rows: list[dict], peaks: dict, size: Size, positions: int, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows}, key=["fp32", "bf16"].index)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for i, trainer in enumerate(("jax", "megatron")):
        by = {r["dtype"]: r for r in rows if r["trainer"] == trainer}
        xs = [x + (i - 0.5) * width for x in range(len(dtypes))]
        left.bar(xs, [by[d]["tokens_per_s"] for d in dtypes], width, label=trainer)
        right.bar(xs, [100 * by[d]["mfu"] for d in dtypes], width, label=trainer)
    left.set_xticks(range(len(dtypes)), dtypes)
    left.set_ylabel("tokens / s (median step)")
    left.set_title("training step throughput")
    right.set_xticks(range(len(dtypes)), [f"{d}\npeak {peaks[d]['machine'] / 1e9:.0f} GFLOP/s" for d in dtypes])
    right.set_ylabel("MFU (%) vs measured matmul peak")
    right.set_title("model-FLOPs utilization")
    for ax in (left, right):
        ax.legend()
    fig.suptitle(f"JAX vs Megatron trainer step, {size.rows}x{positions} tokens, "
                 f"{size.model.parameter_count() / 1e6:.1f}M params")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, with --quick 2)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - {"fp32", "bf16"})
    if unknown:
        parser.error(f"--dtypes: unknown dtype(s) {unknown}; choose from fp32, bf16")
    size = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 7)
    out = output_dir(args, __file__)

    load_before = os.getloadavg()
    batch = random_batch(size.model, seed=0, rows=size.rows, prompt_lengths=(size.prompt_len, size.prompt_len),
                         response_lengths=(size.response_len, size.response_len))
    positions = int(batch.input_ids.shape[1])
    tokens = size.rows * positions
    flops = step_flops(size.model, size.rows, positions)
    n = size.peak_n
    rows, raw, peaks = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp, Progress() as progress:
        checkpoint = build_tiny_checkpoint(pathlib.Path(tmp) / "bench", size.model, seed=0, init_std=0.02)
        task = progress.add_task("building", total=len(dtypes) * repeats)
        for dtype in dtypes:
            progress.update(task, description=f"{dtype}: building + warm-up")
            fns = step_fns(build_trainers(checkpoint, dtype), batch) | matmul_fns(dtype, n)
            progress.update(task, description=f"{dtype}: interleaved steps and matmuls")
            times = raw[dtype] = time_interleaved(fns, repeats, progress, task)
            peaks[dtype] = {lib: 2.0 * n**3 / statistics.median(times[f"{lib} matmul"]) for lib in ("jax", "torch")}
            peaks[dtype]["machine"] = max(peaks[dtype]["jax"], peaks[dtype]["torch"])
            peaks[dtype]["machine_best"] = max(2.0 * n**3 / min(times[f"{lib} matmul"]) for lib in ("jax", "torch"))
            for name in ("jax", "megatron"):
                median, best = statistics.median(times[name]), min(times[name])
                speed = statistics.median(m / t for t, m in zip(times[name], times["megatron"]))
                rows.append(dict(trainer=name, dtype=dtype, step_s=median, best_s=best, tokens_per_s=tokens / median,
                                 best_tokens_per_s=tokens / best, speed_vs_megatron=speed, achieved_flops=flops / median,
                                 mfu=flops / median / peaks[dtype]["machine"],
                                 mfu_best=flops / best / peaks[dtype]["machine_best"]))
            del fns

    console = Console()
    table = Table(title=f"training step, {size.rows}x{positions} tokens, model FLOPs {flops / 1e9:.1f} GFLOP/step")
    for col in ("trainer", "dtype", "step s (median / best)", "tokens/s (median / best)", "speed vs megatron", "GFLOP/s",
                "MFU (median / best)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["trainer"], r["dtype"], f"{r['step_s']:.2f} / {r['best_s']:.2f}",
                      f"{r['tokens_per_s']:.0f} / {r['best_tokens_per_s']:.0f}", f"{r['speed_vs_megatron']:.2f}x",
                      f"{r['achieved_flops'] / 1e9:.1f}", f"{100 * r['mfu']:.1f}% / {100 * r['mfu_best']:.1f}%")
    console.print(table)
    peak_table = Table(title=f"matmul peak, {n}x{n} @ {n}x{n}")
    for col in ("dtype", "jax GFLOP/s", "torch GFLOP/s", "machine peak GFLOP/s (median / best)"):
        peak_table.add_column(col, justify="right")
    for dtype, p in peaks.items():
        peak_table.add_row(dtype, f"{p['jax'] / 1e9:.1f}", f"{p['torch'] / 1e9:.1f}",
                           f"{p['machine'] / 1e9:.1f} / {p['machine_best'] / 1e9:.1f}")
    console.print(peak_table)

    meta = dict(date=datetime.date.today().isoformat(), machine=platform.machine(), cores=os.cpu_count(),
                quick=args.quick, repeats=repeats, rows=size.rows, positions=positions, tokens=tokens,
                model=size.model.model_dump(), parameters=size.model.parameter_count(),
                matmul_parameters=matmul_parameters(size.model), step_flops=flops, peak_matmul_n=n,
                load_average_1_5_15min=dict(before=load_before, after=os.getloadavg()))
    (out / "trainer_step.json").write_text(json.dumps(dict(meta=meta, peaks=peaks, rows=rows, step_times_s=raw), indent=1))
    plot(rows, peaks, size, positions, out / "trainer_step.png")
    console.print(f"wrote {out / 'trainer_step.json'} and {out / 'trainer_step.png'}")


if __name__ == "__main__":
    main()
