"""The correction math of DESIGN §3 checked against exact, hand-derived values.

Gradients come from torch autograd in float64 (tolerances 1e-10 unless stated): these are
identities, so only rounding separates the two sides.
"""

import numpy as np
import pytest
import torch

from factories import log_softmax
from hetrl.core.correction import (
    PRESETS,
    CorrectionConfig,
    LossInputs,
    correction_preset,
    grpo_advantages,
    is_weight,
    mis_masks,
    policy_loss,
    replay_logprobs,
)

T64 = torch.float64


def single_position_inputs(logits, target, support, sampler_logprobs, support_logprobs, kept=True, advantages=None):
    """B rows, one target position each, all sharing one support of width K (torch float64)."""
    B = len(target)
    K = len(support)
    adv = torch.ones(B, dtype=T64) if advantages is None else torch.as_tensor(advantages, dtype=T64)
    return LossInputs(
        logits=logits,
        target_ids=torch.as_tensor(target).reshape(B, 1),
        loss_mask=torch.ones(B, 1, dtype=torch.bool),
        sampler_logprobs=torch.as_tensor(sampler_logprobs, dtype=T64).reshape(B, 1),
        support_ids=torch.as_tensor(support).reshape(1, 1, K).expand(B, 1, K).contiguous(),
        support_mask=torch.ones(B, 1, K, dtype=torch.bool),
        support_logprobs=torch.as_tensor(support_logprobs, dtype=T64).reshape(1, 1, K).expand(B, 1, K).contiguous(),
        support_kept=torch.full((B,), kept),
        advantages=adv,
        temperature=torch.ones(B, dtype=T64),
    )


def grad_of(config, make_inputs, z):
    logits = torch.tensor(z, dtype=T64, requires_grad=True)
    loss, _ = policy_loss(make_inputs(logits), config, normalizer=1.0)
    (g,) = torch.autograd.grad(loss, logits)
    return loss.detach(), g.numpy()


# ------------------------------------------------------------------ score centering identities
def test_sc_with_full_support_and_exact_weights_equals_plain_is():
    """w_v = p_v/q_v over the whole vocabulary: μ_w = Σ p_v s_v = 0, SC gradient = IS gradient."""
    rng = np.random.default_rng(0)
    V = 7
    exact = dict(weight_mode="mask", token_bounds=(0.0, 1e9))  # f(ρ) = ρ: no masking, no clamp hit
    for _ in range(5):
        z = rng.normal(size=(1, 1, V)) * 2
        logq = log_softmax(z[0, 0] + rng.normal(size=V) * 0.7)
        a = int(rng.integers(V))
        adv = [float(rng.normal())]
        inputs = lambda lg: single_position_inputs(lg, [a], np.arange(V), [logq[a]], logq, advantages=adv)  # noqa: E731
        for replay in (True, False):
            _, g_sc = grad_of(CorrectionConfig(score_centering=True, replay=replay, **exact), inputs, z)
            _, g_is = grad_of(CorrectionConfig(score_centering=False, replay=replay, **exact), inputs, z)
            np.testing.assert_allclose(g_sc, g_is, atol=1e-12, rtol=0)
            assert np.abs(g_is).max() > 1e-3  # the IS gradient itself is not trivially zero


@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.8, 1.25), (0.0, 1.1)])
@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_expected_centered_score_is_zero_under_q_with_masking(bounds, mode):
    """Σ_{a∈S} q_a · ∇ℓ(a) = 0 exactly: E_q[w_a s_a − μ_w] = 0 whatever the MIS rule f."""
    rng = np.random.default_rng(2)
    V, S = 9, np.array([0, 2, 3, 5, 8])
    z = np.broadcast_to(rng.normal(size=(1, 1, V)) * 1.5, (len(S), 1, V)).copy()
    q_kept = log_softmax(z[0, 0, S] + rng.normal(size=len(S)) * 1.5)  # sampler's renormalized q over S
    q = np.exp(q_kept)
    config = CorrectionConfig(replay=True, score_centering=True, weight_mode=mode, token_bounds=bounds)
    # row i = sampled token S[i]; advantage q_i turns the summed gradient into the expectation
    inputs = lambda lg: single_position_inputs(lg, S, S, q_kept, q_kept, advantages=q)  # noqa: E731
    _, g = grad_of(config, inputs, z)
    _, g_plain = grad_of(config.model_copy(update=dict(score_centering=False)), inputs, z)
    log_rho = log_softmax(z[0, 0, S]) - q_kept
    weights = is_weight(log_rho, config)
    assert np.count_nonzero(weights) > 0 and np.any(weights != np.exp(log_rho))  # f really bites
    np.testing.assert_allclose(g.sum(axis=0), 0.0, atol=1e-12)
    assert np.abs(g_plain.sum(axis=0)).max() > 1e-3  # without SC the expected step drifts


