"""The ``hetrl`` command line: ``hetrl train|warmstart|parity|experiment|bench|fleet`` (DESIGN §1).

``hetrl train CONFIG [--set KEY=VALUE]... [--trainer jax|megatron] [--backend local|ray] [--resume]
[--dry-run]`` loads and validates the run config (:mod:`hetrl.config`); with ``--dry-run`` it
prints it resolved,
otherwise it runs the asynchronous loop on the config's backend and prints a short summary
(SIGTERM stops it gracefully: the step in progress finishes and is checkpointed).
Other commands live in their own modules (:data:`COMMANDS`): each exposes
``add_arguments(parser)`` and ``run(args) -> exit code`` and imports its heavy dependencies only
inside ``run``. The rest says plainly when its machinery has not landed yet instead of
pretending to run.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

#: Subcommands implemented in their own module: name -> (module, help).
COMMANDS: dict[str, tuple[str, str]] = {
    "warmstart": ("hetrl.warmstart.command", "train the tiny policy from scratch on solved tasks (the RL starting point)"),
    "parity": ("hetrl.parity", "cross-backend numerical parity on one checkpoint (log-probs, loss, AdamW update)"),
    "experiment": ("hetrl.experiment.command", "run an experiment grid (arms x seeds) and write its report"),
    "bench": ("hetrl.bench_command", "run a benchmark of the repository's bench/ (--list names them; NAME --quick)"),
}

NOT_YET = {
    "fleet": "fleet inspection (needs the samplers)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetrl", description="Asynchronous RL on a heterogeneous sampler fleet.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy")
    train.add_argument("config", nargs="?", default="tiny_mixed.yaml",
                       help="YAML run config: a path, or a name in the repository's configs/")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set fleet.pools[0].replicas=2 (value parsed as YAML)")
    train.add_argument("--trainer", choices=("jax", "megatron"), default=None,
                       help="train with this trainer: the config's trainer section is translated to it (before any --set)")
    train.add_argument("--backend", choices=("local", "ray"), default=None,
                       help="shorthand for --set backend=...: threads in one process, or Ray actors")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in checkpointing.directory (--set checkpointing.resume=true)")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config as YAML and exit")
    for name, (module, help_text) in COMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text))
    for name, help_text in NOT_YET.items():
        sub.add_parser(name, help=help_text)
    return parser


def _train(args: argparse.Namespace) -> int:
    """Load and validate the config (exit 1 with the bad keys named if invalid); with
    ``--dry-run`` print it resolved and exit 0; otherwise train (exit 0 when every step ran)."""
    from hetrl.config import ConfigError, load_config

    overrides = (([f"trainer.kind={args.trainer}"] if args.trainer else []) + list(args.overrides)
                 + ([f"backend={args.backend}"] if args.backend else [])
                 + (["checkpointing.resume=true"] if args.resume else []))
    try:
        config = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"hetrl train: {err}", file=sys.stderr)
        return 1
    if args.dry_run:
        sys.stdout.write(config.to_yaml())
        return 0
    from hetrl.orchestrator import build_orchestrator
    from hetrl.orchestrator.report import summary_lines

    try:
        orchestrator = build_orchestrator(config)
    except ConfigError as err:
        print(f"hetrl train: {err}", file=sys.stderr)
        return 1
    # SIGTERM (a preemptible machine reclaimed, a scheduler's stop): finish the step, checkpoint, exit 0
    previous = signal.signal(signal.SIGTERM, lambda *_: orchestrator.request_stop())
    try:
        result = orchestrator.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    for line in summary_lines(result.history, result.final):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command in COMMANDS:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    print(f"hetrl {args.command}: not available yet: {NOT_YET[args.command]} has not landed.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
