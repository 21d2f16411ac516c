"""``REPORT.md``, ``measures.json`` and ``plots/*.png`` of a finished grid, under its output directory.

Everything is computed from the runs' own ``runs/<arm>/s<seed>/metrics.jsonl`` in the same
directory: per-run values by the rules of :mod:`hetrl.experiment.measures` (listed in the
report's Appendix A, defined in Appendix B, and written to ``measures.json``), aggregated over
runs by :mod:`hetrl.experiment.statistics`, and set against the public claims by
:mod:`hetrl.experiment.claims`. Sections: the claims with their verdicts (and, under those that
do not agree, the config's ``caveats``), E1 mismatch, E2
stability, E3 cost, E4 partial alignment, the any-mixture sweep, E1 and E2's main arms with the
Megatron trainer, the power analysis (seeds and held-out episodes a score margin needs, from this
grid's spread: :mod:`hetrl.experiment.power`), and the appendices. An analysis
the grid does not include says so instead of a table.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from hetrl.experiment import plots, power
from hetrl.experiment.claims import (AGREES, VERDICT_RULES, Claim, claim_cost, claim_mismatch, claim_partial_alignment,
                                     claim_stability, column)
from hetrl.experiment.measures import BY_NAME, MEASURES, RENTED, TIMING, Measure, Records, load_records, run_values
from hetrl.experiment.plan import ExperimentPlan, RunSpec
from hetrl.experiment.runner import run_directory
from hetrl.experiment.statistics import BOOTSTRAP_RESAMPLES, LEVEL, Estimate, bootstrap_ratio, t_interval, welch_interval

__all__ = ["REPORT_FILE", "MEASURES_FILE", "SECTIONS", "write_report"]

REPORT_FILE = "REPORT.md"
MEASURES_FILE = "measures.json"
SECTIONS = ("## The public result's claims", "## E1 — sampler–trainer mismatch", "## E2 — stability",
            "## E3 — cost", "## E4 — partial alignment", "## Any mixture — random fleets",
            "## Megatron trainer — E1 and E2's main arms", "## Power — seeds and held-out episodes for a margin",
            "## Appendix A — per-run values", "## Appendix B — definitions", "## Appendix C — arms")
"""The report's section headings, in order."""


@dataclass(frozen=True)
class _Grid:
    """A finished grid's data: per run its metrics file (relative to the output directory),
    records and values; per arm its runs' values."""

    plan: ExperimentPlan
    files: dict[str, str]
    records: dict[str, Records]
    values: dict[str, dict[str, float]]
    by_arm: dict[str, list[dict[str, float]]]

    def arm_records(self, arms: Sequence[str]) -> dict[str, list[Records]]:
        return {arm: [self.records[r.key] for r in self.plan.runs_of(arm)] for arm in arms}

    def estimate(self, arm: str, measure: str) -> Estimate:
        return t_interval(column(self.by_arm, arm, measure))


def _measures(plan: ExperimentPlan) -> tuple[Measure, ...]:
    """The values the grid reports: :data:`MEASURES`, :data:`RENTED` when its cost analysis
    compares it, :data:`TIMING` when it has a power analysis."""
    e3 = plan.config.analyses.e3
    rented = (RENTED,) if e3 is not None and e3.measure == RENTED.name else ()
    return (*MEASURES, *rented, *(TIMING if plan.config.analyses.power is not None else ()))


def _load(plan: ExperimentPlan, out: pathlib.Path) -> _Grid:
    files, records, values = {}, {}, {}
    for spec in plan.runs:
        path = run_directory(out, spec) / "metrics.jsonl"
        files[spec.key] = path.relative_to(out).as_posix()
        records[spec.key] = load_records(path)
        values[spec.key] = run_values(records[spec.key], plan.config.grad_spike_factor, _measures(plan))
    by_arm = {arm: [values[r.key] for r in plan.runs_of(arm)] for arm in plan.arms}
    return _Grid(plan, files, records, values, by_arm)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def _arm_table(grid: _Grid, arms: Sequence[str], measures: Sequence[str]) -> list[str]:
    """A row per arm: its run count and ``mean ± sd [95% CI]`` of each measure over its runs."""
    header = ["arm", "runs", *(BY_NAME[m].label for m in measures)]
    rows = [[f"`{arm}`", str(len(grid.plan.runs_of(arm))),
             *(grid.estimate(arm, m).format(BY_NAME[m].fmt, sd=True) for m in measures)] for arm in arms]
    return _table(header, rows)


