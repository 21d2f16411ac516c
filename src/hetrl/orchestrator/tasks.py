"""The task source of the loop: train tasks in passes over the suite's train functions.

Pass ``e`` visits every train function once, in a fresh random order drawn from the run's
generator, with the examples and hidden tests of :meth:`SyntheticSuite.train_pass` ``(e)`` (task
ids suffixed ``@<e>`` for ``e >= 1``). Memory stays flat over passes: the source holds the tasks
of the current pass and their prompt ids only; a task of another pass (a group submitted again,
or in flight at the checkpoint a run resumes from) is rebuilt from its id (:meth:`resolve`;
the last such pass is kept). Fixed task sets (:class:`~hetrl.envs.task_files.TaskSplits`, of
``environment.name: coding``) have the same tasks, under the same ids, in every pass. The
source's position (:meth:`TaskSource.state`: the generator, the rest of the pass's order) is
saved beside each checkpoint in ``loop-<step>.json``, the same for either trainer. One reader on
the driver draws a task at a time, so a data pipeline (Grain: per-process shards, read-ahead
threads) has nothing to do here; its per-element index shuffle also cost about 5 ms a task
(grain 0.2.18, measured on this machine), against microseconds for a permutation.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np

from hetrl.envs.base import Task
from hetrl.envs.task_files import TaskSplits
from hetrl.envs.tasks_synthetic import SyntheticSuite
from hetrl.errors import UserError

__all__ = ["TaskSource", "NoTaskFits"]

log = logging.getLogger(__name__)


class NoTaskFits(UserError):
    """No train task of a whole pass has a prompt that fits the model with room for the generation."""


def _pass_of(task_id: str) -> tuple[str, int]:
    """``(base id, pass)`` of a train task id (``<base>@<e>`` for pass ``e >= 1``)."""
    base, sep, suffix = task_id.rpartition("@")
    return (base, int(suffix)) if sep and suffix.isdigit() else (task_id, 0)


class TaskSource:
    """Train tasks of ``suite`` in passes (see the module docstring), the order drawn from
    ``rng``; ``prompt_ids(task)`` tokenizes a task's prompt (cached per current-pass task);
    tasks whose prompt does not pass ``fits`` are skipped."""

    def __init__(self, suite: SyntheticSuite | TaskSplits, rng: np.random.Generator, prompt_ids: Callable[[Task], np.ndarray],
                 fits: Callable[[np.ndarray], bool] = lambda prompt: True):
        self.suite, self._rng, self._prompt_ids, self._fits = suite, rng, prompt_ids, fits
        self.overlong: set[str] = set()
        """Ids of the tasks skipped so far because their prompt does not fit (base ids, without the pass)."""
        self._order: list[int] = []
        self.passes = 0
        """Passes started so far (the current one is ``passes - 1``)."""
        self._pass: tuple[Task, ...] = ()
        self._current: dict[str, Task] = {}
        self._prompts: dict[str, np.ndarray] = {}
        self._other: tuple[int, dict[str, Task]] = (-1, {})  # the last other pass rebuilt by resolve

    def next(self) -> Task:
        """The next train task whose prompt fits (a new pass starts when the current one is used up)."""
        for _ in range(2 * len(self.suite.train) + 1):  # every task of a whole pass at least once
            if not self._order:
                self._order = [int(i) for i in self._rng.permutation(len(self.suite.train))]
                self._start_pass(self.passes)
                self.passes += 1
            task = self._pass[self._order.pop(0)]
            prompt = self.prompt(task)
            if self._fits(prompt):
                return task
            base = _pass_of(task.task_id)[0]
            if base not in self.overlong:
                self.overlong.add(base)
                log.warning("train task %s skipped: its prompt (%d tokens) leaves no room for the generation "
                            "(async.max_new_tokens) within the model's positions", base, prompt.shape[0])
        raise NoTaskFits(f"no train task's prompt fits the model with room for async.max_new_tokens "
                         f"({len(self.overlong)} tasks skipped); lower async.max_new_tokens, use a model with more "
                         f"positions or tasks with shorter prompts")

    def resolve(self, task_id: str) -> Task:
        """The train task ``task_id`` of any pass. Raises KeyError for an id no pass has."""
        if task_id in self._current:
            return self._current[task_id]
        epoch = _pass_of(task_id)[1]
        if self._other[0] != epoch:
            self._other = (epoch, {t.task_id: t for t in self.suite.train_pass(epoch)})
        return self._other[1][task_id]

    def prompt(self, task: Task) -> np.ndarray:
        """The prompt ids of ``task`` (cached while its pass is the current one)."""
        if task.task_id in self._prompts:
            return self._prompts[task.task_id]
        ids = self._prompt_ids(task)
        if task.task_id in self._current:
            self._prompts[task.task_id] = ids
        return ids

    def held(self) -> int:
        """Tasks and prompts held now (bounded by about three passes, whatever the run's length)."""
        return len(self._current) + len(self._prompts) + len(self._other[1])

    # ------------------------------------------------------------------ resume
    def state(self) -> dict[str, Any]:
        """What :meth:`restore` continues from: the generator, the current pass's remaining order, passes."""
        return {"rng": self._rng.bit_generator.state, "order": list(self._order), "passes": self.passes}

    def restore(self, state: Mapping[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._order = [int(i) for i in state["order"]]
        self.passes = int(state["passes"])
        if self.passes:
            self._start_pass(self.passes - 1)

    def _start_pass(self, epoch: int) -> None:
        self._pass = self.suite.train_pass(epoch)
        self._current = {t.task_id: t for t in self._pass}
        self._prompts = {}
