"""Graded episodes per second of the code sandbox, before and after the minimal view, with where the time goes.

Before: unshare namespaces; after: bubblewrap's minimal view, cgroup tree limits, seccomp.

Grades the reference answer of every real-code function task and repository task
(``hetrl.envs.tasks_realcode``) with :class:`hetrl.envs.coding.CodingEnv` under each isolation
variant, one episode at a time: ``before`` (``backend="unshare"``, no cgroup, no seccomp: the
isolation the sandbox had until bubblewrap), each new mechanism added to it alone, bubblewrap
alone, and ``after`` (the default). An empty program (``pass``) gives each variant's fixed cost.
Variants are timed interleaved (the order rotates every repeat) and compared by the median of the
per-repeat ratios to ``before``, so machine load shifts all alike. Every graded episode must score
1.0 (a broken sandbox that fails fast would look fast).

    .venv/bin/python bench/sandbox_throughput.py [--repeats 5] [--out bench/results] [--quick]

Writes ``sandbox_throughput.json`` and ``sandbox_throughput.png`` to ``--out``. ``--quick``: one
task of each kind, one repeat.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

from rich.console import Console
from rich.table import Table

from hetrl.bench_command import output_dir, script_parser
from hetrl.envs import tasks_realcode
from hetrl.envs.coding import CodingEnv, CodingEnvConfig
from hetrl.envs.sandbox import Sandbox, SandboxError

#: name -> Sandbox keyword arguments; "before" first, "after" last.
VARIANTS = {
    "before": dict(backend="unshare", cgroup=False, seccomp=False),
    "unshare+cgroup": dict(backend="unshare", cgroup=True, seccomp=False),
    "unshare+seccomp": dict(backend="unshare", cgroup=False, seccomp=True),
    "bubblewrap": dict(backend="bubblewrap", cgroup=False, seccomp=False),
    "after": dict(),
}


def make_envs(console: Console) -> dict[str, CodingEnv]:
    """One CodingEnv per variant that works here (a missing backend is reported and skipped)."""
    config = CodingEnvConfig()
    envs = {}
    for name, kwargs in VARIANTS.items():
        try:
            envs[name] = CodingEnv(config, sandbox=Sandbox(config.limits, **kwargs))
            console.print(f"{name:>16}: {envs[name].sandbox.isolation.describe()}")
        except SandboxError as exc:
            console.print(f"{name:>16}: unavailable here ({exc})")
    return envs


def time_episode(env: CodingEnv, kind: str, task) -> float:
    start = time.perf_counter()
    if kind == "empty":
        res = env.sandbox.run("pass")
        ok = res.ok
    else:
        ok = env.grade(task, task.reference).scored_fraction == 1.0
    elapsed = time.perf_counter() - start
    if not ok:
        raise RuntimeError(f"the reference answer of {getattr(task, 'task_id', kind)} did not score 1.0")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    out = output_dir(args, __file__)
    console = Console()
    functions, repos = tasks_realcode.function_tasks(), tasks_realcode.repo_tasks()
    if args.quick:
        functions, repos, args.repeats = functions[:1], repos[:1], 1
    kinds = {"empty": [None], "function": list(functions), "repo": list(repos)}
    envs = make_envs(console)
    names = list(envs)
    times = {(n, k): [] for n in names for k in kinds}  # per repeat: mean seconds per episode
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            for kind, tasks in kinds.items():
                per = [time_episode(envs[name], kind, t) for t in tasks]
                times[name, kind].append(statistics.fmean(per))
    rows = []
    for name in names:
        for kind in kinds:
            ts = times[name, kind]
            base = times.get(("before", kind))
            ratio = statistics.median(t / b for t, b in zip(ts, base)) if base else None
            rows.append(dict(variant=name, kind=kind, ms_per_episode=1e3 * statistics.median(ts),
                             episodes_per_s=1.0 / statistics.median(ts), ratio_to_before=ratio,
                             episodes=len(kinds[kind]) * len(ts)))
    table = Table(title="sandbox: graded episodes, one at a time")
    for col in ("variant", "kind", "ms/episode", "episodes/s", "x before"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["variant"], r["kind"], f"{r['ms_per_episode']:.0f}", f"{r['episodes_per_s']:.2f}",
                      "-" if r["ratio_to_before"] is None else f"{r['ratio_to_before']:.2f}")
    console.print(table)
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), repeats=args.repeats, quick=args.quick,
                isolation={n: envs[n].sandbox.isolation.describe() for n in names},
                tasks={k: len(v) for k, v in kinds.items()})
    (out / "sandbox_throughput.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, names, list(kinds), out / "sandbox_throughput.png")
    print(f"wrote {out / 'sandbox_throughput.json'} and {out / 'sandbox_throughput.png'}")


def plot(rows: list[dict], names: list[str], kinds: list[str], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next(r["ms_per_episode"] for r in rows if r["variant"] == name and r["kind"] == k) for k in kinds]
        ax.bar([j + i * width for j in range(len(kinds))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("ms per graded episode (median)")
    ax.set_title("sandbox isolation cost per episode")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
