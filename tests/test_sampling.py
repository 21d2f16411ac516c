"""Sampling math of hetrl.samplers.sampling: kept sets against hand-derived top-k/top-p sets,
renormalization, the sampled token always inside, empirical frequencies, head mode; the
prefiltered top-k against ``lax.top_k`` bit for bit; noise drawn ahead against noise per step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetrl.samplers.sampling import check_params, draw_noise, row_keys, sample, top_k_exact, top_k_floor

# Probabilities of a 5-token vocabulary. Sorted: 1 (.40), 3 (.25), 4 (.20), 2 (.10), 0 (.05);
# cumulative mass .40, .65, .85, .95, 1. At T = 2 (probs ∝ sqrt p): 1 (.2984), 3 (.2359),
# 4 (.2110), 2 (.1492), 0 (.1055); cumulative .2984, .5343, .7453, .8945, 1.
P = np.array([0.05, 0.40, 0.10, 0.25, 0.20])
LOGITS = np.log(P).astype(np.float32)

# (temperature, top_k, top_p) -> the kept set, in decreasing-probability order, derived by hand
CASES = [
    ((1.0, 0, 0.3), [1]),
    ((1.0, 0, 0.5), [1, 3]),
    ((1.0, 0, 0.6), [1, 3]),
    ((1.0, 0, 0.7), [1, 3, 4]),
    ((1.0, 0, 0.9), [1, 3, 4, 2]),
    ((1.0, 2, 1.0), [1, 3]),
    ((1.0, 3, 0.5), [1, 3]),
    ((1.0, 2, 0.9), [1, 3]),
    ((1.0, 5, 1.0), [1, 3, 4, 2, 0]),
    ((2.0, 0, 0.5), [1, 3]),
    ((2.0, 0, 0.55), [1, 3, 4]),  # at T = 1 the same top_p keeps {1, 3}
    ((1.0, 0, 0.55), [1, 3]),
    ((2.0, 4, 0.9), [1, 3, 4, 2]),
]


def _run(logits, temps, top_k, top_p, width=5, head_size=5, seed=0):
    logits = jnp.asarray(logits, jnp.float32)
    noise = draw_noise(row_keys(jax.random.key(seed), logits.shape[0], 0), width)
    fn = jax.jit(sample, static_argnames=("width", "head_size"))
    out = fn(noise, logits, jnp.asarray(temps, jnp.float32), jnp.asarray(top_k, jnp.int32),
             jnp.asarray(top_p, jnp.float32), width=width, head_size=head_size)
    return jax.tree.map(np.asarray, out)


def test_kept_sets_match_hand_derived_sets_and_are_renormalized():
    params = [c[0] for c in CASES]
    out = _run(np.tile(LOGITS, (len(CASES), 1)), *zip(*params))
    for b, ((temp, _, _), expected) in enumerate(CASES):
        n = out.count[b]
        assert out.kept[b]
        assert out.support_ids[b, :n].tolist() == expected, CASES[b]
        q = P ** (1.0 / temp)
        q = q[expected] / q[expected].sum()
        np.testing.assert_allclose(out.support_logprobs[b, :n], np.log(q), atol=2e-6)
        assert np.all(out.support_logprobs[b, n:] == 0) and np.all(out.support_ids[b, n:] == 0)
        assert out.token[b] in expected
        assert out.logprob[b] == out.support_logprobs[b, expected.index(out.token[b])]
        assert not out.cap_bound[b]


def test_ties_are_broken_by_the_lower_token_id():
    out = _run([[1.0, 2.0, 2.0, 2.0, 0.0]] * 2, [1.0, 1.0], [2, 0], [1.0, 0.5])
    assert out.support_ids[0, :2].tolist() == [1, 2]
    # probs of 1, 2, 3 are 0.3148 each: a top-p of 0.5 keeps the two lowest ids
    assert out.support_ids[1, : out.count[1]].tolist() == [1, 2]


def test_head_mode_records_full_distribution_head():
    out = _run(np.tile(LOGITS, (2, 1)), [1.0, 2.0], [0, 0], [1.0, 1.0], head_size=2)
    for b, temp in enumerate([1.0, 2.0]):
        q = P ** (1.0 / temp)
        q = q / q.sum()
        assert not out.kept[b] and out.count[b] == 2
        assert out.support_ids[b, :2].tolist() == [1, 3]
        np.testing.assert_allclose(out.support_logprobs[b, :2], np.log(q[[1, 3]]), atol=2e-6)
        np.testing.assert_allclose(out.logprob[b], np.log(q[out.token[b]]), atol=2e-6)


def test_top_p_is_cut_to_the_cap_and_flagged():
    # W = 3: top_p = .99 would need all 5 tokens; the kept set is the top 3, renormalized.
    out = _run([LOGITS, LOGITS, LOGITS], [1.0] * 3, [0, 3, 0], [0.99, 0.99, 0.7], width=3, head_size=3)
    for b in range(3):
        assert out.support_ids[b, : out.count[b]].tolist() == [1, 3, 4]
        np.testing.assert_allclose(np.exp(out.support_logprobs[b]).sum(), 1.0, atol=1e-6)
    assert out.cap_bound.tolist() == [True, False, False]  # top_k = W asked for 3; .7 is reached


def test_check_params_refuses_what_cannot_be_honoured():
    check_params([0, 64], [1.0, 0.5], 64)
    with pytest.raises(ValueError, match="top_k=65 exceeds the sampler's support cap W=64"):
        check_params([65], [1.0], 64)
    with pytest.raises(ValueError, match="top_p must lie in"):
        check_params([0], [1.5], 64)


def test_sampled_token_always_in_kept_support_random_params():
    rng = np.random.default_rng(0)
    B, V, W = 512, 97, 16
    logits = rng.normal(size=(B, V)).astype(np.float32) * rng.uniform(0.5, 6.0, size=(B, 1)).astype(np.float32)
    temps = rng.uniform(0.3, 1.5, size=B)
    top_k = rng.choice([0, 1, 5, 16], size=B)
    top_p = rng.choice([0.3, 0.8, 0.95, 1.0], size=B)
    out = _run(logits, temps, top_k, top_p, width=W, head_size=8, seed=3)
    for b in range(B):
        n = out.count[b]
        ids = out.support_ids[b, :n].tolist()
        truncated = top_k[b] > 0 or top_p[b] < 1.0
        assert out.kept[b] == truncated
        if truncated:
            assert out.token[b] in ids
            assert out.logprob[b] == out.support_logprobs[b, ids.index(out.token[b])]
            np.testing.assert_allclose(np.exp(out.support_logprobs[b, :n].astype(np.float64)).sum(), 1.0, atol=1e-5)
            if top_k[b]:
                assert n <= top_k[b]
        assert len(set(ids)) == n
        assert np.all(np.diff(out.support_logprobs[b, :n]) <= 0)  # decreasing probability order


def test_empirical_frequencies_match_q():
    """N = 200k draws per distribution: every frequency within 5 standard errors
    sqrt(q(1-q)/N) <= 0.0056 of q, and tokens outside the kept set never drawn."""
    N = 200_000
    settings = [((1.0, 0, 0.9), [1, 3, 4, 2]), ((2.0, 0, 0.55), [1, 3, 4]), ((1.0, 2, 1.0), [1, 3]),
                ((1.5, 0, 1.0), [0, 1, 2, 3, 4])]
    for i, ((temp, k, p), kept) in enumerate(settings):
        out = _run(np.tile(LOGITS, (N, 1)), np.full(N, temp), np.full(N, k), np.full(N, p), seed=10 + i)
        freq = np.bincount(out.token, minlength=5) / N
        q = np.zeros(5)
        q[kept] = P[kept] ** (1.0 / temp)
        q /= q.sum()
        se = np.sqrt(q * (1 - q) / N)
        assert np.all(np.abs(freq - q) <= 5 * se + 1e-12), (temp, k, p, freq, q)
        np.testing.assert_allclose(out.logprob, np.log(q[out.token]), atol=2e-6)


def test_draws_are_deterministic_and_independent_of_batch_padding():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 50)).astype(np.float32) * 3
    args = (np.ones(8), np.zeros(8, int), np.full(8, 0.9))
    a = _run(logits, *args, width=16, head_size=4, seed=7)
    b = _run(logits, *args, width=16, head_size=4, seed=7)
    c = _run(logits[:3], *(x[:3] for x in args), width=16, head_size=4, seed=7)
    d = _run(logits, *args, width=16, head_size=4, seed=8)
    np.testing.assert_array_equal(a.token, b.token)
    np.testing.assert_array_equal(a.token[:3], c.token)
    assert not np.array_equal(a.token, d.token)


def _top_k_case(case: str, rng: np.random.Generator, B: int = 16, V: int = 4096) -> np.ndarray:
    """[B, V] float32 rows built to stress the prefilter of :func:`top_k_exact`."""
    x = rng.normal(size=(B, V)).astype(np.float32) * 3
    if case == "ties":  # quarter steps: ties inside the top k and across its boundary
        x = np.round(x * 4).astype(np.float32) / 4
    elif case == "tight_floor":  # 8 large entries in distinct 16-entry sub-groups of each 512-entry
        x -= 100.0  # group: the floor equals the k-th largest entry (k = 64), which must be kept
        large = rng.permutation(64)[None, :] + rng.uniform(0, 0.5, size=(B, 64))
        cols = (np.arange(8)[:, None] * 512 + np.arange(8)[None, :] * 16 + 3).reshape(-1)
        x[:, cols] = large
    elif case == "one_group":  # the whole top k in 8 sub-groups of one group: only that group's
        x[:, 256:384] += 100.0  # floor is high, the row's floor (the lowest) keeps many entries
    elif case == "signed_zeros":  # lax.top_k orders -0.0 below +0.0
        x = np.where(rng.random((B, V)) < 0.5, np.float32(-0.0), np.float32(0.0))
        x[:, ::97] = 1.0
    elif case == "infinities":
        x = np.where(rng.random((B, V)) < 0.99, -np.inf, x).astype(np.float32)
        x[:, ::1000] = np.inf
    elif case == "nans":  # lax.top_k orders -NaN lowest and NaN highest
        x[:, ::300] = np.nan
        x[:, 7::300] = -np.nan
    elif case == "constant":
        x = np.full((B, V), 0.25, np.float32)
    return x


@pytest.mark.parametrize("case", ["normal", "ties", "tight_floor", "one_group", "signed_zeros", "infinities", "nans",
                                  "constant"])
def test_top_k_exact_equals_lax_top_k_bit_for_bit(case):
    k = 64
    x = jnp.asarray(_top_k_case(case, np.random.default_rng(0)))
    assert top_k_floor(x, k) is not None  # the prefiltered path is the one under test
    got = jax.jit(top_k_exact, static_argnums=1)(x, k)
    want = jax.jit(jax.lax.top_k, static_argnums=1)(x, k)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.int32), np.asarray(want[0]).view(np.int32))


def test_top_k_floor_keeps_k_entries_and_filters_the_rest():
    rng = np.random.default_rng(1)
    k = 64
    for case in ("normal", "ties", "tight_floor", "one_group"):
        x = _top_k_case(case, rng)
        t = np.asarray(jax.jit(top_k_floor, static_argnums=1)(jnp.asarray(x), k))
        survivors = (x >= t[:, None]).sum(axis=1)
        assert survivors.min() >= k, case
        if case == "normal":  # the point of the floor: ~100 of 4096 entries survive
            assert survivors.max() < x.shape[1] // 16, survivors
        if case == "ties":  # ~200: distinct values are fewer, the floor lower, but it still filters
            assert survivors.max() < x.shape[1] // 8, survivors
        if case == "tight_floor":
            assert np.all(survivors == k)
    # too few entries per group (V / (16 * k / 8) < 8): no floor, plain lax.top_k
    assert top_k_floor(jnp.zeros((2, 512)), 64) is None
    assert top_k_floor(jnp.zeros((2, 4096)), 60) is None


def test_sample_support_is_the_top_of_the_row_on_a_large_vocabulary():
    """V = 2048, W = 64 (the prefiltered top-k): every kept support is the prefix of the row's
    order by (z / T decreasing, id increasing), computed here with numpy."""
    rng = np.random.default_rng(2)
    B, V, W = 24, 2048, 64
    assert top_k_floor(jnp.zeros((B, V)), W) is not None
    logits = (rng.normal(size=(B, V)) * rng.uniform(0.5, 4.0, size=(B, 1))).astype(np.float32)
    logits[:4] = np.round(logits[:4])  # tied rows
    temps = rng.uniform(0.5, 1.5, size=B).astype(np.float32)
    top_k = rng.choice([0, 1, 20, 64], size=B)
    top_p = rng.choice([0.5, 0.9, 1.0], size=B)
    top_k[(top_k == 0) & (top_p == 1.0)] = 64  # truncated rows only: the support is the kept set
    out = _run(logits, temps, top_k, top_p, width=W, head_size=W, seed=4)
    s = logits / temps[:, None]
    for b in range(B):
        order = np.lexsort((np.arange(V), -s[b]))  # decreasing s, ties: lower id first
        n = out.count[b]
        assert n >= 1 and (top_k[b] == 0 or n <= top_k[b])
        assert out.support_ids[b, :n].tolist() == order[:n].tolist(), b


def test_noise_drawn_ahead_equals_noise_drawn_per_step():
    key, B, N, W = jax.random.key(5), 3, 4, 8
    ahead = draw_noise(jax.vmap(lambda n: row_keys(key, B, n))(jnp.arange(N)), W)
    assert ahead.kept.shape == (N, B, W) and ahead.full.shape == (N, B)
    for n in range(N):
        now = draw_noise(row_keys(key, B, n), W)
        np.testing.assert_array_equal(np.asarray(ahead.kept[n]), np.asarray(now.kept))
        np.testing.assert_array_equal(jax.random.key_data(ahead.full[n]), jax.random.key_data(now.full))
    assert not np.array_equal(np.asarray(ahead.kept[0]), np.asarray(ahead.kept[1]))
