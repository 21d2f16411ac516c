"""The fleet: pool configs, capacity routing, re-queue of dead replicas, weights, metrics, cost.

The samplers here are test doubles of the Sampler protocol (the fleet is under test, not them).
"""

import threading
import time

import numpy as np
import pytest
from pydantic import ValidationError

from hetrl.core.buffer import RolloutBuffer, RolloutGroup
from hetrl.core.correction import TokenStats, mismatch_metrics, pool_mismatch
from hetrl.core.schema import Rollout, SamplingParams
from hetrl.samplers.base import Generation, GenerationRequest, Sampler, SamplerHealth
from hetrl.samplers.fleet import Fleet, FleetConfig, FleetError, PoolConfig


class FakeSampler:
    """Returns ``tokens`` fixed tokens per request after ``delay`` seconds per call. ``kill``:
    an Event; the call blocks until it is set and then raises (a replica dying mid-call).
    ``hold``: an Event; the call blocks until it is set and then returns normally."""

    def __init__(self, pool: PoolConfig, delay: float = 0.0, tokens: int = 3, kill: threading.Event | None = None,
                 hold: threading.Event | None = None):
        self._info = pool.numerics().sampler_info(pool.name, pool.engine, "fake")
        self.delay, self.tokens, self.kill, self.hold = delay, tokens, kill, hold
        self.version = 0
        self.healthy = True
        self.calls = 0
        self.started = threading.Event()
        self.bad_output = False
        self.loads: list[int] = []
        self.call_versions: list[int] = []

    @property
    def info(self):
        return self._info

    def generate(self, requests):
        self.calls += 1
        self.started.set()
        if self.kill is not None:
            self.kill.wait(10)
            raise ConnectionError("replica died mid-generation")
        if self.hold is not None:
            self.hold.wait(10)
        time.sleep(self.delay)
        version = self.version
        self.call_versions.append(version)
        out = [Generation(request_id=r.request_id, token_ids=np.arange(self.tokens, dtype=np.int32),
                          logprobs=np.full(self.tokens, -0.1, np.float32),
                          policy_version=np.full(self.tokens, version, np.int32), finish_reason="length",
                          support=None, sampler=self._info) for r in requests]
        return out[:-1] if self.bad_output else out

    def update_weights(self, version, weights):
        self.loads.append(version)
        self.version = version

    def health(self):
        return SamplerHealth(healthy=self.healthy, weight_version=self.version, detail="" if self.healthy else "down")


def pool(name, kind, weight=None, replicas=1, **kw):
    return PoolConfig(name=name, accelerator=kind, weight_precision=weight, replicas=replicas, **kw)


FAST = pool("fast", "b200", "nvfp4")
SLOW = pool("slow", "l40s", "bf16")


def requests(job: str, n: int = 1):
    return [GenerationRequest(f"{job}/{i}", np.array([1, 2], np.int32), SamplingParams(), 3) for i in range(n)]


def fleet_of(*specs, max_batch=16):
    """``specs``: (PoolConfig, FakeSampler kwargs) per replica."""
    samplers = [(p, FakeSampler(p, **kw)) for p, kw in specs]
    return Fleet(samplers, max_batch=max_batch), [s for _, s in samplers]


# ---------------------------------------------------------------------- config
def test_fake_sampler_satisfies_the_protocol():
    assert isinstance(FakeSampler(FAST), Sampler)


def test_pool_activation_precision_defaults_to_what_engines_serve():
    assert PoolConfig(name="a", accelerator="b200", weight_precision="nvfp4").numerics().activation_format == "nvfp4"
    assert PoolConfig(name="a", accelerator="h100", weight_precision="fp8_e4m3").numerics().activation_format == "fp8_e4m3"
    assert PoolConfig(name="a", accelerator="h100").numerics().activation_format == "none"
    pinned = PoolConfig(name="a", accelerator="h100", weight_precision="fp8_e4m3", activation_precision="none")
    assert pinned.numerics().activation_format == "none"


