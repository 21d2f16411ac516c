"""Fault injection around a sampler: for the fault tests, soak runs and chaos drills.

Wrappers with the :class:`hetrl.samplers.base.Sampler` protocol that delegate to an inner
sampler and misbehave on purpose:

* :class:`Slow` sleeps before every ``generate`` call (a slow or congested pool);
* :class:`Dies` raises on its first call (a replica killed mid-generation);
* :class:`Poisoned` returns only invalid generations, cycling through :data:`POISONS` (NaN or
  inconsistent log-probs, ids outside the vocabulary, a sampled token outside its support, wrong
  lengths, versions never published, another pool's stamp);
* :class:`ChaosSampler` injects random faults at the rates of a :class:`ChaosConfig`
  (``fleet.chaos`` in a run config): per call it may die (raise), stall for ``slow_s`` seconds,
  and poison each returned generation. Draws come from a seeded generator, so a drill is
  reproducible given its call order; what was injected is counted in a shared
  :class:`ChaosLedger` (the run's ``chaos/*`` metrics).

Every wrapper forwards the optional capabilities of the sampler it wraps,
:class:`hetrl.samplers.base.Reseedable` and :class:`hetrl.samplers.base.Abortable` (and has
each only when that one does); :class:`ChaosSampler` also restarts its own fault draws from the
seed, so a reseeded drill repeats its faults too. An abort reaches the inner sampler's running
call; a wrapper's own delay (:class:`Slow`'s sleep, a chaos stall) is not cut short.

Every poison is one the rollout gate must reject (:mod:`hetrl.core.admission`), and every other
fault one the fleet must absorb (re-queue, restart, route around): nothing here changes what a
healthy sampler would return.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hetrl.core.schema import SamplerInfo
from hetrl.samplers.base import Generation, GenerationRequest, Sampler, SamplerHealth, abort, can_abort, can_reseed, reseed

__all__ = ["POISONS", "Slow", "Dies", "Poisoned", "ChaosConfig", "ChaosLedger", "ChaosSampler", "InjectedFault"]


def _edit(g: Generation, name: str, value) -> Generation:
    arr = np.array(getattr(g, name))
    arr[0] = value
    return dataclasses.replace(g, **{name: arr})


def _outside_support(g: Generation) -> Generation:
    if g.support is None:
        return _edit(g, "token_ids", 10**6)
    span = set(g.support.ids[g.support.offsets[0]:g.support.offsets[1]].tolist())
    return _edit(g, "token_ids", next(v for v in itertools.count() if v not in span))


POISONS: tuple[tuple[str, Callable[[Generation], Generation]], ...] = (
    ("nan_logprob", lambda g: _edit(g, "logprobs", np.nan)),
    ("id_outside_vocab", lambda g: _edit(g, "token_ids", 10**6)),
    ("support_missing_token", _outside_support),
    ("wrong_length", lambda g: dataclasses.replace(g, logprobs=g.logprobs[:-1])),
    ("unpublished_version", lambda g: dataclasses.replace(g, policy_version=g.policy_version + 1000)),
    ("inconsistent_logprob", lambda g: _edit(g, "logprobs", g.logprobs[0] - 0.5)),
    ("other_pool", lambda g: dataclasses.replace(g, sampler=SamplerInfo(**{**g.sampler.model_dump(), "pool": "elsewhere"}))),
)
"""(name, poison) pairs: each makes a generation invalid in one way."""


class InjectedFault(ConnectionError):
    """The error an injected replica death raises."""


class Slow:
    """A sampler that sleeps ``delay`` seconds before every generate call."""

    def __init__(self, inner: Sampler, delay: float):
        self.inner, self.delay = inner, delay

    @property
    def info(self) -> SamplerInfo:
        return self.inner.info

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        time.sleep(self.delay)
        return self.inner.generate(requests)

    def update_weights(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        self.inner.update_weights(version, weights)

    def health(self) -> SamplerHealth:
        return self.inner.health()

    @property
    def supports_reseed(self) -> bool:
        return can_reseed(self.inner)

    def reseed(self, seed: int) -> None:
        """Reseed the inner sampler (:class:`hetrl.samplers.base.CapabilityMissing` if it cannot)."""
        reseed(self.inner, seed)

    @property
    def supports_abort(self) -> bool:
        return can_abort(self.inner)

    def abort(self) -> None:
        """Abort the inner sampler's running calls (:class:`hetrl.samplers.base.CapabilityMissing` if it cannot)."""
        abort(self.inner)


