"""The GPU check kit ``bench/gpu_check.sh``: its argument errors (fast), its ``--cpu-smoke`` run
through every stage on this machine (slow), and the refusal of a full run without a GPU (slow).
A GPU session runs the same script without ``--cpu-smoke`` (BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
KIT = REPO / "bench" / "gpu_check.sh"
SRC = REPO / "src"


def run_kit(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(["bash", str(KIT), "--python", sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_missing_out_is_a_usage_error():
    proc = run_kit("--cpu-smoke")
    assert proc.returncode == 2 and "usage: bench/gpu_check.sh --out DIR" in proc.stderr


def test_unknown_argument_is_named():
    proc = run_kit("--out", "x", "--gpu")
    assert proc.returncode == 2 and "unknown argument '--gpu'" in proc.stderr


def test_a_wheel_directory_without_wheels_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = run_kit("--wheels", str(tmp_path / "wheels"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "no *.whl there" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cpu_smoke_passes_every_stage_and_its_figures_are_consistent(tmp_path):
    """Every stage runs and passes at the smallest size; the figures in the JSON are derived as
    documented (tokens/s and MFU from the step times and the measured peak), the round trip is
    bit exact and within its log-prob bound, parity has rows and none failed."""
    import torch

    out = tmp_path / "out"
    proc = run_kit("--cpu-smoke", "--out", str(out), timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads((out / "gpu_check.json").read_text())
    stages = report["stages"]
    assert report["ok"] and list(stages) == ["devices", "steps", "hf_round_trip", "sampler", "parity"]
    assert all(s["ok"] for s in stages.values()), {n: s.get("error") for n, s in stages.items()}

    steps = stages["steps"]
    assert steps["cpu_shim_active"] == (not torch.cuda.is_available())
    peak = steps["peak_bf16_flops"]
    assert peak["machine"] == max(peak["jax"], peak["torch"]) > 0
    for row in steps["trainers"]:
        assert row["step_s"] == pytest.approx(statistics.median(steps["step_times_s"][row["trainer"]]))
        assert row["tokens_per_s"] == pytest.approx(steps["tokens"] / row["step_s"])
        assert row["mfu"] == pytest.approx(steps["step_flops"] / row["step_s"] / peak["machine"])

    round_trip = stages["hf_round_trip"]
    assert set(round_trip["export_max_abs_diff"].values()) == {0.0}
    assert round_trip["step_max_abs_change"] > 0
    assert round_trip["logprob_max_abs_diff"] <= round_trip["tolerance"]

    sampler = stages["sampler"]
    assert sampler["tokens_per_s"] > 0 and sampler["mean_logprob"] < 0

    statuses = [r["status"] for r in stages["parity"]["rows"]]
    assert "PASS" in statuses and "FAIL" not in statuses
    assert (out / "parity.json").is_file() and (out / "gpu_check.png").is_file()
    assert "gpu_check.sh done: exit 0" in (out / "gpu_check.log").read_text()


@pytest.mark.slow
def test_a_full_run_without_a_gpu_stops_at_the_devices_stage(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full run is the kit's real use, not a refusal")
    out = tmp_path / "out"
    proc = run_kit("--out", str(out), timeout=300)
    assert proc.returncode == 1
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    assert list(stages) == ["devices"] and not stages["devices"]["ok"]
    assert "no GPU for the check" in stages["devices"]["error"] and "--cpu-smoke" in stages["devices"]["error"]
