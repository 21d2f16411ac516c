"""Run outputs the user reads: the console (:class:`RunConsole`: a live 80-column view on a
terminal, one plain line per step and phase otherwise), PNG plots and the final summary. Metric
records go to the monitors of :mod:`hetrl.orchestrator.monitors`."""

from __future__ import annotations

import math
import pathlib
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from rich import get_console
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hetrl.core.correction import pool_mismatch_key
from hetrl.formatting import fmt, fmt_duration

__all__ = ["fmt", "fmt_duration", "RunConsole", "write_plots", "summary_lines"]


_HEADLINE = (("reward", "reward/mean"), ("solved", "rollout/solved"), ("held-out", "eval/success"),
             ("KL k3", "mismatch/k3"), ("masked", "mismatch/masked_frac/any"),
             ("gen tok/s", "throughput/gen_tokens_per_s"), ("train tok/s", "throughput/trained_tokens_per_s"),
             ("stale", None), ("step s", "time/step_s"))
"""The headline figures: (label, record key); ``stale`` shows ``staleness/mean``/``staleness/max``."""

_POOL_COLUMNS = (("pool", "pool"), ("alive", "alive"), ("w-ver", "weight_version"), ("req", "requests"),
                 ("tokens", "tokens"), ("trained", "trained"), ("drop", "dropped"), ("stale", "max_staleness"),
                 ("k3", "k3"), ("$", "cost_usd"))
"""The per-pool block: (header, key of a pool row; the row's ``numerics`` is left out: the static
description of the pool, too wide for 80 columns)."""


def _headline_value(record: Mapping[str, Any], key: str | None) -> str:
    if key is None:
        return f"{fmt(record.get('staleness/mean'))}/{fmt(record.get('staleness/max'))}"
    return fmt(record.get(key))


class RunConsole:
    """What ``hetrl train`` shows while it runs (a no-op when ``enabled`` is False).

    The loop reports through three calls: :meth:`phase` (``"warm start"``, ``"set-up"``,
    ``"training"``, ...), :meth:`progress` (``k`` of ``n`` done in a phase, e.g. the evaluation's
    episodes) and :meth:`step` (a step's metric record and the pools' rows). On a terminal a rich
    live view shows a status line (the phase, its progress, the elapsed time and, in training,
    the ETA from the mean time per step so far), the headline figures of the last step and one
    compact row per pool, all within 80 columns (cells fold, never truncate). Otherwise (stdout
    piped to a file or a log) each phase change, progress report and step prints one plain line,
    flushed at once. ``console``: where to write (default: rich's global console, which the warm
    start's progress bar shares, so it shows inside the live view); ``clock``: seconds (tests)."""

    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total_steps
        self.enabled = enabled
        self.console = console or get_console()
        self.interactive = self.console.is_terminal
        self._clock = clock
        self._lock = threading.RLock()
        self._live: Live | None = None
        self._phase, self._done, self._of = "", 0, 0
        self._started = self._phase_started = clock()
        self._train_started: tuple[float, int] | None = None  # (time, step) when training began
        self._record: Mapping[str, Any] = {}
        self._pools: Sequence[Mapping[str, Any]] = ()

    # ------------------------------------------------------------------ what the loop calls
    def phase(self, name: str) -> None:
        """Enter phase ``name`` (a repeated call is a no-op; training starts with :meth:`start_training`)."""
        with self._lock:
            if name == self._phase and not self._of:
                return
            self._phase, self._done, self._of = name, 0, 0
            self._phase_started = self._clock()
            self._show(self._status())

    def start_training(self, step: int) -> None:
        """Training begins (or resumes) at ``step``: the phase ``"training"`` and the ETA's origin."""
        with self._lock:
            self._train_started = (self._clock(), step)
            self.phase("training")

    def progress(self, name: str, done: int, total: int) -> None:
        """``done`` of ``total`` units of phase ``name`` are finished (entering it if needed)."""
        with self._lock:
            if name != self._phase:
                self._phase, self._phase_started = name, self._clock()
            self._done, self._of = done, total
            self._show(self._status())

    def step(self, record: Mapping[str, Any], pools: Sequence[Mapping[str, Any]]) -> None:
        """A step finished: show its ``record`` and the ``pools``' rows (one mapping per pool with
        the keys of the pool block)."""
        with self._lock:
            self._record, self._pools = dict(record), list(pools)
            if self._phase != "training":
                self._phase, self._done, self._of = "training", 0, 0
            self._show(self._plain_step())

    def close(self) -> None:
        """Stop the live view (its last frame stays on the screen)."""
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    def __enter__(self) -> "RunConsole":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ rendering
    def _show(self, line: str) -> None:
        if not self.enabled:
            return
        if not self.interactive:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self.console.file.flush()
            return
        if self._live is None:
            self._live = Live(get_renderable=self.render, console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.start()
        self._live.refresh()

    def _eta(self) -> float | None:
        step = self._record.get("step")
        if self._train_started is None or not isinstance(step, int):
            return None
        t0, s0 = self._train_started
        done = step - s0
        return (self._clock() - t0) / done * (self.total - step) if done > 0 else None

    def _status(self) -> str:
        """``hetrl | <phase> [k/n] [(time in it)] | step s/N | elapsed <since start> | ETA <left>``."""
        now = self._clock()
        phase = (self._phase or "starting") + (f" {self._done}/{self._of}" if self._of else "")
        if self._phase != "training":
            phase += f" ({fmt_duration(now - self._phase_started)})"
        parts = [f"hetrl | {phase}"]
        if self._train_started is not None:
            step = self._record.get("step", self._train_started[1])
            parts.append(f"step {step}/{self.total}")
        parts.append(f"elapsed {fmt_duration(now - self._started)}")
        if self._train_started is not None:
            parts.append(f"ETA {fmt_duration(self._eta())}")
        return " | ".join(parts)

    def _plain_step(self) -> str:
        """One line per step: the status, the headline figures and each pool's alive/k3."""
        r = self._record
        figures = " ".join(f"{label}={_headline_value(r, key)}" for label, key in _HEADLINE)
        pools = " ".join(f"[{p['pool']} {p['alive']} k3={fmt(p['k3'])}]" for p in self._pools)
        return f"{self._status()} | {figures}" + (f" | {pools}" if pools else "")

    def render(self) -> Group:
        """The live view: status line, headline figures (4 pairs a row) and the pool block."""
        with self._lock:
            parts: list[Any] = [Text(self._status(), style="bold")]
            if self._record:
                head = Table.grid(padding=(0, 1))
                for _ in range(4):
                    head.add_column(style="dim", overflow="fold")
                    head.add_column(justify="right", overflow="fold")
                cells = [c for label, key in _HEADLINE for c in (label, _headline_value(self._record, key))]
                for i in range(0, len(cells), 8):
                    head.add_row(*cells[i: i + 8])
                parts.append(head)
            if self._pools:
                table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, header_style="bold")
                for header, _ in _POOL_COLUMNS:
                    table.add_column(header, justify="left" if header == "pool" else "right", overflow="fold")
                for p in self._pools:
                    table.add_row(*[p[key] if isinstance(p[key], str) else fmt(p[key]) for _, key in _POOL_COLUMNS])
                parts.append(table)
            return Group(*parts)


