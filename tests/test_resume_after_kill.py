"""The trainer process killed at a random point, then `hetrl train --resume` (local backend).

Two schedules. ``lockstep`` (deterministic): the killed-and-resumed run's metrics equal an
uninterrupted run's exactly, every key but wall-clock timings. ``async`` (the default), below:

A real `hetrl train` subprocess (tiny homogeneous config, small batches, a checkpoint every
step) is SIGKILLed once its step-2 checkpoint and loop state are on disk and the run has moved
on; the same command with ``--resume`` then finishes the run. Checked: the resumed run restores
step 2 (not step 0) and trains steps 3..STEPS once each, so the metrics file holds every step
exactly once (the killed run's records after the checkpoint are dropped); the data order
continues (the step-STEPS loop state's remaining task order is a suffix of the step-2 one, in the
same pass); group ids continue after the last one used before the kill, so no id is reused and
the buffer refuses no duplicate; the fleet's cumulative counters continue instead of restarting.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tiny_run import NO_EVAL, QUIET, TINY_BATCH, replicas, set_args

pytestmark = pytest.mark.slow  # each test trains tiny runs (minutes on 2 cores)

STEPS = 4
KILL_AFTER_STEP = 2
TIMING_PREFIXES = ("time/", "throughput/")  # wall-clock measurements: the only keys allowed to differ
TIMING_SUFFIXES = ("/rented_s", "/cost/rented_usd", "/cost/rented_usd_per_trained_token", "/idle_fraction")  # the fleet's rented-time clock
RUN_TIMEOUT_S = 600


def _command(out: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hetrl.cli", "train", "tiny_homogeneous.yaml",
            *set_args([f"steps={STEPS}", f"output_dir={out}", "checkpointing.every=1", "checkpointing.keep=10", QUIET,
                       NO_EVAL, *TINY_BATCH, "async.max_new_tokens=24", "async.max_staleness=1", replicas(2)]), *extra]


def _steps(path: pathlib.Path) -> list[int]:
    """Steps of the complete records of ``path``: a run being written (or killed mid-write) may
    leave a last line without its newline, which is not a record yet."""
    return [json.loads(line)["step"] for line in path.read_text().split("\n")[:-1] if line.strip()]


def _kill_and_resume(out: pathlib.Path, *extra: str):
    """Run, SIGKILL once the step-2 state is on disk and a later record is written, resume."""
    proc = subprocess.Popen(_command(out, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    state = out / "checkpoints" / f"loop-{KILL_AFTER_STEP}.json"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        # kill once the step-2 state is on disk and the run has written a later record (mid-run, past the checkpoint)
        while not (state.exists() and (out / "metrics.jsonl").exists()
                   and max(_steps(out / "metrics.jsonl"), default=0) > KILL_AFTER_STEP):
            assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stderr.read()[-4000:]}"
            assert time.monotonic() < deadline, "the run did not reach its step-2 checkpoint in time"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    before = {"steps": _steps(out / "metrics.jsonl"), "loop": json.loads(state.read_text()),
              "checkpoints": sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())}
    resumed = subprocess.run(_command(out, *extra, "--resume"), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    return before, resumed


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_run")
    before, resumed = _kill_and_resume(out)
    return out, before, resumed


LOCKSTEP = ("--set", "async.schedule=lockstep", "--set", "async.max_staleness=0")
CHAOS = ("--set", "fleet.chaos={seed: 3, poison_rate: 0.15, slow_rate: 0.3, slow_s: 0.0}")
"""Faults drawn per call (poisoned generations, rejected by the gate; zero-length stalls): the
chaos wrapper must forward the per-step reseed, and restart its own draws, for the exact resume."""


MEGATRON_2_RANKS = ("--trainer", "megatron", "--set", "trainer.world_size=2", "--set", "trainer.mesh={data: 2, fsdp: 1, tensor: 1}")
"""Two Megatron ranks (data parallel, hetrl.orchestrator.trainer_ranks): the worker dies with the killed loop."""
JAX_2_PROCESSES = ("--set", "trainer.world_size=2")
"""Two JAX trainer processes joined by jax.distributed (their devices one fsdp mesh): both die with the killed loop."""


@pytest.mark.parametrize("trainer", [MEGATRON_2_RANKS, JAX_2_PROCESSES], ids=["megatron-2-ranks", "jax-2-processes"])
def test_lockstep_resume_after_a_kill_reproduces_the_uninterrupted_run_exactly(tmp_path, trainer):
    """Two trainer ranks, restored from their checkpoints in fresh processes. (Two data-parallel
    ranks need an even row count, so no faults here: the same resume under faults, chaos and
    the autopilot's pins, is tests/test_autopilot.py's.)"""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    extra = (*LOCKSTEP, *trainer)
    done = subprocess.run(_command(whole, *extra), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    before, _ = _kill_and_resume(cut, *extra)
    assert max(before["steps"]) > KILL_AFTER_STEP  # killed past its checkpoint: steps redone after the resume
    assert_same_records(whole, cut)


def assert_same_records(whole: pathlib.Path, cut: pathlib.Path) -> list[dict]:
    """The metrics of ``cut`` (killed and resumed) equal those of ``whole`` in every key but
    wall-clock timings; returns ``whole``'s records."""
    expected = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    for e, g in zip(expected, got):
        keys = {k for k in e.keys() | g.keys() if not k.startswith(TIMING_PREFIXES) and not k.endswith(TIMING_SUFFIXES)}
        assert len(keys) > 50
        assert {k: g.get(k) for k in keys} == {k: e.get(k) for k in keys}, e["step"]
    return expected


def test_the_kill_came_after_the_checkpoint(killed_and_resumed):
    _, before, _ = killed_and_resumed
    assert KILL_AFTER_STEP in before["checkpoints"] and max(before["steps"]) > KILL_AFTER_STEP


def test_every_step_is_logged_exactly_once(killed_and_resumed):
    out, _, resumed = killed_and_resumed
    assert _steps(out / "metrics.jsonl") == list(range(1, STEPS + 1))
    assert f"trainer version: {STEPS}" in resumed.stdout


def test_the_resumed_run_restored_the_checkpoint_not_step_zero(killed_and_resumed):
    out, before, _ = killed_and_resumed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the fleet's cumulative counters continue: the first resumed step counts the jobs before the checkpoint too
    jobs = [r["fleet/jobs"] for r in records]
    assert jobs == sorted(jobs) and jobs[KILL_AFTER_STEP] >= before["loop"]["fleet"]["pools"]["b200-bf16"]["jobs"]
    assert all(r["buffer/duplicates"] == 0 for r in records)


def test_data_order_and_group_ids_continue(killed_and_resumed):
    out, before, _ = killed_and_resumed
    after = json.loads((out / "checkpoints" / f"loop-{STEPS}.json").read_text())
    at_kill = before["loop"]
    assert after["passes"] == at_kill["passes"] >= 1
    order, rest = at_kill["order"], after["order"]
    assert len(rest) < len(order) and order[len(order) - len(rest):] == rest  # the same permutation, further on
    assert after["next_gid"] > at_kill["next_gid"]
