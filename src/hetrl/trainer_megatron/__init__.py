"""The Megatron-LM (megatron-core) trainer, hetrl's primary trainer (BF16).

Modules, one job each: :mod:`~hetrl.trainer_megatron.model` (the Qwen2/Qwen3 ``GPTModel`` from
the shared :class:`hetrl.models.ModelConfig`, parallel start-up, attention masks),
:mod:`~hetrl.trainer_megatron.weights` (HF <-> megatron weight mapping, tensor-parallel shards),
:mod:`~hetrl.trainer_megatron.trainer` (:class:`MegatronTrainer`: corrected train step through
megatron's schedule, DDP and optimizer, dist_checkpointing, HF export) and
:mod:`~hetrl.trainer_megatron.cpu_shim` (the CPU test shim, applied only without CUDA) and
:mod:`~hetrl.trainer_megatron.config` (its pydantic configuration).

Importing this package imports neither torch nor megatron (:mod:`~hetrl.trainer_megatron.config`
is plain pydantic and the run config embeds it); the names below load their submodule on first
access.
"""

import importlib

_EXPORTS = {"MegatronTrainerConfig": "config", "MegatronTrainer": "trainer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetrl.trainer_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrl.trainer_megatron.{_EXPORTS[name]}"), name)
