"""Run outputs: metrics JSON lines and TensorBoard events, the rich live display, PNG plots and the
final summary."""

from __future__ import annotations

import json
import math
import numbers
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from hetrl.orchestrator.tb_events import EventFileWriter

__all__ = ["MetricsWriter", "LiveDisplay", "write_plots", "summary_lines"]


def _plain(value: Any) -> Any:
    """Numpy scalars and arrays (``np.float32``, ``np.int64``, ``np.bool_``, ...) as plain Python
    numbers, bools and lists, also inside lists, tuples and maps."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _clean(value: Any) -> Any:
    """JSON-safe plain data (:func:`_plain`): non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends one JSON object per record to ``path`` (created with its parents) and, with
    ``tensorboard_dir``, one TensorBoard event per record to a new event file there
    (:mod:`hetrl.orchestrator.tb_events`): every numeric entry but ``step`` as a scalar at the
    record's ``step``."""

    def __init__(self, path: str | pathlib.Path, tensorboard_dir: str | pathlib.Path | None = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._events = EventFileWriter(tensorboard_dir) if tensorboard_dir is not None else None

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record``; numpy values are written as plain numbers (lists for arrays) and
        non-finite floats as ``null`` in the JSON line (TensorBoard keeps them)."""
        plain = _plain(record)
        self._file.write(json.dumps(_clean(plain), sort_keys=True) + "\n")
        self._file.flush()
        if self._events is not None:
            scalars = {k: float(v) for k, v in plain.items()
                       if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}
            self._events.add_scalars(int(plain["step"]), scalars)

    def close(self) -> None:
        self._file.close()
        if self._events is not None:
            self._events.close()


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


class LiveDisplay:
    """A rich live view: a headline table (step, reward, held-out, KL k3, masked fraction,
    tokens/s, staleness) and one row per pool. A no-op when ``enabled`` is False."""

    def __init__(self, total_steps: int, enabled: bool, console: Console | None = None):
        self.total = total_steps
        self.enabled = enabled
        self._live = Live(console=console or Console(), refresh_per_second=4, transient=False) if enabled else None

    def __enter__(self) -> "LiveDisplay":
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, record: Mapping[str, Any], pools: Sequence[Mapping[str, Any]]) -> None:
        if self._live is None:
            return
        head = Table(title=f"hetrl: step {record['step']}/{self.total}", show_header=True)
        cols = [("reward", "reward/mean"), ("solved", "rollout/solved"), ("held-out", "eval/success"),
                ("KL k3", "mismatch/k3"), ("masked", "mismatch/masked_frac/any"), ("gen tok/s", "throughput/gen_tokens_per_s"),
                ("train tok/s", "throughput/trained_tokens_per_s"), ("stale mean", "staleness/mean"),
                ("stale max", "staleness/max"), ("step s", "time/step_s")]
        for name, _ in cols:
            head.add_column(name, justify="right")
        head.add_row(*[_fmt(record.get(key)) for _, key in cols])
        table = Table(title="pools", show_header=True)
        for name in ("pool", "numerics", "alive", "w-ver", "requests", "tokens", "trained", "dropped",
                     "max stale", "k3", "cost $"):
            table.add_column(name, justify="right")
        for p in pools:
            table.add_row(p["pool"], p["numerics"], str(p["alive"]), str(p["weight_version"]), str(p["requests"]),
                          str(p["tokens"]), str(p["trained"]), str(p["dropped"]), str(p["max_staleness"]),
                          _fmt(p["k3"], ".2e"), _fmt(p["cost_usd"], ".4f"))
        self._live.update(Group(head, table))


def write_plots(history: Sequence[Mapping[str, Any]], pool_names: Sequence[str], directory: str | pathlib.Path) -> list[pathlib.Path]:
    """``reward.png``, ``heldout.png`` and ``mismatch.png`` (per-pool KL k3) over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in history]

    def series(key: str) -> tuple[list[int], list[float]]:
        # a mismatch metric of a step whose batch held no token of that pool is an empty mean, not a 0
        count = key.rsplit("/", 1)[0] + "/num_tokens" if "/mismatch/" in f"/{key}" else None
        pts = [(r["step"], r[key]) for r in history
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and (count is None or r.get(count, 1) > 0)]
        return [p[0] for p in pts], [p[1] for p in pts]

    out = []
    specs = [
        ("reward.png", "reward", [("reward/mean", "mean reward"), ("rollout/solved", "solved fraction")]),
        ("heldout.png", "held-out", [("eval/success", "success rate"), ("eval/reward", "mean reward")]),
        ("mismatch.png", "KL k3 (sampler vs trainer)",
         [("mismatch/k3", "all")] + [(f"pool/{p}/mismatch/k3", p) for p in pool_names]),
    ]
    for filename, title, lines in specs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in lines:
            xs, ys = series(key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        first, last = min(steps, default=0), max(steps, default=0)
        ax.set_xlim(first, max(last, first + 1))  # also when nothing was plotted (a single step, no evaluation)
        if filename == "mismatch.png":
            ax.set_yscale("log")
        if ax.get_legend_handles_labels()[0]:  # e.g. no held-out evaluation ran: nothing to label
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out


def summary_lines(history: Sequence[Mapping[str, Any]], final: Mapping[str, Any]) -> list[str]:
    """A few lines: steps, wall time, reward first/last, held-out, mismatch, staleness, buffer."""
    if not history:
        return ["no training step completed"]
    steps = [r for r in history if "reward/mean" in r] or list(history)  # without the step-0 evaluation
    first, last = steps[0], steps[-1]
    evals = [r for r in history if "eval/success" in r]
    held = (f"start {_fmt(evals[0]['eval/success'])} (step {evals[0]['step']})  end {_fmt(evals[-1]['eval/success'])} "
            f"(step {evals[-1]['step']})" if evals else "-")
    lines = [
        f"steps: {last['step']}  wall: {final['wall_s']:.1f}s  trainer version: {final['version']}",
        f"reward: first {_fmt(first.get('reward/mean'))}  last {_fmt(last.get('reward/mean'))}",
        f"held-out success: {held} ({len(evals)} evaluations)",
        f"KL k3: last {_fmt(last.get('mismatch/k3'), '.2e')}  staleness max over run: {final['max_staleness']}",
        f"groups: trained {final['groups_trained']}  dropped {final['groups_dropped']}  "
        f"rejected rollouts {final['rollouts_rejected']}  requeued jobs {final['requeues']}",
        f"outputs: {final['output_dir']}",
    ]
    return lines