@pytest.mark.parametrize("kwargs, loc, message", [
    (dict(name="a", accelerator="a100", weight_precision="fp8_e4m3"), "weight_precision", "does not run weight format 'fp8_e4m3'"),
    (dict(name="a", accelerator="h100", kv_precision="nvfp4"), "kv_precision", "KV-cache format 'nvfp4'"),
    (dict(name="a", accelerator="h100", activation_precision="nvfp4"), "activation_precision",
     "does not run activation format 'nvfp4'"),
    (dict(name="a", accelerator="v100"), "accelerator", "unknown accelerator kind 'v100'"),
    (dict(name="a b", accelerator="h100"), "name", "must match"),
    (dict(name="a", accelerator="h100", engine="sglang"), "", "one endpoint per replica"),
    (dict(name="a", accelerator="h100", engine="sglang", endpoints=("https://x",), activation_precision="fp8_e4m3"),
     "", "activation_precision sets how the embedded engine computes"),
    (dict(name="a", accelerator="h100", engine="sglang-jax", endpoints=("https://x",)), "", "serves TPUs"),
    (dict(name="a", accelerator="tpu-v6e", engine="sglang", endpoints=("https://x",)), "", "use 'sglang-jax'"),
    (dict(name="a", accelerator="h100", endpoints=("https://x",)), "", "embedded pools take no endpoints"),
    (dict(name="a", accelerator="h100", server={"retries": 1}), "", "embedded pools take no endpoints"),
    (dict(name="a", accelerator="tpu-v6e", engine="sglang-jax", endpoints=("https://x",)), "",
     "'restart' needs server.restart_command"),
    (dict(name="a", accelerator="tpu-v6e", engine="sglang-jax", endpoints=("https://x",),
          server={"weight_sync": "disk"}), "", "no /update_weights_from_disk endpoint"),
    (dict(name="a", accelerator="h100", engine="sglang", endpoints=("https://x",), server={"top_logprobs_num": 0}),
     "server.top_logprobs_num", "greater than or equal to 1"),
    (dict(name="a", accelerator="h100", replicas=0), "replicas", "greater than or equal to 1"),
    (dict(name="a", accelerator="h100", colour="red"), "colour", "Extra inputs"),
])
def test_pool_config_errors_name_the_field(kwargs, loc, message):
    with pytest.raises(ValidationError) as err:
        PoolConfig(**kwargs)
    first = err.value.errors()[0]
    assert ".".join(map(str, first["loc"])) == loc
    assert message in str(err.value)


def _server(*endpoints: str, **kwargs) -> PoolConfig:
    return PoolConfig(name="s", accelerator="h100", engine="sglang", replicas=len(endpoints), endpoints=endpoints,
                      **kwargs)


@pytest.mark.parametrize("url, message", [
    ("http://sgl-0:30000", "plain http to a non-loopback host"),
    ("http://10.0.0.5:30000", "plain http to a non-loopback host"),
    ("ftp://sgl-0:30000", "must be an http:// or https:// URL"),
    ("sgl-0:30000", "must be an http:// or https:// URL"),
    ("https://:30000", "has no host"),
    ("https://sgl-0:99999", "is not a valid URL"),
    ("https://sgl-0:port", "is not a valid URL"),
    ("https://user:hunter2@sgl-0:30000", "carries credentials"),
    ("https://sk-token@sgl-0", "carries credentials"),
    ("https://sgl-0:30000/?key=hunter2", "without query or fragment"),
])
def test_bad_endpoints_fail_naming_the_endpoint(url, message):
    with pytest.raises(ValidationError) as err:
        _server("https://ok:30000", url)
    first = err.value.errors()[0]
    assert first["loc"] == ("endpoints", 1) and message in first["msg"]


def test_plain_http_is_for_loopback_unless_allowed():
    loopback = ("http://localhost:30000", "http://127.0.0.1:30000", "http://127.8.9.10", "http://[::1]:30000")
    assert _server(*loopback).endpoints == loopback
    assert _server("http://sgl-0:30000", allow_insecure_http=True).endpoints == ("http://sgl-0:30000",)
    assert _server("https://sgl-0", "https://[fd00::1]:8443/v1").replicas == 2


def test_api_key_is_read_from_the_environment_when_used(monkeypatch):
    monkeypatch.delenv("HETRL_TEST_KEY", raising=False)
    pool = _server("https://sgl-0:30000", api_key_env="HETRL_TEST_KEY")
    assert "HETRL_TEST_KEY" in repr(pool) and _server("https://sgl-0").auth_headers() == {}
    with pytest.raises(ValueError, match="'HETRL_TEST_KEY', which is not set"):
        pool.auth_headers()
    monkeypatch.setenv("HETRL_TEST_KEY", "s3cret")
    assert pool.auth_headers() == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(pool) and "s3cret" not in pool.model_dump_json()
    with pytest.raises(ValidationError, match="should match pattern"):
        _server("https://sgl-0", api_key_env="not a name")
    with pytest.raises(ValidationError, match="embedded pools take no endpoints, api_key_env"):
        PoolConfig(name="e", accelerator="h100", api_key_env="HETRL_TEST_KEY")


