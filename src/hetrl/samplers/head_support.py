"""The sampling support of a server token, rebuilt from the log-prob head it returned.

SGLang returns, per generated token ``t``, the sampled id ``a_t`` with its log-prob and the
``H`` most likely tokens with theirs (``top_logprobs_num = H``), all under the full
temperature-scaled distribution ``log π(v) = z_v/T − logsumexp_V z/T``. It does not return the
set it sampled from. Its torch sampler builds that set as hetrl's embedded sampler does
(:mod:`hetrl.samplers.sampling`): sort ``π`` in decreasing order, ``v_1, v_2, ...``, cumulative
mass ``c_i = Σ_{j≤i} π(v_j)``; keep ``v_i`` iff ``i ≤ k`` (``top_k``, 0 = off) and
``c_{i−1} ≤ top_p`` (the mass *before* it, counted over the untruncated distribution). So with a
top-k cap ``k ≤ H`` the kept set is a prefix of the head and is known exactly:

    S_t = {v_1 .. v_n},  n = min(k, #{i ≤ H : c_{i−1} ≤ top_p}),

and with ``top_k = 0`` it is known exactly whenever the head's mass reaches ``top_p`` before its
end (``c_H > top_p``). The sampled token is force-kept (it is in S_t unless the server's
arithmetic differs at a boundary), and q is π renormalized over S_t:

    log q(v) = log π(v) − logsumexp_{u∈S_t} log π(u),   v ∈ S_t,

which is what the trainer's mask replay computes from its own logits over the same S_t
(:func:`hetrl.core.correction.replay_logprobs`). Untruncated sampling (``top_p = 1``, no top-k)
records the head itself (kind ``'head'``, full-distribution log-probs; the tail is handled by
the head/tail approximation of DESIGN §3.5). ``approximate=True`` accepts a top-p set that
runs past the head: the token's support is then recorded as the head, kind ``'head'``, and its
log-prob as the server's full-distribution one (the same approximation, opted into).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hetrl.core.schema import SamplingParams, SamplingSupport

__all__ = ["HeadSupportError", "check_head_params", "support_from_head"]


class HeadSupportError(ValueError):
    """The kept set of a token cannot be rebuilt exactly from the returned head."""


def check_head_params(sampling: SamplingParams, head_size: int, *, approximate: bool = False) -> None:
    """Refuse sampling parameters whose kept sets cannot be rebuilt from a head of
    ``head_size`` tokens: truncated sampling needs a top-k cap ``<= head_size`` (top-p alone
    may need the whole vocabulary), unless ``approximate``."""
    if not sampling.truncated or approximate:
        return
    if sampling.top_k == 0:
        raise HeadSupportError(
            f"top_p={sampling.top_p} without a top-k cap: the kept set may extend past the "
            f"{head_size}-token log-prob head the server returns, so it cannot be rebuilt exactly; set "
            f"top_k <= {head_size} (top_logprobs_num), or opt into the head/tail approximation "
            f"(server.support: head_tail)")
    if sampling.top_k > head_size:
        raise HeadSupportError(f"top_k={sampling.top_k} exceeds the log-prob head the server returns "
                               f"(top_logprobs_num={head_size}); raise top_logprobs_num to at least {sampling.top_k}")


def support_from_head(
    head_ids: Sequence[Sequence[int]],
    head_logprobs: Sequence[Sequence[float]],
    token_ids: np.ndarray,
    token_logprobs: np.ndarray,
    sampling: SamplingParams,
    *,
    approximate: bool = False,
) -> tuple[SamplingSupport, np.ndarray]:
    """``(support, logprobs)`` for T tokens: ``head_ids[t]`` / ``head_logprobs[t]`` the head of
    token t (full-distribution ``log π``, any order), ``token_ids`` [T] the sampled ids,
    ``token_logprobs`` [T] their ``log π``. Returns the per-token supports (CSR) and ``log q(a_t)``
    [T] float32 under the distribution sampled from: kind ``'kept'`` (the rebuilt kept sets, q
    renormalized over them) for truncated sampling with a top-k cap within the head; kind
    ``'head'`` (the heads and ``log π``) for untruncated sampling, and for truncated sampling
    whose sets the head cannot determine when ``approximate`` (otherwise that raises
    :class:`HeadSupportError`, see :func:`check_head_params`)."""
    T = len(token_ids)
    if len(head_ids) != T or len(head_logprobs) != T or len(token_logprobs) != T:
        raise HeadSupportError(f"{T} tokens but {len(head_ids)} heads, {len(head_logprobs)} head log-prob rows "
                               f"and {len(token_logprobs)} token log-probs")
    head_size = min((len(h) for h in head_ids), default=0)
    check_head_params(sampling, head_size, approximate=approximate)
    kept = sampling.truncated and 0 < sampling.top_k <= head_size
    ids_out: list[list[int]] = []
    lp_out: list[list[float]] = []
    logq = np.asarray(token_logprobs, np.float64).copy()
    for t in range(T):
        ids = np.asarray(head_ids[t], np.int64)
        lps = np.asarray(head_logprobs[t], np.float64)
        if ids.shape != lps.shape or ids.ndim != 1 or ids.size == 0:
            raise HeadSupportError(f"token {t}: head ids {ids.shape} and log-probs {lps.shape} must be equal, non-empty 1-D")
        order = np.lexsort((ids, -lps))  # decreasing log-prob, ties by the lower id
        ids, lps = ids[order], lps[order]
        if kept:
            n = sampling.top_k
            if sampling.top_p < 1.0:  # top_p = 1 filters nothing (a rounded mass may exceed 1.0)
                mass_before = np.concatenate([[0.0], np.cumsum(np.exp(lps))[:-1]])
                n = min(n, int((mass_before <= sampling.top_p).sum()))
            ids, lps = ids[:n], lps[:n]
            a = int(token_ids[t])
            if a not in ids:  # force-keep the sampled token (a boundary the server rounded otherwise)
                ids, lps = np.append(ids, a), np.append(lps, logq[t])
            norm = np.logaddexp.reduce(lps)
            lps = lps - norm
            logq[t] -= norm
        ids_out.append(ids.tolist())
        lp_out.append(lps.tolist())
    support = SamplingSupport.from_lists(ids_out, lp_out, kind="kept" if kept else "head")
    return support, logq.astype(np.float32)
