"""The replica supervisor: health probed when due (not before every call), dead replicas rebuilt
per the restart policy, quarantine taken from the admission gate's record into the fleet's
routing (also on resume), aborts sent to the replicas that can abort.

The fleet and the gate are the real ones; the samplers are test doubles of the Sampler protocol
(the supervisor is under test, not them). Restart threads run inline, the clock is a counter."""

import time

import numpy as np
import pytest

from factories import random_rollout
from hetrl.core.admission import QuarantineConfig, RolloutGate
from hetrl.core.schema import SamplingParams
from hetrl.orchestrator.supervisor import ReplicaSupervisor
from hetrl.samplers.base import Generation, GenerationRequest, SamplerHealth
from hetrl.samplers.fleet import Fleet, FleetError, PoolConfig, RestartPolicy

A = PoolConfig(name="h100-fp8", accelerator="h100", weight_precision="fp8_e4m3")
B = PoolConfig(name="a100-bf16", accelerator="a100", weight_precision="bf16")


class Fake:
    """Counts ``health()`` calls and aborts; ``healthy`` says what health answers."""

    supports_abort = True

    def __init__(self, pool: PoolConfig, healthy: bool = True, abortable: bool = True):
        self._info = pool.numerics().sampler_info(pool.name, pool.engine, "fake")
        self.healthy, self.probes, self.aborts, self.version = healthy, 0, 0, 0
        self.supports_abort = abortable

    @property
    def info(self):
        return self._info

    def generate(self, requests):
        return [Generation(r.request_id, np.arange(2, dtype=np.int32), np.full(2, -0.1, np.float32),
                           np.full(2, self.version, np.int64), "length", None, self._info) for r in requests]

    def update_weights(self, version, weights):
        self.version = version

    def health(self):
        self.probes += 1
        return SamplerHealth(healthy=self.healthy, weight_version=self.version, detail="ok" if self.healthy else "down")

    def abort(self):
        self.aborts += 1


class Clock:
    """Monotonic seconds (the fleet stamps deaths with time.monotonic), moved by hand."""

    def __init__(self):
        self.now = time.monotonic()

    def __call__(self):
        return self.now


def job(fleet, name, replica=None):
    fleet.submit(name, [GenerationRequest(f"{name}/0", np.array([1, 2], np.int32), SamplingParams(), 2)], replica=replica)


def setup(*samplers, policy=RestartPolicy(max_per_replica=2, delay_s=1.0, health_every_s=10.0), rebuild=None, **quarantine):
    fleet = Fleet([(A if s.info.pool == A.name else B, s) for s in samplers])
    gate = RolloutGate(QuarantineConfig(**quarantine), vocab_size=50, max_length=64, max_staleness=1)
    clock, revived, errors, threads = Clock(), [], [], []

    def start_thread(target, replica, name):
        threads.append(name)
        target(replica)

    sup = ReplicaSupervisor(fleet, gate, policy, rebuild or (lambda r: Fake(r.pool)), start_thread=start_thread,
                            on_revived=revived.append, on_error=errors.append, clock=clock)
    return fleet, sup, clock, revived, errors, threads


def test_health_is_probed_after_a_start_a_weight_load_or_the_interval_not_before_every_call():
    s = Fake(A)
    fleet, sup, clock, *_ = setup(s)
    for i in range(3):
        job(fleet, f"g{i}")
        assert len(fleet.serve_once(fleet.replicas[0], timeout=1)) == 1
    assert s.probes == 1  # the first call only
    fleet.publish_weights(1, {})
    job(fleet, "g3")
    fleet.serve_once(fleet.replicas[0], timeout=1)
    assert s.probes == 2  # after loading new weights
    clock.now += 10.0
    job(fleet, "g4")
    fleet.serve_once(fleet.replicas[0], timeout=1)
    assert s.probes == 3  # the interval passed
    s.healthy = False
    job(fleet, "g5")
    fleet.serve_once(fleet.replicas[0], timeout=1)
    assert fleet.replicas[0].alive  # not due yet: the call itself would have to fail
    clock.now += 10.0
    job(fleet, "g6")
    assert fleet.serve_once(fleet.replicas[0], timeout=1) == []
    assert not fleet.replicas[0].alive  # unhealthy when probed: dead, its job back in the queue


