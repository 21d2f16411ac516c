"""The Megatron-LM (megatron-core) trainer, hetrl's primary trainer (BF16).

Modules, one job each: :mod:`~hetrl.trainer_megatron.model` (the Qwen2/Qwen3 ``GPTModel`` from
the shared :class:`hetrl.models.ModelConfig`, parallel start-up, attention masks),
:mod:`~hetrl.trainer_megatron.weights` (HF <-> megatron weight mapping, tensor-parallel shards),
:mod:`~hetrl.trainer_megatron.trainer` (:class:`MegatronTrainer`: corrected train step through
megatron's schedule, DDP and optimizer, dist_checkpointing, HF export) and
:mod:`~hetrl.trainer_megatron.cpu_shim` (the CPU test shim, applied only without CUDA).

Importing this package does not import megatron; its functions do.
"""

from hetrl.trainer_megatron.model import ParallelConfig
from hetrl.trainer_megatron.trainer import MegatronTrainer, MegatronTrainerConfig, OptimizerSettings

__all__ = ["ParallelConfig", "MegatronTrainer", "MegatronTrainerConfig", "OptimizerSettings"]
