"""Stopping `hetrl train` and `hetrl experiment` with SIGINT / SIGTERM (:mod:`hetrl.stopping`).

Real `hetrl train` subprocesses (a tiny homogeneous run, one replica, small batches) are
signalled in each phase: during the warm start (a warm start that must train, in a fresh cache),
during the set-up, during an evaluation and during training. Each stops within a bounded time,
without a traceback, with the conventional ``128 + signal`` status (143 for SIGTERM, 130 for
SIGINT); once a trainer exists the stop is checkpointed and summarized. A phase is recognized by
what the process has done so far: its SIGTERM handler installed (``SigCgt`` in
``/proc/<pid>/status``), its output directory or metrics file created. The cheap tests use a
probe process around :func:`hetrl.stopping.signal_handlers` (a second signal forces the exit; the
same signal delivered twice, as ``timeout`` does, is one stop) and the experiment runner's
launcher with stand-in children.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from hetrl.stopping import StopToken
from tiny_run import NO_EVAL, ONE_REPLICA, QUIET, TINY_BATCH, as_mapping, set_args

REPO = pathlib.Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 120  # a stopped run must be gone this long after the signal
START_TIMEOUT_S = 600  # reaching the phase to stop in (a loaded machine compiles slowly)
TINY_WARMSTART = {  # tests/test_warmstart.py's small setting, with more steps than it can finish here
    "suite": {"tiers": [1], "max_per_tier": 20},
    "model": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1},
    "training": {"steps": 100000, "batch_size": 8, "seq_len": 128, "variants": 2, "warmup_steps": 5},
    "eval": {"tasks": 4, "samples": 2, "max_new_tokens": 24},
}


def _train_argv(out: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hetrl.cli", "train", "tiny_homogeneous.yaml",
            *set_args(["steps=30", f"output_dir={out}", QUIET, NO_EVAL, *TINY_BATCH, "async.max_new_tokens=24",
                       ONE_REPLICA]), *extra]


class _Process:
    """A command run with its stdout and stderr in files (no pipe to fill)."""

    def __init__(self, argv: list[str], directory: pathlib.Path, **kwargs):
        self.stdout_path, self.stderr_path = directory / "stdout.txt", directory / "stderr.txt"
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, **kwargs)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_until(self, condition, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"ended before {what} (status {self.proc.returncode}):\n{self.stderr[-4000:]}"
            assert time.monotonic() < deadline, f"not {what} after {timeout} s:\n{self.stderr[-4000:]}"
            time.sleep(0.1)

    def stop(self, signum: int) -> tuple[int, float]:
        """Send ``signum``; the exit status and the seconds it took to exit."""
        sent = time.monotonic()
        os.kill(self.proc.pid, signum)
        try:
            status = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running {STOP_TIMEOUT_S} s after {signal.Signals(signum).name}:\n{self.stderr[-4000:]}")
        return status, time.monotonic() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM installed (Python has none by default)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _children(pid: int) -> list[int]:
    """Pids of the live child processes of ``pid`` (from /proc)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_no_traceback(run: _Process) -> None:
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, run.stderr[-4000:]


# ---------------------------------------------------------------------- the handlers (probe process)
PROBE = textwrap.dedent("""
    import sys, time
    from hetrl.stopping import signal_handlers
    with signal_handlers("probe") as stop:
        print("ready", flush=True)
        while not stop.is_set():
            time.sleep(0.02)
        print("stopping", flush=True)
        time.sleep(float(sys.argv[1]))  # a stop that takes this long (a step finishing)
    sys.exit(stop.exit_status)
""")


def _probe(tmp_path: pathlib.Path, stop_takes_s: float) -> _Process:
    run = _Process([sys.executable, "-c", PROBE, str(stop_takes_s)], tmp_path)
    run.wait_until(lambda: "ready" in run.stdout, "ready", timeout=60)
    return run


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_first_signal_requests_a_stop_and_the_status_is_128_plus_the_signal(tmp_path, signum, status):
    run = _probe(tmp_path, 0.5)
    assert run.stop(signum)[0] == status
    assert "stopping" in run.stdout and "stopping at the next safe point" in run.stderr


