"""Configuration of the Megatron trainer (pydantic, framework-free: the run config embeds it).

:class:`ParallelConfig` (tensor x pipeline x data sizes), :class:`OptimizerSettings` (AdamW on
megatron's learning-rate schedule) and :class:`MegatronTrainerConfig` (everything the trainer
needs besides the model's weights, checkpoint policy included).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.core.checkpoints import CheckpointConfig
from hetrl.core.correction import CorrectionConfig, correction_preset


class ParallelConfig(BaseModel):
    """Megatron parallel sizes; ``tensor × pipeline × data`` must equal the world size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensor: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)
    data: int = Field(1, ge=1)
    seed: int = Field(0, description="seed of megatron's model-parallel RNG tracker")



class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OptimizerSettings(_Frozen):
    """AdamW with global-norm clipping on megatron's learning-rate schedule.

    ``θ ← θ − η_t·(m̂/(√v̂ + ε) + λ·θ)`` (torch AdamW, decoupled decay, λ = 0 on biases and 1-D
    parameters), after ``g ← g·min(1, c/(‖g‖₂ + 1e-6))`` with ``c = grad_clip`` (None: no
    clipping). ``η_t``: megatron ``OptimizerParamScheduler`` with linear warmup from 0 over
    ``warmup_steps`` updates (step t uses ``η·t/W``, so a warmed-up run starts at 0), then
    ``schedule`` decay from ``learning_rate`` to ``min_learning_rate`` by ``decay_steps``.
    ``distributed``: megatron's distributed optimizer (state sharded over data-parallel ranks).
    """

    learning_rate: float = Field(1e-6, gt=0.0)
    min_learning_rate: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    decay_steps: int | None = Field(None, gt=0, description="end of the decay (required unless constant)")
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.999, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float | None = Field(1.0, gt=0.0)
    distributed: bool = False

    @model_validator(mode="after")
    def _schedule(self) -> "OptimizerSettings":
        if self.min_learning_rate > self.learning_rate:
            raise ValueError("min_learning_rate must not exceed learning_rate")
        if self.schedule != "constant" and (self.decay_steps is None or self.decay_steps <= self.warmup_steps):
            raise ValueError(f"schedule {self.schedule!r} needs decay_steps > warmup_steps")
        return self


class MegatronTrainerConfig(_Frozen):
    """Everything the Megatron trainer needs besides the model checkpoint.

    ``bf16``: BF16 parameters and activations (``Float16Module``) with FP32 master weights and
    FP32 gradient reduction; False: FP32 throughout. ``micro_batch_size``: rows per forward /
    backward (None: all local rows at once). ``parallel``: tensor and data parallelism (pipeline
    parallelism is refused: the model and weight mapping support stages, the step's metrics and
    log-probs do not yet). ``kernel_fusion``: megatron's fused kernels, which need CUDA plus
    Apex / Transformer Engine. ``checkpoint``: where :meth:`MegatronTrainer.save` writes
    (one ``dist_checkpointing`` directory per step), how often and how many are kept.
    """

    bf16: bool = True
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerSettings = OptimizerSettings()
    micro_batch_size: int | None = Field(None, gt=0)
    correction_preset: str = "hetrl"
    correction_overrides: dict[str, Any] = Field(default_factory=dict)
    normalize_advantage_std: bool = False
    kernel_fusion: bool = False
    checkpoint: CheckpointConfig = CheckpointConfig()

    @property
    def correction(self) -> CorrectionConfig:
        return correction_preset(self.correction_preset, **self.correction_overrides)

    @model_validator(mode="after")
    def _valid(self) -> "MegatronTrainerConfig":
        self.correction  # raises on a bad preset or override
        if self.parallel.pipeline > 1:
            raise ValueError("MegatronTrainer does not support pipeline parallelism yet (parallel.pipeline must be 1)")
        return self
