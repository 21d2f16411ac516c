"""The fleet simulator's invariants: determinism, accounting identities, the staleness bound,
monotonicity in replicas, and the cost of preemptions."""

import math

import pytest

from hetrl.errors import UserError
from hetrl.fleet_sim.config import SimConfig, SimPool, load_sim_config, masked_fraction
from hetrl.fleet_sim.plan import load_plan_config
from hetrl.samplers.fleet import PoolConfig
from hetrl.fleet_sim.engine import simulate


def config(pools=None, **workload) -> SimConfig:
    w = {"batch_groups": 16, "steps": 12, "max_staleness": 2, "response_tokens": 512.0, "group_size": 4}
    w.update(workload)
    return SimConfig.model_validate({
        "name": "t", "seed": 3, "model": {"params_b": 8}, "trainer": {"accelerator": "b200", "count": 8},
        "workload": w, "max_batch": 32,
        "pools": pools or [{"name": "fast", "accelerator": "b200", "weight_precision": "nvfp4", "replicas": 2},
                           {"name": "mid", "accelerator": "h100", "replicas": 3},
                           {"name": "slow", "accelerator": "l40s", "replicas": 4}]})


def with_pool(cfg: SimConfig, name: str, **changes) -> SimConfig:
    pools = [p.model_copy(update=changes) if p.name == name else p for p in cfg.pools]
    return cfg.model_copy(update={"pools": tuple(pools)})


def test_deterministic_under_a_seed():
    cfg = config()
    a, b = simulate(cfg), simulate(cfg)
    assert a == b
    other = simulate(cfg.model_copy(update={"seed": 4}))
    assert other["trained_tokens"] != a["trained_tokens"]  # the response lengths are drawn from the seed


def test_accounting_identities():
    r = simulate(config(steps=20))
    little = r["little"]
    # exactly: ∫ in-system dt = Σ completed sojourns + the time so far of those still in
    assert little["mean_in_system"] * r["wall_s"] == pytest.approx(
        little["departure_rate"] * r["wall_s"] * little["mean_time_in_system_s"] + little["residual_time_s"], rel=1e-9)
    # Little's law L = λW, up to the groups still in the system at the end
    assert little["mean_in_system"] == pytest.approx(little["departure_rate"] * little["mean_time_in_system_s"], rel=0.25)
    assert r["steps"] == 20 and r["trained_groups"] == 20 * 16
    assert r["trained_tokens"] == sum(p["trained_tokens"] for p in r["pools"])
    assert sum(p["trained_tokens"] for p in r["pools"]) <= sum(p["generated_tokens"] for p in r["pools"])
    assert r["useful_tokens"] == pytest.approx(sum(p["trained_tokens"] * (1 - p["masked_fraction"]) for p in r["pools"]))
    assert r["usd"] == pytest.approx(r["sampler_usd"] + r["trainer_usd"])
    assert r["usd_per_useful_mtok"] > r["usd_per_mtok"]
    for p in r["pools"]:
        assert 0.0 <= p["idle_fraction"] <= 1.0 and p["busy_s"] <= p["rented_s"] + 1e-9
        assert p["rented_s"] == pytest.approx(p["replicas"] * r["wall_s"])  # no preemptions: rented all along


def test_throughput_is_bounded_by_the_fleet_and_the_trainer():
    cfg = config(steps=10, response_cv=0.0)
    r = simulate(cfg)
    fleet_tps = sum(p.capacity() * p.replicas for p in cfg.pools) * cfg.reference_tps()
    assert r["tokens_per_s"] <= fleet_tps
    step_tokens = 16 * 4 * (512 + cfg.workload.prompt_tokens)
    trainer_tps = 16 * 4 * 512 / cfg.trainer.step_time(cfg.model, step_tokens)
    assert r["tokens_per_s"] <= trainer_tps


def test_max_staleness_zero_trains_only_fresh_groups():
    r = simulate(config(max_staleness=0, steps=8))
    assert r["dropped"] == 0
    assert all(p["staleness_max"] <= 0 for p in r["pools"])
    assert r["staleness_mean"] == 0.0


def test_the_staleness_bound_holds_and_the_slowest_pool_is_the_stalest():
    r = simulate(config(max_staleness=2, steps=30, batch_groups=8))
    assert all(p["staleness_max"] <= 2 for p in r["pools"])
    by = {p["name"]: p for p in r["pools"]}
    assert by["slow"]["staleness_mean"] > by["fast"]["staleness_mean"]
    assert by["slow"]["dropped"] >= by["fast"]["dropped"]