def _figure(out: pathlib.Path, path: pathlib.Path, caption: str) -> list[str]:
    return [f"![{caption}]({path.relative_to(out).as_posix()})", ""]


def _finding_lines(claim: Claim) -> list[str]:
    """A bullet per finding of ``claim``: the statement, the measured figure and the verdict."""
    return [f"- {f.statement}: {f.measured}: **{f.verdict}**." for f in claim.findings]


def _not_in_grid(name: str) -> list[str]:
    return [f"{name} is not part of this grid (no `analyses` entry for it, or the quick grid leaves its arms out).", ""]


def _intro(grid: _Grid, command: str) -> list[str]:
    c, plan = grid.plan.config, grid.plan
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# Experiment report: `{c.name}`", "",
        *([c.description.strip(), ""] if c.description else []),
        f"- Grid: `{plan.source}`: {len(plan.arms)} arms, seeds {list(c.seeds)}, {len(plan.runs)} runs of `hetrl train` "
        "(each arm's base config and overrides in Appendix C).",
        f"- Command: `{command}`; report written {when}.",
        "- **Where every number comes from.** Each run's metrics are in this directory, "
        "`runs/<arm>/s<seed>/metrics.jsonl` (one JSON object per step). Appendix A lists each run's per-run values, "
        f"Appendix B defines each value by the metric keys and the rule it is computed with (also in `{MEASURES_FILE}`). "
        "An arm's figure is over its runs: `mean ± sd [95% CI]`, the CI being mean ± t(n−1)·sd/√n. Ratios of means "
        f"have {LEVEL:.0%} percentile-bootstrap CIs over runs ({BOOTSTRAP_RESAMPLES} resamples, each arm resampled "
        "independently), differences of means Welch t CIs. `(no CI)`: fewer than two runs.", "",
    ]


def _claims(claims: Mapping[str, Claim], caveats: Mapping[str, str]) -> list[str]:
    """The claims with their findings, then, for every tested claim that does not agree, the
    config's reading of what the tiny scale may explain (``caveats``, by analysis key)."""
    lines = [SECTIONS[0], ""]
    for claim in claims.values():
        lines += [f"### Claim {claim.number} ({claim.experiment}): {claim.text}", "", f"**Verdict: {claim.verdict}.**", ""]
        if claim.findings:
            lines += _table(["finding tested", "measured (95% CI) and source", "verdict"],
                            [[f.statement, f.measured, f.verdict] for f in claim.findings])
    lines += ["**Verdict rules.** " + VERDICT_RULES, "", "### Where the measurement and the public result part", ""]
    parting = {key: c for key, c in claims.items() if c.findings and c.verdict != AGREES}
    if not parting:
        return lines + ["Every tested claim agrees.", ""]
    for key, claim in parting.items():
        reading = caveats.get(key, f"(the experiment config gives no reading of this: `caveats.{key}`)")
        lines.append(f"- **Claim {claim.number} ({claim.experiment}), {claim.verdict}.** {' '.join(reading.split())}")
    return lines + [""]


def _e1(grid: _Grid, out: pathlib.Path, claim: Claim) -> list[str]:
    e1 = grid.plan.config.analyses.e1
    if e1 is None:
        return [SECTIONS[1], "", *_not_in_grid("E1")]
    arms = [e1.mixed, e1.homogeneous]
    png = plots.curves(out / "plots" / "e1_k3.png", "E1: sampler–trainer KL k3", "mismatch/k3",
                       grid.arm_records(arms), "mismatch/k3", log=True)
    return [SECTIONS[1], "", f"Mixed fleet `{e1.mixed}` against homogeneous fleet `{e1.homogeneous}`.", "",
            *_arm_table(grid, arms, ["k3_mean", "k3_slope", "masked_frac"]),
            f"Ratio of mean KL k3, mixed / homogeneous: {claim.findings[0].measured}; the public result saw "
            f"{e1.claimed_ratio:g}x: **{claim.findings[0].verdict}**.", "",
            *_figure(out, png, "KL k3 over steps")]


