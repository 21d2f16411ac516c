"""Agentic repository tasks: the policy acts through tool calls in Qwen3's format.

Each assistant turn holds one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (the JSON of Qwen3's chat template); the environment answers each with a
``<tool_response>...</tool_response>`` block in the next user message, which the episode runner
appends to the trajectory with ``loss_mask`` False like any environment observation. Tools:

* ``run(command)``: run a command (``python -m unittest ...``, ``python script.py``; no shell, and
  ``python`` is the sandbox's interpreter) in a fresh sandbox holding the repository as it is now
  and the visible test files; its output comes back, its file changes do not (use write_file);
* ``read_file(path)`` / ``write_file(path, content)``: the repository's files and the visible
  tests (test files cannot be written; hidden test files do not exist for the agent);
* ``submit()``: end the episode; the answer is scored like a :class:`~hetrl.envs.coding.RepoTask`
  answer (every test, hidden ones staged only now, canaries:
  :meth:`~hetrl.envs.coding.CodingEnv.run_repo_tests`).

After ``max_steps`` turns without ``submit`` the repository is scored as it is. The reward is
:meth:`~hetrl.envs.coding.Grade.reward` with ``format_ok`` meaning every turn's tool calls parsed.
In a run: ``environment: {name: coding, options: {train: <repo tasks>, agent: {max_steps: 8}}}``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.envs.base import Environment, Message, Observation, StepResult
from hetrl.envs.coding import CodingEnv, CodingEnvConfig, Grade, RepoTask, _check_relpath, _sanitize
from hetrl.envs.sandbox import Sandbox

__all__ = ["AgentEnvConfig", "AgentRepoEnv", "TOOLS"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

#: The tools, as Qwen3's template lists them in the system prompt (JSON function schemas).
TOOLS = (
    {"type": "function", "function": {"name": "run", "description": "Run a command (no shell) on a copy of the repository.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                                                      "content": {"type": "string"}},
                                                     "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Submit the repository as it is now.",
                                      "parameters": {"type": "object", "properties": {}}}},
)

_RUN = """import json, resource, shlex, signal, subprocess, sys
spec = json.loads(sys.stdin.read())
argv = shlex.split(spec["command"])
if argv and argv[0] in ("python", "python3"):
    argv[0] = sys.executable
cpu = spec["cpu_s"]

def limit_cpu():  # in the command's process: RLIMIT_CPU (whole seconds), SIGKILL a second later
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    top = cpu + 1 if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_CPU, (min(cpu, top), min(cpu + 1, top)))

try:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=spec["wall_s"], preexec_fn=limit_cpu)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and used.ru_utime + used.ru_stime >= cpu - 0.05:
        sys.stdout.write(done.stdout + done.stderr + f"[stopped: CPU time limit, {cpu} s]")
    else:
        sys.stdout.write(done.stdout + done.stderr + f"[exit status {done.returncode}]")
except subprocess.TimeoutExpired:
    sys.stdout.write(f"[stopped: wall time limit, {spec['wall_s']} s]")
except OSError as exc:
    sys.stdout.write(f"[cannot run: {exc}]")
