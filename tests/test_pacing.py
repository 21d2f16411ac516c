"""Time-faithful emulation (``fleet.pacing: modelled``) and cost on the rented-time clock.

The samplers are the fleet tests' doubles: their calls take real wall time (a sleep), which the
pacing scales; the fleet, the pacing wrapper and the buffer are the real ones.
"""

import threading
import time

import numpy as np
import pytest
from test_fleet import FakeSampler, pool, requests, to_rollout

from hetrl.core.buffer import RolloutBuffer, RolloutGroup
from hetrl.samplers.base import Sampler
from hetrl.samplers.fleet import Fleet, FleetConfig
from hetrl.samplers.pacing import Paced, ReferenceRate
from hetrl.samplers.profiles import CATALOGUE

FAST = pool("fast", "b200", "nvfp4")   # 2.4 x 2.2 = 5.28 x H100
SLOW = pool("slow", "a100", "bf16")    # 0.61 x H100: paced 8.66x slower than FAST


def _clock(*times):
    it = iter(times)
    return lambda: next(it)


def test_a_paced_call_lasts_its_tokens_at_the_reference_rate_times_its_ratio():
    rate, slept = ReferenceRate(), []
    ref = Paced(FakeSampler(FAST), 1.0, rate, clock=_clock(0.0, 9.0, 10.0, 10.5), sleep=slept.append)
    ref.generate(requests("a", 2))  # first call (compiles): not recorded
    assert rate.tokens_per_s() is None
    ref.generate(requests("b", 2))  # 2 requests x 3 tokens in 0.5 s
    assert rate.tokens_per_s() == pytest.approx(12.0) and slept == []  # the reference is never held
    slow = Paced(FakeSampler(SLOW), 0.25, rate, clock=_clock(20.0, 20.5), sleep=slept.append)
    out = slow.generate(requests("j", 2))
    assert [g.request_id for g in out] == ["j/0", "j/1"]
    assert slept == [pytest.approx(6 / (12.0 * 0.25) - 0.5)]  # held until 2 s after the call began
    slow._clock = _clock(30.0, 35.0)  # already slower than modelled (a compile): not held
    slow.generate(requests("k", 2))
    assert len(slept) == 1
    assert isinstance(slow, Sampler)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        Paced(FakeSampler(SLOW), 2.0, rate)


def test_before_any_rate_is_known_no_call_is_held():
    """Before ``R`` is measured a call may have paid a compile (a first call, or new shapes): held
    ``c_ref / c`` times its own time, a slow pool's compile was multiplied 10x over."""
    rate, slept = ReferenceRate(), []
    slow = Paced(FakeSampler(SLOW), 0.25, rate, clock=_clock(0.0, 30.0, 40.0, 40.5, 50.0, 50.5), sleep=slept.append)
    slow.generate(requests("i"))  # first call: compiles, not recorded
    slow.generate(requests("j"))  # no rate before it: not held by its own time; recorded (3 tokens in 0.5 s)
    assert slept == []
    rate.record(12, 1.0)  # a reference call: 12 tokens/s, preferred to the other replicas' 6
    slow.generate(requests("k"))  # 3 tokens at 12 x 0.25 tokens/s: 1 s
    assert slept == [pytest.approx(1.0 - 0.5)]


def test_until_the_reference_has_a_call_the_other_replicas_cpu_rate_stands_in():
    """The reference pool still compiling (or quarantined before its second call) must not leave
    the fleet unpaced: the other replicas' unheld call times give ``R`` meanwhile."""
    rate, slept = ReferenceRate(), []
    other = Paced(FakeSampler(SLOW), 0.5, rate, clock=_clock(0.0, 9.0, 10.0, 10.5), sleep=slept.append)
    other.generate(requests("a", 2))
    other.generate(requests("b", 2))  # 6 tokens in 0.5 s: 12 tokens/s
    assert rate.tokens_per_s() == pytest.approx(12.0) and slept == []
    slow = Paced(FakeSampler(SLOW), 0.25, rate, clock=_clock(20.0, 20.5), sleep=slept.append)
    slow.generate(requests("j", 2))  # 6 tokens at 12 x 0.25 tokens/s: 2 s
    assert slept == [pytest.approx(2.0 - 0.5)]
    rate.record(24, 1.0)  # the reference's first recorded call replaces the stand-in
    assert rate.tokens_per_s() == pytest.approx(24.0)


