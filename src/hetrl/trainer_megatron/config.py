"""Configuration of the Megatron trainer (pydantic, framework-free; the run config's ``trainer``
section when ``kind: megatron``).

:class:`MegatronTrainerConfig` is the shared :class:`hetrl.core.training.TrainerSettings`
(compute precision, the rank mesh, the optimizer) plus megatron's own keys. The off-policy
correction, the checkpoint policy and the seed of megatron's model-parallel RNG tracker are
given to :class:`hetrl.trainer_megatron.trainer.MegatronTrainer` beside it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from hetrl.core.training import MeshConfig, OptimizerConfig, TrainerSettings

__all__ = ["MegatronTrainerConfig", "MeshConfig", "OptimizerConfig"]


class MegatronTrainerConfig(TrainerSettings):
    """Everything the Megatron trainer is configured by besides the model, the correction and
    the checkpoint policy.

    ``compute_dtype: bf16``: BF16 parameters and activations (``Float16Module``) with FP32
    master weights and FP32 gradient reduction. ``mesh``: over N ranks, ``tensor`` is the
    tensor-parallel size and ``data x fsdp`` the data-parallel one (pipeline stages are refused:
    the model and weight mapping support them, the step's metrics and log-probs do not yet).
    ``distributed_optimizer``: megatron's distributed optimizer (optimizer state sharded over the
    data-parallel ranks). ``micro_batch_size``: rows per forward / backward (None: all local
    rows at once). ``kernel_fusion``: megatron's fused kernels, which need CUDA plus Apex /
    Transformer Engine. The optimizer's ``decay_vectors`` is refused: megatron never decays
    biases and norms."""

    kind: Literal["megatron"] = "megatron"
    distributed_optimizer: bool = False
    micro_batch_size: int | None = Field(None, gt=0)
    kernel_fusion: bool = False

    @field_validator("mesh")
    @classmethod
    def _no_pipeline(cls, mesh: MeshConfig) -> MeshConfig:
        if mesh.pipeline != 1:
            raise ValueError("the Megatron trainer does not run pipeline stages yet: set mesh.pipeline to 1")
        return mesh

    @field_validator("optimizer")
    @classmethod
    def _no_vector_decay(cls, optimizer: OptimizerConfig) -> OptimizerConfig:
        if optimizer.decay_vectors and optimizer.weight_decay:
            raise ValueError("the Megatron trainer never decays biases and norms: set decay_vectors to false")
        return optimizer

    def parallel_sizes(self, world_size: int) -> tuple[int, int, int]:
        """``(tensor, pipeline, data)`` parallel sizes on ``world_size`` ranks (data = the mesh's
        data x fsdp); raises ValueError when the mesh does not fill them."""
        data, fsdp, tensor = self.mesh.resolve(world_size)
        return tensor, self.mesh.pipeline, data * fsdp
