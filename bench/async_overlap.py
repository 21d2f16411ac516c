"""Wall time of the fully asynchronous loop against a synchronous generate-then-train loop.

Both arms are the real orchestrator (:class:`hetrl.orchestrator.local.LocalOrchestrator`) on the
same config (default ``tiny_mixed.yaml``: six embedded pools, the JAX trainer, multi-turn coding
episodes), with the same seed, number of steps and batch (``batch_groups x group_size`` rollouts
per step), so both train the same number of rollouts:

* **async**: the config as it is (``async.max_staleness`` = 2 in tiny_mixed): sampling goes on
  while the trainer steps, up to ``(max_staleness + 1) x batch_groups`` groups outstanding;
* **sync**: ``async.max_staleness = 0``: at most one batch is outstanding and a trained batch
  stops counting only once its step is published, so the fleet samples a batch, waits while the
  trainer steps on it and publishes, then samples the next on the new weights.

Held-out evaluation is off and checkpoints are written only at the end. The headline figure is
the total ``run()`` wall time (set-up, N steps, final checkpoint, plots): the same N steps and
N x batch rollouts trained in both arms. Also reported: the window **steps 2..N** (wall clock at
the end of step N minus at the end of step 1, from the run's metrics), which leaves out set-up
and the first step, which pays the jit compiles of a fresh trainer (and during which the async
arm already samples ahead). One untimed 2-step warm-up run per arm fills the JAX persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR`` where set, as under the test suite, else a
directory under ``--work``) so that timed runs reuse compiled programs.
Arms run interleaved (alternating which goes first in each repeat) so machine load shifts both
alike. Ratio = sync / async wall time per repeat (> 1: async is faster), summarized by the median
over repeats.

    .venv/bin/python bench/async_overlap.py [--steps 8] [--repeats 3] [--config tiny_mixed.yaml] [--out bench/results]
                                            [--quick]

Writes ``async_overlap.json`` and ``async_overlap.png`` to ``--out``. ``--quick``: 2 steps, 1
repeat, no warm-up runs, one of the six pools, batches of 2 groups x 2 rollouts of at most 16 new
tokens, ``--work`` under the output directory (``async_overlap-work/``).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hetrl.bench_command import output_dir, script_parser
from hetrl.config import load_config
from hetrl.models.resolve import resolve_model
from hetrl.orchestrator.local import LocalOrchestrator

ARMS = {"async": [], "sync": ["async.max_staleness=0"]}
QUICK_OVERRIDES = [
    "async.batch_groups=2", "async.group_size=2", "async.max_new_tokens=16",
    "fleet.pools=[{name: a100-bf16, accelerator: a100, weight_precision: bf16, kv_precision: bf16}]",
]


def run_arm(config: str, arm: str, steps: int, rep: int, work: pathlib.Path, model_dir: pathlib.Path,
            overrides: list[str]) -> dict:
    """One run of ``arm``; its figures from the run's history and summary."""
    out = work / f"{arm}-{rep}"
    cfg = load_config(config, [
        f"output_dir={out}", "checkpointing.every=0",
        f"steps={steps}", f"model={{path: {model_dir}}}",
        "environment.options={eval: {every: 0}}", *overrides, *ARMS[arm],
    ])
    start = time.perf_counter()
    result = LocalOrchestrator(cfg, console=False).run()
    total = time.perf_counter() - start
    h = result.history
    last = h[-1]
    return dict(
        arm=arm, repeat=rep, steps=steps, max_staleness=cfg.async_.max_staleness,
        window_s=last["time/wall_s"] - h[0]["time/wall_s"], total_s=total,
        trained_groups=len(result.trained),
        generated_rollouts=int(last["rollout/rollouts_valid"]), groups_dropped=int(result.final["groups_dropped"]),
        staleness_mean=statistics.mean(r["staleness/mean"] for r in h),
        wait_s_mean=statistics.mean(r["time/wait_s"] for r in h[1:]),
        step_s_mean=statistics.mean(r["time/step_s"] for r in h[1:]),
    )