def write_plots(history: Sequence[Mapping[str, Any]], pool_names: Sequence[str], directory: str | pathlib.Path) -> list[pathlib.Path]:
    """``reward.png``, ``heldout.png`` and ``mismatch.png`` (per-pool KL k3) over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in history]

    def series(key: str, count: str | None = None) -> tuple[list[int], list[float]]:
        # a mismatch metric of a step whose batch held no token (``count``) of that pool is an empty mean, not a 0
        pts = [(r["step"], r[key]) for r in history
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and (count is None or r.get(count, 1) > 0)]
        return [p[0] for p in pts], [p[1] for p in pts]

    out = []
    specs = [
        ("reward.png", "reward", [("reward/mean", None, "mean reward"), ("rollout/solved", None, "solved fraction")]),
        ("heldout.png", "held-out", [("eval/success", None, "success rate"), ("eval/reward", None, "mean reward")]),
        ("mismatch.png", "KL k3 (sampler vs trainer)",
         [("mismatch/k3", "mismatch/num_tokens", "all")]
         + [(pool_mismatch_key(p, "k3"), pool_mismatch_key(p, "num_tokens"), p) for p in pool_names]),
    ]
    for filename, title, lines in specs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, count, label in lines:
            xs, ys = series(key, count)
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
    held = (f"start {fmt(evals[0]['eval/success'])} (step {evals[0]['step']})  end {fmt(evals[-1]['eval/success'])} "
            f"(step {evals[-1]['step']})" if evals else "-")
    lines = [
        f"steps: {last['step']}  wall: {final['wall_s']:.1f}s  trainer version: {final['version']}",
        f"reward: first {fmt(first.get('reward/mean'))}  last {fmt(last.get('reward/mean'))}",
        f"held-out success: {held} ({len(evals)} evaluations)",
        f"KL k3: last {fmt(last.get('mismatch/k3'))}  staleness max over run: {final['max_staleness']}",
        f"groups: trained {final['groups_trained']}  dropped {final['groups_dropped']}  "
        f"rejected rollouts {final['rollouts_rejected']}  requeued jobs {final['requeues']}",
        f"outputs: {final['output_dir']}",
    ]
    return lines
