"""Builders of valid rollouts and loss inputs from a seeded numpy Generator.

Rollouts are sampled for real from a random "sampler" distribution: logits over the vocabulary,
temperature, then top-k / top-p truncation; q is renormalized over the kept set, the token is
drawn from it, and the recorded log-probs are those of that distribution. Multi-turn rollouts
get runs of env tokens (``loss_mask=False``, empty support spans). So every produced rollout
passes ``Rollout.validate`` by construction, and malformed cases are made by editing one field.
"""

from __future__ import annotations

import numpy as np

from hetrl.core.schema import Rollout, SamplerInfo, SamplingParams, SamplingSupport, collate


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sampler_info(pool: str = "b200-bf16") -> SamplerInfo:
    return SamplerInfo(pool=pool, accelerator=pool.split("-")[0], weight_precision="bf16",
                       kv_precision="bf16", engine="embedded", engine_version="test")


def truncated_distribution(logits: np.ndarray, sampling: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Kept ids (sorted by decreasing prob) and their renormalized log q after top-k/top-p."""
    logq = log_softmax(logits / sampling.temperature)
    order = np.argsort(-logq, kind="stable")
    if sampling.top_k > 0:
        order = order[: sampling.top_k]
    if sampling.top_p < 1.0:
        cum = np.cumsum(np.exp(logq[order]))
        keep = int(np.searchsorted(cum, sampling.top_p) + 1)  # smallest prefix with mass >= top_p
        order = order[:keep]
    kept = logq[order]
    kept = kept - np.log(np.exp(kept - kept.max()).sum()) - kept.max()
    return order.astype(np.int32), kept.astype(np.float64)


def random_rollout(
    rng: np.random.Generator,
    vocab: int = 50,
    prompt_len: int = 3,
    response_len: int = 6,
    sampling: SamplingParams | None = None,
    head_size: int = 0,
    env_every: int = 0,
    pool: str = "b200-bf16",
    group_id: str = "g0",
    rollout_id: str | None = None,
    version: int = 0,
    logit_scale: float = 2.0,
) -> tuple[Rollout, np.ndarray]:
    """A valid rollout and the sampler logits [T, V] it was drawn from.

    ``sampling`` truncated -> a 'kept' support; not truncated -> a 'head' support of the top
    ``head_size`` full-distribution entries (``head_size=0``: no support recorded). Every
    ``env_every``-th response token is an env token (``loss_mask=False``).
    """
    sampling = sampling or SamplingParams(temperature=1.0, top_p=0.9, top_k=8)
    T = response_len
    logits = rng.normal(size=(T, vocab)) * logit_scale
    ids, lps, spans_ids, spans_lp = [], [], [], []
    mask = np.ones(T, dtype=bool)
    if env_every:
        mask[env_every - 1 :: env_every] = False
    for t in range(T):
        if not mask[t]:
            ids.append(int(rng.integers(vocab)))
            lps.append(0.0)
            spans_ids.append([])
            spans_lp.append([])
            continue
        if sampling.truncated:
            kept, logq = truncated_distribution(logits[t], sampling)
            pick = int(rng.choice(len(kept), p=np.exp(logq) / np.exp(logq).sum()))
            ids.append(int(kept[pick]))
            lps.append(float(np.float32(logq[pick])))
            spans_ids.append(kept.tolist())
            spans_lp.append(logq.tolist())
        else:
            logq = log_softmax(logits[t] / sampling.temperature)
            a = int(rng.choice(vocab, p=np.exp(logq) / np.exp(logq).sum()))
            ids.append(a)
            lps.append(float(np.float32(logq[a])))
            head = np.argsort(-logq, kind="stable")[:head_size]
            spans_ids.append(head.tolist())
            spans_lp.append(logq[head].tolist())
    support = None
    if sampling.truncated:
        support = SamplingSupport.from_lists(spans_ids, spans_lp, kind="kept")
    elif head_size:
        support = SamplingSupport.from_lists(spans_ids, spans_lp, kind="head")
    rollout = Rollout(
        rollout_id=rollout_id or f"r{int(rng.integers(1 << 30))}",
        group_id=group_id,
        prompt_ids=rng.integers(vocab, size=prompt_len).astype(np.int32),
        response_ids=np.asarray(ids, dtype=np.int32),
        loss_mask=mask,
        sampler_logprobs=np.asarray(lps, dtype=np.float32),
        policy_version=np.full(T, version, dtype=np.int32),
        reward=float(rng.integers(2)),
        finish_reason="stop",
        sampling=sampling,
        sampler=sampler_info(pool),
        support=support,
        timings={"generate_s": 0.01},
    )
    return rollout, logits


def random_batch(
    rng: np.random.Generator,
    batch: int = 6,
    vocab: int = 40,
    noise: tuple[float, ...] = (0.0, 0.02, 0.3, 1.0),
    pools: tuple[str, ...] = ("b200-bf16", "mi300x-fp8", "l40s-nvfp4"),
    mixed_kinds: bool = True,
):
    """A collated batch of ragged rollouts plus trainer logits ``[B, L, V]`` (float64).

    Trainer logits = sampler logits + Gaussian noise of a per-row scale drawn from ``noise``, so
    ratios range from exactly 1 to far outside the MIS bounds. Half the rows (when
    ``mixed_kinds``) record a head of the full distribution instead of a kept set.
    """
    rollouts, sampler_logits = [], []
    for b in range(batch):
        head_row = mixed_kinds and b % 2 == 1
        sampling = (SamplingParams(temperature=1.0, top_p=1.0, top_k=0) if head_row
                    else SamplingParams(temperature=float(rng.choice([0.7, 1.0])), top_p=0.9, top_k=int(rng.choice([4, 8]))))
        r, lg = random_rollout(
            rng, vocab=vocab, prompt_len=int(rng.integers(1, 5)), response_len=int(rng.integers(2, 9)),
            sampling=sampling, head_size=int(rng.choice([0, 5])) if head_row else 0,
            env_every=int(rng.choice([0, 3])), pool=pools[b % len(pools)], group_id=f"g{b // 2}",
            rollout_id=f"r{b}",
        )
        rollouts.append(r.validate(vocab))
        sampler_logits.append(lg)
    batch_ = collate(rollouts, length_multiple=4)
    B, L = batch_.target_ids.shape
    logits = rng.normal(size=(B, L, vocab))
    for b, (r, lg) in enumerate(zip(rollouts, sampler_logits)):
        P, T = r.prompt_ids.shape[0], r.response_ids.shape[0]
        scale = float(rng.choice(noise))
        logits[b, P - 1 : P - 1 + T] = lg + scale * rng.normal(size=lg.shape)
    return batch_, logits, rollouts