class Dies(Slow):
    """A sampler whose first generate call raises (a killed replica); ``failed`` records the
    request ids it held."""

    def __init__(self, inner: Sampler):
        super().__init__(inner, 0.0)
        self.failed: list[str] = []
        self.lock = threading.Lock()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        with self.lock:
            self.failed += [r.request_id for r in requests]
        raise InjectedFault("replica killed")


class Poisoned(Slow):
    """A sampler whose every generation is poisoned, cycling through :data:`POISONS` (first
    trainable token); ``used`` counts the poisons applied."""

    def __init__(self, inner: Sampler):
        super().__init__(inner, 0.0)
        self.used: dict[str, int] = {}
        self._next = itertools.cycle(POISONS)
        self.lock = threading.Lock()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        out = []
        for g in self.inner.generate(requests):
            with self.lock:
                name, poison = next(self._next)
                self.used[name] = self.used.get(name, 0) + 1
            out.append(poison(g))
        return out


class ChaosConfig(BaseModel):
    """Random faults injected into every replica of the fleet (``fleet.chaos``; off when absent).
    Per ``generate`` call: the replica dies with probability ``kill_rate`` (the call raises; the
    fleet re-queues its jobs and restarts it per ``fleet.restart``), stalls ``slow_s`` seconds
    with probability ``slow_rate``; each generation it returns is poisoned with probability
    ``poison_rate`` (a random one of :data:`POISONS`). ``seed`` seeds the draws (per replica and
    incarnation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = Field(0, ge=0)
    kill_rate: float = Field(0.0, ge=0.0, le=1.0)
    slow_rate: float = Field(0.0, ge=0.0, le=1.0)
    slow_s: float = Field(2.0, ge=0.0, allow_inf_nan=False)
    poison_rate: float = Field(0.0, ge=0.0, le=1.0)


class ChaosLedger:
    """Thread-safe counts of the faults injected into a fleet: ``kills``, ``slow_calls``,
    ``poisoned`` (generations) and per poison name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {"kills": 0, "slow_calls": 0, "poisoned": 0}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {f"chaos/{k}": float(v) for k, v in self.counts.items()}

    def state(self) -> dict[str, int]:
        """The counts, for a checkpoint (:meth:`restore` continues them)."""
        with self._lock:
            return dict(self.counts)

    def restore(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            self.counts = {k: int(v) for k, v in counts.items()}


class ChaosSampler(Slow):
    """``inner`` with the random faults of ``config``, drawn from ``seed``, counted in ``ledger``."""

    def __init__(self, inner: Sampler, config: ChaosConfig, seed: int, ledger: ChaosLedger):
        super().__init__(inner, config.slow_s)
        self.config, self.ledger = config, ledger
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def reseed(self, seed: int) -> None:
        """Reseed the inner sampler and restart the fault draws at (``config.seed``, ``seed``)."""
        super().reseed(seed)
        with self._lock:
            self._rng = np.random.default_rng((self.config.seed, seed))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        c = self.config
        with self._lock:
            dies, slow = self._rng.random() < c.kill_rate, self._rng.random() < c.slow_rate
        if slow:
            self.ledger.add("slow_calls")
            time.sleep(c.slow_s)
        if dies:
            self.ledger.add("kills")
            raise InjectedFault(f"chaos: replica killed during a call of {len(requests)} requests")
        out = self.inner.generate(requests)
        with self._lock:
            picks = [int(self._rng.integers(len(POISONS))) if self._rng.random() < c.poison_rate else -1 for _ in out]
        for i, pick in enumerate(picks):
            if pick >= 0:
                name, poison = POISONS[pick]
                out[i] = poison(out[i])
                self.ledger.add("poisoned")
                self.ledger.add(f"poison/{name}")
        return out
