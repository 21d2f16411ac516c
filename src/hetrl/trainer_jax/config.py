"""Configuration of the JAX trainer (pydantic, framework-free; the run config's ``trainer``
section when ``kind: jax``).

:class:`JaxTrainerConfig` is the shared :class:`hetrl.core.training.TrainerSettings` (compute
precision, the device mesh over axes ``data`` x ``fsdp`` x ``tensor``, the optimizer) plus the
multi-host start-up (:class:`DistributedConfig`). The off-policy correction and the checkpoint
policy are given to :class:`hetrl.trainer_jax.trainer.JaxTrainer` beside it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hetrl.core.training import MESH_AXES, MeshConfig, OptimizerConfig, TrainerSettings

__all__ = ["JaxTrainerConfig", "DistributedConfig", "MeshConfig", "OptimizerConfig", "MESH_AXES"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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


class JaxTrainerConfig(TrainerSettings):
    """Everything the JAX trainer is configured by besides the model, the correction and the
    checkpoint policy: :class:`TrainerSettings` and ``distributed``."""

    kind: Literal["jax"] = "jax"
    distributed: DistributedConfig = DistributedConfig()

    @field_validator("mesh")
    @classmethod
    def _no_pipeline(cls, mesh: MeshConfig) -> MeshConfig:
        if mesh.pipeline != 1:
            raise ValueError("the JAX trainer has no pipeline parallelism: set mesh.pipeline to 1")
        return mesh