def test_pool_numerics_and_overrides():
    p = pool("mi", "mi300x", "fp8_e4m3fnuz", price_per_hour_usd=1.5)
    n = p.numerics()
    assert (n.kind, n.weight_format, n.kv_format, n.cost_per_hour()) == ("mi300x", "fp8_e4m3fnuz", "bf16", 1.5)
    tpu = PoolConfig(name="t", accelerator="tpu-v6e", engine="sglang-jax", replicas=2, endpoints=("https://a", "https://b"),
                     server={"restart_command": ("restart.sh", "{endpoint}", "{model_path}")})
    assert tpu.numerics().weight_format == "bf16"
    with pytest.raises(ValidationError, match="repeated: a"):
        FleetConfig(pools=[pool("a", "h100"), pool("a", "a100")])


def test_from_config_builds_every_replica():
    cfg = FleetConfig(pools=[pool("fast", "b200", "nvfp4", replicas=2), SLOW], max_batch=8)
    built = []
    fleet = Fleet.from_config(cfg, lambda p, n, i: built.append((p.name, n.weight_format, i)) or FakeSampler(p))
    assert built == [("fast", "nvfp4", 0), ("fast", "nvfp4", 1), ("slow", "bf16", 0)]
    assert [r.key for r in fleet.replicas] == ["fast/0", "fast/1", "slow/0"]
    with pytest.raises(ValueError, match="reports pool"):
        Fleet([(SLOW, FakeSampler(FAST))])


# ---------------------------------------------------------------------- routing
def test_routing_by_capacity_with_slots():
    fleet, _ = fleet_of((FAST, {}), (SLOW, {}), max_batch=16)
    fast, slow = fleet.replicas
    assert fast.capacity / slow.capacity == pytest.approx(2.4 * 2.2 / 0.26)
    assert (fast.slots, slow.slots) == (16, 1)
    for i in range(20):
        fleet.submit(f"j{i}", requests(f"j{i}"))
    assert (fast.load, slow.load) == (16, 1)  # the rest waits in the queue
    assert fleet.metrics()["fleet/queued_jobs"] == 3.0
    with pytest.raises(ValueError, match="already submitted"):
        fleet.submit("j0", requests("j0"))


def test_least_loaded_alternates_between_equal_replicas_and_big_jobs_go_to_idle_ones():
    h = pool("h", "h100", replicas=2)
    fleet, _ = fleet_of((h, {}), (h, {}), max_batch=4)
    a, b = fleet.replicas
    fleet.submit("g0", requests("g0", 2))
    fleet.submit("g1", requests("g1", 2))
    assert (a.load, b.load) == (2, 2)
    fleet.submit("big", requests("big", 9))  # larger than any replica's slots: waits for an idle one
    assert fleet.metrics()["fleet/queued_jobs"] == 1.0
    fleet.serve_once(a, timeout=1)
    assert a.load == 9 and b.load == 2


def test_every_job_done_once_and_the_slow_pool_is_not_starved():
    fleet, (fast, slow) = fleet_of((FAST, dict(delay=0.002)), (SLOW, dict(delay=0.02)), max_batch=4)
    jobs = {f"g{i}": requests(f"g{i}", 2) for i in range(40)}
    done = fleet.generate(jobs, timeout=20)
    assert sorted(done) == sorted(jobs)
    for job_id, res in done.items():
        assert [g.request_id for g in res.generations] == [q.request_id for q in jobs[job_id]]
        assert res.attempts == 1
    m = fleet.metrics()
    assert m["pool/slow/jobs"] > 0 and m["pool/fast/jobs"] > m["pool/slow/jobs"]
    assert m["pool/fast/jobs"] + m["pool/slow/jobs"] == 40 and m["fleet/requests"] == 80 and m["fleet/tokens"] == 240


