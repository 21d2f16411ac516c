"""The autopilot (``fleet.routing: autopilot``): the decision function (drain, probation,
readmission, cost tilt, never all drained), its shares in the real fleet's routing and in the
lockstep schedule's pinning, its config, the router between the loop's records and the fleet,
the E5 grid; slow: a tiny paced mixed-fleet run whose metrics show its decisions, and a lockstep
autopilot run killed and resumed that repeats the uninterrupted one."""

import dataclasses
import json
import logging
import math
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_fleet import FakeSampler, pool, requests
from tiny_run import NO_EVAL, QUIET, TINY_BATCH, TINY_MODEL, set_args

from hetrl.cli import main
from hetrl.config import ConfigError, load_config
from hetrl.orchestrator.schedule import LockstepSchedule, Driver
from hetrl.samplers.autopilot import STATES, Autopilot, AutopilotConfig, PoolReading
from hetrl.samplers.fleet import Fleet, FleetConfig

CFG = AutopilotConfig(max_k3=0.01, max_masked_fraction=0.2, min_ess=0.5, max_dropped_fraction=0.5,
                      recover=0.8, cooldown_steps=2, probe_share=0.25, sharpness=2.0, smoothing=1.0)


def reading(name: str, *, k3: float | None = 1e-3, price: float = 2.0, tokens_per_s: float = 1000.0,
            capacity: float = 1.0, masked: float = 0.0, ess: float = 0.99, routable: bool = True,
            replicas: int = 1, returned: int = 2, dropped: int = 0) -> PoolReading:
    """A pool's reading at one step: one second busy at ``tokens_per_s``; mismatch over 100 tokens
    (none when ``k3`` is None)."""
    mismatch = {} if k3 is None else {"num_tokens": 100.0, "k3": k3, "masked_frac/any": masked, "ess": ess}
    return PoolReading(pool=name, capacity=capacity, replicas_alive=replicas if routable else 0, routable=routable,
                       price_per_hour_usd=price, tokens=tokens_per_s, busy_s=1.0,
                       modelled_tokens_per_s=tokens_per_s, mismatch=mismatch, returned=returned, dropped=dropped)


def run(pilot: Autopilot, steps):
    """Decide each step's readings in turn; the decisions."""
    return [pilot.decide(r) for r in steps]


# ====================================================================== the state machine
def test_a_pool_over_its_k3_budget_is_drained_then_probed_then_readmitted_once_it_recovers():
    pilot = Autopilot(CFG)
    good = reading("good")
    bad, recovered, marginal = reading("q", k3=0.05), reading("q", k3=0.001), reading("q", k3=0.009)
    d = run(pilot, [[good, reading("q")], [good, bad], [good, bad], [good, bad], [good, marginal],
                    [good, recovered]])
    states = [x.states["q"] for x in d]
    # over budget -> drained for cooldown_steps (2) steps -> probation (fresh figures only: the
    # marginal 0.009 is within budget but above recover x budget = 0.008, so it stays) -> active
    assert states == ["active", "drained", "drained", "probation", "probation", "active"]
    assert [x.shares["q"] for x in d][1:3] == [0.0, 0.0]
    assert d[1].shares["good"] == 1.0
    assert 0 < d[3].shares["q"] < d[5].shares["q"]  # throttled on probation, full weight again after
    assert any("q active -> drained" in line and "k3 0.05" in line for line in d[1].changes)
    assert any("readmitted" in line for line in d[5].changes)
    assert all(x.metrics()["pool/q/autopilot/state"] == STATES[x.states["q"]] for x in d)


@pytest.mark.parametrize("over", [dict(masked=0.5), dict(ess=0.2), dict(returned=1, dropped=3)])
def test_each_budget_drains_a_pool_that_breaks_it(over):
    d = Autopilot(CFG).decide([reading("good"), reading("q", **over)])
    assert d.states["q"] == "drained" and d.shares["q"] == 0.0 and d.shares["good"] == 1.0


def test_on_probation_a_pool_breaking_its_budget_again_is_drained_again():
    pilot = Autopilot(CFG)
    good, bad = reading("good"), reading("q", k3=0.05)
    d = run(pilot, [[good, bad], [good, bad], [good, bad], [good, bad]])
    assert [x.states["q"] for x in d] == ["drained", "drained", "probation", "drained"]


