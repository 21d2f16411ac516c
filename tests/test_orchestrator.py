"""The local asynchronous loop end to end (hetrl.orchestrator.local).

One short run (3 steps, tiny sizes) is shared by the end-to-end checks: three pools, where the
fast pool has a second replica that dies on its first call (its jobs must be re-queued and
finished elsewhere, never lost or trained twice), the slow pool sleeps before every call (its
groups are the stalest; none may be trained beyond max_staleness) and the poison pool returns
only poisoned generations (rejected, counted per reason, the pool quarantined, never trained on,
while training goes on with the others). A unit check drives the episode runner with malformed
generations: they are rejected naming the field, not raised, and never reach the environment.
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
from hetrl.errors import UserError
from hetrl.orchestrator.supervisor import FleetExhausted
from hetrl.samplers.faults import Dies, InjectedFault, Poisoned, Slow
from orchestrator_checks import (check_monotone_versions, check_outputs,
                                 check_requeued_exactly_once, check_staleness)
from tiny_run import QUIET, TINY_BATCH

MAX_STALENESS = 1
QUARANTINE_MIN = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config("tiny_mixed.yaml", [
        f"output_dir={out}", "checkpointing.every=2",
        "steps=3", *TINY_BATCH,
        f"async.max_staleness={MAX_STALENESS}",
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3, replicas: 2},"
        " {name: slow, accelerator: a100, weight_precision: bf16},"
        " {name: poison, accelerator: h100, weight_precision: fp8_e4m3}]",
        f"fleet.quarantine={{max_rejection_rate: 0.5, min_rollouts: {QUARANTINE_MIN}, window: 8}}",
        "fleet.restart={max_per_replica: 0}",  # the killed replica stays dead: its pool shrinks
        "environment.options={eval: {every: 2, tasks: 2}, coding: {max_turns: 2}}",
    ])
    killed: list[Dies] = []
    poisoned: list[Poisoned] = []

    def wrap(pool, index, sampler):
        if pool.name == "slow":
            return Slow(sampler, 1.5)
        if pool.name == "poison":
            poisoned.append(Poisoned(sampler))
            return poisoned[-1]
        if index == 1:
            killed.append(Dies(sampler))
            return killed[-1]
        return sampler

    return LocalOrchestrator(cfg, wrap_sampler=wrap, console=False).run(), killed, poisoned


@pytest.mark.slow
def test_run_completes_and_writes_outputs(run):
    result, *_ = run
    check_outputs(result, steps=3, eval_steps=[0, 2, 3])


@pytest.mark.slow
def test_rewards_come_from_the_environment(run):
    result, *_ = run
    assert result.rewards and all(np.isfinite(result.rewards))
    # the environment's rewards lie in [0, 1]; a random tiny model scores (almost) nothing
    assert all(0.0 <= r <= 1.0 for r in result.rewards)
    assert result.history[-1]["rollout/rollouts_valid"] > 0


@pytest.mark.slow
def test_weight_versions_are_monotone_per_replica(run):
    check_monotone_versions(run[0])


@pytest.mark.slow
def test_no_trained_group_is_older_than_max_staleness(run):
    check_staleness(run[0], MAX_STALENESS)


@pytest.mark.slow
def test_killed_replica_jobs_are_requeued_exactly_once(run):
    result, killed, _ = run
    (dead,) = killed
    check_requeued_exactly_once(result, {rid.split("/")[0] for rid in dead.failed}, "fast/1")


@pytest.mark.slow
def test_poisoned_pool_is_rejected_counted_quarantined_and_never_trained(run):
    result, _, (poisoned,) = run
    assert sum(poisoned.used.values()) >= QUARANTINE_MIN
    last = result.history[-1]
    rejected = last["pool/poison/admission/rejected"]
    by_reason = {k.rsplit("/", 1)[1]: v for k, v in last.items() if k.startswith("pool/poison/admission/rejected/")}
    assert rejected >= QUARANTINE_MIN and sum(by_reason.values()) == rejected and len(by_reason) >= 2
    assert set(by_reason) <= {"sampler_logprobs", "response_ids", "support.ids", "policy_version", "sampler.pool"}
    assert last["pool/poison/admission/admitted"] == 0 and last["pool/poison/quarantined"] == 1
    assert "pool 'poison' quarantined" in result.final["quarantined"]["poison"]
    assert set(result.final["quarantined"]) == {"poison"}
    trained_pools = {pool for _, pool, *_ in result.trained}
    assert "poison" not in trained_pools and "fast" in trained_pools
    assert result.rejected and not set(result.rejected) & {g for g, *_ in result.trained}
    assert result.final["version"] == 3 and "poison/0" not in result.rollout_versions


@pytest.mark.slow
def test_a_dead_replica_is_restarted_and_serves_again(tmp_path):
    """The second replica dies on its first call; the restart policy builds it again after the
    delay, and the new one serves jobs (its first-token weight versions are recorded)."""
    cfg = load_config("tiny_homogeneous.yaml", [
        f"output_dir={tmp_path}", QUIET,
        "steps=3", *TINY_BATCH, "async.max_staleness=0",
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3, replicas: 2}]",
        "fleet.restart={max_per_replica: 2, delay_s: 0.2}", "environment.options={eval: {every: 0}}",
    ])
    killed: list[Dies] = []

    def wrap(pool, index, sampler):
        if index == 1 and not killed:  # only its first incarnation dies
            killed.append(Dies(sampler))
            return killed[-1]
        return sampler

    result = LocalOrchestrator(cfg, wrap_sampler=wrap, console=False).run()
    assert killed and killed[0].failed
    assert result.history[-1]["fleet/restarts"] == 1 and result.history[-1]["fleet/replicas_alive"] == 2
    assert result.rollout_versions.get("fast/1"), "the restarted replica never served"
    check_requeued_exactly_once(result, {r.split("/")[0] for r in killed[0].failed}, dead_replica="none")


class DiesAtVersion(Slow):
    """A sampler whose calls raise once it serves weight version ``version`` (a replica lost mid-run)."""

    def __init__(self, inner, version: int):
        super().__init__(inner, 0.0)
        self.version = version

    def generate(self, requests):
        if self.inner.weight_version >= self.version:
            raise InjectedFault("replica killed")
        return self.inner.generate(requests)


@pytest.mark.slow
def test_a_fleet_with_no_replica_left_ends_checkpointed_with_one_error_naming_the_cause(tmp_path):
    """The only replica dies after a few calls and may not be restarted: the run stops like a
    user's stop (checkpointed at its last step, summary written) and raises one UserError that
    says why, the replica's own error, and how to go on (--resume), instead of a traceback."""
    cfg = load_config("tiny_homogeneous.yaml", [
        f"output_dir={tmp_path}", QUIET, "steps=6", *TINY_BATCH, "async.schedule=lockstep", "async.max_staleness=0",
        "fleet.pools=[{name: only, accelerator: h100, weight_precision: bf16}]", "fleet.restart={max_per_replica: 0}",
        "environment.options={eval: {every: 0}}", "checkpointing.every=100",
    ])
    with pytest.raises(FleetExhausted) as err:
        LocalOrchestrator(cfg, wrap_sampler=lambda pool, i, sampler: DiesAtVersion(sampler, 2), console=False).run()
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    summary = json.loads((tmp_path / "summary.json").read_text())
    step = summary["version"]
    assert step == 2 and summary["stopped"] and summary["error"] == message
    assert "every sampler replica is dead or quarantined" in message and "InjectedFault" in message
    assert f"Stopped at step {step}, checkpointed" in message and "--resume" in message
    assert (tmp_path / "checkpoints" / str(step)).is_dir()  # not the every-100 policy's: saved on the way out