def test_dead_replicas_are_rebuilt_after_the_delay_at_most_max_per_replica_times():
    s = Fake(A, healthy=False)
    built = []

    def rebuild(replica):
        built.append(Fake(replica.pool, healthy=len(built) > 0))  # the first rebuild is unhealthy too
        return built[-1]

    fleet, sup, clock, revived, errors, threads = setup(s, rebuild=rebuild)
    job(fleet, "g0")
    assert fleet.serve_once(fleet.replicas[0], timeout=1) == [] and not fleet.replicas[0].alive
    assert sup.tend() and threads == []  # pending, but the delay has not passed
    clock.now += 1.5
    assert sup.tend() and len(threads) == 1 and errors and "unhealthy after restart" in errors[0]
    assert not fleet.replicas[0].alive and revived == []
    assert sup.tend() and len(threads) == 1  # a failed attempt waits the delay again
    clock.now += 1.5
    sup.tend()
    assert len(threads) == 2 and fleet.replicas[0].alive and revived == [fleet.replicas[0]]
    assert fleet.replicas[0].sampler is built[1] and fleet.replicas[0].restarts == 1
    (done,) = fleet.serve_once(fleet.replicas[0], timeout=1)  # the re-queued job, on the rebuilt replica
    assert done.job_id == "g0" and built[1].probes == 2  # probed by the restart and before its first call
    built[1].healthy = False
    clock.now += 10.0
    job(fleet, "g1")
    fleet.serve_once(fleet.replicas[0], timeout=1)
    clock.now += 1.5
    assert not sup.tend() and len(threads) == 2  # both attempts used: the pool shrinks
    with pytest.raises(FleetError, match="every sampler replica is dead"):
        sup.tend(need_replicas=True)


def _rollout(pool: str, seed: int, version: int = 0):
    r, _ = random_rollout(np.random.default_rng(seed), vocab=50, response_len=4, pool=pool, version=version,
                          rollout_id=f"{pool}-{seed}")
    return r


def test_the_gate_quarantine_takes_the_pool_out_of_routing_and_is_never_restarted():
    a, b = Fake(A), Fake(B)
    fleet, sup, clock, revived, errors, threads = setup(a, b, max_rejection_rate=0.5, min_rollouts=2, window=4)
    fleet.publish_weights(5, {})
    admission = sup.admit(A.name, [_rollout(A.name, 0, version=5), _rollout(A.name, 1)], published_version=5)
    assert admission.quarantined is None and fleet.replicas[0].alive  # one fresh, one stale (version 0)
    admission = sup.admit(A.name, [_rollout(A.name, 2)], published_version=5)
    assert admission.quarantined and sup.is_quarantined(A.name) and set(sup.quarantined()) == {A.name}
    assert fleet.quarantined == sup.quarantined() and not fleet.replicas[0].alive
    clock.now += 100.0
    assert not sup.tend() and threads == []  # quarantined: never rebuilt
    # resume: the gate's record comes back and the fleet's routing follows it
    fleet2, sup2, *_ = setup(Fake(A), Fake(B))
    sup2.restore(sup.state())
    assert fleet2.quarantined == sup.quarantined() and not fleet2.replicas[0].alive and fleet2.replicas[1].alive


def test_aborts_reach_the_alive_replicas_that_can_abort():
    a, b, c = Fake(A), Fake(B, abortable=False), Fake(A)
    fleet, sup, *_ = setup(a, b, c)
    c.healthy = False
    job(fleet, "g0", replica="h100-fp8/1")
    assert fleet.serve_once("h100-fp8/1", timeout=1) == []
    assert [r.alive for r in fleet.replicas] == [True, True, False]
    assert sup.abort_in_flight() == 1
    assert (a.aborts, b.aborts, c.aborts) == (1, 0, 0)