def test_on_probation_without_fresh_figures_a_pool_waits():
    pilot = Autopilot(CFG)
    good = reading("good")
    d = run(pilot, [[good, reading("q", k3=0.05)], [good, reading("q", k3=None)], [good, reading("q", k3=None)],
                    [good, reading("q", k3=None)]])
    assert [x.states["q"] for x in d] == ["drained", "drained", "probation", "probation"]


def test_when_every_pool_is_over_budget_the_least_over_keeps_routing():
    pilot = Autopilot(CFG)
    d = pilot.decide([reading("a", k3=0.08), reading("b", k3=0.03), reading("c", k3=0.05)])
    assert d.states == {"a": "drained", "b": "forced", "c": "drained"}
    assert d.shares == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert any("b keeps routing" in line for line in d.changes)
    again = pilot.decide([reading("a", k3=0.08), reading("b", k3=0.03), reading("c", k3=0.05)])
    assert again.states["b"] == "forced" and not any("keeps routing" in line for line in again.changes)  # said once


def test_an_unavailable_pool_gets_nothing_and_keeps_its_state():
    pilot = Autopilot(CFG)
    d = run(pilot, [[reading("a"), reading("b", k3=0.05)], [reading("a"), reading("b", routable=False)]])
    assert d[1].states["b"] == "unavailable" and d[1].shares == {"a": 1.0, "b": 0.0}
    assert pilot.state()["state"]["b"] == "drained"


# ====================================================================== the weights
def test_among_in_budget_pools_the_cheaper_per_useful_token_gets_more_weight():
    # same speed and price: the one with half its tokens masked costs twice as much per useful token
    d = Autopilot(CFG).decide([reading("clean", masked=0.0), reading("masky", masked=0.1)])
    assert d.shares["clean"] > d.shares["masky"] > 0
    ratio = d.cost_per_useful_token["masky"] / d.cost_per_useful_token["clean"]
    assert ratio == pytest.approx(1 / 0.9)
    assert d.shares["clean"] / d.shares["masky"] == pytest.approx(ratio ** CFG.sharpness)
    # price and speed: a pool twice the price per token gets 1/4 of the weight at sharpness 2
    d = Autopilot(CFG).decide([reading("cheap", price=1.0), reading("dear", price=4.0, tokens_per_s=2000.0)])
    assert d.shares["cheap"] / d.shares["dear"] == pytest.approx(4.0)


def test_a_pool_not_yet_measured_is_costed_in_the_measured_pools_units():
    """A pool that has generated nothing is costed at its modelled rate x the measured pools'
    measured / modelled ratio: modelled rates (the catalogue's, here 1000 tok/s per H100) against
    this machine's measured ones (here 10x lower) would make it look 10x cheaper per token."""
    def measured(name, price):  # modelled 1000 tok/s, measured 100
        return dataclasses.replace(reading(name, price=price), tokens=100.0, busy_s=1.0)
    fresh = dataclasses.replace(reading("new", price=2.0, k3=None), tokens=0.0, busy_s=0.0)
    d = Autopilot(CFG).decide([measured("a", 2.0), measured("b", 4.0), fresh])
    assert d.cost_per_useful_token["new"] == pytest.approx(d.cost_per_useful_token["a"])  # same price, same rate
    assert d.shares["new"] == pytest.approx(d.shares["a"]) and d.shares["b"] == pytest.approx(d.shares["a"] / 4)
    alone = Autopilot(CFG).decide([fresh])  # nothing measured: the modelled rate as it is
    assert alone.cost_per_useful_token["new"] == pytest.approx(2.0 / 3600 / 1000)


def test_with_equal_costs_the_shares_are_the_capacity_shares():
    d = Autopilot(CFG).decide([reading("a", capacity=3.0, price=3.0, tokens_per_s=3000.0),
                               reading("b", capacity=1.0, price=1.0, replicas=2)])
    assert d.shares == pytest.approx({"a": 0.6, "b": 0.4})