# ---------------------------------------------------------------------- failures
def test_replica_killed_mid_generation_requeues_and_no_group_is_lost_or_trained_twice():
    kill = threading.Event()
    doomed = pool("doomed", "h100", "fp8_e4m3")
    fleet, (bad, good) = fleet_of((doomed, dict(kill=kill)), (pool("ok", "mi300x", "fp8_e4m3fnuz"), dict(delay=0.001)),
                                  max_batch=4)
    jobs = {f"g{i}": requests(f"g{i}", 2) for i in range(12)}
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(fleet.generate(jobs, timeout=20)))
    runner.start()
    assert bad.started.wait(5)
    kill.set()  # the doomed replica dies holding in-flight (and possibly assigned) jobs
    runner.join()
    assert sorted(result) == sorted(jobs)
    assert {res.pool for res in result.values()} == {"ok"}
    m = fleet.metrics()
    assert m["pool/doomed/errors"] == 1 and m["pool/doomed/requeues"] >= 1 and m["pool/doomed/replicas_alive"] == 0
    assert max(res.attempts for res in result.values()) == 2

    buf = RolloutBuffer(max_staleness=1)
    for job_id, res in result.items():
        assert buf.put(RolloutGroup(job_id, job_id, tuple(to_rollout(job_id, g) for g in res.generations)))
    taken = [g.group_id for g in buf.take(12, trainer_version=0)]
    assert sorted(taken) == sorted(jobs) and buf.take(1, 0) == []


def test_a_revived_replica_loads_the_published_weights_and_serves_again():
    doomed = pool("doomed", "h100", "fp8_e4m3")
    fleet, (sick,) = fleet_of((doomed, {}))
    fleet.publish_weights(3, {})
    sick.healthy = False
    assert fleet.serve_once("doomed/0", timeout=0) == []  # nothing to do: not even checked
    fleet.submit("g0", requests("g0"))
    assert fleet.serve_once("doomed/0", timeout=1) == []  # unhealthy: dead, its job back in the queue
    assert not fleet.replicas[0].alive and fleet.replicas[0].died_at is not None
    fresh = FakeSampler(doomed)
    assert fleet.revive("doomed/0", fresh) and not fleet.revive("doomed/0", fresh)  # alive already: no-op
    (done,) = fleet.serve_once("doomed/0", timeout=1)
    # one attempt: the sick replica failed its health check before starting the job
    assert done.job_id == "g0" and done.attempts == 1 and fresh.loads == [3]  # the latest weights before serving
    m = fleet.metrics()
    assert (m["pool/doomed/restarts"], m["pool/doomed/errors"], m["fleet/replicas_alive"]) == (1, 1, 1)
    fleet.quarantine("doomed", "too many rejections")
    assert not fleet.revive("doomed/0", FakeSampler(doomed))  # a quarantined pool stays out


def test_pinned_jobs_run_on_their_replica_until_it_dies():
    fleet, (a, b) = fleet_of((pool("p", "h100", replicas=2), {}), (pool("p2", "h100"), {}))
    for i in range(4):
        fleet.submit(f"g{i}", requests(f"g{i}"), replica="p/0")  # all on one replica, whatever the load
    assert [len(r.assigned) for r in fleet.replicas] == [4, 0]
    with pytest.raises(ValueError, match="no replica 'nope/0'"):
        fleet.submit("bad", requests("bad"), replica="nope/0")
    a.healthy = False
    assert fleet.serve_once("p/0", timeout=1) == []  # dies: its pinned jobs are routed like any other
    assert [len(r.assigned) for r in fleet.replicas] == [0, 4]
    assert {res.job_id for res in fleet.serve_once("p2/0", timeout=1)} == {"g0", "g1", "g2", "g3"}


def to_rollout(group_id: str, g: Generation) -> Rollout:
    T = g.token_ids.shape[0]
    return Rollout(rollout_id=g.request_id, group_id=group_id, prompt_ids=np.array([1, 2], np.int32),
                   response_ids=g.token_ids, loss_mask=np.ones(T, bool), sampler_logprobs=g.logprobs,
                   policy_version=g.policy_version, reward=0.0, finish_reason=g.finish_reason,
                   sampling=SamplingParams(), sampler=g.sampler)


def test_unhealthy_or_misbehaving_replicas_are_routed_around():
    fleet, (sick, liar, good) = fleet_of((pool("sick", "a100", "int8"), {}), (pool("liar", "h200"), {}),
                                         (pool("good", "h100"), {}), max_batch=2)
    sick.healthy = False
    liar.bad_output = True
    done = fleet.generate({f"g{i}": requests(f"g{i}") for i in range(6)}, timeout=10)
    assert {r.pool for r in done.values()} == {"good"}
    m = fleet.metrics()
    assert (m["pool/sick/errors"], m["pool/liar/errors"], m["fleet/replicas_alive"]) == (1, 1, 1)
    assert sick.calls == 0 and liar.calls == 1


