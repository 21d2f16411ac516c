"""Admission of rollouts into the buffer: validation, per-pool rejection counts, quarantine.

Every rollout a pool returns passes :class:`RolloutGate` before it may enter the
:class:`hetrl.core.buffer.RolloutBuffer`, so the trainer never steps on malformed or poisoned
data. A rollout is **rejected**, with a :class:`hetrl.core.schema.RolloutError` naming the
field, when :meth:`Rollout.validate` fails (NaN/inf log-probs, ids outside the vocabulary, a kept
support missing the sampled token, wrong lengths, log-probs inconsistent with the support,
versions that were never published, ...) or when it claims to come from another pool. A valid
rollout whose oldest trainable token is more than ``max_staleness`` versions behind the latest
published version is **stale**: it is not admitted either (the caller applies the run's stale
policy, drop or regenerate), and it counts against its pool like a rejection (reason
``stale``), so a pool that never loads new weights, or cannot keep up, is caught too. A pool's
**warm-up** is not judged: the stale rollouts it returns before its first admitted one (its first
calls include compiling, loading and connecting while the trainer moves on) stay out of its
window, up to ``window`` of them; a pool that returns that many stale rollouts and no fresh one
is judged on the next.

Both are counted per pool and per reason (the field name, or ``stale``). A pool whose share of
rejected or stale rollouts over its last ``window`` exceeds ``max_rejection_rate`` (judged once
it has returned at least ``min_rollouts``) is **quarantined**: :meth:`RolloutGate.admit` returns
a message once, and admits nothing from that pool any more. Taking the pool out of routing is the
fleet's job (:meth:`hetrl.samplers.fleet.Fleet.quarantine`). Framework-free; thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.core.schema import Rollout, RolloutError

__all__ = ["QuarantineConfig", "Admission", "RolloutGate", "STALE"]

STALE = "stale"
"""The rejection reason counted for stale rollouts (the others are field names)."""


class QuarantineConfig(BaseModel):
    """When a pool is quarantined: its share of rejected or stale rollouts over its last
    ``window`` exceeds ``max_rejection_rate`` once it has returned at least ``min_rollouts``
    (``max_rejection_rate: 1.0`` never quarantines)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_rejection_rate: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False)
    min_rollouts: int = Field(16, ge=1)
    window: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _window_holds_min(self) -> "QuarantineConfig":
        if self.min_rollouts > self.window:
            raise ValueError(f"min_rollouts ({self.min_rollouts}) must not exceed window ({self.window}): "
                             "the rate is judged over the window")
        return self


@dataclass(frozen=True)
class Admission:
    """What :meth:`RolloutGate.admit` decided: the rollouts that may enter the buffer, one error
    per rejected rollout, the valid but ``stale`` ones, and ``quarantined``: the message when
    this call quarantined the pool."""

    admitted: list[Rollout]
    rejected: list[RolloutError]
    stale: list[Rollout]
    quarantined: str | None = None


@dataclass
class _PoolRecord:
    admitted: int = 0
    reasons: Counter = field(default_factory=Counter)  # field name or STALE -> count
    recent: deque = field(default_factory=deque)        # per rollout, last `window`: True = not admitted
    last_error: str = ""
    quarantined: str | None = None
    warmup: int = 0  # stale rollouts returned before the first admitted one, not judged (at most `window`)


