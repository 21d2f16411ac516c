"""The same correction function on numpy, jax.numpy and torch arrays gives the same numbers.

Tolerances: float64 1e-10 (the backends differ only in summation order and libm ulps); float32
1e-5 for losses, metrics and gradients (a few float32 ulps accumulated over B·L·V sums). The
batches are ragged (kept and head supports, env tokens, padding) and their ratios straddle every
MIS bound, so masks are exercised; they are seeded so no ratio sits within rounding of a bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from factories import random_batch
from hetrl.core.correction import (
    PRESETS,
    CorrectionConfig,
    LOSS_FIELDS,
    LossInputs,
    correction_preset,
    grpo_advantages,
    loss_inputs,
    mismatch_metrics,
    policy_loss,
    token_entropy,
    token_logprobs,
)

CONFIGS = {
    **PRESETS,
    "hetrl_wide_geo": correction_preset("hetrl", sequence_bounds=(0.7, 1.4), veto_threshold=0.25),
    "mis_replay_no_sc": correction_preset("hetrl", score_centering=False),
    "sc_no_replay": correction_preset("hetrl", replay=False, sequence_bounds=None),
    "hetrl_sequence_mean": correction_preset("hetrl", reduction="sequence_mean", sequence_bounds=(0.5, 2.0)),
    "tis_std": correction_preset("tis"),
    "ppo_clip": CorrectionConfig(weight_mode="mask", token_bounds=(0.5, 2.0), ppo_clip=(0.2, 0.28)),
}

CONVERT = {
    "numpy": lambda a, dt: np.asarray(a, dtype=dt) if np.asarray(a).dtype.kind == "f" else np.asarray(a),
    "jax": lambda a, dt: jnp.asarray(a, dtype=dt) if np.asarray(a).dtype.kind == "f" else jnp.asarray(a),
    "torch": lambda a, dt: torch.as_tensor(np.asarray(a, dtype=dt)) if np.asarray(a).dtype.kind == "f" else torch.as_tensor(np.asarray(a)),
}


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def make_inputs(batch, logits, backend, dtype, old_shift=None):
    c = lambda a: CONVERT[backend](a, dtype)  # noqa: E731
    adv = grpo_advantages(batch.reward.astype(np.float64), batch.group_index, batch.num_groups)
    adv = adv + np.linspace(-0.3, 0.3, adv.shape[0])  # no zero-advantage row hides a term
    old = None
    if old_shift is not None:
        lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
        old = np.take_along_axis(lp, batch.target_ids[..., None].astype(np.int64), -1)[..., 0] + old_shift
    return LossInputs(
        logits=c(logits), target_ids=c(batch.target_ids), loss_mask=c(batch.loss_mask),
        sampler_logprobs=c(batch.sampler_logprobs), support_ids=c(batch.support_ids),
        support_mask=c(batch.support_mask), support_logprobs=c(batch.support_logprobs),
        support_kept=c(batch.support_kept), advantages=c(adv), temperature=c(batch.temperature),
        old_logprobs=None if old is None else c(old),
    )


def evaluate(batch, logits, backend, dtype, config):
    old_shift = np.random.default_rng(7).normal(size=batch.target_ids.shape) * 0.1 if config.ppo_clip else None
    x = make_inputs(batch, logits, backend, dtype, old_shift)
    loss, stats = policy_loss(x, config)
    metrics = mismatch_metrics(stats, x.loss_mask, CONVERT[backend](batch.pool_index, dtype), batch.pool_names,
                               CONVERT[backend](batch.policy_version, dtype), trainer_version=2)
    metrics["entropy"] = (token_entropy(x.logits, x.temperature) * x.loss_mask).sum()
    to_np = (lambda t: t.detach().numpy()) if backend == "torch" else np.asarray
    return float(to_np(loss)), {k: float(to_np(v)) for k, v in metrics.items()}


def batches():
    for seed in (11, 12, 13):
        batch, logits, _ = random_batch(np.random.default_rng(seed), batch=8, vocab=40,
                                        noise=(0.0, 0.0, 0.003, 0.05, 0.4, 1.5))
        yield seed, batch, logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_loss_and_metrics_agree_across_namespaces(name, dtype, tol):
    config = CONFIGS[name]
    for seed, batch, logits in batches():
        ref_loss, ref_metrics = evaluate(batch, logits, "numpy", np.float64, config)
        assert np.isfinite(ref_loss) and ref_loss != 0.0
        for backend in ("numpy", "jax", "torch"):
            loss, metrics = evaluate(batch, logits, backend, dtype, config)
            assert loss == pytest.approx(ref_loss, abs=tol, rel=tol), (seed, backend)
            assert metrics.keys() == ref_metrics.keys()
            for k, v in metrics.items():
                assert v == pytest.approx(ref_metrics[k], abs=tol, rel=tol), (seed, backend, k)


def test_parity_batches_exercise_every_mask_level():
    seen = {"token": 0.0, "sequence": 0.0, "veto": 0.0}
    for _, batch, logits in batches():
        _, m = evaluate(batch, logits, "numpy", np.float64, CONFIGS["hetrl_wide_geo"])
        for level in seen:
            seen[level] = max(seen[level], m[f"mismatch/masked_frac/{level}"])
        assert 0 < m["mismatch/masked_frac/any"] < 1
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.parametrize("name", ["hetrl", "hetrl_wide_geo", "mis", "tis", "none", "sc_no_replay", "ppo_clip"])
def test_gradients_agree_between_jax_and_torch_float32(name):
    config = CONFIGS[name]
    for seed, batch, logits in batches():
        tx = make_inputs(batch, logits, "torch", np.float32,
                         np.random.default_rng(7).normal(size=batch.target_ids.shape) * 0.1 if config.ppo_clip else None)
        t_logits = tx.logits.clone().requires_grad_(True)
        t_loss, _ = policy_loss(LossInputs(**{**tx.__dict__, "logits": t_logits}), config)
        (t_grad,) = torch.autograd.grad(t_loss, t_logits)

        jx = make_inputs(batch, logits, "jax", np.float32,
                         np.random.default_rng(7).normal(size=batch.target_ids.shape) * 0.1 if config.ppo_clip else None)
        fn = jax.jit(lambda lg: policy_loss(LossInputs(**{**jx.__dict__, "logits": lg}), config)[0])
        j_loss, j_grad = jax.value_and_grad(fn)(jx.logits)
        assert float(j_loss) == pytest.approx(float(t_loss.detach()), abs=1e-5)
        assert np.abs(t_grad.numpy()).max() > 1e-4  # a real gradient, not all masked away
        np.testing.assert_allclose(np.asarray(j_grad), t_grad.numpy(), atol=1e-5, rtol=0, err_msg=f"seed {seed}")
        assert np.isfinite(t_grad.numpy()).all()


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("backend", ["numpy", "jax", "torch"])
def test_token_logprobs_are_the_loss_logprobs_in_every_namespace(backend, replay):
    """The trainers' shared :func:`token_logprobs` (their PPO-clip ``old_logprobs``) equals the
    ``log p(a_t)`` the loss uses, and :func:`loss_inputs` assembles the loss's inputs from a batch."""
    config = correction_preset("hetrl", replay=replay)
    for seed, batch, logits in batches():
        x = make_inputs(batch, logits, backend, np.float64)
        arrays = {name: CONVERT[backend](batch.arrays[name], np.float64) for name in LOSS_FIELDS}
        _, stats = policy_loss(loss_inputs(x.logits, arrays, x.advantages), config)
        _, expected = policy_loss(x, config)
        to_np = (lambda t: t.detach().numpy()) if backend == "torch" else np.asarray
        got = to_np(token_logprobs(x.logits, arrays, replay))
        mask = batch.loss_mask
        np.testing.assert_allclose(got[mask], to_np(expected.logp)[mask], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(to_np(stats.logp), to_np(expected.logp))
        full = logits / batch.temperature[:, None, None]
        full = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
        plain = np.take_along_axis(full, batch.target_ids[..., None].astype(np.int64), -1)[..., 0]
        replayed_rows = batch.support_kept[:, None] & mask
        assert replay == bool(np.abs(got - plain)[replayed_rows].max() > 1e-6), seed  # replay changes kept rows only
        np.testing.assert_allclose(got[~batch.support_kept][mask[~batch.support_kept]],
                                   plain[~batch.support_kept][mask[~batch.support_kept]], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["hetrl", "ppo_clip", "hetrl_sequence_mean"])
def test_torch_functions_allocate_on_their_inputs_device(name):
    """Every core function a trainer calls keeps to its inputs' device: on torch ``meta`` tensors
    (shapes only) any intermediate allocated on the default device (the CPU) raises, as it would
    beside CUDA tensors (the GPU check caught ``grpo_advantages`` doing so)."""
    batch, logits, _ = random_batch(np.random.default_rng(3))
    meta = lambda a: torch.as_tensor(np.asarray(a)).to("meta")  # noqa: E731
    arrays = {field: meta(getattr(batch, field)) for field in LOSS_FIELDS}
    config = CONFIGS[name]
    advantages = grpo_advantages(meta(batch.reward.astype(np.float32)), meta(batch.group_index.astype(np.int64)),
                                 batch.num_groups, normalize_std=True)
    old = meta(np.zeros(batch.loss_mask.shape, np.float32)) if config.ppo_clip is not None else None
    inputs = loss_inputs(meta(logits.astype(np.float32)).requires_grad_(), arrays, advantages, old)
    loss, stats = policy_loss(inputs, config)
    loss.backward()
    metrics = mismatch_metrics(stats, arrays["loss_mask"], meta(batch.pool_index), batch.pool_names,
                               meta(batch.policy_version), 3, config.log_ratio_clamp)
    tensors = [advantages, loss, token_entropy(inputs.logits, arrays["temperature"]),
               token_logprobs(inputs.logits, arrays, replay=True), *metrics.values()]
    assert all(t.device.type == "meta" for t in tensors if isinstance(t, torch.Tensor))