def _e2(grid: _Grid, out: pathlib.Path, claim: Claim) -> list[str]:
    e2 = grid.plan.config.analyses.e2
    if e2 is None:
        return [SECTIONS[2], "", *_not_in_grid("E2")]
    records = grid.arm_records(e2.arms)
    figures = [
        plots.curves(out / "plots" / "e2_heldout.png", "E2: held-out success", "eval/success", records, "eval/success"),
        plots.curves(out / "plots" / "e2_k3.png", "E2: sampler–trainer KL k3", "mismatch/k3", records, "mismatch/k3",
                     log=True),
        plots.curves(out / "plots" / "e2_grad_norm.png", "E2: gradient norm", "grad_norm", records, "grad_norm", log=True),
    ]
    captions = ["held-out success over steps", "KL k3 over steps", "gradient norm over steps"]
    findings = _finding_lines(claim)
    return [SECTIONS[2], "", "Held-out score, KL trend and gradient-norm spikes per arm "
            f"(a spike: `grad_norm` above {grid.plan.config.grad_spike_factor:g}x the run's median).", "",
            *_arm_table(grid, e2.arms, ["heldout_start", "heldout_end", "heldout_change", "k3_mean", "k3_slope",
                                        "grad_spikes", "masked_frac"]),
            *([*findings, ""] if findings else []),
            *(line for png, caption in zip(figures, captions) for line in _figure(out, png, caption))]


def _e3(grid: _Grid, out: pathlib.Path, claim: Claim) -> list[str]:
    arms = grid.plan.arms
    e3 = grid.plan.config.analyses.e3
    m = "usd_per_mtok" if e3 is None else e3.measure
    png = plots.interval_bars(out / "plots" / "e3_cost.png", "E3: cost per million trained tokens (95% CI)",
                              BY_NAME[m].label, {a: grid.estimate(a, m) for a in arms})
    clock = ("the rented-time clock: every replica's wall time, idle included, x its price" if m != "usd_per_mtok"
             else "the `modelled` cost clock of the base configs: generated tokens / modelled throughput x list "
             "price, so the figures compare fleets, not this CPU")
    columns = ["usd_per_mtok", "rented_usd_per_mtok"] if m != "usd_per_mtok" else ["usd_per_mtok"]
    lines = [SECTIONS[3], "", f"Cost of every arm's fleet ({clock}).", "",
             *_arm_table(grid, arms, [*columns, "usd_per_point", "cost_usd", "trained_tokens", "heldout_end"]),
             *_figure(out, png, "cost per million trained tokens")]
    if claim.findings:
        lines += [*_finding_lines(claim), ""]
    if e3 is not None:
        lines += [_cheapest_match(grid, e3.homogeneous, e3.score_margin, m), ""]
    return lines


def _cheapest_match(grid: _Grid, homogeneous: str, margin: float, measure: str = "usd_per_mtok") -> str:
    """The cheapest arm (mean cost per trained token, ``measure``) whose final held-out success
    is not shown worse than ``homogeneous``'s by more than ``margin`` (Welch interval's upper end
    >= −margin), with its cost ratio to ``homogeneous``."""
    base = column(grid.by_arm, homogeneous, "heldout_end")
    matches = []
    for arm in grid.plan.arms:
        diff = welch_interval(column(grid.by_arm, arm, "heldout_end"), base)
        if arm != homogeneous and diff.has_interval and diff.hi >= -margin:
            matches.append((grid.estimate(arm, measure).value, arm))
    rule = (f"final held-out success not shown worse than `{homogeneous}`'s by more than {margin:g} "
            f"(upper end of the Welch 95% CI of the difference >= −{margin:g})")
    if not matches:
        return f"- Cheapest fleet matching the homogeneous score ({rule}): none qualifies."
    _, arm = min(matches)
    ratio = bootstrap_ratio(column(grid.by_arm, arm, measure), column(grid.by_arm, homogeneous, measure))
    return (f"- Cheapest fleet matching the homogeneous score ({rule}; {len(matches)} of {len(grid.plan.arms) - 1} "
            f"arms qualify): `{arm}`, at {ratio.format('.3f')} times `{homogeneous}`'s cost per trained token "
            f"(ratio of `{measure}` means).")


