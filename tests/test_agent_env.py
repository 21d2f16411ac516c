"""Agentic repository tasks through tool calls (hetrl.envs.agent), driven by scripted agents: the
tools act on the repository, hidden tests never reach the agent, submit scores like a repo answer,
and in an episode every tool response enters the trajectory with loss_mask False."""

import json

import numpy as np
import pytest

from hetrl.core.schema import SamplerInfo, SamplingParams
from hetrl.envs.agent import AgentEnvConfig, AgentRepoEnv
from hetrl.envs.base import ChatFormat
from hetrl.envs.coding import extract_files
from hetrl.envs.task_files import TaskSetError, task_splits
from hetrl.envs.sandbox import Sandbox, SandboxLimits
from hetrl.envs.tasks_realcode import repo_tasks
from hetrl.orchestrator.episodes import EpisodeRunner
from hetrl.samplers.base import Generation

TASK = next(t for t in repo_tasks() if t.task_id == "repo-textstats")
FIXES = extract_files(TASK.reference)[0]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(cpu_s=4, wall_s=8, max_processes=64))


@pytest.fixture()
def env(sandbox):
    return AgentRepoEnv(AgentEnvConfig(max_steps=6), sandbox=sandbox)


def test_a_scripted_agent_reads_runs_fixes_and_submits(env):
    first = env.reset(TASK)
    assert first.messages[0].role == "system" and '"name": "write_file"' in first.messages[0].content
    assert "tests/test_textstats.py" in first.text and "hidden" not in first.text
    read = env.step(call("read_file", path="textstats/tokenize.py"))
    assert not read.done and TASK.files["textstats/tokenize.py"].strip() in read.observation.text
    run = env.step(call("run", command="python -m unittest tests.test_textstats"))
    assert "FAILED" in run.observation.text and "[exit status 1]" in run.observation.text
    wrote = env.step("".join(call("write_file", path=p, content=t) for p, t in FIXES.items()))
    assert wrote.observation.text.count("Wrote ") == len(FIXES)
    again = env.step(call("run", command="python -m unittest tests.test_textstats"))
    assert "OK" in again.observation.text and "[exit status 0]" in again.observation.text
    done = env.step(call("submit"))
    assert done.done and done.reward == 1.0 and done.info["submitted"] and done.info["scored_total"] == 8


def test_hidden_tests_never_reach_the_agent_and_tests_cannot_be_written(env):
    env.reset(TASK)
    hidden = next(iter(TASK.hidden_tests))
    step = env.step(call("read_file", path=hidden) + call("write_file", path="tests/test_textstats.py", content="")
                    + call("run", command="python -c \"import os; print(sorted(os.listdir('tests')))\""))
    text = step.observation.text
    assert f"No such file: {hidden}" in text and "test files cannot be written" in text
    assert "['test_textstats.py']" in text and "TestHidden" not in text


def test_a_wrong_submission_and_malformed_calls_score_less(env):
    env.reset(TASK)
    bad = env.step("I will fix it. <tool_call>{not json</tool_call>" + call("delete", path="x")
                   + call("read_file") + call("read_file", path="../etc/passwd"))
    text = bad.observation.text
    assert "not valid JSON" in text and "Unknown tool" in text and "missing argument 'path'" in text
    assert "not a clean relative path" in text
    done = env.step(call("write_file", path="textstats/tokenize.py", content=FIXES["textstats/tokenize.py"])
                    + call("submit"))
    assert done.done and 0 < done.info["scored_passed"] < done.info["scored_total"]
    assert done.reward < 0.9 and not done.info["format_ok"]  # format_ok lost to the malformed calls


def test_the_repository_is_scored_after_max_steps(sandbox):
    env = AgentRepoEnv(AgentEnvConfig(max_steps=2), sandbox=sandbox)
    env.reset(TASK)
    assert not env.step("thinking...").done
    last = env.step("".join(call("write_file", path=p, content=t) for p, t in FIXES.items()))
    assert last.done and not last.info["submitted"] and last.info["scored_passed"] == 8
    assert last.reward == pytest.approx(0.9)  # the first turn had no tool call