figures = st.builds(
    dict, k3=st.one_of(st.none(), st.floats(0, 0.1)), price=st.floats(0.1, 20), tokens_per_s=st.floats(10, 1e4),
    capacity=st.floats(0.1, 10), masked=st.floats(0, 1), ess=st.floats(0, 1), routable=st.booleans(),
    replicas=st.integers(1, 4), returned=st.integers(0, 8), dropped=st.integers(0, 8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(figures, min_size=1, max_size=4), min_size=1, max_size=6))
def test_shares_sum_to_one_over_routable_pools_and_some_pool_always_routes(steps):
    pilot, again = Autopilot(CFG), Autopilot(CFG)
    for step in steps:
        readings = [reading(f"p{i}", **f) for i, f in enumerate(step)]
        d = pilot.decide(readings)
        assert all(s >= 0 and math.isfinite(s) for s in d.shares.values())
        if any(r.routable for r in readings):
            assert sum(d.shares.values()) == pytest.approx(1.0)
            assert any(d.states[r.pool] in ("active", "probation", "forced") for r in readings if r.routable)
        else:
            assert sum(d.shares.values()) == 0.0
        assert all(d.shares[r.pool] == 0.0 for r in readings if not r.routable)
        assert again.decide(readings) == d  # deterministic given the figures


def test_state_round_trips_through_json():
    pilot = Autopilot(CFG)
    pilot.decide([reading("a"), reading("b", k3=0.05)])
    resumed = Autopilot(CFG)
    resumed.restore(json.loads(json.dumps(pilot.state())))
    nxt = [reading("a"), reading("b", k3=0.002)]
    assert resumed.decide(nxt) == pilot.decide(nxt)


# ====================================================================== config
@pytest.mark.parametrize("bad", [{"max_k3": 0}, {"max_masked_fraction": 1.5}, {"min_ess": 1.0}, {"recover": 1.0},
                                 {"cooldown_steps": 0}, {"probe_share": 0}, {"sharpness": -1}, {"budget": 1}])
def test_bad_autopilot_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        AutopilotConfig(**bad)


def test_lockstep_autopilot_needs_the_modelled_clock():
    with pytest.raises(ConfigError, match="cost_clock 'modelled'"):
        load_config("tiny_homogeneous.yaml", ["async.schedule=lockstep", "async.max_staleness=0",
                                              "fleet.routing=autopilot", "fleet.cost_clock=wall"])


# ====================================================================== the fleet applies the shares
def _fleet(**kw):
    return Fleet.from_config(FleetConfig(pools=[pool("a", "b200", "bf16"), pool("b", "b200", "bf16")], max_batch=64,
                                         **kw), lambda p, n, i: FakeSampler(p))


def test_the_fleet_routes_by_shares_and_sends_nothing_to_a_drained_pool():
    fleet = _fleet()
    fleet.set_shares({"a": 0.75, "b": 0.25})
    for i in range(8):
        fleet.submit(f"g{i}", requests(f"g{i}", n=2))
    load = {r.pool.name: r.load for r in fleet.replicas}
    assert load == {"a": 12, "b": 4}
    fleet.set_shares({"a": 1.0, "b": 0.0})
    fleet.submit("g8", requests("g8", n=2))  # routed: nothing to the drained pool
    assert {r.pool.name: r.load for r in fleet.replicas} == {"a": 14, "b": 4}
    # a pin is kept whatever the shares (a lockstep group pinned before the pool was drained,
    # carried over a resume, goes where it went in the uninterrupted run)
    fleet.submit("pinned", requests("pinned", n=2), replica="b/0")
    assert {r.pool.name: r.load for r in fleet.replicas} == {"a": 14, "b": 6}
    fleet.set_shares(None)  # capacity routing again: equal pools, the lighter one
    fleet.submit("g9", requests("g9", n=2))
    assert {r.pool.name: r.load for r in fleet.replicas} == {"a": 14, "b": 8}
    with pytest.raises(ValueError, match="unknown"):
        fleet.set_shares({"zzz": 1.0})


