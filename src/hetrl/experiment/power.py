"""Power analysis: how many seeds and held-out episodes a grid needs to resolve a score margin.

A pilot grid gives, per arm, the final held-out success of each of its runs. Their spread within
arms, pooled over the arms (:func:`pooled_sd`), is what a comparison of two arms scales:

* pooled sd ``σ = √(Σ_a Σ_i (x_ai − x̄_a)² / Σ_a (n_a − 1))`` over the arms' runs (an arm
  with fewer than two runs adds nothing);
* the Welch 95% interval of a difference of two arms of ``n`` runs each, both of spread ``σ``,
  has half-width ``h(n) = t_{2n−2, 0.975} · σ · √(2/n)`` (:func:`half_width`); the smallest
  ``n >= 2`` with ``h(n) <= m`` resolves a margin ``m`` (:func:`seeds_for_margin`): an interval
  that narrow lies on one side of ``−m`` unless the true difference is within ``h`` of it. A test
  with two thresholds, the *worse (margin m)* rule (agrees below 0, disagrees at or above ``−m``),
  is undecided only while its interval holds both ``0`` and ``−m``; at ``h(n) <= m/2``
  (:data:`DECISIVE`) it decides whatever the difference;
* held-out noise: a success rate over ``E`` independent episodes has binomial variance
  ``p(1−p)/E`` (:func:`eval_variance`), so of the pilot's ``σ²`` at ``E₀`` episodes the part
  ``σ_e² = min(σ², p(1−p)/E₀)`` is held-out noise and ``σ² − σ_e²`` the seed-to-seed (training)
  spread that more episodes do not remove. With ``E`` episodes (:func:`projected_sd`):
  ``σ(E)² = σ² − σ_e² + σ_e²·E₀/E``;
* cost (:func:`run_seconds`): a run's wall time is its training time plus its evaluations', and
  an evaluation's time grows with its episodes: ``T(E) = T₀ + k·e·(E/E₀ − 1)`` with ``T₀`` the
  pilot's mean run time, ``k`` evaluations per run and ``e`` the pilot's seconds per evaluation.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
from scipy import stats as _scipy_stats

from hetrl.experiment.statistics import LEVEL

__all__ = ["MAX_SEEDS", "DECISIVE", "pooled_sd", "half_width", "seeds_for_margin", "eval_variance", "projected_sd", "run_seconds"]

MAX_SEEDS = 1000
"""The largest seed count :func:`seeds_for_margin` searches."""

DECISIVE = 0.5
"""The share of a margin ``m`` a half-width must stay under for the *worse (margin m)* rule to decide
whatever the difference (module docstring): an interval narrower than ``m`` cannot hold both 0 and ``−m``."""


def pooled_sd(groups: Iterable[Sequence[float]]) -> tuple[float, int]:
    """``(σ, degrees of freedom)``: the within-group spread pooled over ``groups`` (NaN values
    dropped); ``(nan, 0)`` when no group has two values."""
    squares, dof = 0.0, 0
    for group in groups:
        x = np.asarray(group, dtype=np.float64)
        x = x[np.isfinite(x)]
        if x.size >= 2:
            squares += float(((x - x.mean()) ** 2).sum())
            dof += int(x.size) - 1
    return (math.sqrt(squares / dof), dof) if dof else (math.nan, 0)


def half_width(sd: float, n: int, level: float = LEVEL) -> float:
    """``t_{2n−2, (1+level)/2} · sd · √(2/n)``: the half-width of the Welch interval of a
    difference of two arms of ``n`` runs, each of spread ``sd``."""
    if n < 2:
        return math.inf
    return float(_scipy_stats.t.ppf((1.0 + level) / 2.0, 2 * n - 2)) * sd * math.sqrt(2.0 / n)


def seeds_for_margin(sd: float, margin: float, level: float = LEVEL) -> int | None:
    """The smallest ``n >= 2`` with ``half_width(sd, n) <= margin``; None above :data:`MAX_SEEDS`
    (or without a finite ``sd``)."""
    if not math.isfinite(sd) or margin <= 0.0:
        return None
    for n in range(2, MAX_SEEDS + 1):
        if half_width(sd, n, level) <= margin:
            return n
    return None


def eval_variance(p: float, episodes: int) -> float:
    """``p(1−p)/E``: the binomial variance of a success rate ``p`` measured over ``E`` episodes."""
    return p * (1.0 - p) / episodes


def projected_sd(sd: float, p: float, pilot_episodes: int, episodes: int) -> float:
    """A run's spread with ``episodes`` held-out episodes per evaluation, from its spread ``sd``
    at ``pilot_episodes`` and the success rate ``p`` (module docstring)."""
    noise = min(sd * sd, eval_variance(p, pilot_episodes))
    return math.sqrt(sd * sd - noise + noise * pilot_episodes / episodes)


def run_seconds(pilot_seconds: float, evaluations: int, eval_seconds: float, pilot_episodes: int,
                episodes: int) -> float:
    """``T₀ + k·e·(E/E₀ − 1)``: a run's wall time with ``episodes`` held-out episodes (module docstring)."""
    return pilot_seconds + evaluations * eval_seconds * (episodes / pilot_episodes - 1.0)
