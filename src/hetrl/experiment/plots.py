"""The report's PNG figures (matplotlib, Agg backend: no display needed).

* :func:`curves`: one metric over steps per arm: the mean over the arm's runs at every step all
  of them logged, with the band from their minimum to their maximum;
* :func:`interval_bars`: one estimate per arm with its 95% interval as error bars;
* :func:`mixture_scatter`: per random fleet, its uncorrected mean KL against the final held-out
  success uncorrected and corrected, the two joined by a line;
* :func:`half_widths`: a 95% interval's half-width against the seeds per arm, a line per held-out
  episode count, with the margins to resolve as horizontal lines.
"""

from __future__ import annotations

import math
import pathlib
from typing import Mapping, Sequence

import numpy as np

from hetrl.experiment.measures import Records, series
from hetrl.experiment.statistics import Estimate

__all__ = ["curves", "interval_bars", "mixture_scatter", "half_widths"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, path: pathlib.Path, title: str) -> pathlib.Path:
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def curves(path: pathlib.Path, title: str, ylabel: str, runs_by_arm: Mapping[str, Sequence[Records]], key: str,
           *, log: bool = False) -> pathlib.Path:
    """``key`` over steps per arm: mean line and min–max band over the arm's runs (module docstring)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    positive = False  # a log axis needs a positive value
    for arm, runs in runs_by_arm.items():
        per_run = [dict(zip(*series(records, key))) for records in runs]
        steps = sorted(set.intersection(*(set(r) for r in per_run))) if per_run else []
        if not steps:
            continue
        table = np.asarray([[r[s] for s in steps] for r in per_run])
        line, = ax.plot(steps, table.mean(axis=0), marker="." if len(steps) < 30 else None, label=f"{arm} (n={len(runs)})")
        ax.fill_between(steps, table.min(axis=0), table.max(axis=0), color=line.get_color(), alpha=0.2)
        positive = positive or bool((table > 0).any())
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log and positive:
        ax.set_yscale("log")
    return _save(fig, ax, path, title)


def interval_bars(path: pathlib.Path, title: str, ylabel: str, estimates: Mapping[str, Estimate]) -> pathlib.Path:
    """A bar per arm at its estimate, error bars over its interval (none where there is none)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(estimates) + 2.0), 4))
    names = list(estimates)
    values = np.asarray([estimates[n].value for n in names])
    errors = np.asarray([[e.value - e.lo, e.hi - e.value] if e.has_interval else [0.0, 0.0]
                         for e in estimates.values()]).reshape(-1, 2).T
    ax.bar(range(len(names)), np.nan_to_num(values), yerr=errors, capsize=4, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    return _save(fig, ax, path, title)


def mixture_scatter(path: pathlib.Path, points: Sequence[tuple[str, float, float, float]]) -> pathlib.Path:
    """``points``: ``(fleet label, uncorrected mean KL k3, uncorrected final success, corrected
    final success)`` per fleet."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = [p for p in points if math.isfinite(p[1]) and p[1] > 0]
    for i, (label, k3, uncorrected, corrected) in enumerate(shown):
        ax.plot([k3, k3], [uncorrected, corrected], color="0.6", linewidth=1)
        ax.annotate(label, (k3, max(uncorrected, corrected)), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.scatter([k3], [uncorrected], marker="x", color="tab:red", label="uncorrected" if i == 0 else None)
        ax.scatter([k3], [corrected], marker="o", color="tab:green", label="corrected" if i == 0 else None)
    if shown:
        ax.set_xscale("log")
    ax.set_xlabel("mean KL k3 of the uncorrected run")
    ax.set_ylabel("final held-out success")
    return _save(fig, ax, path, "any mixture: random fleets")


def half_widths(path: pathlib.Path, title: str, lines: Mapping[str, tuple[Sequence[int], Sequence[float]]],
                levels: Mapping[str, float]) -> pathlib.Path:
    """``lines``: label -> ``(seeds, half-widths)``; ``levels``: label -> a half-width to reach,
    drawn as a dashed horizontal line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (seeds, widths) in lines.items():
        ax.plot(seeds, widths, marker=".", label=label)
    for label, level in levels.items():
        ax.axhline(level, color="0.5", linestyle="--", linewidth=1)
        ax.annotate(label, (ax.get_xlim()[1], level), fontsize=7, ha="right", va="bottom")
    ax.set_xlabel("seeds per arm")
    ax.set_ylabel("95% CI half-width (Welch difference)")
    ax.set_yscale("log")
    return _save(fig, ax, path, title)
