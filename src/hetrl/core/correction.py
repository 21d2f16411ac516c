"""Off-policy correction, written once for numpy, jax.numpy and torch (DESIGN §3).

Notation: q = sampler distribution, p = trainer distribution under the current parameters,
z = trainer logits, T = sampling temperature, S_t = recorded support at token t, a_t = sampled
token, A = advantage, sg = stop-gradient, M = loss mask (trainable tokens).

Shapes: B rollouts, L target positions (see :mod:`hetrl.core.schema` for the alignment), V the
vocabulary, K the (padded) support width. Every function takes arrays of one namespace and finds
it with :func:`hetrl.core.xp.namespace`; nothing here imports a framework.

Pipeline of :func:`policy_loss`:

1. log-probs: ``log p^S(v) = z_v/T - logsumexp_{u∈S∪{a}} z_u/T`` on rows whose support is the
   kept set (mask replay, ``config.replay``), the full-vocabulary log-softmax otherwise;
2. ratios ``log ρ_t = clamp(sg(log p(a_t)) - log q(a_t), ±c)``;
3. masked importance sampling: token level ``L ≤ ρ_t ≤ U``, geometric sequence level
   ``L_g ≤ exp(mean_t log ρ_t) ≤ U_g``, veto (any ``ρ_t < τ``); weights ``ρ·keep`` (mask) or
   ``min(ρ, U)`` (truncate);
4. score centering (optional): per token
   ``ℓ_t = -sg(A)·[sg(w_a)·log p(a) - Σ_{v∈S} sg(c_v)·log p(v)]`` with ``c_v = q_v·f(p_v/q_v)``
   over a kept support and ``c_v = q_v·f(p_v/q_v) - α·f(1/α)·p_v`` over a head H, where
   ``α = (1-Q_H)/(1-P_H)``; the gradient is ``-A·(w_a·s_a - μ_w)`` with ``μ_w = E_q[w·s]``;
5. reduction: token mean (denominator = number of *unmasked* trainable tokens, so masking shrinks
   the step) or sequence mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.core.xp import (
    Array,
    device,
    log_softmax,
    logsumexp,
    masked_max,
    masked_mean,
    masked_sum,
    namespace,
    stop_gradient,
    take_along_axis,
)

__all__ = [
    "CorrectionConfig",
    "PRESETS",
    "correction_preset",
    "LossInputs",
    "LOSS_FIELDS",
    "loss_inputs",
    "token_logprobs",
    "TokenStats",
    "replay_logprobs",
    "replay_from_gathered",
    "grpo_advantages",
    "importance_log_ratios",
    "mis_masks",
    "is_weight",
    "centering_coefficients",
    "policy_loss",
    "mismatch_metrics",
    "pool_mismatch",
    "pool_mismatch_key",
    "token_entropy",
]


# ====================================================================== config
class CorrectionConfig(BaseModel):
    """What the loss corrects for. Named presets live in :data:`PRESETS`.

    ``weight_mode``: ``"none"`` (w = 1, plain GRPO), ``"mask"`` (w = ρ·keep), ``"truncate"``
    (w = min(ρ, U), the TIS baseline). Bounds are on ρ, not log ρ.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    replay: bool = Field(False, description="renormalize the trainer over the recorded kept support")
    weight_mode: Literal["none", "mask", "truncate"] = "none"
    token_bounds: tuple[float, float] | None = Field(None, description="(L, U) token-level MIS bounds on ρ_t")
    sequence_bounds: tuple[float, float] | None = Field(None, description="(L_g, U_g) on exp(mean log ρ)")
    veto_threshold: float | None = Field(None, gt=0.0, description="drop a rollout if any ρ_t is below this")
    score_centering: bool = False
    ppo_clip: tuple[float, float] | None = Field(None, description="(ε_low, ε_high): PPO-clip with recomputed p_old")
    reduction: Literal["token_mean", "sequence_mean"] = "token_mean"
    log_ratio_clamp: float = Field(20.0, gt=0.0)
    head_tail_eps: float = Field(1e-6, gt=0.0, description="guard of the SC tail denominators")

    @model_validator(mode="after")
    def _consistent(self) -> "CorrectionConfig":
        for name in ("token_bounds", "sequence_bounds"):
            bounds = getattr(self, name)
            if bounds is not None and not (0.0 <= bounds[0] <= bounds[1]):
                raise ValueError(f"{name} must satisfy 0 <= L <= U, got {bounds}")
        if self.weight_mode == "none" and (self.token_bounds or self.sequence_bounds or self.veto_threshold):
            raise ValueError("weight_mode 'none' takes no MIS bounds; use weight_mode 'mask' or 'truncate'")
        if self.weight_mode != "none" and self.token_bounds is None:
            raise ValueError(f"weight_mode {self.weight_mode!r} needs token_bounds (L, U)")
        if self.score_centering and self.ppo_clip is not None:
            raise ValueError("score_centering cannot be combined with ppo_clip (DESIGN §3.3)")
        if self.ppo_clip is not None and not (0.0 <= self.ppo_clip[0] < 1.0 and self.ppo_clip[1] >= 0.0):
            raise ValueError(f"ppo_clip must be (ε_low in [0, 1), ε_high >= 0), got {self.ppo_clip}")
        return self


