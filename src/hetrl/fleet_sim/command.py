"""``hetrl fleet simulate CONFIG`` and ``hetrl fleet plan CONFIG``.

``simulate`` runs the discrete-event simulation of a :class:`hetrl.fleet_sim.config.SimConfig`
YAML (``--seed`` overrides its seed) and prints its table; ``plan`` searches the fleets of a
:class:`hetrl.fleet_sim.plan.PlanConfig` YAML for the cheapest one that reaches its target, prints
every candidate and the recommended fleet (as the ``pools`` of a simulator config). Both write
``<name>.json`` and ``<name>.png`` under ``--out`` (default ``runs/fleet``). A bad config is one
line on stderr and exit status 1; a plan with no fleet that meets the target exits 3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", required=True)
    sim = sub.add_parser("simulate", help="simulate the asynchronous loop on a fleet at cluster scale")
    sim.add_argument("config", help="simulator YAML (model, trainer, workload, pools)")
    sim.add_argument("--seed", type=int, default=None, help="override the config's seed")
    sim.add_argument("--out", type=Path, default=Path("runs/fleet"), help="where the JSON and PNG go")
    pl = sub.add_parser("plan", help="the cheapest fleet for a target throughput within mismatch budgets")
    pl.add_argument("config", help="plan YAML (capacity, model, trainer, workload, target, budgets)")
    pl.add_argument("--out", type=Path, default=Path("runs/fleet"), help="where the JSON and PNG go")


def run(args: argparse.Namespace) -> int:
    from hetrl.errors import UserError

    try:
        return _simulate(args) if args.fleet_command == "simulate" else _plan(args)
    except UserError as err:
        print(f"hetrl fleet {args.fleet_command}: {err}", file=sys.stderr)
        return 1


def _simulate(args: argparse.Namespace) -> int:
    from hetrl.fleet_sim.config import load_sim_config
    from hetrl.fleet_sim.engine import simulate
    from hetrl.fleet_sim.report import table_lines, write_outputs

    cfg = load_sim_config(args.config)
    if args.seed is not None:
        cfg = cfg.model_copy(update={"seed": args.seed})
    report = simulate(cfg)
    print("\n".join(table_lines(report)))
    for path in write_outputs([report], args.out, cfg.name):
        print(f"wrote {path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import yaml

    from hetrl.fleet_sim.plan import load_plan_config, plan
    from hetrl.fleet_sim.report import table_lines, write_outputs

    cfg = load_plan_config(args.config)
    result = plan(cfg)
    for name, reason in result["excluded"].items():
        print(f"pool {name} not used: {reason}")
    for report in result["candidates"]:
        print("\n".join(table_lines(report)) + "\n")
    if result["candidates"]:
        write_outputs(result["candidates"], args.out, cfg.name)
    best = result["best"]
    if best is None:
        cap = result["trainer_cap_tokens_per_s"]
        why = (f"the trainer caps throughput at {cap:.0f} tok/s (add trainer accelerators)"
               if cap < cfg.target_tokens_per_s else "no candidate fleet within the capacity and budgets reaches it")
        print(f"no fleet reaches {cfg.target_tokens_per_s:.0f} trained tok/s: {why}")
        return 3
    print(f"recommended: {best['name']}: {best['tokens_per_s']:.0f} trained tok/s, "
          f"${best['usd_per_useful_mtok']:.3f} per useful Mtok (${best['usd_per_mtok']:.3f}/Mtok), "
          f"dropped {best['dropped_fraction']:.1%}, idle {best['idle_fraction']:.1%}")
    print(yaml.safe_dump({"pools": best["pools_config"]}, sort_keys=False).rstrip())
    print(f"wrote {args.out / (cfg.name + '.json')} and .png")
    return 0
