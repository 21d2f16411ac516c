"""SGLang pools against a real SGLang server (hetrl.samplers.sglang).

The server runs on this CPU from its own virtual environment (tests/sglang_server/bootstrap.py,
built on first use), in float32, serving a copy of the shipped warm-started tiny Qwen3. If it
cannot start, the tests fail with the server's log tail; nothing is skipped.

What is checked: the log-probs a pool returns equal the trainer's recomputation with mask replay
over the rebuilt supports (float32; 1e-4: SGLang's torch-native attention and hetrl's JAX model
sum in different orders), and those supports are the kept sets the trainer's own logits give;
a weight update changes the outputs and the reported version and rolling back restores them
exactly; a dead endpoint is routed around; a killed server's jobs are re-queued to the other
pools and training continues; `hetrl train` runs a mixed embedded + SGLang fleet end to end."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from hetrl.core.correction import replay_logprobs
from hetrl.core.schema import Rollout, SamplingParams, collate
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import load_state_dict
from hetrl.models.qwen_jax import from_hf_state_dict
from hetrl.orchestrator.transport import SharedDiskTransport
from hetrl.samplers.base import GenerationRequest, Sampler
from hetrl.samplers.fleet import Fleet, PoolConfig
from hetrl.samplers.head_support import support_from_head
from hetrl.samplers.profiles import sampler_numerics
from hetrl.samplers.sglang import KEEP_EXPORTS, ServerError, ServerSampler
from hetrl.samplers.weight_set import WeightSet

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from sglang_server.server import SGLangServer  # noqa: E402
from tiny_run import NO_EVAL, QUIET  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
WARMSTART = next((ROOT / "assets" / "models").glob("warmstart-*"))
SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, top_k=32)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    target = tmp_path_factory.mktemp("sglang-model") / "model"
    shutil.copytree(WARMSTART, target)
    return target


API_KEY, API_KEY_ENV = "hetrl-test-key", "HETRL_TEST_SGLANG_KEY"
"""The module server requires this key (one server start serves the API-key test too); the pools
here send it, from the environment variable (a server started without a key ignores it)."""


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, API_KEY)
        srv = SGLangServer(model_dir, log_path=tmp_path_factory.mktemp("sglang-log") / "server.log",
                           api_key=API_KEY).start()
        yield srv
        srv.close()


def _pool(*endpoints: str, api_key_env: str | None = API_KEY_ENV, **server) -> PoolConfig:
    return PoolConfig(name="sgl", engine="sglang", accelerator="h100", weight_precision="bf16", kv_precision="bf16",
                      replicas=len(endpoints), endpoints=endpoints, api_key_env=api_key_env,
                      server={"top_logprobs_num": 32, **server})


def _sampler(model_dir, tmp_path, *endpoints, api_key_env: str | None = API_KEY_ENV, **server) -> ServerSampler:
    pool = _pool(*endpoints, api_key_env=api_key_env, **server)
    return ServerSampler(pool, pool.numerics(), model_dir=model_dir, weights_dir=tmp_path / "weights")


def _prompts(config: ModelConfig, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, config.vocab_size, size=int(rng.integers(4, 20))).astype(np.int32) for _ in range(n)]


def _requests(prompts, sampling=SAMPLING, max_new=24, prefix="r"):
    return [GenerationRequest(f"{prefix}{i}", p, sampling, max_new) for i, p in enumerate(prompts)]


def _trainer_logits(model_dir, batch) -> np.ndarray:
    config = ModelConfig.load(model_dir)
    model = from_hf_state_dict(config, load_state_dict(model_dir))
    return np.asarray(jax.jit(lambda ids: model(ids)[0])(batch.input_ids))


@pytest.mark.parametrize("sampling_mask", ["native", "head"])
def test_logprobs_and_supports_equal_the_trainers_replay(server, model_dir, tmp_path, sampling_mask):
    sampler = _sampler(model_dir, tmp_path, server.url, sampling_mask=sampling_mask)
    assert isinstance(sampler, Sampler) and sampler.info.engine.startswith("sglang")
    config = ModelConfig.load(model_dir)
    samplings = [SAMPLING, SAMPLING, SamplingParams(temperature=0.7, top_k=8), SamplingParams(top_k=32, top_p=0.8)]
    prompts = _prompts(config, len(samplings))
    gens = sampler.generate([GenerationRequest(f"r{i}", p, s, 24) for i, (p, s) in enumerate(zip(prompts, samplings))])
    rollouts = [Rollout(rollout_id=g.request_id, group_id="g", prompt_ids=p, response_ids=g.token_ids,
                        loss_mask=np.ones(len(g.token_ids), bool), sampler_logprobs=g.logprobs,
                        policy_version=g.policy_version, reward=0.0, finish_reason=g.finish_reason, sampling=s,
                        sampler=g.sampler, support=g.support).validate(vocab_size=config.vocab_size,
                                                                       max_length=config.max_position_embeddings)
                for g, p, s in zip(gens, prompts, samplings)]
    batch = collate(rollouts)
    logits = _trainer_logits(model_dir, batch)
    lp_a, lp_s = replay_logprobs(logits, batch.target_ids, batch.support_ids, batch.support_mask, batch.temperature)
    m, sm = batch.loss_mask, batch.support_mask
    np.testing.assert_allclose(batch.sampler_logprobs[m], np.asarray(lp_a)[m], atol=1e-4, rtol=0)
    np.testing.assert_allclose(batch.support_logprobs[sm], np.asarray(lp_s)[sm], atol=1e-4, rtol=0)
    # the rebuilt supports are the kept sets of the trainer's own distribution
    checked = 0
    for b, (g, s) in enumerate(zip(gens, samplings)):
        assert g.support.kind == "kept" and np.all(g.policy_version == 0)
        start = len(prompts[b]) - 1
        for t in range(len(g.token_ids)):
            z = logits[b, start + t].astype(np.float64) / s.temperature
            logp = z - np.logaddexp.reduce(z)
            order = np.lexsort((np.arange(logp.size), -logp))
            before = np.concatenate([[0.0], np.cumsum(np.exp(logp[order]))[:-1]])
            n = min(s.top_k, int((before <= s.top_p).sum()))
            want = order[:n].tolist()
            got = g.support.ids[g.support.offsets[t]: g.support.offsets[t + 1]].tolist()
            assert got == want, (b, t)
            checked += 1
    assert checked >= 4 * 10


def test_rebuilt_supports_equal_the_servers_own_sampling_masks(server, model_dir):
    """One answer carrying both the log-prob head and SGLang's native sampling mask: the kept
    sets rebuilt from the head are the sets the server sampled from, with the same log q.

    Up to float32 rounding: SGLang's torch sampler applies top-p even at ``top_p = 1``, on a
    float32 cumulative sum over the whole sorted vocabulary, so once that sum rounds past 1 the
    remaining tokens are cut. Those tokens carry less mass than the rounding (< 1e-6 here); the
    head cannot see where the server's sum rounded, and keeping or cutting them moves log q by
    less than that mass. So the sets must agree exactly on every token of non-negligible mass,
    the tokens in one set only must have negligible mass together, and most rows must agree
    exactly."""
    config = ModelConfig.load(model_dir)
    compared = exact = 0
    for i, (params, prompt) in enumerate(zip([SAMPLING, SamplingParams(top_k=8, top_p=0.8),
                                             SamplingParams(temperature=0.6, top_k=16)], _prompts(config, 3, seed=5))):
        status, answer = server.post("/generate", {
            "input_ids": prompt.tolist(), "return_logprob": True, "top_logprobs_num": 32,
            "return_sampling_mask": True, "sampling_logprobs_mode": "support",
            "sampling_params": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                                "max_new_tokens": 24, "ignore_eos": True}})
        assert status == 200, answer
        meta = answer["meta_info"]
        ids = np.asarray(answer["output_ids"])
        support, logq = support_from_head([[e[1] for e in row] for row in meta["output_top_logprobs"]],
                                          [[e[0] for e in row] for row in meta["output_top_logprobs"]], ids,
                                          np.asarray([e[0] for e in meta["output_token_logprobs"]]), params)
        for t, mask in enumerate(meta["output_token_sampling_mask"]):
            rebuilt = support.ids[support.offsets[t]: support.offsets[t + 1]].tolist()
            rebuilt_logq = dict(zip(rebuilt, support.logprobs[support.offsets[t]: support.offsets[t + 1]].tolist()))
            native = dict(zip(mask, meta["output_token_sampling_logprobs"][t]))
            only_rebuilt = sum(math.exp(rebuilt_logq[u]) for u in set(rebuilt) - set(mask))
            only_native = sum(math.exp(native[u]) for u in set(mask) - set(rebuilt))
            assert only_rebuilt < 1e-6 and only_native < 1e-6, (i, t, only_rebuilt, only_native)
            shared = [u for u in rebuilt if u in native]
            assert shared == [u for u in mask if u in rebuilt_logq], (i, t)  # same order: by probability
            np.testing.assert_allclose([rebuilt_logq[u] for u in shared], [native[u] for u in shared], atol=2e-6)
            np.testing.assert_allclose(logq[t], native[int(ids[t])], atol=2e-6)
            exact += rebuilt == mask
            compared += 1
    assert compared == 3 * 24
    assert exact >= 0.9 * compared, exact


def test_weight_update_changes_outputs_and_version_and_rollback_restores_them(server, model_dir, tmp_path):
    sampler = _sampler(model_dir, tmp_path, server.url)
    config = ModelConfig.load(model_dir)
    greedy = SamplingParams(top_k=1)
    reqs = _requests(_prompts(config, 4, seed=1), greedy, max_new=16)
    base = sampler.generate(reqs)
    assert all(np.all(g.policy_version == 0) for g in base)
    weights = load_state_dict(model_dir)
    changed = dict(weights)
    changed["lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"] = (
        weights.get("lm_head.weight", weights["model.embed_tokens.weight"])[::-1].copy())
    sampler.update_weights(1, changed)
    after = sampler.generate(reqs)
    assert all(np.all(g.policy_version == 1) for g in after)
    assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(after, base))
    # roll back to the original weights (as a new version) published through the shared-disk
    # transport: the replica loads the transport's export and writes nothing itself
    published = WeightSet(2, weights)
    SharedDiskTransport(config, tmp_path / "weights", model_dir).stage(published)
    sampler.update_weights(2, published)
    assert list(published.builds.values()) == [1]
    again = sampler.generate(reqs)
    assert all(np.all(g.policy_version == 2) for g in again)
    for a, b in zip(again, base):
        assert np.array_equal(a.token_ids, b.token_ids)
        assert np.array_equal(a.logprobs, b.logprobs)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000001", "v00000002"]


def test_tampered_weights_are_refused_before_the_server_loads_them(server, model_dir, tmp_path):
    sampler = _sampler(model_dir, tmp_path, server.url)
    weights = load_state_dict(model_dir)
    bad = dict(weights)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        sampler.update_weights(1, bad)
    assert sampler.health().weight_version == 0 and not (tmp_path / "weights" / "v00000001").exists()


def test_restart_fallback_serves_each_new_version_by_restarting_the_server(model_dir, tmp_path):
    """``weight_sync: restart`` (sglang-jax's only option, here on an SGLang server): the restart
    command brings the server up on the exported directory and the new weights are served."""
    state = tmp_path / "state"
    restart = (sys.executable, str(pathlib.Path(__file__).parent / "sglang_server" / "restart.py"), str(state))
    subprocess.run([*restart, str(model_dir)], check=True, timeout=600)
    url = json.loads((state / "server.json").read_text())["url"]
    try:
        sampler = _sampler(model_dir, tmp_path, url, weight_sync="restart", restart_command=(*restart, "{model_path}"))
        reqs = _requests(_prompts(ModelConfig.load(model_dir), 3, seed=4), SamplingParams(top_k=1), max_new=12)
        base = sampler.generate(reqs)
        weights = load_state_dict(model_dir)
        sampler.update_weights(1, {**weights, "model.norm.weight": -weights["model.norm.weight"]})
        after = sampler.generate(reqs)
        assert all(np.all(g.policy_version == 1) for g in after) and all(np.all(g.policy_version == 0) for g in base)
        assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(after, base))
        info = json.loads((state / "server.json").read_text())
        assert info["url"] == url and sampler.health().healthy
    finally:
        pid = json.loads((state / "server.json").read_text())["pid"]
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_dead_endpoint_is_retried_elsewhere_and_reported(server, model_dir, tmp_path):
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    sampler = _sampler(model_dir, tmp_path, server.url, dead, retries=2, backoff_s=0.01)
    gens = sampler.generate(_requests(_prompts(ModelConfig.load(model_dir), 6, seed=2), max_new=4))
    assert len(gens) == 6
    health = sampler.health()
    assert health.healthy and "1/2 endpoints healthy" in health.detail
    with pytest.raises(ServerError, match="127.0.0.1:9"):
        _sampler(model_dir, tmp_path, dead, retries=1, backoff_s=0.01)


def test_top_p_alone_is_exact_with_native_masks_and_refused_from_the_head(server, model_dir, tmp_path):
    config = ModelConfig.load(model_dir)
    top_p = _requests(_prompts(config, 2), SamplingParams(top_p=0.9), max_new=8)
    gens = _sampler(model_dir, tmp_path, server.url).generate(top_p)
    for g in gens:
        assert g.support.kind == "kept" and np.all(np.diff(g.support.offsets) >= 1)
        sizes = np.exp(g.support.logprobs.astype(np.float64))
        sums = np.add.reduceat(sizes, g.support.offsets[:-1])
        np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="top_p=0.9 without a top-k cap"):
        _sampler(model_dir, tmp_path, server.url, sampling_mask="head").generate(top_p)
    with pytest.raises(ValueError, match="a native sampling mask needs top_k <= 100"):
        _sampler(model_dir, tmp_path, server.url, sampling_mask_max_tokens=100).generate(top_p)


def test_bad_requests_are_refused_with_clear_errors(server, model_dir, tmp_path):
    sampler = _sampler(model_dir, tmp_path, server.url)
    config = ModelConfig.load(model_dir)
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, 512\)"):
        sampler.generate([GenerationRequest("x", np.asarray([1, config.vocab_size], np.int32), SAMPLING, 4)])


def test_api_key_is_sent_and_required(server, model_dir, tmp_path):
    """The module server was started with ``--api-key``: a pool naming the key's variable is
    served, one without it is refused (HTTP 401)."""
    assert server.api_key == API_KEY
    sampler = _sampler(model_dir, tmp_path, server.url)
    assert len(sampler.generate(_requests(_prompts(ModelConfig.load(model_dir), 2), max_new=4))) == 2
    with pytest.raises(ServerError, match="HTTP 401"):
        _sampler(model_dir, tmp_path, server.url, api_key_env=None)


def test_killed_server_is_detected_and_its_jobs_requeued(server, model_dir, tmp_path):
    """Two replicas on two servers (a fresh one and the module's, the survivor); the fresh one is
    killed while it generates: every job is still delivered exactly once (the dead replica's go to
    the survivor), and the pool shrinks."""
    a = SGLangServer(model_dir, log_path=tmp_path / "a.log").start()
    try:
        pool = _pool(a.url, server.url, retries=1, backoff_s=0.01)
        samplers = [ServerSampler(pool, pool.numerics(), model_dir=model_dir, weights_dir=tmp_path / "w", endpoints=[u])
                    for u in (a.url, server.url)]
        fleet = Fleet([(pool, s) for s in samplers], max_batch=4)
        config = ModelConfig.load(model_dir)
        killer = threading.Thread(target=lambda: (_wait_until(lambda: samplers[0].in_flight > 0), a.kill()))
        killer.start()
        jobs = {f"j{i}": _requests(_prompts(config, 2, seed=10 + i), max_new=48, prefix=f"j{i}-") for i in range(8)}
        done = fleet.generate(jobs, timeout=600)
        killer.join()
        assert sorted(done) == sorted(jobs)
        assert all([g.request_id for g in done[j].generations] == [r.request_id for r in jobs[j]] for j in jobs)
        metrics = fleet.metrics()
        assert metrics["pool/sgl/replicas_alive"] == 1 and metrics["pool/sgl/requeues"] >= 1
        assert metrics["pool/sgl/errors"] == 1 and metrics["pool/sgl/requests"] == 16
    finally:
        a.stop()


def _wait_until(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)


MIXED_STEPS = 6


def test_hetrl_train_runs_a_mixed_fleet_and_survives_the_server_dying(model_dir, tmp_path):
    """`hetrl train` on configs/tiny_mixed_sglang.yaml (three embedded pools and an SGLang pool):
    the SGLang pool's rollouts are trained on and its server loads every new version; then the
    server is killed after step 2 and training continues on the embedded pools to step 6 (batches of 4
    groups of 2: the steps after the kill draw on more than what was already generated, so the
    server's death is met and recorded)."""
    srv = SGLangServer(model_dir, log_path=tmp_path / "server.log").start()
    out = tmp_path / "run"
    # no quarantine: the run is about the server's death; on a loaded machine an embedded pool that takes over the
    # dead pool's jobs can fall behind by more than max_staleness and be quarantined for it (a CI run lost the
    # NVFP4 pool that way at step 4), which is the admission gate's behaviour, tested on its own
    sets = [f"output_dir={out}", f"steps={MIXED_STEPS}", QUIET, NO_EVAL, "async.batch_groups=4", "async.group_size=2",
            "async.max_new_tokens=24",
            f'fleet.pools[3].endpoints=["{srv.url}"]', "fleet.pools[3].server.retries=1",
            "fleet.pools[3].server.backoff_s=0.05", "fleet.quarantine.max_rejection_rate=1.0"]
    cmd = [sys.executable, "-m", "hetrl.cli", "train", str(ROOT / "configs" / "tiny_mixed_sglang.yaml")]
    for s in sets:
        cmd += ["--set", s]
    metrics = out / "metrics.jsonl"

    def steps_done() -> int:
        # the run is writing the file: a last line without its newline is still being written
        complete = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
        rows = [json.loads(line) for line in complete]
        return max((r["step"] for r in rows if "loss" in r), default=0)

    try:
        with open(tmp_path / "train.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                _wait_until(lambda: steps_done() >= 2 or proc.poll() is not None, timeout=900)
                srv.kill()
                rc = proc.wait(timeout=900)
            finally:
                proc.kill()
    finally:
        srv.stop()
    assert rc == 0, (tmp_path / "train.log").read_text()[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert steps[-1]["step"] == MIXED_STEPS
    assert sum(r.get("batch/pool/h100-sglang/groups", 0) for r in steps) > 0  # its rollouts were trained on
    last = steps[-1]
    assert last["pool/h100-sglang/replicas_alive"] == 0 and last["pool/h100-sglang/errors"] == 1
    assert last["pool/b200-nvfp4/replicas_alive"] == 1
    # new versions were exported for the server; only the newest KEEP_EXPORTS are kept, so which ones
    # remain depends on how many steps ran before the pool was declared dead
    exported = sorted(int(p.name[1:]) for p in (out / "weights").glob("v[0-9]*"))
    assert exported and exported[-1] >= 1 and len(exported) <= KEEP_EXPORTS, exported
