"""The experiment grid as a typed config: arms x seeds, the analyses E1..E4 (and a power analysis
from a pilot grid's spread), an any-mixture sweep of random fleets, and a ``quick`` scale of the
same grid (DESIGN §6).

A YAML file (``configs/experiment_default.yaml``) holds::

    name: default
    seeds: [0, 1, 2]
    defaults: {steps: 40, environment.options.eval.samples: 4}   # dotted overrides, every run
    arms:
      mixed_grpo: {base: tiny_mixed.yaml, overrides: {correction.preset: none}}
    any_mixture: {fleets: 4, seed: 11}          # random fleets, each run corrected and uncorrected
    analyses:
      e1: {mixed: mixed_grpo, homogeneous: homogeneous_grpo}
    quick: {seeds: [0, 1], defaults: {steps: 10}, arms: [mixed_grpo, homogeneous_grpo], fleets: 1}

One run of arm ``a`` with seed ``s`` is ``hetrl train <a.base>`` with the overrides, in this
order (a later one wins): ``defaults``, ``a.overrides``, ``seed=s``. Override keys are the dotted
keys of ``hetrl train --set`` (:func:`hetrl.config.apply_override`); values are typed YAML.
``base`` is a path relative to the experiment file's directory, or a name in ``configs/``.

The analyses name the arms they compare, so the file says which runs answer which question;
every name must be an arm of the grid. ``quick`` scales the grid down (fewer seeds, cheaper
``defaults`` merged over the full ones, a subset of the arms, fewer random fleets); an analysis
whose arms the quick grid leaves out is dropped from it (E2 keeps the arms that remain).
``caveats`` (by claim-testing analysis: e1, e2, e3, e4, megatron) is the author's reading of what the
tiny scale may explain where a measured figure and the public claim part; the report prints it
under every claim whose verdict is not *agrees*.

Every model forbids unknown keys; :func:`load_experiment` raises :class:`ExperimentError` naming
the file and the dotted key of any problem.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetrl.config import ConfigError, format_path, load_yaml, resolve_config_path
from hetrl.samplers.profiles import CATALOGUE, REFERENCE_KIND

__all__ = [
    "ExperimentError", "Overrides", "ArmConfig", "AnyMixtureConfig", "MismatchAnalysis", "StabilityAnalysis",
    "CostAnalysis", "PartialAlignmentAnalysis", "TrainerAnalysis", "PowerAnalysis", "Analyses", "QuickConfig", "CLAIM_ANALYSES",
    "ExperimentConfig", "load_experiment",
]

Overrides = dict[str, Any]
"""Dotted ``hetrl train --set`` keys to typed values, applied in order."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ExperimentError(ValueError):
    """A problem with an experiment config or its runs; the message names the file, key or run."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ArmConfig(_Strict):
    """One arm: the run config ``base`` and the ``overrides`` that make it this arm."""

    base: str = Field(min_length=1)
    overrides: Overrides = Field(default_factory=dict)
    description: str = ""


def _real_kinds() -> tuple[str, ...]:
    return tuple(k for k in CATALOGUE if k != REFERENCE_KIND)


class AnyMixtureConfig(_Strict):
    """``fleets`` random fleets drawn from ``seed`` (:mod:`hetrl.experiment.fleets`): each has
    between ``min_pools`` and ``max_pools`` pools of distinct accelerator ``kinds`` (default
    every catalogue kind, TPUs included), a weight and a KV format drawn from each kind's native
    ones, and ``replicas`` replicas shared among its pools (a random split, at least one each).
    Every fleet is run on ``base`` twice, with the ``corrected`` and with the ``uncorrected``
    overrides (after the grid's ``defaults``), for the grid's first ``seeds_per_fleet`` seeds."""

    fleets: int = Field(4, ge=0)
    seed: int = Field(0, ge=0)
    base: str = Field("tiny_mixed.yaml", min_length=1)
    kinds: tuple[str, ...] = Field(default_factory=_real_kinds, min_length=1)
    min_pools: int = Field(2, ge=1)
    max_pools: int = Field(4, ge=1)
    replicas: int = Field(6, ge=1)
    seeds_per_fleet: int = Field(1, ge=1)
    corrected: Overrides = Field(default_factory=lambda: {"correction.preset": "hetrl"})
    uncorrected: Overrides = Field(default_factory=lambda: {"correction.preset": "none"})

    @field_validator("kinds")
    @classmethod
    def _known(cls, kinds: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [k for k in kinds if k not in CATALOGUE or k == REFERENCE_KIND]
        if unknown:
            raise ValueError(f"unknown accelerator kind {unknown[0]!r}; choose from {', '.join(_real_kinds())}")
        if len(set(kinds)) != len(kinds):
            raise ValueError("kinds must not repeat")
        return kinds

    @model_validator(mode="after")
    def _sizes(self) -> "AnyMixtureConfig":
        if not self.min_pools <= self.max_pools <= len(self.kinds):
            raise ValueError(f"need min_pools <= max_pools <= len(kinds), got {self.min_pools}, {self.max_pools}, "
                             f"{len(self.kinds)}")
        if self.replicas < self.max_pools:
            raise ValueError(f"replicas ({self.replicas}) must be >= max_pools ({self.max_pools}): one per pool at least")
        return self


class _Analysis(_Strict):
    def references(self) -> dict[str, str]:
        """``field -> arm`` for every arm this analysis names."""
        return {k: v for k, v in self.model_dump().items() if isinstance(v, str)}


class MismatchAnalysis(_Analysis):
    """E1: mean sampler–trainer KL (k3) of the ``mixed`` arm over the ``homogeneous`` one; the
    public result saw ``claimed_ratio``."""

    mixed: str
    homogeneous: str
    claimed_ratio: float = Field(4.7, gt=0.0)


class StabilityAnalysis(_Analysis):
    """E2: held-out score, KL trend and gradient-norm spikes of each of ``arms``; with
    ``homogeneous`` and ``uncorrected`` (both or neither; ``corrected`` only with them) it tests the
    public claim: the uncorrected mixed arm's final held-out success is below the homogeneous arm's,
    the corrected one's (when named) is not worse by more than ``score_margin`` (a success-rate
    difference)."""

    arms: tuple[str, ...] = Field(min_length=1)
    homogeneous: str | None = None
    uncorrected: str | None = None
    corrected: str | None = None
    score_margin: float = Field(0.025, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _all_or_none(self) -> "StabilityAnalysis":
        if (self.homogeneous is None) != (self.uncorrected is None) or (
                self.corrected is not None and self.homogeneous is None):
            raise ValueError("homogeneous and uncorrected name the claim's arms: give both (corrected only with "
                             "them) or none")
        return self

    @property
    def tests_claim(self) -> bool:
        return self.homogeneous is not None

    def references(self) -> dict[str, str]:
        claim = {k: v for k in ("homogeneous", "uncorrected", "corrected") if (v := getattr(self, k)) is not None}
        return {**{f"arms[{i}]": a for i, a in enumerate(self.arms)}, **claim}


class CostAnalysis(_Analysis):
    """E3: cost per trained token of every arm; the public claim: the ``corrected`` mixed arm
    reaches the ``homogeneous`` arm's final score (no worse than ``score_margin``, a success-rate
    difference) at ``claimed_cost_ratio`` times its cost per trained token. ``clock``: the cost
    compared, ``busy`` (the fleet's busy-time cost, ``usd_per_mtok``) or ``rented`` (every
    replica's rented wall time, idle included, ``rented_usd_per_mtok``: paced fleets, E5)."""

    corrected: str
    homogeneous: str
    claimed_cost_ratio: float = Field(0.85, gt=0.0)
    score_margin: float = Field(0.02, ge=0.0, le=1.0)
    clock: Literal["busy", "rented"] = "busy"

    def references(self) -> dict[str, str]:
        return {"corrected": self.corrected, "homogeneous": self.homogeneous}

    @property
    def measure(self) -> str:
        """The per-run cost measure compared (:mod:`hetrl.experiment.measures`)."""
        return "rented_usd_per_mtok" if self.clock == "rented" else "usd_per_mtok"


class PartialAlignmentAnalysis(_Analysis):
    """E4: a fleet aligned in weight precision only, ``uncorrected`` and ``corrected``, against
    the fully mixed fleet uncorrected (``mixed_uncorrected``)."""

    uncorrected: str
    corrected: str
    mixed_uncorrected: str


class TrainerAnalysis(_Analysis):
    """E1 and E2's main arms again with the Megatron trainer (``--trainer megatron``): its
    ``homogeneous`` and ``mixed`` arms uncorrected (E1's KL ratio, claimed ``claimed_ratio``) and
    its ``corrected`` mixed arm (E2: does the correction keep the score on the mixed fleet?)."""

    homogeneous: str
    mixed: str
    corrected: str
    claimed_ratio: float = Field(4.7, gt=0.0)

    def mismatch(self) -> MismatchAnalysis:
        """The E1 comparison of this trainer's arms."""
        return MismatchAnalysis(mixed=self.mixed, homogeneous=self.homogeneous, claimed_ratio=self.claimed_ratio)


class PowerAnalysis(_Analysis):
    """Seeds and held-out episodes a grid needs (:mod:`hetrl.experiment.power`), from this
    grid's spread as a pilot: the final held-out success of the runs of ``arms`` (None: every
    arm), its within-arm spread pooled, sets the seeds per arm that resolve each of ``margins`` at
    each of ``episodes`` held-out episodes per evaluation; ``plans`` (name -> arms) turn seeds into
    runs and hours at ``jobs`` runs at a time, set against ``budget_hours``. ``comparisons``
    (name -> ``[x, y]``) are the differences ``x − y`` the pilot itself measures."""

    arms: tuple[str, ...] | None = Field(None, min_length=1)
    comparisons: dict[str, tuple[str, str]] = Field(min_length=1)
    margins: tuple[float, ...] = Field((0.02, 0.025, 0.03), min_length=1)
    episodes: tuple[int, ...] = Field((140, 280, 560), min_length=1)
    plans: dict[str, int] = Field(min_length=1)
    jobs: int = Field(2, ge=1)
    budget_hours: float = Field(3.0, gt=0.0)

    @field_validator("margins")
    @classmethod
    def _margins(cls, margins: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 < m <= 1.0 for m in margins):
            raise ValueError(f"margins are success-rate differences in (0, 1], got {list(margins)}")
        return margins

    @field_validator("episodes")
    @classmethod
    def _episodes(cls, episodes: tuple[int, ...]) -> tuple[int, ...]:
        if any(e < 1 for e in episodes):
            raise ValueError(f"episodes must be >= 1, got {list(episodes)}")
        return episodes

    @field_validator("plans")
    @classmethod
    def _plans(cls, plans: dict[str, int]) -> dict[str, int]:
        if any(n < 1 for n in plans.values()):
            raise ValueError(f"a plan runs at least one arm, got {plans}")
        return plans

    def references(self) -> dict[str, str]:
        pooled = {f"arms[{i}]": a for i, a in enumerate(self.arms or ())}
        return {**pooled, **{f"comparisons.{name}[{i}]": arm for name, pair in self.comparisons.items()
                             for i, arm in enumerate(pair)}}


class Analyses(_Strict):
    """The named experiments; each is optional (a grid without it reports it as not run)."""

    e1: MismatchAnalysis | None = None
    e2: StabilityAnalysis | None = None
    e3: CostAnalysis | None = None
    e4: PartialAlignmentAnalysis | None = None
    megatron: TrainerAnalysis | None = None
    power: PowerAnalysis | None = None

    def present(self) -> dict[str, _Analysis]:
        return {k: v for k in type(self).model_fields if (v := getattr(self, k)) is not None}


class QuickConfig(_Strict):
    """The ``--quick`` scale: ``seeds`` and ``arms`` (None: the full grid's), ``defaults`` merged
    over the full grid's, ``fleets`` random fleets (None: the full grid's count)."""

    seeds: tuple[int, ...] | None = Field(None, min_length=1)
    defaults: Overrides = Field(default_factory=dict)
    arms: tuple[str, ...] | None = Field(None, min_length=1)
    fleets: int | None = Field(None, ge=0)


CLAIM_ANALYSES = ("e1", "e2", "e3", "e4", "megatron")
"""The analyses that test a claim of the public result (:mod:`hetrl.experiment.claims`)."""


class ExperimentConfig(_Strict):
    """The whole grid (module docstring). ``grad_spike_factor``: a step's gradient norm is a
    spike when it exceeds this multiple of its run's median gradient norm."""

    name: str = Field(pattern=_NAME.pattern)
    description: str = ""
    seeds: tuple[int, ...] = Field(min_length=1)
    defaults: Overrides = Field(default_factory=dict)
    arms: dict[str, ArmConfig] = Field(default_factory=dict)
    grad_spike_factor: float = Field(3.0, gt=1.0)
    any_mixture: AnyMixtureConfig | None = None
    analyses: Analyses = Analyses()
    caveats: dict[str, str] = Field(default_factory=dict, description=(
        "per claim-testing analysis (e1, e2, e3, e4, megatron): what the tiny CPU scale may explain where the "
        "measured figure and the public claim part; the report prints it under every claim that does not agree"))
    quick: QuickConfig | None = None

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: tuple[int, ...]) -> tuple[int, ...]:
        if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct and >= 0, got {list(seeds)}")
        return seeds

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms: dict[str, ArmConfig]) -> dict[str, ArmConfig]:
        bad = [n for n in arms if not _NAME.match(n)]
        if bad:
            raise ValueError(f"arm name {bad[0]!r} must match {_NAME.pattern} (it names a directory)")
        return arms

    @model_validator(mode="after")
    def _references(self) -> "ExperimentConfig":
        known = sorted(self.arms)
        for key, analysis in self.analyses.present().items():
            for field, arm in analysis.references().items():
                if arm not in self.arms:
                    raise ValueError(f"analyses.{key}.{field}: unknown arm {arm!r}; arms: {', '.join(known) or 'none'}")
        if self.quick is not None and self.quick.arms is not None:
            for i, arm in enumerate(self.quick.arms):
                if arm not in self.arms:
                    raise ValueError(f"quick.arms[{i}]: unknown arm {arm!r}; arms: {', '.join(known) or 'none'}")
        for key in self.caveats:
            if key not in CLAIM_ANALYSES:
                raise ValueError(f"caveats.{key}: not an analysis that tests a claim; use one of "
                                 f"{', '.join(CLAIM_ANALYSES)}")
        mixture = self.any_mixture
        if mixture is not None and mixture.seeds_per_fleet > len(self.seeds):
            raise ValueError(f"any_mixture.seeds_per_fleet ({mixture.seeds_per_fleet}) exceeds the {len(self.seeds)} seeds")
        if not self.arms and (mixture is None or mixture.fleets == 0):
            raise ValueError("the grid has no runs: give 'arms' or an 'any_mixture' with fleets > 0")
        return self

    def quick_scaled(self) -> "ExperimentConfig":
        """This grid scaled by its ``quick`` section (module docstring); no ``quick`` section is an error."""
        q = self.quick
        if q is None:
            raise ExperimentError(f"experiment {self.name!r} has no 'quick' section to scale it down with")
        arms = {n: a for n, a in self.arms.items() if q.arms is None or n in q.arms}
        analyses: dict[str, Any] = {}
        for key, analysis in self.analyses.present().items():
            if isinstance(analysis, StabilityAnalysis):
                kept = tuple(a for a in analysis.arms if a in arms)
                claim = {"homogeneous": analysis.homogeneous, "uncorrected": analysis.uncorrected,
                         "corrected": analysis.corrected}
                if not all(a in arms for a in claim.values() if a is not None):
                    claim = dict.fromkeys(claim)
                if kept:
                    analyses[key] = analysis.model_copy(update={"arms": kept, **claim})
            elif all(a in arms for a in analysis.references().values()):
                analyses[key] = analysis
        data = self.model_dump()
        data.update(seeds=q.seeds or self.seeds, defaults={**self.defaults, **q.defaults},
                    arms={n: a.model_dump() for n, a in arms.items()},
                    analyses={k: v.model_dump() for k, v in analyses.items()}, quick=None)
        if self.any_mixture is not None and q.fleets is not None:
            data["any_mixture"]["fleets"] = q.fleets
        return ExperimentConfig.model_validate(data)


def load_experiment(path: str | pathlib.Path, *, quick: bool = False) -> tuple[ExperimentConfig, pathlib.Path]:
    """Read and validate the experiment YAML at ``path`` (a path, or a name in ``configs/``),
    scaled by its ``quick`` section if ``quick``. Returns the config and the resolved file."""
    try:
        file = resolve_config_path(path)
        data = load_yaml(file.read_text(encoding="utf-8"))
    except ConfigError as err:
        raise ExperimentError(str(err)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ExperimentError(f"{path}: cannot read the experiment config: {err}") from None
    if not isinstance(data, dict):
        raise ExperimentError(f"{file}: the experiment config must be a map, got {type(data).__name__}")
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as err:
        lines = [f"{format_path(e['loc']) or '<root>'}: {e['msg']}" for e in err.errors()]
        raise ExperimentError(f"{file}: invalid experiment config:\n  " + "\n  ".join(lines)) from None
    return (config.quick_scaled() if quick else config), file
