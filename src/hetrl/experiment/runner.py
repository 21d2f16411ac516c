"""Runs an experiment grid: one ``hetrl train`` subprocess per run, ``jobs`` at a time, resumable.

Run ``<arm>/s<seed>`` lives in ``<out>/runs/<arm>/s<seed>/``: the train command's
``output_dir`` (so ``metrics.jsonl``, ``summary.json``, checkpoints, plots and TensorBoard
events are there), with ``train.log`` (its stdout and stderr) and ``experiment_run.json`` (the
run's spec: base config, overrides, steps) beside them. The command is::

    python -m hetrl.cli train BASE --set <override>... --set output_dir=DIR --set logging.console=false

**Resuming.** ``hetrl train`` writes ``summary.json`` once, after its last step
(:meth:`hetrl.orchestrator.loop.AsyncOrchestrator.run`); a run is complete when it is there and
its trainer ``version`` equals the run's steps. A complete run is never launched again. A
directory without that marker is an interrupted run (killed, or stopped with its checkpoint): it is
removed and the run starts over rather than resuming, so every reported run is one uninterrupted
process (a resumed run under the default ``async`` schedule trains on other samples than an
uninterrupted one, and its wall-clock and throughput measures would span two processes); this also
gives ``hetrl train`` the empty ``output_dir`` a new run needs. A
directory whose ``experiment_run.json`` is missing or records other settings is refused
(:class:`ExperimentError`), so a changed grid never silently mixes old and new runs. The base
config is recorded relative to the experiment config's directory, so a grid directory stays
valid in another checkout: the same command with ``--out`` pointing at a committed grid (all
runs complete) trains nothing and only rewrites the report from the raw metrics there.

**Stopping.** A stop of the grid (:mod:`hetrl.stopping`: SIGINT or SIGTERM to ``hetrl
experiment``) starts no further run and forwards SIGTERM to the runs in flight
(:class:`SubprocessLauncher`), which checkpoint and exit; none is left running.

Every run's JAX compilations go to one persistent cache (``JAX_COMPILATION_CACHE_DIR``, default
``<out>/jax-cache``): runs of the same shapes and numerics compile once.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Mapping

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetrl.experiment.config import ExperimentError
from hetrl.experiment.plan import ExperimentPlan, RunSpec
from hetrl.stopping import StopToken

__all__ = ["COMPLETE_MARKER", "SPEC_FILE", "LOG_FILE", "RUN_MEMORY_BYTES", "Launcher", "SubprocessLauncher",
           "GridOutcome", "default_jobs", "run_directory", "train_command", "is_complete", "run_grid"]

COMPLETE_MARKER = "summary.json"
SPEC_FILE = "experiment_run.json"
LOG_FILE = "train.log"
RUN_MEMORY_BYTES = 3 * 2**30
"""Memory one tiny run may take at its peak (measured: 1.5 to 2.5 GiB resident per run of the default grid)."""
STOP_GRACE_S = 120.0
"""Seconds a stopped run has to finish its step and checkpoint before it is killed."""

Launcher = Callable[[RunSpec, list[str], pathlib.Path], int]
"""Runs ``argv`` for ``spec`` with its run directory; returns the exit status."""


@dataclass(frozen=True)
class SubprocessLauncher:
    """Runs the train command as a child process with ``env``, its output into ``train.log``.

    The child runs in its own session, so a terminal's Ctrl-C reaches it only through ``stop``:
    once ``stop`` is set it gets SIGTERM (it checkpoints and exits), and is killed if it has
    not exited ``grace_s`` later; a forced stop (a second signal) kills it at once. No child
    outlives the call."""

    env: Mapping[str, str]
    stop: StopToken = field(default_factory=StopToken)
    grace_s: float = STOP_GRACE_S

    def __call__(self, spec: RunSpec, argv: list[str], directory: pathlib.Path) -> int:
        with (directory / LOG_FILE).open("w", encoding="utf-8") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(self.env),
                                    start_new_session=True)
            self.stop.on_force(proc.kill)
            try:
                while True:
                    try:
                        return proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                    if self.stop.is_set():
                        proc.terminate()
                        try:
                            return proc.wait(timeout=self.grace_s)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            return proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@dataclass
class GridOutcome:
    """What :func:`run_grid` did: runs ``completed`` (launched and finished), ``skipped`` (complete
    before), ``failed`` (``(spec, exit status, log)``), ``stopped`` (interrupted, or never
    started, because the grid was stopped)."""

    completed: list[RunSpec] = field(default_factory=list)
    skipped: list[RunSpec] = field(default_factory=list)
    failed: list[tuple[RunSpec, int, pathlib.Path]] = field(default_factory=list)
    stopped: list[RunSpec] = field(default_factory=list)


def default_jobs(run_memory_bytes: int = RUN_MEMORY_BYTES) -> int:
    """Runs to train at once when ``--jobs`` is not given: one per CPU core this process may use
    (a tiny run keeps about one core busy), fewer if the available memory holds fewer runs of
    ``run_memory_bytes``; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # no sysconf names on this platform: cores decide
        return max(1, cores)
    return max(1, min(cores, available // run_memory_bytes))


def run_directory(out: pathlib.Path, spec: RunSpec) -> pathlib.Path:
    return out / "runs" / spec.arm / f"s{spec.seed}"


def train_command(spec: RunSpec, directory: pathlib.Path) -> list[str]:
    """The ``hetrl train`` argv of ``spec`` writing into ``directory`` (module docstring)."""
    outputs = [f"output_dir={directory}", "logging.console=false"]
    argv = [sys.executable, "-m", "hetrl.cli", "train", str(spec.base)]
    for override in (*spec.overrides, *outputs):
        argv += ["--set", override]
    return argv


def _record(spec: RunSpec, configs: pathlib.Path) -> dict:
    """What ``experiment_run.json`` holds for ``spec``; the base config's path relative to
    ``configs`` (the experiment config's directory), not to where this checkout lives."""
    return {"arm": spec.arm, "seed": spec.seed, "base": os.path.relpath(spec.base, configs),
            "overrides": list(spec.overrides), "steps": spec.steps}


def is_complete(spec: RunSpec, directory: pathlib.Path) -> bool:
    """``summary.json`` is there and records ``spec.steps`` trainer steps."""
    marker = directory / COMPLETE_MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text(encoding="utf-8")).get("version") == spec.steps
    except (OSError, ValueError):
        return False


def _check_directory(spec: RunSpec, directory: pathlib.Path, configs: pathlib.Path) -> bool:
    """Whether ``spec`` must run: False if complete; raises if ``directory`` holds anything else
    than a run of ``spec``."""
    if not directory.exists():
        return True
    try:
        recorded = json.loads((directory / SPEC_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = None
    if recorded != _record(spec, configs):
        raise ExperimentError(f"{directory} holds {'a run of other settings' if recorded else 'something else'} than "
                              f"run {spec.key} of this grid; delete it or choose another --out")
    return not is_complete(spec, directory)


def _start(spec: RunSpec, directory: pathlib.Path, configs: pathlib.Path) -> None:
    if directory.exists():  # an interrupted run: start it over
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / SPEC_FILE).write_text(json.dumps(_record(spec, configs), indent=2), encoding="utf-8")


def run_grid(plan: ExperimentPlan, out: pathlib.Path, *, jobs: int = 1, launcher: Launcher | None = None,
             progress: bool = True, stop: StopToken | None = None) -> GridOutcome:
    """Run every incomplete run of ``plan`` under ``out`` (module docstring), ``jobs`` at a time,
    with a progress bar over runs unless ``progress`` is False. ``launcher`` (default: a
    :class:`SubprocessLauncher` with the JAX cache set, stopping its child on ``stop``) starts
    one run. Once ``stop`` is set no run starts; the runs in flight end (stopped) and are
    listed in ``stopped``."""
    if jobs < 1:
        raise ExperimentError(f"--jobs must be >= 1, got {jobs}")
    stop = StopToken() if stop is None else stop
    if launcher is None:
        launcher = SubprocessLauncher({**os.environ, "JAX_COMPILATION_CACHE_DIR":
                                       os.environ.get("JAX_COMPILATION_CACHE_DIR", str(out.resolve() / "jax-cache"))},
                                      stop=stop)
    outcome = GridOutcome()
    configs = plan.source.resolve().parent
    todo = []
    for spec in plan.runs:
        (todo if _check_directory(spec, run_directory(out, spec), configs) else outcome.skipped).append(spec)
    lock = threading.Lock()
    running: list[str] = []
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[running]}"))
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task(f"{plan.config.name}: runs", total=len(plan.runs), completed=len(outcome.skipped),
                            running="")

        def one(spec: RunSpec) -> tuple[RunSpec, int | None]:
            if stop.is_set():
                return spec, None
            directory = run_directory(out, spec)
            with lock:
                running.append(spec.key)
                bar.update(task, running="running " + ", ".join(running))
            _start(spec, directory, configs)
            status = launcher(spec, train_command(spec, directory), directory)
            with lock:
                running.remove(spec.key)
                bar.update(task, running=("running " + ", ".join(running)) if running else "")
            return spec, status

        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            for future in as_completed([pool.submit(one, spec) for spec in todo]):
                spec, status = future.result()
                directory = run_directory(out, spec)
                if status == 0 and is_complete(spec, directory):
                    outcome.completed.append(spec)
                elif stop.is_set():
                    outcome.stopped.append(spec)
                else:
                    outcome.failed.append((spec, status, directory / LOG_FILE))
                bar.advance(task)
        finally:  # stopped: start nothing more, wait for the runs in flight (the launcher stops them)
            pool.shutdown(wait=True, cancel_futures=True)
    return outcome
