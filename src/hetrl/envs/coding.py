"""The agentic coding environment: the policy writes code, the sandbox runs the tests.

Three task kinds share one multi-turn loop (:class:`CodingEnv`):

* :class:`FunctionTask` -- write one Python function. The action's fenced code block that defines
  ``entry_point`` becomes ``solution.py``; a harness (``_harness_function.py``) calls the function
  on the visible and hidden inputs inside the sandbox and prints its return values as typed data
  (:mod:`hetrl.envs.typed`: int, float, bool, None, str, tuple, list, set and dict kept apart).
  **Expected values never enter the sandbox and the reward is decided outside it**: the grader
  decodes the values into plain built-ins and compares them (:func:`typed_equal`: ints exactly,
  floats within the task's own tolerance, a tuple never equals a list).
* :class:`CheckTask` -- HumanEval- and MBPP-style: write one function, scored by trusted test code
  ``check(candidate)``, which runs in the grader's process with ``candidate`` a proxy whose calls
  run in the sandbox and return typed data (:mod:`hetrl.envs.trusted_check`). Feedback says only
  that the tests failed (and why the code did not load): the test code is never shown.
* :class:`RepoTask` -- make a failing unittest suite pass in a small repository. The action gives
  whole files as fenced blocks tagged with their path (```` ```python pkg/mod.py ````); edits
  accumulate over the episode; test files cannot be edited. A harness (``_harness_unittest.py``)
  runs the test files with stdlib :mod:`unittest` inside the sandbox, from the grader's pristine
  copy (sent over stdin; what the candidate writes to disk changes nothing), each file in a child
  process of a harness that never loads the candidate's code and relays the child's records.
  Each turn's feedback comes from a run of the visible tests only; the hidden tests are staged
  only for the scoring run once the episode ends, with canary tests that must fail: one reported
  passing (``unittest`` patched, every test reported passed) marks the answer ``tampered``
  (reward 0, ``info["tampered"]`` says why). Tests still run in the candidate's process, so
  residual risk remains (see the harness's docstring): use function or HumanEval-style tasks
  where a reward must not be forgeable.

Episode: turn t runs the current answer on the visible tests only (the hidden inputs and test
files never enter that run, so its feedback cannot quote them); while they fail and
``t < max_turns`` the failures (inputs, expected, got, errors; or test ids and messages) come back
as the next user message; the episode ends when the visible tests pass or the turns run out, and
the final answer is then scored by a run with every test (on the last turn, that run alone), with

    reward = (1 - format_weight) * fraction of scored tests passed + format_weight * format_ok

on the final answer (0 when tampered), where the scored tests are the hidden cases of a function
task, the trusted ``check`` of a check task and every test (visible and hidden) of a repository
task, and ``format_ok`` means the answer used the expected fenced format. Intermediate turns earn 0. Nothing from the sandbox is evaluated in the
parent: results travel as JSON lines tagged with a per-run nonce, parsed with :func:`json.loads`.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import secrets
from dataclasses import dataclass
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hetrl.envs import typed
from hetrl.envs.base import IM_END, IM_START, Environment, Message, Observation, StepResult, Task
from hetrl.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from hetrl.envs.trusted_check import CallResult, compile_check, run_check

_HERE = pathlib.Path(__file__).parent
FUNCTION_HARNESS = (_HERE / "_harness_function.py").read_text()
#: :mod:`hetrl.envs.typed`, shipped into the run directory for the function harness.
TYPED_MODULE = ("_hetrl_typed.py", (_HERE / "typed.py").read_text())
UNITTEST_HARNESS = (_HERE / "_harness_unittest.py").read_text()
SOLUTION_MODULE = "solution"
_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_PATH_COMMENT = re.compile(r"^#\s*(?:file:\s*)?([\w./-]+\.\w+)\s*$")
MAX_ANSWER_FILES, MAX_FILE_CHARS = 20, 100_000


# -- tasks ---------------------------------------------------------------------------------------

class FunctionCase(BaseModel):
    """One call ``entry_point(*args)`` and its expected return value: values of the types
    :mod:`hetrl.envs.typed` transfers (None, bool, int, float, str, list, tuple, set, frozenset,
    dict, nested)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    args: tuple[Any, ...]
    expected: Any

    @field_validator("args", "expected")
    @classmethod
    def _transferable(cls, value: Any) -> Any:
        try:
            typed.encode(value)
        except typed.TypedError as exc:
            raise ValueError(str(exc)) from None
        return value


