"""`hetrl experiment`: the statistics (hypothesis properties), the verdict rules, the grid config
and its errors, random fleets, resumability (launches counted with a fake launcher), a complete
report on synthetic metrics, and end to end on a real 2-arm x 1-seed x 2-step grid."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from hetrl.experiment import claims, power
from hetrl.experiment.config import ExperimentConfig, ExperimentError, StabilityAnalysis, load_experiment
from hetrl.experiment.fleets import draw_fleets
from hetrl.experiment.measures import run_values
from hetrl.experiment.plan import ExperimentPlan, RunSpec, build_plan
from hetrl.experiment.report import MEASURES_FILE, REPORT_FILE, SECTIONS, write_report
from hetrl.experiment.runner import COMPLETE_MARKER, SPEC_FILE, default_jobs, run_directory, run_grid
from hetrl.experiment.statistics import Estimate, bootstrap_ratio, ols_slope, t_interval, welch_interval
from hetrl.samplers.profiles import CATALOGUE, REFERENCE_KIND
from tiny_run import TINY_BATCH, as_mapping

REPO = pathlib.Path(__file__).resolve().parents[1]

values_st = st.lists(st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=12)
positive_st = st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=2, max_size=8)


# ====================================================================== statistics
@given(values_st)
def test_t_interval_contains_the_mean(xs):
    est = t_interval(xs)
    assert est.n == len(xs)
    assert est.lo <= est.value <= est.hi
    assert est.value == pytest.approx(np.mean(xs))


def test_t_interval_known_value_and_degenerate_cases():
    est = t_interval([1.0, 2.0, 3.0])
    half = 4.302652729911275 / math.sqrt(3)  # t(2, 0.975) * sd 1 / sqrt(3)
    assert (est.value, est.sd) == (2.0, 1.0)
    assert est.lo == pytest.approx(2.0 - half) and est.hi == pytest.approx(2.0 + half)
    one = t_interval([5.0, float("nan")])  # NaN is a missing run
    assert one.n == 1 and one.value == 5.0 and not one.has_interval
    assert t_interval([]).n == 0 and math.isnan(t_interval([]).value)


@given(values_st, values_st)
def test_welch_interval_contains_the_difference_and_is_antisymmetric(a, b):
    ab, ba = welch_interval(a, b), welch_interval(b, a)
    assert ab.lo <= ab.value <= ab.hi
    assert ab.value == pytest.approx(-ba.value, abs=1e-9)
    assert ab.lo == pytest.approx(-ba.hi, abs=1e-6) and ab.hi == pytest.approx(-ba.lo, abs=1e-6)


@given(positive_st)
def test_ratio_interval_of_identical_groups_contains_one(xs):
    est = bootstrap_ratio(xs, list(xs))
    assert est.value == pytest.approx(1.0)
    assert est.lo <= 1.0 <= est.hi


@given(positive_st, positive_st, st.floats(min_value=0.01, max_value=100.0))
def test_ratio_interval_scales_with_the_numerator(a, b, c):
    base, scaled = bootstrap_ratio(a, b), bootstrap_ratio([c * x for x in a], b)
    assert base.lo <= base.value <= base.hi
    assert scaled.value == pytest.approx(c * base.value, rel=1e-9)
    assert scaled.lo == pytest.approx(c * base.lo, rel=1e-9) and scaled.hi == pytest.approx(c * base.hi, rel=1e-9)


def test_ratio_without_enough_runs_has_no_interval():
    assert not bootstrap_ratio([1.0], [2.0]).has_interval
    assert bootstrap_ratio([1.0], [2.0]).value == 0.5
    assert math.isnan(bootstrap_ratio([], [1.0, 2.0]).value)


@given(st.floats(-10, 10), st.floats(-10, 10), st.integers(2, 40))
def test_ols_slope_recovers_a_line(a, b, n):
    x = np.arange(n, dtype=float)
    assert ols_slope(x, a + b * x) == pytest.approx(b, abs=1e-9)


def test_ols_slope_needs_two_distinct_x():
    assert math.isnan(ols_slope([1.0], [2.0])) and math.isnan(ols_slope([3.0, 3.0], [1.0, 2.0]))


@given(st.floats(1e-3, 1.0), st.integers(2, 60))
def test_half_width_is_the_welch_interval_of_two_equal_spread_arms(sd, n):
    """Two arms of n runs whose sample sd is exactly ``sd``: the Welch interval of their difference
    is t(2n−2)·sd·√(2/n) wide on each side, the half-width the power analysis plans with."""
    z = np.arange(n, dtype=float)
    unit = (z - z.mean()) / z.std(ddof=1)
    est = welch_interval(list(1.0 + sd * unit), list(sd * unit))
    assert (est.hi - est.lo) / 2 == pytest.approx(power.half_width(sd, n), rel=1e-6)


@given(st.floats(1e-3, 0.2), st.floats(1e-3, 0.1))
def test_seeds_for_margin_is_the_fewest_that_resolve_it(sd, margin):
    n = power.seeds_for_margin(sd, margin)
    if n is None:
        assert power.half_width(sd, power.MAX_SEEDS) > margin
        return
    assert power.half_width(sd, n) <= margin and (n == 2 or power.half_width(sd, n - 1) > margin)


@given(st.floats(-0.2, 0.2), st.floats(0.0, 1.0), st.floats(1e-3, 0.1))
def test_a_half_width_within_the_decisive_share_of_the_margin_always_decides_worse(diff, share, margin):
    """The plan's m/2 rule: an interval no wider than the margin never holds both 0 and −m, so the
    *worse (margin m)* verdict is never inconclusive; wider ones can be (the interval [−m, 0] is)."""
    h = share * power.DECISIVE * margin
    assert claims.worse_verdict(Estimate(diff, diff - h, diff + h, 6), margin) != claims.INCONCLUSIVE
    assert claims.worse_verdict(_est(-margin * 1.01, 0.0), margin) == claims.INCONCLUSIVE


def test_e2_without_a_corrected_arm_tests_the_uncorrected_comparison_alone():
    """A confirmation grid of the homogeneous and the uncorrected arm: claim 4 rests on their one
    difference (here 0.05 lower on every seed: *agrees*)."""
    e2 = StabilityAnalysis(arms=("h", "u"), homogeneous="h", uncorrected="u", score_margin=0.02)
    scores = {"h": [0.20, 0.21, 0.22], "u": [0.15, 0.16, 0.17]}
    claim = claims.claim_stability(e2, {a: [{"heldout_end": x} for x in xs] for a, xs in scores.items()})
    assert [f.verdict for f in claim.findings] == [claims.AGREES] and "`u` − `h`" in claim.findings[0].statement


def test_pooled_sd_projection_and_run_time():
    sd, dof = power.pooled_sd([[1.0, 2.0, 3.0], [5.0, 7.0], [4.0], [float("nan"), 1.0, 1.0]])
    assert dof == 2 + 1 + 1 and sd == pytest.approx(math.sqrt((2.0 + 2.0 + 0.0) / 4))
    assert math.isnan(power.pooled_sd([[1.0]])[0])
    p, e0 = 0.15, 140
    assert power.projected_sd(0.05, p, e0, e0) == pytest.approx(0.05)  # same episodes: same spread
    assert power.projected_sd(0.05, p, e0, 10**9) == pytest.approx(math.sqrt(0.05**2 - p * (1 - p) / e0))
    assert power.projected_sd(0.01, p, e0, 4 * e0) == pytest.approx(0.005)  # below the binomial sd: all of it noise
    assert power.run_seconds(300.0, 3, 20.0, 140, 140) == 300.0
    assert power.run_seconds(300.0, 3, 20.0, 140, 560) == 300.0 + 3 * 20.0 * 3


# ====================================================================== verdicts
def _est(lo, hi, value=None):
    return Estimate((lo + hi) / 2 if value is None else value, lo, hi, 3)


@pytest.mark.parametrize("lo, hi, expected", [
    (3.0, 6.0, claims.AGREES), (1.5, 2.5, claims.DISAGREES), (0.8, 6.0, claims.INCONCLUSIVE), (5.0, 9.0, claims.DISAGREES),
])
def test_ratio_verdict(lo, hi, expected):
    assert claims.ratio_verdict(_est(lo, hi), 4.7) == expected


def test_other_verdicts_and_combining():
    assert claims.above_verdict(_est(0.1, 0.2), 0.0) == claims.AGREES
    assert claims.above_verdict(_est(-0.2, -0.1), 0.0) == claims.DISAGREES
    assert claims.below_verdict(_est(-0.1, 0.1), 0.0) == claims.INCONCLUSIVE
    assert claims.not_above_verdict(_est(-0.1, 0.1), 0.0) == claims.AGREES
    assert claims.not_above_verdict(_est(0.1, 0.2), 0.0) == claims.DISAGREES
    assert claims.not_worse_verdict(_est(-0.01, 0.05), 0.02) == claims.AGREES
    assert claims.not_worse_verdict(_est(-0.09, -0.05), 0.02) == claims.DISAGREES
    assert claims.not_worse_verdict(_est(-0.05, 0.01), 0.02) == claims.INCONCLUSIVE
    assert claims.worse_verdict(_est(-0.05, -0.001), 0.02) == claims.AGREES  # worse, even if by less than the margin
    assert claims.worse_verdict(_est(-0.019, 0.03), 0.02) == claims.DISAGREES  # not worse by more than the margin
    assert claims.worse_verdict(_est(-0.03, 0.01), 0.02) == claims.INCONCLUSIVE
    assert claims.ratio_verdict(Estimate(2.0, math.nan, math.nan, 1), 4.7) == claims.NO_INTERVAL
    assert claims.combine([claims.AGREES, claims.AGREES]) == claims.AGREES
    assert claims.combine([claims.AGREES, claims.DISAGREES, claims.NO_INTERVAL]) == claims.DISAGREES
    assert claims.combine([claims.AGREES, claims.INCONCLUSIVE]) == claims.INCONCLUSIVE


# ====================================================================== config
def _grid(**extra) -> dict:
    data = {
        "name": "t", "seeds": [0, 1, 2],
        "arms": {"homog": {"base": "tiny_homogeneous.yaml", "overrides": {"correction.preset": "none"}},
                 "mixed": {"base": "tiny_mixed.yaml", "overrides": {"correction.preset": "none"}},
                 "fixed": {"base": "tiny_mixed.yaml", "overrides": {"correction.preset": "hetrl"}},
                 "partial": {"base": "tiny_mixed.yaml", "overrides": {"correction.preset": "none"}}},
        "analyses": {"e1": {"mixed": "mixed", "homogeneous": "homog"}, "e2": {"arms": ["homog", "mixed", "fixed"], "homogeneous": "homog",
                                                                 "uncorrected": "mixed", "corrected": "fixed"},
                     "e3": {"corrected": "fixed", "homogeneous": "homog"},
                     "e4": {"uncorrected": "partial", "corrected": "fixed", "mixed_uncorrected": "mixed"}},
    }
    data.update(extra)
    return data


def _write(tmp_path: pathlib.Path, data: dict) -> pathlib.Path:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["arms"]["homog"].update(overide={}), r"arms\.homog\.overide: Extra inputs are not permitted"),
    (lambda d: d["analyses"]["e1"].update(mixed="nope"), r"analyses\.e1\.mixed: unknown arm 'nope'"),
    (lambda d: d.update(seeds=[1, 1]), r"seeds: .*distinct"),
    (lambda d: d.update(caveats={"power": "x"}), r"caveats\.power: not an analysis that tests a claim"),
    (lambda d: d.update(any_mixture={"min_pools": 3, "max_pools": 2}), r"min_pools <= max_pools"),
    (lambda d: d.update(any_mixture={"kinds": ["fp32"]}), r"any_mixture\.kinds: .*unknown accelerator kind 'fp32'"),
    (lambda d: d.update(quick={"arms": ["gone"]}), r"quick\.arms\[0\]: unknown arm 'gone'"),
    (lambda d: d["analyses"]["e2"].pop("uncorrected"), r"analyses\.e2: .*give both .* or none"),
    (lambda d: d["analyses"].update(power={"comparisons": {"c": ["mixed", "gone"]}, "plans": {"p": 3}}),
     r"analyses\.power\.comparisons\.c\[1\]: unknown arm 'gone'"),
    (lambda d: d["analyses"].update(power={"comparisons": {"c": ["mixed", "homog"]}, "plans": {"p": 3},
                                           "margins": [0.0]}), r"analyses\.power\.margins: .*in \(0, 1\]"),
])
def test_config_errors_name_the_key(tmp_path, edit, message):
    data = _grid()
    edit(data)
    with pytest.raises(ExperimentError, match=message):
        load_experiment(_write(tmp_path, data))


def test_a_bad_run_config_is_refused_before_anything_runs(tmp_path):
    data = _grid(defaults={"fleet.pools[0].accelerator": "a100", "fleet.pools[0].weight_precision": "fp8_e4m3"})
    config, source = load_experiment(_write(tmp_path, data))
    with pytest.raises(ExperimentError, match=r"(?s)arm 'homog'.*fleet\.pools\[0\].*'a100' does not run weight format"):
        build_plan(config, source)
    data = _grid(defaults={"environment.options.eval.sample": 2})
    config, source = load_experiment(_write(tmp_path, data))
    with pytest.raises(ExperimentError, match=r"arm 'homog': --set environment\.options\.eval\.sample=2: unknown key "
                                              r"'sample' \(did you mean 'samples'\?\)"):
        build_plan(config, source)


def test_quick_scales_the_grid_and_drops_analyses_without_their_arms(tmp_path):
    data = _grid(defaults={"steps": 50}, quick={"seeds": [0, 1], "defaults": {"steps": 4}, "arms": ["homog", "mixed"]})
    full, source = load_experiment(_write(tmp_path, data))
    quick, _ = load_experiment(source, quick=True)
    assert quick.seeds == (0, 1) and quick.defaults == {"steps": 4} and list(quick.arms) == ["homog", "mixed"]
    assert set(quick.analyses.present()) == {"e1", "e2"} and quick.analyses.e2.arms == ("homog", "mixed")
    plan = build_plan(quick, source)
    assert {(r.arm, r.seed, r.steps) for r in plan.runs} == {(a, s, 4) for a in ("homog", "mixed") for s in (0, 1)}
    assert plan.runs[0].overrides == ("steps=4", 'correction.preset="none"', "seed=0")
    with pytest.raises(ExperimentError, match="no 'quick' section"):
        ExperimentConfig.model_validate(_grid()).quick_scaled()


def test_the_default_grid_and_its_quick_scale_are_valid():
    for quick, runs in ((False, 42), (True, 16)):
        config, source = load_experiment("experiment_default.yaml", quick=quick)
        plan = build_plan(config, source)
        assert len(plan.runs) == runs and set(config.analyses.present()) == {"e1", "e2", "e3", "e4", "megatron"}
        assert all(len(plan.runs_of(a)) == len(config.seeds) for a in config.arms)


# ====================================================================== random fleets
def test_random_fleets_are_native_reproducible_and_stable_under_more_draws():
    spec = ExperimentConfig.model_validate(_grid(any_mixture={"fleets": 12, "seed": 5})).any_mixture
    fleets = draw_fleets(spec)
    assert fleets == draw_fleets(spec)
    assert draw_fleets(spec.model_copy(update={"fleets": 3})) == fleets[:3]
    kinds_seen = set()
    for fleet in fleets:
        kinds = [p["accelerator"] for p in fleet.pools]
        assert spec.min_pools <= len(kinds) <= spec.max_pools and len(set(kinds)) == len(kinds)
        assert sum(p["replicas"] for p in fleet.pools) == spec.replicas and all(p["replicas"] >= 1 for p in fleet.pools)
        for p in fleet.pools:
            assert p["weight_precision"] in CATALOGUE[p["accelerator"]].weight_formats
            assert p["kv_precision"] in CATALOGUE[p["accelerator"]].kv_formats
        kinds_seen |= set(kinds)
    assert REFERENCE_KIND not in kinds_seen and any(k.startswith("tpu") for k in kinds_seen)


# ====================================================================== fake runs: resuming and the report
K3 = {"homog": 1e-4, "mixed": 4.7e-4, "fixed": 4.0e-4, "partial": 2e-4, "homog_mg": 1e-4, "mixed_mg": 4.7e-4,
      "fixed_mg": 4.0e-4}


def _megatron_arms(data: dict) -> dict:
    """``data`` (a grid) plus the Megatron copies of its homogeneous, mixed and corrected arms."""
    for arm in ("homog", "mixed", "fixed"):
        base = data["arms"][arm]
        data["arms"][f"{arm}_mg"] = {"base": base["base"], "overrides": {"trainer.kind": "megatron", **base["overrides"]}}
    data["analyses"]["megatron"] = {"homogeneous": "homog_mg", "mixed": "mixed_mg", "corrected": "fixed_mg"}
    return data


class FakeLauncher:
    """Writes synthetic metrics for a run instead of training, and counts launches: per arm a KL
    level (:data:`K3`) times ``1 + growth·step`` (no growth for corrected arms), a final score of
    0.17 (0.12 for the uncorrected mixed arm ``mixed``) and a cost per token 0.85x for the
    corrected mixed arm ``fixed``; seed ``s`` scales the KL by ``1 + 0.02(s − 1)`` and shifts the
    score by ``0.005(s − 1)``, so 3 seeds average out; every run's steps take 100 s, and its
    evaluation at step 4 delays step 5 by 10 s."""

    def __init__(self, k3=K3, fail: set[str] = frozenset()):
        self.k3, self.fail, self.launched = k3, fail, []

    def __call__(self, spec: RunSpec, argv: list[str], directory: pathlib.Path) -> int:
        self.launched.append(spec.key)
        assert argv[1:5] == ["-m", "hetrl.cli", "train", str(spec.base)] and f"output_dir={directory}" in argv
        if spec.key in self.fail:
            return 3
        level = self.k3.get(spec.arm, 2e-4) * (1 + 0.02 * (spec.seed - 1))
        growth = 0.0 if "fixed" in spec.arm or "_corrected" in spec.arm else 0.05
        records = [{"step": 0, "eval/success": 0.15}]
        for t in range(1, spec.steps + 1):
            records.append({"step": t, "mismatch/k3": level * (1 + growth * t), "mismatch/masked_frac/any": 0.01,
                            "time/wall_s": 100.0 * t / spec.steps + (10.0 if t > 4 else 0.0),
                            "grad_norm": 0.1 * (5.0 if t == 3 else 1.0 + 0.01 * t),
                            "fleet/cost/usd": 0.002 * t, "fleet/trained_tokens": 1000.0 * t,
                            "fleet/cost/usd_per_trained_token": 2e-6 * (0.85 if spec.arm == "fixed" else 1.0)})
        records[-1]["eval/success"] = 0.17 + 0.005 * (spec.seed - 1) - (0.05 if spec.arm == "mixed" else 0.0)
        records[-1]["eval/tasks"] = 140.0
        if spec.steps >= 4:
            records[4]["eval/success"] = 0.16
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (directory / COMPLETE_MARKER).write_text(json.dumps({"version": spec.steps}))
        return 0


def _fake_plan(tmp_path, megatron: bool = False, **extra) -> ExperimentPlan:
    data = _grid(defaults={"steps": 8}, **extra)
    config, source = load_experiment(_write(tmp_path, _megatron_arms(data) if megatron else data))
    return build_plan(config, source)


def test_a_completed_run_is_not_run_again(tmp_path):
    plan, out = _fake_plan(tmp_path), tmp_path / "out"
    first = FakeLauncher(fail={"mixed/s1"})
    outcome = run_grid(plan, out, launcher=first, progress=False)
    assert len(first.launched) == 12 and [f[0].key for f in outcome.failed] == ["mixed/s1"]
    assert outcome.failed[0][1] == 3
    second = FakeLauncher()
    outcome = run_grid(plan, out, jobs=2, launcher=second, progress=False)
    assert second.launched == ["mixed/s1"] and len(outcome.skipped) == 11 and not outcome.failed
    third = FakeLauncher()
    assert run_grid(plan, out, launcher=third, progress=False).completed == [] and third.launched == []
    # an interrupted run (no completion marker) starts over; other settings in a run directory are refused
    (run_directory(out, plan.runs[0]) / COMPLETE_MARKER).unlink()
    fourth = FakeLauncher()
    run_grid(plan, out, launcher=fourth, progress=False)
    assert fourth.launched == [plan.runs[0].key]
    changed = ExperimentPlan(plan.config, plan.source,
                             tuple(RunSpec(r.arm, r.seed, r.base, r.overrides, r.steps + 1) for r in plan.runs), ())
    with pytest.raises(ExperimentError, match="a run of other settings"):
        run_grid(changed, out, launcher=FakeLauncher(), progress=False)


def test_a_finished_grid_copied_to_another_checkout_is_complete_there(tmp_path):
    """The runs record their base config relative to the experiment config: a committed grid
    directory, in a clone at another path, is recognised as complete (nothing is trained again)."""
    first, second = tmp_path / "clone-a" / "configs", tmp_path / "elsewhere" / "clone-b" / "configs"
    first.mkdir(parents=True)
    for name in ("tiny_homogeneous.yaml", "tiny_mixed.yaml"):
        (first / name).write_text((REPO / "configs" / name).read_text(encoding="utf-8"), encoding="utf-8")
    _write(first, _grid(defaults={"steps": 8}))
    plan = build_plan(*load_experiment(first / "grid.yaml"))
    assert all(r.base.parent == first.resolve() for r in plan.runs)  # the copies, not the repository's
    run_grid(plan, first.parent / "out", launcher=FakeLauncher(), progress=False)
    shutil.copytree(first.parent, second.parent)
    moved = build_plan(*load_experiment(second / "grid.yaml"))
    again = FakeLauncher()
    outcome = run_grid(moved, second.parent / "out", launcher=again, progress=False)
    assert again.launched == [] and len(outcome.skipped) == len(moved.runs)
    recorded = json.loads((run_directory(second.parent / "out", moved.runs[0]) / SPEC_FILE).read_text())
    assert recorded["base"] == moved.runs[0].base.name


def check_report(out: pathlib.Path, plan: ExperimentPlan) -> str:
    """Assert the report under ``out`` is complete; return its text."""
    text = (out / REPORT_FILE).read_text(encoding="utf-8")
    positions = [text.find("\n" + s + "\n") for s in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), "a section is missing or out of order"
    verdicts = re.findall(r"\*\*Verdict: (.+?)\.\*\*", text)
    assert len(verdicts) == 5, verdicts
    allowed = (claims.AGREES, claims.DISAGREES, claims.INCONCLUSIVE, claims.NO_INTERVAL, "not tested")
    assert all(v.startswith(allowed) for v in verdicts), verdicts

    def section(i: int) -> str:
        end = text.find("\n" + SECTIONS[i + 1] + "\n") if i + 1 < len(SECTIONS) else len(text)
        return text[positions[i]:end]

    def rows(i: int, first_cell: str) -> list[str]:
        return [line for line in section(i).splitlines() if line.startswith(f"| {first_cell} |")]

    analyses = plan.config.analyses
    if analyses.e2 is not None:
        for arm in analyses.e2.arms:
            assert len(rows(2, f"`{arm}`")) == 1, f"E2 table has no row for {arm}"
    for arm in plan.arms:
        assert len(rows(3, f"`{arm}`")) == 1, f"E3 table has no row for {arm}"
        assert len(rows(10, f"`{arm}`")) == 1, f"Appendix C has no row for {arm}"
    for run in plan.runs:
        assert len(rows(8, run.key)) == 1, f"Appendix A has no row for {run.key}"
    if analyses.megatron is not None:
        for arm in analyses.megatron.references().values():
            assert len(rows(6, f"`{arm}`")) == 1, f"the Megatron table has no row for {arm}"
    for pair in plan.mixtures:
        assert len(rows(5, f"any{pair.fleet.index}")) == 1
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    expected_figures = 1 + (3 if analyses.e2 else 0) + (1 if analyses.e1 else 0) + (1 if analyses.e4 else 0) + (
        1 if plan.mixtures else 0) + (2 if analyses.megatron else 0) + (1 if analyses.power else 0)
    assert len(figures) == expected_figures, figures
    for fig in figures:
        assert (out / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig
    metrics = set(re.findall(r"\]\((runs/[^)]+/metrics\.jsonl)\)", text))
    assert metrics == {f"runs/{r.key}/metrics.jsonl" for r in plan.runs}
    assert all((out / m).stat().st_size > 0 for m in metrics)
    measures = json.loads((out / MEASURES_FILE).read_text())
    assert set(measures["runs"]) == {r.key for r in plan.runs}
    return text


def test_report_on_synthetic_runs_is_complete_and_judges_the_claims(tmp_path):
    caveats = {"e1": "E1 READING: few tokens per step.", "megatron": "MEGATRON READING."}
    plan = _fake_plan(tmp_path, megatron=True, any_mixture={"fleets": 2, "seed": 3}, caveats=caveats)
    out = tmp_path / "out"
    run_grid(plan, out, launcher=FakeLauncher(), progress=False)
    write_report(plan, out, command="hetrl experiment grid.yaml")
    text = check_report(out, plan)
    verdicts = re.findall(r"\*\*Verdict: (.+?)\.\*\*", text)
    # the fake data is built to agree: 4.7x the KL (claim 1, with either trainer); the same score at 0.85x the cost
    # (2); the weight-aligned fleet at 2/4.7 of the mixed KL, growing uncorrected and flat corrected (3)
    assert verdicts == [claims.AGREES] * 5
    assert "Every tested claim agrees." in text and "READING" not in text
    assert "### Claim 1 (E1, Megatron trainer)" in text
    # every arm scores like the homogeneous one; `fixed` is the one at 0.85x the cost per token
    assert re.search(r"Cheapest fleet matching the homogeneous score .*: `fixed`, at 0\.850 \[", text)
    assert "ratio of `k3_mean` of `runs/mixed/s*/metrics.jsonl`" in text
    # the verdicts follow the data: with the mixed fleet at the homogeneous KL, claim 1 disagrees, and so does claim 3
    # (the weight-aligned fleet is then above the mixed one)
    out2 = tmp_path / "out2"
    run_grid(plan, out2, launcher=FakeLauncher(k3={**K3, "mixed": 1e-4}), progress=False)
    write_report(plan, out2, command="x")
    text = (out2 / REPORT_FILE).read_text()
    verdicts = re.findall(r"\*\*Verdict: (.+?)\.\*\*", text)
    # (the Megatron arms kept 4.7x)
    assert verdicts == [claims.DISAGREES, claims.AGREES, claims.AGREES, claims.DISAGREES, claims.AGREES]
    # under the claims, each one that parts from the public result with the config's reading of it (or the lack of one)
    parting = text[text.index("### Where the measurement and the public result part"):text.index(SECTIONS[1])]
    assert "- **Claim 1 (E1), disagrees.** E1 READING: few tokens per step." in parting
    assert "- **Claim 3 (E4), disagrees.** (the experiment config gives no reading of this: `caveats.e4`)" in parting
    assert "MEGATRON READING" not in parting and "Claim 2" not in parting


def test_the_report_check_catches_an_incomplete_report(tmp_path):
    plan, out = _fake_plan(tmp_path), tmp_path / "out"
    run_grid(plan, out, launcher=FakeLauncher(), progress=False)
    write_report(plan, out, command="x")
    check_report(out, plan)
    (out / "plots" / "e2_k3.png").unlink()
    with pytest.raises(FileNotFoundError):
        check_report(out, plan)
    write_report(plan, out, command="x")
    report = out / REPORT_FILE
    report.write_text(report.read_text().replace("| `fixed` |", "| fixed |", 1))
    with pytest.raises(AssertionError, match="no row for fixed"):
        check_report(out, plan)


def test_the_power_section_sizes_the_grid_from_the_pooled_spread(tmp_path):
    """A grid with a power analysis reports its pooled spread, the seeds per margin and episode
    count (as the power module computes them) and each plan's runs and hours from the runs' own
    timing; the timing values are in Appendix A."""
    data = _grid(defaults={"steps": 8})
    data["analyses"]["power"] = {"comparisons": {"uncorrected": ["mixed", "homog"]}, "margins": [0.01, 0.02],
                                 "episodes": [140, 560], "plans": {"main": 3}, "jobs": 2, "budget_hours": 0.5}
    plan = build_plan(*load_experiment(_write(tmp_path, data)))
    out = tmp_path / "out"
    run_grid(plan, out, launcher=FakeLauncher(), progress=False)
    write_report(plan, out, command="x")
    text = check_report(out, plan)
    section = text[text.index(SECTIONS[7]):text.index(SECTIONS[8])]
    # every arm's final scores are 0.17 + 0.005 (s − 1) (mixed 0.05 lower): a pooled sd of 0.005 over 4 arms x 2 dof
    assert "σ = 0.0050 (8 degrees of freedom)" in section
    p = (3 * 0.17 + 0.12) / 4
    for margin in (0.01, 0.02):
        for width, target in (("≤ m", margin), ("≤ m/2 (decides *worse*)", margin / 2)):
            cells = [str(power.seeds_for_margin(power.projected_sd(0.005, p, 140, e), target)) for e in (140, 560)]
            assert f"| {margin:g} | {width} | {' | '.join(cells)} |" in section
    n = power.seeds_for_margin(0.005, 0.01)
    hours = n * 3 * 120.0 / 2 / 3600  # a run: 110 s to its last record, then its last evaluation (10 s, as at step 4)
    assert f"| main | 3 | 0.01 | ≤ m | {n * 3} runs, {hours:.1f} h |" in section
    # four times the episodes: the spread (all of it held-out noise: 0.005 is below 140 episodes' binomial sd) halves,
    # and each run's 3 evaluations take 3 x 10 s x 3 more
    n4 = power.seeds_for_margin(0.0025, 0.01)
    assert f"| main | 3 | 0.01 | ≤ m | {n * 3} runs, {hours:.1f} h | {n4 * 3} runs, {n4 * 3 * 210.0 / 2 / 3600:.1f} h |" in section
    data["analyses"]["power"]["budget_hours"] = 0.001
    plan = build_plan(*load_experiment(_write(tmp_path, data)))
    write_report(plan, out, command="x")
    assert f"| main | 3 | 0.01 | ≤ m | {n * 3} runs, {hours:.1f} h (over budget) |" in (out / REPORT_FILE).read_text()
    assert "| `mixed` − `homog` | -0.050 [" in section
    measures = json.loads((out / MEASURES_FILE).read_text())["runs"]["mixed/s0"]["values"]
    assert measures["wall_s"] == 120.0 and measures["eval_s"] == pytest.approx(10.0)
    assert measures["evaluations"] == 3 and measures["eval_episodes"] == 140


def test_per_run_values_follow_their_definitions():
    records = [{"step": 0, "eval/success": 0.1}]
    records += [{"step": t, "mismatch/k3": 1e-4 * t, "grad_norm": 10.0 if t == 2 else 1.0, "fleet/cost/usd": 0.5 * t,
                 "fleet/cost/usd_per_trained_token": 1e-6, "mismatch/masked_frac/any": None} for t in (1, 2, 3, 4)]
    records[-1]["eval/success"] = 0.25
    v = run_values(records, 3.0)
    assert v["heldout_start"] == 0.1 and v["heldout_end"] == 0.25 and v["heldout_change"] == pytest.approx(0.15)
    assert v["k3_mean"] == pytest.approx(2.5e-4) and v["k3_slope"] == pytest.approx(1e-4)
    assert v["grad_spikes"] == 1 and v["usd_per_mtok"] == pytest.approx(1.0)
    assert v["usd_per_point"] == pytest.approx(2.0 / 25.0) and math.isnan(v["masked_frac"])


# ====================================================================== end to end
@pytest.mark.slow
def test_hetrl_experiment_end_to_end_on_a_tiny_grid(tmp_path, monkeypatch, capsys):
    """`hetrl experiment --quick` end to end: the grid's quick scale (2 arms x 1 seed x 2 steps of
    real `hetrl train`, one replica, 2x2 rollouts, one held-out episode) into the default output
    directory `runs/experiments/<name>-quick`, the report checked complete; a second invocation
    trains nothing. (The default grid's own quick scale is 16 runs, about 14 min: too long here.)"""
    from hetrl.cli import main

    small = {"steps": 2, "environment.options.eval.every": 2, "environment.options.eval.tasks": 1,
             "environment.options.eval.samples": 1, "fleet.pools[0].replicas": 1, **as_mapping(TINY_BATCH)}
    data = {"name": "smoke", "seeds": [0, 1], "defaults": {**small, "steps": 4},
            "quick": {"seeds": [0], "defaults": small},
            "arms": {"plain": {"base": "tiny_homogeneous.yaml", "overrides": {"correction.preset": "none"}},
                     "corrected": {"base": "tiny_homogeneous.yaml", "overrides": {"correction.preset": "hetrl"}}},
            "analyses": {"e1": {"mixed": "corrected", "homogeneous": "plain"}, "e2": {"arms": ["plain", "corrected"]},
                         "e3": {"corrected": "corrected", "homogeneous": "plain"},
                         "e4": {"uncorrected": "plain", "corrected": "corrected", "mixed_uncorrected": "plain"}}}
    grid = _write(tmp_path, data)
    (tmp_path / "assets").symlink_to(REPO / "assets")  # the base configs' model cache (assets/models) is relative
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", str(grid), "--quick", "--no-progress"]) == 0, capsys.readouterr()
    assert "runs: 2 trained, 0 already complete, 0 failed" in capsys.readouterr().out
    out = tmp_path / "runs" / "experiments" / "smoke-quick"
    config, source = load_experiment(grid, quick=True)
    assert config.seeds == (0,) and all(r.steps == 2 for r in build_plan(config, source).runs)
    text = check_report(out, build_plan(config, source))
    assert text.count(claims.NO_INTERVAL) >= 3  # one seed: every finding says it has no CI
    assert main(["experiment", str(grid), "--quick", "--no-progress"]) == 0
    assert "runs: 0 trained, 2 already complete, 0 failed" in capsys.readouterr().out


@pytest.mark.parametrize("committed, grid, quick", [("default", "experiment_default", False),
                                                     ("default-quick", "experiment_default", True),
                                                     ("e5", "experiment_e5", False),
                                                     ("stress/pilot", "experiment_stress_pilot", False),
                                                     ("stress/confirm", "experiment_stress_confirm", False),
                                                     ("stress", "experiment_stress", False),
                                                     ("e4_long", "experiment_e4_long", False)])
def test_the_committed_report_is_re_derived_from_its_raw_metrics(tmp_path, monkeypatch, capsys, committed, grid, quick):
    """`hetrl experiment configs/<grid>.yaml [--quick] --out <a copy of docs/results/...>`
    trains nothing and writes the committed REPORT.md and measures.json again from the per-run
    metrics beside them: every quoted figure comes from those files with this code (only the
    report's command line and date differ)."""
    from hetrl.cli import main

    source = REPO / "docs" / "results" / committed
    out = tmp_path / committed
    shutil.copytree(source, out)
    monkeypatch.chdir(REPO)  # the report names the grid config as the command line gave it
    argv = ["experiment", f"configs/{grid}.yaml", *(["--quick"] if quick else []),
            "--out", str(out), "--jobs", "1", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr()
    runs = len(build_plan(*load_experiment(REPO / "configs" / f"{grid}.yaml", quick=quick)).runs)
    assert f"runs: 0 trained, {runs} already complete, 0 failed" in capsys.readouterr().out

    def content(path: pathlib.Path) -> list[str]:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("- Command: ")]

    assert content(out / REPORT_FILE) == content(source / REPORT_FILE)
    assert json.loads((out / MEASURES_FILE).read_text()) == json.loads((source / MEASURES_FILE).read_text())


@pytest.mark.parametrize("cores, available_gib, expected", [(2, 24, 2), (8, 7, 2), (4, 1, 1), (1, 64, 1)])
def test_default_jobs_is_one_per_core_unless_memory_holds_fewer_runs(monkeypatch, cores, available_gib, expected):
    page = 4096
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": page,
                                                     "SC_AVPHYS_PAGES": available_gib * 2**30 // page}[name])
    assert default_jobs(run_memory_bytes=3 * 2**30) == expected
