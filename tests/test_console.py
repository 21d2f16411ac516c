"""The run console (hetrl.orchestrator.report.RunConsole, fmt): an 80-column live view on a
terminal with no truncated cell, one plain line per step and phase otherwise, and one number
format (small values in scientific notation) everywhere."""

import io

import pytest
from rich.console import Console

from hetrl.orchestrator.report import RunConsole, fmt, fmt_duration, summary_lines

POOLS = ("b200-nvfp4", "h100-fp8", "mi300x-fp8", "a100-bf16", "l40s-fp8", "tpu-v6e-bf16")
RECORD = {
    "step": 12, "reward/mean": 0.375, "rollout/solved": 0.25, "eval/success": 0.5, "mismatch/k3": 4.73e-4,
    "mismatch/masked_frac/any": 0.0, "throughput/gen_tokens_per_s": 12345.678,
    "throughput/trained_tokens_per_s": 2345.5, "staleness/mean": 0.5, "staleness/max": 2.0, "time/step_s": 1.234,
}


def _pools():
    return [{"pool": name, "numerics": f"{name.rsplit('-', 1)[0]} fp8_e4m3fnuz/bf16", "alive": "2/2",
             "weight_version": "11,12", "requests": 123456, "tokens": 98765432, "trained": 1234, "dropped": 12,
             "max_staleness": 2, "k3": 4.73e-4 * (i + 1), "cost_usd": 0.01234} for i, name in enumerate(POOLS)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("value, shown", [
    (4.73e-4, "4.73e-04"), (1e-7, "1.00e-07"), (0.00141, "1.41e-03"), (0.0, "0"), (0.375, "0.375"), (1.0, "1"),
    (0.01234, "0.01234"), (12345.678, "12346"), (2.5e7, "2.50e+07"), (-3e-5, "-3.00e-05"), (7, "7"), (99999, "99999"),
    (123456, "123k"), (98765432, "98.8M"), (None, "-"), (float("nan"), "-"), (float("inf"), "-"), (True, "True"),
])
def test_fmt(value, shown):
    assert fmt(value) == shown


def test_fmt_duration():
    assert [fmt_duration(s) for s in (5, 65, 3 * 3600 + 120, None)] == ["5s", "1m05s", "3h02m", "-"]


def test_terminal_view_fits_80_columns_without_truncation():
    term = Console(width=80, force_terminal=True, record=True, file=io.StringIO(), color_system=None)
    clock = Clock()
    view = RunConsole(100, console=term, clock=clock)
    assert view.interactive
    view.start_training(0)
    clock.t += 120.0
    view.step(RECORD, _pools())
    view.close()
    frames = term.export_text(clear=True)  # what the live view drew (frames joined: cursor moves are not recorded)
    assert "4.73e-04" in frames and "…" not in frames and "..." not in frames
    term.print(view.render())  # its last frame, alone
    text = term.export_text()
    lines = text.splitlines()
    assert "…" not in text and "..." not in text
    assert max(len(line) for line in lines) <= 80
    for name in POOLS:  # every pool name whole, on one line
        assert any(name in line for line in lines), name
    assert "4.73e-04" in text and "9.46e-04" in text  # the headline KL and the pools' k3: one format
    assert "0.000" not in text
    assert "step 12/100" in text and "elapsed 2m00s" in text and "ETA 14m40s" in text  # 10 s a step, 88 left


def test_phases_and_evaluation_progress_on_a_terminal():
    term = Console(width=80, force_terminal=True, record=True, file=io.StringIO(), color_system=None)
    clock = Clock()
    view = RunConsole(10, console=term, clock=clock)
    view.phase("set-up")
    clock.t += 42
    term.print(view.render())
    view.progress("evaluation", 3, 16)
    term.print(view.render())
    view.close()
    text = term.export_text()
    assert "set-up (42s)" in text and "evaluation 3/16" in text


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    piped = Console(file=out, width=80)
    clock = Clock()
    view = RunConsole(3, console=piped, clock=clock)
    assert not view.interactive
    view.phase("set-up")
    view.progress("evaluation", 0, 16)
    view.progress("evaluation", 16, 16)
    view.start_training(0)
    for step in (1, 2, 3):
        clock.t += 10
        view.step({**RECORD, "step": step}, _pools())
    view.close()
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if "reward=" in line]
    assert len(steps) == 3  # one line per step, however long
    assert [("step 1/3" in s, "step 3/3" in s) for s in steps] == [(True, False), (False, False), (False, True)]
    assert all("KL k3=4.73e-04" in s and "[b200-nvfp4 2/2 k3=4.73e-04]" in s for s in steps)
    assert "hetrl | set-up (0s)" in lines[0] and "evaluation 0/16" in lines[1] and "evaluation 16/16" in lines[2]
    assert "hetrl | training" in lines[3]
    assert "ETA 0s" in steps[-1] and "ETA 20s" in steps[0]


def test_disabled_prints_nothing():
    out = io.StringIO()
    view = RunConsole(3, enabled=False, console=Console(file=out, force_terminal=True))
    view.phase("set-up")
    view.step(RECORD, _pools())
    view.close()
    assert out.getvalue() == ""


def test_summary_uses_the_same_format():
    history = [{"step": 1, "reward/mean": 0.25, "mismatch/k3": 4.73e-4}]
    final = {"wall_s": 3.0, "version": 1, "max_staleness": 0, "groups_trained": 2, "groups_dropped": 0,
             "rollouts_rejected": 0, "requeues": 0, "output_dir": "runs/x"}
    assert "KL k3: last 4.73e-04" in "\n".join(summary_lines(history, final))