def _check_syntax(what: str, source: str) -> None:
    """Raise ValueError naming ``what`` and the line when ``source`` is not valid Python."""
    try:
        ast.parse(source)
    except SyntaxError as err:
        raise ValueError(f"{what} is not valid Python (line {err.lineno}: {err.msg})") from None


class FunctionTask(Task):
    """Write the function ``entry_point``. ``prompt`` shows the visible cases; the hidden ones are
    scored. ``reference`` is a correct answer in the expected format (a fenced block defining
    ``entry_point``, valid Python: checked here; its correctness is checked by the tests)."""

    prompt: str = Field(min_length=1)
    entry_point: str = Field(pattern=r"^[A-Za-z_]\w*$")
    visible: tuple[FunctionCase, ...] = Field(min_length=1)
    hidden: tuple[FunctionCase, ...] = Field(min_length=1)
    reference: str
    tier: int = Field(default=0, ge=0)
    rel_tol: float = Field(default=1e-9, ge=0)
    abs_tol: float = Field(default=1e-9, ge=0)
    """The tolerance of float return values (:func:`typed_equal`); ints are always exact."""

    @model_validator(mode="after")
    def _reference_format(self) -> "FunctionTask":
        code, format_ok = extract_code(self.reference, self.entry_point)
        if code is None or not format_ok:
            raise ValueError(f"task {self.task_id}: reference must be a fenced ```python block "
                             f"defining {self.entry_point}()")
        _check_syntax(f"task {self.task_id}: reference", code)
        return self


def _check_relpath(path: str) -> str:
    parts = pathlib.PurePosixPath(path).parts
    if (not parts or path.startswith("/") or "\\" in path or len(path) > 200
            or any(p in ("", ".", "..") or p.startswith(".") for p in parts)):
        raise ValueError(f"not a clean relative path: {path!r}")
    return path


class RepoTask(Task):
    """Make the tests pass in a repository. ``files``: the initial source files (editable);
    ``tests``: visible test files (shown, give feedback); ``hidden_tests``: scored with the
    visible ones but never shown. Test files are ``unittest`` modules (``.py``, valid Python,
    with test methods). ``reference`` is a correct answer in the expected format: path-tagged
    blocks that edit no test file (None when the task set has none)."""

    issue: str = Field(min_length=1)
    files: dict[str, str]
    tests: dict[str, str] = Field(min_length=1)
    hidden_tests: dict[str, str] = Field(default_factory=dict)
    reference: str | None = None

    @field_validator("files", "tests", "hidden_tests")
    @classmethod
    def _clean_paths(cls, value: dict[str, str]) -> dict[str, str]:
        for path in value:
            _check_relpath(path)
        return value

    @model_validator(mode="after")
    def _test_files(self) -> "RepoTask":
        test_paths = set(self.tests) | set(self.hidden_tests)
        if set(self.tests) & set(self.hidden_tests) or test_paths & set(self.files):
            raise ValueError(f"task {self.task_id}: a path is both a source file and a test file, "
                             "or visible and hidden")
        for path, source in {**self.tests, **self.hidden_tests}.items():
            if not path.endswith(".py"):
                raise ValueError(f"task {self.task_id}: test file {path} must be a .py module")
            _check_syntax(f"task {self.task_id}: test file {path}", source)
            if not unittest_ids(path, source):
                raise ValueError(f"task {self.task_id}: test file {path} defines no unittest test methods")
        return self

    @model_validator(mode="after")
    def _reference_files(self) -> "RepoTask":
        if self.reference is None:
            return self
        files, problems = extract_files(self.reference)
        if problems or not files:
            raise ValueError(f"task {self.task_id}: reference must give files as ```python <path> blocks: "
                             + ("; ".join(problems) or "it has none"))
        edited_tests = sorted(set(files) & (set(self.tests) | set(self.hidden_tests)))
        if edited_tests:
            raise ValueError(f"task {self.task_id}: reference edits test files: {', '.join(edited_tests)}")
        return self

    @property
    def test_paths(self) -> tuple[str, ...]:
        return tuple(sorted(self.tests)) + tuple(sorted(self.hidden_tests))

    @property
    def prompt(self) -> str:
        """The issue, every source file and visible test file, and the answer format."""
        shown = [*sorted(self.files.items()), *sorted(self.tests.items())]
        blocks = "\n\n".join(f"```python {path}\n{text.rstrip()}\n```" for path, text in shown)
        return (f"{self.issue.strip()}\n\nRepository:\n\n{blocks}\n\n"
                "Make the tests pass without editing test files. Reply with the complete new content "
                "of every file you change, each in a ```python <path> block.")