@pytest.mark.slow
def test_chaos_drill_loses_nothing_and_a_stop_request_ends_at_a_checkpoint(tmp_path):
    """Random kills, stalls and poisoned generations on every replica (fleet.chaos, seeded), the
    run stopped by request_stop() (what SIGTERM does) after its second step: every submitted
    group is accounted for, none trained twice, and the run ends checkpointed where it stopped."""
    cfg = load_config("tiny_homogeneous.yaml", [
        f"output_dir={tmp_path}", QUIET,
        "steps=100", *TINY_BATCH,
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3, replicas: 2}]",
        "fleet.restart={max_per_replica: 50, delay_s: 0.1}",
        "fleet.chaos={seed: 3, kill_rate: 0.5, slow_rate: 0.25, slow_s: 0.2, poison_rate: 0.3}",
        "fleet.quarantine={max_rejection_rate: 0.9, min_rollouts: 100, window: 200}",
        "environment.options={eval: {every: 0}}",
    ])
    orch = LocalOrchestrator(cfg, console=False)

    def stop_after_two_steps():
        while getattr(getattr(orch, "trainer", None), "version", 0) < 2:
            time.sleep(0.05)
        orch.request_stop()

    threading.Thread(target=stop_after_two_steps, daemon=True).start()
    result = orch.run()
    version = result.final["version"]
    assert 2 <= version < 100 and result.checkpoint_steps[-1] == version
    audit = result.audit()
    assert audit["lost"] == [] and audit["duplicated"] == [] and audit["unaccounted"] == 0, audit
    # at these rates a run of two steps (well over 8 calls, 16 generations) draws every fault
    assert result.final["chaos_kills"] >= 1 and result.final["replica_restarts"] >= 1
    assert result.final["chaos_poisoned"] >= 1 and result.history[-1]["admission/rejected"] >= 1


