"""The ``hetrl`` command line: ``hetrl train|experiment|parity|bench|fleet`` (DESIGN §1).

``hetrl train CONFIG [--set KEY=VALUE]... [--dry-run]`` loads and validates the run config
(:mod:`hetrl.config`) and, with ``--dry-run``, prints it resolved. The rest says plainly when
its machinery has not landed yet instead of pretending to run.
"""

from __future__ import annotations

import argparse
import sys

NOT_YET = {
    "train": "the asynchronous training loop (orchestrator, fleet, trainers)",
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
    ``--dry-run`` print it resolved and exit 0."""
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
    print(f"hetrl train: config {config.name!r} is valid, but not available yet: {NOT_YET['train']} has not landed.",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    print(f"hetrl {args.command}: not available yet: {NOT_YET[args.command]} has not landed.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