def test_a_second_signal_forces_the_exit(tmp_path):
    run = _probe(tmp_path, 60)  # the first stop would take a minute
    os.kill(run.proc.pid, signal.SIGTERM)
    run.wait_until(lambda: "stopping" in run.stdout, "stopping", timeout=30)
    time.sleep(1.5)  # past the duplicate window
    status, took = run.stop(signal.SIGINT)
    assert status == 130 and took < 10 and "SIGINT again: exiting now" in run.stderr


def test_the_same_signal_delivered_twice_at_once_is_one_stop(tmp_path):
    """`timeout` signals its child and then the child's process group: not a forced exit."""
    run = _probe(tmp_path, 2)
    os.kill(run.proc.pid, signal.SIGTERM)
    status, took = run.stop(signal.SIGTERM)
    assert status == 143 and took >= 1.5 and "exiting now" not in run.stderr


def test_a_stop_token_runs_its_listeners_once_and_late_listeners_at_once():
    token, calls = StopToken(), []
    token.on_request(lambda: calls.append("early"))
    token.request(signal.SIGINT)
    token.request(signal.SIGTERM)  # a stop is requested once: the first signal counts
    token.on_request(lambda: calls.append("late"))
    assert calls == ["early", "late"] and token.exit_status == 130


def test_the_handlers_are_reclaimed_after_a_library_replaces_them_and_restored_after_the_block():
    from hetrl.stopping import current, reclaim_signals, signal_handlers

    before = signal.getsignal(signal.SIGTERM)
    with signal_handlers("probe") as token:
        ours = signal.getsignal(signal.SIGTERM)
        assert current() is token and ours is signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does (its own handler)
        reclaim_signals()
        assert signal.getsignal(signal.SIGTERM) is ours
    assert signal.getsignal(signal.SIGTERM) is before and current() is not token


# ---------------------------------------------------------------------- hetrl train in each phase
@pytest.mark.slow
def test_sigterm_during_the_warm_start_exits_143_without_saving_it(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    model = json.dumps({"warmstart": TINY_WARMSTART, "cache_dir": str(cache)})
    run = _Process(_train_argv(out, "--set", f"model={model}"), tmp_path)
    try:
        run.wait_until(lambda: _catches_sigterm(run.proc.pid) and out.exists(), "in the set-up")
        time.sleep(2)  # in the warm start: preparing its transcripts or training (100000 steps: never done)
        status, took = run.stop(signal.SIGTERM)
    finally:
        run.kill()
    assert status == 143, run.stderr[-4000:]
    assert "stopped by SIGTERM during the warm start" in run.stderr and "nothing to checkpoint" in run.stderr
    _assert_no_traceback(run)
    assert not list(cache.glob("warmstart-*")) and not list(cache.glob(".warmstart-*"))  # nothing half-saved


@pytest.mark.slow
def test_sigterm_during_the_set_up_exits_143(tmp_path):
    out = tmp_path / "run"
    run = _Process(_train_argv(out, "--set", "model={tiny: qwen3}"), tmp_path)
    try:
        run.wait_until(lambda: _catches_sigterm(run.proc.pid) and (out / "model").exists(), "in the set-up")
        status, took = run.stop(signal.SIGTERM)
    finally:
        run.kill()
    assert status == 143, run.stderr[-4000:]
    assert "stopped by SIGTERM during the set-up" in run.stderr
    _assert_no_traceback(run)
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_sigterm_during_an_evaluation_stops_it_checkpointed_with_status_143(tmp_path):
    """The step-0 evaluation (every held-out task x 8 episodes, many batches) is stopped between
    batches; the run checkpoints step 0 and says it stopped at step 0."""
    out = tmp_path / "run"
    run = _Process(_train_argv(out, "--set", "model={tiny: qwen3}", "--set",
                               "environment.options.eval={every: 1, tasks: null, greedy: false, samples: 8}"), tmp_path)
    try:
        run.wait_until(lambda: (out / "metrics.jsonl").exists(), "in the first evaluation")  # opened just before it
        status, took = run.stop(signal.SIGTERM)
    finally:
        run.kill()
    assert status == 143, run.stderr[-4000:]
    _assert_no_traceback(run)
    assert "stopped at step 0 of 30; resume with `hetrl train tiny_homogeneous.yaml" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] is True and summary["version"] == 0 and summary["steps"] == 30
    assert (out / "checkpoints" / "0").is_dir()
    assert (out / "metrics.jsonl").read_text() == ""  # no half evaluation recorded