def test_a_small_share_throttles_a_pool_even_when_every_pool_is_busy():
    fleet = Fleet.from_config(FleetConfig(pools=[pool("a", "b200", "bf16"), pool("b", "b200", "bf16")], max_batch=4),
                              lambda p, n, i: FakeSampler(p))
    fleet.set_shares({"a": 0.8, "b": 0.2})  # b's slots: max(1, round(4 x 0.2 / 0.8)) = 1 of its 4
    for i in range(10):
        fleet.submit(f"g{i}", requests(f"g{i}"))
    assert {r.pool.name: r.load for r in fleet.replicas} == {"a": 4, "b": 1}
    fleet.set_shares(None)  # capacity routing: equal speeds, 4 slots each
    assert {r.pool.name: r.load for r in fleet.replicas} == {"a": 4, "b": 4}


def test_lockstep_pins_follow_the_shares_deterministically():
    fleet = _fleet()
    sched = LockstepSchedule(fleet, Driver(lambda: None, lambda r, j: None, lambda r: None), seed=0)
    assert [sched.pin(i) for i in range(4)] == ["a/0", "b/0", "a/0", "b/0"]  # round robin without shares
    fleet.set_shares({"a": 0.8, "b": 0.2})
    pins = [sched.pin(i) for i in range(200)]
    assert pins == [sched.pin(i) for i in range(200)]
    assert pins.count("a/0") / 200 == pytest.approx(0.8, abs=0.02)
    fleet.set_shares({"a": 0.0, "b": 1.0})
    assert {sched.pin(i) for i in range(20)} == {"b/0"}


def test_the_router_feeds_the_fleets_figures_applies_the_shares_and_resumes_them():
    from hetrl.core.buffer import PoolCounters
    from hetrl.orchestrator.recorder import PoolStep
    from hetrl.orchestrator.routing import make_router

    fleet = Fleet.from_config(FleetConfig(pools=[pool("cheap", "b200", "bf16"), pool("dear", "h100", "bf16")],
                                          cost_clock="modelled"), lambda p, n, i: FakeSampler(p))
    assert make_router(fleet, "capacity", CFG) is None
    router = make_router(fleet, "autopilot", CFG)
    fleet.generate({f"g{i}": requests(f"g{i}", n=2) for i in range(6)})
    figures = fleet.pool_figures()

    def steps(k3_dear):
        return [PoolStep(p, "-", 1, {"num_tokens": 10.0, "k3": k}, figures[p], PoolCounters(groups_out=1))
                for p, k in (("cheap", 1e-4), ("dear", k3_dear))]

    metrics = router.step(steps(1e-4))
    # same k3: the shares follow cost per token (the catalogue's price / modelled speed on this clock)
    cost = {p: figures[p].price_per_hour_usd / figures[p].capacity for p in ("cheap", "dear")}
    assert fleet.shares == router.last.shares and sum(fleet.shares.values()) == pytest.approx(1.0)
    assert (fleet.shares["cheap"] > fleet.shares["dear"]) == (cost["cheap"] < cost["dear"])
    assert metrics["pool/dear/autopilot/state"] == STATES["active"]
    metrics = router.step(steps(0.5))
    assert fleet.shares["dear"] == 0.0 and metrics["pool/dear/autopilot/state"] == STATES["drained"]
    resumed_fleet = Fleet.from_config(FleetConfig(pools=[pool("cheap", "b200", "bf16"), pool("dear", "h100", "bf16")],
                                                  cost_clock="modelled"), lambda p, n, i: FakeSampler(p))
    resumed = make_router(resumed_fleet, "autopilot", CFG)
    resumed.restore(json.loads(json.dumps(router.state())))
    assert resumed_fleet.shares == fleet.shares  # routes as at the checkpoint until the next decision
    assert resumed.step(steps(0.5)) == router.step(steps(0.5))


