"""Soak run: `tiny_mixed` for an hour under random fault injection, then the books are audited.

The run is the real asynchronous loop (local backend, the six embedded pools of
``configs/tiny_mixed.yaml``, the JAX trainer) with ``fleet.chaos`` switched on
(:class:`hetrl.samplers.faults.ChaosConfig`): on every replica, each generate call may kill the
replica (the fleet re-queues its jobs, the loop builds it again after ``fleet.restart.delay_s``)
or stall it for a few seconds, and each generation it returns may be poisoned (NaN or
inconsistent log-probs, ids outside the vocabulary, a token outside its support, wrong lengths,
unpublished versions, another pool's stamp), which the rollout gate must reject. After
``--minutes`` the run is asked to stop (what SIGTERM does): the step in progress finishes and is
checkpointed. Then :meth:`hetrl.orchestrator.loop.RunResult.audit` checks conservation: every
submitted group received, rejected, retracted, failed or still in flight; no group trained twice;
every received group trained, dropped by the staleness policy or pending.

    .venv/bin/python bench/soak.py [--minutes 60] [--kill-rate 0.02] [--slow-rate 0.05]
                                   [--poison-rate 0.02] [--out bench/results] [--quick]

Writes ``soak.json`` (settings, steps, faults injected, restarts, rejections by reason, the audit)
and ``soak.png`` (reward and faults over the run) to ``--out``; the run's own outputs go to
``--run-dir`` (default ``runs/soak/``, emptied first). ``--quick``: 2 trainer steps (at most 5
minutes: a clock stop in mid-compile would leave generations running at exit) with two of the
six pools, batches of 2 groups x 2 rollouts of at most 16 new tokens, kill and poison rates of
0.1, stalls of 0.5 s, restarts after 0.5 s, the run's outputs in ``soak-run/`` under the output
directory.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import threading
import time

from rich.console import Console
from rich.table import Table

from hetrl.bench_command import output_dir, script_parser
from hetrl.config import load_config
from hetrl.orchestrator.local import LocalOrchestrator


QUICK = dict(minutes=5.0, steps=2, kill_rate=0.1, slow_s=0.5, poison_rate=0.1)
QUICK_OVERRIDES = [
    "async.batch_groups=2", "async.group_size=2", "async.max_new_tokens=16",
    "fleet.restart={max_per_replica: 1000, delay_s: 0.5}",
    "fleet.pools=[{name: h100-fp8, accelerator: h100, weight_precision: fp8_e4m3, kv_precision: fp8_e4m3},"
    " {name: a100-bf16, accelerator: a100, weight_precision: bf16, kv_precision: bf16}]",
]


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--minutes", type=float, default=None, help="default 60 (with --quick 5)")
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many trainer steps too (default: only the clock; with --quick 2)")
    parser.add_argument("--kill-rate", type=float, default=None, help="per generate call (default 0.02)")
    parser.add_argument("--slow-rate", type=float, default=0.05, help="per generate call")
    parser.add_argument("--slow-s", type=float, default=None, help="default 3.0")
    parser.add_argument("--poison-rate", type=float, default=None, help="per generation (default 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None,
                        help="the run's outputs (default runs/soak, with --quick soak-run/ in the output directory)")
    parser.add_argument("--no-console", action="store_true", help="no live display")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else dict(minutes=60.0, steps=1_000_000, kill_rate=0.02, slow_s=3.0, poison_rate=0.02)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = output_dir(args, __file__)
    args.run_dir = args.run_dir or (out / "soak-run" if args.quick else "runs/soak")

    run_dir = pathlib.Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: metrics and checkpoints of an earlier soak would mix in
    chaos = {"seed": args.seed, "kill_rate": args.kill_rate, "slow_rate": args.slow_rate, "slow_s": args.slow_s,
             "poison_rate": args.poison_rate}
    cfg = load_config("tiny_mixed.yaml", [
        f"seed={args.seed}", f"steps={args.steps}", f"output_dir={run_dir}", "checkpointing.every=25",
        f"fleet.chaos={json.dumps(chaos)}", "fleet.restart={max_per_replica: 1000, delay_s: 2.0}",
        "environment.options.eval.every=0", f"logging.console={str(not args.no_console).lower()}",
        *(QUICK_OVERRIDES if args.quick else []),
    ])
    orch = LocalOrchestrator(cfg)
    timer = threading.Timer(args.minutes * 60.0, orch.request_stop)
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        result = orch.run()
    finally:
        timer.cancel()
    wall = time.monotonic() - start
    audit = result.audit()
    last = result.history[-1] if result.history else {}
    rejected: dict[str, int] = {}  # summed over pools: pool/<name>/admission/rejected/<reason>
    for key, value in last.items():
        if key.startswith("pool/") and "/admission/rejected/" in key:
            reason = key.split("/admission/rejected/", 1)[1]
            rejected[reason] = rejected.get(reason, 0) + int(value)
    report = {
        "date": datetime.date.today().isoformat(), "quick": args.quick, "minutes": args.minutes, "wall_s": round(wall, 1), "chaos": chaos,
        "steps": result.final["version"], "faults": {k: v for k, v in result.final.items() if k.startswith("chaos_")},
        "replica_restarts": result.final["replica_restarts"], "requeued_jobs": result.final["requeues"],
        "rollouts_rejected": result.final["rollouts_rejected"], "rejected_by_reason": rejected,
        "quarantined": result.final["quarantined"], "continuation_failures": result.final["continuation_failures"],
        "audit": audit, "ok": not audit["lost"] and not audit["duplicated"] and audit["unaccounted"] == 0,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    _plot(result.history, out / "soak.png")

    table = Table(title=f"soak: {args.minutes:g} min of tiny_mixed under chaos")
    table.add_column("what")
    table.add_column("value", justify="right")
    for key in ("steps", "replica_restarts", "requeued_jobs", "rollouts_rejected", "continuation_failures"):
        table.add_row(key, str(report[key]))
    for key, value in report["faults"].items():
        table.add_row(key, str(value))
    for key in ("submitted", "received", "rejected", "retracted", "failed", "unfinished", "trained", "dropped",
                "pending", "unaccounted"):
        table.add_row(f"groups {key}", str(audit[key]))
    table.add_row("groups lost", str(len(audit["lost"])))
    table.add_row("groups duplicated", str(len(audit["duplicated"])))
    Console().print(table)
    print(f"wrote {out / 'soak.json'}, {out / 'soak.png'}; books {'balance' if report['ok'] else 'DO NOT balance'}")


def _plot(history: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history if r.get("step")]
    rows = [r for r in history if r.get("step")]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r.get("reward/mean", float("nan")) for r in rows])
    top.set_ylabel("train reward (mean)")
    for key, label in (("chaos/kills", "replica kills"), ("chaos/poisoned", "poisoned generations"),
                       ("fleet/restarts", "replica restarts"), ("admission/rejected", "rollouts rejected")):
        bottom.plot(steps, [r.get(key, 0.0) for r in rows], label=label)
    bottom.set_ylabel("cumulative count")
    bottom.set_xlabel("trainer step")
    bottom.legend()
    fig.suptitle("soak run: tiny_mixed under random faults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
