"""The ``hetrl`` command line: ``hetrl train|warmstart|eval|parity|experiment|bench|fleet`` (DESIGN §1).

``hetrl train CONFIG [--set KEY=VALUE]... [--trainer jax|megatron] [--backend local|ray] [--resume]
[--dry-run]`` loads and validates the run config (:mod:`hetrl.config`); with ``--dry-run`` it
prints it resolved,
otherwise it runs the asynchronous loop on the config's backend and prints a short summary.
SIGINT or SIGTERM stops it in any phase (:mod:`hetrl.stopping`): during training the step in
progress finishes and is checkpointed, the summary says ``stopped at step k of n`` with the
command that resumes it, and the exit status is ``128 + signal`` (130, 143), not 0; a second
signal exits at once. A problem the user can fix (:class:`hetrl.errors.UserError`: a bad config,
a missing path, a server not running) is one line on stderr and exit status 1.
Other commands live in their own modules (:data:`COMMANDS`): each exposes
``add_arguments(parser)`` and ``run(args) -> exit code`` and imports its heavy dependencies only
inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys

#: Subcommands implemented in their own module: name -> (module, help).
COMMANDS: dict[str, tuple[str, str]] = {
    "warmstart": ("hetrl.warmstart.command", "train the tiny policy from scratch on solved tasks (the RL starting point)"),
    "parity": ("hetrl.parity", "cross-backend numerical parity on one checkpoint (log-probs, loss, AdamW update)"),
    "experiment": ("hetrl.experiment.command", "run an experiment grid (arms x seeds) and write its report"),
    "eval": ("hetrl.eval_command", "evaluate a checkpoint on a task set: pass@k, per-task results (--tasks humaneval|FILE|...)"),
    "bench": ("hetrl.bench_command", "run a benchmark of the repository's bench/ (--list names them; NAME --quick)"),
    "fleet": ("hetrl.fleet_sim.command", "simulate a fleet at cluster scale, or plan the cheapest one for a target"),
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
                       help="train with this trainer: trainer.kind set to it, the other trainer settings kept (before any --set)")
    train.add_argument("--backend", choices=("local", "ray"), default=None,
                       help="shorthand for --set backend=...: threads in one process, or Ray actors")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in output_dir from its newest checkpoint (--set checkpointing.resume=true); "
                            "without it, a run refuses an output_dir that already holds one")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config as YAML and exit")
    for name, (module, help_text) in COMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text))
    return parser


def _train(args: argparse.Namespace) -> int:
    """Load and validate the config and check that the loop would run it (exit 1 with the bad
    keys or the reason named if not); with ``--dry-run`` print it resolved and exit 0; otherwise
    train: exit 0 when every step ran, ``128 + signal`` when SIGINT / SIGTERM stopped it
    (:mod:`hetrl.stopping`), 1 on a problem the user can fix (:class:`~hetrl.errors.UserError`,
    one line, in any phase)."""
    from hetrl.config import load_config, resolve_config_path
    from hetrl.errors import UserError
    from hetrl.stopping import Stopped, signal_handlers

    overrides = (([f"trainer.kind={args.trainer}"] if args.trainer else []) + list(args.overrides)
                 + ([f"backend={args.backend}"] if args.backend else [])
                 + (["checkpointing.resume=true"] if args.resume else []))
    with signal_handlers("hetrl train") as stop:  # before anything heavy: every phase can be stopped
        try:
            config = load_config(args.config, overrides)
            from hetrl.orchestrator.preflight import check_runnable

            check_runnable(config, str(resolve_config_path(args.config)))
            if args.dry_run:
                sys.stdout.write(config.to_yaml())
                return 0
            from hetrl.orchestrator import build_orchestrator
            from hetrl.orchestrator.report import summary_lines

            orchestrator = build_orchestrator(config)
            stop.on_request(orchestrator.request_stop)  # the trainer loop stops after its step, checkpointed
            result = orchestrator.run()
        except Stopped as err:
            print(f"hetrl train: stopped by {signal.Signals(stop.signum or signal.SIGTERM).name} during {err.phase}, "
                  f"before any training step: nothing to checkpoint; run the same command again to start over",
                  file=sys.stderr)
            return stop.exit_status
        except UserError as err:
            print(f"hetrl train: {err}", file=sys.stderr)
            return 1
    for line in summary_lines(result.history, result.final):
        print(line)
    if not result.final.get("stopped"):
        return 0
    print(f"stopped at step {result.final['version']} of {result.final['steps']}; resume with "
          f"`{_resume_command(args)}`")
    return stop.exit_status


def _resume_command(args: argparse.Namespace) -> str:
    """The ``hetrl train`` command line of ``args`` with ``--resume``."""
    argv = ["hetrl", "train", args.config, *(a for o in args.overrides for a in ("--set", o))]
    argv += [*(["--trainer", args.trainer] if args.trainer else []), *(["--backend", args.backend] if args.backend else []),
             "--resume"]
    return shlex.join(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            return _train(args)
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except BrokenPipeError:
        # the reader of stdout left (`hetrl experiment --dry-run | head`): end quietly, as a piped Unix tool does;
        # stdout goes to /dev/null so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
