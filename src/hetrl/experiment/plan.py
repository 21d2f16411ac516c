"""The runs of an experiment grid: every arm x seed (and every random fleet, corrected and
uncorrected) as a :class:`RunSpec`, each validated as a ``hetrl train`` config before any runs.

A run's overrides, in order (a later one wins): the grid's ``defaults``, the arm's own, then
``seed=<seed>``. Random fleet ``i`` gives two arms, ``any<i>_corrected`` and
``any<i>_uncorrected``: ``fleet.pools`` set to the drawn pools, then the corrected or
uncorrected overrides. Values are written as JSON, which is YAML, so ``hetrl train --set``
reads back exactly the typed value.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from hetrl.config import ConfigError, load_config, resolve_config_path
from hetrl.experiment.config import ExperimentConfig, ExperimentError, Overrides
from hetrl.experiment.fleets import RandomFleet, draw_fleets

__all__ = ["RunSpec", "MixturePair", "ExperimentPlan", "build_plan"]


@dataclass(frozen=True)
class RunSpec:
    """One ``hetrl train`` run: ``base`` config, ``overrides`` (``key=value`` strings, seed
    last) and the number of ``steps`` its config resolves to."""

    arm: str
    seed: int
    base: pathlib.Path
    overrides: tuple[str, ...]
    steps: int

    @property
    def key(self) -> str:
        """``<arm>/s<seed>``: the run's directory under ``runs/`` and its name in the report."""
        return f"{self.arm}/s{self.seed}"


@dataclass(frozen=True)
class MixturePair:
    """A random fleet and the names of its corrected and uncorrected arms."""

    fleet: RandomFleet
    corrected: str
    uncorrected: str


@dataclass(frozen=True)
class ExperimentPlan:
    """The validated grid: its config, the file it came from, every run, the random fleets."""

    config: ExperimentConfig
    source: pathlib.Path
    runs: tuple[RunSpec, ...]
    mixtures: tuple[MixturePair, ...]

    @property
    def arms(self) -> list[str]:
        """Arm names in grid order (explicit arms, then the random fleets')."""
        return list(dict.fromkeys(r.arm for r in self.runs))

    def runs_of(self, arm: str) -> list[RunSpec]:
        return [r for r in self.runs if r.arm == arm]

    def describe(self, arm: str) -> str:
        """The arm's ``description``, or for a random fleet's arm its variant and pools."""
        if arm in self.config.arms:
            return self.config.arms[arm].description
        pair = next(p for p in self.mixtures if arm in (p.corrected, p.uncorrected))
        variant = "corrected" if arm == pair.corrected else "uncorrected"
        return f"random fleet {pair.fleet.index}, {variant}: {pair.fleet.describe()}"


def _as_sets(overrides: Overrides) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def _resolve_base(base: str, source: pathlib.Path) -> pathlib.Path:
    local = source.parent / base
    return (local if local.exists() else resolve_config_path(base)).resolve()


def _arm_runs(arm: str, base: str, overrides: list[str], seeds: tuple[int, ...], source: pathlib.Path) -> list[RunSpec]:
    """The runs of one arm over ``seeds``; its config is loaded and validated once (the seed is
    the only difference between them), and checked for what the loop would refuse."""
    from hetrl.orchestrator.preflight import check_runnable

    try:
        path = _resolve_base(base, source)
        config = load_config(path, overrides + [f"seed={seeds[0]}"])
        check_runnable(config, str(path))
    except ConfigError as err:
        raise ExperimentError(f"{source}: arm {arm!r}: {err}") from None
    return [RunSpec(arm, s, path, tuple(overrides + [f"seed={s}"]), config.steps) for s in seeds]


def build_plan(config: ExperimentConfig, source: str | pathlib.Path) -> ExperimentPlan:
    """Every run of ``config`` (read from ``source``), validated (:class:`ExperimentError`
    naming the arm and the key otherwise)."""
    source = pathlib.Path(source)
    defaults = _as_sets(config.defaults)
    runs: list[RunSpec] = []
    for arm, spec in config.arms.items():
        runs += _arm_runs(arm, spec.base, defaults + _as_sets(spec.overrides), config.seeds, source)
    mixtures: list[MixturePair] = []
    mixture = config.any_mixture
    if mixture is not None:
        seeds = config.seeds[: mixture.seeds_per_fleet]
        for fleet in draw_fleets(mixture):
            names: dict[str, str] = {}
            variants: Mapping[str, Mapping[str, Any]] = {"corrected": mixture.corrected, "uncorrected": mixture.uncorrected}
            for variant, extra in variants.items():
                names[variant] = f"any{fleet.index}_{variant}"
                if names[variant] in config.arms:
                    raise ExperimentError(f"{source}: arm {names[variant]!r} collides with a random fleet's arm; rename it")
                sets = defaults + _as_sets({"fleet.pools": list(fleet.pools), **extra})
                runs += _arm_runs(names[variant], mixture.base, sets, seeds, source)
            mixtures.append(MixturePair(fleet, names["corrected"], names["uncorrected"]))
    return ExperimentPlan(config, source, tuple(runs), tuple(mixtures))
