"""Token sampling with an exactly recorded support: pure JAX, jit-able, static shapes.

From logits ``z`` [B, V] and per-row temperature ``T`` [B], ``top_k`` [B] (0 = off) and
``top_p`` [B] (1 = off), :func:`sample` draws one token per row and returns what the
correction needs (DESIGN §2, §3.1): the token, its log-prob under the distribution really
sampled from, and the support as fixed-width arrays ``[B, W]`` plus a count ``[B]``.

The math, per row, with ``s = z / T``:

* full distribution ``log π(v) = s_v − logsumexp_V s``;
* the top ``W`` entries by ``s`` in decreasing order, ties broken by the lower token id
  (``jax.lax.top_k``); call them ``v_1 .. v_W`` and ``c_i = Σ_{j ≤ i} π(v_j)``;
* **truncated rows** (``top_k > 0`` or ``top_p < 1``): the kept set is the prefix
  ``S = {v_1 .. v_n}`` with ``n = min(k, n_p)``, ``k = top_k if top_k > 0 else W`` and
  ``n_p = min(1 + #{i ≤ W : c_i < top_p}, W)`` (``n_p = W`` when ``top_p = 1``): the smallest
  prefix whose *full-distribution* mass reaches ``top_p`` (the SGLang convention: top-p counts
  the untruncated mass, after top-k), **within the cap W**. So ``top_k`` may not exceed ``W``
  (:func:`check_params` refuses it), and a top-p set that would need more than ``W`` tokens is
  cut to the top ``W``: the effective rule is "top-p within the top-``W``", and since the
  support records the set actually sampled from, mask replay stays exact either way
  (``SampleResult.cap_bound`` tells the caller when it happened). The token is drawn from
  ``q(v) = exp(s_v − logsumexp_S s)`` for v in S, and ``log q`` over S is recorded
  (kind ``'kept'``); the sampled token is always in S.
* **untruncated rows**: the token is drawn from π over the whole vocabulary, and the support
  is the head ``{v_1 .. v_H}`` (``H = head_size``) with its full-distribution ``log π``
  (kind ``'head'``); the token may lie outside the head.

Draws use the Gumbel-max trick, ``argmax_v (s_v + g_v)`` with i.i.d. standard Gumbel ``g``:
a truncated row perturbs its (at most W) kept candidates, an untruncated row all V tokens. The
V-wide draw is skipped (``lax.cond``) when every row of the batch is truncated. All math
is float32, whatever the model's compute dtype was.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEFAULT_SUPPORT_CAP", "SampleResult", "sample", "check_params", "row_keys"]

DEFAULT_SUPPORT_CAP = 64
"""Default width W of the recorded support (the top-k cap of truncated sampling)."""


class SampleResult(NamedTuple):
    """Output of :func:`sample`. Shapes: ``token``, ``logprob``, ``count``, ``kept``,
    ``cap_bound`` [B]; ``support_ids``, ``support_logprobs`` [B, W] (entries ``>= count`` are
    padding: id 0, log-prob 0). ``kept[b]``: the row was truncated, its support is the kept set;
    otherwise it is the head of the full distribution. ``cap_bound[b]``: a top-p set (with
    ``top_k = 0``) needed more than W tokens and was cut to the top W."""

    token: jax.Array
    logprob: jax.Array
    support_ids: jax.Array
    support_logprobs: jax.Array
    count: jax.Array
    kept: jax.Array
    cap_bound: jax.Array


def check_params(top_k: Sequence[int] | np.ndarray, top_p: Sequence[float] | np.ndarray, width: int) -> None:
    """Refuse parameters :func:`sample` cannot honour exactly: ``top_k > width`` (the kept set
    would be silently smaller than asked) or a ``top_p`` outside (0, 1]."""
    top_k = np.asarray(top_k)
    top_p = np.asarray(top_p)
    if top_k.size and top_k.max() > width:
        raise ValueError(
            f"top_k={int(top_k.max())} exceeds the sampler's support cap W={width}; "
            f"use top_k <= {width} or a sampler with a larger support_cap"
        )
    if top_k.size and top_k.min() < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {int(top_k.min())}")
    if top_p.size and not np.all((top_p > 0.0) & (top_p <= 1.0)):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p[~((top_p > 0.0) & (top_p <= 1.0))][0]}")


def row_keys(key: jax.Array, batch: int, step: jax.Array | int) -> jax.Array:
    """``[B]`` keys ``fold_in(fold_in(key, b), step)``: row b's draw at ``step`` depends only
    on (key, b, step), not on the batch size the row was padded into."""
    rows = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch, dtype=jnp.uint32))
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(rows)


def sample(
    keys: jax.Array,
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    width: int = DEFAULT_SUPPORT_CAP,
    head_size: int = DEFAULT_SUPPORT_CAP,
) -> SampleResult:
    """Draw one token per row and record its support (see the module docstring for the math).

    keys [B] PRNG keys; logits [B, V]; temperature [B] > 0; top_k [B] int (0 = off, at most
    ``width``); top_p [B] in (0, 1]. ``width`` (W, static, ``<= V``) is the support cap;
    ``head_size`` (static, ``<= W``) the head recorded for untruncated rows.
    """
    B, V = logits.shape
    if not 1 <= width <= V:
        raise ValueError(f"support width {width} must lie in [1, vocab size {V}]")
    if not 0 <= head_size <= width:
        raise ValueError(f"head_size {head_size} must lie in [0, width {width}]")
    s = logits.astype(jnp.float32) / temperature.astype(jnp.float32)[:, None]
    lse = jax.nn.logsumexp(s, axis=-1)  # [B]
    top_s, top_ids = jax.lax.top_k(s, width)  # [B, W], decreasing, ties: lower id first
    top_full = top_s - lse[:, None]  # log π over the top W

    slot = jnp.arange(width)[None, :]
    k = jnp.where(top_k > 0, top_k, width)
    cum = jnp.cumsum(jnp.exp(top_full), axis=-1)
    below = jnp.sum(cum < top_p[:, None], axis=-1)  # [B]; == W: the top W do not reach top_p
    n_p = jnp.where(top_p < 1.0, 1 + below, width)
    n_kept = jnp.clip(jnp.minimum(k, n_p), 1, width).astype(jnp.int32)
    in_kept = slot < n_kept[:, None]
    kept_lse = jax.nn.logsumexp(jnp.where(in_kept, top_s, -jnp.inf), axis=-1)
    kept_lp = jnp.where(in_kept, top_s - kept_lse[:, None], 0.0)

    truncated = (top_k > 0) | (top_p < 1.0)
    keys = jax.vmap(lambda key: jax.random.split(key))(keys)  # [B, 2]: kept draw, full draw
    g_top = jax.vmap(lambda key: jax.random.gumbel(key, (width,), jnp.float32))(keys[:, 0])
    pick = jnp.argmax(jnp.where(in_kept, top_s + g_top, -jnp.inf), axis=-1)  # [B]
    kept_token = jnp.take_along_axis(top_ids, pick[:, None], axis=-1)[:, 0]
    kept_token_lp = jnp.take_along_axis(kept_lp, pick[:, None], axis=-1)[:, 0]

    def full_draw():
        g = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(keys[:, 1])
        return jnp.argmax(s + g, axis=-1).astype(jnp.int32)

    full_token = jax.lax.cond(jnp.all(truncated), lambda: jnp.zeros((B,), jnp.int32), full_draw)
    full_token_lp = jnp.take_along_axis(s, full_token[:, None], axis=-1)[:, 0] - lse

    in_head = slot < head_size
    return SampleResult(
        token=jnp.where(truncated, kept_token, full_token).astype(jnp.int32),
        logprob=jnp.where(truncated, kept_token_lp, full_token_lp),
        support_ids=jnp.where(truncated[:, None], jnp.where(in_kept, top_ids, 0), jnp.where(in_head, top_ids, 0)),
        support_logprobs=jnp.where(truncated[:, None], kept_lp, jnp.where(in_head, top_full, 0.0)),
        count=jnp.where(truncated, n_kept, head_size).astype(jnp.int32),
        kept=truncated,
        cap_bound=(top_p < 1.0) & (top_k == 0) & (below == width),
    )