def test_head_tail_centering_is_exact_when_tail_is_proportional():
    """If q = α·p outside the head H, the head/tail SC gradient has zero mean under q."""
    rng = np.random.default_rng(3)
    V, H = 8, np.array([1, 4, 6])
    z = rng.normal(size=V)
    p = np.exp(log_softmax(z))
    q = p.copy()
    q[H] = p[H] * np.exp(rng.normal(size=len(H)) * 0.5)
    tail = np.setdiff1d(np.arange(V), H)
    tail_q = (1 - p[H].sum()) / 1.3            # tail ratio p/q̂ = 1/α = 1.3: inside the MIS bounds
    q[H] *= (1 - tail_q) / q[H].sum()
    q[tail] = p[tail] * tail_q / p[tail].sum()  # proportional tail: q̂ = α p is exact there
    logq = np.log(q)
    config = CorrectionConfig(score_centering=True, weight_mode="mask", token_bounds=(0.5, 2.0))
    rows = np.arange(V)                        # every token of the vocabulary as the sample
    zz = np.broadcast_to(z, (V, 1, V)).copy()
    inputs = lambda lg: single_position_inputs(lg, rows, H, logq[rows], logq[H], kept=False, advantages=q)  # noqa: E731
    _, g = grad_of(config, inputs, zz)
    np.testing.assert_allclose(g.sum(axis=0), 0.0, atol=1e-12)
    # the tail term matters: the exact-support formula (kept=True) on the same head drifts
    exact_form = lambda lg: single_position_inputs(lg, rows, H, logq[rows], logq[H], kept=True, advantages=q)  # noqa: E731
    _, g_head_only = grad_of(config.model_copy(update=dict(replay=False)), exact_form, zz)
    assert np.abs(g_head_only.sum(axis=0)).max() > 1e-3


# ------------------------------------------------------------------ mask replay
def test_replay_with_full_vocabulary_is_log_softmax():
    rng = np.random.default_rng(4)
    B, L, V = 3, 4, 11
    z = rng.normal(size=(B, L, V)) * 3
    targets = rng.integers(V, size=(B, L))
    support = np.broadcast_to(np.arange(V), (B, L, V))
    mask = np.ones((B, L, V), dtype=bool)
    lp_a, lp_s = replay_logprobs(z, targets, support, mask, temperature=0.7)
    ref = log_softmax(z / 0.7)
    np.testing.assert_allclose(lp_s, ref, atol=1e-12)
    np.testing.assert_allclose(lp_a, np.take_along_axis(ref, targets[..., None], -1)[..., 0], atol=1e-12)


def test_sampled_token_outside_support_is_force_kept():
    z = np.array([[[0.5, 2.0, -1.0, 0.3, 1.2]]])
    support = np.array([[[1, 4, 0]]])
    mask = np.array([[[True, True, False]]])   # S = {1, 4}, third slot is padding
    lp_a, lp_s = replay_logprobs(z, np.array([[3]]), support, mask)
    norm = np.log(np.exp(2.0) + np.exp(1.2) + np.exp(0.3))  # S ∪ {a}
    assert np.isfinite(lp_a).all()
    np.testing.assert_allclose(lp_a[0, 0], 0.3 - norm, atol=1e-14)
    np.testing.assert_allclose(lp_s[0, 0, :2], [2.0 - norm, 1.2 - norm], atol=1e-14)
    # a ∈ S is not counted twice
    lp_a_in, _ = replay_logprobs(z, np.array([[4]]), support, mask)
    np.testing.assert_allclose(lp_a_in[0, 0], 1.2 - np.log(np.exp(2.0) + np.exp(1.2)), atol=1e-14)


def test_replay_gradient_stays_on_support():
    """∂ log p^S(a) / ∂z_u is zero for u ∉ S ∪ {a} (replay ignores the rest of the vocabulary)."""
    z = torch.randn(1, 1, 6, dtype=T64, requires_grad=True)
    lp_a, _ = replay_logprobs(z, torch.tensor([[5]]), torch.tensor([[[1, 2]]]), torch.tensor([[[True, True]]]))
    (g,) = torch.autograd.grad(lp_a.sum(), z)
    assert g[0, 0, [0, 3, 4]].abs().max() < 1e-12 and g[0, 0, [1, 2, 5]].abs().min() > 1e-3


