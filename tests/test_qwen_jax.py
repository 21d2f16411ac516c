"""The Flax NNX Qwen2/Qwen3 decoder (hetrl.models.qwen_jax) against transformers, its own uncached
forward, its HF weight mapping, and the Numerics knobs.

Checkpoints are tiny (2 layers, H=64, V=512) with init_std=0.2 and perturbed norm weights (see
conftest_models). At that scale the float32 noise floor of the network itself is a few 1e-6 in
log-prob (HF float32 vs HF float64 differs by as much), so the 1e-5 parity bounds hold with a
small margin and are not loosened.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest_models import INIT_STD
from hetrl.core.precision import quantize_dequantize
from hetrl.models import CheckpointError, ModelConfig, load_state_dict
from hetrl.models.qwen_jax import (
    PARTITIONING, KVCache, Numerics, QwenModel, contract, from_hf_state_dict, grow_cache, init_cache, load_hf,
    load_state_into, to_hf_state_dict, with_numerics,
)
from hetrl.models.tiny import random_state_dict

ARCHS = ["qwen3", "qwen2"]
TRACES = {"forward": 0}


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, positions, mask):
    TRACES["forward"] += 1
    return nnx.merge(graphdef, state)(ids, positions, mask)[0]


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, ids, positions, mask, cache, index):
    return nnx.merge(graphdef, state)(ids, positions, mask, cache, index)


def forward(model, ids, positions=None, mask=None):
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, ids, positions, mask))


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    return {arch: load_hf(tiny_checkpoints[arch]) for arch in ARCHS}




def right_padded_batch(vocab: int, lengths=(16, 11, 6, 2), seed=0):
    rng = np.random.default_rng(seed)
    L = max(lengths)
    mask = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
    ids = np.where(mask, rng.integers(3, vocab, (len(lengths), L)), 0).astype(np.int32)
    return ids, mask


# ====================================================================== parity with transformers
@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(arch, models, hf_models):
    import torch

    model = models[arch]
    ids, mask = right_padded_batch(model.config.vocab_size)
    ours = log_softmax(forward(model, jnp.asarray(ids), mask=jnp.asarray(mask)))
    with torch.no_grad():
        logits = hf_models[arch](input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()).logits
    ref = torch.log_softmax(logits.float(), dim=-1).numpy()
    assert ours.shape == ref.shape == (*ids.shape, model.config.vocab_size)
    # the comparison means something: distributions far from uniform, and padding was exercised
    assert np.exp(ref[mask]).max(-1).mean() > 0.05 > 1 / model.config.vocab_size
    assert (-np.exp(ref[mask]) * ref[mask]).sum(-1).mean() < np.log(model.config.vocab_size) - 0.5
    np.testing.assert_array_less(np.abs(ours - ref)[mask].max(), 1e-5)
    # the per-token log-probs of the next tokens, the quantity RL uses
    tok = lambda lp: np.take_along_axis(lp[:, :-1], ids[:, 1:, None], -1)[..., 0]  # noqa: E731
    np.testing.assert_array_less(np.abs(tok(ours) - tok(ref))[mask[:, 1:]].max(), 1e-5)


def test_parity_test_can_fail(models, hf_models):
    """A qwen3 model that skips its QK-norm weights is far from transformers: the parity check
    above detects a wrong detail of the architecture."""
    import torch

    model = models["qwen3"]
    state = to_hf_state_dict(model)
    broken = {k: np.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in state.items()}
    ids, mask = right_padded_batch(model.config.vocab_size)
    ours = log_softmax(forward(from_hf_state_dict(model.config, broken), jnp.asarray(ids), mask=jnp.asarray(mask)))
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["qwen3"](input_ids=torch.from_numpy(ids).long(),
                                                   attention_mask=torch.from_numpy(mask).long()).logits, -1).numpy()
    assert np.abs(ours - ref)[mask].max() > 1e-2


# ====================================================================== cached decode
P, D, S_MAX = 6, 4, 16  # prompt slots, decode steps, cache slots (> P + D: unwritten slots stay masked by causality)


def left_padded(vocab: int, prompt_lengths=(6, 4, 1), seed=1):
    """Ids [B, P + D], key mask [B, S_MAX] and RoPE positions [B, S_MAX] for prompts left-padded
    to P slots followed by D decoded tokens."""
    rng = np.random.default_rng(seed)
    start = P - np.asarray(prompt_lengths)[:, None]
    slots = np.arange(S_MAX)[None, :]
    mask = slots >= start
    positions = np.maximum(slots - start, 0).astype(np.int32)
    ids = np.where(mask[:, : P + D], rng.integers(3, vocab, (len(prompt_lengths), P + D)), 0).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions)


def by_slot(cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
    """K and V of every layer as written, ``[num_layers, B, S_max, kvh, hd]`` (the cache stores
    ``k[i]`` as ``[B, kvh, hd, S]`` and ``v[i]`` as ``[B, kvh, S, hd]``)."""
    return (np.stack([np.asarray(k).transpose(0, 3, 1, 2) for k in cache.k]),
            np.stack([np.asarray(v).transpose(0, 2, 1, 3) for v in cache.v]))


def decode(model, ids, mask, positions, grow_after=None):
    """Prefill the P prompt slots, then feed the D tokens one at a time: (logits [B, P + D, V],
    the final cache). ``grow_after=n``: the cache starts with ``P + n`` slots and grows to
    ``S_MAX`` (:func:`grow_cache`) after ``n`` decoded tokens, as the embedded sampler's
    segmented decode does."""
    graphdef, state = nnx.split(model)
    slots = S_MAX if grow_after is None else P + grow_after
    cache = init_cache(model.config, ids.shape[0], slots, model.numerics.compute_dtype)
    logits, cache = _step(graphdef, state, ids[:, :P], positions[:, :P], mask[:, :slots], cache, jnp.int32(0))
    out = [logits]
    for t in range(P, P + D):
        if t == slots:
            cache = grow_cache(cache, S_MAX)
        logits, cache = _step(graphdef, state, ids[:, t : t + 1], positions[:, t : t + 1], mask[:, : cache.max_len],
                              cache, jnp.int32(t))
        out.append(logits)
    k, v = by_slot(cache)
    assert isinstance(cache, KVCache) and cache.max_len == S_MAX
    assert k.shape == v.shape == (model.config.num_hidden_layers, ids.shape[0], S_MAX, model.config.num_key_value_heads,
                                  model.config.head_dim)
    assert np.all(k[:, :, P + D :] == 0) and np.all(v[:, :, P + D :] == 0)  # nothing written past the last token
    assert np.all(np.any(k[:, :, P + D - 1] != 0, axis=(-1, -2)))  # ... and the last token written at its slot
    return np.concatenate([np.asarray(x) for x in out], axis=1), cache


def full(model, ids, mask, positions):
    return forward(model, ids, positions[:, : P + D], mask[:, : P + D])


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decode_matches_full_forward(arch, models):
    model = models[arch]
    ids, mask, positions = left_padded(model.config.vocab_size)
    valid = np.asarray(mask[:, : P + D])
    cached, uncached = decode(model, ids, mask, positions)[0], full(model, ids, mask, positions)
    np.testing.assert_array_less(np.abs(cached - uncached)[valid].max(), 1e-5)
    np.testing.assert_array_less(np.abs(log_softmax(cached) - log_softmax(uncached))[valid].max(), 1e-5)
    # the left padding matters: the same prompt unpadded (row 1, 4 tokens) gives the same logits
    row = 1
    start = P - 4
    alone = forward(model, ids[row : row + 1, start:], positions[row : row + 1, start : P + D])
    np.testing.assert_array_less(np.abs(alone[0] - uncached[row, start:]).max(), 1e-5)


@pytest.mark.parametrize("grow_after", [1, 3])
def test_cache_grown_mid_decode_matches_full_forward(grow_after, models):
    """A cache that starts short and grows (the sampler's segmented decode) computes what the
    uncached forward does, to the 1e-5 of the fixed-size cache (the padded slots are masked)."""
    model = models["qwen3"]
    ids, mask, positions = left_padded(model.config.vocab_size)
    valid = np.asarray(mask[:, : P + D])
    grown, uncached = decode(model, ids, mask, positions, grow_after)[0], full(model, ids, mask, positions)
    np.testing.assert_array_less(np.abs(grown - uncached)[valid].max(), 1e-5)


def test_grow_cache_keeps_slots_and_refuses_to_shrink(models):
    config = models["qwen3"].config
    cache = init_cache(config, 2, 4)
    cache = KVCache(tuple(k + 1.0 for k in cache.k), tuple(v + 2.0 for v in cache.v))
    k, v = by_slot(grow_cache(cache, 7))
    assert k.shape[2] == v.shape[2] == 7
    assert np.all(k[:, :, :4] == 1.0) and np.all(v[:, :, :4] == 2.0)
    assert np.all(k[:, :, 4:] == 0) and np.all(v[:, :, 4:] == 0)
    with pytest.raises(ValueError, match="below the cache's 4 slots"):
        grow_cache(cache, 3)


# ====================================================================== HF mapping
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_round_trip_is_bit_exact(arch, tiny_checkpoints):
    state = load_state_dict(tiny_checkpoints[arch])
    back = to_hf_state_dict(from_hf_state_dict(ModelConfig.load(tiny_checkpoints[arch]), state))
    assert sorted(back) == sorted(state)
    assert ("lm_head.weight" in back) == (arch == "qwen3")
    for name, arr in state.items():
        assert back[name].dtype == np.float32 and back[name].shape == arr.shape, name
        assert np.array_equal(back[name].view(np.uint32), arr.astype(np.float32).view(np.uint32)), name


def test_bf16_params_round_trip_bf16_weights(models):
    config = models["qwen2"].config
    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_state_dict(config, seed=3, init_std=INIT_STD).items()}
    model = from_hf_state_dict(config, state, param_dtype=jnp.bfloat16)
    assert model.layers[0].self_attn.q_proj.kernel.get_value().dtype == jnp.bfloat16
    for name, arr in to_hf_state_dict(model).items():
        assert np.array_equal(arr, state[name].astype(np.float32)), name


def test_load_state_into_updates_weights_without_retracing(models):
    config = models["qwen3"].config
    model = from_hf_state_dict(config, to_hf_state_dict(models["qwen3"]))
    ids, mask = right_padded_batch(config.vocab_size)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    before = forward(model, ids, mask=mask)
    traces = TRACES["forward"]
    new_state = random_state_dict(config, seed=7, init_std=INIT_STD)
    load_state_into(model, new_state)
    after = forward(model, ids, mask=mask)
    assert TRACES["forward"] == traces  # same compiled function
    assert np.abs(after - before).max() > 0.1
    np.testing.assert_array_equal(after, forward(from_hf_state_dict(config, new_state), ids, mask=mask))
    for name, arr in to_hf_state_dict(model).items():
        np.testing.assert_array_equal(arr, new_state[name])


def test_load_state_into_rejects_a_bad_state(models):
    model = models["qwen2"]
    state = to_hf_state_dict(model)
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        load_state_into(model, {k: v for k, v in state.items() if not k.endswith("0.self_attn.q_proj.bias")})
    bad = dict(state, **{"model.norm.weight": np.zeros((3,), np.float32)})
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_state_into(model, bad)
    np.testing.assert_array_equal(to_hf_state_dict(model)["model.norm.weight"], state["model.norm.weight"])


# ====================================================================== sharding annotations
def test_partitioning_annotations(models):
    specs = nnx.get_partition_spec(nnx.state(models["qwen2"], nnx.Param))
    layer = specs["layers"][0]
    got = {
        "embed_tokens": specs["embed_tokens"],
        "column_kernel": layer["self_attn"]["q_proj"]["kernel"], "column_bias": layer["self_attn"]["k_proj"]["bias"],
        "row_kernel": layer["mlp"]["down_proj"]["kernel"], "norm": layer["input_layernorm"]["weight"],
    }
    for kind, spec in got.items():
        assert tuple(spec.get_value()) == PARTITIONING[kind], kind
    assert tuple(layer["self_attn"]["o_proj"]["kernel"].get_value()) == ("tensor", "fsdp")
    assert tuple(nnx.get_partition_spec(nnx.state(models["qwen3"]))["lm_head"]["kernel"].get_value()) == ("fsdp", "tensor")


def test_runs_under_a_mesh(models):
    """Built and run under a (fsdp=1, tensor=1) Auto mesh: params are placed with their named
    sharding and the forward equals the no-mesh one."""
    source = models["qwen3"]
    ids, mask = right_padded_batch(source.config.vocab_size)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = from_hf_state_dict(source.config, to_hf_state_dict(source))
        sharding = model.layers[0].mlp.down_proj.kernel.get_value().sharding
        out = forward(model, ids, mask=mask)
    assert sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    np.testing.assert_array_equal(out, forward(source, ids, mask=mask))


# ====================================================================== numerics
def test_bf16_compute_differs_slightly(models):
    model = models["qwen3"]
    ids, mask = right_padded_batch(model.config.vocab_size)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    ref = log_softmax(forward(model, ids, mask=mask))
    bf16 = log_softmax(forward(with_numerics(model, Numerics(compute_dtype=jnp.bfloat16)), ids, mask=mask))
    diff = np.abs(bf16 - ref)[np.asarray(mask)]
    assert np.isfinite(bf16).all()
    assert 1e-3 < diff.max() < 0.5, diff.max()  # measured 0.1 on this checkpoint (bf16 eps = 2^-8)
    assert diff.mean() < 0.05, diff.mean()


def test_fp8_kv_cache_changes_only_cached_decode(models):
    model = models["qwen3"]
    fp8 = with_numerics(model, Numerics(kv_format="fp8_e4m3"))
    ids, mask, positions = left_padded(model.config.vocab_size)
    valid = np.asarray(mask[:, : P + D])
    np.testing.assert_array_equal(full(fp8, ids, mask, positions), full(model, ids, mask, positions))
    (exact, exact_cache), (rounded, fp8_cache) = decode(model, ids, mask, positions), decode(fp8, ids, mask, positions)
    # what the cache holds is on the E4M3 grid (rounding again changes nothing); the exact cache is not
    for kv in by_slot(fp8_cache):  # [.., kvh, hd]: the write layout the scale groups refer to
        np.testing.assert_array_equal(quantize_dequantize(kv, "fp8_e4m3"), kv)
    exact_k = by_slot(exact_cache)[0]
    assert not np.array_equal(quantize_dequantize(exact_k, "fp8_e4m3"), exact_k)
    diff = np.abs(log_softmax(rounded) - log_softmax(exact))[valid]
    assert np.isfinite(rounded).all()
    assert 1e-3 < diff.max() < 1.0, diff.max()  # measured 0.5: E4M3 has 3 mantissa bits


def test_split_k_reduction_changes_fp32_results_by_a_tiny_amount(models):
    model = models["qwen3"]
    ids, mask = right_padded_batch(model.config.vocab_size)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    ref = log_softmax(forward(model, ids, mask=mask))
    split = log_softmax(forward(with_numerics(model, Numerics(reduction_chunks=4)), ids, mask=mask))
    diff = np.abs(split - ref)[np.asarray(mask)].max()
    assert 0 < diff < 5e-5, diff  # another summation order: float32 rounding noise only


def test_contract_split_k():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 8, 256)).astype(np.float32)
    b = rng.normal(size=(256, 32)).astype(np.float32)
    one = np.asarray(contract("bli,io->blo", jnp.asarray(a), jnp.asarray(b), Numerics()))
    np.testing.assert_allclose(one, np.einsum("bli,io->blo", a.astype(np.float64), b), rtol=0, atol=1e-4)
    for c in (3, 4):
        out = np.asarray(contract("bli,io->blo", jnp.asarray(a), jnp.asarray(b), Numerics(reduction_chunks=c)))
        np.testing.assert_allclose(out, one, rtol=0, atol=1e-4)
        assert not np.array_equal(out, one), c  # a different summation order
    # more chunks than the contracted length: one chunk per element, added left to right
    a5, b5 = a[..., :5], b[:5]
    per_element = np.asarray(contract("bli,io->blo", jnp.asarray(a5), jnp.asarray(b5), Numerics(reduction_chunks=1000)))
    sequential = functools.reduce(np.add, [a5[..., i, None] * b5[i] for i in range(5)])
    np.testing.assert_array_equal(per_element, sequential)
    # small integers: every partial sum is exact in float32, so any order gives the same bits
    ai, bi = np.round(a * 4), np.round(b * 4)
    exact = np.asarray(contract("bli,io->blo", jnp.asarray(ai), jnp.asarray(bi), Numerics()))
    for c in (3, 4):
        np.testing.assert_array_equal(
            np.asarray(contract("bli,io->blo", jnp.asarray(ai), jnp.asarray(bi), Numerics(reduction_chunks=c))), exact)
    np.testing.assert_array_equal(exact, np.einsum("bli,io->blo", ai, bi))
    # accum_dtype is the output dtype of the partial products
    out = contract("bli,io->blo", jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16), Numerics(accum_dtype=jnp.float32))
    assert out.dtype == jnp.float32


def test_numerics_validation_and_model_api_errors(models):
    with pytest.raises(ValueError, match="unknown precision format"):
        Numerics(kv_format="fp7")
    with pytest.raises(ValueError, match="reduction_chunks"):
        Numerics(reduction_chunks=0)
    with pytest.raises(ValueError, match="exactly one contracted index"):
        contract("ij,ji->", jnp.ones((2, 2)), jnp.ones((2, 2)), Numerics())
    model = models["qwen2"]
    ids = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="cache_index"):
        model(ids, cache=init_cache(model.config, 1, 4))
    with pytest.raises(ValueError, match="cache_index"):
        model(ids, cache_index=0)
    fresh = QwenModel(model.config, rngs=nnx.Rngs(0))
    assert sorted(to_hf_state_dict(fresh)) == sorted(to_hf_state_dict(model))