class CheckTask(Task):
    """Write the function ``entry_point``, scored by trusted test code: ``test`` defines
    ``check(candidate)`` (HumanEval's format), which runs in the grader after ``context`` (code the
    answer builds on and the test may use: a HumanEval prompt with its imports and helpers; it
    precedes the answer in ``solution.py``). ``prompt`` is what the policy sees; ``reference`` a
    correct answer (a fenced block defining ``entry_point``), when the task set has one."""

    prompt: str = Field(min_length=1)
    entry_point: str = Field(pattern=r"^[A-Za-z_]\w*$")
    context: str = ""
    test: str = Field(min_length=1)
    reference: str | None = None

    @model_validator(mode="after")
    def _valid_code(self) -> "CheckTask":
        compile_check(self.context, self.test, f"task {self.task_id}")
        if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in ast.parse(self.test).body):
            raise ValueError(f"task {self.task_id}: the test code defines no check(candidate)")
        if self.reference is not None:
            code, format_ok = extract_code(self.reference, self.entry_point)
            if code is None or not format_ok:
                raise ValueError(f"task {self.task_id}: reference must be a fenced ```python block "
                                 f"defining {self.entry_point}()")
            _check_syntax(f"task {self.task_id}: reference", code)
        return self


CodingTask = Union[FunctionTask, RepoTask, CheckTask]


def unittest_ids(path: str, source: str) -> tuple[str, ...]:
    """Ids (``module.Class.test_method``) of the test methods a trusted test file defines, found
    by parsing it (never by running it): classes at module level deriving from ``*TestCase``."""
    module = path[:-3].replace("/", ".")
    ids = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and any(
                (isinstance(b, ast.Attribute) and b.attr.endswith("TestCase"))
                or (isinstance(b, ast.Name) and b.id.endswith("TestCase")) for b in node.bases):
            ids += [f"{module}.{node.name}.{f.name}" for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return tuple(sorted(ids))


# -- answers -------------------------------------------------------------------------------------

def extract_code(text: str, entry_point: str) -> tuple[str | None, bool]:
    """The code of an answer and whether it has the expected format: the last fenced block that
    defines ``entry_point`` (format ok); else the last fenced block, or the text from the first
    ``def`` line, or after an unclosed fence (format not ok); None when there is no code."""
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.M)
    blocks = [body for _, body in _FENCE.findall(text)]
    with_def = [b for b in blocks if defines.search(b)]
    if with_def:
        return with_def[-1], True
    if blocks:
        return blocks[-1], False
    opener = text.rfind("```")
    if opener >= 0:
        rest = text[opener + 3:]
        return (rest.split("\n", 1)[1] if "\n" in rest else ""), False
    match = re.search(r"^\s*def\s", text, re.M)
    return (text[match.start():], False) if match else (None, False)


