"""The autopilot (``fleet.routing: autopilot``): per-pool routing shares that minimize the cost per
useful trained token within per-pool mismatch budgets (DESIGN §8).

Once per training step the autopilot reads one :class:`PoolReading` per pool and returns a
:class:`Decision`: each pool's routing **share** (the fraction of requests the fleet aims to send
it; the shares of the routable pools sum to 1) and its **state**. The fleet applies the shares in
its capacity rule (:meth:`hetrl.samplers.fleet.Fleet.set_shares`).

**Figures.** Per pool, exponential moving averages (newest step weighted ``smoothing``) of the
step's mismatch over its trained tokens (``k3``, ``masked_frac/any``, ``ess``; a step without
tokens of the pool leaves them unchanged) and of its dropped fraction (groups the staleness bound
dropped / groups returned, over the step); throughput is its generated tokens / busy seconds
(before any, its modelled rate scaled to the measured pools' units: the median measured /
modelled ratio of the pools that have generated).

**Cost per useful token** of a pool: ``price_per_s / (tokens_per_s x (1 - masked) x (1 - dropped))``
(per replica; a pool producing nothing useful costs infinity).

**Budgets** (:class:`AutopilotConfig`): ``k3 <= max_k3``, ``masked <= max_masked_fraction``,
``ess >= min_ess``, ``dropped <= max_dropped_fraction``. **States and hysteresis**:

* ``active`` (0): full weight. A figure over its budget: ``drained``.
* ``drained`` (2): share 0 for ``cooldown_steps`` decisions (the draining one included), then
  ``probation``.
* ``probation`` (1): throttled to ``probe_share`` of its weight, so it produces fresh figures
  (its averages restart when it enters probation). Over budget again: ``drained``; once it has
  fresh mismatch figures and every figure is within ``recover`` x its budget (for ``ess``,
  ``1 - ess`` within ``recover x (1 - min_ess)``): ``active``; otherwise it stays on probation.
* ``forced`` (3): when every routable pool would be drained, the one least over budget (largest
  ``figure / budget`` ratio smallest; ties: fleet order) keeps routing at full weight (one line
  when it starts or the forced pool changes), so the run never stalls on its own routing; it
  returns to the normal states once another pool is routable.
* ``unavailable`` (4): quarantined or no replica alive: share 0, not judged.

**Weights.** A routable pool's weight is its capacity share (relative throughput x alive replicas,
over the fleet) x ``(c_min / c)^sharpness`` (``c_min``: the cheapest routable pool's cost per
useful token) x its state's factor (active and forced 1, probation ``probe_share``, drained 0);
shares are the weights normalized to sum 1. With equal costs and every pool active the shares are
the capacity shares, i.e. the fleet's plain capacity routing.

Decisions are a function of the readings and the previous state only (no clock, no randomness),
so a run whose figures are reproducible (the ``modelled`` cost clock under ``lockstep``) routes
reproducibly; :meth:`Autopilot.state` / :meth:`Autopilot.restore` carry it over a resume.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AutopilotConfig", "PoolReading", "Decision", "Autopilot", "STATES"]

STATES = {"active": 0, "probation": 1, "drained": 2, "forced": 3, "unavailable": 4}
"""Each state's code in the step metrics (``pool/<name>/autopilot/state``)."""


