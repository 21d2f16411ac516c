"""Supervised fine-tuning (next-token cross-entropy on marked tokens), for warm starts.

For token sequences packed target-aligned (``input_ids[b, t]`` predicts ``target_ids[b, t]``),
logits ``z = model_θ(input_ids) [B, L, V]`` and a mask ``m [B, L]`` of the tokens to learn (the
assistant's answer tokens, not the prompt):

    loss(θ) = − Σ_{b,t} m[b,t] · log softmax(z[b,t])[target_ids[b,t]] / Σ m

The step is ``g = ∇_θ loss``, then the optimizer of :mod:`hetrl.trainer_jax.optim` (global-norm
clipping + AdamW). Rows are independent: ``attention_mask [B, L]`` marks real tokens (padding
at the end of a row is never attended and never learned).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetrl.core.xp import masked_mean

__all__ = ["SFT_FIELDS", "pack_examples", "sft_loss", "make_sft_step"]

SFT_FIELDS = ("input_ids", "attention_mask", "target_ids", "loss_mask")


def pack_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Target-aligned ``[N, seq_len]`` arrays of (prompt ids, answer ids) pairs, one per row:
    the sequence is ``prompt + answer``; row ``t`` holds token ``t`` as input and ``t+1`` as
    target, learned where the target is an answer token. Raises if a pair does not fit."""
    n = len(examples)
    out = {
        "input_ids": np.full((n, seq_len), pad_id, np.int32),
        "attention_mask": np.zeros((n, seq_len), bool),
        "target_ids": np.full((n, seq_len), pad_id, np.int32),
        "loss_mask": np.zeros((n, seq_len), bool),
    }
    for i, (prompt, answer) in enumerate(examples):
        tokens = [*prompt, *answer]
        if len(tokens) - 1 > seq_len:
            raise ValueError(f"example {i} has {len(tokens)} tokens, more than seq_len + 1 = {seq_len + 1}")
        if not prompt or not answer:
            raise ValueError(f"example {i} has an empty prompt or answer")
        length = len(tokens) - 1
        out["input_ids"][i, :length] = tokens[:-1]
        out["target_ids"][i, :length] = tokens[1:]
        out["attention_mask"][i, :length] = True
        out["loss_mask"][i, len(prompt) - 1: length] = True
    return out


def sft_loss(logits: jax.Array, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(loss, token accuracy)`` of logits [B, L, V] against ``target_ids`` where ``loss_mask``
    (see the module docstring); accuracy = fraction of learned tokens whose argmax is the target."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(logp, batch["target_ids"][..., None], axis=-1)[..., 0]
    mask = batch["loss_mask"]
    correct = (jnp.argmax(logits, axis=-1) == batch["target_ids"]).astype(jnp.float32)
    return -masked_mean(target, mask), masked_mean(correct, mask)


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation) -> Callable:
    """A jitted ``step(params, rest, opt_state, batch) -> (params, opt_state, metrics)`` with
    metrics ``loss``, ``accuracy``, ``grad_norm`` (before clipping)."""

    @jax.jit
    def step(params, rest, opt_state, batch):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, rest)
            logits, _ = model(batch["input_ids"], attention_mask=batch["attention_mask"])
            return sft_loss(logits, batch)

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads)}

    return step