@pytest.mark.slow
def test_ctrl_c_during_training_leaves_a_checkpoint_and_a_summary_with_status_130(tmp_path):
    out = tmp_path / "run"
    run = _Process(_train_argv(out, "--set", "model={tiny: qwen3}"), tmp_path)
    try:
        run.wait_until(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip(),
                       "training")
        status, took = run.stop(signal.SIGINT)
    finally:
        run.kill()
    assert status == 130, run.stderr[-4000:]
    _assert_no_traceback(run)
    summary = json.loads((out / "summary.json").read_text())
    k = summary["version"]
    assert summary["stopped"] is True and 1 <= k < 30
    assert (out / "checkpoints" / str(k)).is_dir() and (out / "checkpoints" / f"loop-{k}.json").exists()
    line = next(line for line in run.stdout.splitlines() if line.startswith("stopped at"))
    assert line.startswith(f"stopped at step {k} of 30; resume with `hetrl train tiny_homogeneous.yaml --set steps=30")
    assert line.endswith("--resume`")


# ---------------------------------------------------------------------- hetrl experiment
def test_the_launcher_stops_its_child_and_kills_one_that_does_not_stop(tmp_path):
    from hetrl.experiment.runner import SubprocessLauncher

    code = {"obeys": "import time; time.sleep(60)",
            "ignores": "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('x', flush=True); "
                       "time.sleep(60)"}
    before = set(_children(os.getpid()))  # other tests' helpers (a Ray worker, ...) are not the launcher's
    for kind, expected in (("obeys", -signal.SIGTERM), ("ignores", -signal.SIGKILL)):
        token = StopToken()
        launcher = SubprocessLauncher(dict(os.environ), stop=token, grace_s=1.0)
        threading.Timer(1.0, token.request).start()
        started = time.monotonic()
        assert launcher(None, [sys.executable, "-c", code[kind]], tmp_path) == expected, kind
        assert time.monotonic() - started < 15
    assert set(_children(os.getpid())) <= before


def test_a_stopped_grid_starts_no_run(tmp_path):
    from hetrl.experiment.config import load_experiment
    from hetrl.experiment.plan import build_plan
    from hetrl.experiment.runner import run_grid

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(_grid(steps=4)))
    plan = build_plan(*load_experiment(grid))
    token, launched = StopToken(), []
    token.request(signal.SIGTERM)
    outcome = run_grid(plan, tmp_path / "out", launcher=lambda spec, argv, d: launched.append(spec) or 0,
                       progress=False, stop=token)
    assert not launched and len(outcome.stopped) == len(plan.runs) and not outcome.failed


def _grid(steps: int) -> dict:
    small = {"steps": steps, "environment.options.eval.every": 0, "fleet.pools[0].replicas": 1, **as_mapping(TINY_BATCH)}
    return {"name": "stops", "seeds": [0], "defaults": small,
            "arms": {"plain": {"base": str(REPO / "configs" / "tiny_homogeneous.yaml"),
                               "overrides": {"correction.preset": "none"}},
                     "corrected": {"base": str(REPO / "configs" / "tiny_homogeneous.yaml"),
                                   "overrides": {"correction.preset": "hetrl"}}},
            "analyses": {"e2": {"arms": ["plain", "corrected"]}}}


@pytest.mark.slow
def test_a_stopped_experiment_stops_its_runs_and_leaves_no_child(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(_grid(steps=50)))
    (tmp_path / "assets").symlink_to(REPO / "assets")  # the base config's model cache (assets/models) is relative
    run = _Process([sys.executable, "-m", "hetrl.cli", "experiment", str(grid), "--out", str(tmp_path / "out"),
                    "--jobs", "2", "--no-progress"], tmp_path, cwd=tmp_path)
    children: list[int] = []
    try:
        def both_runs_started() -> bool:
            children[:] = _children(run.proc.pid)
            return len(children) == 2 and all(_catches_sigterm(c) for c in children)

        run.wait_until(both_runs_started, "running both runs")
        status, took = run.stop(signal.SIGTERM)
    finally:
        run.kill()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
    assert status == 143, run.stderr[-4000:]
    assert not [c for c in children if _alive(c)], "a run outlived its experiment"
    assert "hetrl experiment: stopped" in run.stderr and "Traceback" not in run.stderr
    for log in (tmp_path / "out" / "runs").glob("*/s0/train.log"):
        assert "Traceback" not in log.read_text()
