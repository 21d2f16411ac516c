"""Per-token trainer log-probs of a batch, with the same support treatment as the loss: the
model run on a batch, then :func:`hetrl.core.correction.token_logprobs` (written once, for both
trainers, over the array namespace)."""

from __future__ import annotations

from typing import Callable, Mapping

import jax
from flax import nnx

from hetrl.core.correction import token_logprobs

__all__ = ["make_logprob_fn"]


def make_logprob_fn(graphdef: nnx.GraphDef, replay: bool) -> Callable:
    """``fn(params, rest, batch) -> log p(a) [B, L]`` running the model on
    ``batch["input_ids"]`` (``attention_mask`` over the key slots); jit it with shardings."""

    def fn(params: nnx.State, rest: nnx.State, batch: Mapping[str, jax.Array]) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        logits, _ = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        return token_logprobs(logits, batch, replay)

    return fn
