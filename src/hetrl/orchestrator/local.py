"""The LOCAL backend of the asynchronous loop (DESIGN §5): one process, threads.

The loop itself is :class:`hetrl.orchestrator.loop.AsyncOrchestrator`; here every replica's
embedded sampler and the trainer (JAX or Megatron) are plain objects in the driver process, called directly
from the rollout workers and the trainer loop (JAX releases the GIL while it computes). Weights
reach the embedded replicas in process (:class:`hetrl.orchestrator.transport.InProcessTransport`:
quantized once per weight format, loaded in place). With ``trainer.world_size`` > 1 the trainer
is that many ranks (:class:`hetrl.orchestrator.trainer_ranks.TrainerRanks`): rank 0 in this
process, the others in worker processes.
"""

from __future__ import annotations

from typing import Sequence

from hetrl.orchestrator.loop import AsyncOrchestrator, build_embedded_sampler
from hetrl.orchestrator.trainer_handle import TrainerHandle, TrainerSetup, build_trainer
from hetrl.orchestrator.trainer_ranks import TrainerRanks
from hetrl.orchestrator.transport import InProcessTransport, WeightTransport
from hetrl.samplers.base import Sampler
from hetrl.samplers.profiles import SamplerNumerics

__all__ = ["LocalOrchestrator"]


class LocalOrchestrator(AsyncOrchestrator):
    """Runs a config with samplers and trainer in this process (see the module docstring)."""

    backend = "local"

    def _create_sampler(self, numerics: SamplerNumerics, *, pool: str, seed: int) -> Sampler:
        return build_embedded_sampler(self.model_dir, numerics, pool=pool, seed=seed)

    def _create_trainer(self, setup: TrainerSetup) -> TrainerHandle:
        if setup.settings.world_size > 1:
            return TrainerRanks(self.model_dir, setup)
        return build_trainer(self.model_dir, setup)

    def _embedded_transport(self, numerics: Sequence[SamplerNumerics]) -> WeightTransport:
        return InProcessTransport(self.model_config, numerics)