def extract_files(text: str) -> tuple[dict[str, str], list[str]]:
    """Files of an answer: fenced blocks whose info string ends with a path
    (```` ```python pkg/mod.py ````) or whose first line is a ``# file: path`` comment.
    Returns (files, problems); a block without a usable path is a problem, later blocks for the
    same path win."""
    files: dict[str, str] = {}
    problems: list[str] = []
    for info, body in _FENCE.findall(text):
        words = info.split()
        path = words[-1] if words and "." in words[-1] else None
        if path is None:
            first = body.split("\n", 1)[0].strip()
            match = _PATH_COMMENT.match(first)
            path = match.group(1) if match else None
        if path is None:
            problems.append("A code block has no file path.")
            continue
        try:
            _check_relpath(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if len(body) > MAX_FILE_CHARS:
            problems.append(f"{path} is too large.")
            continue
        files[path] = body
    if len(files) > MAX_ANSWER_FILES:
        problems.append(f"Too many files ({len(files)} > {MAX_ANSWER_FILES}).")
        files = dict(list(files.items())[:MAX_ANSWER_FILES])
    return files, problems


# -- grading -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """One test: ``name`` (a call like ``f([1, 2])`` or a unittest id), whether it passed, and a
    one-line explanation for feedback."""

    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class Grade:
    """Result of running one answer: ``visible`` tests (feedback), ``scored`` tests (reward),
    ``format_ok``; ``notes`` for the policy (no code, load error, ignored edits); ``tested`` is
    False when no test could run (then every test failed); the sandbox result if it ran;
    ``tampered``: why the test runner's report cannot be trusted (then the reward is 0)."""

    visible: tuple[Outcome, ...]
    scored: tuple[Outcome, ...]
    format_ok: bool
    notes: tuple[str, ...]
    tested: bool
    sandbox: SandboxResult | None
    tampered: str | None = None

    @property
    def visible_passed(self) -> bool:
        return all(o.passed for o in self.visible)

    @property
    def scored_fraction(self) -> float:
        """The fraction of scored tests passed (0 when tampered)."""
        return 0.0 if self.tampered else sum(o.passed for o in self.scored) / len(self.scored)

    def reward(self, format_weight: float) -> float:
        if self.tampered:
            return 0.0
        return (1.0 - format_weight) * self.scored_fraction + format_weight * float(self.format_ok)

    def info(self) -> dict[str, Any]:
        return {
            "visible_passed": sum(o.passed for o in self.visible), "visible_total": len(self.visible),
            "scored_passed": 0 if self.tampered else sum(o.passed for o in self.scored), "scored_total": len(self.scored),
            "format_ok": self.format_ok, "notes": list(self.notes), "tampered": self.tampered,
            "killed_reason": self.sandbox.killed_reason if self.sandbox else None,
            "sandbox_wall_s": self.sandbox.wall_s if self.sandbox else 0.0,
        }


def _canary_ids(path: str) -> tuple[str, tuple[str, ...]]:
    """A fresh random test class name and method names for the canary of test file ``path``."""
    return f"Test{secrets.token_hex(4).capitalize()}", tuple(f"test_{secrets.token_hex(4)}" for _ in range(3))


def _canary_source(class_name: str, methods: tuple[str, ...]) -> str:
    """A unittest class whose tests must fail (an ``assertEqual`` of two different numbers, a
    false ``assertTrue``, a bare ``assert``): appended to a test file when scoring."""
    a = secrets.randbelow(10**6)
    checks = (f"self.assertEqual({a}, {a + 1 + secrets.randbelow(99)})", "self.assertTrue(0)", "assert 0")
    body = "".join(f"    def {m}(self):\n        {c}\n\n" for m, c in zip(methods, checks))
    return f"\n\nclass {class_name}(__import__('unittest').TestCase):\n{body}"


def _records(stdout: str, nonce: str) -> list[dict]:
    """The harness's JSON records (lines starting with the nonce); anything else is ignored,
    malformed or absurdly nested lines included."""
    out = []
    for line in stdout.splitlines():
        if line.startswith(nonce + " "):
            try:
                record = json.loads(line[len(nonce) + 1:])
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


_show = typed.show
typed_equal = typed.typed_equal


def _sanitize(text: str) -> str:
    """Environment text never contains chat markers (:class:`hetrl.envs.base.ChatFormat`)."""
    return text.replace(IM_START, "<| im_start |>").replace(IM_END, "<| im_end |>")


class CodingEnvConfig(BaseModel):
    """``max_turns``: answers per episode; ``format_weight``: weight of the format term;
    ``test_timeout_s``: CPU seconds per call / per test (CPU time, not wall clock, so that a grade
    does not depend on the machine's load); ``test_wall_s``: the wall-clock backstop per call / per
    test, for code that blocks (sleeps, waits on input) instead of computing; ``limits.wall_s``
    bounds the whole run the same way, set well above its CPU limit so that a loaded machine (a
    fifth of a core per run) cannot end a run that stays within its CPU time;
    ``require_isolation``: passed to :class:`Sandbox`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(default=3, ge=1)
    format_weight: float = Field(default=0.1, ge=0.0, le=1.0)
    limits: SandboxLimits = SandboxLimits(cpu_s=4, wall_s=30, max_output_bytes=1 << 18)
    test_timeout_s: float = Field(default=1.0, gt=0)
    test_wall_s: float = Field(default=5.0, gt=0)
    max_failures_shown: int = Field(default=3, ge=1)
    max_feedback_chars: int = Field(default=1500, ge=200)
    require_isolation: tuple[str, ...] = ()
    system_prompt: str | None = None

    @model_validator(mode="after")
    def _wall_above_cpu(self) -> "CodingEnvConfig":
        if self.test_wall_s < self.test_timeout_s:
            raise ValueError(f"test_wall_s ({self.test_wall_s}) is below test_timeout_s ({self.test_timeout_s}): "
                             "the wall-clock backstop must be at least the CPU-time limit")
        return self


class CodingEnv(Environment):
    """Multi-turn coding episodes over :class:`FunctionTask` and :class:`RepoTask`. One instance
    per concurrent episode; the sandbox may be shared between instances and threads."""

    def __init__(self, config: CodingEnvConfig | None = None, sandbox: Sandbox | None = None):
        self.config = config or CodingEnvConfig()
        self.sandbox = sandbox or Sandbox(self.config.limits, require=self.config.require_isolation)
        self._task: CodingTask | None = None
        self._files: dict[str, str] = {}
        self._turn = 0
        self._done = True

    def _test_limits(self) -> dict[str, float]:
        """The harnesses' per-call / per-test limits: CPU seconds and the wall-clock backstop."""
        return {"cpu_s": self.config.test_timeout_s, "wall_s": self.config.test_wall_s}

    # -- episode -----------------------------------------------------------------------------

    def reset(self, task: CodingTask) -> Observation:
        if not isinstance(task, (FunctionTask, RepoTask, CheckTask)):
            raise TypeError(f"CodingEnv takes FunctionTask, RepoTask or CheckTask, not {type(task).__name__}")
        self._task, self._turn, self._done = task, 0, False
        self._files = dict(task.files) if isinstance(task, RepoTask) else {}
        messages = [Message(role="user", content=_sanitize(task.prompt))]
        if self.config.system_prompt:
            messages.insert(0, Message(role="system", content=self.config.system_prompt))
        return Observation(messages=tuple(messages))

    def step(self, action_text: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("no episode is running: call reset() first")
        self._turn += 1
        last = self._turn >= self.config.max_turns
        if isinstance(self._task, RepoTask):  # hidden tests run only once the episode ends
            grade = self._grade_repo_answer(self._task, action_text, self._files, scoring=False)
            if grade.tested and (grade.visible_passed or last):
                grade = self.run_repo_tests(self._task, self._files, grade.format_ok, grade.notes, scoring=True)
        elif isinstance(self._task, FunctionTask) and not last:  # hidden inputs only in the scoring run
            grade = self._grade_function(self._task, action_text, scoring=False)
            if grade.visible_passed:
                grade = self.grade(self._task, action_text)
        else:
            grade = self.grade(self._task, action_text)
        info = {"turn": self._turn, **grade.info()}
        if grade.visible_passed or self._turn >= self.config.max_turns:
            self._done = True
            return StepResult(observation=None, reward=grade.reward(self.config.format_weight), done=True, info=info)
        feedback = Message(role="user", content=_sanitize(self._feedback(grade)))
        return StepResult(observation=Observation(messages=(feedback,)), reward=0.0, done=False, info=info)

    # -- grading -----------------------------------------------------------------------------

    def grade(self, task: CodingTask, action_text: str) -> Grade:
        """Grade one answer on its own (for a repository task: applied to the initial files)."""
        if isinstance(task, RepoTask):
            return self._grade_repo_answer(task, action_text, dict(task.files))
        if isinstance(task, CheckTask):
            return self._grade_check_answer(task, action_text)
        return self._grade_function(task, action_text, scoring=True)

    def _grade_function(self, task: FunctionTask, action_text: str, *, scoring: bool) -> Grade:
        """Run the visible and (``scoring``) hidden cases; without ``scoring`` the hidden inputs
        never enter the sandbox (the feedback of a run cannot quote them) and the visible cases
        stand in for the scored ones."""
        code, format_ok = extract_code(action_text, task.entry_point)
        cases = task.visible + task.hidden if scoring else task.visible
        if code is None:
            return self._untested(task, "No code block found.", format_ok)
        load_error, results, res = self.call(code, task.entry_point, [(c.args, {}) for c in cases])
        outcomes = []
        for case, result in zip(cases, results):
            call = f"{task.entry_point}({', '.join(_show(a) for a in case.args)})"
            if not result.ok:
                detail = f"{call} raised {result.error}" if result.raised else f"{call}: {result.error}"
                outcomes.append(Outcome(call, False, detail))
            else:
                passed = typed_equal(result.value, case.expected, task.rel_tol, task.abs_tol)
                outcomes.append(Outcome(call, passed, f"{call} == {_show(case.expected)}, got {_show(result.value)}"))
        n = len(task.visible)
        notes = (f"Your code failed to load: {load_error}",) if load_error else ()
        return Grade(tuple(outcomes[:n]), tuple(outcomes[n:] if scoring else outcomes), format_ok, notes,
                     load_error is None, res)

    def call(self, code: str, entry_point: str, calls: list[tuple[tuple, dict]],
             max_out_chars: int = 2_000) -> tuple[str | None, list[CallResult], SandboxResult]:
        """Run ``entry_point(*args, **kwargs)`` of ``code`` for each call, in one sandbox run:
        ``(load_error, one CallResult per call, the sandbox result)``. Return values come back
        typed (:mod:`hetrl.envs.typed`); an error is ``"Type: message"``, or says why no result
        came (the code did not load, the sandbox killed the run)."""
        nonce = secrets.token_hex(8)
        spec = {"nonce": nonce, "module": SOLUTION_MODULE, "entry": entry_point,
                "calls": [typed.encode(c) for c in calls], **self._test_limits(),
                "max_out_chars": max_out_chars}
        res = self.sandbox.run(FUNCTION_HARNESS, stdin=json.dumps(spec),
                               files={f"{SOLUTION_MODULE}.py": code, TYPED_MODULE[0]: TYPED_MODULE[1]})
        records = _records(res.stdout, nonce)
        load_error = next((str(r["load_error"]) for r in records if "load_error" in r), None)
        by_index = {r["i"]: r for r in records if type(r.get("i")) is int}
        missing = load_error or (f"no result (sandbox: {res.killed_reason})" if res.killed_reason else "no result")
        results = []
        for i in range(len(calls)):
            record = by_index.get(i)
            if record is None:
                results.append(CallResult(False, error=missing))
            elif "error" in record:
                results.append(CallResult(False, error=_show(str(record["error"]), 300), raised=True))
            else:
                try:
                    results.append(CallResult(True, typed.decode(record.get("out"))))
                except typed.TypedError as exc:
                    results.append(CallResult(False, error=f"returned a malformed value ({exc})"))
        return load_error, results, res

    def _grade_check_answer(self, task: CheckTask, action_text: str) -> Grade:
        """Run the task's trusted ``check(candidate)`` here, the candidate's calls in the sandbox."""
        code, format_ok = extract_code(action_text, task.entry_point)
        if code is None:
            return self._untested(task, "No code block found.", format_ok)
        solution = f"{task.context}\n\n{code}" if task.context else code
        sandbox_runs: list[SandboxResult] = []
        load_errors: list[str] = []

        def call(batch):
            load_error, results, res = self.call(solution, task.entry_point, list(batch), max_out_chars=1 << 16)
            sandbox_runs.append(res)
            if load_error:
                load_errors.append(load_error)
                return load_error
            return results

        result = run_check(compile_check(task.context, task.test, f"task {task.task_id}"), task.entry_point, call)
        if load_errors:  # its message could quote the hidden calls: a syntax error found here, else the type only
            try:
                ast.parse(solution)
                notes: tuple[str, ...] = (f"Your code failed to load ({load_errors[0].split(':', 1)[0]}).",)
            except SyntaxError as err:
                notes = (f"Your code failed to load: SyntaxError (line {err.lineno}: {err.msg})",)
        else:
            notes = () if result.passed else (f"Your code failed the tests ({result.error}).",)
        outcome = (Outcome("check", result.passed, notes[0] if notes else ""),)
        return Grade(outcome, outcome, format_ok, notes, not load_errors,
                     sandbox_runs[-1] if sandbox_runs else None)

    def _untested(self, task: CodingTask, note: str, format_ok: bool) -> Grade:
        if isinstance(task, CheckTask):
            visible = scored = (Outcome("check", False),)
        elif isinstance(task, FunctionTask):
            visible = tuple(Outcome(f"case {i}", False) for i in range(len(task.visible)))
            scored = tuple(Outcome(f"case {i}", False) for i in range(len(task.hidden)))
        else:
            visible = tuple(Outcome(t, False) for p in sorted(task.tests) for t in self._ids(task, p))
            scored = tuple(Outcome(t, False) for p in task.test_paths for t in self._ids(task, p))
        return Grade(visible, scored, format_ok, (note,), False, None)

    @staticmethod
    def _ids(task: RepoTask, path: str) -> tuple[str, ...]:
        return unittest_ids(path, {**task.tests, **task.hidden_tests}[path])

    def _grade_repo_answer(self, task: RepoTask, action_text: str, state: dict[str, str], *,
                           scoring: bool = True) -> Grade:
        """Apply the answer's files to ``state`` (in place; test paths refused) and run the tests:
        with ``scoring``, every test file (hidden ones staged only now) with canaries; else the
        visible ones only (feedback)."""
        edits, problems = extract_files(action_text)
        refused = sorted(p for p in edits if p in task.tests or p in task.hidden_tests)
        if refused:
            problems.append(f"Edits to test files ignored: {', '.join(refused)}")
        state.update({p: t for p, t in edits.items() if p not in refused})
        format_ok = bool(edits) and not problems
        if not edits:
            return self._untested(task, "; ".join(problems) or "No file blocks found.", format_ok)
        return self.run_repo_tests(task, state, format_ok, tuple(problems), scoring=scoring)

    def run_repo_tests(self, task: RepoTask, state: dict[str, str], format_ok: bool, notes: tuple[str, ...], *,
                        scoring: bool) -> Grade:
        """Run the task's tests on ``state`` (see :meth:`_grade_repo_answer`). The test sources
        reach the harness from the task's pristine copy over stdin (visible ones are also on disk,
        as the policy saw them; hidden ones never are). When scoring, each file gets a canary
        test class that must fail: a canary reported passing or missing while its file's tests
        reported means the candidate tampered with the runner (:attr:`Grade.tampered`, reward 0)."""
        paths = task.test_paths if scoring else tuple(sorted(task.tests))
        sources = {**task.tests, **task.hidden_tests}
        canaries = {p: _canary_ids(p) for p in paths} if scoring else {}
        tests = {p: sources[p] + (_canary_source(*canaries[p]) if scoring else "") for p in paths}
        nonce = secrets.token_hex(8)
        spec = {"nonce": nonce, "tests": tests, **self._test_limits()}
        res = self.sandbox.run(UNITTEST_HARNESS, stdin=json.dumps(spec), files={**state, **task.tests})
        records = _records(res.stdout, nonce)
        by_id = {r["id"]: r for r in records if isinstance(r.get("id"), str)}
        file_errors = {r["file"]: str(r.get("message", "")) for r in records if isinstance(r.get("file"), str)}
        fallback = f"no result (sandbox: {res.killed_reason})" if res.killed_reason else "no result"
        outcomes: dict[str, Outcome] = {}
        for path in paths:
            for test_id in self._ids(task, path):
                record = by_id.get(test_id)
                if record is None:
                    why = f"test file failed to load: {file_errors[path]}" if path in file_errors else fallback
                    outcomes[test_id] = Outcome(test_id, False, why)
                else:
                    status = record.get("status")
                    message = str(record.get("message", ""))
                    outcomes[test_id] = Outcome(test_id, status == "pass", f"{str(status).upper()}: {message}")
        tampered = None
        for path, (class_name, methods) in canaries.items():
            reported = any(t in by_id for t in self._ids(task, path))
            for method in methods:
                record = by_id.get(f"{path[:-3].replace('/', '.')}.{class_name}.{method}")
                if (record is None and reported) or (record is not None and record.get("status") not in ("fail", "error")):
                    tampered = f"a canary test of {path} that must fail was reported {record and record.get('status')}"
        visible_ids = [t for p in sorted(task.tests) for t in self._ids(task, p)]
        return Grade(tuple(outcomes[t] for t in visible_ids), tuple(outcomes.values()), format_ok,
                     notes, True, res, tampered)

    def _feedback(self, grade: Grade) -> str:
        """The next user message: what failed on the visible tests, compactly."""
        failed = [o for o in grade.visible if not o.passed]
        lines = [note[:300] for note in grade.notes]
        if grade.tested and failed and not isinstance(self._task, CheckTask):  # check tasks: the notes
            lines.append(f"Failed {len(failed)}/{len(grade.visible)}:")
            for o in failed[: self.config.max_failures_shown]:
                if isinstance(self._task, RepoTask):
                    lines.append(o.name)
                    lines.append("  " + o.detail.replace("\n", "\n  ")[:400])
                else:
                    lines.append(o.detail)
            if len(failed) > self.config.max_failures_shown:
                lines.append(f"... and {len(failed) - self.config.max_failures_shown} more")
        lines.append("Fix the code.")
        text = "\n".join(lines)
        limit = self.config.max_feedback_chars
        return text if len(text) <= limit else text[: limit - 3] + "..."
