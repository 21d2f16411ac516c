"""``hetrl fleet plan``: the cheapest fleet that reaches a target throughput, by simulation.

A :class:`PlanConfig` names what can be rented (``capacity``: pools as in
:class:`hetrl.fleet_sim.config.SimPool`, with ``max_replicas`` instead of ``replicas``), the
model, trainer and workload, a ``target_tokens_per_s`` (trained tokens per second) and budgets:
``max_masked_fraction`` (per pool: a pool whose masked fraction exceeds it is not used, with the
reason reported) and ``max_dropped_fraction`` (for the fleet).

The search (:func:`plan`) simulates candidate fleets and keeps the one of least cost per
*useful* (unmasked) trained token among those that meet the target and the budgets:

* each admissible pool alone, at the fewest replicas that reach the target;
* **cheapest first**: pools ordered by modelled cost per token at full use (price per second /
  tokens per second), each filled to its ``max_replicas`` before the next is added, the last at
  the fewest replicas that reach the target.

"Fewest replicas that reach the target" is a bisection on the replica count, which relies on
throughput not decreasing with replicas (a tested property of the simulator). The run's
throughput is also capped by the trainer; a target above that cap is reported as unreachable
with the cap, whatever the fleet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from hetrl.fleet_sim.config import (ModelSpec, SimConfig, SimPool, TrainerSpec, WorkloadSpec, _Strict, load_yaml_model,
                                   reference_tps)
from hetrl.fleet_sim.engine import simulate

__all__ = ["CapacityPool", "PlanConfig", "load_plan_config", "plan"]


class CapacityPool(SimPool):
    """A pool that can be rented: up to ``max_replicas`` replicas (``replicas`` is ignored)."""

    max_replicas: int = Field(ge=1)


class PlanConfig(_Strict):
    """What :func:`plan` searches over (see the module docstring)."""

    name: str = "plan"
    seed: int = 0
    model: ModelSpec
    trainer: TrainerSpec = TrainerSpec()
    workload: WorkloadSpec = WorkloadSpec()
    capacity: tuple[CapacityPool, ...] = Field(min_length=1)
    max_batch: int = Field(64, ge=1)
    reference_tokens_per_s: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    target_tokens_per_s: float = Field(gt=0.0, allow_inf_nan=False)
    max_masked_fraction: float = Field(1.0, ge=0.0, le=1.0)
    max_dropped_fraction: float = Field(1.0, ge=0.0, le=1.0)

    def fleet(self, counts: dict[str, int], name: str) -> SimConfig:
        """The :class:`SimConfig` of ``counts`` replicas per capacity pool (pools at 0 left out)."""
        pools = [SimPool.model_validate({**p.model_dump(exclude={"max_replicas"}), "replicas": counts[p.name]})
                 for p in self.capacity if counts.get(p.name)]
        return SimConfig(name=name, seed=self.seed, model=self.model, trainer=self.trainer, workload=self.workload,
                         pools=tuple(pools), max_batch=self.max_batch, reference_tokens_per_s=self.reference_tokens_per_s)


def load_plan_config(path: str | Path) -> PlanConfig:
    """Read and validate a plan YAML (:func:`~hetrl.fleet_sim.config.load_yaml_model`)."""
    return load_yaml_model(path, PlanConfig)


def _meets(report: dict[str, Any], cfg: PlanConfig) -> bool:
    return (report["tokens_per_s"] >= cfg.target_tokens_per_s
            and report["dropped_fraction"] <= cfg.max_dropped_fraction)


def _fewest(cfg: PlanConfig, base: dict[str, int], pool: CapacityPool, name: str) -> dict[str, Any] | None:
    """The report of ``base`` plus the fewest replicas of ``pool`` that meet the target (None if
    even ``max_replicas`` do not), by bisection."""
    run = lambda n: simulate(cfg.fleet({**base, pool.name: n}, name))  # noqa: E731
    top = run(pool.max_replicas)
    if not _meets(top, cfg):
        return None
    lo, hi, best = 0 if any(base.values()) else 1, pool.max_replicas, top
    while lo < hi:
        mid = (lo + hi) // 2
        r = run(mid)
        if _meets(r, cfg):
            hi, best = mid, r
        else:
            lo = mid + 1
    return best


def plan(cfg: PlanConfig) -> dict[str, Any]:
    """Search the candidate fleets (see the module docstring). Returns ``{"best": report or
    None, "candidates": [report, ...], "excluded": {pool: reason}, "trainer_cap_tokens_per_s",
    "target_tokens_per_s"}``; each report is :func:`hetrl.fleet_sim.report.summarize`'s, with
    ``pools_config``: its pools as a simulator config lists them."""
    w = cfg.workload
    step_tokens = w.batch_groups * w.group_size * (w.prompt_tokens + w.response_tokens)
    trainer_cap = w.batch_groups * w.group_size * w.response_tokens / cfg.trainer.step_time(cfg.model, step_tokens)
    excluded = {p.name: f"masked fraction {p.masked():.4f} > budget {cfg.max_masked_fraction}"
                for p in cfg.capacity if p.masked() > cfg.max_masked_fraction}
    usable = [p for p in cfg.capacity if p.name not in excluded]
    out: dict[str, Any] = {"target_tokens_per_s": cfg.target_tokens_per_s, "trainer_cap_tokens_per_s": trainer_cap,
                           "excluded": excluded, "candidates": [], "best": None}
    if not usable or trainer_cap < cfg.target_tokens_per_s:
        return out
    for p in usable:
        r = _fewest(cfg, {}, p, f"only-{p.name}")
        if r is not None:
            out["candidates"].append(r)
    ref = reference_tps(cfg.model, cfg.max_batch, cfg.reference_tokens_per_s)
    order = sorted(usable, key=lambda p: p.price_per_s() / (p.capacity() * ref))
    base: dict[str, int] = {}
    for p in order:
        r = _fewest(cfg, base, p, "cheapest-first")
        if r is not None:
            if base:  # else it is the "only" candidate of this pool, already simulated
                out["candidates"].append(r)
            break
        base[p.name] = p.max_replicas
    for r in out["candidates"]:  # each candidate as the pools of a simulator config, to reproduce it
        fleet = cfg.fleet({p["name"]: p["replicas"] for p in r["pools"]}, r["name"])
        r["pools_config"] = [p.model_dump(exclude_defaults=True) for p in fleet.pools]
    ok = [r for r in out["candidates"] if _meets(r, cfg)]
    out["best"] = min(ok, key=lambda r: r["usd_per_useful_mtok"]) if ok else None
    return out
