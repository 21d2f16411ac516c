"""The local asynchronous loop end to end (hetrl.orchestrator.local).

One short run (3 steps, tiny sizes) is shared by the end-to-end checks: two pools, where the
fast pool has a second replica that dies on its first call (its jobs must be re-queued and
finished elsewhere, never lost or trained twice) and the slow pool sleeps before every call (its
groups are the stalest; none may be trained beyond max_staleness). A unit check drives the
episode runner with malformed generations: they are rejected and counted, not raised.
"""

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
from orchestrator_checks import (Dies, Slow, check_monotone_versions, check_outputs, check_requeued_exactly_once,
                                 check_staleness)

MAX_STALENESS = 1


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

    return LocalOrchestrator(cfg, wrap_sampler=wrap, console=False).run(), killed


def test_run_completes_and_writes_outputs(run):
    result, _ = run
    check_outputs(result, steps=3, eval_steps=[2, 3])


def test_rewards_come_from_the_environment(run):
    result, _ = run
    assert result.rewards and all(np.isfinite(result.rewards))
    # the environment's rewards lie in [0, 1]; a random tiny model scores (almost) nothing
    assert all(0.0 <= r <= 1.0 for r in result.rewards)
    assert result.history[0]["rollout/rollouts_valid"] > 0


def test_weight_versions_are_monotone_per_replica(run):
    check_monotone_versions(run[0])


def test_no_trained_group_is_older_than_max_staleness(run):
    check_staleness(run[0], MAX_STALENESS)


def test_killed_replica_jobs_are_requeued_exactly_once(run):
    result, killed = run
    (dead,) = killed
    check_requeued_exactly_once(result, {rid.split("/")[0] for rid in dead.failed}, "fast/1")


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
