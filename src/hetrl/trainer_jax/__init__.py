"""The JAX trainer (Flax NNX model, Optax, mesh sharding, Orbax checkpoints).

Modules, one job each: :mod:`~hetrl.trainer_jax.config` (pydantic configuration),
:mod:`~hetrl.trainer_jax.mesh` (mesh, shardings, multi-host start-up and per-host batches),
:mod:`~hetrl.trainer_jax.optim` (AdamW + clipping + schedule), :mod:`~hetrl.trainer_jax.step`
(the jittable train step), :mod:`~hetrl.trainer_jax.logprobs` (per-token log-probs with mask
replay), :mod:`~hetrl.trainer_jax.checkpoint` (Orbax) and :mod:`~hetrl.trainer_jax.trainer` (:class:`JaxTrainer`, tying them together).

Importing the package imports no framework (``hetrl.trainer_jax.config`` is plain pydantic and
the run config embeds it); the names below load their submodule on first access.
"""

import importlib

_EXPORTS = {
    **dict.fromkeys(("DistributedConfig", "JaxTrainerConfig", "MeshConfig", "OptimizerConfig"), "config"),
    "initialize_distributed": "mesh", "make_mesh": "mesh",
    "JaxTrainer": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetrl.trainer_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrl.trainer_jax.{_EXPORTS[name]}"), name)
