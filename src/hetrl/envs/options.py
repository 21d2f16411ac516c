"""The options of the environments a run config names (``environment.options``), validated when
the config is loaded (:class:`hetrl.config.RunConfig`), so a typo there fails naming the key
before anything starts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.envs.agent import AgentEnvConfig
from hetrl.envs.coding import CodingEnvConfig
from hetrl.envs.tasks_synthetic import SuiteConfig

__all__ = ["EvalOptions", "SyntheticEnvOptions", "CodingEnvOptions"]


class EvalOptions(BaseModel):
    """Held-out evaluation: before the first step and every ``every`` steps (0: never; the last
    step is always evaluated when enabled) on the first ``tasks`` held-out tasks (None: all),
    ``greedy``, or with the rollouts' own sampling parameters (``async.sampling``: the policy as
    it is sampled for training, truncation included) and ``samples`` episodes per task (the
    success rate is then the mean over ``tasks x samples`` episodes: a lower-variance estimate).
    Every evaluation restarts the evaluation sampler's random stream at the run's seed (common
    random numbers): two evaluations differ by what the policy changed, not by fresh sampling
    noise, so the difference between steps is measured with much less variance than either."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    every: int = Field(10, ge=0)
    tasks: int | None = Field(16, ge=1)
    greedy: bool = True
    samples: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> "EvalOptions":
        if self.greedy and self.samples > 1:
            raise ValueError("samples > 1 needs greedy: false (greedy episodes are all the same)")
        return self


class SyntheticEnvOptions(BaseModel):
    """``environment.options`` of ``name: synthetic``: ``suite`` (None: the warm start's suite
    when the model is a warm start, else the default suite with the run's seed), ``eval`` and
    ``coding`` (the :class:`CodingEnvConfig`, e.g. ``max_turns``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    suite: SuiteConfig | None = None
    eval: EvalOptions = EvalOptions()
    coding: CodingEnvConfig = CodingEnvConfig()


class CodingEnvOptions(BaseModel):
    """``environment.options`` of ``name: coding``: task sets from files or by name (sources of
    :func:`hetrl.envs.task_files.load_tasks`: ``humaneval``, ``realcode``, a HumanEval/MBPP JSONL
    file...). ``train``: the tasks trained on, in passes; ``heldout``: the evaluation tasks (None:
    ``heldout_fraction`` of ``train``'s tasks, drawn by the run's seed, are held out of training);
    ``eval`` and ``coding`` as for ``synthetic``; ``agent``: play the (repository) tasks through
    tool calls (:class:`hetrl.envs.agent.AgentRepoEnv`) instead of whole-file answers. Relative
    file paths are relative to the working directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: str = Field(min_length=1)
    heldout: str | None = None
    heldout_fraction: float = Field(0.1, gt=0, lt=1)
    eval: EvalOptions = EvalOptions()
    coding: CodingEnvConfig = CodingEnvConfig()
    agent: AgentEnvConfig | None = None
