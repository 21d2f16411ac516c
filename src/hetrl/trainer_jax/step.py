"""The train step: forward, corrected policy loss, gradients, optimizer update, metrics.

For a batch of B rollouts (target-aligned ``[B, L]`` arrays, supports ``[B, L, K]``, see
:mod:`hetrl.core.schema`) and parameters θ:

1. ``z = model_θ(input_ids)`` [B, L, V] float32 logits (the model computes in
   ``numerics.compute_dtype``, e.g. BF16 with FP32 accumulation, from FP32 master weights);
2. GRPO advantages ``A_i = R_i − mean_{g(i)} R`` (optionally / std), over the *global* batch
   (groups may span processes), with ``num_groups = B`` as a static bound;
3. ``loss(θ) = policy_loss(loss_inputs(z, batch, A), correction)`` (mask replay, MIS, score centering,
   token-mean reduction; :mod:`hetrl.core.correction`, called with jax.numpy arrays);
4. ``g = ∇_θ loss``, ``θ ← θ + optimizer_update(g)`` (:mod:`hetrl.trainer_jax.optim`).

Metrics (0-d arrays): ``loss``, ``grad_norm`` = ‖g‖₂ before clipping, ``update_norm``,
``param_norm`` (after the update), ``entropy`` (full-vocabulary entropy of p over trainable
tokens), ``advantage_abs_mean`` (over rollouts), and every key of
:func:`hetrl.core.correction.mismatch_metrics` (overall and per pool; staleness against
``version``, the trainer version that consumed the batch).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hetrl.core.correction import CorrectionConfig, TokenStats, grpo_advantages, loss_inputs, mismatch_metrics, policy_loss, token_entropy
from hetrl.core.xp import masked_mean

__all__ = ["STEP_FIELDS", "corrected_loss", "make_train_step"]

STEP_FIELDS: tuple[str, ...] = (
    "input_ids", "attention_mask", "target_ids", "loss_mask", "sampler_logprobs", "policy_version",
    "support_ids", "support_mask", "support_logprobs", "support_kept", "reward", "temperature",
    "group_index", "pool_index",
)
"""The :class:`~hetrl.core.schema.RolloutBatch` arrays a step reads (all batch-major)."""


def corrected_loss(
    logits: jax.Array,
    batch: Mapping[str, jax.Array],
    correction: CorrectionConfig,
    normalize_std: bool = False,
    old_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, TokenStats, jax.Array]:
    """``(loss, TokenStats, advantages [B])`` of logits [B, L, V] on a batch of
    :data:`STEP_FIELDS` arrays: GRPO advantages, then :func:`policy_loss`."""
    num_rows = batch["reward"].shape[0]
    advantages = grpo_advantages(batch["reward"].astype(logits.dtype), batch["group_index"], num_rows, normalize_std)
    loss, stats = policy_loss(loss_inputs(logits, batch, advantages, old_logprobs), correction)
    return loss, stats, advantages


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    correction: CorrectionConfig,
    *,
    pool_names: Sequence[str] = (),
    normalize_std: bool = False,
) -> Callable:
    """The pure step ``fn(params, rest, opt_state, batch, version, old_logprobs=None) ->
    (params, opt_state, metrics)``.

    ``params`` / ``rest``: the model's ``nnx.Param`` state and the remaining state
    (``nnx.split(model, nnx.Param, ...)``); ``batch``: :data:`STEP_FIELDS` arrays; ``version``:
    int32 scalar; ``old_logprobs`` [B, L] only for PPO-clip. ``pool_names`` (static) names the
    per-pool metrics. Jit it with shardings; nothing here depends on the mesh.
    """
    pool_names = tuple(pool_names)

    def step(params, rest, opt_state, batch, version, old_logprobs=None):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, rest)
            logits, _ = model(batch["input_ids"], attention_mask=batch["attention_mask"])
            loss, stats, advantages = corrected_loss(logits, batch, correction, normalize_std, old_logprobs)
            entropy = masked_mean(token_entropy(logits, batch["temperature"]), batch["loss_mask"])
            return loss, (stats, advantages, entropy)

        (loss, (stats, advantages, entropy)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(params),
            "entropy": entropy,
            "advantage_abs_mean": jnp.mean(jnp.abs(advantages)),
            **mismatch_metrics(
                stats, batch["loss_mask"], batch["pool_index"], pool_names,
                batch["policy_version"], version, correction.log_ratio_clamp,
            ),
        }
        return params, opt_state, metrics

    return step