class RolloutGate:
    """Checks rollouts per pool and quarantines pools that return too many bad ones (see the
    module docstring). ``vocab_size`` and ``max_length`` are the model's, ``max_staleness`` the
    run's bound."""

    def __init__(self, config: QuarantineConfig, *, vocab_size: int, max_length: int | None, max_staleness: int):
        self.config = config
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._pools: dict[str, _PoolRecord] = {}

    def check(self, pool: str, rollout: Rollout, published_version: int) -> Rollout:
        """Raise :class:`RolloutError` naming the field unless ``rollout`` is a valid rollout of
        ``pool`` while ``published_version`` is the latest published weight version."""
        rollout.validate(self.vocab_size, self.max_length, max_version=published_version)
        if rollout.sampler.pool != pool:
            raise RolloutError(rollout.rollout_id, "sampler.pool",
                               f"says it comes from pool {rollout.sampler.pool!r} but pool {pool!r} returned it")
        return rollout

    def admit(self, pool: str, rollouts: Sequence[Rollout], rejected: Sequence[RolloutError] = (), *,
              published_version: int) -> Admission:
        """Sort ``rollouts`` of ``pool`` into admitted, rejected (:meth:`check`) and stale;
        ``rejected`` are rollouts of the same pool already rejected upstream (e.g. by the
        decoder), counted with the rest. Nothing is admitted or returned as stale from a
        quarantined pool, nor in the call that quarantines it (its output is no longer trusted);
        calls after quarantine are not counted."""
        errors, stale, admitted = list(rejected), [], []
        for r in rollouts:
            try:
                self.check(pool, r, published_version)
            except RolloutError as err:
                errors.append(err)
                continue
            (stale if r.version_span()[0] < published_version - self.max_staleness else admitted).append(r)
        with self._lock:
            rec = self._pools.setdefault(pool, _PoolRecord())
            if rec.quarantined is not None:
                return Admission([], errors, [])
            rec.reasons.update([e.field for e in errors] + [STALE] * len(stale))
            if errors:
                rec.last_error = str(errors[-1])
            elif stale:
                rec.last_error = (f"rollout {stale[-1].rollout_id!r} is stale: version {stale[-1].version_span()[0]} "
                                  f"is more than {self.max_staleness} behind {published_version}")
            judged_stale = len(stale)
            if rec.admitted == 0 and not admitted and rec.warmup < self.config.window:  # its warm-up
                rec.warmup, judged_stale = rec.warmup + len(stale), 0
            rec.recent.extend([False] * len(admitted) + [True] * (len(errors) + judged_stale))
            while len(rec.recent) > self.config.window:
                rec.recent.popleft()
            rate = sum(rec.recent) / len(rec.recent) if rec.recent else 0.0
            if len(rec.recent) < self.config.min_rollouts or rate <= self.config.max_rejection_rate:
                rec.admitted += len(admitted)
                return Admission(admitted, errors, stale)
            top = ", ".join(f"{reason}: {n}" for reason, n in rec.reasons.most_common(3))
            rec.quarantined = (f"pool {pool!r} quarantined: {sum(rec.recent)} of its last {len(rec.recent)} rollouts "
                               f"were rejected or stale (rate {rate:.2f} > max_rejection_rate "
                               f"{self.config.max_rejection_rate}); most frequent reasons: {top}; "
                               f"last: {rec.last_error}")
            return Admission([], errors, [], rec.quarantined)

    def state(self) -> dict[str, Any]:
        """Per pool: counts, rejection reasons, the recent window and any quarantine, as
        JSON-able data (a checkpoint's; :meth:`restore_state` continues from it)."""
        with self._lock:
            return {pool: {"admitted": rec.admitted, "reasons": dict(rec.reasons), "recent": list(rec.recent),
                           "last_error": rec.last_error, "quarantined": rec.quarantined, "warmup": rec.warmup}
                    for pool, rec in self._pools.items()}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`'s record (a quarantined pool stays quarantined)."""
        with self._lock:
            self._pools = {pool: _PoolRecord(int(rec["admitted"]), Counter(rec["reasons"]), deque(rec["recent"]),
                                             rec["last_error"], rec["quarantined"], int(rec.get("warmup", 0)))
                           for pool, rec in state.items()}

    def is_quarantined(self, pool: str) -> bool:
        with self._lock:
            rec = self._pools.get(pool)
            return rec is not None and rec.quarantined is not None

    def quarantined(self) -> dict[str, str]:
        """The message of every quarantined pool."""
        with self._lock:
            return {pool: rec.quarantined for pool, rec in self._pools.items() if rec.quarantined is not None}

    def metrics(self) -> dict[str, float]:
        """Per pool under ``pool/<name>/admission/``: ``admitted``, ``rejected`` (stale
        included), ``rejected/<reason>``, ``rejection_rate`` (over the window) and
        ``quarantined``; totals ``admission/admitted``, ``admission/rejected``,
        ``admission/quarantined_pools``."""
        out: dict[str, float] = {"admission/admitted": 0.0, "admission/rejected": 0.0, "admission/quarantined_pools": 0.0}
        with self._lock:
            for pool, rec in self._pools.items():
                p = f"pool/{pool}/admission"
                rejected = float(sum(rec.reasons.values()))
                out[f"{p}/admitted"] = float(rec.admitted)
                out[f"{p}/rejected"] = rejected
                out[f"{p}/rejection_rate"] = sum(rec.recent) / len(rec.recent) if rec.recent else 0.0
                out[f"{p}/quarantined"] = float(rec.quarantined is not None)
                out.update({f"{p}/rejected/{reason}": float(n) for reason, n in rec.reasons.items()})
                out["admission/admitted"] += rec.admitted
                out["admission/rejected"] += rejected
                out["admission/quarantined_pools"] += rec.quarantined is not None
        return out
