"""`hetrl train --trainer megatron`: the asynchronous loop driving the Megatron trainer
(megatron-core on the CPU test shim), end to end through the command line.

The front door is exercised as users call it, in a fresh interpreter: the tiny homogeneous
config (written for the JAX trainer) switched to Megatron, two steps on a small batch from a
two-replica BF16 pool, checkpointing every step with one kept; then the same command with
``checkpointing.resume`` and one more step. Checked: every step trains and logs finite losses;
the sampler–trainer mismatch stays at the BF16-sampler level (a trainer that did not start from
the published checkpoint, or samplers that did not receive its weights, would be orders of
magnitude off); checkpoints are complete step directories with retention applied; the resumed
run continues from the last checkpoint instead of starting over.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from tiny_run import NO_EVAL, QUIET, replicas, set_args

pytestmark = pytest.mark.slow  # each test trains tiny runs (minutes on 2 cores)

RUN_TIMEOUT_S = 600
K3_BOUND = 1e-3  # measured ~1e-5 (fp32 trainer vs BF16 samplers of the same weights); random weights give ~1


def _train(out: pathlib.Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "hetrl.cli", "train", "tiny_homogeneous.yaml", "--trainer", "megatron",
            "--set", f"steps={steps}", "--set", f"output_dir={out}", "--set", "checkpointing.every=1",
            "--set", "checkpointing.keep=1",
            *set_args([QUIET, NO_EVAL, "async.batch_groups=3", "async.group_size=4", "async.max_new_tokens=24",
                       replicas(2)]), *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_run")
    first = _train(out, 2)
    first_lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first_checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    resumed = _train(out, 3, "--set", "checkpointing.resume=true")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return out, first, first_lines, first_checkpoints, resumed, lines


def test_every_step_trains_with_the_megatron_trainer(runs):
    out, first, first_lines, *_ = runs
    assert [r["step"] for r in first_lines] == [1, 2]
    for r in first_lines:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["mismatch/num_tokens"] > 0
    assert any(r["grad_norm"] > 0 for r in first_lines)  # some group had different rewards: a real gradient
    assert "trainer version: 2" in first.stdout


def test_the_mismatch_is_that_of_bf16_samplers_of_the_trainers_weights(runs):
    _, _, first_lines, *_ = runs
    for r in first_lines:
        assert 0 <= r["mismatch/k3"] < K3_BOUND, r["mismatch/k3"]
        assert r["mismatch/abs_logp_diff_mean"] < 0.02


def test_checkpoints_are_complete_step_directories_with_retention(runs):
    out, _, _, first_checkpoints, *_ = runs
    # keep=1: step 1 pruned; no partial directory left behind; the buffer's and the loop's state beside it
    assert first_checkpoints == ["2", "buffer-2.json", "loop-2.json"]
    assert (out / "checkpoints" / "3" / "metadata.json").exists()  # after the resumed run


def test_resume_continues_from_the_last_checkpoint(runs):
    out, _, _, _, resumed, lines = runs
    assert [r["step"] for r in lines] == [1, 2, 3]  # the resumed run appends step 3 only
    assert "trainer version: 3" in resumed.stdout
    assert json.loads((out / "summary.json").read_text())["version"] == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["3"]
