"""The Qwen2 / Qwen3 decoder in Flax NNX, shared by the JAX trainer and the embedded sampler.

It computes exactly what ``transformers``' ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` compute
(checked to 1e-5 in log-prob on float32 checkpoints), with ``B`` = batch, ``L`` = new tokens,
``S`` = key slots, ``H`` = hidden size, ``V`` = vocab, ``nh`` / ``kvh`` = query / key-value heads,
``hd`` = head dim, ``g = nh / kvh``::

    h_0   = embed_tokens[input_ids]                                       [B, L, H]
    a     = rms(h) ;  q = a W_q (+ b_q),  k = a W_k (+ b_k),  v = a W_v (+ b_v)
            (Qwen2: the biases; Qwen3: no biases, q and k RMS-normed per head over hd)
    q, k  = rope(q, positions), rope(k, positions)                         [B, L, nh|kvh, hd]
    o     = softmax(q k^T / sqrt(hd) masked) v  (query head j reads kv head j // g)
    h    += o W_o ;  h += (silu(rms(h) W_gate) * (rms(h) W_up)) W_down     (per layer)
    logits = rms(h) W_lm  (W_lm = embed_tokens^T when tied)                [B, L, V] float32

* ``rms(x) = (x * rsqrt(mean(x^2, -1) + eps)) * w``, computed in float32 and cast back.
* RoPE ("rotate half", non-interleaved): ``inv_freq_i = theta^(-2i/hd)`` for ``i < hd/2``,
  ``phi = position * inv_freq`` duplicated to ``hd``, ``x' = x cos(phi) + rotate_half(x) sin(phi)``
  with ``rotate_half([x1, x2]) = [-x2, x1]``, computed in float32 and cast back.
* Weights live as ``[in, out]`` kernels; the HF mapping (:func:`from_hf_state_dict`,
  :func:`to_hf_state_dict`) transposes HF's ``[out, in]`` exactly. Module attribute paths mirror HF
  names (``layers[i].self_attn.q_proj.kernel`` is ``model.layers.{i}.self_attn.q_proj.weight``^T).

How an accelerator computes is a :class:`Numerics` value (dtypes, KV-cache format, split-K
reduction order); its defaults are exact float32. Every parameter carries a logical partitioning
(``out_sharding`` metadata over the mesh axes ``"fsdp"`` and ``"tensor"``, Megatron-style tensor
parallelism, see :data:`PARTITIONING`); with no mesh active the model runs on one device.

Jitting: the module is plain NNX, e.g.::

    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda state, ids, pos, mask: nnx.merge(graphdef, state)(ids, pos, mask)[0])
    logits = fwd(nnx.state(model), ids, pos, mask)     # after load_state_into: same shapes, no re-jit

(or ``nnx.jit`` on a function taking the model).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetrl.core.precision import ACTIVATION_FORMATS, FORMATS, quantize_activations, quantize_dequantize
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import check_state_dict, load_state_dict

__all__ = [
    "Numerics", "KVCache", "PARTITIONING", "init_cache", "grow_cache", "contract", "QwenModel", "with_numerics",
    "from_hf_state_dict", "to_hf_state_dict", "load_state_into", "load_hf", "hf_parameters",
]

PARTITIONING: dict[str, tuple[str | None, ...]] = {
    "embed_tokens": ("tensor", "fsdp"),   # [V, H]: vocab-parallel
    "column_kernel": ("fsdp", "tensor"),  # q/k/v/gate/up/lm_head [H, out]: output dim split
    "column_bias": ("tensor",),           # q/k/v biases [out]
    "row_kernel": ("tensor", "fsdp"),     # o/down [in, H]: input dim split
    "norm": (None,),                      # RMSNorm weights: replicated
}
"""Logical partitioning of every parameter kind (mesh axis names per dimension)."""

_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How an accelerator computes; the defaults are exact float32.

    * ``compute_dtype``: activations, the residual stream and matmul inputs (params are cast to it).
    * ``accum_dtype``: ``preferred_element_type`` of every matmul / einsum (the dtype the partial
      sums come out in; within one contraction the backend's own accumulation applies).
    * ``softmax_dtype``: attention scores are cast to it, scaled, masked and softmaxed in it.
    * ``kv_format``: a :mod:`hetrl.core.precision` format applied (quantize-dequantize) to each
      write of K and V ``[B, L, kvh, hd]`` into the KV cache; attention through a cache reads them
      back so rounded. Every format's scale groups lie within one token's ``[kvh, hd]`` (per head
      vector, or blocks of it), except nvfp4's float32 tensor scale, which spans the whole write.
      The uncached forward has no cache and is unaffected.
    * ``activation_format``: a :data:`hetrl.core.precision.ACTIVATION_FORMATS` name applied
      (:func:`~hetrl.core.precision.quantize_activations`, per token, dynamic scales) to the input
      of every :class:`Linear` (q/k/v/o, gate/up/down; not the LM head nor attention's own
      products), as a W8A8 / W4A4 serving GEMM reads it. ``"none"``: the compute dtype.
    * ``reduction_chunks``: ``c > 1`` splits every contraction into ``min(c, n)`` near-equal chunks
      along its contracted dim (length ``n``), computes each chunk's partial result in
      ``accum_dtype`` and adds them left to right (split-K): the same sum in another order.
    * ``matmul_precision``: ``jax.lax.Precision`` name for every contraction; ``"highest"`` keeps
      float32 inputs exact (no TF32 / bf16 passes on GPU / TPU), ``"default"`` lets the backend
      choose.
    """

    compute_dtype: Any = jnp.float32
    accum_dtype: Any = jnp.float32
    softmax_dtype: Any = jnp.float32
    kv_format: str = "fp32"
    activation_format: str = "none"
    reduction_chunks: int = 1
    matmul_precision: str = "highest"

    def __post_init__(self):
        if self.reduction_chunks < 1:
            raise ValueError(f"reduction_chunks must be >= 1, got {self.reduction_chunks}")
        if self.kv_format not in FORMATS:
            raise ValueError(f"unknown precision format {self.kv_format!r}; valid formats: {', '.join(FORMATS)}")
        if self.activation_format not in ACTIVATION_FORMATS:
            raise ValueError(f"unknown activation format {self.activation_format!r}; "
                             f"valid: {', '.join(ACTIVATION_FORMATS)}")