class AutopilotConfig(BaseModel):
    """The autopilot's budgets and dynamics (module docstring). Budgets: ``max_k3`` (run mean k3
    of a pool's tokens), ``max_masked_fraction`` (fraction of its tokens the correction zeroes),
    ``min_ess`` (normalized effective sample size), ``max_dropped_fraction`` (its groups dropped
    by the staleness bound). ``recover`` < 1: the readmission margin; ``cooldown_steps``: steps a
    drained pool rests; ``probe_share``: a pool's weight factor on probation; ``sharpness``: how
    strongly cost per useful token tilts the shares (0: capacity shares); ``smoothing``: the
    newest step's weight in the moving averages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_k3: float = Field(0.01, gt=0.0, allow_inf_nan=False)
    max_masked_fraction: float = Field(0.2, gt=0.0, le=1.0)
    min_ess: float = Field(0.5, ge=0.0, lt=1.0)
    max_dropped_fraction: float = Field(0.5, gt=0.0, le=1.0)
    recover: float = Field(0.8, gt=0.0, lt=1.0)
    cooldown_steps: int = Field(3, ge=1)
    probe_share: float = Field(0.25, gt=0.0, lt=1.0)
    sharpness: float = Field(2.0, ge=0.0, le=16.0)
    smoothing: float = Field(0.5, gt=0.0, le=1.0)


@dataclass(frozen=True)
class PoolReading:
    """One pool's figures at one step. ``capacity``: relative throughput per replica;
    ``replicas_alive``; ``routable`` (not quarantined, a replica alive); ``price_per_hour_usd`` of
    one replica; cumulative ``tokens`` generated and ``busy_s``; ``modelled_tokens_per_s`` (one
    replica, before any busy time); the step's ``mismatch`` over its tokens (``num_tokens``,
    ``k3``, ``masked_frac/any``, ``ess``; empty or ``num_tokens`` 0: none); the step's groups
    ``returned`` and ``dropped`` (counter deltas)."""

    pool: str
    capacity: float
    replicas_alive: int
    routable: bool
    price_per_hour_usd: float
    tokens: float
    busy_s: float
    modelled_tokens_per_s: float
    mismatch: Mapping[str, float] = field(default_factory=dict)
    returned: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class Decision:
    """The shares (sum 1 over routable pools; 0 elsewhere), states, cost per useful token
    (USD/token), the smoothed figures and what changed (one line per state change)."""

    shares: dict[str, float]
    states: dict[str, str]
    cost_per_useful_token: dict[str, float]
    figures: dict[str, dict[str, float]]
    changes: tuple[str, ...]

    def metrics(self) -> dict[str, float]:
        """``pool/<name>/autopilot/{share,state,usd_per_useful_token,k3,masked_fraction,ess,dropped_fraction}``."""
        out: dict[str, float] = {}
        for pool, share in self.shares.items():
            p = f"pool/{pool}/autopilot/"
            out[p + "share"] = share
            out[p + "state"] = float(STATES[self.states[pool]])
            out[p + "usd_per_useful_token"] = self.cost_per_useful_token[pool]
            out.update({p + k: v for k, v in self.figures[pool].items()})
        return out


_FIGURES = ("k3", "masked_fraction", "ess", "dropped_fraction")
_MISMATCH = {"k3": "k3", "masked_fraction": "masked_frac/any", "ess": "ess"}


class Autopilot:
    """The decision function and its state (module docstring)."""

    def __init__(self, config: AutopilotConfig):
        self.config = config
        self._avg: dict[str, dict[str, float]] = {}   # pool -> smoothed figures (absent: none seen)
        self._state: dict[str, str] = {}              # pool -> active | probation | drained (judged state)
        self._since: dict[str, int] = {}              # pool -> steps in its current state
        self._forced: str | None = None               # the pool forced to keep routing (None: none)

    # ------------------------------------------------------------------ figures
    def _smooth(self, r: PoolReading) -> dict[str, float]:
        a, avg = self.config.smoothing, self._avg.setdefault(r.pool, {})
        new: dict[str, float] = {}
        if r.mismatch.get("num_tokens", 0.0) > 0:
            new.update({k: float(r.mismatch[m]) for k, m in _MISMATCH.items() if m in r.mismatch})
        if r.returned + r.dropped > 0:
            new["dropped_fraction"] = r.dropped / (r.returned + r.dropped)
        for k, v in new.items():
            if math.isfinite(v):
                avg[k] = v if k not in avg else a * v + (1 - a) * avg[k]
        return avg

    def _ratio(self, figures: Mapping[str, float]) -> float:
        """The largest figure / budget (> 1: over budget); ``ess`` as ``(1 - ess) / (1 - min_ess)``."""
        c = self.config
        budget = {"k3": c.max_k3, "masked_fraction": c.max_masked_fraction, "dropped_fraction": c.max_dropped_fraction}
        ratios = [figures[k] / b for k, b in budget.items() if k in figures]
        if "ess" in figures:
            ratios.append((1.0 - figures["ess"]) / (1.0 - c.min_ess))
        return max(ratios, default=0.0)

    @staticmethod
    def _rates(readings: Sequence[PoolReading]) -> dict[str, float]:
        """Each pool's tokens per busy second; a pool with none yet gets its modelled rate in the
        measured pools' units: ``modelled x median(measured / modelled)`` over the pools measured
        (the modelled rate alone while none is). Modelled rates are the catalogue's and measured
        ones this machine's, so comparing them raw would make an unmeasured pool look cheap or dear
        by their ratio, not by its price."""
        measured = {r.pool: r.tokens / r.busy_s for r in readings if r.busy_s > 0 and r.tokens > 0}
        units = [measured[r.pool] / r.modelled_tokens_per_s for r in readings if r.pool in measured]
        scale = statistics.median(units) if units else 1.0
        return {r.pool: measured.get(r.pool, r.modelled_tokens_per_s * scale) for r in readings}

    @staticmethod
    def _cost(r: PoolReading, rate: float, figures: Mapping[str, float]) -> float:
        useful = rate * (1.0 - figures.get("masked_fraction", 0.0)) * (1.0 - figures.get("dropped_fraction", 0.0))
        return r.price_per_hour_usd / 3600.0 / useful if useful > 0 else math.inf

    # ------------------------------------------------------------------ the decision
    def decide(self, readings: Sequence[PoolReading]) -> Decision:
        """One step's decision from ``readings`` (one per pool, fleet order); updates the state."""
        c = self.config
        figures = {r.pool: dict(self._smooth(r)) for r in readings}
        ratio = {r.pool: self._ratio(figures[r.pool]) for r in readings}
        states: dict[str, str] = {}
        changes: list[str] = []
        for r in readings:
            old = self._state.get(r.pool, "active")
            since = self._since.get(r.pool, 0) + 1
            if not r.routable:
                new = old  # judged again when it is back
            elif old == "drained":
                new = "probation" if since >= c.cooldown_steps else "drained"
            elif ratio[r.pool] > 1.0:
                new = "drained"
            elif old == "probation" and (ratio[r.pool] > c.recover or "k3" not in figures[r.pool]):
                new = "probation"
            else:
                new = "active"
            if new != old:
                changes.append(self._why(r.pool, old, new, figures[r.pool]))
                since = 0
            if new == "probation" and old == "drained":  # judged on fresh figures only
                self._avg[r.pool], figures[r.pool] = {}, {}
            self._state[r.pool], self._since[r.pool] = new, since
            states[r.pool] = new if r.routable else "unavailable"
        routable = [r for r in readings if r.routable]
        forced = None
        if routable and all(states[r.pool] == "drained" for r in routable):
            forced = min(routable, key=lambda r: ratio[r.pool]).pool  # min is stable: ties keep fleet order
            states[forced] = "forced"
            if forced != self._forced:
                changes.append(f"autopilot: every routable pool is over budget; {forced} keeps routing "
                               f"(least over budget: {ratio[forced]:.2f}x)")
        self._forced = forced
        rates = self._rates(readings)
        cost = {r.pool: self._cost(r, rates[r.pool], figures[r.pool]) for r in readings}
        shares = self._shares(readings, states, cost)
        return Decision(shares, states, cost, figures, tuple(changes))

    def _shares(self, readings: Sequence[PoolReading], states: Mapping[str, str],
                cost: Mapping[str, float]) -> dict[str, float]:
        c = self.config
        factor = {"active": 1.0, "forced": 1.0, "probation": c.probe_share, "drained": 0.0, "unavailable": 0.0}
        live = [r for r in readings if factor[states[r.pool]] > 0]
        finite = [cost[r.pool] for r in live if math.isfinite(cost[r.pool])]
        c_min = min(finite, default=math.inf)
        total_cap = sum(r.capacity * r.replicas_alive for r in live)
        weight = {}
        for r in readings:
            f = factor[states[r.pool]]
            if f == 0:
                weight[r.pool] = 0.0
                continue
            if not finite:  # no pool's cost known: no tilt
                tilt = 1.0
            else:
                tilt = (c_min / cost[r.pool]) ** c.sharpness if math.isfinite(cost[r.pool]) else 0.0
            weight[r.pool] = f * r.capacity * r.replicas_alive / total_cap * tilt
        total = sum(weight.values())
        if total <= 0 and live:  # nothing useful anywhere yet: capacity shares of the live pools
            weight = {r.pool: (r.capacity * r.replicas_alive if r in live else 0.0) for r in readings}
            total = sum(weight.values())
        return {p: (w / total if total > 0 else 0.0) for p, w in weight.items()}

    def _why(self, pool: str, old: str, new: str, figures: Mapping[str, float]) -> str:
        c = self.config
        shown = ", ".join(f"{k} {figures[k]:.3g}" for k in _FIGURES if k in figures) or "no figures yet"
        budgets = (f"budgets k3 <= {c.max_k3:g}, masked <= {c.max_masked_fraction:g}, ess >= {c.min_ess:g}, "
                   f"dropped <= {c.max_dropped_fraction:g}")
        reason = {"drained": f"over budget ({shown}; {budgets}); drained for {c.cooldown_steps} steps",
                  "probation": f"cooldown over; on probation at {c.probe_share:g}x its weight",
                  "active": f"within {c.recover:g}x its budgets ({shown}); readmitted"}[new]
        return f"autopilot: pool {pool} {old} -> {new}: {reason}"

    # ------------------------------------------------------------------ resume
    def state(self) -> dict[str, Any]:
        """The smoothed figures and states, JSON-able (:meth:`restore`)."""
        return {"avg": {p: dict(v) for p, v in self._avg.items()}, "state": dict(self._state), "since": dict(self._since),
                "forced": self._forced}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`."""
        self._avg = {p: {k: float(x) for k, x in v.items()} for p, v in state.get("avg", {}).items()}
        self._state = {p: str(s) for p, s in state.get("state", {}).items() if s in STATES}
        self._since = {p: int(n) for p, n in state.get("since", {}).items()}
        self._forced = state.get("forced")
