"""The Megatron trainer: an HF checkpoint in, corrected RL steps with megatron-core, HF weights out.

One train step on a :class:`~hetrl.core.schema.RolloutBatch` (target-aligned ``[B, L]`` arrays,
supports ``[B, L, K]``), with θ the parameters:

1. GRPO advantages ``A_i = R_i − mean_{g(i)} R`` (optionally / std) over the rows of *all*
   data-parallel ranks (:func:`hetrl.core.correction.grpo_advantages`);
2. the rows are cut into micro-batches and run through megatron's forward-backward schedule
   (``get_forward_backward_func``): per micro-batch
   ``z = GPTModel_θ(input_ids)`` [b, L, V] float32 logits (causal + padding mask), then the loss
   of :func:`hetrl.core.correction.policy_loss` on torch tensors (mask replay, MIS, score
   centering). megatron's per-token loss mode is used: each micro-batch returns its loss *sum*
   ``Σ_t ℓ_t`` (token mean; per-row means for the sequence mean) and its token (row) count, and
   ``finalize_model_grads`` divides the accumulated gradient by the count summed over
   micro-batches and data-parallel ranks, so the step's loss is exactly the token mean over the
   global batch;
3. megatron's optimizer (AdamW, ``get_megatron_optimizer``) clips the global gradient norm and
   updates θ: in BF16 over FP32 master weights (``Float16Module`` + mixed-precision or
   distributed optimizer), or everything in FP32; ``OptimizerParamScheduler`` sets the learning
   rate and the weight decay (none on biases and norms) before every update.

The model is wrapped in megatron's ``DistributedDataParallel`` (grad buffers, reduced in FP32).
Checkpoints are megatron ``dist_checkpointing`` directories holding model, optimizer and
scheduler state, one per step under ``checkpoint.directory`` (atomic: renamed once written); weights for samplers are exported under HF names (:mod:`.weights`).

On a machine without CUDA the CPU test shim (:mod:`.cpu_shim`) is applied by
:func:`.model.initialize_parallel`; scripts using the trainer need a ``__main__`` guard.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from functools import partial
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from hetrl.core.checkpoints import CheckpointConfig, complete_steps
from hetrl.core.correction import (
    PRESETS, CorrectionConfig, TokenStats, grpo_advantages, loss_inputs, mismatch_metrics, policy_loss, token_entropy,
    token_logprobs,
)
from hetrl.core.schema import RolloutBatch
from hetrl.core.xp import masked_mean
from hetrl.models import ModelConfig, load_state_dict
from hetrl.models.hf_io import save_hf_export
from hetrl.trainer_megatron.config import MegatronTrainerConfig
from hetrl.trainer_megatron.orphan_watch import install_results_queue
from hetrl.trainer_megatron.model import (
    build_gpt_model, forward_logits, initialize_parallel, transformer_config, unwrap,
)
from hetrl.trainer_megatron.weights import hf_to_megatron, megatron_to_hf_units

__all__ = ["MegatronTrainer", "STEP_FIELDS", "EXPORT_BUCKET_BYTES"]

STEP_FIELDS: tuple[str, ...] = (
    "input_ids", "attention_mask", "target_ids", "loss_mask", "sampler_logprobs", "support_ids", "support_mask",
    "support_logprobs", "support_kept", "temperature",
)
"""The per-row :class:`RolloutBatch` arrays a micro-batch carries to the loss."""


_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""dist_checkpointing layout of the distributed optimizer's state: one tensor per grad-buffer
bucket, saved and loaded fully in parallel (resharding only across data-parallel sizes)."""
EXPORT_BUCKET_BYTES = 256 * 2**20
"""Default size of a bucket of :meth:`MegatronTrainer.export_hf_buckets` (256 MiB)."""