class KVCache(NamedTuple):
    """Keys and values by slot, one array per layer (a pytree): ``k[i]`` of shape
    ``[B, num_kv_heads, head_dim, S_max]`` (keys after RoPE, transposed: slots last) and ``v[i]``
    of shape ``[B, num_kv_heads, S_max, head_dim]``.

    The layout is the one decode attention reads without copying: ``q k^T`` contracts
    ``[.., g, hd] x k[i] [.., hd, S]`` and ``probs v`` contracts ``[.., g, S] x v[i] [.., S, hd]``,
    both plain batched row-major matmuls over the leading ``(B, kvh)`` batch dims. Stored as
    ``[B, S, kvh, hd]``, XLA copies a transposed K and V of every layer at every decode step, and
    a stacked ``[num_layers, ...]`` array is copied when sliced per layer; one array per layer in
    this layout is read in place and each write is an in-place update."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        """``S_max``, the number of slots."""
        return self.v[0].shape[2]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An all-zero cache of ``max_len`` slots; pass ``dtype=numerics.compute_dtype`` (a narrower
    dtype rounds K/V once more on write)."""
    B, kvh, hd, n = batch_size, config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    return KVCache(tuple(jnp.zeros((B, kvh, hd, max_len), dtype) for _ in range(n)),
                   tuple(jnp.zeros((B, kvh, max_len, hd), dtype) for _ in range(n)))


def grow_cache(cache: KVCache, max_len: int) -> KVCache:
    """``cache`` with ``max_len >= cache.max_len`` slots: the old slots unchanged, the new ones
    zero (one copy of the cache)."""
    extra = max_len - cache.max_len
    if extra < 0:
        raise ValueError(f"grow_cache: max_len {max_len} is below the cache's {cache.max_len} slots")
    return KVCache(tuple(jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, extra))) for k in cache.k),
                   tuple(jnp.pad(v, ((0, 0), (0, 0), (0, extra), (0, 0))) for v in cache.v))