# ------------------------------------------------------------------ MIS
def test_mis_masks_match_hand_derived_cases():
    rho = np.array([
        [1.0, 1.0, 1.0, 1.0],     # kept everywhere
        [0.4, 1.0, 2.5, 1.0],     # tokens 0, 2 out of (0.5, 2); geo = exp(mean log) = 1.0 -> kept
        [1.03, 1.03, 1.03, 1.0],  # all tokens in bounds but geo = 1.0224 > 1.01 -> row dropped
        [1.0, 5e-5, 1.0, 1.0],    # one catastrophic token: veto
    ])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
    config = CorrectionConfig(weight_mode="mask", token_bounds=(0.5, 2.0), sequence_bounds=(0.99, 1.01), veto_threshold=1e-4)
    tok, seq, veto = mis_masks(np.log(rho), mask, config)
    np.testing.assert_array_equal(tok, rho_in := (rho >= 0.5) & (rho <= 2.0))
    assert rho_in[1].tolist() == [False, True, False, True]
    assert seq.tolist() == [True, True, False, False]
    assert veto.tolist() == [True, True, True, False]
    w = is_weight(np.log(rho), config)
    np.testing.assert_allclose(w, np.where(rho_in, rho, 0.0))
    trunc = CorrectionConfig(weight_mode="truncate", token_bounds=(0.0, 2.0))
    np.testing.assert_allclose(is_weight(np.log(rho), trunc), np.minimum(rho, 2.0))
    assert mis_masks(np.log(rho), mask, trunc)[0].all()  # truncation masks no token


@pytest.mark.parametrize("ratio", [0.985, 0.995, 1.0, 1.005, 1.02])
def test_geometric_mask_is_length_invariant(ratio):
    decisions = set()
    config = CorrectionConfig(weight_mode="mask", token_bounds=(0.5, 2.0), sequence_bounds=(0.99, 1.01))
    for length in (1, 2, 7, 64, 500):
        log_ratio = np.full((1, length), np.log(ratio))
        _, seq, _ = mis_masks(log_ratio, np.ones((1, length), dtype=bool), config)
        decisions.add(bool(seq[0]))
    assert decisions == {0.99 <= ratio <= 1.01}


def test_masking_keeps_the_unmasked_denominator():
    """Masking a token shrinks the step: the token-mean denominator counts every trainable token."""
    rng = np.random.default_rng(5)
    V = 5
    z = rng.normal(size=(1, 2, V))
    lp = log_softmax(z)
    logq = np.array([[lp[0, 0, 1], lp[0, 1, 3] + np.log(10.0)]])  # second token: ρ = 0.1 -> masked
    inputs = LossInputs(
        logits=z, target_ids=np.array([[1, 3]]), loss_mask=np.ones((1, 2), dtype=bool), sampler_logprobs=logq,
        support_ids=np.zeros((1, 2, 1), dtype=np.int32), support_mask=np.zeros((1, 2, 1), dtype=bool),
        support_logprobs=np.zeros((1, 2, 1)), support_kept=np.array([False]), advantages=np.array([1.0]),
        temperature=np.array([1.0]))
    loss, stats = policy_loss(inputs, correction_preset("mis", sequence_bounds=None))
    np.testing.assert_allclose(loss, -lp[0, 0, 1] / 2, atol=1e-12)
    assert stats.token_keep.tolist() == [[True, False]]


