"""Per-token trainer log-probs of a batch, with the same support treatment as the loss.

For target position ``(b, j)`` with sampled token ``a = target_ids[b, j]`` and logits ``z``:
rows whose recorded support is the kept set (``support_kept[b]``) get the mask-replayed
``log p^S(a) = z_a/T − logsumexp_{u∈S∪{a}} z_u/T`` (:func:`hetrl.core.correction.replay_logprobs`)
when replay is on; every other row gets the full-vocabulary ``log softmax(z/T)_a``. That is
exactly the ``log p(a_t)`` :func:`hetrl.core.correction.policy_loss` uses, so these values serve
as the recomputed ``old_logprobs`` of the PPO-clip mode. Values off ``loss_mask`` are defined
but meaningless.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from hetrl.core.correction import replay_logprobs

__all__ = ["token_logprobs", "make_logprob_fn"]


def token_logprobs(logits: jax.Array, batch: Mapping[str, jax.Array], replay: bool) -> jax.Array:
    """``log p(a)`` [B, L] from ``logits`` [B, L, V] and the batch arrays ``target_ids``
    [B, L], ``support_ids``/``support_mask`` [B, L, K], ``support_kept``, ``temperature`` [B]."""
    temperature = batch["temperature"].astype(logits.dtype)
    full = jax.nn.log_softmax(logits / temperature[:, None, None], axis=-1)
    full_a = jnp.take_along_axis(full, batch["target_ids"][..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not replay:
        return full_a
    replayed_a, _ = replay_logprobs(logits, batch["target_ids"], batch["support_ids"], batch["support_mask"], temperature)
    return jnp.where(batch["support_kept"][:, None], replayed_a, full_a)


def make_logprob_fn(graphdef: nnx.GraphDef, replay: bool) -> Callable:
    """``fn(params, rest, batch) -> log p(a) [B, L]`` running the model on
    ``batch["input_ids"]`` (``attention_mask`` over the key slots); jit it with shardings."""

    def fn(params: nnx.State, rest: nnx.State, batch: Mapping[str, jax.Array]) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        logits, _ = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        return token_logprobs(logits, batch, replay)

    return fn
