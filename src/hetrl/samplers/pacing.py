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
began. A call already slower than that (a compile, a CPU-bound small batch) is not held, and
neither is a call before ``R`` is known (held to its own time ``x c_ref / c`` instead, a call that
paid a compile, a replica's first or a later one meeting new shapes, was held that compile over
10 times over for the slow pools of ``tiny_mixed`` and outlasted a 40-step run). Until a reference
replica has recorded a call, the other replicas' CPU rate stands in for ``R`` (see
:class:`ReferenceRate`; a call is held by the rate before it, never by its own time). So
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
    """The reference decode rate ``R``: tokens / seconds summed over the reference replicas' calls
    (each replica's first call left out: it compiles). Until a reference call is recorded (the
    reference pool still compiling, or quarantined before its second call) ``R`` is the same
    figure over the other replicas' own (unheld) call times: every embedded replica runs the
    same model on this CPU, so their CPU rate stands in for the reference's; without it the
    fleet ran unpaced for as long as its reference was out. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {True: [0, 0.0], False: [0, 0.0]}  # reference? -> [tokens, seconds]

    def record(self, tokens: int, seconds: float, *, reference: bool = True) -> None:
        with self._lock:
            total = self._totals[reference]
            total[0] += tokens
            total[1] += seconds

    def tokens_per_s(self) -> float | None:
        """The reference replicas' rate, else the other replicas', or None before any call."""
        with self._lock:
            for tokens, seconds in (self._totals[True], self._totals[False]):
                if tokens > 0 and seconds > 0:
                    return tokens / seconds
            return None


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
        rate = self.rate.tokens_per_s()  # before this call is recorded: a call is never held by its own time
        self._calls += 1
        if self._calls > 1:
            self.rate.record(tokens, elapsed, reference=self.is_reference)
        if not self.is_reference and rate is not None and tokens / (rate * self.ratio) > elapsed:
            self._sleep(tokens / (rate * self.ratio) - elapsed)
        return out
