"""The ``hetrl`` command line: ``hetrl train|experiment|parity|bench|fleet`` (DESIGN §1).

Only the front door exists so far; each subcommand says plainly when its machinery has not
landed yet instead of pretending to run.
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
    train.add_argument("--trainer", choices=("jax", "megatron"), default="jax")
    train.add_argument("config", nargs="?", default="configs/tiny_mixed.yaml")
    for name in ("experiment", "parity", "bench", "fleet"):
        sub.add_parser(name, help=NOT_YET[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"hetrl {args.command}: not available yet: {NOT_YET[args.command]} has not landed.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
