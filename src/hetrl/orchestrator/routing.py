"""The routing strategy of ``fleet.routing`` as the loop drives it, once per training step.

``capacity`` needs nothing: the fleet routes by speed (:mod:`hetrl.samplers.fleet`).
``autopilot``: :class:`AutopilotRouter` turns each step's typed pool records
(:class:`hetrl.orchestrator.recorder.PoolStep`) into :class:`hetrl.samplers.autopilot.PoolReading`
figures, asks :class:`hetrl.samplers.autopilot.Autopilot` for the shares, applies them to the fleet
(:meth:`hetrl.samplers.fleet.Fleet.set_shares`), logs every state change (one line each) and
returns the decision's metrics (``pool/<name>/autopilot/...``) for the step's record.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from hetrl.orchestrator.recorder import PoolStep
from hetrl.samplers.autopilot import Autopilot, AutopilotConfig, Decision, PoolReading
from hetrl.samplers.fleet import Fleet

__all__ = ["AutopilotRouter", "make_router"]

log = logging.getLogger(__name__)


class AutopilotRouter:
    """Feeds the autopilot and applies its shares (module docstring). ``on_change(line)``: each
    state change's line, besides the log (the console)."""

    def __init__(self, fleet: Fleet, config: AutopilotConfig, on_change: Callable[[str], None] = lambda line: None):
        self.fleet, self.autopilot, self._on_change = fleet, Autopilot(config), on_change
        self._counted: dict[str, tuple[int, int]] = {}  # pool -> (groups returned, dropped) at the last step
        self.last: Decision | None = None

    def readings(self, pools: Sequence[PoolStep]) -> list[PoolReading]:
        """One reading per pool of a step's records; the buffer counters as deltas since the last step."""
        out = []
        for p in pools:
            f, c = p.figures, p.buffer
            before = self._counted.get(p.pool, (0, 0))
            self._counted[p.pool] = (c.groups_out, c.dropped)
            out.append(PoolReading(
                pool=p.pool, capacity=f.capacity, replicas_alive=f.replicas_alive,
                routable=not f.quarantined and f.replicas_alive > 0, price_per_hour_usd=f.price_per_hour_usd,
                tokens=float(f.tokens), busy_s=f.busy_s,
                modelled_tokens_per_s=self.fleet.reference_tokens_per_s * f.capacity, mismatch=p.mismatch,
                returned=c.groups_out - before[0], dropped=c.dropped - before[1]))
        return out

    def step(self, pools: Sequence[PoolStep]) -> dict[str, float]:
        """Decide from one step's records, route by the shares, return the decision's metrics."""
        decision = self.autopilot.decide(self.readings(pools))
        self.fleet.set_shares(decision.shares)
        for line in decision.changes:
            log.warning("%s", line)
            self._on_change(line)
        self.last = decision
        return decision.metrics()

    def state(self) -> dict[str, Any]:
        """The autopilot's state and the counters it last saw, for a checkpoint."""
        return {"autopilot": self.autopilot.state(), "counted": {p: list(v) for p, v in self._counted.items()},
                "shares": self.fleet.shares}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`: the autopilot's state, and the fleet routes by the shares
        in force at the checkpoint until the next step decides."""
        self.autopilot.restore(state.get("autopilot", {}))
        self._counted = {p: (int(v[0]), int(v[1])) for p, v in state.get("counted", {}).items()}
        shares = state.get("shares")
        self.fleet.set_shares({p: float(v) for p, v in shares.items() if p in self.fleet.pools} if shares else None)


def make_router(fleet: Fleet, routing: str, config: AutopilotConfig,
                on_change: Callable[[str], None] = lambda line: None) -> AutopilotRouter | None:
    """The router of ``fleet.routing`` (None for ``capacity``: the fleet routes by itself)."""
    if routing == "autopilot":
        return AutopilotRouter(fleet, config, on_change)
    if routing == "capacity":
        return None
    raise ValueError(f"unknown routing {routing!r}; choose 'capacity' or 'autopilot'")
