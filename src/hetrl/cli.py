"""The ``hetrl`` command line: ``hetrl train|experiment|parity|bench|fleet`` (DESIGN §1).

``hetrl train CONFIG [--set KEY=VALUE]... [--dry-run]`` loads and validates the run config
(:mod:`hetrl.config`); with ``--dry-run`` it prints it resolved, otherwise it runs the
asynchronous loop with the local (threaded) backend (:mod:`hetrl.orchestrator.local`) and prints
a short summary. The rest says plainly when its machinery has not landed yet instead of
pretending to run.
"""

from __future__ import annotations

import argparse
import sys

NOT_YET = {
    "experiment": "the experiment grid (needs `hetrl train`)",
    "parity": "cross-backend parity (needs the JAX and Megatron trainers)",
    "fleet": "fleet inspection (needs the samplers)",
    "bench": "benchmark dispatch (run the scripts in bench/ directly for now)",
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
                       help="shorthand for --set trainer.kind=...")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config as YAML and exit")
    for name in ("experiment", "parity", "bench", "fleet"):
        sub.add_parser(name, help=NOT_YET[name])
    return parser


def _train(args: argparse.Namespace) -> int:
    """Load and validate the config (exit 1 with the bad keys named if invalid); with
    ``--dry-run`` print it resolved and exit 0; otherwise train (exit 0 when every step ran)."""
    from hetrl.config import ConfigError, load_config

    overrides = list(args.overrides) + ([f"trainer.kind={args.trainer}"] if args.trainer else [])
    try:
        config = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"hetrl train: {err}", file=sys.stderr)
        return 1
    if args.dry_run:
        sys.stdout.write(config.to_yaml())
        return 0
    from hetrl.orchestrator.local import LocalOrchestrator
    from hetrl.orchestrator.report import summary_lines

    try:
        orchestrator = LocalOrchestrator(config)
    except ConfigError as err:
        print(f"hetrl train: {err}", file=sys.stderr)
        return 1
    result = orchestrator.run()
    for line in summary_lines(result.history, result.final):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    print(f"hetrl {args.command}: not available yet: {NOT_YET[args.command]} has not landed.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