def test_regenerate_resubmits_what_drop_loses():
    drop = simulate(config(max_staleness=2, steps=20, batch_groups=8, stale_policy="drop"))
    regen = simulate(config(max_staleness=2, steps=20, batch_groups=8, stale_policy="regenerate"))
    assert drop["dropped"] > 0 and regen["dropped"] > 0
    assert regen["trained_groups"] == drop["trained_groups"] == 20 * 8
    assert regen["regenerated"] == regen["dropped"] and drop["regenerated"] == 0


@pytest.mark.parametrize("pool", ["fast", "slow"])
def test_more_replicas_give_no_less_throughput(pool):
    base = config(steps=10, response_cv=0.0)
    rates = [simulate(with_pool(base, pool, replicas=n))["tokens_per_s"] for n in (1, 2, 4, 8)]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(rates, rates[1:])), rates
    assert rates[-1] > rates[0]


def test_preemptions_raise_cost_per_token():
    base = with_pool(config(steps=15), "mid", price="spot", replicas=6)
    calm = simulate(base)
    stormy = simulate(with_pool(base, "mid", price="spot", replicas=6, preemptions_per_hour=120.0, restart_s=30.0))
    mid = {p["name"]: p for p in stormy["pools"]}["mid"]
    assert mid["preemptions"] > 0 and mid["lost_tokens"] > 0
    assert stormy["usd_per_mtok"] > calm["usd_per_mtok"]
    assert mid["rented_s"] < 6 * stormy["wall_s"]  # not billed while away


def test_spot_is_cheaper_per_token_without_preemptions():
    base = config(steps=8)
    spot = base.model_copy(update={"pools": tuple(p.model_copy(update={"price": "spot"}) for p in base.pools)})
    assert simulate(spot)["sampler_usd"] < simulate(base)["sampler_usd"]


def test_weight_sync_time_slows_a_thin_link():
    base = config(steps=8, max_staleness=0)
    thin = base.model_copy(update={"pools": tuple(p.model_copy(update={"link_gbps": 1.0}) for p in base.pools)})
    assert simulate(thin)["wall_s"] > simulate(base)["wall_s"] + 8 * 2 * 8e9 / (1e9 / 8) * 0.9


def test_masked_fraction_table_and_override():
    assert masked_fraction("nvfp4", "bf16") > masked_fraction("fp8_e4m3", "bf16") > masked_fraction("bf16", "bf16")
    cfg = with_pool(config(), "fast", masked_fraction=0.5)
    assert {p.name: p.masked() for p in cfg.pools}["fast"] == 0.5


def test_bad_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {params_b: 8}\npools: [{name: a, accelerator: a100, weight_precision: fp8_e4m3}]\n")
    with pytest.raises(UserError, match=r"pools\.0.*does not run weight format 'fp8_e4m3'") as err:
        load_sim_config(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="no such file"):
        load_sim_config(tmp_path / "missing.yaml")
    bad.write_text("model: {params_b: 8}\npools: [{name: a, accelerator: v100}]\n")
    with pytest.raises(UserError, match="unknown accelerator kind 'v100'"):
        load_sim_config(bad)


@pytest.mark.parametrize("spec", [
    {"accelerator": "b200", "weight_precision": "nvfp4"},
    {"accelerator": "h100", "weight_precision": "fp8_e4m3", "kv_precision": "fp8_e4m3", "price": "spot",
     "price_per_hour_usd": 1.25},
    {"accelerator": "mi300x", "price_per_hour_usd": 3.0, "relative_throughput": 1.7},
    {"accelerator": "a100"},
])
def test_a_simulated_pool_has_the_numerics_of_the_same_fleet_pool(spec):
    sim, real = SimPool(name="p", **spec).numerics(), PoolConfig(name="p", **spec).numerics()
    assert sim == real
    assert sim.cost_per_hour(spec.get("price", "on_demand")) == real.cost_per_hour(spec.get("price", "on_demand"))