def test_pacing_ratio_is_the_throughput_ratio_to_the_fastest_pool():
    fleet = Fleet.from_config(FleetConfig(pools=[FAST, SLOW], pacing="modelled"), lambda p, n, i: FakeSampler(p))
    fast, slow = fleet.replicas
    assert fast.sampler.is_reference and not slow.sampler.is_reference
    assert slow.sampler.ratio == pytest.approx(slow.capacity / fast.capacity)
    assert slow.sampler.ratio == pytest.approx(0.61 / (2.4 * 2.2))
    assert fast.sampler.rate is slow.sampler.rate  # one measured reference rate per fleet
    off = Fleet.from_config(FleetConfig(pools=[FAST, SLOW]), lambda p, n, i: FakeSampler(p))
    assert not any(isinstance(r.sampler, Paced) for r in off.replicas)


def test_a_revived_replica_is_paced_too():
    fleet = Fleet.from_config(FleetConfig(pools=[FAST, SLOW], pacing="modelled"), lambda p, n, i: FakeSampler(p))
    slow = fleet.replicas[1]
    fleet._fail(slow, RuntimeError("killed by the test"))
    assert fleet.revive(slow, FakeSampler(SLOW))
    assert isinstance(slow.sampler, Paced) and slow.sampler.ratio < 1 / 8


def test_paced_slow_pool_serves_in_proportion_to_its_modelled_speed():
    fleet = Fleet.from_config(FleetConfig(pools=[FAST, SLOW], pacing="modelled", max_batch=1),
                              lambda p, n, i: FakeSampler(p, delay=0.05))
    # warm up past the first calls (compiles) and measure R over several calls (one call late on a loaded
    # machine would set R for the first held calls), outside the metrics
    for replica in fleet.replicas:
        for _ in range(5 if replica.sampler.is_reference else 2):
            replica.sampler.generate(requests("warm-up"))
    t0 = time.monotonic()
    fleet.generate({f"g{i}": requests(f"g{i}") for i in range(20)}, timeout=30)
    wall = time.monotonic() - t0
    m = fleet.metrics()
    fast_rate = m["pool/fast/requests"] / m["pool/fast/busy_s"]
    slow_rate = m["pool/slow/requests"] / m["pool/slow/busy_s"]
    assert fast_rate / slow_rate == pytest.approx(2.4 * 2.2 / 0.61, rel=0.35)
    assert m["pool/fast/requests"] > 3 * m["pool/slow/requests"]
    assert wall < 10


def _run_async(pacing: str, steps: int = 24, batch_groups: int = 2, max_staleness: int = 20) -> dict[str, float]:
    """A minimal asynchronous loop over the real fleet and buffer: one worker thread per replica
    puts finished groups into the buffer; the trainer takes ``batch_groups`` at its version, steps
    (a short sleep), publishes. At most ``(max_staleness + 1) * batch_groups`` groups are
    outstanding, as in the orchestrator. Returns the mean staleness of each pool's trained groups."""
    cfg = FleetConfig(pools=[FAST, SLOW], pacing=pacing, max_batch=2)
    fleet = Fleet.from_config(cfg, lambda p, n, i: FakeSampler(p, delay=0.01))
    buffer = RolloutBuffer(max_staleness, "drop")
    stop, lock = threading.Event(), threading.Lock()
    state = {"next": 0, "outstanding": 0}
    bound = (max_staleness + 1) * batch_groups

    def top_up():
        with lock:
            while state["outstanding"] < bound:
                gid = f"g{state['next']}"
                state["next"] += 1
                state["outstanding"] += 1
                fleet.submit(gid, requests(gid))

    def worker(r):
        while not stop.is_set():
            for res in fleet.serve_once(r, timeout=0.05):
                buffer.put(RolloutGroup(res.job_id, res.job_id, tuple(to_rollout(res.job_id, g) for g in res.generations)))

    top_up()
    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in fleet.replicas]
    for t in threads:
        t.start()
    staleness: dict[str, list[int]] = {"fast": [], "slow": []}
    fleet.publish_weights(1, {})
    version = 1
    try:
        for _ in range(steps):
            batch = buffer.take(batch_groups, version, timeout=20)
            assert batch, "the fleet produced no batch"
            for g in batch:
                staleness[g.pool].append(g.staleness(version))
            time.sleep(0.002)
            version += 1
            fleet.publish_weights(version, {})
            with lock:
                state["outstanding"] -= len(batch) + len(buffer.pop_evicted())
            top_up()
    finally:
        stop.set()
        fleet.close()
        for t in threads:
            t.join()
    return {p: float(np.mean(v)) if v else float("nan") for p, v in staleness.items()}


