"""Fake quantization (hetrl.core.precision): grids, scale rules, idempotence, backend parity.

The format constants below are restated here on purpose (and checked against ml_dtypes' finfo),
so the tests do not just read the implementation's own tables back.
"""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from hetrl.core.precision import FORMATS, dequantize, quantize, quantize_dequantize

pytestmark = pytest.mark.filterwarnings("error")  # e.g. numpy's overflow / invalid-value warnings

CASTS = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}
# scaled format -> (element dtype, grid top, block lengths over the trailing axes; None = whole axis)
SCALED = {
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0, (None,)),
    "fp8_e4m3_block": (ml_dtypes.float8_e4m3fn, 448.0, (128, 128)),
    "fp8_e4m3_g128": (ml_dtypes.float8_e4m3fn, 448.0, (128,)),
    "fp8_e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, 240.0, (None,)),
    "nvfp4": (ml_dtypes.float4_e2m1fn, 6.0, (16,)),
    "mxfp4": (ml_dtypes.float4_e2m1fn, 6.0, (32,)),
    "int8": (np.int8, 127.0, (None,)),
}
PER_GROUP_AMAX = ("fp8_e4m3", "fp8_e4m3_block", "fp8_e4m3_g128", "fp8_e4m3fnuz", "int8")  # scale = amax / top


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def blocked(a, fmt):
    """``a`` zero-padded and split into the format's blocks: (..., n1, b1, ..., nk, bk)."""
    sizes = SCALED[fmt][2]
    k = len(sizes)
    lead, tail = a.shape[: a.ndim - k], a.shape[a.ndim - k :]
    sizes = [(n or 1) if b is None else b for n, b in zip(tail, sizes)]
    a = np.pad(a, [(0, 0)] * len(lead) + [(0, -n % b) for n, b in zip(tail, sizes)])
    split = sum(((n // b, b) for n, b in zip(a.shape[len(lead) :], sizes)), ())
    return a.reshape(lead + split)


def in_block_axes(fmt):
    k = len(SCALED[fmt][2])
    return tuple(range(-2 * k + 1, 0, 2))


def block_amax(a, fmt):
    return np.abs(blocked(a, fmt)).max(axis=in_block_axes(fmt), keepdims=True)


def weights(seed, shape, log2_scale=0, spread=0, zero_rows=False, coarse=False):
    """Gaussian rows, each scaled by 2^(log2_scale + U{-spread..spread})."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(shape)
    if coarse:  # many exact ties and repeated maxima
        z = np.round(z * 4) / 4
    rows = rng.integers(-spread, spread + 1, size=shape[:-1] + (1,))
    x = z * np.exp2(rows + log2_scale)
    if zero_rows and x.ndim > 1:
        x[rng.random(shape[:-1]) < 0.2] = 0.0
    return x.astype(np.float32)


def mixed_rows(shape, seed=0):
    """Rows spanning 2^-60..2^60, a zero row, a row of exact grid ties: the parity stress input."""
    x = weights(seed, shape)
    x = x * np.exp2(np.random.default_rng(seed + 1).integers(-60, 61, size=shape[:-1] + (1,))).astype(np.float32)
    x[..., 1, :] = 0.0
    ties = np.array([448.0, 1.0625, 5.0, -0.0, 2.5, 0.25, 0.75, -3.5, 17.0, 240.0], np.float32)
    x[..., 2, : ties.size] = ties[: shape[-1]]
    return x


def test_constants_match_ml_dtypes():
    for dtype, top, _ in SCALED.values():
        info = np.iinfo(dtype) if dtype is np.int8 else ml_dtypes.finfo(dtype)
        assert float(info.max) == top
    assert set(FORMATS) == set(CASTS) | set(SCALED)


@pytest.mark.parametrize("fmt", FORMATS)
@given(
    shape=st.one_of(
        st.tuples(st.integers(1, 300)),
        st.tuples(st.integers(1, 140), st.integers(1, 300)),
        st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 70)),
    ),
    seed=st.integers(0, 2**32 - 1),
    log2_scale=st.integers(-150, 100),
    spread=st.integers(0, 8),
    zero_rows=st.booleans(),
    coarse=st.booleans(),
)
def test_idempotent(fmt, shape, seed, log2_scale, spread, zero_rows, coarse):
    """Quantizing an already quantized array changes no bit, under the documented preconditions."""
    if fmt == "fp8_e4m3_block":
        assume(len(shape) >= 2)
    if fmt == "nvfp4":
        spread = min(spread, 3)  # keeps block scales E4M3-normal (see the precondition below)
    x = weights(seed, shape, log2_scale, spread, zero_rows, coarse)
    if fmt in PER_GROUP_AMAX:  # the scale must be computed from a normal amax
        a = block_amax(x, fmt)
        assume(np.all((a == 0) | (a >= 2.0**-126)))
    if fmt == "nvfp4":  # normal tensor scale, and no subnormal E4M3 block scale (the format's own exception)
        total, a = np.abs(x).max(), block_amax(x, fmt)
        assume(total >= 2.0**-114 and np.all((a == 0) | (a >= total / 28672 * 1.01)))
    once = quantize_dequantize(x, fmt)
    twice = quantize_dequantize(once, fmt)
    np.testing.assert_array_equal(bits(twice), bits(once))


def test_nvfp4_subnormal_block_scale_is_the_documented_exception():
    """With t = 1, a block of amax 0.01875 gets the subnormal E4M3 scale 2^-8 (0.01875/6 = 1.6 * 2^-9
    rounds up), its max lands on 4 (4.8 rounds down), and requantizing picks 2^-9: not a fixed point."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 16] = 2688.0, 0.01875
    q = quantize(x, "nvfp4")
    assert float(q.tensor_scale) == 1.0 and q.scale[0, 1, 0] == 2.0**-8
    once = quantize_dequantize(x, "nvfp4")
    twice = quantize_dequantize(once, "nvfp4")
    assert once[0, 16] == 4 * 2.0**-8 and twice[0, 16] == 6 * 2.0**-9
    assert once[0, 0] == twice[0, 0] == 2688.0


CASES = {
    "2d_ragged": lambda: weights(1, (70, 300), spread=3, zero_rows=True),
    "3d": lambda: weights(2, (2, 5, 48), log2_scale=-20, spread=2),
    "ties_big": lambda: weights(3, (150, 130), log2_scale=40, spread=1, coarse=True),
    "1d": lambda: weights(4, (77,), log2_scale=5),
}


def cases_for(fmt):
    return [c for c in CASES if not (fmt == "fp8_e4m3_block" and c == "1d")]


@pytest.mark.parametrize(("fmt", "case"), [(f, c) for f in SCALED for c in cases_for(f)])
def test_dequantized_values_lie_on_the_scaled_grid(fmt, case):
    """In every block, dq / scale is an element of the format (to float32 rounding; exactly for
    mxfp4's powers of two), and that element times the stored scale gives dq back bit for bit."""
    x = CASES[case]()
    element, top, _ = SCALED[fmt]
    q = quantize(x, fmt)
    dq = quantize_dequantize(x, fmt)
    db = blocked(dq, fmt)
    assert q.values.dtype == np.dtype(element) and q.values.shape == db.shape
    divisor = q.scale * q.tensor_scale if fmt == "nvfp4" else q.scale
    r = np.where(divisor > 0, db / np.where(divisor > 0, divisor, 1), 0).astype(np.float32)
    codes = np.rint(r) if element is np.int8 else r.astype(element).astype(np.float32)
    assert np.all(np.abs(codes) <= top)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(bits(r), bits(codes))
    else:
        np.testing.assert_allclose(r, codes, rtol=2**-20, atol=0)
    back = codes * q.scale * q.tensor_scale if fmt == "nvfp4" else codes * q.scale
    np.testing.assert_array_equal(bits(back), bits(db))
    np.testing.assert_array_equal(bits(np.asarray(q.values, np.float32)), bits(codes))


@pytest.mark.parametrize("fmt", list(CASTS))
def test_casts_are_representable_round_to_nearest_even(fmt):
    x = weights(5, (64, 100), spread=6)
    dq = quantize_dequantize(x, fmt)
    element = CASTS[fmt]
    np.testing.assert_array_equal(bits(dq), bits(x.astype(element).astype(np.float32)))
    np.testing.assert_array_equal(bits(dq.astype(element).astype(np.float32)), bits(dq))


@pytest.mark.parametrize(("fmt", "case"), [(f, c) for f in PER_GROUP_AMAX for c in cases_for(f)])
def test_per_group_scale_is_amax_over_top_and_amax_maps_to_top(fmt, case):
    x = CASES[case]()
    _, top, _ = SCALED[fmt]
    q = quantize(x, fmt)
    a = block_amax(x, fmt)
    np.testing.assert_array_equal(bits(q.scale), bits(a / np.float32(top)))
    code_max = np.abs(np.asarray(q.values, np.float32)).max(axis=in_block_axes(fmt), keepdims=True)
    np.testing.assert_array_equal(code_max[a > 0], top)  # 448 for e4m3, 240 for fnuz, 127 for int8


def test_fp8_block_scales_tile_the_last_two_axes():
    x = weights(6, (2, 200, 300), spread=4)
    q = quantize(x, "fp8_e4m3_block")
    assert q.scale.shape == (2, 2, 1, 3, 1)
    for i, j in [(0, 0), (1, 1), (1, 2)]:  # (1, 2): the ragged corner block 72 x 44
        tile = x[:, 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
        np.testing.assert_array_equal(q.scale[:, i, 0, j, 0], np.abs(tile).max(axis=(1, 2)) / np.float32(448))


@pytest.mark.parametrize("case", list(CASES))
def test_nvfp4_scales_follow_the_two_level_rule(case):
    x = CASES[case]()
    q = quantize(x, "nvfp4")
    t = np.float32(np.abs(x).max()) / np.float32(6 * 448)
    assert q.tensor_scale.shape == () and bits(q.tensor_scale) == bits(t)
    a = block_amax(x, "nvfp4")
    s = np.clip(a / np.float32(6) / t, 0, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(bits(q.scale), bits(s))
    e4m3 = q.scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(bits(e4m3), bits(q.scale))  # block scales are E4M3 values
    normal = q.scale >= 2.0**-6  # a block's max lands on 6 whenever its scale is E4M3-normal
    code_max = np.abs(np.asarray(q.values, np.float32)).max(axis=-1, keepdims=True)
    assert normal.any()
    np.testing.assert_array_equal(code_max[normal], 6.0)


@pytest.mark.parametrize("case", list(CASES))
def test_mxfp4_scales_are_e8m0_powers_of_two(case):
    x = CASES[case]()
    x.reshape(-1)[:32] *= np.float32(2.0**-140)  # a block near or below 2^-127: the E8M0 floor
    q = quantize(x, "mxfp4")
    a = block_amax(x, "mxfp4").astype(np.float64)
    _, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    expected = np.where(a > 0, np.maximum(np.ldexp(1.0, e - 3), 2.0**-127), 2.0**-127)
    np.testing.assert_array_equal(q.scale, expected.astype(np.float32))
    mantissa, _ = np.frexp(q.scale)
    np.testing.assert_array_equal(mantissa, 0.5)
    e8m0 = q.scale.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(bits(e8m0), bits(q.scale))
    code_max = np.abs(np.asarray(q.values, np.float32)).max(axis=-1, keepdims=True)
    unclamped = a >= 2.0**-125
    assert set(np.unique(code_max[unclamped])) <= {4.0, 6.0}


def test_error_ordering_on_gaussian_weights():
    w = (np.random.default_rng(7).standard_normal((256, 1024)) * 0.02).astype(np.float32)
    err = {f: float(np.sqrt(np.mean((quantize_dequantize(w, f) - w) ** 2) / np.mean(w**2))) for f in FORMATS}
    assert err["fp32"] == 0.0
    assert err["fp16"] < err["bf16"] < err["int8"] < err["fp8_e4m3"] < err["nvfp4"] < err["mxfp4"]
    for fp8 in ("fp8_e4m3_block", "fp8_e4m3_g128", "fp8_e4m3fnuz"):  # same 3-bit mantissa: same error to ~10%
        assert abs(err[fp8] / err["fp8_e4m3"] - 1) < 0.1
    assert err["bf16"] < 3e-3 and err["nvfp4"] < 0.12 and err["mxfp4"] < 0.15


@pytest.fixture(scope="module")
def jax_qdq():
    import jax
    return jax.jit(quantize_dequantize, static_argnums=1), jax.numpy


PARITY_SHAPES = [(37, 200), (2, 130, 48)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_numpy_and_jitted_jax_agree_bit_for_bit(fmt, jax_qdq):
    qdq, jnp = jax_qdq
    for i, shape in enumerate(PARITY_SHAPES):
        x = mixed_rows(shape, seed=i)
        ours = quantize_dequantize(x, fmt)
        theirs = np.asarray(qdq(jnp.asarray(x), fmt))
        np.testing.assert_array_equal(bits(theirs), bits(ours))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_stay_zeros(fmt, jax_qdq):
    qdq, jnp = jax_qdq
    for shape in [PARITY_SHAPES[0], (130, 129), (0, 16), (3, 0)]:
        z = np.zeros(shape, np.float32)
        out = quantize_dequantize(z, fmt)
        assert out.shape == shape and out.dtype == np.float32
        np.testing.assert_array_equal(bits(out), bits(z))
    np.testing.assert_array_equal(np.asarray(qdq(jnp.zeros(PARITY_SHAPES[0]), fmt)), 0.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_inputs_poison_their_scale_group(fmt, jax_qdq):
    qdq, jnp = jax_qdq
    x = np.ones(PARITY_SHAPES[0], np.float32)
    x[0, 3], x[1, 5], x[2, 7] = np.nan, np.inf, -np.inf
    out = quantize_dequantize(x, fmt)  # numpy warnings would fail here (pytest filterwarnings)
    np.testing.assert_array_equal(np.asarray(qdq(jnp.asarray(x), fmt)), out)  # NaN payloads may differ
    if fmt in CASTS:
        assert np.isnan(out[0, 3]) and out[1, 5] == np.inf and out[2, 7] == -np.inf
        assert np.isfinite(out).sum() == x.size - 3
    elif fmt == "nvfp4":
        assert np.isnan(out).all()
    else:
        axes, real = in_block_axes(fmt), blocked(np.ones_like(x), fmt) > 0  # real: not padding
        poisoned = (~np.isfinite(blocked(x, fmt))).any(axis=axes, keepdims=True)
        assert poisoned.sum() == (1 if fmt == "fp8_e4m3_block" else 3)
        np.testing.assert_array_equal(np.isnan(blocked(out, fmt)), poisoned & real)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_shape_and_dtype_are_kept(fmt, dtype):
    x = weights(8, (3, 33), spread=2).astype(dtype)
    out = quantize_dequantize(x, fmt)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(out, quantize_dequantize(x.astype(np.float32), fmt).astype(dtype))
    q = quantize(x, fmt)
    assert dequantize(q).dtype == x.dtype and q.shape == x.shape


@pytest.mark.parametrize("fmt", list(SCALED))
@pytest.mark.parametrize("log2_scale", [-149, -140, -130, 120])
def test_tiny_and_huge_inputs_stay_finite(fmt, log2_scale):
    """Down in the float32 subnormals the scales lose bits (so the group max may land a few % off),
    but nothing turns into NaN or inf."""
    x = weights(10, (20, 200), log2_scale, spread=4)
    out = quantize_dequantize(x, fmt)
    assert np.isfinite(out).all()
    assert np.abs(out).max() <= np.abs(x).max() * (1 + (0.1 if log2_scale < -126 else 2**-20))


def test_nvfp4_block_scale_saturates_when_the_tensor_scale_is_subnormal():
    """amax = 3763 * 2^-149: t = fl(amax / 2688) = 2^-149 (1.4 rounds to 1), so amax / 6 / t = 627,
    beyond E4M3's 448: the block scale saturates at 448 instead of casting to NaN."""
    x = np.array([[3763 * 2.0**-149] + [0.0] * 15], np.float32)
    q = quantize(x, "nvfp4")
    assert float(q.tensor_scale) == 2.0**-149 and q.scale[0, 0, 0] == 448.0
    assert np.isfinite(quantize_dequantize(x, "nvfp4")).all()


def test_fp16_overflows_to_inf_and_scaled_formats_saturate():
    x = np.array([[65519.0, 65520.0, -1e6, 1.0]], np.float32)
    np.testing.assert_array_equal(quantize_dequantize(x, "fp16"), [[65504.0, np.inf, -np.inf, 1.0]])
    assert np.isfinite(quantize_dequantize(x, "fp8_e4m3")).all()


def test_bad_arguments_raise():
    x = np.ones((4, 32), np.float32)
    with pytest.raises(ValueError, match="'fp7'") as err:
        quantize_dequantize(x, "fp7")
    assert all(f in str(err.value) for f in FORMATS)
    with pytest.raises(ValueError, match="fp8_e4m3_block.*2 dimension.*\\(32,\\)"):
        quantize_dequantize(np.ones(32, np.float32), "fp8_e4m3_block")
    with pytest.raises(ValueError, match="nvfp4"):
        quantize_dequantize(np.ones((), np.float32), "nvfp4")
    with pytest.raises(TypeError, match="int32"):
        quantize_dequantize(np.ones((4, 32), np.int32), "int8")


def test_torch_goes_through_numpy():
    import torch
    x = weights(9, (8, 64), spread=2)
    for fmt in ("bf16", "nvfp4", "int8"):
        t = torch.from_numpy(x).to(torch.bfloat16)
        out = quantize_dequantize(t, fmt)
        assert out.dtype == torch.bfloat16 and out.shape == t.shape
        ref = quantize_dequantize(t.float().numpy(), fmt)
        np.testing.assert_array_equal(out.float().numpy(), torch.from_numpy(ref).to(torch.bfloat16).float().numpy())


def test_import_pulls_in_no_framework():
    code = "import hetrl.core.precision, sys; print([m for m in ('jax', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
