"""The Ray backend end to end (hetrl.orchestrator.ray_backend): the same loop with every sampler
and the trainer in Ray actors, checked against the invariants of the local backend's tests.

One short run (3 steps, tiny sizes, a private local Ray instance) with two pools: ``fast`` has
two replica actors, and the test kills the second one with ``ray.kill`` while its first generate
call (which includes the jit compile, so it lasts seconds) is in flight: its jobs must be
re-queued and finished by the other replica, never lost or trained twice. ``slow`` sleeps before
every call (on the driver side), so its groups are the stalest; none may be trained beyond
max_staleness. The run is bounded: it must finish within RUN_TIMEOUT_S.
"""

import threading
import time

import pytest
import ray

from hetrl.config import load_config
from hetrl.orchestrator import build_orchestrator
from hetrl.orchestrator.ray_backend import RayOrchestrator
from hetrl.samplers.faults import Slow
from orchestrator_checks import check_monotone_versions, check_outputs, check_requeued_exactly_once, check_staleness
from tiny_run import TINY_BATCH

MAX_STALENESS = 1
RUN_TIMEOUT_S = 300
KILLED = "fast/1"


def _kill_mid_generation(orch: RayOrchestrator, done: threading.Event, killed: dict) -> None:
    """Wait until replica KILLED has jobs in flight for 0.5 s (its generate call is running in the
    actor), record them, then kill its actor."""
    while not done.is_set():
        fleet = getattr(orch, "fleet", None)
        replica = next((r for r in fleet.replicas if r.key == KILLED), None) if fleet else None
        jobs = [j.job_id for j in list(replica.in_flight)] if replica else []
        if jobs:
            time.sleep(0.5)
            if [j.job_id for j in list(replica.in_flight)] == jobs:
                killed["jobs"] = set(jobs)
                ray.kill(orch.replica_actor(KILLED))
                return
        time.sleep(0.01)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray-run")
    cfg = load_config("tiny_mixed.yaml", [
        f"output_dir={out}", "checkpointing.every=2",
        "steps=3", *TINY_BATCH,
        f"async.max_staleness={MAX_STALENESS}", "backend=ray",
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3, replicas: 2},"
        " {name: slow, accelerator: a100, weight_precision: bf16}]",
        "fleet.restart={max_per_replica: 0}",  # the killed actor is not replaced: the pool shrinks
        "environment.options={eval: {every: 3, tasks: 2}, coding: {max_turns: 2}}",
    ])
    orch = build_orchestrator(cfg, wrap_sampler=lambda pool, i, s: Slow(s, 1.5) if pool.name == "slow" else s,
                              console=False)
    assert isinstance(orch, RayOrchestrator)
    done, killed, outcome = threading.Event(), {}, {}

    def target():
        try:
            outcome["result"] = orch.run()
        except BaseException as err:  # re-raised in the test thread
            outcome["error"] = err
        finally:
            done.set()

    runner = threading.Thread(target=target, daemon=True)
    killer = threading.Thread(target=_kill_mid_generation, args=(orch, done, killed), daemon=True)
    runner.start()
    killer.start()
    runner.join(RUN_TIMEOUT_S)
    done.set()
    assert not runner.is_alive(), f"the Ray run did not finish within {RUN_TIMEOUT_S} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], killed


@pytest.mark.slow
def test_ray_run_completes_and_writes_outputs(run):
    result, _ = run
    assert result.final["backend"] == "ray"
    check_outputs(result, steps=3, eval_steps=[0, 3])
    assert not ray.is_initialized()  # the private instance was shut down


@pytest.mark.slow
def test_ray_weight_versions_are_monotone_per_replica(run):
    check_monotone_versions(run[0])


@pytest.mark.slow
def test_ray_no_trained_group_is_older_than_max_staleness(run):
    check_staleness(run[0], MAX_STALENESS)


@pytest.mark.slow
def test_ray_killed_actor_jobs_are_requeued_exactly_once(run):
    result, killed = run
    assert "jobs" in killed, f"replica {KILLED} never had a generate call in flight"
    check_requeued_exactly_once(result, killed["jobs"], KILLED)


