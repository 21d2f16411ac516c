"""Held-out evaluation: one full episode per task with a given sampler.

For tasks ``T_1..T_n`` each episode is played to the end by :meth:`EpisodeRunner.run_group`
(the environment's multi-turn loop, later turns on the same sampler), and

    success = (1/n) Σ_i [all hidden tests of T_i pass on the final answer]
    reward  = (1/n) Σ_i R_i                      (the environment's reward)

also per tier (``success/tier<k>``) when tasks carry one. Episodes whose environment failed
count as unsolved with reward 0, so the denominator is always ``n``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from hetrl.core.schema import SamplingParams
from hetrl.envs.base import Task
from hetrl.orchestrator.episodes import EpisodeRunner
from hetrl.samplers.base import Sampler
from hetrl.stopping import Stopped

__all__ = ["evaluate_tasks"]


def evaluate_tasks(runner: EpisodeRunner, sampler: Sampler, tasks: Sequence[Task], sampling: SamplingParams,
                   *, prefix: str = "eval", batch: int = 16, episodes: list[dict] | None = None,
                   stop: Callable[[], bool] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """``{"success", "reward", "tasks", "success/tier<k>"...}`` of ``tasks`` (see the module
    docstring); first turns are generated ``batch`` tasks per call. ``episodes``, if given, gets
    one record per episode: ``task_id``, ``prompt`` and ``completion`` (decoded text; the
    completion holds every turn, environment feedback included), ``reward``, ``success``. Raises
    :class:`~hetrl.stopping.Stopped` between batches once ``stop()`` is true. ``progress(done,
    total)`` is called before the first batch and after each (episodes finished of ``len(tasks)``)."""
    solved: list[bool] = []
    rewards: list[float] = []
    tiers: list[int | None] = []
    if progress is not None:
        progress(0, len(tasks))
    for start in range(0, len(tasks), batch):
        if stop is not None and stop():
            raise Stopped("an evaluation")
        chunk = tasks[start: start + batch]
        prompts = [runner.prompt_ids(t) for t in chunk]
        requests = [runner.requests(f"{prefix}-{start + i}", p, 1, sampling)[0] for i, p in enumerate(prompts)]
        for i, (task, prompt, first) in enumerate(zip(chunk, prompts, sampler.generate(requests))):
            out = runner.run_group(f"{prefix}-{start + i}", task, prompt, [first], sampling, sampler.generate)
            solved.append(bool(out.solved and out.solved[0]))
            rewards.append(float(out.rollouts[0].reward) if out.rollouts else 0.0)
            tiers.append(getattr(task, "tier", None))
            if episodes is not None:
                response = out.rollouts[0].response_ids.tolist() if out.rollouts else first.token_ids.tolist()
                episodes.append({"task_id": task.task_id, "prompt": runner.decode(prompt.tolist()),
                                 "completion": runner.decode(response), "reward": rewards[-1], "success": solved[-1]})
        if progress is not None:
            progress(len(solved), len(tasks))
    n = max(len(tasks), 1)
    scores = {"success": sum(solved) / n, "reward": sum(rewards) / n, "tasks": float(len(tasks))}
    for tier in sorted({t for t in tiers if t is not None}):
        picked = [s for s, t in zip(solved, tiers) if t == tier]
        scores[f"success/tier{tier}"] = float(np.mean(picked))
    return scores
