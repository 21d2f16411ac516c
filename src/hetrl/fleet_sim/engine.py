"""A discrete-event simulation of the asynchronous loop at cluster scale (DESIGN §8).

The simulated loop is the orchestrator's (:mod:`hetrl.orchestrator.loop`), with time modelled
(:mod:`hetrl.fleet_sim.config`) instead of spent:

* **Feeding.** At most ``(max_staleness + 1) · batch_groups`` groups are outstanding (submitted
  and not yet trained or dropped; a trained batch counts until its step is published); groups
  evicted under ``stale_policy: regenerate`` are submitted again first, under a new id.
* **Routing** is the fleet's rule (:mod:`hetrl.samplers.fleet`): jobs (one group of
  ``group_size`` requests) wait in a FIFO queue and go, in order, to the alive replica of least
  ``(load + n) / capacity`` (ties: the faster, then the first), where a replica holds at most
  ``slots = max(1, round(max_batch · capacity / max capacity))`` requests unless idle. The rule
  is restated here, not imported: the fleet applies it inside its lock-guarded, threaded state
  (:meth:`hetrl.samplers.fleet.Fleet.submit`), and ``bench/fleet_sim_validation.py`` checks the
  two against each other through the per-pool figures of paced runs.
* **Serving.** An idle replica with work takes its assigned jobs (up to ``max_batch``
  requests), loads the newest weights if its are older (sync time), and generates them in
  ``tokens / tokens-per-s``; all its groups carry the weight version it loaded.
* **The buffer is the real one**: :class:`hetrl.core.buffer.RolloutBuffer` with the run's
  ``max_staleness`` and ``stale_policy`` (staleness, eviction at put and take, oldest policy
  first); the simulation feeds it light group records with the fields it reads.
* **Training.** When the trainer is idle it takes ``batch_groups`` groups at its version; the
  step lasts the modelled step time; then the version is published.
* **Spot preemptions** and restarts as in :class:`hetrl.fleet_sim.config.SimPool`.

Everything random (response lengths, preemptions) comes from one generator seeded by
``SimConfig.seed``, drawn in event order, so a run is a function of its config.
The run ends when the last of ``steps`` steps is published.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetrl.core.buffer import RolloutBuffer
from hetrl.fleet_sim.config import SimConfig

__all__ = ["SimulationError", "simulate"]


class SimulationError(RuntimeError):
    """The simulated loop cannot make progress (e.g. a job larger than any replica takes)."""


@dataclass(frozen=True, eq=False)
class _Group:
    """A finished group as the buffer reads it (``group_id``, ``prompt_id``, ``pool``,
    ``min_version``, ``staleness``), with its trainable tokens."""

    group_id: str
    prompt_id: str
    pool: str
    min_version: int
    tokens: int
    submitted_at: float

    def staleness(self, trainer_version: int) -> int:
        return trainer_version - self.min_version


@dataclass(eq=False)
class _Job:
    group_id: str
    prompt_id: str
    lengths: np.ndarray  # response tokens of each of the group's samples
    submitted_at: float


@dataclass(eq=False)
class _Replica:
    pool: int
    capacity: float
    slots: int
    tps: float
    alive: bool = True
    busy: bool = False
    version: int | None = None
    assigned: deque = field(default_factory=deque)
    in_flight: list = field(default_factory=list)
    started: float = 0.0
    up_since: float = 0.0
    rented_s: float = 0.0
    busy_s: float = 0.0
    epoch: int = 0

    @property
    def load(self) -> int:
        return sum(len(j.lengths) for j in self.assigned) + sum(len(j.lengths) for j in self.in_flight)


@dataclass
class _PoolTally:
    generated_tokens: int = 0
    lost_tokens: int = 0
    preemptions: int = 0
    trained_groups: int = 0
    trained_tokens: int = 0
    staleness: list = field(default_factory=list)


class _Sim:
    def __init__(self, cfg: SimConfig):
        self.cfg, self.w = cfg, cfg.workload
        self.rng = np.random.default_rng(cfg.seed)
        self.pools = list(cfg.pools)
        self._pool_index = {p.name: i for i, p in enumerate(self.pools)}
        ref = cfg.reference_tps()
        caps = [p.capacity() for p in self.pools]
        top = max(c for c, p in zip(caps, self.pools) if p.replicas)
        self.reps: list[_Replica] = []
        for i, p in enumerate(self.pools):
            for _ in range(p.replicas):
                self.reps.append(_Replica(i, caps[i], max(1, round(cfg.max_batch * caps[i] / top)), ref * caps[i]))
        self.sync_s = [p.sync_overhead_s + 2.0 * cfg.model.params / (p.link_gbps * 1e9 / 8.0) for p in self.pools]
        self.tally = [_PoolTally() for _ in self.pools]
        self.buffer = RolloutBuffer(self.w.max_staleness, self.w.stale_policy)
        self.queue: deque[_Job] = deque()
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self.now = 0.0
        self.version = 0
        self.outstanding = 0       # the loop's bound: submitted, not yet trained-and-published or dropped
        self.in_system = 0         # Little's law: submitted, not yet taken or dropped
        self.area = 0.0            # ∫ in_system dt
        self.sojourn = 0.0         # Σ (leave - submit) over groups that left
        self.departed = 0
        self.dropped = 0
        self.training: list[_Group] | None = None
        self.steps_done = 0
        self.trainer_busy_s = 0.0
        self.step_log: list[tuple[float, int]] = []  # per step: (publication time, trained tokens)
        self.by_id: dict[str, float] = {}  # group id -> submission time, while in the system
        for i in range(len(self.reps)):
            self._schedule_preemption(i)

    # ------------------------------------------------------------------ events
    def _at(self, t: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, data))

    def _advance(self, t: float) -> None:
        self.area += self.in_system * (t - self.now)
        self.now = t

    def _schedule_preemption(self, i: int) -> None:
        rate = self.pools[self.reps[i].pool].preemptions_per_hour / 3600.0
        if rate > 0:
            self._at(self.now + float(self.rng.exponential(1.0 / rate)), "preempt", i)

    # ------------------------------------------------------------------ the loop side
    def _submit(self, prompt_id: str | None = None) -> None:
        gid = f"g{next(self._ids):07d}"
        w = self.w
        if w.response_cv > 0:
            k = 1.0 / w.response_cv ** 2
            lengths = self.rng.gamma(k, w.response_tokens / k, size=w.group_size)
        else:
            lengths = np.full(w.group_size, w.response_tokens)
        lengths = np.clip(np.rint(lengths), 1, w.max_tokens).astype(np.int64)
        self.queue.append(_Job(gid, prompt_id or gid, lengths, self.now))
        self.outstanding += 1
        self.in_system += 1
        self.by_id[gid] = self.now

    def _leave(self, group_id: str) -> None:
        self.in_system -= 1
        self.departed += 1
        self.sojourn += self.now - self.by_id.pop(group_id)

    def _collect_evictions(self) -> None:
        for gid in self.buffer.pop_evicted():
            self.dropped += 1
            self.outstanding -= 1
            self._leave(gid)

    def _top_up(self) -> None:
        self._collect_evictions()
        regen = self.buffer.pop_regenerations()
        target = (self.w.max_staleness + 1) * self.w.batch_groups
        for s in regen:
            self._submit(s.prompt_id)
        while self.outstanding < target:
            self._submit()

    # ------------------------------------------------------------------ the fleet side
    def _dispatch(self) -> None:
        while self.queue:
            n = len(self.queue[0].lengths)
            best, key = None, None
            for r in self.reps:
                if not r.alive:
                    continue
                load = r.load
                if load + n <= r.slots or load == 0:
                    k = ((load + n) / r.capacity, -r.capacity)
                    if key is None or k < key:
                        best, key = r, k
            if best is None:
                return
            best.assigned.append(self.queue.popleft())

    def _start_idle(self) -> None:
        for i, r in enumerate(self.reps):
            if r.alive and not r.busy and r.assigned:
                self._start(i)

    def _start(self, i: int) -> None:
        r = self.reps[i]
        batch, size = [], 0
        while r.assigned and (not batch or size + len(r.assigned[0].lengths) <= self.cfg.max_batch):
            job = r.assigned.popleft()
            batch.append(job)
            size += len(job.lengths)
        duration = 0.0
        if r.version != self.version:
            duration += self.sync_s[r.pool]
            r.version = self.version
        duration += sum(int(j.lengths.sum()) for j in batch) / r.tps
        r.in_flight, r.busy, r.started = batch, True, self.now
        self._at(self.now + duration, "done", (i, r.epoch))

    def _done(self, i: int, epoch: int) -> None:
        r = self.reps[i]
        if epoch != r.epoch:  # preempted meanwhile: the batch was lost
            return
        r.busy_s += self.now - r.started
        pool = self.pools[r.pool].name
        tally = self.tally[r.pool]
        for job in r.in_flight:
            tokens = int(job.lengths.sum())
            tally.generated_tokens += tokens
            self.buffer.put(_Group(job.group_id, job.prompt_id, pool, int(r.version), tokens, job.submitted_at))
        r.in_flight, r.busy = [], False
        self._collect_evictions()

    def _preempt(self, i: int) -> None:
        r = self.reps[i]
        if not r.alive:
            return
        tally = self.tally[r.pool]
        tally.preemptions += 1
        if r.busy:
            r.busy_s += self.now - r.started  # billed, lost
            tally.lost_tokens += sum(int(j.lengths.sum()) for j in r.in_flight)
        jobs = list(r.in_flight) + list(r.assigned)
        self.queue.extendleft(reversed(jobs))
        r.rented_s += self.now - r.up_since
        r.alive, r.busy, r.in_flight, r.assigned, r.version = False, False, [], deque(), None
        r.epoch += 1
        self._at(self.now + self.pools[r.pool].restart_s, "restore", i)

    def _restore(self, i: int) -> None:
        r = self.reps[i]
        r.alive, r.up_since = True, self.now
        self._schedule_preemption(i)

    # ------------------------------------------------------------------ the trainer side
    def _try_train(self) -> None:
        if self.training is not None or self.steps_done >= self.w.steps:
            return
        batch = self.buffer.take(self.w.batch_groups, self.version, timeout=0)
        self._collect_evictions()
        if not batch:
            return
        step_tokens = 0
        for g in batch:
            t = self.tally[self._pool_index[g.pool]]
            t.trained_groups += 1
            t.trained_tokens += g.tokens
            t.staleness.append(g.staleness(self.version))
            step_tokens += g.tokens + self.w.prompt_tokens * self.w.group_size
            self._leave(g.group_id)
        step = self.cfg.trainer.step_time(self.cfg.model, step_tokens)
        self.trainer_busy_s += step
        self.training = batch
        self._step_tokens = sum(g.tokens for g in batch)
        self._at(self.now + step, "step")

    def _step_done(self) -> None:
        self.outstanding -= len(self.training or [])
        self.training = None
        self.step_log.append((self.now, self._step_tokens))
        self.version += 1
        self.steps_done += 1

    # ------------------------------------------------------------------ run
    def run(self, max_events: int = 50_000_000) -> dict[str, Any]:
        self._top_up()
        self._dispatch()
        self._start_idle()
        for _ in range(max_events):
            if self.steps_done >= self.w.steps:
                break
            if not self.events:
                raise SimulationError("the simulated loop stalled: no replica can take the queued jobs "
                                      "and nothing is running")
            t, _, kind, data = heapq.heappop(self.events)
            self._advance(t)
            if kind == "done":
                self._done(*data)
            elif kind == "step":
                self._step_done()
            elif kind == "preempt":
                self._preempt(data)
            elif kind == "restore":
                self._restore(data)
            self._try_train()
            self._top_up()
            self._dispatch()
            self._start_idle()
        else:
            raise SimulationError(f"no end after {max_events} events")
        for r in self.reps:
            if r.alive:
                r.rented_s += self.now - r.up_since
        return self._report()

    def _report(self) -> dict[str, Any]:
        from hetrl.fleet_sim.report import summarize

        return summarize(self)


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Run the simulation of ``cfg``; returns the report of :func:`hetrl.fleet_sim.report.summarize`."""
    return _Sim(cfg).run()