@pytest.mark.parametrize("centering", [False, True])
def test_sequence_and_veto_levels_drop_the_whole_rollout(centering):
    """A rollout dropped by the geometric or veto level adds nothing to the loss or gradient,
    yet its tokens stay in the token-mean denominator."""
    rng = np.random.default_rng(8)
    V, K = 6, 3
    z = rng.normal(size=(3, 2, V))
    lp = log_softmax(z)
    targets = np.array([[0, 1], [2, 3], [4, 5]])
    lp_a = np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    # row 0 on-policy; row 1 geometric ratio e^0.1 (dropped by (0.99, 1.01)); row 2 one ρ = 1e-5 (vetoed)
    logq = lp_a - np.array([[0.0, 0.0], [0.1, 0.1], [0.0, np.log(1e-5)]])
    support = np.broadcast_to(np.arange(K), (3, 2, K))
    inputs = LossInputs(
        logits=torch.tensor(z, requires_grad=True), target_ids=torch.tensor(targets), loss_mask=torch.ones(3, 2, dtype=torch.bool),
        sampler_logprobs=torch.tensor(logq), support_ids=torch.tensor(support.copy()), support_mask=torch.ones(3, 2, K, dtype=torch.bool),
        support_logprobs=torch.tensor(lp[..., :K]), support_kept=torch.tensor([False] * 3),
        advantages=torch.tensor([1.0, -2.0, 3.0], dtype=T64), temperature=torch.ones(3, dtype=T64))
    config = CorrectionConfig(weight_mode="mask", token_bounds=(1e-6, 2.0), sequence_bounds=(0.99, 1.01),
                              veto_threshold=1e-4, score_centering=centering)
    loss, stats = policy_loss(inputs, config)
    assert stats.sequence_keep.tolist() == [True, False, False] and stats.veto_keep.tolist() == [True, True, False]
    (g,) = torch.autograd.grad(loss, inputs.logits)
    assert torch.all(g[1:] == 0) and torch.any(g[0] != 0)
    only_row0 = LossInputs(**{k: v[:1] for k, v in inputs.__dict__.items() if v is not None})
    loss0, _ = policy_loss(only_row0, config, normalizer=6.0)
    torch.testing.assert_close(loss.detach(), loss0.detach(), rtol=0, atol=1e-12)


# ------------------------------------------------------------------ advantages and config
def test_grpo_advantages():
    r = np.array([1.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    g = np.array([0, 0, 0, 1, 1, 2])
    np.testing.assert_allclose(grpo_advantages(r, g, 3), [1 / 3, -2 / 3, 1 / 3, 0, 0, 0])
    std = np.std([1.0, 0.0, 1.0], ddof=1)
    np.testing.assert_allclose(grpo_advantages(r, g, 3, normalize_std=True)[:3], np.array([1 / 3, -2 / 3, 1 / 3]) / (std + 1e-6))
    np.testing.assert_allclose(grpo_advantages(r, g, 3, normalize_std=True)[3:], 0.0)


def test_presets_and_config_validation():
    assert set(PRESETS) == {"none", "tis", "mis", "hetrl"}
    h = PRESETS["hetrl"]
    assert h.replay and h.score_centering and h.weight_mode == "mask" and h.token_bounds and h.sequence_bounds
    assert correction_preset("hetrl", score_centering=False).score_centering is False
    with pytest.raises(ValueError, match="score_centering cannot be combined"):
        correction_preset("hetrl", ppo_clip=(0.2, 0.28))
    with pytest.raises(ValueError, match="needs token_bounds"):
        CorrectionConfig(weight_mode="mask")
    with pytest.raises(ValueError, match="unknown correction preset"):
        correction_preset("grpo++")
    with pytest.raises(ValueError, match="0 <= L <= U"):
        CorrectionConfig(weight_mode="mask", token_bounds=(2.0, 0.5))


def test_ppo_clip_mode_clips_the_ratio():
    rng = np.random.default_rng(6)
    z = torch.tensor(rng.normal(size=(1, 3, 4)), requires_grad=True)
    lp = torch.log_softmax(z.detach(), -1)
    targets = torch.tensor([[0, 1, 2]])
    cur = lp.gather(-1, targets[..., None])[..., 0]
    old = cur + torch.tensor([[0.0, 0.5, -0.5]], dtype=T64)  # ratios 1, e^-0.5, e^0.5
    inputs = LossInputs(
        logits=z, target_ids=targets, loss_mask=torch.ones(1, 3, dtype=torch.bool), sampler_logprobs=old,
        support_ids=torch.zeros(1, 3, 1, dtype=torch.long), support_mask=torch.zeros(1, 3, 1, dtype=torch.bool),
        support_logprobs=torch.zeros(1, 3, 1, dtype=T64), support_kept=torch.tensor([False]),
        advantages=torch.tensor([1.0], dtype=T64), temperature=torch.ones(1, dtype=T64), old_logprobs=old)
    loss, _ = policy_loss(inputs, CorrectionConfig(ppo_clip=(0.2, 0.2)), normalizer=1.0)
    ratio = torch.exp(cur - old)
    expected = -torch.minimum(ratio, ratio.clamp(0.8, 1.2)).sum()
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(loss, z)
    # the ratio above 1 + ε (token 2, A > 0) is clipped: no gradient through it
    assert torch.all(g[0, 2] == 0) and torch.any(g[0, 0] != 0)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(LossInputs(**{**inputs.__dict__, "old_logprobs": None}), CorrectionConfig(ppo_clip=(0.2, 0.2)))