def _e4(grid: _Grid, out: pathlib.Path) -> list[str]:
    e4 = grid.plan.config.analyses.e4
    if e4 is None:
        return [SECTIONS[4], "", *_not_in_grid("E4")]
    arms = [e4.uncorrected, e4.corrected, e4.mixed_uncorrected]
    png = plots.curves(out / "plots" / "e4_k3.png", "E4: KL k3, weight-aligned fleet vs mixed", "mismatch/k3",
                       grid.arm_records(arms), "mismatch/k3", log=True)
    return [SECTIONS[4], "", f"A fleet aligned in weight precision only, uncorrected `{e4.uncorrected}` and corrected "
            f"`{e4.corrected}`, against the mixed fleet uncorrected `{e4.mixed_uncorrected}`. With mask replay on, the "
            "corrected arm's k3 is measured on the replayed (renormalized) distribution, as its loss sees it.", "",
            *_arm_table(grid, arms, ["k3_mean", "k3_slope", "masked_frac", "heldout_end"]),
            *_figure(out, png, "KL k3 over steps")]


def _mixture(grid: _Grid, out: pathlib.Path) -> list[str]:
    pairs = grid.plan.mixtures
    if not pairs:
        return [SECTIONS[5], "", *_not_in_grid("The any-mixture sweep")]
    rows, points, diffs = [], [], []
    for pair in pairs:
        k3 = grid.estimate(pair.uncorrected, "k3_mean")
        plain, fixed = grid.estimate(pair.uncorrected, "heldout_end"), grid.estimate(pair.corrected, "heldout_end")
        diffs.append(fixed.value - plain.value)
        points.append((f"any{pair.fleet.index}", k3.value, plain.value, fixed.value))
        rows.append([f"any{pair.fleet.index}", pair.fleet.describe(), BY_NAME["k3_mean"].format(k3.value),
                     BY_NAME["k3_mean"].format(grid.estimate(pair.corrected, "k3_mean").value),
                     BY_NAME["heldout_end"].format(plain.value), BY_NAME["heldout_end"].format(fixed.value),
                     BY_NAME["heldout_change"].format(diffs[-1])])
    png = plots.mixture_scatter(out / "plots" / "any_mixture.png", points)
    paired = t_interval(diffs)
    return [SECTIONS[5], "", f"{len(pairs)} random fleets (kinds, precisions and replica shares drawn from the "
            "accelerator catalogue), each run uncorrected (`any<i>_uncorrected`) and corrected (`any<i>_corrected`). "
            "Per fleet: the mean over its runs of each per-run value.", "",
            *_table(["fleet", "pools (kind weight/KV x replicas)", "mean KL k3 uncorrected", "mean KL k3 corrected",
                     "held-out end uncorrected", "held-out end corrected", "corrected − uncorrected"], rows),
            f"Final held-out success, corrected − uncorrected, paired over fleets (t interval of the last column): "
            f"{paired.format('+.3f', sd=True)}.", "",
            *_figure(out, png, "any mixture: KL against final held-out success")]


def _megatron(grid: _Grid, out: pathlib.Path, claim: Claim) -> list[str]:
    m = grid.plan.config.analyses.megatron
    if m is None:
        return [SECTIONS[6], "", *_not_in_grid("The Megatron comparison")]
    arms = [m.homogeneous, m.mixed, m.corrected]
    records = grid.arm_records(arms)
    figures = [
        plots.curves(out / "plots" / "megatron_k3.png", "Megatron trainer: sampler–trainer KL k3", "mismatch/k3",
                     records, "mismatch/k3", log=True),
        plots.curves(out / "plots" / "megatron_heldout.png", "Megatron trainer: held-out success", "eval/success",
                     records, "eval/success"),
    ]
    kept = welch_interval(column(grid.by_arm, m.corrected, "heldout_end"), column(grid.by_arm, m.homogeneous, "heldout_end"))
    lines = [SECTIONS[6], "", f"The same runs with `hetrl train --trainer megatron` (megatron-core, the config's trainer "
             f"settings under kind megatron): homogeneous `{m.homogeneous}` and mixed `{m.mixed}` uncorrected, mixed corrected "
             f"`{m.corrected}`.", "",
             *_arm_table(grid, arms, ["heldout_start", "heldout_end", "heldout_change", "k3_mean", "k3_slope",
                                      "grad_spikes", "masked_frac"]),
             f"- Ratio of mean KL k3, mixed / homogeneous: {claim.findings[0].measured}; the public result saw "
             f"{m.claimed_ratio:g}x: **{claim.findings[0].verdict}**.",
             f"- Final held-out success, `{m.corrected}` − `{m.homogeneous}`: {kept.format('+.3f')} (Welch).", ""]
    e1 = grid.plan.config.analyses.e1
    if e1 is not None:
        jax = bootstrap_ratio(column(grid.by_arm, e1.mixed, "k3_mean"), column(grid.by_arm, e1.homogeneous, "k3_mean"))
        lines += [f"- The same ratio with the JAX trainer (`{e1.mixed}` / `{e1.homogeneous}`): {jax.format('.2f')}.", ""]
    return lines + [line for png, caption in zip(figures, ["KL k3 over steps", "held-out success over steps"])
                    for line in _figure(out, png, caption)]


