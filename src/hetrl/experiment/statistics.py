"""Statistics over seeds: means with t intervals, Welch differences, bootstrap ratios, OLS slopes.

The unit of replication is a run (one seed of one arm, or one random fleet): every interval is
over per-run values, never over the steps of one run, whose values are autocorrelated.

* :func:`t_interval`: ``x̄ ± t_{n-1, (1+γ)/2} · s/√n`` with ``s`` the sample standard deviation
  (``ddof = 1``) and ``γ`` the level; ``n < 2`` gives no interval (NaN bounds).
* :func:`welch_interval`: the difference of two independent means ``x̄_a − x̄_b`` ±
  ``t_{ν, (1+γ)/2} · √(s_a²/n_a + s_b²/n_b)`` with Welch–Satterthwaite degrees of freedom
  ``ν = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1))``.
* :func:`bootstrap_ratio`: the ratio of means ``R = x̄_a / x̄_b`` with a percentile-bootstrap
  interval: ``B`` times, resample each group with replacement (independently, same sizes),
  compute ``R* = x̄*_a / x̄*_b``; the bounds are the ``(1−γ)/2`` and ``(1+γ)/2`` quantiles of
  the ``R*`` (a fixed generator seed makes it reproducible). Each group needs ``n >= 2`` and
  positive values (mismatch and cost are), else there is no interval.
* :func:`ols_slope`: ``β = Σ(x−x̄)(y−ȳ) / Σ(x−x̄)²``, the least-squares trend of ``y`` over ``x``.

NaN inputs are dropped first (a run without the metric contributes nothing) and ``n`` counts
what is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats as _scipy_stats

__all__ = ["LEVEL", "Estimate", "t_interval", "welch_interval", "bootstrap_ratio", "ols_slope"]

LEVEL = 0.95
"""The confidence level of every interval in the report."""

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its interval ``[lo, hi]`` (NaN bounds: no interval), the number of
    runs ``n`` it rests on (for two-group statistics, the smaller group) and, for a mean, the
    sample standard deviation ``sd``."""

    value: float
    lo: float
    hi: float
    n: int
    sd: float = math.nan

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    def format(self, spec: str, *, sd: bool = False) -> str:
        """``value [lo, hi]`` (with ``± sd`` after the value if ``sd``) in format ``spec``;
        ``n/a`` without a value, ``(no CI)`` without an interval."""
        if not math.isfinite(self.value):
            return "n/a"
        text = format(self.value, spec)
        if sd and math.isfinite(self.sd):
            text += f" ± {format(self.sd, spec.lstrip('+'))}"
        if not self.has_interval:
            return f"{text} (no CI)"
        return f"{text} [{format(self.lo, spec)}, {format(self.hi, spec)}]"


def _clean(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return arr[np.isfinite(arr)]


def _t_quantile(df: float, level: float) -> float:
    return float(_scipy_stats.t.ppf((1.0 + level) / 2.0, df))


def t_interval(values: Sequence[float], level: float = LEVEL) -> Estimate:
    """Mean, sample sd and the t interval of ``values`` (module docstring); empty: all NaN."""
    x = _clean(values)
    n = int(x.size)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if n < 2:
        return Estimate(mean, math.nan, math.nan, n)
    sd = float(x.std(ddof=1))
    half = _t_quantile(n - 1, level) * sd / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n, sd)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Estimate:
    """``mean(a) − mean(b)`` with the Welch t interval (module docstring). Two groups of zero
    spread give a zero-width interval; a group with ``n < 2`` gives none."""
    xa, xb = _clean(a), _clean(b)
    n = min(xa.size, xb.size)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    diff = float(xa.mean() - xb.mean())
    if n < 2:
        return Estimate(diff, math.nan, math.nan, int(n))
    va, vb = xa.var(ddof=1) / xa.size, xb.var(ddof=1) / xb.size
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Estimate(diff, diff, diff, int(n))
    df = (va + vb) ** 2 / (va**2 / (xa.size - 1) + vb**2 / (xb.size - 1))
    half = _t_quantile(df, level) * se
    return Estimate(diff, diff - half, diff + half, int(n))


def bootstrap_ratio(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                    resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Estimate:
    """``mean(a) / mean(b)`` with its percentile-bootstrap interval over runs (module docstring)."""
    xa, xb = _clean(a), _clean(b)
    n = int(min(xa.size, xb.size))
    if n == 0 or xb.mean() <= 0.0:
        return Estimate(math.nan, math.nan, math.nan, n)
    ratio = float(xa.mean() / xb.mean())
    if n < 2 or (xa <= 0.0).any() or (xb <= 0.0).any():
        return Estimate(ratio, math.nan, math.nan, n)
    rng = np.random.default_rng(seed)
    mean_a = xa[rng.integers(0, xa.size, size=(resamples, xa.size))].mean(axis=1)
    mean_b = xb[rng.integers(0, xb.size, size=(resamples, xb.size))].mean(axis=1)
    lo, hi = np.quantile(mean_a / mean_b, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return Estimate(ratio, float(lo), float(hi), n)


def ols_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``y`` on ``x`` (pairs with a NaN dropped); NaN with fewer than two
    distinct ``x``."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[keep], ys[keep]
    if xs.size < 2:
        return math.nan
    dx = xs - xs.mean()
    denom = float((dx * dx).sum())
    return float((dx * (ys - ys.mean())).sum() / denom) if denom > 0.0 else math.nan