def test_tool_responses_enter_the_episode_with_loss_mask_false(sandbox):
    """An episode through the runner, a scripted agent as the sampler: the agent's tokens are
    trained on, every tool response (and template token around it) is not."""
    chat = ChatFormat(lambda s: [ord(c) for c in s], 1, 2)
    runner = EpisodeRunner(chat, lambda ids: "".join(chr(i) for i in ids), lambda: AgentRepoEnv(sandbox=sandbox),
                           max_new_tokens=4000, max_length=60000, vocab_size=1 << 16, stop_token_ids=(2,))
    script = [call("read_file", path="textstats/stats.py"),
              "".join(call("write_file", path=p, content=t) for p, t in FIXES.items()), call("submit")]
    info = SamplerInfo(pool="p", accelerator="h100", weight_precision="bf16", kv_precision="bf16", engine="embedded")

    def generate(text, rid):
        ids = np.asarray([ord(c) for c in text] + [2], np.int32)
        return Generation(rid, ids, np.full(ids.shape, -0.5, np.float32), np.zeros(ids.shape, np.int64), "stop", None, info)

    turns = iter(script[1:])
    prompt = runner.prompt_ids(TASK)
    out = runner.run_group("g", TASK, prompt, [generate(script[0], "g/0")], SamplingParams(),
                           lambda reqs: [generate(next(turns), r.request_id) for r in reqs])
    (rollout,) = out.rollouts
    assert rollout.reward == 1.0 and out.solved == [True]
    response = "".join(chr(i) for i in rollout.response_ids)
    trained = "".join(chr(i) for i, m in zip(rollout.response_ids, rollout.loss_mask) if m)
    untrained = "".join(chr(i) for i, m in zip(rollout.response_ids, rollout.loss_mask) if not m)
    assert trained == "".join(s + chr(2) for s in script)
    assert untrained.count("<tool_response>") == 1 + len(FIXES) and "Wrote textstats/stats.py." in untrained
    assert "<tool_response>" not in trained and response.count("<tool_call>") == 1 + len(FIXES) + 1


def test_an_episode_cut_short_is_scored_with_its_last_writes(env):
    env.reset(TASK)
    env.step(call("write_file", path="textstats/tokenize.py", content=FIXES["textstats/tokenize.py"]))
    grade = env.grade(TASK, call("write_file", path="textstats/stats.py", content=FIXES["textstats/stats.py"])
                      + call("run", command="python -c 1"))
    assert grade.reward(env.config.format_weight) == 1.0 and grade.tampered is None


SPEND = ("import sys, time\ncpu, wall = float(sys.argv[1]), float(sys.argv[2])\nend = time.process_time() + cpu\n"
         "while time.process_time() < end:\n    pass\ntime.sleep(wall)\nprint('spent')\n")
"""A script that computes for ``argv[1]`` CPU seconds, then sleeps ``argv[2]`` seconds."""


def test_a_run_command_is_limited_by_its_cpu_time_not_by_the_wall_clock(sandbox):
    env = AgentRepoEnv(AgentEnvConfig(max_steps=6, command_timeout_s=1, command_wall_s=2.5), sandbox=sandbox)
    env.reset(TASK)
    waits, spins, blocks = (env.step(call("write_file", path="spend.py", content=SPEND) + call("run", command=command))
                            .observation.text for command in ("python spend.py 0.1 1.5", "python spend.py 5 0",
                                                              "python spend.py 0 60"))
    assert "spent" in waits and "[exit status 0]" in waits  # 1.6 s of wall clock on 0.1 s of CPU: within 1 s of CPU
    assert "spent" not in spins and "[stopped: CPU time limit, 1 s]" in spins
    assert "spent" not in blocks and "[stopped: wall time limit, 2.5 s]" in blocks


def test_the_run_commands_wall_clock_backstop_cannot_be_below_its_cpu_limit():
    with pytest.raises(ValueError, match="command_wall_s .* below command_timeout_s"):
        AgentEnvConfig(command_timeout_s=3, command_wall_s=2)


def test_agentic_runs_take_repository_tasks_only(tmp_path):
    from hetrl.config import load_config

    folder = tmp_path / "repo-task"
    for sub, files in (("repo", TASK.files), ("visible", TASK.tests), ("hidden", TASK.hidden_tests)):
        for path, text in files.items():
            (folder / sub / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / sub / path).write_text(text)
    (folder / "ISSUE.md").write_text(TASK.issue)
    splits = task_splits(str(folder), "realcode")
    assert [t.task_id for t in splits.train] == ["repo-task"]
    with pytest.raises(TaskSetError, match="agent plays repository tasks only; fn-run-length-encode is a "
                                           "realcode-function task"):
        task_splits(str(folder), "realcode", repo_only=True)
    config = load_config("tiny_mixed.yaml", [f"environment={{name: coding, options: {{train: {folder}, "
                                             "agent: {max_steps: 3}}}"])
    assert config.environment.options.agent.max_steps == 3
