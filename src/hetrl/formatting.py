"""How hetrl shows a number or a duration to a person: one format for the run console, its plain
lines, the summary and the warm start's progress (so a small KL never reads ``0.000`` in one place
and ``4.73e-04`` in another)."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["fmt", "fmt_duration"]


def fmt(value: Any) -> str:
    """The one way a metric is shown (console, plain lines, summary): ``-`` for a missing or
    non-finite value; integers as they are below 100000, else with a k/M/G suffix (``98.8M``);
    floats with 4 significant digits, or in scientific notation (``4.73e-04``) below 0.01 or from
    1e6 on in magnitude, so a small KL never reads as ``0.000``."""
    if value is None or isinstance(value, bool):
        return "-" if value is None else str(value)
    if isinstance(value, numbers.Integral):
        value = int(value)
        if abs(value) < 100_000:
            return str(value)
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.3g}{suffix}"
    value = float(value)
    if not math.isfinite(value):
        return "-"
    if value == 0.0:
        return "0"
    if abs(value) < 1e-2 or abs(value) >= 1e6:
        return f"{value:.2e}"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def fmt_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s`` or ``2h07m``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
