"""The settings every trainer shares, in one vocabulary (pydantic, framework-free).

:class:`OptimizerConfig` (AdamW, clipping, the learning-rate schedule), :class:`MeshConfig` (how
the trainer's ranks or devices are laid out) and :class:`TrainerSettings` (those two, the compute
precision and the GRPO option). Each trainer's own config (:class:`hetrl.trainer_jax.config.JaxTrainerConfig`,
:class:`hetrl.trainer_megatron.config.MegatronTrainerConfig`) is this plus its ``kind`` and its
own keys, and is the run config's ``trainer`` section as it stands: switching ``trainer.kind``
keeps every shared setting's meaning, and a setting the other trainer cannot honour is refused
naming it (by its validators, or as a key that trainer does not have).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["OptimizerConfig", "MeshConfig", "MESH_AXES", "MESH_SHORTHANDS", "TrainerSettings"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OptimizerConfig(_Frozen):
    """AdamW: ``m ← β1·m + (1−β1)·g``, ``v ← β2·v + (1−β2)·g²``,
    ``θ ← θ − η_t·(m̂/(√v̂ + ε) + λ·θ)``, after clipping g to global norm ``grad_clip`` (None:
    no clipping). Weight decay λ applies to matrices only (biases and norms are not decayed)
    unless ``decay_vectors``.

    Schedule ``η_t``: linear warmup from 0 to ``learning_rate`` over ``warmup_steps`` updates,
    then ``schedule``: ``constant``, or a ``linear`` or ``cosine`` decay to ``min_learning_rate``
    reached at update ``decay_steps`` (counted from the first update, warmup included). Each
    trainer states its step-exact rule (:func:`hetrl.trainer_jax.optim.learning_rate_schedule`:
    the first update already moves; megatron's ``OptimizerParamScheduler``: the first warmup
    update is at 0).
    """

    learning_rate: float = Field(1e-6, gt=0.0)
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.999, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    decay_vectors: bool = False
    grad_clip: float | None = Field(1.0, gt=0.0, description="global-norm clip; None disables")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    decay_steps: int | None = Field(None, gt=0, description="end of the decay (required unless constant)")
    min_learning_rate: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _schedule(self) -> "OptimizerConfig":
        if self.min_learning_rate > self.learning_rate:
            raise ValueError("min_learning_rate must not exceed learning_rate")
        if self.schedule != "constant" and (self.decay_steps is None or self.decay_steps <= self.warmup_steps):
            raise ValueError(f"schedule {self.schedule!r} needs decay_steps > warmup_steps")
        return self


MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
"""The data-parallel and tensor axes, outermost first (the batch is split over ``data`` x ``fsdp``)."""


class MeshConfig(_Frozen):
    """How the trainer's N ranks (Megatron) or devices (JAX) are laid out:
    ``data x fsdp x tensor x pipeline = N``; exactly one of data, fsdp, tensor may be ``-1`` =
    whatever is left over.

    ``data``: data parallelism, parameters replicated; ``fsdp``: data parallelism with the
    training state sharded over it (JAX: parameters and optimizer state; Megatron: the optimizer
    state when ``distributed_optimizer``); ``tensor``: tensor (model) parallelism; ``pipeline``:
    pipeline stages (no trainer runs them yet: each refuses ``pipeline > 1`` naming it)."""

    data: int = Field(1, ge=-1)
    fsdp: int = Field(-1, ge=-1)
    tensor: int = Field(1, ge=-1)
    pipeline: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _sizes(self) -> "MeshConfig":
        sizes = (self.data, self.fsdp, self.tensor)
        if 0 in sizes:
            raise ValueError(f"mesh axis sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
        if sizes.count(-1) > 1:
            raise ValueError("at most one mesh axis may be -1")
        return self

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` with the ``-1`` axis filled so that their product times
        ``pipeline`` is ``num_devices``; raises ValueError when that cannot be."""
        sizes = [self.data, self.fsdp, self.tensor]
        fixed = math.prod(s for s in sizes if s != -1) * self.pipeline
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(f"{num_devices} devices cannot be split into a mesh with fixed axes of product {fixed}")
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) * self.pipeline != num_devices:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} x pipeline {self.pipeline} needs "
                             f"{math.prod(sizes) * self.pipeline} devices, {num_devices} available")
        return tuple(sizes)  # type: ignore[return-value]


MESH_SHORTHANDS: dict[str, str] = {"tensor_parallel": "tensor", "data_parallel": "data", "pipeline_parallel": "pipeline"}
"""Megatron's names for the mesh axes, accepted as ``trainer`` keys on input
(``trainer.tensor_parallel: 2`` is ``trainer.mesh.tensor: 2``); the layout is kept once, in ``mesh``."""


class TrainerSettings(_Frozen):
    """What every trainer is configured by (each trainer's config narrows ``kind`` and adds its own keys):
    ``compute_dtype`` (``bf16``: FP32 master weights, BF16 matmul inputs and activations with
    FP32 accumulation; ``fp32``: FP32 throughout), ``world_size`` (the number of trainer ranks
    (Megatron) or processes (JAX) the loop runs), the ``mesh`` laid over them, the ``optimizer``
    and ``normalize_advantage_std`` (GRPO: divide the advantages by the group's reward std).

    The off-policy correction and the checkpoint policy are not trainer settings: the run config
    owns them (``correction``, ``checkpointing``) and the trainer is given them when it is built."""

    kind: str
    """The trainer (each trainer's config narrows it to its own name)."""
    compute_dtype: Literal["bf16", "fp32"] = "bf16"
    world_size: int = Field(1, ge=1)
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    normalize_advantage_std: bool = False

    @model_validator(mode="before")
    @classmethod
    def _mesh_shorthands(cls, data: object) -> object:
        """Moves :data:`MESH_SHORTHANDS` keys into ``mesh``; a shorthand and a mesh axis that disagree are refused."""
        if not isinstance(data, dict) or not MESH_SHORTHANDS.keys() & data.keys():
            return data
        data = dict(data)
        mesh = data.get("mesh", {})
        mesh = mesh.model_dump(exclude_unset=True) if isinstance(mesh, MeshConfig) else dict(mesh)
        for key, axis in MESH_SHORTHANDS.items():
            if key in data:
                size = data.pop(key)
                if mesh.setdefault(axis, size) != size:
                    raise ValueError(f"{key}: {size} contradicts mesh.{axis}: {mesh[axis]} (the same axis): set one of them")
        data["mesh"] = mesh
        return data
