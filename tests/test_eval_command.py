"""``hetrl eval``: the unbiased pass@k estimator, checkpoint resolution, and an end-to-end run on the
shipped warm start (hetrl.eval_command, hetrl.orchestrator.evaluation.pass_at_k)."""

import itertools
import json
import math
import pathlib
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetrl.cli import main
from hetrl.config import load_config
from hetrl.eval_command import resolve_checkpoint
from hetrl.errors import UserError
from hetrl.orchestrator.evaluation import pass_at_k

WARMSTART = next((pathlib.Path(__file__).parents[1] / "assets" / "models").glob("warmstart-*"))


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_one_minus_the_ratio_of_binomials(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_the_chance_that_k_of_the_episodes_hold_a_solved_one():
    """By enumeration: over every k-subset of n episodes (c solved), the fraction with a solved one."""
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 2), (7, 1, 7)]:
        episodes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(episodes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_a_warm_start_evaluates_with_its_own_settings_and_a_run_folder_with_its_config(tmp_path):
    ckpt = resolve_checkpoint(str(WARMSTART))
    assert ckpt.sampling.temperature == 1.0 and ckpt.max_new_tokens == 64 and ckpt.coding.max_turns == 1
    assert ckpt.suite is not None and ckpt.suite.tiers == (1, 2)
    run = tmp_path / "run"
    shutil.copytree(WARMSTART, run / "hf" / "step-3")
    (run / "hf" / "latest").symlink_to("step-3")
    config = load_config("tiny_mixed.yaml", ["async.max_new_tokens=48", "async.sampling.temperature=0.7",
                                             "environment.options.coding.max_turns=2"])
    (run / "config.yaml").write_text(config.to_yaml())  # as the run folder keeps it
    for model in (run, run / "hf" / "step-3"):
        ckpt = resolve_checkpoint(str(model))
        assert ckpt.directory == (run / "hf" / "step-3").resolve() and ckpt.name == "run"
        assert (ckpt.sampling.temperature, ckpt.max_new_tokens, ckpt.coding.max_turns) == (0.7, 48, 2)
    with pytest.raises(UserError, match="not an HF checkpoint"):
        resolve_checkpoint(str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "synthetic", "--samples", "0"], "--samples 0: needs at least 1"),
    (["--tasks", "synthetic", "--workers", "0"], "--workers 0: needs at least 1"),
    (["--tasks", "synthetic", "--samples", "2", "--greedy"], "--greedy gives every sample the same episode"),
    (["--tasks", "synthetic", "--samples", "2", "--k", "1,5"], "each k must be between 1 and --samples (2)"),
    (["--tasks", "nope.jsonl"], "no task set 'nope.jsonl'"),
    (["--tasks", "synthetic", "--temperature", "-1"], "sampling settings:"),
])
def test_bad_eval_arguments_fail_in_one_line(capsys, tmp_path, argv, message):
    assert main(["eval", str(WARMSTART), "--out", str(tmp_path / "o"), "--no-progress", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetrl eval: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_eval_of_the_warm_start_writes_consistent_per_task_results(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", str(WARMSTART), "--tasks", "synthetic", "--limit", "3", "--samples", "3", "--k", "1,2",
                 "--out", str(out), "--no-progress"]) == 0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(results) == 3 and len(episodes) == 9 and summary["episodes"] == 9
    for i, row in enumerate(results):
        mine = episodes[3 * i: 3 * i + 3]
        assert {e["task_id"] for e in mine} == {row["task_id"]} and row["correct"] == sum(e["success"] for e in mine)
        assert row["pass@2"] == pass_at_k(3, row["correct"], 2)
    assert summary["pass@1"] == pytest.approx(summary["success"]) == pytest.approx(sum(e["success"] for e in episodes) / 9)
    assert summary["sampling"]["temperature"] == 1.0 and summary["max_new_tokens"] == 64
    assert "pass@1" in capsys.readouterr().out
