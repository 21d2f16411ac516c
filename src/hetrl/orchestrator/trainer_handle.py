"""The trainer as the loop sees it: the :class:`TrainerHandle` protocol and :func:`build_trainer`.

Both trainers (:class:`hetrl.trainer_jax.trainer.JaxTrainer`,
:class:`hetrl.trainer_megatron.trainer.MegatronTrainer`) have this interface without importing
it (trainers never import the orchestrator); a backend may hand the loop a proxy to one in
another process (:class:`hetrl.orchestrator.ray_backend.RayTrainer`). The handle owns the weight
version: :attr:`TrainerHandle.version` is the number of steps trained, the loop stamps every
publication with it and nothing else keeps a copy (the fleet records only what it was last
sent, :attr:`hetrl.samplers.fleet.Fleet.published_version`).
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hetrl.core.schema import RolloutBatch

if TYPE_CHECKING:
    from hetrl.trainer_jax.config import JaxTrainerConfig
    from hetrl.trainer_megatron.config import MegatronTrainerConfig

__all__ = ["TrainerHandle", "build_trainer"]


class TrainerHandle(Protocol):
    """What the loop needs from the trainer (a trainer, or a proxy to one in another process)."""

    @property
    def version(self) -> int: ...

    def train_step(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None) -> dict[str, float]: ...

    def logprobs(self, batch: RolloutBatch) -> np.ndarray: ...

    def export_hf_weights(self) -> dict[str, np.ndarray]: ...

    def save(self, *, force: bool = True) -> bool: ...

    def restore(self) -> int: ...

    def checkpoint_steps(self) -> list[int]: ...

    def close(self) -> None: ...


def build_trainer(model_dir: str | pathlib.Path, config: "JaxTrainerConfig | MegatronTrainerConfig") -> TrainerHandle:
    """The trainer ``config`` configures (:class:`hetrl.trainer_jax.trainer.JaxTrainer` or
    :class:`hetrl.trainer_megatron.trainer.MegatronTrainer`), initialized from the HF
    checkpoint in ``model_dir``."""
    from hetrl.trainer_megatron.config import MegatronTrainerConfig

    if isinstance(config, MegatronTrainerConfig):
        from hetrl.trainer_megatron.trainer import MegatronTrainer

        return MegatronTrainer.from_hf(model_dir, config)
    from hetrl.trainer_jax.trainer import JaxTrainer

    return JaxTrainer.from_hf(model_dir, config)
