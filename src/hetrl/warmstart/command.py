"""``hetrl warmstart [--out DIR] [--set KEY=VALUE]...``: train, save and evaluate a warm start.

Overrides are dotted keys of :class:`~hetrl.warmstart.config.WarmstartConfig` (e.g.
``--set training.steps=400 --set model.hidden_size=96``), values parsed as YAML. Without
``--out`` the checkpoint goes to ``runs/models/warmstart-<key>``, where run configs that name
the same settings under ``model.warmstart`` find it. SIGINT / SIGTERM stop it at the next
optimizer step, saving nothing (exit status ``128 + signal``).
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys

__all__ = ["add_arguments", "run", "default_directory"]


def default_directory(key: str, root: str | pathlib.Path = "runs/models") -> pathlib.Path:
    """Where the warm start named ``key`` lives by default."""
    return pathlib.Path(root) / f"warmstart-{key}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="checkpoint directory (default runs/models/warmstart-<key>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a warm-start setting, e.g. --set training.steps=400")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hetrl.config import ConfigError, apply_override
    from hetrl.stopping import Stopped, signal_handlers
    from hetrl.warmstart.config import WarmstartConfig
    from hetrl.warmstart.train import run_warmstart

    data: dict = {}
    try:
        for override in args.overrides:
            apply_override(data, override)
        config = WarmstartConfig.model_validate(data)
    except (ConfigError, ValidationError) as err:
        print(f"hetrl warmstart: {err}", file=sys.stderr)
        return 1
    out = pathlib.Path(args.out) if args.out else default_directory(config.key())
    with signal_handlers("hetrl warmstart") as stop:
        try:
            result = run_warmstart(config, out, console=not args.no_progress)
        except Stopped as err:
            print(f"hetrl warmstart: stopped by {signal.Signals(stop.signum or signal.SIGTERM).name} during "
                  f"{err.phase}: nothing saved; run the same command again to start over", file=sys.stderr)
            return stop.exit_status
    wall = result["wall_s"]
    print(f"warm start {result['key']}: {result['parameters']:,} parameters, {result['train_transcripts']} transcripts, "
          f"{wall['total']:.0f} s (train {wall['train']:.0f} s) -> {out}")
    for mode, scores in result["eval"].items():
        tiers = ", ".join(f"{k.split('/')[1]} {v:.2f}" for k, v in scores.items() if k.startswith("success/"))
        print(f"  held-out {mode}: success {scores['success']:.3f}, reward {scores['reward']:.3f} over "
              f"{int(scores['tasks'])} tasks ({tiers})")
    return 0
