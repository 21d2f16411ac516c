"""The group ledger: the one record of every group's state in a run of the loop.

A group (one prompt, ``group_size`` rollouts, one group id) is *submitted* to the fleet and is
then **in flight** until one outcome closes it: *received* (put into the buffer: it is then
**buffered** until it is *trained* or *dropped* by the buffer's staleness policy), *rejected*
(none of its rollouts admitted), *retracted* (overtaken by newer weights, ``weight_update:
abort``), *failed* (a later turn failed) or *refused* (the buffer had seen its id). A group in
flight or buffered is **live**: the loop's bound on outstanding work counts the live groups
(:attr:`GroupLedger.outstanding`), nothing else keeps that count.

Only live groups hold memory beyond their id: an in-flight group its :class:`GroupSpec` (task and
prompt ids), a buffered one its id. A closed group leaves nothing but its id in the outcome lists
(:class:`hetrl.orchestrator.loop.RunResult`'s record) and, when trained, one tuple.

Not thread-safe on its own: the loop updates it under its lock, together with the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

import numpy as np

from hetrl.envs.base import Task

__all__ = ["GroupSpec", "GroupLedger", "Closed"]

Closed = Literal["rejected", "retracted", "failed", "refused"]
"""The outcomes that close an in-flight group without buffering it."""


@dataclass(frozen=True)
class GroupSpec:
    """What an in-flight group needs to be played and, if need be, submitted again."""

    group_id: str
    task: Task
    prompt: np.ndarray
    submitted_at: float
    replica: str | None = None  # the replica key it is pinned to (lockstep); None: routed by the fleet


class GroupLedger:
    """Every group's state (see the module docstring). ``pending``: the ids of the groups a
    restored buffer holds (buffered, from before a resume)."""

    def __init__(self, pending: Iterable[str] = ()):
        self._in_flight: dict[str, GroupSpec] = {}
        self._buffered: set[str] = set(pending)
        self.submitted: list[str] = []
        self.received: list[str] = []
        self.closed: dict[Closed, list[str]] = {"rejected": [], "retracted": [], "failed": [], "refused": []}
        self.trained: list[tuple[str, str, int, int]] = []
        """``(group_id, pool, min_version, trainer_version)`` per trained group, in order."""
        self.dropped = 0

    # ------------------------------------------------------------------ transitions
    def submit(self, spec: GroupSpec) -> None:
        """``spec``'s group is sent to the fleet: in flight. Raises ValueError for a known id."""
        if spec.group_id in self._in_flight or spec.group_id in self._buffered:
            raise ValueError(f"group {spec.group_id!r} is already live")
        self._in_flight[spec.group_id] = spec
        self.submitted.append(spec.group_id)

    def spec(self, group_id: str) -> GroupSpec | None:
        """The spec of in-flight group ``group_id`` (None once it is closed or buffered: e.g. a
        result the fleet delivers a second time)."""
        return self._in_flight.get(group_id)

    def receive(self, group_id: str) -> None:
        """In flight -> buffered (its spec leaves)."""
        del self._in_flight[group_id]
        self._buffered.add(group_id)
        self.received.append(group_id)

    def close(self, group_id: str, outcome: Closed) -> None:
        """In flight -> ``outcome`` (its spec leaves)."""
        del self._in_flight[group_id]
        self.closed[outcome].append(group_id)

    def train(self, groups: Iterable[tuple[str, str, int]], trainer_version: int) -> None:
        """Buffered -> trained: ``(group_id, pool, min_version)`` per group of the step trained
        at ``trainer_version`` (once its weights are published)."""
        for gid, pool, min_version in groups:
            self._buffered.discard(gid)
            self.trained.append((gid, pool, min_version, trainer_version))

    def drop(self, group_ids: Iterable[str]) -> None:
        """Buffered -> dropped (evicted by the buffer as too stale)."""
        for gid in group_ids:
            self._buffered.discard(gid)
            self.dropped += 1

    # ------------------------------------------------------------------ reading
    @property
    def outstanding(self) -> int:
        """Live groups: in flight or buffered (a batch being trained counts until published)."""
        return len(self._in_flight) + len(self._buffered)

    def in_flight(self) -> list[GroupSpec]:
        """The specs of the groups in flight, in submission order."""
        return list(self._in_flight.values())