def _finite_mean(xs: list[float]) -> float:
    """The mean of the finite ``xs``; NaN when none is."""
    finite = [x for x in xs if math.isfinite(x)]
    return float(np.mean(finite)) if finite else math.nan


def _power(grid: _Grid, out: pathlib.Path) -> list[str]:
    """Seeds per arm that resolve each margin at each held-out episode count, from the pooled
    within-arm spread of final held-out success; each plan's runs and hours at those seeds
    (:mod:`hetrl.experiment.power`)."""
    pa = grid.plan.config.analyses.power
    if pa is None:
        return [SECTIONS[7], "", *_not_in_grid("The power analysis")]
    arms = list(pa.arms or grid.plan.arms)
    ends = [column(grid.by_arm, arm, "heldout_end") for arm in arms]
    sd, dof = power.pooled_sd(ends)
    p = float(np.nanmean([x for arm in ends for x in arm]))
    runs = [grid.values[r.key] for arm in arms for r in grid.plan.runs_of(arm)]
    episodes0 = int(round(float(np.nanmedian([r["eval_episodes"] for r in runs]))))
    seconds0, eval_s, evaluations = (_finite_mean([r[m] for r in runs]) for m in ("wall_s", "eval_s", "evaluations"))

    def needed(margin: float, episodes: int) -> int | None:
        return power.seeds_for_margin(power.projected_sd(sd, p, episodes0, episodes), margin)

    too_many = f"> {power.MAX_SEEDS} seeds"

    def plan_cell(n_arms: int, margin: float, episodes: int) -> str:
        n = needed(margin, episodes)
        if n is None:
            return too_many
        seconds = power.run_seconds(seconds0, round(evaluations), eval_s, episodes0, episodes)
        hours = n * n_arms * seconds / pa.jobs / 3600
        if not math.isfinite(hours):
            return f"{n * n_arms} runs"
        return f"{n * n_arms} runs, {hours:.1f} h{'' if hours <= pa.budget_hours else ' (over budget)'}"

    widths = {"≤ m": 1.0, "≤ m/2 (decides *worse*)": power.DECISIVE}
    seed_rows = [[f"{m:g}", width, *(str(n) if (n := needed(m * share, e)) is not None else too_many
                                     for e in pa.episodes)]
                 for width, share in widths.items() for m in pa.margins]
    plan_rows = [[plan, str(n_arms), f"{m:g}", width, *(plan_cell(n_arms, m * share, e) for e in pa.episodes)]
                 for plan, n_arms in pa.plans.items() for width, share in widths.items() for m in pa.margins]
    diffs = [[name, f"`{x}` − `{y}`", welch_interval(column(grid.by_arm, x, "heldout_end"),
                                                    column(grid.by_arm, y, "heldout_end")).format("+.3f")]
             for name, (x, y) in pa.comparisons.items()]
    seeds = list(range(2, 41))
    lines = {f"{e} episodes": (seeds, [power.half_width(power.projected_sd(sd, p, episodes0, e), n) for n in seeds])
             for e in pa.episodes}
    png = plots.half_widths(out / "plots" / "power.png", "95% CI half-width of a difference of two arms' final "
                            "held-out success", lines,
                            {**{f"margin {m:g}": m for m in pa.margins},
                             **{f"{m:g}/2: decides worse (margin {m:g})": m * power.DECISIVE for m in pa.margins}})
    return [SECTIONS[7], "",
            f"Final held-out success (`heldout_end`) of the {len(runs)} runs of {len(arms)} arms has a within-arm "
            f"spread, pooled over the arms, of σ = {sd:.4f} ({dof} degrees of freedom) at a mean success p = {p:.3f}, "
            f"with {episodes0} held-out episodes per evaluation (`eval_episodes`). A difference of two arms of n seeds "
            "each then has a Welch 95% interval of half-width t(2n−2)·σ·√(2/n). With E episodes, the held-out noise in "
            f"σ² (at most the binomial p(1−p)/{episodes0}) is scaled by {episodes0}/E and the rest (seed to seed) kept "
            "(`hetrl.experiment.power`).", "",
            "Differences this grid measures (Welch 95% CI):", "",
            *_table(["comparison", "difference", "final held-out success"], diffs),
            "Seeds per arm for a half-width no wider than each margin m, which resolves a one-threshold test unless "
            "the true difference lies within the half-width of −m, and no wider than m/2, at which the two-threshold "
            "*worse (margin m)* rule (E2's uncorrected comparison) decides whatever the difference: its interval cannot "
            "hold both 0 and −m:", "",
            *_table(["margin", "half-width", *(f"{e} episodes" for e in pa.episodes)], seed_rows),
            (f"A grid at those seeds, {pa.jobs} runs at a time: a run took {seconds0:.0f} s here (mean `wall_s`, "
             f"{pa.jobs} runs sharing the machine) with {round(evaluations)} evaluations of {eval_s:.1f} s each "
             f"(mean `eval_s`), which grow with their episodes; budget {pa.budget_hours:g} h:"
             if math.isfinite(seconds0) else
             "A grid at those seeds: its runs (no hours: these runs' metrics do not show an evaluation's time, "
             "`eval_s`, which needs an evaluation between the first and the last step, as a step's record is stamped "
             "before its evaluation runs):"), "",
            *_table(["plan", "arms", "margin", "half-width", *(f"{e} episodes" for e in pa.episodes)], plan_rows),
            *_figure(out, png, "CI half-width against seeds per arm")]


