"""The trainer as the loop sees it: the :class:`TrainerHandle` protocol, the :class:`TrainerSetup`
it is built from and :func:`build_trainer`.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hetrl.core.checkpoints import CheckpointConfig
from hetrl.core.correction import CorrectionConfig
from hetrl.core.schema import RolloutBatch

if TYPE_CHECKING:
    from hetrl.config import RunConfig
    from hetrl.trainer_jax.config import JaxTrainerConfig
    from hetrl.trainer_megatron.config import MegatronTrainerConfig

__all__ = ["TrainerHandle", "TrainerSetup", "build_trainer"]


@dataclass(frozen=True)
class TrainerSetup:
    """What a trainer is built from: its ``settings`` (the run config's ``trainer`` section, whose
    ``kind`` picks the trainer), the resolved ``correction``, the ``checkpoint`` policy and the
    run's ``seed`` (megatron's model-parallel RNG tracker)."""

    settings: "JaxTrainerConfig | MegatronTrainerConfig"
    correction: CorrectionConfig
    checkpoint: CheckpointConfig
    seed: int = 0

    @classmethod
    def of(cls, config: "RunConfig", checkpoint_dir: str | pathlib.Path) -> "TrainerSetup":
        """The setup of ``config``'s trainer, checkpointing under ``checkpoint_dir``."""
        return cls(config.trainer, config.correction.resolve(),
                   config.checkpointing.checkpoint_config(str(checkpoint_dir)), config.seed)


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


def build_trainer(model_dir: str | pathlib.Path, setup: TrainerSetup) -> TrainerHandle:
    """The trainer ``setup`` describes (:class:`hetrl.trainer_jax.trainer.JaxTrainer` or
    :class:`hetrl.trainer_megatron.trainer.MegatronTrainer`), initialized from the HF
    checkpoint in ``model_dir``. A JAX trainer first joins its processes when ``trainer.distributed``
    or the environment (``HETRL_COORDINATOR``, as :mod:`hetrl.orchestrator.trainer_ranks` sets it)
    names a coordinator."""
    if setup.settings.kind == "megatron":
        from hetrl.trainer_megatron.trainer import MegatronTrainer

        return MegatronTrainer.from_hf(model_dir, setup.settings, correction=setup.correction,
                                       checkpoint=setup.checkpoint, seed=setup.seed)
    from hetrl.trainer_jax.mesh import initialize_distributed
    from hetrl.trainer_jax.trainer import JaxTrainer

    initialize_distributed(setup.settings.distributed)
    return JaxTrainer.from_hf(model_dir, setup.settings, correction=setup.correction, checkpoint=setup.checkpoint)