# ====================================================================== contractions
def contract(subscripts: str, a: jax.Array, b: jax.Array, numerics: Numerics) -> jax.Array:
    """``jnp.einsum(subscripts, a, b)`` with ``preferred_element_type=numerics.accum_dtype``, for
    exactly one contracted index (a letter in both inputs, not in the output). With
    ``numerics.reduction_chunks = c > 1`` the contracted axis is cut at ``floor(j n / c')``,
    ``c' = min(c, n)``, and the chunk results are summed sequentially, ``((p_0 + p_1) + p_2) + ...``
    in ``accum_dtype``; with exactly representable partial sums (e.g. small integers) this equals
    the unchunked result bit for bit, otherwise it generally differs in the last bits."""
    inputs, out = subscripts.split("->")
    sa, sb = inputs.split(",")
    contracted = [c for c in sa if c in sb and c not in out]
    if len(contracted) != 1:
        raise ValueError(f"{subscripts!r}: expected exactly one contracted index, got {contracted}")
    kwargs = dict(preferred_element_type=numerics.accum_dtype, precision=numerics.matmul_precision)
    ia, ib = sa.index(contracted[0]), sb.index(contracted[0])
    n = a.shape[ia]
    chunks = min(numerics.reduction_chunks, n)
    if chunks == 1:
        return jnp.einsum(subscripts, a, b, **kwargs)
    bounds = [j * n // chunks for j in range(chunks + 1)]
    total = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = jnp.einsum(subscripts, jax.lax.slice_in_dim(a, lo, hi, axis=ia),
                          jax.lax.slice_in_dim(b, lo, hi, axis=ib), **kwargs)
        total = part if total is None else total + part
    return total


# ====================================================================== parameters and layers
def _param(value: jax.Array, sharding: tuple[str | None, ...]) -> nnx.Param:
    """A Param annotated with ``sharding``; placed eagerly only when a mesh is active (and eager
    sharding is on), so the model also builds with no mesh at all."""
    eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(value, out_sharding=sharding, eager_sharding=eager)


class RMSNorm(nnx.Module):
    """``(x * rsqrt(mean(x^2, -1) + eps)) * weight`` over the last axis in float32, cast back to
    ``x.dtype``; ``weight`` is ``[dim]``, initialized to ones."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.eps = eps
        self.weight = _param(jnp.ones((dim,), param_dtype), PARTITIONING["norm"])

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)``: ``x [B, L, in]``, ``kernel [in, out]``, ``bias [out]``. The
    product comes out in ``accum_dtype``, the bias is added there, the result is cast to
    ``compute_dtype``.

    With ``numerics.activation_format`` set, ``x`` is first rounded per token to that format
    (float32 values ``code * scale``) and the product takes float32 inputs (the kernel, in the
    compute dtype, converts exactly): a low-precision GEMM multiplies the codes exactly and
    applies the scales to the float32 sums, which this equals up to float32 rounding."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, column: bool, rngs: nnx.Rngs, param_dtype):
        kernel = jax.random.normal(rngs.params(), (in_features, out_features), param_dtype) * _INIT_STD
        self.kernel = _param(kernel, PARTITIONING["column_kernel" if column else "row_kernel"])
        self.bias = _param(jnp.zeros((out_features,), param_dtype), PARTITIONING["column_bias"]) if use_bias else None

    def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
        kernel = self.kernel[...].astype(numerics.compute_dtype)
        if numerics.activation_format != "none":
            x = quantize_activations(x.astype(jnp.float32), numerics.activation_format)
            kernel = kernel.astype(jnp.float32)
        y = contract("bli,io->blo", x, kernel, numerics)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y.astype(numerics.compute_dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos(phi), sin(phi)`` of shape ``[B, L, head_dim]`` float32, ``phi = positions * inv_freq``
    duplicated over both halves, ``inv_freq_i = 1 / theta^(2i / head_dim)`` (float32, as HF)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponent)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x cos + rotate_half(x) sin`` in float32 for ``x [B, L, heads, hd]``, ``cos, sin
    [B, L, hd]``; cast back to ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def _write_slots(buf: jax.Array, x: jax.Array, axes: str, fmt: str, index) -> jax.Array:
    """``buf`` (a cache array whose axes are ``axes``, a permutation of ``"bksd"``) with
    ``x [B, L, kvh, hd]``, rounded to ``fmt`` as one write, at slots ``[index, index + L)``."""
    x = jnp.einsum(f"bskd->{axes}", quantize_dequantize(x, fmt).astype(buf.dtype))
    return jax.lax.dynamic_update_slice(buf, x, tuple(index if a == "s" else 0 for a in axes))


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE (+ QK-norm for Qwen3, q/k/v biases for Qwen2)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        H, hd = config.hidden_size, config.head_dim
        nh, kvh = config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, hd
        self.rope_theta = config.rope_theta
        bias = config.attention_bias
        self.q_proj = Linear(H, nh * hd, use_bias=bias, column=True, rngs=rngs, param_dtype=param_dtype)
        self.k_proj = Linear(H, kvh * hd, use_bias=bias, column=True, rngs=rngs, param_dtype=param_dtype)
        self.v_proj = Linear(H, kvh * hd, use_bias=bias, column=True, rngs=rngs, param_dtype=param_dtype)
        self.o_proj = Linear(nh * hd, H, use_bias=False, column=False, rngs=rngs, param_dtype=param_dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, allowed, numerics: Numerics, kv: tuple[jax.Array, jax.Array] | None, cache_index):
        """``x [B, L, H]`` -> ``([B, L, H], kv)``. ``allowed [B, L, S]`` bool: query ``i`` may
        read key slot ``j``. With ``kv``, this layer's cache entry ``(k [B, kvh, hd, S_max],
        v [B, kvh, S_max, hd])`` (:class:`KVCache`), the new K/V (after ``kv_format`` rounding,
        applied to the ``[B, L, kvh, hd]`` write) are written at slots ``[cache_index,
        cache_index + L)`` and attention reads all ``S_max`` slots; without, it reads the ``L``
        new keys (``kv`` stays None)."""
        B, L, _ = x.shape
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x, numerics).reshape(B, L, nh, hd)
        k = self.k_proj(x, numerics).reshape(B, L, kvh, hd)
        v = self.v_proj(x, numerics).reshape(B, L, kvh, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        qg = q.reshape(B, L, kvh, nh // kvh, hd)  # query head j = kv head (j // g), group (j % g)
        # axes of q (and the attention output), k and v: as projected, or as the cache stores
        # them, with q and the output made to match (batch dims b, k leading in every operand)
        q_axes, k_axes, v_axes = "blkgd", "bskd", "bskd"
        if kv is not None:
            q_axes, k_axes, v_axes = "bkgld", "bkds", "bksd"
            kv = (_write_slots(kv[0], k, k_axes, numerics.kv_format, cache_index),
                  _write_slots(kv[1], v, v_axes, numerics.kv_format, cache_index))
            k, v = kv[0].astype(numerics.compute_dtype), kv[1].astype(numerics.compute_dtype)
            qg = jnp.einsum(f"blkgd->{q_axes}", qg)
        scores = contract(f"{q_axes},{k_axes}->bkgls", qg, k, numerics).astype(numerics.softmax_dtype)
        scores = scores * jnp.asarray(hd**-0.5, numerics.softmax_dtype)
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(numerics.softmax_dtype).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(numerics.compute_dtype)
        out = contract(f"bkgls,{v_axes}->{q_axes}", probs, v, numerics).astype(numerics.compute_dtype)
        out = jnp.einsum(f"{q_axes}->blkgd", out)
        return self.o_proj(out.reshape(B, L, nh * hd), numerics), kv


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(H, I, use_bias=False, column=True, rngs=rngs, param_dtype=param_dtype)
        self.up_proj = Linear(H, I, use_bias=False, column=True, rngs=rngs, param_dtype=param_dtype)
        self.down_proj = Linear(I, H, use_bias=False, column=False, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, numerics)) * self.up_proj(x, numerics), numerics)


class DecoderLayer(nnx.Module):
    """``h += attn(rms(h)); h += mlp(rms(h))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, rngs=rngs, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(config, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, h, cos, sin, allowed, numerics, kv, cache_index):
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, allowed, numerics, kv, cache_index)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h), numerics), kv


