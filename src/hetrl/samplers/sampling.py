"""Token sampling with an exactly recorded support: pure JAX, jit-able, static shapes.

From logits ``z`` [B, V] and per-row temperature ``T`` [B], ``top_k`` [B] (0 = off) and
``top_p`` [B] (1 = off), :func:`sample` draws one token per row and returns what the
correction needs (DESIGN §2, §3.1): the token, its log-prob under the distribution really
sampled from, and the support as fixed-width arrays ``[B, W]`` plus a count ``[B]``.

The math, per row, with ``s = z / T``:

* full distribution ``log π(v) = s_v − logsumexp_V s``;
* the top ``W`` entries by ``s`` in decreasing order, ties broken by the lower token id
  (:func:`top_k_exact`, bit for bit ``jax.lax.top_k``); call them ``v_1 .. v_W`` and ``c_i = Σ_{j ≤ i} π(v_j)``;
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
randomness of a draw is a :class:`Noise` (:func:`draw_noise` makes it from one PRNG key per row):
the W Gumbel variates of the kept draw, drawn ahead (a caller sampling many steps draws every
step's noise in one call), and a key for the V-wide draw, which is skipped (``lax.cond``) when
every row of the batch is truncated. All math is float32, whatever the model's compute dtype was.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEFAULT_SUPPORT_CAP", "Noise", "SampleResult", "sample", "draw_noise", "top_k_exact", "top_k_floor",
           "check_params", "row_keys"]

DEFAULT_SUPPORT_CAP = 64
"""Default width W of the recorded support (the top-k cap of truncated sampling)."""


class Noise(NamedTuple):
    """The randomness of one draw per row, for a batch shape ``S`` (``[B]`` for one step):
    ``kept`` [*S, W] i.i.d. standard Gumbel variates perturbing the kept candidates, ``full`` [*S]
    PRNG keys of the V-wide Gumbel draw of untruncated rows."""

    kept: jax.Array
    full: jax.Array


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


_FLOOR_SUBGROUP = 16
"""Entries per sub-group whose maximum :func:`top_k_floor` takes in its first pass."""
_FLOOR_PER_GROUP = 8
"""Distinct sub-group maxima :func:`top_k_floor` takes from each of its ``k / 8`` groups."""


def top_k_floor(x: jax.Array, k: int) -> jax.Array | None:
    """A floor ``t`` [B] under the k-th largest entry of each row of ``x`` [B, V], cheap to compute
    (one pass over ``x``); None when the shapes do not allow it.

    The row is cut into sub-groups of ``u = 16`` entries (their maxima ``M``, [B, V/u]) and ``M``
    into ``G = k/8`` groups of consecutive sub-groups; per group, ``c_g`` = the 8th largest
    distinct value of its ``M`` (-inf when it has fewer). Each ``c_g`` has 8 distinct sub-group
    maxima, so 8 distinct entries of ``x``, at or above it; ``t = min_g c_g`` has ``8 G = k``
    entries ``>= t``, so no entry ``< t`` is among the k largest. A NaN in a row makes its t NaN
    or -inf (no entry is ``< t``).
    """
    B, V = x.shape
    u, m = _FLOOR_SUBGROUP, _FLOOR_PER_GROUP
    if k % m or V % (u * (k // m)) or V // (u * (k // m)) < m:
        return None
    maxima = x.reshape(B, k // m, V // (u * (k // m)), u).max(axis=-1)  # [B, G, V / (u G)]
    c = maxima.max(axis=-1)
    for _ in range(m - 1):  # the next distinct value below c
        c = jnp.where(maxima < c[..., None], maxima, -jnp.inf).max(axis=-1)
    return c.min(axis=-1)


def top_k_exact(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exactly ``jax.lax.top_k(x, k)`` for ``x`` [B, V]: the k largest entries of each row (values
    [B, k] in decreasing order, ties broken by the lower index) and their indices [B, k].

    ``lax.top_k``'s CPU kernel scans the row keeping a k-entry heap; every entry larger than the
    heap's smallest costs a heap update, the price of scanning ~20 entries. Entries below
    ``t = top_k_floor(x, k)`` cannot be among the k largest and are replaced by -inf first, which
    changes neither the result nor the order of ties (entries equal to t are kept). On the bench
    model's logits (V = 8192, k = 64) about 100 entries per row remain (300 with a floor from
    single maxima of k groups), and the whole :func:`sample` takes ~0.7x the time.
    """
    t = top_k_floor(x, k)
    if t is None:
        return jax.lax.top_k(x, k)
    return jax.lax.top_k(jnp.where(x < t[:, None], -jnp.inf, x), k)


def draw_noise(keys: jax.Array, width: int) -> Noise:
    """The :class:`Noise` of one draw per key, for keys of any shape ``S``: each key is split in
    two, ``(kept key, full key) = split(key)``, and ``kept = gumbel(kept key, (width,))``. A
    draw's noise depends only on its own key, so noise drawn for a stack of keys (e.g. every
    step of a decode, ``S = [N, B]``) and indexed afterwards equals noise drawn per key."""
    flat = keys.reshape(-1)
    pairs = jax.vmap(jax.random.split)(flat)  # [n, 2]: kept key, full key
    kept = jax.vmap(lambda key: jax.random.gumbel(key, (width,), jnp.float32))(pairs[:, 0])
    return Noise(kept.reshape(keys.shape + (width,)), pairs[:, 1].reshape(keys.shape))


def sample(
    noise: Noise,
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    width: int = DEFAULT_SUPPORT_CAP,
    head_size: int = DEFAULT_SUPPORT_CAP,
) -> SampleResult:
    """Draw one token per row and record its support (see the module docstring for the math).

    noise: the draw's :class:`Noise` (``kept`` [B, W], ``full`` [B]; :func:`draw_noise`); logits
    [B, V]; temperature [B] > 0; top_k [B] int (0 = off, at most ``width``); top_p [B] in (0, 1].
    ``width`` (W, static, ``<= V``) is the support cap; ``head_size`` (static, ``<= W``) the head
    recorded for untruncated rows.
    """
    B, V = logits.shape
    if not 1 <= width <= V:
        raise ValueError(f"support width {width} must lie in [1, vocab size {V}]")
    if not 0 <= head_size <= width:
        raise ValueError(f"head_size {head_size} must lie in [0, width {width}]")
    if noise.kept.shape != (B, width):
        raise ValueError(f"noise.kept has shape {noise.kept.shape}, expected {(B, width)} (draw_noise(keys, width))")
    s = logits.astype(jnp.float32) / temperature.astype(jnp.float32)[:, None]
    lse = jax.nn.logsumexp(s, axis=-1)  # [B]
    top_s, top_ids = top_k_exact(s, width)  # [B, W], decreasing, ties: lower id first
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
    pick = jnp.argmax(jnp.where(in_kept, top_s + noise.kept, -jnp.inf), axis=-1)  # [B]
    kept_token = jnp.take_along_axis(top_ids, pick[:, None], axis=-1)[:, 0]
    kept_token_lp = jnp.take_along_axis(kept_lp, pick[:, None], axis=-1)[:, 0]

    def full_draw():
        g = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(noise.full)
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

