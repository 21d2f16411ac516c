"""The replica supervisor: the one owner of what happens to sick replicas and misbehaving pools
(DESIGN §5): health probes, restarts, quarantine and aborts.

The fleet (:class:`hetrl.samplers.fleet.Fleet`) routes jobs, serves replicas and re-queues the
jobs of a replica that fails; every decision about a replica's life is taken here, and the loop
asks the supervisor, never the fleet, about them:

* **Health.** The fleet asks :meth:`ReplicaSupervisor.probe` at its one safe point, in the
  replica's serving thread before a ``generate`` call (after loading new weights). The sampler's
  ``health()`` is called only when a probe is due: the first call of a (re)built replica, the
  first call after it loaded a new weight version, and otherwise once ``health_every_s``
  (:class:`hetrl.samplers.fleet.RestartPolicy`) passed since its last healthy probe; a failure
  of the call itself is caught by the fleet either way. An unhealthy answer makes the fleet mark
  the replica dead and re-queue its jobs. (A server pool's ``/health`` is thus no longer asked
  before every call.)
* **Restarts.** :meth:`tend`, called by the trainer's thread whenever it tries to take a batch,
  starts rebuilding each dead replica the :class:`RestartPolicy` allows (its pool not
  quarantined, fewer than ``max_per_replica`` attempts, ``delay_s`` passed since it died or the
  last attempt failed), each in its own thread (``start_thread``, joined by the loop's
  shutdown): the sampler is built again (``rebuild``), must answer healthy, and is put back into
  routing (:meth:`Fleet.revive`); the schedule is told (``on_revived``). When no replica is alive
  and none can come back, :meth:`tend` raises :class:`FleetExhausted`.
* **Quarantine.** :meth:`admit` passes a replica's rollouts through the
  :class:`hetrl.core.admission.RolloutGate`, the record of rejections per pool and reason and of
  quarantine; when the gate quarantines a pool, the fleet takes it out of routing at once. The
  gate's record is the one truth: :meth:`quarantined` reads it, :meth:`restore` continues it
  after a resume and re-applies its quarantines to the fleet, and a quarantined pool is never
  restarted.
* **Aborts.** :meth:`abort_in_flight` (``weight_update: abort``, at each publication) aborts the
  calls running on every replica whose sampler has the
  :class:`hetrl.samplers.base.Abortable` capability; replicas without it finish their call, and
  the loop retracts what newer weights overtook at turn boundaries either way.

Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from hetrl.core.admission import Admission, RolloutGate
from hetrl.core.schema import Rollout, RolloutError
from hetrl.errors import UserError
from hetrl.samplers.base import Sampler, SamplerHealth, abort, can_abort
from hetrl.samplers.fleet import Fleet, FleetError, Replica, RestartPolicy

__all__ = ["ReplicaSupervisor", "FleetExhausted"]

log = logging.getLogger(__name__)

StartThread = Callable[[Callable[[Replica], None], Replica, str], None]
"""``start_thread(target, replica, name)``: run ``target(replica)`` in a thread the loop joins."""


class FleetExhausted(FleetError, UserError):
    """No sampler replica is alive and none can come back (dead past the restart policy, or
    quarantined): the run cannot go on until the pools are fixed (the loop checkpoints first)."""


class ReplicaSupervisor:
    """Health, restarts, quarantine and aborts of ``fleet``'s replicas (see the module docstring).

    ``gate``: the admission gate (the quarantine record); ``policy``: the restart policy;
    ``rebuild(replica)``: a new sampler for a dead replica; ``start_thread``: see
    :data:`StartThread`; ``on_revived(replica)``: a rebuilt replica is back in routing;
    ``on_error(message)``: a restart failed; ``clock``: seconds (tests)."""

    def __init__(self, fleet: Fleet, gate: RolloutGate, policy: RestartPolicy, rebuild: Callable[[Replica], Sampler], *,
                 start_thread: StartThread, on_revived: Callable[[Replica], None] = lambda r: None,
                 on_error: Callable[[str], None] = lambda m: None, clock: Callable[[], float] = time.monotonic):
        self.fleet, self.gate, self.policy = fleet, gate, policy
        self._rebuild, self._start_thread = rebuild, start_thread
        self._on_revived, self._on_error, self._clock = on_revived, on_error, clock
        self._lock = threading.Lock()
        self._attempts: dict[str, int] = {}       # replica key -> restarts started
        self._restarting: set[str] = set()        # replica keys being rebuilt now
        self._retry_at: dict[str, float] = {}     # replica key -> earliest next attempt after a failed one
        self._probed: dict[str, tuple[tuple[int, int | None], float]] = {}  # key -> ((restarts, version), time)
        fleet.health_probe = self.probe

    # ------------------------------------------------------------------ health
    def probe(self, replica: Replica) -> SamplerHealth | None:
        """``replica.sampler.health()`` when a probe is due (module docstring), else None."""
        mark = (replica.restarts, replica.weight_version)
        now = self._clock()
        with self._lock:
            last = self._probed.get(replica.key)
            if last is not None and last[0] == mark and now - last[1] < self.policy.health_every_s:
                return None
        health = replica.sampler.health()
        with self._lock:
            if health.healthy:
                self._probed[replica.key] = (mark, now)
            else:
                self._probed.pop(replica.key, None)
        return health

    # ------------------------------------------------------------------ restarts
    def tend(self, *, need_replicas: bool = False) -> bool:
        """Start rebuilding each dead replica the policy allows (each in its own thread). Returns
        whether any dead replica is being rebuilt or may still be. ``need_replicas`` (the trainer
        found no batch): raise :class:`FleetError` if no replica is alive and none can come back."""
        now, pending = self._clock(), False
        for r in self.fleet.replicas:
            if r.alive or r.died_at is None or self.gate.is_quarantined(r.pool.name):
                continue
            with self._lock:
                if self._attempts.get(r.key, 0) >= self.policy.max_per_replica:
                    continue
                pending = True
                if (r.key in self._restarting or now - r.died_at < self.policy.delay_s
                        or now < self._retry_at.get(r.key, 0.0)):
                    continue
                self._restarting.add(r.key)
                self._attempts[r.key] = self._attempts.get(r.key, 0) + 1
            self._start_thread(self._restart, r, f"restart-{r.key}")
        if need_replicas and not pending and not any(r.alive for r in self.fleet.replicas):
            causes = [f"{r.key}: {r.cause}" for r in self.fleet.replicas if r.cause]
            raise FleetExhausted("every sampler replica is dead or quarantined and none is being restarted "
                                 f"(quarantined: {', '.join(self.quarantined()) or 'none'}; what killed the replicas: "
                                 f"{'; '.join(causes[:3]) or 'nothing recorded'}{' ...' if len(causes) > 3 else ''})")
        return pending

    def _restart(self, replica: Replica) -> None:
        """Build ``replica``'s sampler again; once it answers healthy, put it back into routing."""
        try:
            sampler = self._rebuild(replica)
            health = sampler.health()
            if not health.healthy:
                raise RuntimeError(f"unhealthy after restart: {health.detail}")
            if self.fleet.revive(replica, sampler):
                self._on_revived(replica)
        except Exception as err:  # try again after the delay, while attempts remain
            log.warning("restarting replica %s failed: %s", replica.key, err)
            with self._lock:
                self._retry_at[replica.key] = self._clock() + self.policy.delay_s
            self._on_error(f"restart of {replica.key} failed: {err}")
        finally:
            with self._lock:
                self._restarting.discard(replica.key)

    # ------------------------------------------------------------------ quarantine
    def admit(self, pool: str, rollouts: Sequence[Rollout], rejected: Sequence[RolloutError] = (), *,
              published_version: int) -> Admission:
        """The gate's :meth:`RolloutGate.admit`; a pool it quarantines leaves the fleet's routing now."""
        admission = self.gate.admit(pool, rollouts, rejected, published_version=published_version)
        if admission.quarantined is not None:
            self.fleet.quarantine(pool, admission.quarantined)
        return admission

    def is_quarantined(self, pool: str) -> bool:
        return self.gate.is_quarantined(pool)

    def quarantined(self) -> dict[str, str]:
        """The message of every quarantined pool (the gate's record)."""
        return self.gate.quarantined()

    def state(self) -> dict[str, Any]:
        """The gate's record, for a checkpoint (:meth:`restore`)."""
        return self.gate.state()

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the gate's record of :meth:`state`; its quarantined pools leave routing again."""
        self.gate.restore_state(state)
        for pool, reason in self.gate.quarantined().items():
            self.fleet.quarantine(pool, reason)

    # ------------------------------------------------------------------ aborts
    def abort_in_flight(self) -> int:
        """Abort the running calls of every alive replica that can abort (a replica with no call
        running is unaffected); returns how many replicas were told. A replica that fails to take
        the abort is left to the fleet (its call fails or finishes)."""
        told = 0
        for r in self.fleet.replicas:
            if not r.alive or not can_abort(r.sampler):
                continue
            try:
                abort(r.sampler)
                told += 1
            except Exception as err:
                log.warning("aborting the calls of replica %s failed: %s", r.key, err)
        return told