class QwenModel(nnx.Module):
    """Qwen2 / Qwen3 causal LM. Parameters are stored in ``param_dtype`` and cast to
    ``numerics.compute_dtype`` where used; initial values are N(0, 0.02) kernels and embeddings,
    unit norms, zero biases (load real weights with :func:`load_state_into`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, numerics: Numerics = Numerics()):
        self.config = config
        self.numerics = numerics
        V, H = config.vocab_size, config.hidden_size
        self.embed_tokens = _param(jax.random.normal(rngs.params(), (V, H), param_dtype) * _INIT_STD, PARTITIONING["embed_tokens"])
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs, param_dtype=param_dtype) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(H, V, use_bias=False, column=True, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, input_ids, positions=None, attention_mask=None, cache=None, cache_index=None) -> tuple[jax.Array, KVCache | None]:
        """Logits of ``input_ids [B, L]`` (int32): ``logits(hidden_states(...))``.

        Returns ``(logits [B, L, V] float32, updated cache or None)``; the arguments are those of
        :meth:`hidden_states`.
        """
        h, cache = self.hidden_states(input_ids, positions, attention_mask, cache, cache_index)
        return self.logits(h), cache

    def hidden_states(self, input_ids, positions=None, attention_mask=None, cache=None,
                      cache_index=None) -> tuple[jax.Array, KVCache | None]:
        """The final-normed hidden states ``rms(h) [B, L, H]`` (compute dtype) of ``input_ids
        [B, L]`` (int32), before the LM head.

        * ``positions [B, L]`` int32 (default ``arange(L)`` in every row) feed RoPE only.
        * ``attention_mask [B, S]`` bool over KEY slots (True = may be attended), ``S = L``
          without a cache, ``S = S_max`` with one; None = all allowed.
        * Without a cache: query ``i`` attends keys ``j <= i`` that the mask allows.
        * With ``cache`` (a :class:`KVCache`) and ``cache_index`` (scalar int32, the same for every
          row): the new K/V, rounded to ``numerics.kv_format``, are written at slots
          ``[cache_index, cache_index + L)`` and query ``i`` (slot ``cache_index + i``) attends key
          slots ``j <= cache_index + i`` that the mask allows. ``cache_index + L <= S_max`` is the
          caller's to guarantee (``dynamic_update_slice`` clamps the start otherwise).

        A query whose every key is masked gets a uniform average (finite, meaningless): only
        positions with at least one allowed key are defined. Returns ``(hidden [B, L, H], updated
        cache or None)``.
        """
        n = self.numerics
        B, L = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        if cache is None:
            if cache_index is not None:
                raise ValueError("cache_index given without a cache")
            allowed = jnp.tril(jnp.ones((L, L), bool))[None]
        else:
            if cache_index is None:
                raise ValueError("a cache needs a cache_index")
            slots = jnp.arange(cache.max_len)
            allowed = (slots[None, :] <= cache_index + jnp.arange(L)[:, None])[None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.astype(bool)[:, None, :]
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        h = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(n.compute_dtype)
        written = []
        for i, layer in enumerate(self.layers):
            h, kv = layer(h, cos, sin, allowed, n, None if cache is None else (cache.k[i], cache.v[i]), cache_index)
            written.append(kv)
        if cache is not None:
            cache = KVCache(tuple(k for k, _ in written), tuple(v for _, v in written))
        return self.norm(h), cache

    def logits(self, h: jax.Array) -> jax.Array:
        """``h W_lm`` for final-normed hidden states ``h [B, L, H]`` (:meth:`hidden_states`):
        logits ``[B, L, V]`` float32."""
        n = self.numerics
        if self.lm_head is None:
            logits = contract("blh,vh->blv", h, self.embed_tokens[...].astype(n.compute_dtype), n)
        else:
            logits = contract("blh,hv->blv", h, self.lm_head.kernel[...].astype(n.compute_dtype), n)
        return logits.astype(jnp.float32)


def with_numerics(model: QwenModel, numerics: Numerics) -> QwenModel:
    """A model computing with ``numerics`` over the SAME parameter arrays as ``model`` (no copy;
    a later :func:`load_state_into` on either one replaces only that one's arrays)."""
    dtype = model.embed_tokens.get_value().dtype
    new = nnx.eval_shape(lambda: QwenModel(model.config, rngs=nnx.Rngs(0), param_dtype=dtype, numerics=numerics))
    nnx.update(new, nnx.state(model, nnx.Param))
    return new


# ====================================================================== HF mapping
def hf_parameters(model: QwenModel) -> dict[str, tuple[nnx.Param, bool]]:
    """HF tensor name -> (the Param holding it, whether it is stored transposed)."""
    out: dict[str, tuple[nnx.Param, bool]] = {
        "model.embed_tokens.weight": (model.embed_tokens, False),
        "model.norm.weight": (model.norm.weight, False),
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = (model.lm_head.kernel, True)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, False)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, False)
        for owner, group, names in ((layer.self_attn, "self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                    (layer.mlp, "mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                lin = getattr(owner, name)
                out[f"{p}{group}.{name}.weight"] = (lin.kernel, True)
                if lin.bias is not None:
                    out[f"{p}{group}.{name}.bias"] = (lin.bias, False)
        if layer.self_attn.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = (layer.self_attn.q_norm.weight, False)
            out[p + "self_attn.k_norm.weight"] = (layer.self_attn.k_norm.weight, False)
    return out


def load_state_into(model: QwenModel, state: Mapping[str, np.ndarray]) -> None:
    """Replace every parameter of ``model`` in place by the HF-named ``state`` (validated with
    :func:`hetrl.models.check_state_dict`: names, shapes, finite floats; ``CheckpointError``
    otherwise). Values are cast to each parameter's dtype and placed with its current sharding,
    so jitted functions taking ``nnx.state(model)`` do not retrace."""
    check_state_dict(model.config, state)
    for name, (param, transposed) in hf_parameters(model).items():
        arr = np.asarray(state[name])
        old = param.get_value()
        value = jnp.asarray(arr.T if transposed else arr, dtype=old.dtype)
        sharding = _placement(old)
        param.set_value(jax.device_put(value, sharding) if sharding is not None else value)


def _placement(old) -> jax.sharding.Sharding | None:
    """Where a new value for a parameter now holding ``old`` goes: a concrete array's own sharding;
    for an abstract one (from ``nnx.eval_shape``) its named sharding on the active concrete mesh
    (``jax.set_mesh``), or None (the default device) when it carries none."""
    sharding = getattr(old, "sharding", None)
    if isinstance(old, jax.Array) or sharding is None:
        return sharding
    return jax.sharding.NamedSharding(jax.sharding.get_mesh(), sharding.spec)


def to_hf_state_dict(model: QwenModel) -> dict[str, np.ndarray]:
    """Every parameter as a float32 numpy array under its HF name and in HF layout (``[out, in]``);
    the exact inverse of :func:`load_state_into` for float32 params (a tied model has no
    ``lm_head.weight``, as in HF)."""
    out = {}
    for name, (param, transposed) in hf_parameters(model).items():
        arr = np.asarray(jax.device_get(param.get_value())).astype(np.float32)
        out[name] = np.ascontiguousarray(arr.T if transposed else arr)
    return out


def from_hf_state_dict(config: ModelConfig, state: Mapping[str, np.ndarray], *, param_dtype=jnp.float32,
                       numerics: Numerics = Numerics(), rngs: nnx.Rngs | None = None) -> QwenModel:
    """A :class:`QwenModel` holding ``state`` (HF names, ``[out, in]`` layout, any float dtype).
    The module is built abstractly (no random init is computed) unless ``rngs`` is given, in which
    case it is built with them first; the result is the same either way."""
    def build(r):
        return QwenModel(config, rngs=r, param_dtype=param_dtype, numerics=numerics)

    model = build(rngs) if rngs is not None else nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    load_state_into(model, state)
    return model


def load_hf(directory: str | os.PathLike, *, param_dtype=jnp.float32, numerics: Numerics = Numerics()) -> QwenModel:
    """A model from an HF checkpoint directory (``config.json`` + safetensors, single or sharded)."""
    return from_hf_state_dict(ModelConfig.load(directory), load_state_dict(directory), param_dtype=param_dtype, numerics=numerics)
