"""``hetrl experiment CONFIG [--quick] [--out DIR] [--jobs N] [--no-progress]``: run a grid, write its report.

``CONFIG`` is an experiment YAML (:mod:`hetrl.experiment.config`; a path or a name in
``configs/``). Every run that is not complete under ``DIR`` (default
``runs/experiments/<name>``, ``<name>-quick`` with ``--quick``) is trained
(:mod:`hetrl.experiment.runner`), ``N`` at a time (default: one per core, memory
permitting); then ``DIR/REPORT.md`` and its plots are
written (:mod:`hetrl.experiment.report`). Running the same command again only runs what is
missing and rewrites the report. Exit status: 0 with the report written, 1 on a config problem
or when a run failed (its log is named; the report needs every run), ``128 + signal`` when
SIGINT / SIGTERM stopped it (the runs in flight are stopped too, none is left running).
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML: a path, or a name in the repository's configs/")
    parser.add_argument("--quick", action="store_true", help="the config's scaled-down `quick` grid")
    parser.add_argument("--out", default=None,
                        help="output directory (default runs/experiments/<name>, or <name>-quick with --quick)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs trained at the same time (default: one per CPU core, fewer if memory is short)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate every run's config, list the runs and exit (train nothing)")


def run(args: argparse.Namespace) -> int:
    from hetrl.experiment.config import ExperimentError, load_experiment
    from hetrl.experiment.plan import build_plan
    from hetrl.experiment.report import write_report
    from hetrl.experiment.runner import default_jobs, run_grid

    from hetrl.stopping import signal_handlers

    with signal_handlers("hetrl experiment") as stop:
        try:
            config, source = load_experiment(args.config, quick=args.quick)
            plan = build_plan(config, source)
            out = pathlib.Path(args.out or f"runs/experiments/{config.name}{'-quick' if args.quick else ''}")
            if args.dry_run:
                print(f"hetrl experiment {config.name}: {len(plan.runs)} runs of {len(plan.arms)} arms, every config "
                      f"valid (dry run: nothing trained; output would go to {out})")
                for spec in plan.runs:
                    print(f"  {spec.key}: hetrl train {spec.base.name} {shlex.join(spec.overrides)} ({spec.steps} steps)")
                return 0
            jobs = default_jobs() if args.jobs is None else args.jobs
            print(f"hetrl experiment {config.name}: {len(plan.runs)} runs of {len(plan.arms)} arms, {jobs} at a time "
                  f"-> {out}")
            outcome = run_grid(plan, out, jobs=jobs, progress=not args.no_progress, stop=stop)
        except ExperimentError as err:
            print(f"hetrl experiment: {err}", file=sys.stderr)
            return 1
    if stop.is_set():
        print(f"hetrl experiment: stopped: {len(outcome.completed)} runs trained, {len(outcome.stopped)} stopped or not "
              f"started; run the same command again to train them (a stopped run starts over)", file=sys.stderr)
        return stop.exit_status
    print(f"runs: {len(outcome.completed)} trained, {len(outcome.skipped)} already complete, "
          f"{len(outcome.failed)} failed")
    if outcome.failed:
        for spec, status, log in outcome.failed:
            print(f"  {spec.key} failed (exit status {status}); log: {log}", file=sys.stderr)
        print("hetrl experiment: no report until every run completes; run the same command again to retry "
              "the failed runs", file=sys.stderr)
        return 1
    command = ["hetrl", "experiment", str(args.config), *(["--quick"] if args.quick else []), "--out", str(out)]
    report = write_report(plan, out, command=shlex.join(command))
    print(f"report: {report}")
    return 0
