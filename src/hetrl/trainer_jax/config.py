"""Configuration of the JAX trainer (pydantic, framework-free).

:class:`JaxTrainerConfig` gathers: the optimizer (:class:`OptimizerConfig`, AdamW with global-norm
clipping and a warmup schedule), the compute precision (``bf16``: FP32 master weights, BF16
matmuls with FP32 accumulation; ``fp32``: everything in FP32), the device mesh
(:class:`MeshConfig`, axes ``data`` x ``fsdp`` x ``tensor``), the off-policy correction (a preset
of :data:`hetrl.core.correction.PRESETS` plus field overrides), checkpointing
(:class:`hetrl.core.checkpoints.CheckpointConfig`) and the multi-host start-up
(:class:`DistributedConfig`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.core.checkpoints import CheckpointConfig
from hetrl.core.correction import CorrectionConfig, correction_preset

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
"""Mesh axis names, outermost first. The batch axis is sharded over ``("data", "fsdp")``."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MeshConfig(_Frozen):
    """Sizes of the mesh axes; exactly one may be ``-1`` = all devices left over.

    ``data``: pure data parallelism (parameters replicated); ``fsdp``: data parallelism with
    parameters and optimizer state sharded; ``tensor``: tensor (model) parallelism.
    """

    data: int = Field(1, ge=-1)
    fsdp: int = Field(-1, ge=-1)
    tensor: int = Field(1, ge=-1)

    @model_validator(mode="after")
    def _sizes(self) -> "MeshConfig":
        sizes = (self.data, self.fsdp, self.tensor)
        if 0 in sizes:
            raise ValueError(f"mesh axis sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
        if sizes.count(-1) > 1:
            raise ValueError("at most one mesh axis may be -1")
        return self

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` with the ``-1`` axis filled so the product is ``num_devices``."""
        sizes = [self.data, self.fsdp, self.tensor]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(f"{num_devices} devices cannot be split into a mesh with fixed axes of product {fixed}")
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) != num_devices:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, {num_devices} available")
        return tuple(sizes)  # type: ignore[return-value]


class OptimizerConfig(_Frozen):
    """AdamW: ``m ← β1·m + (1−β1)·g``, ``v ← β2·v + (1−β2)·g²``,
    ``θ ← θ − η_t·(m̂/(√v̂ + ε) + λ·θ)``, after clipping g to global norm ``grad_clip``.

    Schedule ``η_t``: linear warmup from 0 over ``warmup_steps``, then constant, or cosine decay
    to ``min_lr_ratio·learning_rate`` at ``total_steps``. Weight decay λ applies to matrices
    only (ndim ≥ 2) unless ``decay_vectors``.
    """

    learning_rate: float = Field(1e-6, gt=0.0)
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.999, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    decay_vectors: bool = False
    grad_clip: float | None = Field(1.0, gt=0.0, description="global-norm clip; None disables")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = Field(None, gt=0, description="end of the cosine decay")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _cosine(self) -> "OptimizerConfig":
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError("schedule 'cosine' needs total_steps > warmup_steps")
        return self


class DistributedConfig(_Frozen):
    """Multi-process start-up (``jax.distributed.initialize``).

    Unset fields fall back to the environment (``HETRL_COORDINATOR``, ``HETRL_NUM_PROCESSES``,
    ``HETRL_PROCESS_ID``). With a coordinator address the processes join it explicitly; with
    ``auto`` JAX detects the cluster itself (TPU pods, SLURM); otherwise the run is one process.
    """

    auto: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = Field(None, gt=0)
    process_id: int | None = Field(None, ge=0)
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = Field(300, gt=0)
    cpu_collectives: Literal["gloo", "mpi"] = Field("gloo", description="cross-process collectives of the CPU backend")


class JaxTrainerConfig(_Frozen):
    """Everything the JAX trainer needs besides the model checkpoint."""

    compute_dtype: Literal["bf16", "fp32"] = "bf16"
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    correction_preset: str = "hetrl"
    correction_overrides: dict[str, Any] = Field(default_factory=dict)
    normalize_advantage_std: bool = Field(False, description="GRPO: divide A by the group std")
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="after")
    def _correction_valid(self) -> "JaxTrainerConfig":
        correction_preset(self.correction_preset, **self.correction_overrides)  # raises on a bad preset/override
        return self

    @property
    def correction(self) -> CorrectionConfig:
        """The resolved :class:`CorrectionConfig` (preset + overrides)."""
        return correction_preset(self.correction_preset, **self.correction_overrides)