_MIS_BOUNDS = dict(token_bounds=(0.5, 2.0), sequence_bounds=(0.99, 1.01))

PRESETS: dict[str, CorrectionConfig] = {
    # plain GRPO on off-policy data: no correction at all
    "none": CorrectionConfig(),
    # truncated importance sampling at the token level
    "tis": CorrectionConfig(weight_mode="truncate", token_bounds=(0.0, 2.0)),
    # masked importance sampling, token + geometric sequence level
    "mis": CorrectionConfig(weight_mode="mask", **_MIS_BOUNDS),
    # hetrl: mask replay + token & geometric MIS + score centering
    "hetrl": CorrectionConfig(replay=True, weight_mode="mask", score_centering=True, **_MIS_BOUNDS),
}


def correction_preset(name: str, **overrides) -> CorrectionConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (re-validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown correction preset {name!r}; choose one of {sorted(PRESETS)}")
    return CorrectionConfig.model_validate({**PRESETS[name].model_dump(), **overrides})


# ====================================================================== typed inputs / outputs
@dataclass(frozen=True)
class LossInputs:
    """Arrays of one namespace. ``logits`` is the only one the gradient flows through.

    logits [B, L, V] (raw, before temperature); target_ids, loss_mask, sampler_logprobs [B, L];
    support_ids, support_mask, support_logprobs [B, L, K]; support_kept, advantages,
    temperature [B]; old_logprobs [B, L] (PPO-clip only: log p_old(a_t) on the same
    support treatment as the current log-probs).
    """

    logits: Array
    target_ids: Array
    loss_mask: Array
    sampler_logprobs: Array
    support_ids: Array
    support_mask: Array
    support_logprobs: Array
    support_kept: Array
    advantages: Array
    temperature: Array
    old_logprobs: Array | None = None


@dataclass(frozen=True)
class TokenStats:
    """Detached per-token quantities the loss computed, for :func:`mismatch_metrics`.

    [B, L]: logp (trainer log p(a_t) the loss used), log_ratio (log p − log q, unclamped),
    weight (final IS weight incl. sequence masks), token_keep, support_size, sampler_head_mass
    (Q_H = Σ_S q), train_head_mass (P_H = Σ_S p). [B]: sequence_keep, veto_keep.
    """

    logp: Array
    log_ratio: Array
    weight: Array
    token_keep: Array
    sequence_keep: Array
    veto_keep: Array
    support_size: Array
    sampler_head_mass: Array
    train_head_mass: Array


LOSS_FIELDS: tuple[str, ...] = ("target_ids", "loss_mask", "sampler_logprobs", "support_ids", "support_mask",
                                 "support_logprobs", "support_kept", "temperature")
"""The :class:`~hetrl.core.schema.RolloutBatch` arrays :class:`LossInputs` takes as they are."""


def loss_inputs(logits: Array, arrays: Mapping[str, Array], advantages: Array,
                old_logprobs: Array | None = None) -> LossInputs:
    """The :class:`LossInputs` of ``logits`` over a batch's arrays (:data:`LOSS_FIELDS`, in one
    namespace with ``logits``), with ``advantages`` [B] and the PPO-clip ``old_logprobs``."""
    return LossInputs(logits=logits, **{name: arrays[name] for name in LOSS_FIELDS}, advantages=advantages,
                      old_logprobs=old_logprobs)


def token_logprobs(logits: Array, arrays: Mapping[str, Array], replay: bool) -> Array:
    """Trainer ``log p(a_t)`` [B, L] of ``logits`` [B, L, V] with the support treatment of
    :func:`policy_loss`: the mask-replayed ``z_a/T − logsumexp_{u∈S∪{a}} z_u/T`` on rows whose
    recorded support is the kept set (``support_kept``) when ``replay``, the full-vocabulary
    ``log softmax(z/T)_a`` on every other row. The same operations as the loss, so these values
    serve as the recomputed ``old_logprobs`` of the PPO-clip mode; values off ``loss_mask`` are
    defined but meaningless. ``arrays``: ``target_ids`` [B, L], ``support_ids``/``support_mask``
    [B, L, K], ``support_kept`` and ``temperature`` [B]."""
    xp = namespace(logits)
    target = arrays["target_ids"]
    full = log_softmax(_scale(logits, arrays["temperature"]), axis=-1)
    if not replay:
        return take_along_axis(full, target[..., None], axis=-1)[..., 0]
    logp_a, logp_s = _gather_target_and_support(full, target, arrays["support_ids"])
    replay_a, _ = replay_from_gathered(logp_a, logp_s, target, arrays["support_ids"], arrays["support_mask"])
    return xp.where(arrays["support_kept"][:, None], replay_a, logp_a)


# ====================================================================== mask replay
def replay_from_gathered(
    target_logits: Array, support_logits: Array, target_ids: Array, support_ids: Array, support_mask: Array
) -> tuple[Array, Array]:
    """Renormalize over S ∪ {a} given already-gathered values at a and S.

    target_logits [B, L] = z_a/T; support_logits [B, L, K] = z_v/T for v in S (padding masked);
    any per-position shift of both (e.g. full log-probs instead of logits) gives the same result.
    Returns ``(log p^S(a) [B, L], log p^S(v) [B, L, K])``. The sampled token is always kept
    (force-keep): if a ∉ S it joins the normalizer, so log p^S(a) is finite; a ∈ S is not
    counted twice.
    """
    xp = namespace(support_logits)
    a_in_support = xp.any(support_mask & (support_ids == target_ids[..., None]), axis=-1)
    logits = xp.concat([support_logits, target_logits[..., None]], axis=-1)
    keep = xp.concat([support_mask, ~a_in_support[..., None]], axis=-1)
    norm = logsumexp(logits, axis=-1, where=keep)
    return target_logits - norm, support_logits - norm[..., None]


def replay_logprobs(
    logits: Array, target_ids: Array, support_ids: Array, support_mask: Array, temperature: Array | float = 1.0
) -> tuple[Array, Array]:
    """Mask replay from logits: ``log p^S(v) = z_v/T − logsumexp_{u∈S∪{a}} z_u/T``.

    logits [B, L, V]; target_ids [B, L]; support_ids, support_mask [B, L, K]; temperature a
    scalar or [B]. Returns ``(log p^S(a_t) [B, L], log p^S(v) [B, L, K])``. With the whole
    vocabulary as support this equals the log-softmax.
    """
    full = log_softmax(_scale(logits, temperature), axis=-1)
    lp_a, lp_s = _gather_target_and_support(full, target_ids, support_ids)
    return replay_from_gathered(lp_a, lp_s, target_ids, support_ids, support_mask)


def _gather_target_and_support(values: Array, target_ids: Array, support_ids: Array) -> tuple[Array, Array]:
    """``(values[a] [B, L], values[S] [B, L, K])`` with one gather of K+1 ids, so the backward
    pass scatters into the [B, L, V] gradient once (two gathers would cost a second V-sized pass)."""
    xp = namespace(values)
    ids = xp.concat([support_ids, xp.astype(target_ids[..., None], support_ids.dtype)], axis=-1)
    gathered = take_along_axis(values, ids, axis=-1)
    return gathered[..., -1], gathered[..., :-1]


def _scale(logits: Array, temperature: Array | float) -> Array:
    xp = namespace(logits)
    if isinstance(temperature, (int, float)):
        return logits / temperature if temperature != 1.0 else logits
    return logits / xp.astype(temperature, logits.dtype)[:, None, None]


# ====================================================================== advantages
def grpo_advantages(
    rewards: Array, group_index: Array, num_groups: int, normalize_std: bool = False, eps: float = 1e-6
) -> Array:
    """GRPO group-relative advantages ``A_i = R_i − mean_{g(i)} R`` (optionally / (std_g + eps)).

    rewards [B] float, group_index [B] int in [0, num_groups). The std is the unbiased sample
    std of the group (as in GRPO implementations); a group of one has std 0. A group whose
    rewards are all equal gets A = 0: it carries no signal.
    """
    xp = namespace(rewards)
    onehot = xp.astype(group_index[:, None] == xp.arange(num_groups, device=device(group_index))[None, :], rewards.dtype)  # [B, G]
    count = xp.sum(onehot, axis=0)
    mean = xp.sum(onehot * rewards[:, None], axis=0) / xp.maximum(count, xp.ones_like(count))
    centered = rewards - xp.sum(onehot * mean[None, :], axis=1)
    if not normalize_std:
        return centered
    var = xp.sum(onehot * centered[:, None] ** 2, axis=0) / xp.maximum(count - 1, xp.ones_like(count))
    std = xp.sum(onehot * xp.sqrt(var)[None, :], axis=1)
    return centered / (std + eps)


# ====================================================================== importance sampling
def importance_log_ratios(logp: Array, sampler_logprobs: Array, clamp: float = 20.0) -> Array:
    """``log ρ = clamp(sg(log p) − log q, −clamp, clamp)``, elementwise."""
    xp = namespace(logp)
    return xp.clip(stop_gradient(logp) - sampler_logprobs, -clamp, clamp)


def mis_masks(log_ratio: Array, loss_mask: Array, config: CorrectionConfig) -> tuple[Array, Array, Array]:
    """The three MIS levels as booleans: ``(token_keep [B, L], sequence_keep [B], veto_keep [B])``.

    token: ``L ≤ ρ_t ≤ U`` (only in mode ``mask``; truncation keeps every token);
    sequence: ``L_g ≤ exp(mean_{t∈M} log ρ_t) ≤ U_g``; veto: no trainable ρ_t below τ.
    A disabled level keeps everything. Rows without trainable tokens are kept.
    """
    xp = namespace(log_ratio)
    rho = xp.exp(log_ratio)
    token_keep = xp.ones_like(loss_mask)
    if config.weight_mode == "mask" and config.token_bounds is not None:
        lo, hi = config.token_bounds
        token_keep = (rho >= lo) & (rho <= hi)
    seq_keep = xp.ones_like(loss_mask[:, 0])
    if config.sequence_bounds is not None:
        lo, hi = config.sequence_bounds
        geo = xp.exp(masked_mean(log_ratio, loss_mask, axis=1))
        seq_keep = (geo >= lo) & (geo <= hi)
    veto_keep = xp.ones_like(seq_keep)
    if config.veto_threshold is not None:
        veto_keep = ~xp.any(loss_mask & (rho < config.veto_threshold), axis=1)
    return token_keep, seq_keep, veto_keep


def is_weight(log_ratio: Array, config: CorrectionConfig) -> Array:
    """The per-token rule f applied to ρ = exp(log_ratio), any shape.

    ``none``: 1; ``mask``: ρ·1[L ≤ ρ ≤ U]; ``truncate``: min(ρ, U).
    """
    xp = namespace(log_ratio)
    if config.weight_mode == "none":
        return xp.ones_like(log_ratio)
    rho = xp.exp(log_ratio)
    lo, hi = config.token_bounds
    if config.weight_mode == "truncate":
        return xp.minimum(rho, xp.asarray(hi, dtype=rho.dtype))
    return xp.where((rho >= lo) & (rho <= hi), rho, xp.zeros_like(rho))


def centering_coefficients(
    logp_support: Array, support_logprobs: Array, support_mask: Array, support_kept: Array, config: CorrectionConfig
) -> tuple[Array, Array, Array]:
    """Score-centering coefficients ``c_v`` [B, L, K] (detached) and the head masses.

    Kept support (exact): ``c_v = q_v·f(p_v/q_v)``. Head H of the full distribution:
    ``c_v = q_v·f(p_v/q_v) − α·f(1/α)·p_v`` with ``α = (1−Q_H)/max(1−P_H, ε)`` and
    ``1/α = (1−P_H)/max(1−Q_H, ε)``, so that ``Σ_H c_v·s_v = μ_w`` under the tail model
    ``q̂_v = α·p_v``. Returns ``(c, P_H [B, L], Q_H [B, L])``.
    """
    xp = namespace(logp_support)
    zero = xp.zeros_like(support_logprobs)
    logp = stop_gradient(logp_support)
    p = xp.where(support_mask, xp.exp(logp), zero)
    q = xp.where(support_mask, xp.exp(support_logprobs), zero)
    ratio = importance_log_ratios(logp, support_logprobs, config.log_ratio_clamp)
    coef = q * is_weight(ratio, config)
    p_head = xp.sum(p, axis=-1)
    q_head = xp.sum(q, axis=-1)
    eps = config.head_tail_eps
    one = xp.ones_like(p_head)
    alpha = (one - q_head) / xp.maximum(one - p_head, eps * one)
    inv_alpha = (one - p_head) / xp.maximum(one - q_head, eps * one)
    log_inv_alpha = xp.clip(xp.log(xp.maximum(inv_alpha, xp.asarray(1e-30, dtype=inv_alpha.dtype))),
                            -config.log_ratio_clamp, config.log_ratio_clamp)
    tail = alpha * is_weight(log_inv_alpha, config)
    head_coef = coef - tail[..., None] * p
    coef = xp.where(support_kept[:, None, None], coef, head_coef)
    return stop_gradient(coef), p_head, q_head


# ====================================================================== the loss
def policy_loss(
    inputs: LossInputs, config: CorrectionConfig, normalizer: Array | float | None = None
) -> tuple[Array, TokenStats]:
    """Corrected policy-gradient loss and the detached per-token statistics.

    ``normalizer`` overrides the reduction denominator of ``token_mean`` (e.g. the trainable
    token count of the whole global batch when micro-batching); by default it is
    ``Σ loss_mask`` of these inputs. Returns ``(loss scalar, TokenStats)``.
    """
    x = inputs
    xp = namespace(x.logits)
    dtype = x.logits.dtype
    mask = x.loss_mask
    fmask = xp.astype(mask, dtype)
    adv = stop_gradient(xp.astype(x.advantages, dtype))[:, None]
    q_a = xp.astype(x.sampler_logprobs, dtype)
    q_s = xp.astype(x.support_logprobs, dtype)

    # Full-vocabulary log-probs first (the same fused log-softmax a plain loss uses), then one
    # gather at S ∪ {a}; replay renormalizes those K+1 values, which is exact since
    # log p^S = z − lse_{S∪{a}} z is invariant to the per-position shift by lse_V z.
    full = log_softmax(_scale(x.logits, x.temperature), axis=-1)
    logp_a, logp_s = _gather_target_and_support(full, x.target_ids, x.support_ids)
    if config.replay:
        replay_a, replay_s = replay_from_gathered(logp_a, logp_s, x.target_ids, x.support_ids, x.support_mask)
        kept = x.support_kept[:, None]
        logp_a = xp.where(kept, replay_a, logp_a)
        logp_s = xp.where(kept[..., None], replay_s, logp_s)

    behaviour = logp_a if x.old_logprobs is None else xp.astype(x.old_logprobs, dtype)
    log_ratio = importance_log_ratios(behaviour, q_a, config.log_ratio_clamp)
    token_keep, seq_keep, veto_keep = mis_masks(log_ratio, mask, config)
    row_keep = xp.astype(seq_keep & veto_keep, dtype)[:, None]
    token_weight = is_weight(log_ratio, config) * row_keep  # mask mode: ρ·1[L≤ρ≤U]·seq·veto

    if config.ppo_clip is not None:
        if x.old_logprobs is None:
            raise ValueError("ppo_clip needs LossInputs.old_logprobs (recomputed log p_old)")
        lo, hi = config.ppo_clip
        ratio = xp.exp(logp_a - stop_gradient(behaviour))
        surrogate = xp.minimum(ratio * adv, xp.clip(ratio, 1.0 - lo, 1.0 + hi) * adv)
        token_loss = -token_weight * surrogate
    else:
        objective = token_weight * logp_a
        if config.score_centering:
            coef, _, _ = centering_coefficients(logp_s, q_s, x.support_mask, x.support_kept, config)
            objective = objective - row_keep * xp.sum(coef * logp_s, axis=-1)
        token_loss = -adv * objective

    loss = _reduce(token_loss, fmask, config.reduction, normalizer)

    # detached statistics for the metrics
    logp_s_sg = stop_gradient(logp_s)
    zero = xp.zeros_like(q_s)
    stats = TokenStats(
        logp=stop_gradient(logp_a),
        log_ratio=stop_gradient(logp_a) - q_a,
        weight=stop_gradient(token_weight),
        token_keep=token_keep,
        sequence_keep=seq_keep,
        veto_keep=veto_keep,
        support_size=xp.sum(xp.astype(x.support_mask, dtype), axis=-1),
        sampler_head_mass=xp.sum(xp.where(x.support_mask, xp.exp(q_s), zero), axis=-1),
        train_head_mass=xp.sum(xp.where(x.support_mask, xp.exp(logp_s_sg), zero), axis=-1),
    )
    return loss, stats


def _reduce(token_loss: Array, fmask: Array, reduction: str, normalizer: Array | float | None) -> Array:
    xp = namespace(token_loss)
    per_token = xp.where(fmask > 0, token_loss, xp.zeros_like(token_loss))
    if reduction == "token_mean":
        denom = xp.sum(fmask) if normalizer is None else normalizer
        return xp.sum(per_token) / xp.maximum(xp.asarray(denom, dtype=token_loss.dtype), xp.asarray(1.0, dtype=token_loss.dtype))
    counts = xp.sum(fmask, axis=1)
    per_row = xp.sum(per_token, axis=1) / xp.maximum(counts, xp.ones_like(counts))
    rows = xp.sum(xp.astype(counts > 0, token_loss.dtype))
    return xp.sum(per_row) / xp.maximum(rows, xp.ones_like(rows))


# ====================================================================== metrics
def mismatch_metrics(
    stats: TokenStats,
    loss_mask: Array,
    pool_index: Array | None = None,
    pool_names: Sequence[str] = (),
    policy_version: Array | None = None,
    trainer_version: int | None = None,
    clamp: float = 20.0,
) -> dict[str, Array]:
    """Sampler–trainer mismatch metrics, overall (``mismatch/...``) and per pool
    (``pool/<name>/mismatch/...``), as 0-d arrays of the stats' namespace.

    With d = log p − log q over trainable tokens and ρ = exp(clamp(d)):
    k1 = E[−d] (estimates KL(q‖p)), k3 = E[ρ − 1 − log ρ], χ²_token = E[(ρ − 1)²],
    χ²_seq = mean_i (exp(clamp(Σ_t d_t)) − 1)², |d| mean and max, ESS = (Σw)² / (N·Σw²) of the
    final weights, masked fractions (token level over tokens; sequence and veto levels over
    rollouts; ``any`` = tokens whose final weight is 0), mean support size, head masses Q_H and
    P_H, and staleness (trainer_version − policy_version) when versions are given.
    """
    out = _metric_set(stats, loss_mask, None, policy_version, trainer_version, clamp)
    metrics = {f"mismatch/{k}": v for k, v in out.items()}
    if pool_index is not None:
        for g, name in enumerate(pool_names):
            part = _metric_set(stats, loss_mask, pool_index == g, policy_version, trainer_version, clamp)
            metrics.update({pool_mismatch_key(name, k): v for k, v in part.items()})
    return metrics


def pool_mismatch_key(pool: str, metric: str) -> str:
    """The flat name under which :func:`mismatch_metrics` puts ``metric`` of ``pool`` (the one
    owner of that name; readers of metric records look names up with it)."""
    return f"pool/{pool}/mismatch/{metric}"


def pool_mismatch(metrics: Mapping[str, Any], pool_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """The per-pool part of :func:`mismatch_metrics`'s output (e.g. a train step's metrics), as
    ``{pool: {metric: value}}`` floats: for every overall ``mismatch/<metric>`` of ``metrics``,
    each pool's value of it (the metrics looked up by name, nothing parsed). A pool absent from
    ``metrics`` (computed without pools) maps to ``{}``."""
    names = [k.split("/", 1)[1] for k in metrics if k.startswith("mismatch/")]
    return {pool: {m: float(metrics[pool_mismatch_key(pool, m)]) for m in names if pool_mismatch_key(pool, m) in metrics}
            for pool in pool_names}


def _metric_set(
    s: TokenStats, loss_mask: Array, rows: Array | None, policy_version: Array | None,
    trainer_version: int | None, clamp: float,
) -> Mapping[str, Array]:
    xp = namespace(s.log_ratio)
    dtype = s.log_ratio.dtype
    row_has = xp.any(loss_mask, axis=1)
    if rows is not None:
        row_has = row_has & rows
    m = loss_mask & row_has[:, None]
    fm = xp.astype(m, dtype)
    n_tok = xp.sum(fm)
    tiny = xp.asarray(1e-30, dtype=dtype)
    d = s.log_ratio
    log_rho = xp.clip(d, -clamp, clamp)
    rho = xp.exp(log_rho)
    w = s.weight
    w_sum = masked_sum(w, m)
    w_sq = masked_sum(w * w, m)
    seq_log = xp.clip(masked_sum(d, m, axis=1), -clamp, clamp)
    out = {
        "k1": masked_mean(-d, m),
        "k3": masked_mean(rho - 1.0 - log_rho, m),
        "chi2_token": masked_mean((rho - 1.0) ** 2, m),
        "chi2_seq": masked_mean((xp.exp(seq_log) - 1.0) ** 2, row_has),
        "abs_logp_diff_mean": masked_mean(xp.abs(d), m),
        "abs_logp_diff_max": masked_max(xp.abs(d), m),
        "ess": xp.where(w_sq > 0, w_sum * w_sum / xp.maximum(n_tok * w_sq, tiny), xp.zeros_like(w_sq)),
        "masked_frac/token": masked_mean(xp.astype(~s.token_keep, dtype), m),
        "masked_frac/sequence": masked_mean(xp.astype(~s.sequence_keep, dtype), row_has),
        "masked_frac/veto": masked_mean(xp.astype(~s.veto_keep, dtype), row_has),
        "masked_frac/any": masked_mean(xp.astype(w == 0, dtype), m),
        "support_size": masked_mean(s.support_size, m),
        "sampler_head_mass": masked_mean(s.sampler_head_mass, m),
        "train_head_mass": masked_mean(s.train_head_mass, m),
        "num_tokens": n_tok,
    }
    if policy_version is not None and trainer_version is not None:
        stale = xp.astype(trainer_version - policy_version, dtype)
        out["staleness_mean"] = masked_mean(stale, m)
        out["staleness_max"] = masked_max(stale, m)
    return out


def token_entropy(logits: Array, temperature: Array | float = 1.0) -> Array:
    """Entropy of the trainer's full-vocabulary distribution per position, [B, L] (detached)."""
    xp = namespace(logits)
    scaled = stop_gradient(_scale(logits, temperature))
    lse = logsumexp(scaled, axis=-1)
    probs = xp.exp(scaled - lse[..., None])
    return lse - xp.sum(probs * scaled, axis=-1)