# ====================================================================== end to end
@pytest.mark.slow
def test_a_paced_mixed_fleet_run_records_the_autopilots_decisions(tmp_path, caplog):
    """A budget no pool meets (k3 <= 1e-12): a pool is drained (share 0, logged with its k3) at the
    first step its tokens are trained, and every step's shares sum to 1 with some pool routing."""
    fleet = ("fleet.pools=[{name: b200-bf16, accelerator: b200, weight_precision: bf16}, "
             "{name: h100-fp8, accelerator: h100, weight_precision: fp8_e4m3}]")
    args = ["train", "tiny_homogeneous.yaml", *set_args([
        f"output_dir={tmp_path}", TINY_MODEL, QUIET, *TINY_BATCH, NO_EVAL, fleet, "steps=3", "async.max_new_tokens=8",
        "fleet.pacing=modelled", "fleet.cost_clock=modelled", "fleet.routing=autopilot",
        "fleet.autopilot={max_k3: 1.0e-12, cooldown_steps: 1}"])]
    with caplog.at_level(logging.WARNING, logger="hetrl.orchestrator.routing"):
        assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    pools = ("b200-bf16", "h100-fp8")
    assert len(rows) == 3
    for row in rows:
        assert sum(row[f"pool/{p}/autopilot/share"] for p in pools) == pytest.approx(1.0)
        assert any(row[f"pool/{p}/autopilot/share"] > 0 for p in pools)
    drains = [(i, p) for i, row in enumerate(rows) for p in pools
              if row[f"pool/{p}/autopilot/state"] == STATES["drained"]]
    assert drains, "no pool was drained over a budget none meets"
    i, p = drains[0]
    assert rows[i][f"pool/{p}/autopilot/share"] == 0.0 and rows[i][f"pool/{p}/autopilot/k3"] > 1e-12
    assert any(f"pool {p} active -> drained: over budget (k3" in m for m in caplog.messages)


# ====================================================================== E5
def test_the_e5_grid_is_valid_and_compares_the_rented_time_cost(capsys):
    from hetrl.experiment.claims import claim_cost
    from hetrl.experiment.config import load_experiment

    assert main(["experiment", "experiment_e5.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 runs of 4 arms, every config valid" in out
    assert out.count("fleet.pacing=\"modelled\"") == 12 and out.count("fleet.routing=\"autopilot\"") == 6
    assert out.count("fleet.autopilot.max_masked_fraction=0.5") == 3
    config, _ = load_experiment("experiment_e5.yaml")
    e3 = config.analyses.e3
    assert (e3.clock, e3.measure, e3.claimed_cost_ratio) == ("rented", "rented_usd_per_mtok", 0.8)
    cheap = {"heldout_end": 0.2, "rented_usd_per_mtok": 1.0, "usd_per_mtok": 9.0}
    dear = {"heldout_end": 0.2, "rented_usd_per_mtok": 2.0, "usd_per_mtok": 1.0}
    values = {"mixed_autopilot": [cheap, dict(cheap)], "homogeneous": [dear, dict(dear)]}
    finding = claim_cost(e3, values).findings[1]
    assert "rented_usd_per_mtok" in finding.measured and "0.500" in finding.measured  # the rented clock's ratio


@pytest.mark.slow
def test_a_lockstep_autopilot_run_killed_and_resumed_repeats_the_uninterrupted_one(tmp_path):
    """Two pools, a budget no pool meets (so the states change from step to step), under faults
    (poisoned generations, rejected by the gate; zero-length stalls: the chaos wrapper must
    forward the per-step reseed and restart its own draws): the killed and resumed run's
    metrics, autopilot decisions included, equal the uninterrupted run's."""
    from test_resume_after_kill import CHAOS, LOCKSTEP, RUN_TIMEOUT_S, _command, _kill_and_resume, assert_same_records

    extra = (*LOCKSTEP, *CHAOS, *set_args([
        "fleet.pools=[{name: b200-bf16, accelerator: b200, weight_precision: bf16}, "
        "{name: h100-fp8, accelerator: h100, weight_precision: fp8_e4m3}]",
        "fleet.routing=autopilot", "fleet.autopilot={max_k3: 1.0e-12, cooldown_steps: 1}"]))
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = subprocess.run(_command(whole, *extra), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    _kill_and_resume(cut, *extra)
    expected = assert_same_records(whole, cut)
    assert all(any("/autopilot/" in k for k in r) for r in expected)
    assert expected[-1]["chaos/poisoned"] > 0  # faults were injected
    states = {r[f"pool/{p}/autopilot/state"] for r in expected for p in ("b200-bf16", "h100-fp8")}
    assert len(states) > 1  # the decisions changed over the run
