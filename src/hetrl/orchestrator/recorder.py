"""The step recorder: each training step's figures, typed per pool, from the loop's parts to the
monitors and the console (DESIGN §5).

A step is recorded as a :class:`StepRecord`: the flat ``scalars`` every monitor writes (the
JSON-lines file, TensorBoard, W&B; their names are the run's metric names, unchanged) and one
:class:`PoolStep` per pool, typed: the step's mismatch over that pool's tokens
(:func:`hetrl.core.correction.pool_mismatch`), its groups in the batch and its cumulative figures
from the fleet (:class:`hetrl.samplers.fleet.PoolFigures`) and the buffer
(:class:`hetrl.core.buffer.PoolCounters`). The fleet's per-pool mismatch averages are fed from
the typed records, and the console's pool block is rendered from them: no layer takes a
``pool/<name>/...`` name apart again.

The recorder owns the run's step history (continued from a resumed run's metrics), the
throughput clock between steps and the largest staleness seen. :meth:`StepRecorder.record`
builds a step's record (the loop may add to its scalars, e.g. an evaluation's), and
:meth:`StepRecorder.commit` appends it to the history, logs it every ``logging.every`` steps (and
at the last) and shows it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from hetrl.core.buffer import PoolCounters, RolloutBuffer, RolloutGroup
from hetrl.core.correction import pool_mismatch
from hetrl.core.schema import RolloutBatch
from hetrl.samplers.fleet import Fleet, PoolFigures

if TYPE_CHECKING:
    from hetrl.orchestrator.monitors import Monitor
    from hetrl.orchestrator.report import RunConsole

__all__ = ["PoolStep", "StepRecord", "StepRecorder"]


@dataclass(frozen=True)
class PoolStep:
    """One pool at one step: ``batch_groups`` (its groups in the step's batch), ``mismatch``
    (the step's metrics over its tokens, ``num_tokens`` included; empty when the trainer computed
    none per pool), ``figures`` (the fleet's cumulative ones), ``buffer`` (its group counters)
    and ``numerics`` (``"<accelerator> <weight>/<kv>"``)."""

    pool: str
    numerics: str
    batch_groups: int
    mismatch: Mapping[str, float]
    figures: PoolFigures
    buffer: PoolCounters

    def row(self) -> dict[str, Any]:
        """The console's row of this pool (:class:`hetrl.orchestrator.report.RunConsole`)."""
        f, c = self.figures, self.buffer
        return {
            "pool": self.pool, "numerics": self.numerics,
            "alive": "quarantined" if f.quarantined else f"{f.replicas_alive}/{f.replicas}",
            "weight_version": ",".join("-" if v is None else str(v) for v in f.weight_versions),
            "requests": f.requests, "tokens": f.tokens, "trained": c.groups_out, "dropped": c.dropped,
            "max_staleness": c.max_staleness_out, "k3": f.mismatch_avg.get("k3"), "cost_usd": f.cost_usd,
        }


@dataclass
class StepRecord:
    """A step: ``scalars`` (the flat record the monitors write, with its integer ``step``) and
    ``pools`` (one :class:`PoolStep` per pool, in fleet order)."""

    step: int
    scalars: dict[str, Any]
    pools: tuple[PoolStep, ...] = field(default_factory=tuple)


class StepRecorder:
    """Records the loop's steps (see the module docstring). ``fleet``, ``buffer``: the run's;
    ``sources``: zero-argument callables of further flat metrics (admission, chaos), merged into
    each record; ``monitors``; ``display``; ``total_steps``, ``log_every``: when to log;
    ``history``: the records of a resumed run so far; ``t_start``: the run's start (monotonic)."""

    def __init__(self, fleet: Fleet, buffer: RolloutBuffer, *, sources: Sequence[Any], monitors: "Monitor",
                 display: "RunConsole", total_steps: int, log_every: int, history: Sequence[dict[str, Any]] = (),
                 t_start: float | None = None):
        self.fleet, self.buffer, self.sources = fleet, buffer, tuple(sources)
        self.monitors, self.display = monitors, display
        self.total_steps, self.log_every = total_steps, log_every
        self.history: list[dict[str, Any]] = list(history)
        self.max_staleness_seen = -1
        self._t_start = time.monotonic() if t_start is None else t_start
        self._last_time, self._last_tokens = time.monotonic(), 0.0

    def start(self) -> None:
        """Training begins: the throughput of the first step is measured from now."""
        self._last_time = time.monotonic()

    def log(self, scalars: dict[str, Any]) -> None:
        """Append a record that is not a training step (the starting policy's evaluation) and log it."""
        self.history.append(scalars)
        self.monitors.log(scalars)

    def record(self, step: int, *, trained_at: int, groups: Sequence[RolloutGroup], batch: RolloutBatch,
               metrics: Mapping[str, Any], wait_s: float, step_s: float, counts: Mapping[str, float]) -> StepRecord:
        """The record of the step that trained ``groups`` (collated as ``batch``) at trainer
        version ``trained_at``, now at ``step``: ``metrics`` (the trainer's), the time it waited
        for the batch and trained, and the loop's ``counts`` (``rollout/<name>``). Feeds the
        step's per-pool mismatch to the fleet's averages first."""
        pools = tuple(self.fleet.pools)
        per_pool = pool_mismatch(metrics, pools)
        self.fleet.record_mismatch(per_pool)
        rollouts = [r for g in groups for r in g.rollouts]
        stale = [trained_at - g.min_version for g in groups]
        self.max_staleness_seen = max(self.max_staleness_seen, *stale)
        now = time.monotonic()
        fm = self.fleet.metrics()
        gen_tokens = fm["fleet/tokens"]
        since = max(now - self._last_time, 1e-9)
        scalars: dict[str, Any] = {
            "step": step, "time/wall_s": now - self._t_start, "time/step_s": step_s, "time/wait_s": wait_s, **metrics,
            "reward/mean": float(np.mean([r.reward for r in rollouts])),
            "reward/std": float(np.std([r.reward for r in rollouts])),
            "rollout/response_tokens": float(np.mean([r.response_ids.shape[0] for r in rollouts])),
            "rollout/turns": float(np.mean([r.timings.get("turns", 1.0) for r in rollouts])),
            "staleness/mean": float(np.mean(stale)), "staleness/max": float(max(stale)),
            "throughput/gen_tokens_per_s": (gen_tokens - self._last_tokens) / since,
            "throughput/trained_tokens_per_s": float(batch.loss_mask.sum()) / since,
            **{f"batch/pool/{p}/groups": float(sum(g.pool == p for g in groups)) for p in pools},
            **fm, **self.buffer.metrics(), **{k: v for source in self.sources for k, v in source().items()},
            **{f"rollout/{k}": float(v) for k, v in counts.items()},
            "rollout/solved": float(np.mean([r.timings.get("solved", 0.0) for r in rollouts])),
            "rollout/tampered": float(np.mean([r.timings.get("tampered", 0.0) for r in rollouts])),
        }
        self._last_time, self._last_tokens = now, gen_tokens
        figures, counters = self.fleet.pool_figures(), self.buffer.counters()
        steps = tuple(PoolStep(pool=p, numerics=self._numerics(p), batch_groups=sum(g.pool == p for g in groups),
                               mismatch=per_pool[p], figures=figures[p], buffer=counters.get(p, PoolCounters()))
                      for p in pools)
        return StepRecord(step, scalars, steps)

    def commit(self, record: StepRecord) -> None:
        """Append ``record`` to the history, log it every ``log_every`` steps and at the last, show it."""
        self.history.append(record.scalars)
        if record.step % self.log_every == 0 or record.step == self.total_steps:
            self.monitors.log(record.scalars)
        self.display.step(record.scalars, [p.row() for p in record.pools])

    def _numerics(self, pool: str) -> str:
        n = self.fleet.numerics[pool]
        return f"{self.fleet.pools[pool].accelerator} {n.weight_format}/{n.kv_format}"