def test_with_pacing_the_slowest_pools_rollouts_are_the_stalest():
    paced = _run_async("modelled")
    assert paced["slow"] > paced["fast"] + 1.0, paced
    unpaced = _run_async("off")  # the control: at CPU speed the slow pool is not slow
    assert paced["slow"] - paced["fast"] > (unpaced["slow"] - unpaced["fast"]) + 1.0, (paced, unpaced)


def test_rented_cost_counts_idle_time_and_spot_prices():
    spot = pool("spot", "h100", price="spot", accelerators_per_replica=2)
    fleet = Fleet.from_config(FleetConfig(pools=[FAST, spot]), lambda p, n, i: FakeSampler(p, delay=0.02))
    fleet.generate({"g": requests("g")}, timeout=5)
    time.sleep(0.2)  # every replica idles, rented
    fleet.close()
    m = fleet.metrics()
    for name, price in (("fast", CATALOGUE["b200"].price_per_hour_usd), ("spot", 2 * CATALOGUE["h100"].spot_price_per_hour_usd)):
        assert m[f"pool/{name}/rented_s"] >= 0.2
        assert m[f"pool/{name}/rented_s"] > m[f"pool/{name}/busy_s"]
        assert m[f"pool/{name}/cost/rented_usd"] == pytest.approx(price * m[f"pool/{name}/rented_s"] / 3600)
        assert m[f"pool/{name}/cost/usd"] == pytest.approx(price * m[f"pool/{name}/busy_s"] / 3600)
        assert m[f"pool/{name}/idle_fraction"] == pytest.approx(1 - m[f"pool/{name}/busy_s"] / m[f"pool/{name}/rented_s"])
    assert m["fleet/cost/rented_usd"] > m["fleet/cost/usd"]
    assert CATALOGUE["h100"].spot_price_per_hour_usd < CATALOGUE["h100"].price_per_hour_usd
    frozen = fleet.metrics()["fleet/rented_s"]
    time.sleep(0.05)
    assert fleet.metrics()["fleet/rented_s"] == frozen  # the clock stops at close


def test_rented_time_continues_across_a_resume():
    fleet = Fleet.from_config(FleetConfig(pools=[FAST]), lambda p, n, i: FakeSampler(p))
    fleet.close()
    state = fleet.counters_state()
    state["rented_s"]["fast/0"] = 100.0
    resumed = Fleet.from_config(FleetConfig(pools=[FAST]), lambda p, n, i: FakeSampler(p))
    resumed.restore_counters(state)
    assert 100.0 <= resumed.metrics()["pool/fast/rented_s"] < 110.0


def test_spot_override_prices_the_spot_mode():
    p = pool("s", "h100", price="spot", price_per_hour_usd=1.23)
    n = p.numerics()
    assert n.cost_per_hour("spot") == 1.23 and n.cost_per_hour() == CATALOGUE["h100"].price_per_hour_usd
