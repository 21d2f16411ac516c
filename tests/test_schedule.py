"""The schedule strategies (hetrl.orchestrator.schedule): what each starts, pins and serves."""

from types import SimpleNamespace

import pytest

from hetrl.orchestrator.schedule import AsyncSchedule, Driver, LockstepSchedule, make_schedule
from hetrl.samplers.base import CapabilityMissing


class _Sampler:
    supports_reseed = True

    def __init__(self):
        self.seeds = []
        self.info = SimpleNamespace(pool="p", engine="embedded")

    def reseed(self, seed):
        self.seeds.append(seed)


def _replica(key, jobs=(), alive=True):
    return SimpleNamespace(key=key, alive=alive, assigned=list(jobs), sampler=_Sampler())


class _Fleet:
    shares = None  # capacity routing (the autopilot's shares: test_autopilot.py)

    def __init__(self, *replicas):
        self.replicas = list(replicas)

    def serve_once(self, replica, timeout=None):
        return [replica.assigned.pop(0)] if replica.assigned else []


def _driver(log):
    return Driver(lambda: log.append("top_up"), lambda r, job: log.append((r.key, job)),
                  lambda r: log.append(("worker", r.key)))


def test_async_starts_a_worker_per_replica_and_one_per_revival_and_pins_nothing():
    log = []
    fleet = _Fleet(_replica("a/0"), _replica("b/0"))
    s = make_schedule("async", fleet, _driver(log), seed=1)
    assert isinstance(s, AsyncSchedule) and s.pin(3) is None and s.take_timeout_s > 0
    s.start()
    s.revived(fleet.replicas[1])
    s.before_take(0)
    assert log == [("worker", "a/0"), ("worker", "b/0"), ("worker", "b/0")]


def test_lockstep_pins_round_robin_over_alive_replicas_and_serves_them_in_order_reseeded():
    log = []
    fleet = _Fleet(_replica("a/0", ["j1", "j2"]), _replica("a/1", alive=False), _replica("b/0", ["j3"]))
    s = make_schedule("lockstep", fleet, _driver(log), seed=5)
    assert isinstance(s, LockstepSchedule) and s.take_timeout_s == 0
    assert [s.pin(i) for i in range(4)] == ["a/0", "b/0", "a/0", "b/0"]
    s.start()
    s.revived(fleet.replicas[1])
    assert log == []  # no worker threads
    s.before_take(7)
    assert log == ["top_up", ("a/0", "j1"), ("a/0", "j2"), ("b/0", "j3")]
    a, b = list(fleet.replicas[0].sampler.seeds), list(fleet.replicas[2].sampler.seeds)
    assert len(a) == len(b) == 1 and a != b and not fleet.replicas[1].sampler.seeds
    fleet.replicas[0].assigned = ["j4"]
    s.before_take(7)
    assert fleet.replicas[0].sampler.seeds == a * 2  # the same version and replica: the same stream


def test_lockstep_refuses_a_replica_that_cannot_reseed():
    fleet = _Fleet(_replica("a/0", ["j1"]))
    fleet.replicas[0].sampler.supports_reseed = False
    with pytest.raises(CapabilityMissing, match="cannot reseed"):
        make_schedule("lockstep", fleet, _driver([]), seed=0).before_take(0)


def test_an_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="unknown schedule 'sync'"):
        make_schedule("sync", _Fleet(), _driver([]), seed=0)
