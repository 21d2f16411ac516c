"""The JAX trainer: an HF checkpoint in, corrected RL steps on a device mesh, HF weights out.

State: FP32 master parameters θ (``nnx.Param`` state of :class:`hetrl.models.qwen_jax.QwenModel`,
sharded by its partitioning metadata), the optimizer state (sharded like θ), and ``step`` = the
number of updates applied = the weight ``version`` samplers are stamped with. The model computes
in ``config.compute_dtype`` (BF16 matmul inputs with FP32 accumulation, or FP32).

Multi-host: call ``initialize_distributed(config.distributed)`` (:mod:`hetrl.trainer_jax.mesh`)
before anything else touches JAX; then every process builds the same trainer and passes, to
:meth:`JaxTrainer.train_step`, only its own rows of the global batch
(:meth:`JaxTrainer.local_rows`), collated globally (group and pool indices of the whole batch, the
same ``pool_names`` everywhere). All methods are collective.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetrl.core.checkpoints import CheckpointConfig
from hetrl.core.correction import PRESETS, CorrectionConfig
from hetrl.core.schema import RolloutBatch
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import load_state_dict, save_hf_export
from hetrl.models.qwen_jax import Numerics, from_hf_state_dict, to_hf_state_dict
from hetrl.trainer_jax.checkpoint import TrainCheckpointer, abstract_like
from hetrl.trainer_jax.config import JaxTrainerConfig
from hetrl.trainer_jax.logprobs import make_logprob_fn
from hetrl.trainer_jax.mesh import (
    BATCH_AXES, batch_sharding, gather_to_host, local_batch_rows, local_rows_to_numpy, make_mesh, place, replicated,
    replicated_to_numpy, shard_batch, state_shardings,
)
from hetrl.trainer_jax.optim import learning_rate_schedule, make_optimizer
from hetrl.trainer_jax.step import STEP_FIELDS, make_train_step

__all__ = ["JaxTrainer", "numerics_for"]

_COMPUTE_DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def numerics_for(compute_dtype: str) -> Numerics:
    """Training numerics: matmul inputs and activations in ``compute_dtype``, FP32 accumulation
    and softmax (``bf16`` = BF16 compute over FP32 master weights)."""
    return Numerics(compute_dtype=_COMPUTE_DTYPES[compute_dtype], accum_dtype=jnp.float32, softmax_dtype=jnp.float32)


class JaxTrainer:
    """Corrected policy-gradient training of a Qwen2/Qwen3 model on a ``data x fsdp x tensor`` mesh."""

    def __init__(
        self,
        model_config: ModelConfig,
        hf_state: Mapping[str, np.ndarray],
        config: JaxTrainerConfig = JaxTrainerConfig(),
        *,
        correction: CorrectionConfig = PRESETS["hetrl"],
        checkpoint: CheckpointConfig = CheckpointConfig(),
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.config, self.correction, self.checkpoint = config, correction, checkpoint
        self.model_config = model_config
        self.mesh = make_mesh(config.mesh) if mesh is None else mesh
        model = from_hf_state_dict(model_config, hf_state, param_dtype=jnp.float32, numerics=numerics_for(config.compute_dtype))
        self._graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self._param_shardings = state_shardings(params, self.mesh)
        self._rest_shardings = state_shardings(rest, self.mesh)
        self.params = place(params, self._param_shardings)
        self._rest = place(rest, self._rest_shardings)
        del model, params, rest

        self._tx = make_optimizer(config.optimizer)
        self._schedule = learning_rate_schedule(config.optimizer)
        self._opt_shardings = optax.tree_map_params(
            self._tx, lambda _, sharding: sharding, jax.eval_shape(self._tx.init, self.params), self._param_shardings,
            transform_non_params=lambda _: replicated(self.mesh),
        )
        self.opt_state = jax.jit(self._tx.init, out_shardings=self._opt_shardings)(self.params)
        self.step = 0
        self._train_fns: dict[tuple[tuple[str, ...], bool], Any] = {}
        self._logprob_fn = None
        self._checkpointer: TrainCheckpointer | None = None

    @classmethod
    def from_hf(cls, directory: str | os.PathLike, config: JaxTrainerConfig = JaxTrainerConfig(),
                **kwargs: Any) -> "JaxTrainer":
        """A trainer initialized from an HF checkpoint directory (``config.json`` + safetensors);
        ``kwargs``: those of the constructor (``correction``, ``checkpoint``, ``mesh``)."""
        return cls(ModelConfig.load(directory), load_state_dict(directory), config, **kwargs)

    @property
    def version(self) -> int:
        """The weight version: the number of optimizer updates applied."""
        return self.step

    # ------------------------------------------------------------------ batches
    def local_rows(self, global_batch_size: int) -> slice:
        """The rows of a ``global_batch_size``-row batch this process must pass to
        :meth:`train_step` and :meth:`logprobs` (all rows with one process)."""
        return local_batch_rows(self.mesh, global_batch_size)

    def _global_batch(self, batch: RolloutBatch, extra: Mapping[str, np.ndarray] | None = None) -> dict[str, jax.Array]:
        """Global :data:`STEP_FIELDS` (+ ``extra``) arrays from this process's rows. The global
        row count is the local one scaled by the share of the batch shards this process holds."""
        shards = int(np.prod([self.mesh.shape[a] for a in BATCH_AXES]))
        share = self.local_rows(shards)
        global_rows = batch.batch_size * shards // (share.stop - share.start)
        arrays = {name: batch.arrays[name] for name in STEP_FIELDS} | dict(extra or {})
        return shard_batch(arrays, self.mesh, global_rows)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None) -> dict[str, float]:
        """One optimizer update on ``batch`` (this process's rows); returns the metrics of
        :mod:`hetrl.trainer_jax.step` as floats plus ``learning_rate`` and ``version`` (the
        version that consumed the batch). ``old_logprobs`` [B_local, L] (from :meth:`logprobs`
        before the first update on this batch) is required exactly when the correction uses
        PPO-clip."""
        if (self.correction.ppo_clip is not None) != (old_logprobs is not None):
            raise ValueError("old_logprobs must be given exactly when the correction uses ppo_clip (compute them with logprobs())")
        extra = {} if old_logprobs is None else {"old_logprobs": np.asarray(old_logprobs, np.float32)}
        arrays = self._global_batch(batch, extra)
        old = arrays.pop("old_logprobs", None)
        fn = self._train_fn(tuple(batch.pool_names), old is not None)
        version = place(np.int32(self.step), replicated(self.mesh))
        args = (self.params, self._rest, self.opt_state, arrays, version) + ((old,) if old is not None else ())
        self.params, self.opt_state, metrics = fn(*args)
        out = {k: float(v) for k, v in replicated_to_numpy(metrics).items()}
        out["learning_rate"] = float(self._schedule(self.step))
        out["version"] = float(self.step)
        self.step += 1
        return out

    def _train_fn(self, pool_names: tuple[str, ...], with_old: bool):
        key = (pool_names, with_old)
        if key not in self._train_fns:
            step = make_train_step(self._graphdef, self._tx, self.correction, pool_names=pool_names,
                                   normalize_std=self.config.normalize_advantage_std)
            data = batch_sharding(self.mesh)
            in_shardings = (self._param_shardings, self._rest_shardings, self._opt_shardings, data, replicated(self.mesh))
            self._train_fns[key] = jax.jit(
                step,
                in_shardings=in_shardings + ((data,) if with_old else ()),
                out_shardings=(self._param_shardings, self._opt_shardings, replicated(self.mesh)),
                donate_argnums=(0, 2),
            )
        return self._train_fns[key]

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """Trainer ``log p(a_t)`` [B_local, L] of this process's rows, with mask replay on kept
        supports when the correction replays (:mod:`hetrl.trainer_jax.logprobs`)."""
        if self._logprob_fn is None:
            data = batch_sharding(self.mesh)
            self._logprob_fn = jax.jit(
                make_logprob_fn(self._graphdef, self.correction.replay),
                in_shardings=(self._param_shardings, self._rest_shardings, data), out_shardings=data,
            )
        return local_rows_to_numpy(self._logprob_fn(self.params, self._rest, self._global_batch(batch)))

    # ------------------------------------------------------------------ weights out
    def export_hf_weights(self) -> dict[str, np.ndarray]:
        """The current weights as float32 numpy arrays under HF names (``[out, in]`` layout),
        gathered to every host, for ``Sampler.update_weights(trainer.version, weights)``."""
        model = nnx.merge(self._graphdef, gather_to_host(self.params), gather_to_host(self._rest))
        return to_hf_state_dict(model)

    def save_hf(self, directory: str | os.PathLike) -> pathlib.Path:
        """Write the current weights as an HF checkpoint (``config.json``, safetensors) with
        ``hetrl_version.txt`` = :attr:`version` (process 0 writes; every process calls)."""
        weights = self.export_hf_weights()
        if jax.process_index() == 0:
            save_hf_export(directory, self.model_config, weights, self.version)
        return pathlib.Path(directory)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoints(self) -> TrainCheckpointer:
        if self._checkpointer is None:
            cfg = self.checkpoint
            if cfg.directory is None:
                raise ValueError("checkpoint.directory is not set")
            self._checkpointer = TrainCheckpointer(cfg.directory, keep=cfg.keep, async_save=cfg.async_save)
        return self._checkpointer

    def save(self, *, force: bool = True) -> bool:
        """Checkpoint the state at :attr:`step`. ``force=False`` saves only every
        ``checkpoint.every`` steps. Returns whether it saved."""
        if not force and not self.checkpoint.due(self.step):
            return False
        meta = {"step": self.step, "model_config": self.model_config.model_dump(mode="json")}
        self._checkpoints().save(self.step, self.params, self.opt_state, meta)
        return True

    def restore(self, step: int | None = None) -> int:
        """Load checkpoint ``step`` (default: the latest) into this trainer; returns the restored step."""
        params, opt_state, meta = self._checkpoints().restore(abstract_like(self.params), abstract_like(self.opt_state), step)
        if meta["model_config"] != self.model_config.model_dump(mode="json"):
            raise ValueError(f"checkpoint model config {meta['model_config']} differs from this trainer's model")
        self.params, self.opt_state, self.step = params, opt_state, int(meta["step"])
        return self.step

    def checkpoint_steps(self) -> list[int]:
        """Steps of the checkpoints on disk (after retention)."""
        checkpoints = self._checkpoints()
        checkpoints.wait()
        return checkpoints.all_steps()

    def close(self) -> None:
        """Finish pending checkpoint writes."""
        if self._checkpointer is not None:
            self._checkpointer.wait()
            self._checkpointer.close()
            self._checkpointer = None
