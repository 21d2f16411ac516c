"""Time-faithful emulation: an embedded replica paced to its profile's modelled throughput.

Every embedded replica runs on this machine's CPU, so without pacing a pool modelled at 0.26x an
H100 produces rollouts as fast as a B200 pool. With ``fleet.pacing: modelled`` the fleet's
fastest pool is the **reference**: its replicas run at CPU speed, and a shared
:class:`ReferenceRate` measures their decode rate ``R`` (generated tokens per second of
``generate`` calls, each replica's first call left out: it pays the jit compiles). A replica of
relative throughput ``c`` (:meth:`hetrl.samplers.profiles.SamplerNumerics.relative_throughput`)
in a fleet whose fastest is ``c_ref`` is modelled to decode at ``R · c / c_ref``: after a
``generate`` call that returned ``n`` tokens in ``t`` seconds, :class:`Paced` holds the replica
busy (sleeps before returning) until ``n / (R · c / c_ref)`` seconds have passed since the call
began. A call already slower than that (a compile, a CPU-bound small batch) is not held. Before
``R`` is known (the reference's first calls), the call is held until ``c_ref / c · t``, except a
replica's first call, which is not held: it pays the jit compiles, and held ``c_ref / c`` times
over (over 10x for the slow pools of ``tiny_mixed``) a slow pool's first call outlasted a 40-step
run. So
per-pool decode rates, queueing and the staleness of each pool's rollouts follow the catalogue,
and time is modelled per token as in the fleet's ``modelled`` cost clock and the simulator
(:mod:`hetrl.fleet_sim`).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from hetrl.samplers.base import Generation, GenerationRequest, Sampler
from hetrl.samplers.faults import Slow

__all__ = ["ReferenceRate", "Paced"]


class ReferenceRate:
    """The reference replicas' measured decode rate: tokens / seconds summed over their calls
    (each replica's first call left out). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens, self._seconds = 0, 0.0

    def record(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._tokens += tokens
            self._seconds += seconds

    def tokens_per_s(self) -> float | None:
        """The rate, or None before any call was recorded."""
        with self._lock:
            return self._tokens / self._seconds if self._seconds > 0 and self._tokens > 0 else None


class Paced(Slow):
    """``inner`` paced to ``ratio = c / c_ref`` (≤ 1) of the reference decode rate ``rate`` (see
    the module docstring); a replica of the reference pool (``ratio == 1``) runs unheld and
    feeds ``rate``. Weights, health, reseed and abort are forwarded unchanged (an abort cuts the
    inner call, not the hold)."""

    def __init__(self, inner: Sampler, ratio: float, rate: ReferenceRate, clock=time.monotonic, sleep=time.sleep):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"pacing ratio must be in (0, 1] (the reference is the fastest pool), got {ratio}")
        super().__init__(inner, 0.0)
        self.ratio, self.rate = ratio, rate
        self._clock, self._sleep = clock, sleep
        self._calls = 0

    @property
    def is_reference(self) -> bool:
        return self.ratio == 1.0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        start = self._clock()
        out = self.inner.generate(requests)
        elapsed = self._clock() - start
        tokens = sum(int(g.token_ids.shape[0]) for g in out)
        self._calls += 1
        if self.is_reference:
            if self._calls > 1:
                self.rate.record(tokens, elapsed)
            return out
        rate = self.rate.tokens_per_s()
        if rate is not None:
            target = tokens / (rate * self.ratio)
        else:  # scale this call's own time, but never a first call's (the jit compiles)
            target = elapsed / self.ratio if self._calls > 1 else elapsed
        if target > elapsed:
            self._sleep(target - elapsed)
        return out