def test_a_held_out_task_whose_prompt_does_not_fit_is_unsolved_and_never_generated(tmp_path):
    from hetrl.orchestrator.evaluation import evaluate_tasks

    build_tiny_checkpoint(tmp_path, TINY_QWEN3, seed=0)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    chat = ChatFormat.from_tokenizer(tok)
    tasks = synthetic_suite().heldout[:4]
    probe = EpisodeRunner(chat, tok.decode, lambda: CodingEnv(), max_new_tokens=4, max_length=10_000,
                          vocab_size=TINY_QWEN3.vocab_size, stop_token_ids=(chat.im_end_id,))
    lengths = [len(probe.prompt_ids(t)) for t in tasks]
    longest = int(np.argmax(lengths))
    assert lengths.count(lengths[longest]) == 1
    room = 400  # new tokens: more than any reference answer takes
    runner = EpisodeRunner(chat, tok.decode, lambda: CodingEnv(), max_new_tokens=room, max_length=lengths[longest] + room - 1,
                           vocab_size=TINY_QWEN3.vocab_size, stop_token_ids=(chat.im_end_id,))
    info = SamplerInfo(pool="p", accelerator="h100", weight_precision="bf16", kv_precision="bf16", engine="embedded")
    seen: list[str] = []

    class Answering:  # answers every request with the task's canonical solution, as a perfect policy would
        def generate(self, requests):
            out = []
            for r in requests:
                seen.append(r.request_id)
                task = tasks[int(r.request_id.split("-")[1].split("/")[0])]
                ids = np.asarray(tok.encode(task.reference).ids + [chat.im_end_id], np.int32)
                out.append(Generation(r.request_id, ids, np.full(len(ids), -1.0, np.float32),
                                      np.zeros(len(ids), np.int64), "stop", None, info))
            return out

    episodes: list[dict] = []
    scores = evaluate_tasks(runner, Answering(), tasks, SamplingParams(), prefix="e", episodes=episodes)
    assert len(seen) == len(tasks) - 1 and not any(s.startswith(f"e-{longest}/") for s in seen)
    assert [e["success"] for e in episodes] == [i != longest for i in range(len(tasks))]
    assert scores["success"] == (len(tasks) - 1) / len(tasks) and scores["tasks"] == len(tasks)


def test_malformed_generations_are_rejected_not_raised(tmp_path):
    build_tiny_checkpoint(tmp_path, TINY_QWEN3, seed=0)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    chat = ChatFormat.from_tokenizer(tok)
    decoded: list[list[int]] = []

    def decode(ids):  # what the environment sees
        decoded.append(list(ids))
        return tok.decode(ids)

    runner = EpisodeRunner(chat, decode, lambda: CodingEnv(), max_new_tokens=4,
                           max_length=TINY_QWEN3.max_position_embeddings, vocab_size=TINY_QWEN3.vocab_size,
                           stop_token_ids=(chat.im_end_id,))
    task = synthetic_suite().train[0]
    prompt = runner.prompt_ids(task)
    info = SamplerInfo(pool="p", accelerator="h100", weight_precision="bf16", kv_precision="bf16", engine="embedded")
    ids = np.asarray([5, 6, 7, chat.im_end_id], np.int32)

    def gen(rid, logprobs, token_ids=ids):
        return Generation(rid, token_ids, np.asarray(logprobs, np.float32), np.zeros(4, np.int64), "stop", None, info)

    good = gen("g/0", [-1.0] * 4)
    bad = gen("g/1", [-1.0, np.nan, -1.0, -1.0])
    positive = gen("g/2", [-1.0, 3.0, -1.0, -1.0])
    outside = gen("g/3", [-1.0] * 4, np.asarray([5, TINY_QWEN3.vocab_size + 9, 7, chat.im_end_id], np.int32))
    out = runner.run_group("g", task, prompt, [good, bad, positive, outside], SamplingParams(),
                           lambda reqs: [gen(r.request_id, [-1.0] * 4) for r in reqs])
    assert len(out.rollouts) == 1 and out.errors == []
    assert [(e.rollout_id, e.field) for e in out.rejected] == [
        ("g/1", "sampler_logprobs"), ("g/2", "sampler_logprobs"), ("g/3", "response_ids")]
    assert all(max(d) < TINY_QWEN3.vocab_size for d in decoded) and len(decoded) >= 1
    r = out.rollouts[0]
    assert r.reward == r.reward and not r.loss_mask.all() and r.loss_mask[:4].all()  # env tokens are masked