def test_quarantined_pool_gets_no_work_and_its_queued_and_in_flight_jobs_are_rerouted(caplog):
    hold = threading.Event()
    fleet, (bad, good) = fleet_of((pool("bad", "h100", "fp8_e4m3"), dict(hold=hold)),
                                  (pool("ok", "h100", "fp8_e4m3"), {}), max_batch=2)
    bad_replica, ok_replica = fleet.replicas
    jobs = {f"g{i}": requests(f"g{i}", 2) for i in range(4)}
    for job_id, reqs in jobs.items():
        fleet.submit(job_id, reqs)
    assert bad_replica.load > 0 and ok_replica.load > 0
    served: list = []
    worker = threading.Thread(target=lambda: served.extend(fleet.serve_once(bad_replica, timeout=5)))
    worker.start()
    assert bad.started.wait(5)  # the bad pool now holds a job in flight (and possibly queued ones)
    with caplog.at_level("ERROR", logger="hetrl.samplers.fleet"):
        fleet.quarantine("bad", "pool 'bad' quarantined: poisoned")
        fleet.quarantine("bad", "again")  # idempotent
    assert "pool 'bad' quarantined: poisoned" in caplog.text and "re-routed" in caplog.text
    hold.set()
    worker.join()
    assert served == []  # what it generated after being quarantined is discarded
    done: dict = {}
    deadline = time.monotonic() + 10
    while len(done) < len(jobs) and time.monotonic() < deadline:
        for res in fleet.serve_once(ok_replica, timeout=0.1):
            assert res.job_id not in done
            done[res.job_id] = res
    assert sorted(done) == sorted(jobs) and {r.pool for r in done.values()} == {"ok"}
    fleet.submit("later", requests("later"))
    assert bad_replica.load == 0 and ok_replica.load == 1 and bad.calls == 1
    assert fleet.serve_once(bad_replica, timeout=0.1) == []
    m = fleet.metrics()
    assert m["pool/bad/quarantined"] == 1 and m["pool/ok/quarantined"] == 0 and m["fleet/quarantined"] == 1
    assert m["pool/bad/requeues"] >= 1 and m["pool/bad/errors"] == 0 and m["pool/bad/replicas_alive"] == 0
    assert fleet.quarantined == {"bad": "pool 'bad' quarantined: poisoned"}


def test_published_version_is_the_latest_publication():
    fleet, _ = fleet_of((FAST, {}))
    assert fleet.published_version == 0
    fleet.publish_weights(3, {})
    assert fleet.published_version == 3


def test_all_replicas_dead_raises():
    fleet, (s,) = fleet_of((SLOW, {}))
    s.healthy = False
    with pytest.raises(FleetError, match="1 of 1 jobs unfinished"):
        fleet.generate({"g": requests("g")}, timeout=5)


# ---------------------------------------------------------------------- weights
def test_weights_load_between_calls_and_versions_are_monotone_per_pool():
    fleet, samplers = fleet_of((FAST, dict(delay=0.001)), (SLOW, dict(delay=0.005)), max_batch=2)
    stop = threading.Event()

    def publisher():
        for v in range(1, 6):
            time.sleep(0.02)
            fleet.publish_weights(v, {"w": np.zeros(1)})
        stop.set()

    pub = threading.Thread(target=publisher)
    pub.start()
    n = 0
    while not stop.is_set():
        fleet.generate({f"g{n}-{i}": requests(f"g{n}-{i}") for i in range(4)}, timeout=10)
        n += 1
    pub.join()
    fleet.generate({f"last-{i}": requests(f"last-{i}") for i in range(4)}, timeout=10)  # both pools get one
    for s in samplers:  # one replica per pool: its call order is the pool's
        assert s.loads == sorted(set(s.loads)) and s.loads[-1] == 5  # loaded at most once each, in order
        assert s.call_versions == sorted(s.call_versions) and s.call_versions[-1] == 5
    with pytest.raises(ValueError, match="not newer"):
        fleet.publish_weights(3, {})