def test_plan_and_repeated_keys_load_as_one_line(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("model: {params_b: 8}\ncapacity: [{name: a, accelerator: h100, max_replicas: 2}]\n")
    with pytest.raises(UserError, match=r"target_tokens_per_s: Field required \(1 error\(s\)\)") as err:
        load_plan_config(bad)
    assert "\n" not in str(err.value)
    bad.write_text("model: {params_b: 8}\nmodel: {params_b: 70}\npools: [{name: a, accelerator: h100}]\n")
    with pytest.raises(UserError, match="not valid YAML.*'model'"):
        load_sim_config(bad)


def test_cluster_scale_runs_quickly():
    pools = [{"name": f"p{i}", "accelerator": k, "replicas": 60} for i, k in enumerate(("b200", "h100", "a100", "l40s", "mi300x"))]
    r = simulate(config(pools=pools, batch_groups=256, steps=5))
    assert sum(p["replicas"] for p in r["pools"]) == 300 and r["steps"] == 5
    assert not math.isnan(r["usd_per_mtok"])


# ---------------------------------------------------------------------- plan and the command line
from hetrl.cli import main  # noqa: E402
from hetrl.fleet_sim.plan import PlanConfig, plan  # noqa: E402


def plan_config(target: float, **kw) -> PlanConfig:
    return PlanConfig.model_validate({
        "model": {"params_b": 8}, "trainer": {"accelerator": "b200", "count": 8}, "max_batch": 32,
        "workload": {"batch_groups": 16, "steps": 6, "group_size": 4, "response_tokens": 512.0},
        "target_tokens_per_s": target,
        "capacity": [{"name": "nv", "accelerator": "b200", "weight_precision": "nvfp4", "max_replicas": 4},
                     {"name": "h", "accelerator": "h100", "price": "spot", "max_replicas": 6},
                     {"name": "l", "accelerator": "l40s", "max_replicas": 8}], **kw})


def test_plan_picks_the_cheapest_fleet_that_meets_the_target_within_budgets():
    cfg = plan_config(8000.0, max_masked_fraction=0.05)
    out = plan(cfg)
    assert "nv" in out["excluded"] and "masked fraction" in out["excluded"]["nv"]
    best = out["best"]
    assert best is not None and best["tokens_per_s"] >= 8000.0
    assert "nv" not in {p["name"] for p in best["pools"]}
    shell = cfg.model_dump(include={"seed", "model", "trainer", "workload", "max_batch", "reference_tokens_per_s"})
    again = simulate(SimConfig.model_validate({**shell, "name": best["name"], "pools": best["pools_config"]}))
    assert again == best_without_config(best)  # the printed pools reproduce the recommendation
    assert best["usd_per_useful_mtok"] == min(c["usd_per_useful_mtok"] for c in out["candidates"] if c["tokens_per_s"] >= 8000)
    # the fewest replicas: one fewer of the fleet's pool misses the target
    if len(best["pools"]) == 1:
        p = best["pools"][0]
        fewer = simulate(cfg.fleet({p["name"]: p["replicas"] - 1}, "fewer")) if p["replicas"] > 1 else None
        assert fewer is None or fewer["tokens_per_s"] < 8000.0


def best_without_config(report):
    return {k: v for k, v in report.items() if k != "pools_config"}


def test_plan_reports_a_target_beyond_the_trainer():
    out = plan(plan_config(1e9))
    assert out["best"] is None and out["trainer_cap_tokens_per_s"] < 1e9


def test_fleet_commands(tmp_path, capsys):
    sim = tmp_path / "sim.yaml"
    sim.write_text(config(steps=4).model_dump_json())  # JSON is YAML
    assert main(["fleet", "simulate", str(sim), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "t.json").exists() and (tmp_path / "o" / "t.png").exists()
    assert "trained tok/s" in capsys.readouterr().out
    sim.write_text("model: {params_b: -1}\npools: []\n")
    assert main(["fleet", "simulate", str(sim)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetrl fleet simulate:") and "\n" not in err
    pl = tmp_path / "plan.yaml"
    pl.write_text(plan_config(8000.0).model_dump_json())
    assert main(["fleet", "plan", str(pl), "--out", str(tmp_path / "p")]) == 0
    assert "recommended:" in capsys.readouterr().out
    pl.write_text(plan_config(1e9).model_dump_json())
    assert main(["fleet", "plan", str(pl), "--out", str(tmp_path / "p")]) == 3
    assert "the trainer caps throughput" in capsys.readouterr().out
