"""Fake quantization: round arrays to the number formats accelerators store weights and KV caches in.

``quantize_dequantize(x, fmt)`` returns ``x`` as it reads back after being stored in ``fmt``: same
shape and dtype, every value on the format's grid, rounded exactly as the format's rules say
(round-to-nearest-even on the element grid, saturating where the format saturates). It serves
numpy and jax.numpy with one implementation (also under ``jax.jit``, with ``fmt`` static), and
torch tensors through a numpy round trip. All arithmetic is float32: ``x`` is first cast to
float32, the result is cast back to ``x.dtype``. ``quantize`` / ``dequantize`` expose the two
halves (element codes and scales, see :class:`QuantizedTensor`)::

    w_fp8 = quantize_dequantize(w, "fp8_e4m3")                       # numpy or jax
    a_fp4 = quantize_activations(x, "nvfp4")                          # per token: W4A4's matmul input
    kv_fp4 = jax.jit(quantize_dequantize, static_argnums=1)(kv, "nvfp4")
    q = quantize(w, "mxfp4"); q.values, q.scale                       # E2M1 codes, E8M0 scales

Formats (``FORMATS``). *amax* is ``max |x|`` over a scale group, ``e4m3(.)``, ``e2m1(.)`` are
round-to-nearest-even casts to ``float8_e4m3fn`` / ``float4_e2m1fn`` (via ml_dtypes):

============== =================== ======================================= ==========================
format         element             scale group                             scale
============== =================== ======================================= ==========================
fp32           float32             --                                      --
bf16           bfloat16            --                                      --
fp16           float16             --                                      --
fp8_e4m3       float8_e4m3fn (448) the last axis (per channel)             amax / 448
fp8_e4m3_block float8_e4m3fn (448) 128 x 128 blocks over the last two axes amax / 448
fp8_e4m3_g128  float8_e4m3fn (448) 128 along the last axis (1 x 128 groups) amax / 448
fp8_e4m3fnuz   float8_e4m3fnuz     the last axis                           amax / 240
               (AMD MI300, 240)
nvfp4          float4_e2m1fn (6)   16 along the last axis, plus one        t = amax_tensor / (6*448);
                                   float32 scale for the whole tensor      s = e4m3(amax / 6 / t)
mxfp4          float4_e2m1fn (6)   32 along the last axis (OCP MX v1.0)    2^(floor(log2 amax) - 2),
                                                                           as E8M0: >= 2^-127
int8           int8 (127)          the last axis                           amax / 127
============== =================== ======================================= ==========================

Per scale group, with ``top`` the element maximum in parentheses::

    code = elem(clip(x / scale, -top, top))      (int8: elem = round half to even)
    dq   = code * scale                           (nvfp4: (code * s) * t, scale = s * t)

so a group's amax lands on the top of the element grid (mxfp4: on 4 or 6, as amax / scale is in
[4, 8)). The plain casts (fp32, bf16, fp16) round to nearest even and overflow to +-inf like IEEE;
the scaled formats saturate (clip) instead. "Per channel" means one scale per slice along the last
axis: for an HF weight ``[out, in]`` one scale per output channel, for a KV cache
``[..., head_dim]`` one per token-head vector. Divisions are true float32 divisions on every
backend (see :func:`_div`: XLA would otherwise turn some into reciprocal multiplications).

Edge cases, as implemented:

* Blocked formats pad the blocked axes with zeros up to whole blocks (zeros never change a block's
  amax) and crop the padding off again, so any length works; ``fp8_e4m3_block`` needs
  ``ndim >= 2``, the other scaled formats ``ndim >= 1`` (``ValueError`` otherwise).
* A group of zeros, or one whose float32 scale underflows to 0, reads back as zeros (never NaN);
  mxfp4 stores the E8M0 floor 2^-127 as the scale of an all-zero block. NaN or +-inf anywhere in a
  scale group turns the whole group into NaN (for nvfp4 the whole tensor, through the tensor
  scale), with no numpy floating-point warnings on the way.
* Idempotence (``quantize_dequantize`` twice == once, bit for bit, float32 in): the group max maps
  to ``top``, so requantizing sees ``amax' = fl(top * s)``, and ``fl(fl(top * s) / top) == s`` for
  every ``s = fl(amax / top)`` (checked over all float32 mantissas for 127, 240, 448 and 6*448):
  the scale is a fixed point and the codes then reproduce. This holds for bf16, fp16, fp32 and
  mxfp4 (power-of-two scales, every step exact) always; for fp8_e4m3(_block/_g128/fnuz) and int8 when
  every nonzero group amax is a normal float32 (>= 2^-126); for nvfp4 when the tensor amax is
  >= 2^-114 (a normal tensor scale) and every nonzero E4M3 block scale is normal (>= 2^-6, i.e.
  block amax >= amax_tensor / 28672). The last condition is the format's own: a subnormal block
  scale grid is so coarse that the block max can round to 4 instead of 6, and requantizing then
  picks a smaller block scale.
* jax on CPU flushes float32 subnormals to zero. numpy and jax agree bit for bit when the input
  has no float32 subnormals and every group amax (nvfp4: the tensor amax) is >= 2^-100, so that
  no scale or dequantized value is subnormal either.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hetrl.core.xp import Array, backend_name, device, namespace

__all__ = ["FORMATS", "ACTIVATION_FORMATS", "QuantizedTensor", "quantize", "dequantize", "quantize_dequantize",
           "quantize_activations"]


@dataclass(frozen=True)
class _Spec:
    element: Any  # element dtype (numpy / ml_dtypes scalar type)
    top: float = 0.0  # largest element magnitude; a group's amax maps onto it
    rule: str = ""  # scale rule: "amax" (amax / top), "nvfp4", "mxfp4"; "" = plain cast
    block: tuple[int | None, ...] = ()  # block lengths over the trailing axes; None = whole axis


_SPECS: dict[str, _Spec] = {
    "fp32": _Spec(np.float32),
    "bf16": _Spec(ml_dtypes.bfloat16),
    "fp16": _Spec(np.float16),
    "fp8_e4m3": _Spec(ml_dtypes.float8_e4m3fn, 448.0, "amax", (None,)),
    "fp8_e4m3_block": _Spec(ml_dtypes.float8_e4m3fn, 448.0, "amax", (128, 128)),
    "fp8_e4m3_g128": _Spec(ml_dtypes.float8_e4m3fn, 448.0, "amax", (128,)),
    "fp8_e4m3fnuz": _Spec(ml_dtypes.float8_e4m3fnuz, 240.0, "amax", (None,)),
    "nvfp4": _Spec(ml_dtypes.float4_e2m1fn, 6.0, "nvfp4", (16,)),
    "mxfp4": _Spec(ml_dtypes.float4_e2m1fn, 6.0, "mxfp4", (32,)),
    "int8": _Spec(np.int8, 127.0, "amax", (None,)),
}

FORMATS: tuple[str, ...] = tuple(_SPECS)
"""Names accepted by :func:`quantize` and :func:`quantize_dequantize`."""

ACTIVATION_FORMATS: tuple[str, ...] = ("none", "fp8_e4m3", "fp8_e4m3fnuz", "fp8_e4m3_g128", "int8", "nvfp4", "mxfp4")
"""Names accepted by :func:`quantize_activations`: ``"none"`` (the matmul reads the activations in
the compute dtype) and the formats whose scale groups lie within one token."""

_E4M3_MAX = 448.0
_E8M0_MIN = 2.0**-127
_FP16_OVERFLOW = 65520.0  # |x| >= this rounds to inf in float16 (midpoint of 65504 and 2^16)


@dataclass(frozen=True)
class QuantizedTensor:
    """An array stored in ``fmt``: element codes, their scales, and how to undo the blocking.

    * ``values``: the element codes in the element dtype (``bfloat16``, ``float8_e4m3fn``,
      ``float4_e2m1fn``, ``int8``, ...). Plain casts keep ``x``'s shape. Scaled formats use the
      blocked layout: each blocked trailing axis of length ``n`` is zero-padded to ``N`` (whole
      blocks of ``b``) and split into ``(N // b, b)``; per-channel formats block the last axis
      whole. So ``[out, in]`` becomes ``[out, 1, in]`` (fp8_e4m3, int8), ``[out, in/16, 16]``
      (nvfp4), ``[out/128, 128, in/128, 128]`` (fp8_e4m3_block).
    * ``scale``: float32, one per block (size 1 on the in-block axes, so it broadcasts against
      ``values``); each value is exactly representable in the format's scale type (E4M3 for
      nvfp4, E8M0 for mxfp4). ``None`` for plain casts.
    * ``tensor_scale``: nvfp4's float32 per-tensor scale (0-d; per row, ``[..., 1, 1]``, with
      ``quantize(..., per_row=True)``), ``None`` otherwise.
    * ``shape``, ``dtype``: the original array's, restored by :func:`dequantize`.
    """

    fmt: str
    values: Array
    scale: Array | None
    tensor_scale: Array | None
    shape: tuple[int, ...]
    dtype: Any


def quantize(x: Array, fmt: str, *, per_row: bool = False) -> QuantizedTensor:
    """``x`` (numpy or jax, any shape, real floating dtype) encoded in ``fmt``; see the module doc.

    ``per_row=True`` encodes every row ``x[i, ..., :]`` (a slice along the last axis) as a
    tensor of its own: nvfp4's tensor scale is then one per row (``tensor_scale`` of shape
    ``[..., 1, 1]``, broadcasting against ``values``); the other formats' scale groups already lie
    within a row and are unchanged; ``fp8_e4m3_block``, whose blocks span rows, is refused.

    Raises ``ValueError`` for an unknown ``fmt`` or too few dimensions, ``TypeError`` for a
    non-floating dtype or a torch tensor (use :func:`quantize_dequantize` for those).
    """
    spec = _spec(fmt)
    if per_row and len(spec.block) > 1:
        raise ValueError(f"format {fmt!r} blocks {len(spec.block)} axes: its scale groups span rows (per_row)")
    if backend_name(x) == "torch":
        raise TypeError("quantize() takes numpy or jax arrays; use quantize_dequantize() for torch tensors")
    _check_dtype(x)
    xp = namespace(x)
    v = xp.astype(x, xp.float32)
    if not spec.rule:
        if spec.element is np.float16:  # overflow to inf explicitly: numpy warns when the cast does it
            v = xp.where(xp.abs(v) >= _FP16_OVERFLOW, xp.copysign(xp.full_like(v, math.inf), v), v)
        return QuantizedTensor(fmt, xp.astype(v, spec.element), None, None, tuple(x.shape), x.dtype)

    k = len(spec.block)
    if v.ndim < k:
        raise ValueError(
            f"format {fmt!r} blocks the last {k} axes and needs at least {k} dimension(s); "
            f"got shape {tuple(x.shape)}"
        )
    g = _to_blocks(xp, v, spec.block)
    in_block = tuple(range(-2 * k + 1, 0, 2))  # the b-axes of (..., n1, b1, ..., nk, bk)
    amax = _amax(xp, g, in_block)
    tensor_scale = None
    if spec.rule == "amax":
        scale = xp.where(xp.isfinite(amax), _div(xp, amax, spec.top), xp.nan)
        divisor = scale
    elif spec.rule == "nvfp4":
        total = _amax(xp, g, (-2, -1) if per_row else tuple(range(g.ndim)))
        t = xp.where(xp.isfinite(total), _div(xp, total, spec.top * _E4M3_MAX), xp.nan)
        s = _safe_div(xp, _div(xp, amax, spec.top), t)
        scale = xp.astype(xp.astype(xp.clip(s, 0.0, _E4M3_MAX), ml_dtypes.float8_e4m3fn), xp.float32)
        divisor = scale * t
        tensor_scale = t if per_row else xp.reshape(t, ())
    else:  # mxfp4: amax = m * 2^e with m in [0.5, 1), so amax / (8 m) = 2^(floor(log2 amax) - 2) exactly
        ok = xp.isfinite(amax) & (amax > 0)
        a = xp.where(ok, amax, 1.0)
        m, _ = xp.frexp(a)
        scale = xp.maximum(xp.where(ok, _div(xp, a, 8.0 * m), 0.0), _E8M0_MIN)
        scale = xp.where(xp.isfinite(amax), scale, xp.nan)
        divisor = scale
    r = xp.clip(_safe_div(xp, g, divisor), -spec.top, spec.top)
    if spec.element is np.int8:
        r = xp.round(r)
    return QuantizedTensor(fmt, xp.astype(r, spec.element), scale, tensor_scale, tuple(x.shape), x.dtype)


def dequantize(q: QuantizedTensor) -> Array:
    """The array ``q`` stands for: ``values * scale`` (nvfp4: ``(values * scale) * tensor_scale``),
    unblocked and cropped to ``q.shape``, in ``q.dtype``. The products are float32."""
    xp = namespace(q.values)
    y = xp.astype(q.values, xp.float32)
    if q.scale is not None:
        y = y * q.scale
        if q.tensor_scale is not None:
            y = y * q.tensor_scale
        y = _from_blocks(xp, y, q.shape)
    return xp.astype(y, q.dtype)


def quantize_dequantize(x: Array, fmt: str) -> Array:
    """``dequantize(quantize(x, fmt))``: ``x`` rounded to ``fmt``, same shape and dtype.

    numpy and jax arrays (jit-compatible with ``fmt`` static); torch tensors go through numpy on
    the CPU and come back on their device and dtype, detached (no gradient).
    """
    if backend_name(x) == "torch":
        torch = sys.modules["torch"]
        _spec(fmt)
        if not torch.is_floating_point(x):
            raise TypeError(f"quantize_dequantize needs a real floating array, got dtype {x.dtype}")
        y = quantize_dequantize(x.detach().to(device="cpu", dtype=torch.float32).numpy(), fmt)
        return torch.from_numpy(y).to(device=x.device, dtype=x.dtype)
    return dequantize(quantize(x, fmt))


def quantize_activations(x: Array, fmt: str) -> Array:
    """A matmul input ``x [..., K]`` (``K`` contracted) rounded as a serving engine's
    low-precision GEMM reads it: every token (row along ``K``) quantized on its own with scales
    computed from that row at run time (dynamic), so a token's rounding never depends on the other
    tokens of the batch. ``fmt`` is one of :data:`ACTIVATION_FORMATS`; ``"none"`` returns ``x``.

    ========== ======================================================== ==========================
    fmt        scales per token                                         serving counterpart
    ========== ======================================================== ==========================
    fp8_e4m3   one, amax / 448                                          FP8 W8A8, per-token dynamic
    fp8_e4m3fnuz one, amax / 240                                        the same on MI300 (FNUZ)
    fp8_e4m3_g128 one per 128 elements, amax / 448                      DeepSeek-style 1 x 128
    int8       one, amax / 127 (symmetric)                              INT8 W8A8, per-token
    nvfp4      one per 16 elements, E4M3, times one float32 scale       NVFP4 W4A4
               t = amax_token / (6 * 448)
    mxfp4      one per 32 elements, E8M0                                MXFP4 W4A4
    ========== ======================================================== ==========================

    nvfp4's float32 scale is NVFP4's tensor scale with the token as the tensor. Engines load a
    static, calibrated activation tensor scale instead (checkpoint ``input_scale``); only where the
    E4M3 block-scale grid sits moves with it (the block scale keeps its 3-bit mantissa either way,
    unless a block is 28672x below the amax), and a per-token scale keeps the emulation
    independent of batch composition and of any calibration set. Same shape and dtype out; the
    arithmetic is float32 (pass float32 to keep the dequantized values unrounded).
    """
    if fmt == "none":
        return x
    if fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"unknown activation format {fmt!r}; valid: {', '.join(ACTIVATION_FORMATS)}")
    return dequantize(quantize(x, fmt, per_row=True))


def _spec(fmt: str) -> _Spec:
    try:
        return _SPECS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown precision format {fmt!r}; valid formats: {', '.join(FORMATS)}") from None


def _check_dtype(x: Array) -> None:
    if np.dtype(x.dtype).kind in "biuc":  # ml_dtypes floats (bfloat16, ...) have kind "V"
        raise TypeError(f"quantization needs a real floating array, got dtype {x.dtype}")


def _safe_div(xp: Any, a: Array, b: Array) -> Array:
    """``a / b`` where ``b > 0``, else 0 (zero, underflowed or NaN scales), without 0/0."""
    ok = b > 0
    return xp.where(ok, _div(xp, a, xp.where(ok, b, 1.0)), 0.0)


def _div(xp: Any, a: Array, b: Array | float) -> Array:
    """``a / b``, one correctly rounded float32 division per element on every backend.

    XLA rewrites ``A / broadcast(B)`` into ``A * broadcast(1 / B)`` and ``(A / B) / C`` into
    ``A / (B * C)``, which differ in the last bit and would break both numpy parity and the scale
    fixed point ``fl(fl(c * s) / c) == s`` that makes requantization idempotent. On jax both
    operands are therefore broadcast to the result shape and passed through an optimization
    barrier, which the simplifier cannot see through.
    """
    if backend_name(a) != "jax":
        return a / b
    jax = sys.modules["jax"]
    b = xp.asarray(b, dtype=a.dtype)
    shape = jax.numpy.broadcast_shapes(a.shape, b.shape)
    a, b = jax.lax.optimization_barrier((xp.broadcast_to(a, shape), xp.broadcast_to(b, shape)))
    return a / b


def _amax(xp: Any, g: Array, axes: tuple[int, ...]) -> Array:
    """``max |g|`` over ``axes`` (keepdims), NaN if any entry is NaN; 0 when those axes are empty.

    The NaN check is explicit: XLA's CPU max reduction may skip NaNs.
    """
    axes = tuple(a % g.ndim for a in axes)
    if any(g.shape[a] == 0 for a in axes):
        return xp.zeros(tuple(1 if i in axes else n for i, n in enumerate(g.shape)), dtype=g.dtype, device=device(g))
    amax = xp.max(xp.abs(g), axis=axes, keepdims=True)
    return xp.where(xp.any(xp.isnan(g), axis=axes, keepdims=True), xp.nan, amax)


def _to_blocks(xp: Any, v: Array, block: tuple[int | None, ...]) -> Array:
    """Zero-pad the last ``len(block)`` axes to whole blocks and split each into (n_blocks, b)."""
    k = len(block)
    lead, tail = tuple(v.shape[: v.ndim - k]), tuple(v.shape[v.ndim - k :])
    split: list[int] = []
    for i, (n, b) in enumerate(zip(tail, block)):
        b = (n or 1) if b is None else b
        pad = -n % b
        if pad:
            axis = len(lead) + i
            zeros = xp.zeros(tuple(v.shape[:axis]) + (pad,) + tuple(v.shape[axis + 1 :]), dtype=v.dtype, device=device(v))
            v = xp.concat([v, zeros], axis=axis)
        split += [(n + pad) // b, b]
    return xp.reshape(v, lead + tuple(split))


def _from_blocks(xp: Any, g: Array, shape: tuple[int, ...]) -> Array:
    """Inverse of :func:`_to_blocks`: merge the (n_blocks, b) pairs and crop to ``shape``."""
    k = g.ndim - len(shape)
    lead = tuple(shape[: len(shape) - k])
    padded = tuple(g.shape[len(lead) + 2 * i] * g.shape[len(lead) + 2 * i + 1] for i in range(k))
    y = xp.reshape(g, lead + padded)
    return y[(...,) + tuple(slice(0, n) for n in shape[len(lead) :])]