def _appendices(grid: _Grid) -> list[str]:
    plan = grid.plan
    measures = _measures(plan)
    per_run = _table(["run", "metrics file", *(m.name for m in measures)],
                     [[r.key, f"[{grid.files[r.key]}]({grid.files[r.key]})",
                       *(m.format(grid.values[r.key][m.name]) for m in measures)] for r in plan.runs])
    definitions = _table(["value", "heading", "definition"], [[m.name, m.label, m.definition] for m in measures])
    first: dict[str, RunSpec] = {}
    for r in plan.runs:
        first.setdefault(r.arm, r)
    arms = _table(["arm", "what it is", "base config", "overrides (`--set`, in order; then the seed)"],
                  [[f"`{a}`", plan.describe(a) or "-", f"`{r.base.name}`",
                    "<br>".join(f"`{o}`" for o in r.overrides[:-1]) or "-"] for a, r in first.items()])
    return [SECTIONS[8], "", *per_run, SECTIONS[9], "",
            f"`grad_spike_factor` = {plan.config.grad_spike_factor:g}.", "", *definitions, SECTIONS[10], "", *arms]


def write_report(plan: ExperimentPlan, out: pathlib.Path, *, command: str) -> pathlib.Path:
    """Write ``REPORT.md``, ``measures.json`` and the plots of the finished grid ``plan`` under ``out``."""
    grid = _load(plan, out)
    analyses, values = plan.config.analyses, grid.by_arm
    megatron = claim_mismatch(analyses.megatron.mismatch() if analyses.megatron else None, values,
                              experiment="E1, Megatron trainer")
    claims = {"e1": claim_mismatch(analyses.e1, values), "e2": claim_stability(analyses.e2, values),
              "e3": claim_cost(analyses.e3, values), "e4": claim_partial_alignment(analyses.e4, values),
              "megatron": megatron}
    lines = [*_intro(grid, command), *_claims(claims, plan.config.caveats), *_e1(grid, out, claims["e1"]),
             *_e2(grid, out, claims["e2"]), *_e3(grid, out, claims["e3"]), *_e4(grid, out), *_mixture(grid, out),
             *_megatron(grid, out, megatron), *_power(grid, out), *_appendices(grid)]
    (out / MEASURES_FILE).write_text(json.dumps(
        {"definitions": {m.name: m.definition for m in _measures(plan)}, "grad_spike_factor": plan.config.grad_spike_factor,
         "runs": {k: {"metrics": grid.files[k], "values": {m: (x if math.isfinite(x) else None) for m, x in v.items()}}
                  for k, v in grid.values.items()}}, indent=2, allow_nan=False), encoding="utf-8")
    path = out / REPORT_FILE
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
