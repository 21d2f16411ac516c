"""The local asynchronous loop end to end (hetrl.orchestrator.local).

One short run (3 steps, tiny sizes) is shared by the end-to-end checks: two pools, where the
fast pool has a second replica that dies on its first call (its jobs must be re-queued and
finished elsewhere, never lost or trained twice) and the slow pool sleeps before every call (its
groups are the stalest; none may be trained beyond max_staleness). A unit check drives the
episode runner with malformed generations: they are rejected and counted, not raised.
"""

import json
import threading
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from hetrl.config import load_config
from hetrl.core.schema import SamplerInfo, SamplingParams
from hetrl.envs.base import ChatFormat
from hetrl.envs.coding import CodingEnv
from hetrl.envs.tasks_synthetic import synthetic_suite
from hetrl.models.tiny import TINY_QWEN3, build_tiny_checkpoint
from hetrl.orchestrator.episodes import EpisodeRunner
from hetrl.orchestrator.local import LocalOrchestrator
from hetrl.samplers.base import Generation

MAX_STALENESS = 1


class Slow:
    """A sampler that sleeps ``delay`` seconds before every generate call."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    @property
    def info(self):
        return self.inner.info

    def generate(self, requests):
        time.sleep(self.delay)
        return self.inner.generate(requests)

    def update_weights(self, version, weights):
        self.inner.update_weights(version, weights)

    def health(self):
        return self.inner.health()


class Dies(Slow):
    """A sampler whose first generate call raises (a killed replica); records what it held."""

    def __init__(self, inner):
        super().__init__(inner, 0.0)
        self.failed: list[str] = []
        self.lock = threading.Lock()

    def generate(self, requests):
        with self.lock:
            self.failed += [r.request_id for r in requests]
        raise ConnectionError("replica killed")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config("tiny_mixed.yaml", [
        f"output_dir={out}", "logging.jsonl_path=null", "checkpointing.directory=null", "checkpointing.every=2",
        "steps=3", "async.batch_groups=2", "async.group_size=2", "async.max_new_tokens=16",
        f"async.max_staleness={MAX_STALENESS}",
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3, replicas: 2},"
        " {name: slow, accelerator: a100, weight_precision: bf16}]",
        "environment.options={eval: {every: 2, tasks: 2}, coding: {max_turns: 2}}",
    ])
    killed: list[Dies] = []

    def wrap(pool, index, sampler):
        if pool.name == "slow":
            return Slow(sampler, 1.5)
        if index == 1:
            killed.append(Dies(sampler))
            return killed[-1]
        return sampler

    start = time.monotonic()
    result = LocalOrchestrator(cfg, wrap_sampler=wrap, console=False).run()
    return result, killed, time.monotonic() - start


def test_run_completes_and_writes_outputs(run):
    result, _, wall = run
    assert result.final["version"] == 3 and len(result.history) == 3
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all("mismatch/k3" in r and "reward/mean" in r and "staleness/max" in r for r in lines)
    assert "eval/success" in lines[1] and "eval/success" in lines[2]
    assert result.checkpoint_steps and result.checkpoint_steps[-1] == 3
    for step in result.checkpoint_steps:
        snap = json.loads((result.checkpoint_dir / f"buffer-{step}.json").read_text())
        assert snap["version"] == 1
    assert {p.name for p in result.plots} == {"reward.png", "heldout.png", "mismatch.png"}
    assert all(p.stat().st_size > 1000 for p in result.plots)
    assert (result.output_dir / "summary.json").exists()
    assert wall < 120


def test_rewards_come_from_the_environment(run):
    result, _, _ = run
    assert result.rewards and all(np.isfinite(result.rewards))
    # the environment's rewards lie in [0, 1]; a random tiny model scores (almost) nothing
    assert all(0.0 <= r <= 1.0 for r in result.rewards)
    assert result.history[0]["rollout/rollouts_valid"] > 0


def test_weight_versions_are_monotone_per_replica(run):
    result, _, _ = run
    assert result.rollout_versions
    for key, versions in result.rollout_versions.items():
        assert versions == sorted(versions), key
    assert max(max(v) for v in result.rollout_versions.values()) >= 1  # new weights reached the fleet


def test_no_trained_group_is_older_than_max_staleness(run):
    result, _, _ = run
    assert result.trained
    assert all(trainer_v - min_v <= MAX_STALENESS for _, _, min_v, trainer_v in result.trained)
    assert result.final["max_staleness"] <= MAX_STALENESS


def test_killed_replica_jobs_are_requeued_exactly_once(run):
    result, killed, _ = run
    (dead,) = killed
    assert dead.failed, "the killed replica never received work"
    assert result.final["requeues"] >= 1
    lost = {rid.split("/")[0] for rid in dead.failed}
    assert lost <= set(result.received)  # finished on another replica
    ids = [g for g, *_ in result.trained]
    assert len(ids) == len(set(ids))  # never trained twice
    assert len(result.received) == len(set(result.received))
    assert set(ids) <= set(result.received) <= set(result.submitted)
    assert "fast/1" not in result.rollout_versions


def test_malformed_generations_are_rejected_not_raised(tmp_path):
    build_tiny_checkpoint(tmp_path, TINY_QWEN3, seed=0)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    chat = ChatFormat.from_tokenizer(tok)
    runner = EpisodeRunner(chat, lambda ids: tok.decode(ids), lambda: CodingEnv(), max_new_tokens=4,
                           max_length=TINY_QWEN3.max_position_embeddings, vocab_size=TINY_QWEN3.vocab_size,
                           stop_token_ids=(chat.im_end_id,))
    task = synthetic_suite(0).train[0]
    prompt = runner.prompt_ids(task)
    info = SamplerInfo(pool="p", accelerator="h100", weight_precision="bf16", kv_precision="bf16", engine="embedded")
    ids = np.asarray([5, 6, 7, chat.im_end_id], np.int32)

    def gen(rid, logprobs):
        return Generation(rid, ids, np.asarray(logprobs, np.float32), np.zeros(4, np.int64), "stop", None, info)

    good = gen("g/0", [-1.0] * 4)
    bad = gen("g/1", [-1.0, np.nan, -1.0, -1.0])
    positive = gen("g/2", [-1.0, 3.0, -1.0, -1.0])
    out = runner.run_group("g", task, prompt, [good, bad, positive], SamplingParams(),
                           lambda reqs: [gen(r.request_id, [-1.0] * 4) for r in reqs])
    assert len(out.rollouts) == 1 and len(out.errors) == 2
    r = out.rollouts[0]
    assert r.reward == r.reward and not r.loss_mask.all() and r.loss_mask[:4].all()  # env tokens are masked
