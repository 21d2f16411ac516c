"""Per-run values, each read from named keys of the run's ``metrics.jsonl`` by a stated rule.

``hetrl train`` writes one JSON object per line: the held-out evaluation before the first step
(``step: 0``, ``eval/*`` keys only), then one record per trainer step (``step`` 1..N, with
``mismatch/*``, ``grad_norm``, cumulative ``fleet/*`` counters, and ``eval/*`` on evaluation
steps). A *training step* below is a record with ``mismatch/k3``; the *last step* is the one
with the largest ``step``. Null (non-finite) values are skipped. A value a run cannot give (no
evaluation ran, a zero score) is NaN and counts as missing in every statistic.

:data:`MEASURES` lists every per-run value with its definition; the report prints them with the
definitions, so each aggregate traces back to a key of a file; :data:`RENTED` is reported too by
a grid whose cost analysis compares the rented-time cost, :data:`TIMING` by a grid with a power
analysis.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hetrl.experiment.statistics import ols_slope

__all__ = ["Records", "Measure", "MEASURES", "RENTED", "TIMING", "BY_NAME", "load_records", "series", "run_values"]

Records = list[dict[str, Any]]


def load_records(path: str | pathlib.Path) -> Records:
    """The JSON objects of a ``metrics.jsonl``, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def series(records: Records, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of every record with a finite ``key``."""
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return np.asarray([p[0] for p in pts], dtype=np.float64), np.asarray([p[1] for p in pts], dtype=np.float64)


def _first(records: Records, key: str) -> float:
    _, values = series(records, key)
    return float(values[0]) if values.size else math.nan


def _last(records: Records, key: str) -> float:
    steps, values = series(records, key)
    return float(values[np.argmax(steps)]) if values.size else math.nan


def _mean(records: Records, key: str) -> float:
    _, values = series(records, key)
    return float(values.mean()) if values.size else math.nan


def _slope(records: Records, key: str) -> float:
    return ols_slope(*series(records, key))


def _spikes(records: Records, factor: float) -> float:
    _, norms = series(records, "grad_norm")
    return float((norms > factor * np.median(norms)).sum()) if norms.size else math.nan


def _per_point(records: Records) -> float:
    score = _last(records, "eval/success")
    return _last(records, "fleet/cost/usd") / (100.0 * score) if score > 0 else math.nan


@dataclass(frozen=True)
class Measure:
    """A per-run value: ``name`` (a column of the report's per-run table), ``label`` (its
    heading), ``definition`` (Markdown: the keys and the rule), ``fmt`` (a format spec) and
    ``compute(records, grad_spike_factor)``."""

    name: str
    label: str
    definition: str
    fmt: str
    compute: Callable[[Records, float], float]

    def format(self, value: float) -> str:
        return format(value, self.fmt) if math.isfinite(value) else "n/a"


MEASURES: tuple[Measure, ...] = (
    Measure("heldout_start", "held-out start", "`eval/success` of the first evaluation (before step 1)", ".3f",
            lambda r, f: _first(r, "eval/success")),
    Measure("heldout_end", "held-out end", "`eval/success` of the last evaluation (the last step)", ".3f",
            lambda r, f: _last(r, "eval/success")),
    Measure("heldout_change", "held-out change", "heldout_end − heldout_start", "+.3f",
            lambda r, f: _last(r, "eval/success") - _first(r, "eval/success")),
    Measure("k3_mean", "mean KL k3", "mean of `mismatch/k3` over the training steps", ".3e",
            lambda r, f: _mean(r, "mismatch/k3")),
    Measure("k3_slope", "KL k3 slope / step", "least-squares slope of `mismatch/k3` on `step` over the training steps",
            "+.2e", lambda r, f: _slope(r, "mismatch/k3")),
    Measure("masked_frac", "masked token fraction", "mean of `mismatch/masked_frac/any` over the training steps",
            ".4f", lambda r, f: _mean(r, "mismatch/masked_frac/any")),
    Measure("grad_spikes", "grad-norm spikes",
            "number of training steps whose `grad_norm` exceeds `grad_spike_factor` x the run's median `grad_norm`",
            ".3g", _spikes),
    Measure("cost_usd", "fleet cost, USD", "`fleet/cost/usd` of the last step (cumulative)", ".4f",
            lambda r, f: _last(r, "fleet/cost/usd")),
    Measure("trained_tokens", "trained tokens", "`fleet/trained_tokens` of the last step (cumulative)", ".0f",
            lambda r, f: _last(r, "fleet/trained_tokens")),
    Measure("usd_per_mtok", "USD / M trained tokens", "10^6 x `fleet/cost/usd_per_trained_token` of the last step",
            ".4f", lambda r, f: 1e6 * _last(r, "fleet/cost/usd_per_trained_token")),
    Measure("usd_per_point", "USD / success point",
            "`fleet/cost/usd` of the last step / (100 x heldout_end): dollars per percentage point of final held-out "
            "success", ".5f", lambda r, f: _per_point(r)),
)
"""Every per-run value (module docstring)."""

RENTED = Measure("rented_usd_per_mtok", "rented USD / M trained tokens",
                 "10^6 x `fleet/cost/rented_usd_per_trained_token` of the last step (every replica's rented wall "
                 "time, idle included, x its price)", ".4f",
                 lambda r, f: 1e6 * _last(r, "fleet/cost/rented_usd_per_trained_token"))
"""The rented-time cost, a value of the grids whose cost analysis compares it (``clock: rented``)."""


def _eval_seconds(records: Records) -> float:
    steps, wall = series(records, "time/wall_s")
    if wall.size < 3:
        return math.nan
    increments = np.diff(wall)
    after = dict(zip(steps[1:], increments - np.median(increments)))  # step -> its extra increment
    evaluated = [r["step"] for r in records if "eval/success" in r and 0 < r["step"] < steps[-1]]
    picked = [after[step + 1] for step in evaluated if step + 1 in after]
    return float(np.mean(picked)) if picked else math.nan


def _wall_seconds(records: Records) -> float:
    steps, wall = series(records, "time/wall_s")
    if not wall.size:
        return math.nan
    evaluated_last = any("eval/success" in r and r["step"] == steps[-1] for r in records)
    return float(wall[-1]) + (_eval_seconds(records) if evaluated_last else 0.0)


TIMING: tuple[Measure, ...] = (
    Measure("eval_s", "seconds per evaluation",
            "mean, over the evaluations after step 0 and before the last step, of the next step's `time/wall_s` "
            "increment less the run's median increment (a step's record is stamped before its evaluation runs, so the "
            "evaluation delays the next one)", ".1f", lambda r, f: _eval_seconds(r)),
    Measure("wall_s", "run wall time, s", "`time/wall_s` of the last step (the run's clock, start-up included) plus "
            "eval_s for the evaluation that follows it (unknown with eval_s)", ".0f", lambda r, f: _wall_seconds(r)),
    Measure("evaluations", "evaluations", "number of records with `eval/success` (step 0 included)", ".0f",
            lambda r, f: float(len(series(r, "eval/success")[0]))),
    Measure("eval_episodes", "held-out episodes", "`eval/tasks` of the last evaluation (episodes it scored)", ".0f",
            lambda r, f: _last(r, "eval/tasks")),
)
"""A run's time and its evaluations' share, the values of a grid with a power analysis (its cost model)."""

BY_NAME = {m.name: m for m in (*MEASURES, RENTED, *TIMING)}


def run_values(records: Records, grad_spike_factor: float, measures: tuple[Measure, ...] = MEASURES) -> dict[str, float]:
    """Every value of ``measures`` (default :data:`MEASURES`) of one run."""
    return {m.name: m.compute(records, grad_spike_factor) for m in measures}