class MegatronTrainer:
    """Corrected policy-gradient training of a Qwen2/Qwen3 model with megatron-core.

    State: the (DDP-wrapped, possibly ``Float16Module``-wrapped) GPTModel, megatron's optimizer
    and LR scheduler, and ``step`` = the number of updates applied = the weight ``version``.
    With data parallelism every rank builds the same trainer and passes its own rows (the same
    number on every rank, collated globally so group indices refer to the whole batch); all
    methods are collective.
    """

    def __init__(self, model_config: ModelConfig, hf_state: Mapping[str, np.ndarray],
                 config: MegatronTrainerConfig = MegatronTrainerConfig(), *,
                 correction: CorrectionConfig = PRESETS["hetrl"], checkpoint: CheckpointConfig = CheckpointConfig(),
                 seed: int = 0):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        self.config, self.correction, self.checkpoint = config, correction, checkpoint
        self.model_config = model_config
        bf16 = config.compute_dtype == "bf16"
        tensor, pipeline, _ = initialize_parallel(config.mesh, seed)
        self._tconfig = transformer_config(model_config, bf16, tensor=tensor, pipeline=pipeline,
                                           kernel_fusion=config.kernel_fusion)
        gpt = build_gpt_model(model_config, self._tconfig)
        self.device = next(gpt.parameters()).device
        self._load_hf_into(gpt, hf_state)
        module = Float16Module(self._tconfig, gpt) if bf16 else gpt
        opt, distributed = config.optimizer, config.distributed_optimizer
        self.model = DistributedDataParallel(
            self._tconfig,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
            module,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=opt.learning_rate, min_lr=opt.min_learning_rate, weight_decay=opt.weight_decay,
                adam_beta1=opt.b1, adam_beta2=opt.b2, adam_eps=opt.eps, clip_grad=opt.grad_clip or 0.0,
                bf16=bf16, params_dtype=self._tconfig.params_dtype, use_distributed_optimizer=distributed,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=opt.learning_rate, min_lr=opt.min_learning_rate,
            lr_warmup_steps=opt.warmup_steps, lr_decay_steps=opt.decay_steps or opt.warmup_steps + 1,
            lr_decay_style=opt.schedule, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        self._tconfig.grad_scale_func = self.optimizer.scale_loss
        self._tconfig.no_sync_func = self.model.no_sync
        self._tconfig.finalize_model_grads_func = finalize_model_grads
        self.step = 0

    @classmethod
    def from_hf(cls, directory: str | os.PathLike, config: MegatronTrainerConfig = MegatronTrainerConfig(),
                **kwargs: Any) -> "MegatronTrainer":
        """A trainer initialized from an HF checkpoint directory (``config.json`` + safetensors);
        ``kwargs``: those of the constructor (``correction``, ``checkpoint``, ``seed``)."""
        return cls(ModelConfig.load(directory), load_state_dict(directory), config, **kwargs)

    @property
    def version(self) -> int:
        """The weight version: the number of optimizer updates applied."""
        return self.step

    # ------------------------------------------------------------------ weights
    def _load_hf_into(self, gpt: torch.nn.Module, hf_state: Mapping[str, np.ndarray]) -> None:
        from megatron.core import parallel_state

        state = hf_to_megatron(self.model_config, hf_state, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                               tp_size=parallel_state.get_tensor_model_parallel_world_size())
        own = _tensors(gpt.state_dict())
        if set(state) != set(own):
            raise ValueError(f"HF mapping and model disagree on {sorted(set(state) ^ set(own))}")
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(value)

    def export_hf_weights(self) -> dict[str, np.ndarray]:
        """The current model weights under HF names as numpy arrays, in the model's parameter
        dtype (float32, or ``ml_dtypes.bfloat16`` under BF16), gathered over tensor-parallel
        ranks (every rank gets them): the buckets of :meth:`export_hf_buckets` merged."""
        return {name: value for bucket in self.export_hf_buckets() for name, value in bucket.items()}

    def export_hf_buckets(self, bucket_bytes: int = EXPORT_BUCKET_BYTES) -> Iterator[dict[str, np.ndarray]]:
        """The HF export streamed in buckets of about ``bucket_bytes`` (whole tensors; a bucket
        closes once it holds that much): gathered over tensor-parallel ranks and mapped to HF names
        one unit at a time (:func:`megatron_to_hf_units`), so at most a bucket and one layer's
        gathered shards are held, never the whole model twice. Collective with tensor parallelism:
        every rank must consume it to the end."""
        from megatron.core import parallel_state

        local = _tensors(unwrap(self.model).state_dict())
        size = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if size > 1 else None

        def gather(names: Sequence[str]) -> list[dict[str, torch.Tensor]]:
            shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
            for name in names:
                parts = [local[name]]
                if size > 1:
                    parts = [torch.empty_like(local[name]) for _ in range(size)]
                    torch.distributed.all_gather(parts, local[name].contiguous(), group=group)
                for rank, part in enumerate(parts):
                    shards[rank][name] = part
            return shards

        bucket: dict[str, np.ndarray] = {}
        held = 0
        for unit in megatron_to_hf_units(self.model_config, list(local), gather):
            bucket.update(unit)
            held += sum(v.nbytes for v in unit.values())
            if held >= bucket_bytes:
                yield bucket
                bucket, held = {}, 0
        if bucket:
            yield bucket

    def save_hf(self, directory: str | os.PathLike) -> pathlib.Path:
        """Write the current weights as an HF checkpoint (``config.json``, safetensors) with
        ``hetrl_version.txt`` = :attr:`version` (global rank 0 writes; every rank calls)."""
        weights = self.export_hf_weights()
        if torch.distributed.get_rank() == 0:
            save_hf_export(directory, self.model_config, weights, self.version)
        return pathlib.Path(directory)

    # ------------------------------------------------------------------ batches
    @property
    def data_parallel(self) -> tuple[int, int]:
        """``(rank, size)``: this rank's place among the data-parallel ranks (every
        tensor/pipeline rank of one data-parallel rank passes the same rows)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def local_rows(self, global_batch_size: int) -> slice:
        """The rows of a ``global_batch_size``-row batch this rank passes to :meth:`train_step`
        and :meth:`logprobs`: a contiguous share per data-parallel rank (all rows without data
        parallelism; tensor/pipeline ranks of one data-parallel rank get the same rows)."""
        from megatron.core import parallel_state

        dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        if global_batch_size % dp:
            raise ValueError(f"global batch of {global_batch_size} rows does not split over {dp} data-parallel ranks")
        share = global_batch_size // dp
        return slice(rank * share, (rank + 1) * share)

    def _tensors(self, batch: RolloutBatch, extra: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        arrays = {name: batch.arrays[name] for name in STEP_FIELDS} | dict(extra)
        # np.array copies: arrays from Ray's object store are read-only, torch tensors are not
        return {name: torch.from_numpy(np.array(a, order="C")).to(self.device) for name, a in arrays.items()}

    def _micro_batches(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        rows = next(iter(tensors.values())).shape[0]
        size = self.config.micro_batch_size or rows
        return [{k: v[start:start + size] for k, v in tensors.items()} for start in range(0, rows, size)]

    def _advantages(self, batch: RolloutBatch) -> np.ndarray:
        """GRPO advantages [B_local] computed over the rows of every data-parallel rank."""
        from megatron.core import parallel_state

        reward = torch.from_numpy(batch.reward.astype(np.float32)).to(self.device)
        group = torch.from_numpy(batch.group_index.astype(np.int64)).to(self.device)
        dp = parallel_state.get_data_parallel_world_size()
        if dp > 1:
            dp_group = parallel_state.get_data_parallel_group()
            parts = [[torch.empty_like(t) for _ in range(dp)] for t in (reward, group)]
            torch.distributed.all_gather(parts[0], reward, group=dp_group)
            torch.distributed.all_gather(parts[1], group, group=dp_group)
            reward, group = torch.cat(parts[0]), torch.cat(parts[1])
        advantages = grpo_advantages(reward, group, int(reward.shape[0]), self.config.normalize_advantage_std)
        rank = parallel_state.get_data_parallel_rank()
        return advantages[rank * batch.batch_size:(rank + 1) * batch.batch_size].cpu().numpy()

    def _run(self, micro_batches: list[dict[str, torch.Tensor]], loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
            mb = next(data_iterator)
            return forward_logits(model, mb["input_ids"], mb["attention_mask"]), partial(loss_func, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
            num_microbatches=len(micro_batches), seq_length=micro_batches[0]["input_ids"].shape[1],
            micro_batch_size=micro_batches[0]["input_ids"].shape[0], forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    # ------------------------------------------------------------------ training
    def train_step(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None) -> dict[str, float]:
        """One optimizer update on ``batch`` (this rank's rows). Returns floats: ``loss`` (token
        mean over the global batch), ``grad_norm`` (global, before clipping), ``entropy``
        (full-vocabulary entropy over trainable tokens), ``advantage_abs_mean``,
        ``learning_rate``, ``version`` (the version that consumed the batch), ``update_skipped``,
        and every key of :func:`hetrl.core.correction.mismatch_metrics` (all over the global batch).
        ``old_logprobs`` [B, L] (from :meth:`logprobs` before the first update on the batch) is
        required exactly when the correction uses PPO-clip."""
        if (self.correction.ppo_clip is not None) != (old_logprobs is not None):
            raise ValueError("old_logprobs must be given exactly when the correction uses ppo_clip (compute them with logprobs())")
        extra = {"advantages": self._advantages(batch)}
        if old_logprobs is not None:
            extra["old_logprobs"] = np.asarray(old_logprobs, np.float32)
        micro_batches = self._micro_batches(self._tensors(batch, extra))
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        collected: list[dict[str, Any]] = []
        logs = self._run(micro_batches, partial(self._loss, collected), forward_only=False)
        succeeded, grad_norm, _ = self.optimizer.step()
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        metrics = self._metrics(batch, logs, collected)
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), learning_rate=learning_rate,
                       version=float(self.step), update_skipped=float(not succeeded))
        self.step += 1
        return metrics

    def _loss(self, collected: list, mb: dict[str, torch.Tensor], logits: torch.Tensor):
        """megatron loss function of one micro-batch (per-token loss mode): ``(S, n, logs)`` with
        ``S = Σ_{t∈M} ℓ_t`` and ``n = |M|`` for the token mean (``policy_loss`` with normalizer 1),
        or ``S = Σ_i mean_{t∈M_i} ℓ_t`` and ``n`` = rows with trainable tokens for the sequence
        mean; megatron divides the summed gradient by the global ``Σ n``."""
        inputs = loss_inputs(logits, mb, mb["advantages"], mb.get("old_logprobs"))
        if self.correction.reduction == "token_mean":
            loss_sum, stats = policy_loss(inputs, self.correction, normalizer=1.0)
            count = mb["loss_mask"].sum()
        else:
            loss_mean, stats = policy_loss(inputs, self.correction)
            count = mb["loss_mask"].any(dim=1).sum()
            loss_sum = loss_mean * count
        entropy = token_entropy(logits, mb["temperature"])
        collected.append({"stats": stats, "entropy": entropy, "advantages": mb["advantages"]})
        count = count.to(torch.int)
        return loss_sum, count, {"loss": torch.stack([loss_sum.detach().float(), count.float()])}

    def _all_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [B_local, ...] of every data-parallel rank, concatenated in rank order
        [B_global, ...] (``rows`` itself without data parallelism)."""
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size()
        if dp == 1:
            return rows
        wire = rows.to(torch.uint8) if rows.dtype == torch.bool else rows.contiguous()  # gloo gathers no bools
        parts = [torch.empty_like(wire) for _ in range(dp)]
        torch.distributed.all_gather(parts, wire, group=parallel_state.get_data_parallel_group())
        return torch.cat(parts).to(rows.dtype)

    def _metrics(self, batch: RolloutBatch, logs: list[dict], collected: list[dict]) -> dict[str, float]:
        """Step metrics over the global batch: the token-mean loss from the micro-batches' (sum,
        count) logs, the rest from every data-parallel rank's per-token statistics."""
        from megatron.core import parallel_state

        loss_and_count = torch.stack([log["loss"] for log in logs]).sum(0)
        torch.distributed.all_reduce(loss_and_count, group=parallel_state.get_data_parallel_group())
        stats = TokenStats(**{name: self._all_rows(torch.cat([getattr(c["stats"], name) for c in collected]))
                              for name in TokenStats.__dataclass_fields__})
        loss_mask = self._all_rows(torch.from_numpy(batch.loss_mask).to(self.device))
        entropy = self._all_rows(torch.cat([c["entropy"] for c in collected]))
        advantages = self._all_rows(torch.cat([c["advantages"] for c in collected]))
        metrics = mismatch_metrics(
            stats, loss_mask, self._all_rows(torch.from_numpy(batch.pool_index).to(self.device)), batch.pool_names,
            self._all_rows(torch.from_numpy(batch.policy_version).to(self.device)), self.step,
            self.correction.log_ratio_clamp,
        )
        metrics.update(entropy=masked_mean(entropy, loss_mask), advantage_abs_mean=advantages.abs().mean())
        out = {name: float(value) for name, value in metrics.items()}
        out["loss"] = float(loss_and_count[0] / loss_and_count[1].clamp(min=1.0))
        return out

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """Trainer ``log p(a_t)`` [B, L] (float32) of this rank's rows under the current weights,
        with the loss's support treatment (:func:`hetrl.core.correction.token_logprobs`); values off ``loss_mask``
        are defined but meaningless."""
        micro_batches = self._micro_batches(self._tensors(batch, {}))
        replay = self.correction.replay

        def collect(mb: dict[str, torch.Tensor], logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
            return token_logprobs(logits, mb, replay)

        self.model.eval()
        with torch.no_grad():
            parts = self._run(micro_batches, collect, forward_only=True)
        self.model.train()
        return torch.cat(parts).float().cpu().numpy()

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state_dict(self, is_loading: bool) -> dict:
        model = self.model.module.sharded_state_dict(metadata=_CHECKPOINT_METADATA)  # DDP's own would prefix "module."
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=_CHECKPOINT_METADATA),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "model_config": self.model_config.model_dump(mode="json"),
        }

    def save_to(self, directory: str | os.PathLike) -> pathlib.Path:
        """Write model, optimizer and scheduler state, :attr:`step` and the model config to
        ``directory`` (a new or empty directory) as a megatron ``dist_checkpointing`` checkpoint
        (synchronous save; the distributed optimizer's state in the ``dp_reshardable`` layout)."""
        from megatron.core import dist_checkpointing

        directory = pathlib.Path(directory)
        if torch.distributed.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        install_results_queue()
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(directory))
        return directory

    def restore_from(self, directory: str | os.PathLike) -> int:
        """Load a checkpoint written by :meth:`save_to` into this trainer; returns the restored step."""
        from megatron.core import dist_checkpointing

        self._init_empty_adam_state()
        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(directory))
        if state["model_config"] != self.model_config.model_dump(mode="json"):
            raise ValueError(f"checkpoint model config {state['model_config']} differs from this trainer's model")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_adam_steps(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        return self.step

    # The checkpoint policy of ``checkpoint``: ``<directory>/<step>/`` per checkpoint,
    # written under ``<step>.partial`` and renamed once complete (an interrupted save leaves the
    # previous checkpoints as the newest loadable ones), the newest ``keep`` retained.
    def _checkpoint_root(self) -> pathlib.Path:
        if self.checkpoint.directory is None:
            raise ValueError("checkpoint.directory is not set")
        return pathlib.Path(self.checkpoint.directory).absolute()

    def save(self, *, force: bool = True) -> bool:
        """Checkpoint the state at :attr:`step` under ``checkpoint.directory``;
        ``force=False`` saves only every ``checkpoint.every`` steps. Returns whether it
        saved (collective: every rank calls it)."""
        if not force and not self.checkpoint.due(self.step):
            return False
        root = self._checkpoint_root()
        final, partial_dir = root / str(self.step), root / f"{self.step}.partial"
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(partial_dir, ignore_errors=True)
        self.save_to(partial_dir)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            partial_dir.rename(final)
            keep = self.checkpoint.keep
            for old in complete_steps(root)[:-keep] if keep else []:
                shutil.rmtree(root / str(old), ignore_errors=True)
        torch.distributed.barrier()
        return True

    def restore(self, step: int | None = None) -> int:
        """Load checkpoint ``step`` (default: the newest) from ``checkpoint.directory``;
        returns the restored step."""
        steps = self.checkpoint_steps()
        if not steps or (step is not None and step not in steps):
            raise FileNotFoundError(f"no checkpoint {'at step ' + str(step) if step is not None else ''} "
                                    f"in {self._checkpoint_root()} (steps there: {steps})")
        return self.restore_from(self._checkpoint_root() / str(steps[-1] if step is None else step))

    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk (after retention)."""
        return complete_steps(self._checkpoint_root())

    def close(self) -> None:
        """Nothing is pending: saves are synchronous (the process group stays up for reuse)."""

    # torch.optim.AdamW fallback: megatron-core 0.16 uses it when neither Apex nor Transformer
    # Engine is installed (TE's FusedAdam keeps no per-parameter step, so both helpers below do
    # nothing there). AdamW's per-parameter state is empty until the first update, and its
    # "step" (the bias-correction count) is handled by the distributed optimizer's checkpoint
    # code only half-way: stored in the param groups, then overwritten on load by the
    # pre-load value. These two helpers make a restore exact with that fallback.
    def _inner_optimizers(self) -> list:
        return [c.optimizer for c in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _init_empty_adam_state(self) -> None:
        """Give a fresh optimizer the AdamW state torch creates on a first update (``step`` 0,
        zero moments), for the checkpoint to overwrite: the distributed optimizer's
        ``state_dict`` (needed to build the state to load into) requires a ``step``."""
        if not isinstance(self._inner_optimizers()[0], torch.optim.AdamW):
            return
        for inner in self._inner_optimizers():
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def _restore_adam_steps(self, loaded: Mapping[str, Any]) -> None:
        """Set AdamW's per-parameter ``step`` to the one the distributed optimizer stored in the
        checkpoint's param groups (absent for the other optimizers, whose state carries it)."""
        inners = self._inner_optimizers()
        parts = [loaded] if len(inners) == 1 else [v for _, v in sorted(loaded.items())]
        for inner, part in zip(inners, parts):
            groups = part.get("optimizer", {}).get("param_groups", []) if isinstance(part, Mapping) else []
            steps = {g["step"] for g in groups if "step" in g}
            if not steps:
                continue
            (step,) = steps
            for state in inner.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(float(step))


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a module state dict (megatron adds ``_extra_state`` entries)."""
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}