def test_weights_are_loaded_before_the_next_call():
    fleet, (s,) = fleet_of((FAST, {}))
    fleet.submit("a", requests("a"))
    assert fleet.serve_once("fast/0", timeout=1)[0].generations[0].policy_version[0] == 0
    fleet.publish_weights(7, {"w": np.zeros(1)})
    fleet.submit("b", requests("b"))
    assert fleet.serve_once("fast/0", timeout=1)[0].generations[0].policy_version[0] == 7
    assert fleet.serve_once("fast/0", timeout=0.01) == []  # nothing routed: times out


# ---------------------------------------------------------------------- metrics and cost
def test_cost_accounting_per_pool_and_per_trained_token():
    p = pool("h", "h100", accelerators_per_replica=8, price_per_hour_usd=3.6)
    fleet, _ = fleet_of((p, dict(delay=0.05)))
    fleet.generate({"g": requests("g", 2)}, timeout=5)
    m = fleet.metrics()
    busy = m["pool/h/busy_s"]
    assert 0.05 <= busy < 1.0
    assert m["pool/h/cost/usd"] == pytest.approx(3.6 * 8 * busy / 3600)
    assert np.isnan(m["pool/h/cost/usd_per_trained_token"])
    fleet.record_trained("h", 6)
    m = fleet.metrics()
    assert m["pool/h/cost/usd_per_trained_token"] == pytest.approx(m["pool/h/cost/usd"] / 6)
    assert m["fleet/cost/usd_per_trained_token"] == pytest.approx(m["fleet/cost/usd"] / 6)


def test_mismatch_metrics_aggregate_per_pool_token_weighted():
    fleet, _ = fleet_of((FAST, {}), (SLOW, {}))
    rng = np.random.default_rng(0)
    B, L = 4, 5
    mask = np.ones((B, L), bool)
    steps = []
    for scale in (0.1, 0.5):
        d = rng.normal(size=(B, L)) * scale
        stats = TokenStats(logp=-np.ones((B, L)), log_ratio=d, weight=np.exp(d), token_keep=mask,
                           sequence_keep=np.ones(B, bool), veto_keep=np.ones(B, bool), support_size=np.ones((B, L)),
                           sampler_head_mass=np.ones((B, L)), train_head_mass=np.ones((B, L)))
        pool_index = np.array([0, 0, 0, 1]) if scale == 0.1 else np.array([0, 1, 1, 1])
        m = mismatch_metrics(stats, mask, pool_index, ("fast", "slow"))
        fleet.record_mismatch(pool_mismatch(m, ("fast", "slow")))
        steps.append(m)
    out = fleet.metrics()
    for name in ("fast", "slow"):
        n = [float(s[f"pool/{name}/mismatch/num_tokens"]) for s in steps]
        k1 = [float(s[f"pool/{name}/mismatch/k1"]) for s in steps]
        assert out[f"pool/{name}/mismatch_avg/k1"] == pytest.approx(np.dot(n, k1) / sum(n))
        assert out[f"pool/{name}/mismatch_avg/abs_logp_diff_max"] == pytest.approx(
            max(float(s[f"pool/{name}/mismatch/abs_logp_diff_max"]) for s in steps))
        figures = fleet.pool_figures()[name]  # the typed view holds the same averages
        prefix = f"pool/{name}/mismatch_avg/"
        assert figures.mismatch_avg == {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}
    fleet.record_mismatch({"unknown": {"k1": 1.0, "num_tokens": 4.0}})  # ignored
    assert "pool/unknown/mismatch_avg/k1" not in fleet.metrics() and "unknown" not in fleet.pool_figures()


def test_modelled_cost_clock_charges_accelerator_time_not_cpu_time():
    cfg = FleetConfig(pools=[FAST, SLOW], cost_clock="modelled", reference_tokens_per_s=100.0, max_batch=1)
    fleet = Fleet.from_config(cfg, lambda p, n, i: FakeSampler(p, delay=0.001))
    fleet.submit("f", requests("f"))
    fleet.submit("s", requests("s"))  # the fast replica's one slot is taken: goes to the slow one
    fleet.serve_once("fast/0", timeout=1)
    fleet.serve_once("slow/0", timeout=1)
    m = fleet.metrics()
    assert m["pool/fast/tokens"] == m["pool/slow/tokens"] == 3
    assert m["pool/fast/busy_s"] == pytest.approx(3 / (100.0 * 2.4 * 2.2))
    assert m["pool/slow/busy_s"] == pytest.approx(3 / (100.0 * 0.26))
    assert m["pool/slow/cost/usd"] == pytest.approx(1.60 * 3 / (100.0 * 0.26) / 3600)
