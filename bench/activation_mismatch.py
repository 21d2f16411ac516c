"""Sampler–trainer mismatch per number format, weight-only vs weight + activation quantization, on the warm start.

For every low-precision format a pool can serve, two pools that differ only in the activation
format: weight-only (activations in bf16, as the emulation did before activation quantization) and
weight + activation as serving engines run it (FP8 W8A8 with per-token dynamic scales, DeepSeek
128 x 128 FP8 with 1 x 128 activation groups, INT8 W8A8 per token, NVFP4 W4A4, MXFP4 W4A4), plus
the bf16 pool. Each samples untruncated responses (temperature 1, up to ``--tokens`` tokens) to the
warm start's held-out prompts with the embedded engine; the float32 forward recomputes them
(:func:`hetrl.samplers.probe.probe_mismatch`). Reported per pool: per-token |Δ log p| (mean, max)
and k3 (≈ KL(q‖p) per token), pooled over ``--seeds`` seeds (common random numbers: the same seeds
in every pool), and each seed's k3 for the spread.

    .venv/bin/python bench/activation_mismatch.py [--prompts 32] [--tokens 64] [--seeds 3] [--out bench/results] [--quick]

Writes ``activation_mismatch.json`` and ``activation_mismatch.png`` to ``--out``. ``--quick``: the
h100 bf16 and FP8 pools only, 4 prompts x 8 tokens, one seed.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from hetrl.bench_command import output_dir, script_parser
from hetrl.samplers.probe import probe_mismatch, warmstart_prompts
from hetrl.samplers.profiles import sampler_numerics

CHECKPOINT = next((pathlib.Path(__file__).resolve().parents[1] / "assets" / "models").glob("warmstart-*"))

POOLS = [  # (label, kind, weight format, activation format: None = what engines serve)
    ("bf16", "b200", "bf16", None),
    ("fp8 W8", "h100", "fp8_e4m3", "none"),
    ("fp8 W8A8", "h100", "fp8_e4m3", None),
    ("fp8 block W8", "h100", "fp8_e4m3_block", "none"),
    ("fp8 block W8A8 (1x128)", "h100", "fp8_e4m3_block", None),
    ("fp8 fnuz W8", "mi300x", "fp8_e4m3fnuz", "none"),
    ("fp8 fnuz W8A8", "mi300x", "fp8_e4m3fnuz", None),
    ("int8 W8", "a100", "int8", "none"),
    ("int8 W8A8", "a100", "int8", None),
    ("nvfp4 W4", "b200", "nvfp4", "none"),
    ("nvfp4 W4A4", "b200", "nvfp4", None),
    ("mxfp4 W4", "b200", "mxfp4", "none"),
    ("mxfp4 W4A4", "b200", "mxfp4", "mxfp4"),
]
QUICK_POOLS = [("bf16", "h100", "bf16", None), POOLS[1], POOLS[2]]  # one kind: two compiled engines


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 32, with --quick 4)")
    parser.add_argument("--tokens", type=int, default=None, help="max new tokens (default 64, with --quick 8)")
    parser.add_argument("--seeds", type=int, default=None, help="sampling seeds (default 3, with --quick 1)")
    args = parser.parse_args(argv)
    n_prompts = args.prompts or (4 if args.quick else 32)
    n_tokens = args.tokens or (8 if args.quick else 64)
    seeds = range(args.seeds or (1 if args.quick else 3))
    for name, value in (("--prompts", n_prompts), ("--tokens", n_tokens), ("--seeds", len(seeds))):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    out = output_dir(args, __file__)
    prompts = warmstart_prompts(CHECKPOINT, n_prompts)

    rows = []
    for label, kind, weight, activation in QUICK_POOLS if args.quick else POOLS:
        numerics = sampler_numerics(kind, weight, "bf16", activation)
        start = time.perf_counter()
        per_seed = [probe_mismatch(CHECKPOINT, numerics, prompts, max_new_tokens=n_tokens, seed=s,
                                   max_batch=min(16, n_prompts)) for s in seeds]
        tokens = sum(r["tokens"] for r in per_seed)
        rows.append(dict(
            pool=label, kind=kind, weight=weight, activation=numerics.activation_format, kv="bf16", tokens=tokens,
            abs_dlogp_mean=sum(r["abs_dlogp_mean"] * r["tokens"] for r in per_seed) / tokens,
            abs_dlogp_max=max(r["abs_dlogp_max"] for r in per_seed),
            k3=sum(r["k3"] * r["tokens"] for r in per_seed) / tokens,
            k3_per_seed=[r["k3"] for r in per_seed], seconds=time.perf_counter() - start,
        ))
        print(f"{label}: k3 {rows[-1]['k3']:.2e} ({rows[-1]['seconds']:.0f} s)", flush=True)

    table = Table(title=f"mismatch vs float32 on {CHECKPOINT.name}: {n_prompts} prompts x <= {n_tokens} tokens x "
                        f"{len(seeds)} seeds")
    for col in ("pool", "kind", "activation", "tokens", "mean |Δlog p|", "max |Δlog p|", "k3", "k3 per seed"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["pool"], r["kind"], r["activation"], str(r["tokens"]), f"{r['abs_dlogp_mean']:.2e}",
                      f"{r['abs_dlogp_max']:.2e}", f"{r['k3']:.2e}", " ".join(f"{k:.1e}" for k in r["k3_per_seed"]))
    Console().print(table)
    print("| pool | kind | activations | tokens | mean \\|Δlog p\\| | max \\|Δlog p\\| | k3 | k3 per seed |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pool']} | {r['kind']} | {r['activation']} | {r['tokens']} | {r['abs_dlogp_mean']:.2e} | "
              f"{r['abs_dlogp_max']:.2e} | {r['k3']:.2e} | {', '.join(f'{k:.1e}' for k in r['k3_per_seed'])} |")

    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
                cores=os.cpu_count(), checkpoint=CHECKPOINT.name, prompts=n_prompts, max_new_tokens=n_tokens,
                seeds=len(seeds), quick=args.quick)
    (out / "activation_mismatch.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, out / "activation_mismatch.png")
    print(f"wrote {out / 'activation_mismatch.json'} and {out / 'activation_mismatch.png'}")


def plot(rows, path: pathlib.Path) -> None:
    """k3 per pool on a log axis, weight-only and weight + activation side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    colours = ["tab:grey" if r["weight"] == "bf16" else "tab:blue" if r["activation"] == "none" else "tab:red"
               for r in rows]
    ax.bar(range(len(rows)), [max(r["k3"], 1e-12) for r in rows], color=colours)
    for i, r in enumerate(rows):
        ax.plot([i] * len(r["k3_per_seed"]), [max(k, 1e-12) for k in r["k3_per_seed"]], "k.", markersize=4)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["pool"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("k3 vs float32 (per token)")
    ax.set_title("sampler–trainer mismatch: blue weight-only, red weight + activation (dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
