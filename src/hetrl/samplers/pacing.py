"""Time-faithful emulation: an embedded replica paced to its profile's modelled throughput.

Every embedded replica runs on this machine's CPU, so without pacing a pool modelled at 0.26x an
H100 produces rollouts as fast as a B200 pool. With ``fleet.pacing: modelled`` the fastest pool
of the fleet is the **reference**: it runs at CPU speed. A replica of relative throughput ``c``
(:meth:`hetrl.samplers.profiles.SamplerNumerics.relative_throughput`) in a fleet whose fastest
is ``c_ref`` is slowed by ``factor = c_ref / c`` ≥ 1: after a ``generate`` call that took ``t``
seconds, :class:`Paced` holds the replica busy (sleeps, returning nothing yet) until ``factor ·
t`` seconds have passed since the call began, i.e. until the time the same work takes at the
replica's modelled speed relative to the reference. So per-pool throughput ratios, queueing and
the staleness of each pool's rollouts follow the catalogue; ``t`` is this CPU's time for the call
(including any contention with the other replicas' threads, which the pacing scales too).
"""

from __future__ import annotations

import time
from typing import Sequence

from hetrl.samplers.base import Generation, GenerationRequest, Sampler
from hetrl.samplers.faults import Slow

__all__ = ["Paced", "pacing_factor"]


def pacing_factor(capacity: float, reference_capacity: float) -> float:
    """``reference_capacity / capacity``: how many times longer this replica's calls last than the
    reference's (≥ 1 when the reference is the fleet's fastest)."""
    if capacity <= 0 or reference_capacity <= 0:
        raise ValueError(f"capacities must be > 0, got {capacity} and {reference_capacity}")
    return reference_capacity / capacity


class Paced(Slow):
    """``inner`` whose every ``generate`` call lasts ``factor`` times its CPU wall time (see the
    module docstring); the other methods (weights, health, reseed) are forwarded unchanged."""

    def __init__(self, inner: Sampler, factor: float, clock=time.monotonic, sleep=time.sleep):
        if factor < 1.0:
            raise ValueError(f"pacing factor must be >= 1 (the reference is the fastest pool), got {factor}")
        super().__init__(inner, 0.0)
        self.factor = factor
        self._clock, self._sleep = clock, sleep

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        start = self._clock()
        out = self.inner.generate(requests)
        hold = (self.factor - 1.0) * (self._clock() - start)
        if hold > 0:
            self._sleep(hold)
        return out