def test_backend_flag_sets_the_config_key(capsys):
    from hetrl.cli import main

    assert main(["train", "tiny_mixed.yaml", "--backend", "ray", "--dry-run"]) == 0
    assert "\nbackend: ray\n" in capsys.readouterr().out
    assert main(["train", "tiny_mixed.yaml", "--dry-run"]) == 0
    assert "\nbackend: local\n" in capsys.readouterr().out


def test_a_bad_backend_fails_naming_the_key():
    from hetrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--set backend=rai: Input should be 'local' or 'ray'"):
        load_config("tiny_mixed.yaml", ["backend=rai"])
    with pytest.raises(ConfigError, match=r"^--set ray\.num_cpus=0: Input should be greater than or equal to 1"):
        load_config("tiny_mixed.yaml", ["ray.num_cpus=0"])


@pytest.mark.slow
def test_ray_sampler_abort_reaches_the_running_call(tmp_path):
    """The Ray proxy forwards the Abortable capability: ``abort`` is sent beside the actor's
    running ``generate`` (its own concurrency group), which returns cut, ``finish_reason`` abort."""
    import os
    import shutil
    import tempfile

    import numpy as np

    from hetrl.core.schema import SamplingParams
    from hetrl.models.tiny import TINY_QWEN3, build_tiny_checkpoint
    from hetrl.orchestrator.loop import build_embedded_sampler
    from hetrl.orchestrator.ray_backend import HostActor, RaySampler
    from hetrl.samplers.base import GenerationRequest, abort, can_abort
    from hetrl.samplers.profiles import sampler_numerics

    assert not ray.is_initialized()
    model = build_tiny_checkpoint(tmp_path / "model", TINY_QWEN3, seed=0, init_std=0.15)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="hetrl-ray-", dir="/tmp")
    ray.init(num_cpus=1, _temp_dir=temp, include_dashboard=False)
    try:
        sampler = RaySampler(HostActor.remote(build_embedded_sampler, model, sampler_numerics("fp32"), pool="p", seed=0))
        assert can_abort(sampler)
        n = 512
        reqs = [GenerationRequest("a/0", np.array([5, 6, 7], np.int32), SamplingParams(top_k=20), n)]
        assert sampler.generate(reqs)[0].finish_reason == "length"  # compiled now: the next call only decodes
        out: list = []
        call = threading.Thread(target=lambda: out.extend(sampler.generate(reqs)))
        call.start()
        while ray.get(sampler.actor.signal.remote("health")).in_flight == 0:  # read beside the running call
            time.sleep(0.01)
        abort(sampler)
        call.join(60)
        assert out[0].finish_reason == "abort" and 1 <= len(out[0].token_ids) < n
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_failed_ray_trainer_rank_ends_the_gang_with_one_error_naming_it():
    """The others wait in a collective the failed rank never joins: the handle must not wait for
    them, but kill every rank actor and raise one TrainerRankFailed naming the rank, then refuse."""
    import os
    import shutil
    import tempfile

    from hetrl.orchestrator.ray_backend import RayTrainerRanks, TrainerActor
    from hetrl.orchestrator.trainer_ranks import TrainerRankFailed

    class _RankStuckOrFailing:  # local: Ray pickles it by value (the actors cannot import the tests)
        """A stand-in trainer rank: rank 1 fails its call, rank 0 waits as in a collective that never completes."""

        def __init__(self, rank: int):
            self.rank, self.version = rank, 0

        def execute(self, op, *args, **kwargs):
            if self.rank == 1:
                raise ValueError(f"rank 1 broke in {op}")
            time.sleep(600)

    assert not ray.is_initialized()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="hetrl-ray-", dir="/tmp")
    ray.init(num_cpus=1, _temp_dir=temp, include_dashboard=False)
    try:
        actors = [TrainerActor.remote(_RankStuckOrFailing, rank) for rank in range(2)]
        ranks = RayTrainerRanks(actors)
        start = time.monotonic()
        with pytest.raises(TrainerRankFailed, match=r"failed in save \(2 ranks on Ray\): rank 1 failed: ValueError: rank 1 broke in save"):
            ranks.save(force=True)
        assert time.monotonic() - start < 60
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actors[0].attribute.remote("version"), timeout=60)  # killed, not left waiting
        with pytest.raises(TrainerRankFailed):
            ranks.checkpoint_steps()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