def plot(runs: list[dict], ratios: list[float], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(8.0, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    reps = sorted({r["repeat"] for r in runs})
    for arm, dx in (("async", -0.2), ("sync", 0.2)):
        for part, key, alpha in (("total run()", "total_s", 0.35), ("steps 2..N", "window_s", 1.0)):
            ys = [next(r[key] for r in runs if r["arm"] == arm and r["repeat"] == rep) for rep in reps]
            ax.bar([x + dx for x in reps], ys, 0.4, alpha=alpha, color="C0" if arm == "async" else "C1",
                   label=f"{arm}: {part}")
    ax.set_xticks(reps, [f"repeat {r}" for r in reps])
    ax.set_ylabel("wall time (s)")
    ax.set_ylim(top=1.45 * max(r["total_s"] for r in runs))  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    ax.set_title(title, fontsize=8)
    bx.bar(reps, ratios, 0.6, color="C2")
    bx.axhline(1.0, color="black", linewidth=0.8)
    bx.set_xticks(reps, [str(r) for r in reps])
    bx.set_xlabel("repeat")
    bx.set_ylabel("sync / async, total run()")
    bx.set_title(f"median {statistics.median(ratios):.2f}x", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--config", default="tiny_mixed.yaml")
    parser.add_argument("--steps", type=int, default=None, help="default 8 (with --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (with --quick 1)")
    parser.add_argument("--work", type=pathlib.Path, default=None,
                        help="run outputs, the shared model checkpoint and the compilation cache "
                             "(default runs/bench_async_overlap, with --quick async_overlap-work/ in the output directory)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 3)
    out = output_dir(args, __file__)
    args.work = args.work or (out / "async_overlap-work" if args.quick else pathlib.Path("runs/bench_async_overlap"))
    overrides = QUICK_OVERRIDES if args.quick else []
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (the timed window is steps 2..N) and --repeats >= 1")
    console = Console(width=140)

    import jax

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str((args.work / "jax-cache").resolve())
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    base = load_config(args.config, overrides)
    model_dir = resolve_model(base.model, args.work / "model").resolve()  # built once, shared by every run

    runs: list[dict] = []
    with Progress(console=console) as progress:
        warmups = [] if args.quick else list(ARMS)
        task = progress.add_task("async vs sync runs (interleaved)", total=2 * args.repeats + len(warmups))
        for arm in warmups:  # warm-up: fill the compilation caches, not timed
            progress.update(task, description=f"warm-up: {arm}")
            run_arm(args.config, arm, 2, -1, args.work, model_dir, overrides)
            progress.advance(task)
        for rep in range(args.repeats):
            for arm in (("async", "sync") if rep % 2 == 0 else ("sync", "async")):
                progress.update(task, description=f"repeat {rep + 1}/{args.repeats}: {arm}")
                runs.append(run_arm(args.config, arm, args.steps, rep, args.work, model_dir, overrides))
                progress.advance(task)

    def pick(arm: str, rep: int) -> dict:
        return next(r for r in runs if r["arm"] == arm and r["repeat"] == rep)

    ratios = [pick("sync", rep)["window_s"] / pick("async", rep)["window_s"] for rep in range(args.repeats)]
    total_ratios = [pick("sync", rep)["total_s"] / pick("async", rep)["total_s"] for rep in range(args.repeats)]
    table = Table(title=f"{args.config}: {args.steps} steps, sync / async wall time")
    for col in ("repeat", "async s (2..N)", "sync s (2..N)", "ratio", "async total s", "sync total s", "ratio total",
                "async wait s/step", "sync wait s/step", "async staleness", "async generated", "sync generated"):
        table.add_column(col, justify="right")
    for rep in range(args.repeats):
        a, s = pick("async", rep), pick("sync", rep)
        table.add_row(str(rep), f"{a['window_s']:.1f}", f"{s['window_s']:.1f}", f"{ratios[rep]:.2f}x",
                      f"{a['total_s']:.1f}", f"{s['total_s']:.1f}", f"{total_ratios[rep]:.2f}x",
                      f"{a['wait_s_mean']:.2f}", f"{s['wait_s_mean']:.2f}", f"{a['staleness_mean']:.2f}",
                      str(a["generated_rollouts"]), str(s["generated_rollouts"]))
    console.print(table)
    console.print(f"median ratio sync/async: total {statistics.median(total_ratios):.2f}x, "
                  f"steps 2..N {statistics.median(ratios):.2f}x")

    meta = dict(date=datetime.date.today().isoformat(), machine=platform.machine(), cores=os.cpu_count(),
                quick=args.quick, config=args.config, steps=args.steps, repeats=args.repeats, jax=jax.__version__,
                batch_groups=base.async_.batch_groups, group_size=base.async_.group_size,
                pools=[p.name for p in base.fleet.pools], async_max_staleness=base.async_.max_staleness)
    summary = dict(ratio_window=ratios, ratio_total=total_ratios, median_ratio_window=statistics.median(ratios),
                   median_ratio_total=statistics.median(total_ratios))
    (out / "async_overlap.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    plot(runs, total_ratios, out / "async_overlap.png",
         f"{args.config}, {args.steps} steps x {base.async_.batch_groups * base.async_.group_size} rollouts")
    console.print(f"wrote {out / 'async_overlap.json'} and {out / 'async_overlap.png'}")


if __name__ == "__main__":
    main()
