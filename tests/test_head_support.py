"""Rebuilding a server token's kept set from its log-prob head (hetrl.samplers.head_support).

The reference is the embedded sampler's own kept set (hetrl.samplers.sampling.sample): on the
same logits, the set rebuilt from the top-H head of log π and the sampled token must be the set
the embedded sampler recorded, with the same log q, in float32 up to rounding (1e-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetrl.core.schema import SamplingParams
from hetrl.samplers.head_support import HeadSupportError, check_head_params, support_from_head
from hetrl.samplers.sampling import draw_noise, sample

V, H = 96, 32


def _head(logits: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-H ids and full-distribution log π of one row (what SGLang returns), shuffled."""
    s = logits.astype(np.float64) / temperature
    logp = s - np.logaddexp.reduce(s)
    ids = np.argsort(-logp, kind="stable")[:H]
    perm = np.random.default_rng(0).permutation(H)
    return ids[perm], logp[ids][perm]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.7, 1.0, 1.3]),
       top_k=st.integers(1, H), top_p=st.floats(0.05, 1.0), scale=st.floats(0.5, 6.0))
def test_rebuilt_kept_set_equals_the_embedded_samplers(seed, temperature, top_k, top_p, scale):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(V) * scale).astype(np.float32)
    s = logits.astype(np.float64) / temperature
    probs = np.sort(np.exp(s - np.logaddexp.reduce(s)))[::-1]
    assume(np.min(np.abs(np.cumsum(probs) - top_p)) > 1e-5)  # no cumulative mass on the top-p boundary
    res = sample(draw_noise(jax.random.split(jax.random.key(seed % 1000), 1), H), jnp.asarray(logits[None]),
                 jnp.asarray([temperature], jnp.float32), jnp.asarray([top_k]), jnp.asarray([top_p], jnp.float32),
                 width=H, head_size=H)
    token = int(res.token[0])
    n = int(res.count[0])
    head_ids, head_lp = _head(logits, temperature)
    token_lp = float((s - np.logaddexp.reduce(s))[token])
    support, logq = support_from_head([head_ids], [head_lp], np.asarray([token]), np.asarray([token_lp]),
                                      SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert support.kind == "kept"
    assert support.ids.tolist() == np.asarray(res.support_ids[0, :n]).tolist()
    np.testing.assert_allclose(support.logprobs, np.asarray(res.support_logprobs[0, :n]), atol=1e-5)
    np.testing.assert_allclose(logq[0], float(res.logprob[0]), atol=1e-5)
    assert abs(np.logaddexp.reduce(support.logprobs.astype(np.float64))) < 1e-6


def test_sampled_token_outside_the_rebuilt_set_is_force_kept():
    head_ids = [[5, 7, 9, 11]]
    head_lp = [np.log([0.5, 0.3, 0.1, 0.05]).tolist()]
    support, logq = support_from_head(head_ids, head_lp, np.asarray([9]), np.asarray([np.log(0.1)]),
                                      SamplingParams(top_k=2))
    assert support.ids.tolist() == [5, 7, 9]
    np.testing.assert_allclose(logq[0], np.log(0.1 / 0.9), rtol=1e-6)


def test_top_p_counts_the_mass_before_each_token():
    # π = .5 .3 .1 .05: a token is kept iff the mass before it is <= top_p (SGLang's rule); the mass
    # before 7 is .5 (kept at top_p .5, not at .49), before 9 it is .8 (not kept at .79).
    head_ids = [[5, 7, 9, 11]]
    head_lp = [np.log([0.5, 0.3, 0.1, 0.05]).tolist()]
    for top_p, want in ((0.79, [5, 7]), (0.5, [5, 7]), (0.49, [5])):
        support, _ = support_from_head(head_ids, head_lp, np.asarray([5]), np.asarray([np.log(0.5)]),
                                       SamplingParams(top_k=4, top_p=top_p))
        assert support.ids.tolist() == want, top_p


def test_top_p_one_filters_nothing_even_when_the_rounded_mass_passes_one():
    # a peaked row whose float32 log-probs sum to slightly more than 1: top-k alone decides
    lp = np.log(np.asarray([0.9999999, 3e-7, 2e-7, 1e-7], np.float32)).astype(np.float32)
    assert np.exp(lp.astype(np.float64))[:2].sum() > 1.0
    support, _ = support_from_head([[1, 2, 3, 4]], [lp.tolist()], np.asarray([1]), np.asarray([lp[0]]),
                                   SamplingParams(top_k=3))
    assert support.ids.tolist() == [1, 2, 3]


def test_untruncated_sampling_records_the_head_with_full_log_probs():
    head_ids, head_lp = [[3, 1, 2]], [np.log([0.2, 0.5, 0.1]).tolist()]
    support, logq = support_from_head(head_ids, head_lp, np.asarray([40]), np.asarray([-6.0]), SamplingParams())
    assert support.kind == "head"
    assert support.ids.tolist() == [1, 3, 2]  # sorted by decreasing log-prob
    assert logq.tolist() == [-6.0]


@pytest.mark.parametrize("params, fragment", [
    (SamplingParams(top_p=0.9), "without a top-k cap"),
    (SamplingParams(top_k=H + 1), "exceeds the log-prob head"),
])
def test_parameters_the_head_cannot_determine_are_refused(params, fragment):
    with pytest.raises(HeadSupportError, match=fragment):
        check_head_params(params, H)
    head_ids, head_lp = [list(range(H))], [np.full(H, np.log(1.0 / V)).tolist()]
    with pytest.raises(HeadSupportError, match=fragment):
        support_from_head(head_ids, head_lp, np.asarray([0]), np.asarray([np.log(1.0 / V)]), params)
    support, logq = support_from_head(head_ids, head_lp, np.asarray([0]), np.asarray([np.log(1.0 / V)]), params,
                                      approximate=True)
    assert support.kind == "head" and np.isclose(logq[0], np.log(1.0 / V))


def test_mismatched_lengths_are_rejected():
    with pytest.raises(HeadSupportError, match="2 tokens but 1 heads"):
        support_from_head([[1]], [[0.0]], np.asarray([1, 1]), np.asarray([0.0, 0.0]), SamplingParams(top_k=1))