"""


class AgentEnvConfig(BaseModel):
    """``max_steps``: assistant turns before the repository is scored as it is;
    ``command_timeout_s``: CPU seconds per ``run`` (whole seconds, RLIMIT_CPU's unit; CPU time, not
    wall clock, so that what the agent observes does not depend on the machine's load);
    ``command_wall_s``: the wall-clock backstop per ``run``, for a command that blocks instead of
    computing; ``max_observation_chars``: per tool response."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(8, ge=1)
    command_timeout_s: int = Field(3, ge=1)
    command_wall_s: float = Field(10.0, gt=0)
    max_observation_chars: int = Field(4000, ge=200)

    @model_validator(mode="after")
    def _wall_above_cpu(self) -> "AgentEnvConfig":
        if self.command_wall_s < self.command_timeout_s:
            raise ValueError(f"command_wall_s ({self.command_wall_s}) is below command_timeout_s "
                             f"({self.command_timeout_s}): the wall-clock backstop must be at least the CPU-time limit")
        return self


class AgentRepoEnv(Environment):
    """One agentic episode on a :class:`RepoTask` at a time (module docstring). ``config`` is the
    :class:`CodingEnvConfig` of the scoring (sandbox limits, format weight; as for
    :class:`CodingEnv`), ``agent`` the :class:`AgentEnvConfig`."""

    def __init__(self, agent: AgentEnvConfig | None = None, config: CodingEnvConfig | None = None,
                 sandbox: Sandbox | None = None):
        self.agent = agent or AgentEnvConfig()
        self.coding = CodingEnv(config, sandbox)
        self.config = self.coding.config
        self._task: RepoTask | None = None
        self._files: dict[str, str] = {}
        self._steps = 0
        self._format_ok = True
        self._done = True

    def reset(self, task: RepoTask) -> Observation:
        if not isinstance(task, RepoTask):
            raise TypeError(f"AgentRepoEnv takes a RepoTask, not {type(task).__name__}")
        self._task, self._files, self._steps, self._format_ok, self._done = task, dict(task.files), 0, True, False
        tools = "\n".join(json.dumps(t) for t in TOOLS)
        system = ("You can call tools. Their signatures are within <tools></tools>:\n<tools>\n" + tools + "\n</tools>\n"
                  'For each call, return a JSON object within <tool_call></tool_call>: '
                  '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        listing = "\n".join(sorted([*task.files, *task.tests]))
        user = (f"{task.issue.strip()}\n\nThe repository's files:\n{listing}\n\nMake the tests pass without editing "
                "test files, then call submit.")
        return Observation(messages=(Message(role="system", content=_sanitize(system)),
                                     Message(role="user", content=_sanitize(user))))

    def step(self, action_text: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("no episode is running: call reset() first")
        self._steps += 1
        calls = _TOOL_CALL.findall(action_text)
        responses: list[str] = []
        submitted = False
        if not calls:
            self._format_ok = False
            responses.append("No tool call found: answer with <tool_call>{...}</tool_call>.")
        for raw in calls:
            name, arguments, problem = _parse(raw)
            if problem:
                self._format_ok = False
                responses.append(problem)
            elif name == "submit":
                submitted = True
                break
            else:
                responses.append(self._call(name, arguments))
        if submitted or self._steps >= self.agent.max_steps:
            self._done = True
            grade = self.coding.run_repo_tests(self._task, self._files, self._format_ok, (), scoring=True)
            return StepResult(observation=None, reward=grade.reward(self.config.format_weight), done=True,
                              info={"turn": self._steps, "submitted": submitted, **grade.info()})
        limit = self.agent.max_observation_chars
        text = "\n".join(f"<tool_response>\n{r if len(r) <= limit else r[:limit] + '...'}\n</tool_response>"
                         for r in responses)
        return StepResult(observation=Observation(messages=(Message(role="user", content=_sanitize(text)),)),
                          reward=0.0, done=False, info={"turn": self._steps, "calls": len(calls)})

    def grade(self, task: RepoTask, action_text: str) -> Grade:
        """Score the repository with this turn's ``write_file`` calls applied (an episode cut short,
        e.g. by the model's context length, is scored like this)."""
        if task is not self._task:
            raise RuntimeError("grade() scores the running episode's task")
        for raw in _TOOL_CALL.findall(action_text):
            name, arguments, problem = _parse(raw)
            if not problem and name == "write_file":
                self._call(name, arguments)
        return self.coding.run_repo_tests(task, self._files, self._format_ok, (), scoring=True)

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        task = self._task
        assert task is not None
        visible = {**self._files, **task.tests}
        try:
            if name == "run":
                spec = {"command": str(arguments["command"]), "cpu_s": self.agent.command_timeout_s,
                        "wall_s": self.agent.command_wall_s}
                res = self.coding.sandbox.run(_RUN, stdin=json.dumps(spec), files=visible)
                return res.stdout if res.killed_reason is None else f"{res.stdout}[sandbox: {res.killed_reason}]"
            path = _check_relpath(str(arguments["path"]))
            if name == "read_file":
                return visible[path] if path in visible else f"No such file: {path}"
            if path in task.tests or path in task.hidden_tests:
                return f"{path} is a test file: test files cannot be written."
            self._files[path] = str(arguments["content"])
            return f"Wrote {path}."
        except KeyError as exc:
            return f"{name}: missing argument {exc}"
        except ValueError as exc:
            return f"{name}: {exc}"


def _parse(raw: str) -> tuple[str, dict[str, Any], str | None]:
    """``(name, arguments, problem)`` of one tool call's JSON."""
    try:
        call = json.loads(raw)
    except (ValueError, RecursionError):
        return "", {}, "A tool call is not valid JSON."
    if not isinstance(call, dict) or call.get("name") not in {t["function"]["name"] for t in TOOLS}:
        return "", {}, f"Unknown tool; the tools are {', '.join(t['function']['name'] for t in TOOLS)}."
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return "", {}, "A tool call's arguments are a JSON object."
    return call["name"], arguments, None
