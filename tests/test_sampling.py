"""Sampling math of hetrl.samplers.sampling: kept sets against hand-derived top-k/top-p sets,
renormalization, the sampled token always inside, empirical frequencies, head mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetrl.samplers.sampling import check_params, row_keys, sample

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
    keys = row_keys(jax.random.key(seed), logits.shape[0], 0)
    fn = jax.jit(sample, static_argnames=("width", "head_size"))
    out = fn(keys, logits, jnp.asarray(temps, jnp.float32), jnp.asarray(top_k, jnp.int32),
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
