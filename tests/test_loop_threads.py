"""The loop's threads at shutdown: a replica restart still running when the run stops is joined,
and it starts no worker once the shutdown began (nothing joins the list after the stop flag)."""

import threading
import time
from types import SimpleNamespace

from hetrl.config import load_config
from hetrl.core.admission import QuarantineConfig, RolloutGate
from hetrl.core.buffer import RolloutBuffer
from hetrl.orchestrator.local import LocalOrchestrator
from hetrl.orchestrator.schedule import Driver, make_schedule
from hetrl.orchestrator.supervisor import ReplicaSupervisor
from hetrl.samplers.base import SamplerHealth


class _Fleet:
    """One dead replica whose revival always succeeds (even once closed: the loop alone must
    keep threads from starting after its shutdown)."""

    def __init__(self, pool):
        self.replica = SimpleNamespace(pool=pool, index=0, key=f"{pool.name}/0", alive=False, died_at=0.0)
        self.replicas, self.quarantined, self.numerics = [self.replica], {}, {pool.name: pool.numerics()}
        self.closed = threading.Event()

    def revive(self, replica, sampler):
        replica.alive = True
        return True

    def close(self):
        self.closed.set()


class _Orchestrator(LocalOrchestrator):
    """Builds a healthy fake sampler once ``release`` is set (a restart that takes a while)."""

    release = threading.Event()

    def _create_sampler(self, numerics, *, pool, seed):
        assert self.release.wait(10)
        return SimpleNamespace(health=lambda: SamplerHealth(healthy=True, weight_version=0))


def test_a_restart_running_at_shutdown_is_joined_and_starts_no_worker(tmp_path):
    cfg = load_config("tiny_homogeneous.yaml", [f"output_dir={tmp_path}", "fleet.restart={delay_s: 0}"])
    orch = _Orchestrator(cfg, console=False)
    orch.fleet, orch.buffer = _Fleet(cfg.fleet.pools[0]), RolloutBuffer(1)
    orch.schedule = make_schedule("async", orch.fleet, Driver(orch._top_up, orch._finish_group, orch._start_worker), 0)
    orch._lock, orch._stop, orch._threads, orch._errors = threading.RLock(), threading.Event(), [], []
    orch.supervisor = supervisor = ReplicaSupervisor(orch.fleet, RolloutGate(QuarantineConfig(), vocab_size=8, max_length=8, max_staleness=1),
                                   cfg.fleet.restart, orch._rebuild_sampler,
                                   start_thread=lambda target, r, name: orch._start_thread(target, r, name=name),
                                   on_revived=orch.schedule.revived, on_error=orch._record_error)
    assert supervisor.tend()  # a restart thread is building the sampler again
    restart = orch._threads[0]
    shutdown = threading.Thread(target=orch._shutdown)
    shutdown.start()
    assert orch.fleet.closed.wait(10)  # the shutdown began (the stop flag is set before the fleet closes)
    orch.release.set()  # the restart finishes now, and revives its replica
    shutdown.join(30)
    assert not shutdown.is_alive() and not restart.is_alive()
    assert [t.name for t in orch._threads] == [restart.name]  # no worker started after the stop
    assert not any(t.name.startswith("worker-") for t in threading.enumerate())
    orch.fleet.replica.alive, orch.fleet.replica.died_at = False, time.monotonic() - 1
    assert supervisor.tend() and orch._threads == [restart]  # none started once stopped
