"""Array-namespace binding: the one module of ``hetrl.core`` that knows numpy, jax.numpy and torch.

Every function in ``hetrl.core`` is written against the Python array API standard
(https://data-apis.org/array-api/) plus the handful of extra operations defined here. The
namespace of the inputs is found with :func:`namespace` (``array_api_compat.array_namespace``),
which never imports a framework: it inspects the types of the arrays it is given, so
``import hetrl.core`` pulls in neither jax nor torch.

Extras the standard lacks, each dispatched on the backend by name:

* :func:`stop_gradient`  -- ``jax.lax.stop_gradient`` / ``Tensor.detach`` / identity;
* :func:`logsumexp`      -- over an axis, with an optional boolean ``where`` mask, gradient-safe
  (masked entries get an exact zero gradient, never NaN, as long as every reduced slice keeps at
  least one entry); unmasked, it is the framework's fused kernel;
* :func:`log_softmax`    -- the framework's fused kernel (numpy: via :func:`logsumexp`);
* :func:`take_along_axis` -- gather along an axis with integer indices of any width;
* :func:`masked_sum`, :func:`masked_mean`, :func:`masked_max` -- reductions over masked entries.
"""

from __future__ import annotations

import sys
from typing import Any

import array_api_compat

Array = Any
"""An array of any supported backend (numpy.ndarray, jax.Array, torch.Tensor)."""

__all__ = [
    "Array",
    "namespace",
    "device",
    "backend_name",
    "stop_gradient",
    "logsumexp",
    "log_softmax",
    "take_along_axis",
    "masked_sum",
    "masked_mean",
    "masked_max",
    "to_numpy",
]


def namespace(*arrays: Array) -> Any:
    """The array-API namespace shared by ``arrays`` (numpy, jax.numpy or torch, wrapped).

    Python scalars and ``None`` are ignored. Raises ``TypeError`` when the arrays come from
    different libraries.
    """
    found = [a for a in arrays if a is not None and not isinstance(a, (bool, int, float))]
    if not found:
        raise TypeError("namespace() needs at least one array argument")
    return array_api_compat.array_namespace(*found)


def device(x: Array) -> Any:
    """The device ``x`` lives on, to pass as ``device=`` to the namespace's creation functions
    (``arange``, ``zeros``, ...), which otherwise allocate on the default device (torch: the CPU,
    whatever device the inputs are on). ``None`` for a traced jax array, where jax places it."""
    return array_api_compat.device(x)


def backend_name(x: Array) -> str:
    """``"numpy"``, ``"jax"`` or ``"torch"`` for an array of that library."""
    if array_api_compat.is_numpy_array(x):
        return "numpy"
    if array_api_compat.is_jax_array(x):
        return "jax"
    if array_api_compat.is_torch_array(x):
        return "torch"
    raise TypeError(f"unsupported array type {type(x).__module__}.{type(x).__name__}")


def stop_gradient(x: Array) -> Array:
    """``x`` with no gradient flowing back through it (identity on numpy)."""
    name = backend_name(x)
    if name == "jax":
        return sys.modules["jax"].lax.stop_gradient(x)
    if name == "torch":
        return x.detach()
    return x


def take_along_axis(x: Array, indices: Array, axis: int = -1) -> Array:
    """``out[..., i, ...] = x[..., indices[..., i, ...], ...]`` along ``axis``.

    ``indices`` has the same rank as ``x``; its dims other than ``axis`` must match ``x``'s
    (no broadcasting: torch does not broadcast here). Any integer width is accepted.
    """
    xp = namespace(x)
    if backend_name(x) == "torch":
        return sys.modules["torch"].take_along_dim(x, xp.astype(indices, xp.int64), dim=axis)
    return xp.take_along_axis(x, indices, axis=axis)


def logsumexp(x: Array, axis: int = -1, where: Array | None = None, keepdims: bool = False) -> Array:
    """``log Σ_{i: where_i} exp(x_i)`` along ``axis``.

    Masked entries are replaced by ``-inf`` *before* the exponential, so their gradient is an
    exact zero. The shift by the maximum is taken under :func:`stop_gradient` (the result does
    not depend on it), and a slice with no kept entry returns ``-inf`` without NaN in the
    forward pass.
    """
    xp = namespace(x)
    if where is None:
        name = backend_name(x)
        if name == "torch":  # fused native kernels, same math
            return sys.modules["torch"].logsumexp(x, dim=axis, keepdim=keepdims)
        if name == "jax":
            return sys.modules["jax"].nn.logsumexp(x, axis=axis, keepdims=keepdims)
    else:
        x = xp.where(where, x, xp.asarray(-xp.inf, dtype=x.dtype))
    shift = stop_gradient(xp.max(x, axis=axis, keepdims=True))
    shift = xp.where(xp.isfinite(shift), shift, xp.zeros_like(shift))
    total = xp.sum(xp.exp(x - shift), axis=axis, keepdims=True)
    out = xp.log(total) + shift
    return out if keepdims else xp.squeeze(out, axis=axis)


def log_softmax(x: Array, axis: int = -1) -> Array:
    """``x − logsumexp(x)`` along ``axis``; the framework's fused kernel on jax and torch."""
    name = backend_name(x)
    if name == "torch":
        return sys.modules["torch"].log_softmax(x, dim=axis)
    if name == "jax":
        return sys.modules["jax"].nn.log_softmax(x, axis=axis)
    return x - logsumexp(x, axis=axis, keepdims=True)


def masked_sum(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Sum of ``x`` over entries where ``mask`` is true (masked entries contribute exactly 0)."""
    xp = namespace(x)
    return xp.sum(xp.where(mask, x, xp.zeros_like(x)), axis=axis)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Mean of ``x`` over entries where ``mask`` is true; 0 where nothing is kept."""
    xp = namespace(x)
    count = xp.sum(xp.astype(mask, x.dtype), axis=axis)
    return masked_sum(x, mask, axis=axis) / xp.maximum(count, xp.ones_like(count))


def masked_max(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Max of ``x`` over entries where ``mask`` is true; 0 where nothing is kept."""
    xp = namespace(x)
    low = xp.asarray(-xp.inf, dtype=x.dtype)
    out = xp.max(xp.where(mask, x, low), axis=axis)
    return xp.where(xp.isfinite(out), out, xp.zeros_like(out))


def to_numpy(x: Array) -> Any:
    """A numpy copy of ``x`` (detached from any graph); numpy inputs are returned as is."""
    import numpy as np

    name = backend_name(x)
    if name == "torch":
        return x.detach().cpu().numpy()
    return np.asarray(x)
