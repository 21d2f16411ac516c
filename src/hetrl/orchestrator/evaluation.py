"""Held-out evaluation: one full episode per task with a given sampler.

For tasks ``T_1..T_n`` each episode is played to the end by :meth:`EpisodeRunner.run_group`
(the environment's multi-turn loop, later turns on the same sampler), and

    success = (1/n) Σ_i [all hidden tests of T_i pass on the final answer]
    reward  = (1/n) Σ_i R_i                      (the environment's reward)

also per tier (``success/tier<k>``) when tasks carry one. Episodes whose environment failed, and
tasks whose prompt does not fit the model with room for the generation (not generated from,
:meth:`EpisodeRunner.fits`), count as unsolved with reward 0, so the denominator is always ``n``.

:func:`pass_at_k` is the unbiased estimator of pass@k (Chen et al. 2021, *Evaluating Large
Language Models Trained on Code*): with ``n`` episodes of a task of which ``c`` solved it,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - Π_{i = n - c + 1}^{n} (1 - k / i)     (k <= n)

the probability that ``k`` episodes drawn without replacement from the ``n`` hold a solved one.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from hetrl.core.schema import SamplingParams
from hetrl.envs.base import Task
from hetrl.orchestrator.episodes import EpisodeRunner
from hetrl.samplers.base import Sampler
from hetrl.stopping import Stopped

__all__ = ["evaluate_tasks", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``c`` of ``n`` episodes solved (module docstring);
    ValueError unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def evaluate_tasks(runner: EpisodeRunner, sampler: Sampler, tasks: Sequence[Task], sampling: SamplingParams,
                   *, prefix: str = "eval", batch: int = 16, episodes: list[dict] | None = None,
                   stop: Callable[[], bool] | None = None,
                   progress: Callable[[int, int], None] | None = None, workers: int = 1) -> dict[str, float]:
    """``{"success", "reward", "tasks", "success/tier<k>"...}`` of ``tasks`` (see the module
    docstring); first turns are generated ``batch`` tasks per call. ``episodes``, if given, gets
    one record per episode: ``task_id``, ``prompt`` and ``completion`` (decoded text; the
    completion holds every turn, environment feedback included), ``reward``, ``success``. Raises
    :class:`~hetrl.stopping.Stopped` between batches once ``stop()`` is true. ``progress(done,
    total)`` is called before the first batch and after each (episodes finished of ``len(tasks)``).
    ``workers``: episodes of a batch played at once after their first turn (their sandboxes run in
    parallel; later turns' generation calls take turns on the sampler)."""
    lock = threading.Lock()

    def continue_fn(requests):
        with lock:
            return sampler.generate(requests)

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
        playable = [i for i, p in enumerate(prompts) if runner.fits(p)]
        requests = [runner.requests(f"{prefix}-{start + i}", prompts[i], 1, sampling)[0] for i in playable]
        firsts = dict(zip(playable, sampler.generate(requests) if requests else []))

        def play(i: int):
            return runner.run_group(f"{prefix}-{start + i}", chunk[i], prompts[i], [firsts[i]], sampling, continue_fn)

        with ThreadPoolExecutor(max(1, workers)) as pool:
            outs = dict(zip(playable, pool.map(play, playable)))
        for i, (task, prompt) in enumerate(zip(chunk, prompts)):
            out = outs.get(i)
            solved.append(bool(out is not None and out.solved and out.solved[0]))
            rewards.append(float(out.rollouts[0].reward) if out is not None and out.rollouts else 0.0)
            tiers.append(getattr(task, "tier", None))
            if episodes is not None:
                response = (out.rollouts[0].response_ids.tolist() if out is not None and out.rollouts
                            else firsts[i].token_ids.tolist() if i in firsts else [])
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
