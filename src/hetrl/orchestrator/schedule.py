"""When and where the loop's groups are generated: the schedule strategies of ``async.schedule``.

* :class:`AsyncSchedule` (``async``): one rollout worker thread per replica serves whatever the
  fleet routes to it, continuously, while the trainer steps; groups go wherever routing sends them.
* :class:`LockstepSchedule` (``lockstep``): no worker threads. Group ``i`` is pinned to alive
  replica ``i mod n`` (fleet order; under the autopilot's shares, to a replica drawn by a
  deterministic low-discrepancy sequence, :meth:`LockstepSchedule.pin`), and before each batch is taken the trainer's thread serves
  the replicas one by one, each reseeded from (seed, trainer version, replica) first, playing
  every group to its end (:meth:`LockstepSchedule.before_take`). So the step's groups, their
  samples and their order are a function of the run's state alone, and a resumed run repeats
  the uninterrupted one exactly.

A schedule drives the loop through a :class:`Driver` (the orchestrator's hooks): it starts
workers and plays groups; it keeps no state of the run.
"""

from __future__ import annotations

import abc
import time
import zlib
from dataclasses import dataclass
from typing import Callable

from hetrl.samplers.base import reseed
from hetrl.samplers.fleet import Fleet, JobResult, Replica

__all__ = ["Driver", "Schedule", "AsyncSchedule", "LockstepSchedule", "make_schedule"]

_GOLDEN = (5 ** 0.5 - 1) / 2


@dataclass(frozen=True)
class Driver:
    """What a schedule needs of the loop: ``top_up()`` submits groups up to the outstanding
    bound; ``finish_group(replica, result)`` plays a served job's group to its end on ``replica``
    and buffers it; ``start_worker(replica)`` starts a rollout worker thread serving it (none
    once the run stops)."""

    top_up: Callable[[], None]
    finish_group: Callable[[Replica, JobResult], None]
    start_worker: Callable[[Replica], None]


class Schedule(abc.ABC):
    """When and where groups are generated (see the module docstring)."""

    take_timeout_s: float
    """How long the trainer waits for a batch per try."""

    def __init__(self, fleet: Fleet, driver: Driver):
        self.fleet, self.driver = fleet, driver

    @abc.abstractmethod
    def start(self) -> None:
        """Begin generating (once the first groups are submitted)."""

    @abc.abstractmethod
    def revived(self, replica: Replica) -> None:
        """``replica`` was restarted and is back in routing."""

    @abc.abstractmethod
    def pin(self, index: int) -> str | None:
        """The replica key the ``index``-th group is pinned to (None: routed by the fleet)."""

    @abc.abstractmethod
    def before_take(self, trainer_version: int) -> None:
        """Work in the trainer's thread before each try to take a batch at ``trainer_version``."""


class AsyncSchedule(Schedule):
    """``async``: workers serve every replica continuously (see the module docstring)."""

    take_timeout_s = 0.5  # the workers fill the buffer meanwhile

    def start(self) -> None:
        """One worker per replica."""
        for r in self.fleet.replicas:
            self.driver.start_worker(r)

    def revived(self, replica: Replica) -> None:
        """Serve it again in a new worker."""
        self.driver.start_worker(replica)

    def pin(self, index: int) -> str | None:
        return None

    def before_take(self, trainer_version: int) -> None:
        """Nothing: the workers generate."""


class LockstepSchedule(Schedule):
    """``lockstep``: deterministic rounds in the trainer's thread (see the module docstring);
    ``seed`` is the run's."""

    take_timeout_s = 0.0

    def __init__(self, fleet: Fleet, driver: Driver, seed: int, sleep: Callable[[float], None] = time.sleep):
        super().__init__(fleet, driver)
        self.seed, self._sleep = seed, sleep

    def start(self) -> None:
        """No worker threads: :meth:`before_take` generates."""

    def revived(self, replica: Replica) -> None:
        """Served in the next round like every alive replica."""

    def pin(self, index: int) -> str | None:
        """Alive replica ``index mod n`` (fleet order); under routing shares
        (:meth:`Fleet.set_shares`), the replica whose interval of the cumulative routing
        capacities holds ``frac((index + 1/2) x golden ratio)``: a deterministic sequence in which
        each replica's fraction of groups tends to its share."""
        if self.fleet.shares is None:
            alive = [r.key for r in self.fleet.replicas if r.alive]
            return alive[index % len(alive)] if alive else None
        capacity = self.fleet.routing_capacity()
        keys = [r.key for r in self.fleet.replicas if capacity.get(r.key, 0.0) > 0]
        if not keys:
            return None
        u = ((index + 0.5) * _GOLDEN) % 1.0 * sum(capacity[k] for k in keys)
        for key in keys:
            u -= capacity[key]
            if u < 0:
                return key
        return keys[-1]

    def before_take(self, trainer_version: int) -> None:
        """Submit what the step still needs, then, replica by replica in fleet order, reseed it
        from (seed, ``trainer_version``, replica) and serve every job pinned to it, playing each
        group to the end and buffering it, all in this thread."""
        self.driver.top_up()
        served = False
        for r in self.fleet.replicas:
            if not (r.alive and r.assigned):
                continue
            reseed(r.sampler, zlib.crc32(f"{self.seed}/{trainer_version}/{r.key}".encode()))
            while r.alive and r.assigned:
                for result in self.fleet.serve_once(r, timeout=0):
                    served = True
                    self.driver.finish_group(r, result)
        if not served:  # nothing to serve (replicas dead and restarting): do not spin
            self._sleep(0.1)


def make_schedule(name: str, fleet: Fleet, driver: Driver, seed: int) -> Schedule:
    """The schedule ``name`` (``async.schedule``: ``async`` or ``lockstep``)."""
    if name == "lockstep":
        return LockstepSchedule(fleet, driver, seed)
    if name == "async":
        return AsyncSchedule(fleet, driver)
    raise ValueError(f"unknown schedule {name!r}; choose 'async' or 'lockstep'")
