"""The JAX trainer (Flax NNX model, Optax, mesh sharding, Orbax checkpoints, Grain prompts).

Modules, one job each: :mod:`~hetrl.trainer_jax.config` (pydantic configuration),
:mod:`~hetrl.trainer_jax.mesh` (mesh, shardings, multi-host start-up and per-host batches),
:mod:`~hetrl.trainer_jax.optim` (AdamW + clipping + schedule), :mod:`~hetrl.trainer_jax.step`
(the jittable train step), :mod:`~hetrl.trainer_jax.logprobs` (per-token log-probs with mask
replay), :mod:`~hetrl.trainer_jax.checkpoint` (Orbax), :mod:`~hetrl.trainer_jax.data` (Grain
prompt pipeline) and :mod:`~hetrl.trainer_jax.trainer` (:class:`JaxTrainer`, tying them together).
"""

from hetrl.trainer_jax.config import (
    CheckpointConfig, DistributedConfig, JaxTrainerConfig, MeshConfig, OptimizerConfig, PromptDataConfig,
)
from hetrl.trainer_jax.data import prompt_dataset, prompt_iterator
from hetrl.trainer_jax.mesh import initialize_distributed, make_mesh
from hetrl.trainer_jax.trainer import JaxTrainer

__all__ = [
    "CheckpointConfig", "DistributedConfig", "JaxTrainerConfig", "MeshConfig", "OptimizerConfig", "PromptDataConfig",
    "prompt_dataset", "prompt_iterator", "initialize_distributed", "make_mesh", "JaxTrainer",
]
