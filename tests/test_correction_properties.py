"""Property tests (hypothesis) of the correction: shapes, masks and invariances, numpy float64."""

import dataclasses

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from factories import random_batch
from hetrl.core.correction import (
    PRESETS,
    CorrectionConfig,
    LossInputs,
    correction_preset,
    grpo_advantages,
    mis_masks,
    mismatch_metrics,
    policy_loss,
)

CONFIG_NAMES = sorted(PRESETS) + ["wide"]


def config_of(name: str) -> CorrectionConfig:
    if name == "wide":
        return correction_preset("hetrl", sequence_bounds=(0.5, 2.0), veto_threshold=0.1)
    return PRESETS[name]


@st.composite
def cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    batch_size = draw(st.integers(1, 6))
    vocab = draw(st.integers(12, 30))
    rng = np.random.default_rng(seed)
    batch, logits, _ = random_batch(rng, batch=batch_size, vocab=vocab, noise=(0.0, 0.01, 0.3, 2.0),
                                    mixed_kinds=draw(st.booleans()))
    adv = grpo_advantages(batch.reward.astype(np.float64), batch.group_index, batch.num_groups) + rng.normal(size=batch_size)
    x = LossInputs(
        logits=logits * draw(st.sampled_from([1.0, 5.0])), target_ids=batch.target_ids, loss_mask=batch.loss_mask,
        sampler_logprobs=batch.sampler_logprobs.astype(np.float64), support_ids=batch.support_ids,
        support_mask=batch.support_mask, support_logprobs=batch.support_logprobs.astype(np.float64),
        support_kept=batch.support_kept, advantages=adv, temperature=batch.temperature.astype(np.float64))
    return x, batch, rng, config_of(draw(st.sampled_from(CONFIG_NAMES)))


@given(cases())
def test_shapes_and_finiteness(case):
    x, batch, _, config = case
    loss, stats = policy_loss(x, config)
    B, L = x.target_ids.shape
    assert np.ndim(loss) == 0 and np.isfinite(loss)
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        expected = (B,) if f.name in ("sequence_keep", "veto_keep") else (B, L)
        assert value.shape == expected, f.name
    assert np.all(stats.weight[~x.loss_mask] >= 0)
    m = mismatch_metrics(stats, x.loss_mask, batch.pool_index, batch.pool_names)
    assert all(np.isfinite(v) for v in m.values())
    assert 0.0 <= m["mismatch/ess"] <= 1.0 + 1e-12
    assert m["mismatch/k3"] >= 0.0 and m["mismatch/chi2_token"] >= 0.0


@given(cases())
def test_untrained_positions_and_support_padding_do_not_matter(case):
    x, _, rng, config = case
    loss, _ = policy_loss(x, config)
    logits = x.logits.copy()
    logits[~x.loss_mask] = rng.normal(size=logits[~x.loss_mask].shape) * 10
    padded_ids = np.where(x.support_mask, x.support_ids, rng.integers(x.logits.shape[-1], size=x.support_ids.shape))
    padded_lp = np.where(x.support_mask, x.support_logprobs, -rng.exponential(size=x.support_ids.shape))
    other = dataclasses.replace(x, logits=logits, support_ids=padded_ids, support_logprobs=padded_lp)
    loss2, _ = policy_loss(other, config)
    np.testing.assert_allclose(loss2, loss, rtol=1e-12, atol=1e-12)


@given(cases())
def test_invariant_to_a_constant_logit_shift(case):
    x, _, rng, config = case
    loss, stats = policy_loss(x, config)
    shift = rng.normal(size=x.target_ids.shape + (1,)) * 30
    loss2, stats2 = policy_loss(dataclasses.replace(x, logits=x.logits + shift), config)
    np.testing.assert_allclose(loss2, loss, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(stats2.token_keep, stats.token_keep)


@given(cases())
def test_invariant_to_row_order_and_linear_in_advantages(case):
    x, _, rng, config = case
    loss, _ = policy_loss(x, config)
    perm = rng.permutation(x.target_ids.shape[0])
    permuted = LossInputs(**{k: (v[perm] if v is not None else None) for k, v in x.__dict__.items()})
    np.testing.assert_allclose(policy_loss(permuted, config)[0], loss, rtol=1e-12, atol=1e-12)
    scaled = dataclasses.replace(x, advantages=x.advantages * 3.5)
    np.testing.assert_allclose(policy_loss(scaled, config)[0], 3.5 * loss, rtol=1e-10, atol=1e-12)


@given(cases())
def test_masked_tokens_get_no_gradient_and_every_gradient_is_finite(case):
    x, _, _, config = case
    logits = torch.tensor(x.logits, requires_grad=True)
    tx = LossInputs(**{k: (torch.as_tensor(v) if v is not None else None) for k, v in x.__dict__.items()})
    loss, stats = policy_loss(dataclasses.replace(tx, logits=logits), config)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(g).all()
    assert torch.all(g[~tx.loss_mask] == 0)
    if config.weight_mode == "mask" and not config.score_centering:
        dropped = tx.loss_mask & (stats.weight == 0)
        assert torch.all(g[dropped] == 0)


@given(ratio=st.floats(0.9, 1.1), lengths=st.lists(st.integers(1, 300), min_size=2, max_size=5),
       bounds=st.sampled_from([(0.99, 1.01), (0.95, 1.05)]))
def test_geometric_mask_invariant_to_length(ratio, lengths, bounds):
    config = CorrectionConfig(weight_mode="mask", token_bounds=(0.5, 2.0), sequence_bounds=bounds)
    L = max(lengths)
    mask = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
    _, seq, _ = mis_masks(np.full(mask.shape, np.log(ratio)), mask, config)
    assert len(set(seq.tolist())) == 1
