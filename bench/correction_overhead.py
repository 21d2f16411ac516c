"""Cost of the off-policy correction: the ``hetrl`` preset loss against a plain token log-prob loss.

Forward+backward time of both, in jax (jit) and torch (eager autograd), at a few [B, L, V, K]
sizes. Both losses start from the same logits [B, L, V] and apply the sampling temperature; the plain one
is ``-A · log_softmax(z/T)[a]`` token-mean, the corrected one is
``hetrl.core.correction.policy_loss`` with ``PRESETS["hetrl"]`` (replay over a kept support of K
ids, token + geometric MIS, score centering) plus its per-token statistics. The two are timed
interleaved (alternating which goes first), and compared by the median of the per-pair ratios,
so machine load shifts both alike.

    .venv/bin/python bench/correction_overhead.py [--repeats 15] [--out bench/results] [--quick]

Writes ``correction_overhead.json`` and ``correction_overhead.png`` to ``--out``. ``--quick``:
one size (2 x 64 x 1024, K 16), 3 repeats.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from hetrl.bench_command import output_dir, script_parser  # noqa: E402
from hetrl.core.correction import PRESETS, LossInputs, policy_loss  # noqa: E402

SIZES = [  # (B, L, V, K)
    (4, 256, 8192, 64),
    (4, 256, 32768, 16),
    (4, 256, 32768, 64),
    (2, 256, 65536, 64),
    (1, 256, 151936, 64),  # Qwen3 vocabulary
]
QUICK_SIZES = [(2, 64, 1024, 16)]


def make_arrays(B: int, L: int, V: int, K: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random logits and a kept support of K ids per position that contains the sampled token."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, L, V)).astype(np.float32)
    support = np.stack([rng.choice(V, size=K, replace=False) for _ in range(B * L)]).reshape(B, L, K).astype(np.int32)
    targets = support[..., 0].copy()
    q = rng.normal(size=(B, L, K)).astype(np.float32)
    q = q - np.log(np.exp(q).sum(-1, keepdims=True))
    return dict(
        logits=logits, target_ids=targets, loss_mask=rng.random((B, L)) < 0.9, sampler_logprobs=q[..., 0],
        support_ids=support, support_mask=np.ones((B, L, K), dtype=bool), support_logprobs=q,
        support_kept=np.ones(B, dtype=bool), advantages=rng.normal(size=B).astype(np.float32),
        temperature=np.full(B, 0.8, dtype=np.float32),
    )


def torch_fns(arrays):
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    t = {k: torch.as_tensor(v) for k, v in arrays.items()}
    inputs = LossInputs(**{k: t[k] for k in t if k != "logits"}, logits=None)
    mask = t["loss_mask"].to(torch.float32)

    def plain():
        logits = t["logits"].clone().requires_grad_(True)
        lp = torch.log_softmax(logits / t["temperature"][:, None, None], dim=-1)
        lp_a = lp.gather(-1, t["target_ids"][..., None].long())[..., 0]
        loss = -(t["advantages"][:, None] * lp_a * mask).sum() / mask.sum()
        loss.backward()
        return logits.grad

    def hetrl():
        logits = t["logits"].clone().requires_grad_(True)
        loss, _ = policy_loss(LossInputs(**{**inputs.__dict__, "logits": logits}), PRESETS["hetrl"])
        loss.backward()
        return logits.grad

    return plain, hetrl


def jax_fns(arrays):
    import jax
    import jax.numpy as jnp

    # every array is a jit argument: closed-over constants would let XLA fold the masks away
    j = {k: jnp.asarray(v) for k, v in arrays.items()}

    def plain_loss(logits, j):
        mask = j["loss_mask"].astype(jnp.float32)
        lp = jax.nn.log_softmax(logits / j["temperature"][:, None, None], axis=-1)
        lp_a = jnp.take_along_axis(lp, j["target_ids"][..., None], axis=-1)[..., 0]
        return -(j["advantages"][:, None] * lp_a * mask).sum() / mask.sum()

    def hetrl_loss(logits, j):
        return policy_loss(LossInputs(logits=logits, **{k: v for k, v in j.items() if k != "logits"}), PRESETS["hetrl"])[0]

    plain_grad = jax.jit(jax.grad(plain_loss))
    hetrl_grad = jax.jit(jax.grad(hetrl_loss))
    return (lambda: plain_grad(j["logits"], j).block_until_ready()), (lambda: hetrl_grad(j["logits"], j).block_until_ready())


def time_pair(plain, hetrl, repeats: int) -> tuple[float, float, float]:
    """Medians of each and the median of the per-pair ratios hetrl/plain (robust to drift)."""
    plain(), hetrl(), plain(), hetrl()  # warm-up and compilation
    tp, th = [], []
    for i in range(repeats):
        order = ((plain, tp), (hetrl, th)) if i % 2 == 0 else ((hetrl, th), (plain, tp))
        for fn, out in order:
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(tp), statistics.median(th), statistics.median(h / p for h, p in zip(th, tp))


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs (default 15, with --quick 3)")
    parser.add_argument("--sizes", type=str, default=None, help="e.g. '4x256x32768x64,2x128x8192x16'")
    args = parser.parse_args(argv)
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: expected comma-separated BxLxVxK, e.g. 4x256x32768x64")
    if sizes and any(len(s) != 4 for s in sizes):
        parser.error(f"--sizes {args.sizes!r}: every size needs four numbers BxLxVxK")
    sizes = sizes or (QUICK_SIZES if args.quick else SIZES)
    repeats = args.repeats or (3 if args.quick else 15)
    out = output_dir(args, __file__)

    rows = []
    with Progress() as progress:
        task = progress.add_task("correction overhead", total=len(sizes) * 2)
        for size in sizes:
            arrays = make_arrays(*size)
            for backend, make in (("jax", jax_fns), ("torch", torch_fns)):
                progress.update(task, description=f"{backend} B,L,V,K={size}")
                plain_s, hetrl_s, ratio = time_pair(*make(arrays), repeats)
                rows.append(dict(backend=backend, B=size[0], L=size[1], V=size[2], K=size[3],
                                 plain_ms=plain_s * 1e3, hetrl_ms=hetrl_s * 1e3, overhead=ratio - 1))
                progress.advance(task)

    table = Table(title="hetrl preset loss vs plain token log-prob loss, forward+backward")
    for col in ("backend", "B", "L", "V", "K", "plain ms", "hetrl ms", "overhead"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["backend"], *(str(r[k]) for k in "BLVK"), f"{r['plain_ms']:.1f}", f"{r['hetrl_ms']:.1f}",
                      f"{100 * r['overhead']:+.1f}%")
    Console().print(table)

    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
                cores=os.cpu_count(), repeats=repeats, quick=args.quick)
    (out / "correction_overhead.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("| backend | B | L | V | K | plain ms | hetrl ms | overhead |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['B']} | {r['L']} | {r['V']} | {r['K']} | {r['plain_ms']:.1f} | "
              f"{r['hetrl_ms']:.1f} | {100 * r['overhead']:+.1f}% |")
    plot(rows, out / "correction_overhead.png")
    print(f"wrote {out / 'correction_overhead.json'} and {out / 'correction_overhead.png'}")


def plot(rows, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({f"V={r['V']}\nK={r['K']}" for r in rows}, key=lambda s: [int(x.split("=")[1]) for x in s.split("\n")])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for i, backend in enumerate(("jax", "torch")):
        by_label = {f"V={r['V']}\nK={r['K']}": 100 * r["overhead"] for r in rows if r["backend"] == backend}
        ax.bar([x + (i - 0.5) * width for x in range(len(labels))], [by_label.get(lbl, 0) for lbl in labels], width, label=backend)
    ax.axhline(10, color="red", linestyle="--", linewidth=1, label="10% target")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("forward+backward overhead vs plain loss (%)")
    ax.set_title("hetrl preset loss overhead")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
