"""The public result's three claims, each set against the measured figure with a verdict.

1. (E1) The mixed fleet's sampler–trainer KL is 4.7x the homogeneous fleet's.
2. (E3) With the correction, the mixed fleet's final held-out score matches the homogeneous
   fleet's at 15% lower cost (per trained token).
3. (E4) Aligning only the weight precision lowers the mismatch, but it keeps growing over
   training; the correction stops the growth.
4. (E2) Uncorrected, the mixed fleet's final held-out score falls below the homogeneous fleet's;
   corrected, it matches.

A claim is split into findings, each a statistic with its 95% interval
(:mod:`hetrl.experiment.statistics`) judged by one rule of :data:`VERDICT_RULES`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hetrl.experiment.config import CostAnalysis, MismatchAnalysis, PartialAlignmentAnalysis, StabilityAnalysis
from hetrl.experiment.statistics import Estimate, bootstrap_ratio, t_interval, welch_interval

__all__ = ["VERDICT_RULES", "AGREES", "DISAGREES", "INCONCLUSIVE", "NO_INTERVAL", "ArmValues", "Finding", "Claim",
           "ratio_verdict", "above_verdict", "below_verdict", "not_above_verdict", "not_worse_verdict",
           "worse_verdict", "combine", "column", "claim_mismatch", "claim_stability", "claim_cost",
           "claim_partial_alignment"]

AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive (CI overlaps)"
NO_INTERVAL = "inconclusive (no CI: fewer than 2 runs per arm)"

VERDICT_RULES = """\
Each finding is a statistic with its 95% interval `[lo, hi]`, judged by one rule:
**ratio equals r** (a claimed factor): *agrees* if `lo <= r <= hi` and the interval excludes 1 (a difference is \
established and the claimed size is compatible), *disagrees* if r is outside `[lo, hi]`, else *inconclusive* (the \
interval holds both r and 1); **above b**: *agrees* if `lo > b`, *disagrees* if `hi < b`, else *inconclusive*; \
**below b** mirrors it; **not above b**: *disagrees* if `lo > b`, else *agrees* (no evidence of exceeding b); \
**not worse by more than m** (a difference `x − y`): *agrees* if `lo >= −m`, *disagrees* if `hi < −m`, else \
*inconclusive*; **worse (margin m)** (a difference `x − y`): *agrees* if `hi < 0` (x is worse), *disagrees* if \
`lo >= −m` (x is not worse by more than m), else *inconclusive*. Without an interval (fewer than two runs in an arm) a finding is *inconclusive*, saying why. A claim \
agrees when every finding agrees, disagrees when any finding disagrees, and is inconclusive otherwise."""
"""The verdict rules (Markdown), printed in the report."""

ArmValues = Mapping[str, Sequence[Mapping[str, float]]]
"""Arm name -> the per-run values (:func:`hetrl.experiment.measures.run_values`) of its runs."""


def column(values: ArmValues, arm: str, measure: str) -> list[float]:
    """The ``measure`` of every run of ``arm``."""
    return [run[measure] for run in values.get(arm, ())]


def _needs_interval(rule: Callable[[Estimate, float], str]) -> Callable[[Estimate, float], str]:
    """``rule``, or :data:`NO_INTERVAL` for an estimate without an interval."""
    @functools.wraps(rule)
    def checked(est: Estimate, bound: float) -> str:
        return rule(est, bound) if est.has_interval else NO_INTERVAL
    return checked


@_needs_interval
def ratio_verdict(est: Estimate, claimed: float) -> str:
    return DISAGREES if not est.lo <= claimed <= est.hi else INCONCLUSIVE if est.lo <= 1.0 <= est.hi else AGREES


@_needs_interval
def above_verdict(est: Estimate, bound: float) -> str:
    return AGREES if est.lo > bound else DISAGREES if est.hi < bound else INCONCLUSIVE


@_needs_interval
def below_verdict(est: Estimate, bound: float) -> str:
    return AGREES if est.hi < bound else DISAGREES if est.lo > bound else INCONCLUSIVE


@_needs_interval
def not_above_verdict(est: Estimate, bound: float) -> str:
    return DISAGREES if est.lo > bound else AGREES


@_needs_interval
def not_worse_verdict(est: Estimate, margin: float) -> str:
    return AGREES if est.lo >= -margin else DISAGREES if est.hi < -margin else INCONCLUSIVE


@_needs_interval
def worse_verdict(est: Estimate, margin: float) -> str:
    return AGREES if est.hi < 0.0 else DISAGREES if est.lo >= -margin else INCONCLUSIVE


def combine(verdicts: Sequence[str]) -> str:
    """The claim's verdict from its findings' (module docstring)."""
    if DISAGREES in verdicts:
        return DISAGREES
    if verdicts and all(v == AGREES for v in verdicts):
        return AGREES
    return NO_INTERVAL if NO_INTERVAL in verdicts else INCONCLUSIVE


@dataclass(frozen=True)
class Finding:
    """One tested statement: what it says, the measured figure (with its source) and the verdict."""

    statement: str
    measured: str
    verdict: str


@dataclass(frozen=True)
class Claim:
    """A public claim, the experiment that tests it, and the findings (none: not in this grid)."""

    number: int
    text: str
    experiment: str
    findings: tuple[Finding, ...]

    @property
    def verdict(self) -> str:
        if not self.findings:
            return f"not tested ({self.experiment} is not part of this grid)"
        return combine([f.verdict for f in self.findings])


CLAIM_TEXTS = {
    1: "The mixed fleet's sampler–trainer KL is 4.7x the homogeneous BF16 fleet's.",
    2: "With the correction, the mixed fleet's final score matches the homogeneous fleet's at 15% lower cost.",
    3: "Partial alignment (weights only) lowers the mismatch but it keeps growing; the correction stops the growth.",
    4: "Uncorrected, the mixed fleet's final score falls below the homogeneous fleet's; corrected, it matches.",
}


def _src(arm: str, measure: str) -> str:
    return f"`{measure}` of `runs/{arm}/s*/metrics.jsonl`"


def claim_mismatch(e1: MismatchAnalysis | None, values: ArmValues, experiment: str = "E1") -> Claim:
    """Claim 1: bootstrap ratio of mean ``k3_mean``, mixed over homogeneous, equals the claimed
    factor (``experiment`` names the comparison, e.g. E1 with another trainer)."""
    if e1 is None:
        return Claim(1, CLAIM_TEXTS[1], experiment, ())
    ratio = bootstrap_ratio(column(values, e1.mixed, "k3_mean"), column(values, e1.homogeneous, "k3_mean"))
    return Claim(1, CLAIM_TEXTS[1], experiment, (Finding(
        f"mean KL k3 ratio `{e1.mixed}` / `{e1.homogeneous}` = {e1.claimed_ratio:g}",
        f"{ratio.format('.2f')} (ratio of {_src(e1.mixed, 'k3_mean')} over {_src(e1.homogeneous, 'k3_mean')})",
        ratio_verdict(ratio, e1.claimed_ratio)),))


def claim_stability(e2: StabilityAnalysis | None, values: ArmValues) -> Claim:
    """Claim 4: final held-out success (Welch differences): uncorrected − homogeneous is below 0
    (*worse*, margin ``score_margin``), corrected − homogeneous (where the grid names a corrected
    arm) is not worse by more than ``score_margin``."""
    if e2 is None or not e2.tests_claim:
        return Claim(4, CLAIM_TEXTS[4], "E2", ())
    base, m = column(values, e2.homogeneous, "heldout_end"), e2.score_margin
    findings = []
    tested = ((e2.uncorrected, f"< 0 (falls; margin {m:g})", worse_verdict),
              (e2.corrected, f">= −{m:g} (matches)", not_worse_verdict))
    for arm, says, verdict in (t for t in tested if t[0] is not None):
        diff = welch_interval(column(values, arm, "heldout_end"), base)
        findings.append(Finding(
            f"final held-out success `{arm}` − `{e2.homogeneous}` {says}",
            f"{diff.format('+.3f')} (Welch; {_src(arm, 'heldout_end')} minus "
            f"{_src(e2.homogeneous, 'heldout_end')})", verdict(diff, m)))
    return Claim(4, CLAIM_TEXTS[4], "E2", tuple(findings))


def claim_cost(e3: CostAnalysis | None, values: ArmValues) -> Claim:
    """Claim 2: final score not worse than the homogeneous arm's by more than the margin, and
    the cost-per-trained-token ratio equal to the claimed one."""
    if e3 is None:
        return Claim(2, CLAIM_TEXTS[2], "E3", ())
    score = welch_interval(column(values, e3.corrected, "heldout_end"), column(values, e3.homogeneous, "heldout_end"))
    m = e3.measure
    cost = bootstrap_ratio(column(values, e3.corrected, m), column(values, e3.homogeneous, m))
    return Claim(2, CLAIM_TEXTS[2], "E3", (
        Finding(f"final held-out success `{e3.corrected}` − `{e3.homogeneous}` >= −{e3.score_margin:g}",
                f"{score.format('+.3f')} (Welch; {_src(e3.corrected, 'heldout_end')} minus "
                f"{_src(e3.homogeneous, 'heldout_end')})", not_worse_verdict(score, e3.score_margin)),
        Finding(f"cost per trained token ratio `{e3.corrected}` / `{e3.homogeneous}` = {e3.claimed_cost_ratio:g}",
                f"{cost.format('.3f')} (ratio of {_src(e3.corrected, m)} over "
                f"{_src(e3.homogeneous, m)})", ratio_verdict(cost, e3.claimed_cost_ratio)),
    ))


def claim_partial_alignment(e4: PartialAlignmentAnalysis | None, values: ArmValues) -> Claim:
    """Claim 3: partial/mixed KL ratio below 1; uncorrected partial KL slope above 0; corrected
    slope below the uncorrected one and not above 0."""
    if e4 is None:
        return Claim(3, CLAIM_TEXTS[3], "E4", ())
    lower = bootstrap_ratio(column(values, e4.uncorrected, "k3_mean"), column(values, e4.mixed_uncorrected, "k3_mean"))
    grows = t_interval(column(values, e4.uncorrected, "k3_slope"))
    diff = welch_interval(column(values, e4.corrected, "k3_slope"), column(values, e4.uncorrected, "k3_slope"))
    corrected = t_interval(column(values, e4.corrected, "k3_slope"))
    return Claim(3, CLAIM_TEXTS[3], "E4", (
        Finding(f"mean KL k3 ratio `{e4.uncorrected}` / `{e4.mixed_uncorrected}` < 1",
                f"{lower.format('.2f')} (ratio of {_src(e4.uncorrected, 'k3_mean')} over "
                f"{_src(e4.mixed_uncorrected, 'k3_mean')})", below_verdict(lower, 1.0)),
        Finding(f"KL k3 slope of `{e4.uncorrected}` > 0 (keeps growing)",
                f"{grows.format('+.2e')} per step ({_src(e4.uncorrected, 'k3_slope')})", above_verdict(grows, 0.0)),
        Finding(f"KL k3 slope `{e4.corrected}` − `{e4.uncorrected}` < 0 (the correction slows the growth)",
                f"{diff.format('+.2e')} per step (Welch; {_src(e4.corrected, 'k3_slope')} minus "
                f"{_src(e4.uncorrected, 'k3_slope')})", below_verdict(diff, 0.0)),
        Finding(f"KL k3 slope of `{e4.corrected}` not > 0 (no growth left)",
                f"{corrected.format('+.2e')} per step ({_src(e4.corrected, 'k3_slope')})",
                not_above_verdict(corrected, 0.0)),
    ))
