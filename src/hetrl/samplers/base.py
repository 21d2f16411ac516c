"""The sampler interface every pool implements (embedded JAX engine, SGLang, sglang-jax).

A sampler turns :class:`GenerationRequest` s into :class:`Generation` s: one turn of sampled
tokens with everything the correction needs per token (the sampler's log-prob under the
distribution it really sampled from, the kept support with its log-probs, the weight version).
Multi-turn episodes are assembled into :class:`hetrl.core.schema.Rollout` s by the orchestrator,
which appends environment tokens between turns. Weights arrive in HF naming
(``dict[str, np.ndarray]``, see :mod:`hetrl.models.hf_io`) with a version stamp.

Optional capabilities are named, never probed with ``getattr``: a sampler that can restart its
random stream has the :class:`Reseedable` capability (``supports_reseed`` true, ``reseed``
works); one that can cancel the calls it is running has the :class:`Abortable` capability
(``supports_abort`` true, ``abort`` works). A wrapper forwards each from the sampler it wraps,
and one that lacks it says so (``supports_*`` false; the method raises
:class:`CapabilityMissing`). Test with :func:`can_reseed` / :func:`can_abort`; call through
:func:`reseed` / :func:`abort`, which raise :class:`CapabilityMissing` naming the sampler.
``weight_update: abort`` aborts the calls in flight on every replica that can abort when new
weights are published (:mod:`hetrl.orchestrator.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from hetrl.core.schema import FinishReason, SamplerInfo, SamplingParams, SamplingSupport


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue. ``prompt_ids`` [P] int32 (the whole context so far)."""

    request_id: str
    prompt_ids: np.ndarray
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()


def check_request(r: GenerationRequest, vocab_size: int, max_length: int) -> None:
    """Refuse a request no model of ``vocab_size`` tokens and ``max_length`` positions can
    serve: prompt ids not a non-empty 1-D integer array, ids outside ``[0, vocab_size)``,
    ``max_new_tokens < 1``, or prompt + new tokens past ``max_length``. Raises ValueError
    naming the request."""
    ids = np.asarray(r.prompt_ids)
    where = f"request {r.request_id!r}"
    if ids.ndim != 1 or ids.shape[0] == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"{where}: prompt_ids must be a non-empty 1-D integer array, got dtype {ids.dtype} shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{where}: prompt token ids must lie in [0, {vocab_size})")
    if r.max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
    if ids.shape[0] + r.max_new_tokens > max_length:
        raise ValueError(f"{where}: prompt ({ids.shape[0]}) + max_new_tokens ({r.max_new_tokens}) exceeds "
                         f"max_position_embeddings={max_length}")


@dataclass(frozen=True, eq=False)
class Generation:
    """One sampled continuation. Per new token t (shape [T] each): ``token_ids``,
    ``logprobs`` = log q(a_t), ``policy_version``; ``support`` = S_t (CSR, kind 'kept' when
    sampling truncates, 'head' of the full distribution otherwise, or None)."""

    request_id: str
    token_ids: np.ndarray
    logprobs: np.ndarray
    policy_version: np.ndarray
    finish_reason: FinishReason
    support: SamplingSupport | None
    sampler: SamplerInfo
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SamplerHealth:
    healthy: bool
    weight_version: int
    in_flight: int = 0
    detail: str = ""


@runtime_checkable
class Sampler(Protocol):
    """What the orchestrator needs from a pool replica."""

    @property
    def info(self) -> SamplerInfo: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request to completion (stop token or ``max_new_tokens``)."""
        ...

    def update_weights(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Load HF-named weights and stamp later tokens with ``version``."""
        ...

    def health(self) -> SamplerHealth: ...


class CapabilityMissing(RuntimeError):
    """A sampler was asked for an optional capability it does not have."""


@runtime_checkable
class Reseedable(Protocol):
    """The optional capability of restarting a sampler's random stream: after ``reseed(s)``
    the same requests in the same calls draw the same noise (common random numbers; the
    lockstep schedule's exact resume). ``supports_reseed`` says whether ``reseed`` works (a
    wrapper around a sampler without it: false, and ``reseed`` raises
    :class:`CapabilityMissing`)."""

    @property
    def supports_reseed(self) -> bool: ...

    def reseed(self, seed: int) -> None: ...


def can_reseed(sampler: object) -> bool:
    """Whether ``sampler`` has the :class:`Reseedable` capability."""
    return isinstance(sampler, Reseedable) and bool(sampler.supports_reseed)


def reseed(sampler: Sampler, seed: int) -> None:
    """``sampler.reseed(seed)``, or :class:`CapabilityMissing` naming the sampler when it cannot."""
    if not can_reseed(sampler):
        raise CapabilityMissing(f"the {type(sampler).__name__} sampler of pool {sampler.info.pool!r} "
                                f"({sampler.info.engine}) cannot reseed its random stream")
    sampler.reseed(seed)  # type: ignore[attr-defined]


@runtime_checkable
class Abortable(Protocol):
    """The optional capability of cancelling generation: ``abort()`` makes every ``generate``
    call running when it is called return as soon as it can (the embedded engine: at its next
    abort check, a few decode steps later), each request not yet finished returned with
    ``finish_reason="abort"`` and the tokens it sampled so far (at least one; all with their log-probs, support and version, as for
    a finished request). Requests already finished keep their reason; calls that start after
    ``abort()`` are not affected, and with no call running it does nothing. Thread-safe: it is
    called from another thread than the one inside ``generate``. ``supports_abort`` says whether
    ``abort`` works (a wrapper around a sampler without it: false, and ``abort`` raises
    :class:`CapabilityMissing`)."""

    @property
    def supports_abort(self) -> bool: ...

    def abort(self) -> None: ...


def can_abort(sampler: object) -> bool:
    """Whether ``sampler`` has the :class:`Abortable` capability."""
    return isinstance(sampler, Abortable) and bool(sampler.supports_abort)


def abort(sampler: Sampler) -> None:
    """``sampler.abort()``, or :class:`CapabilityMissing` naming the sampler when it cannot."""
    if not can_abort(sampler):
        raise CapabilityMissing(f"the {type(sampler).__name__} sampler of pool {sampler.info.pool!r} "
                                f"({sampler.info.engine}) cannot abort its calls")
    sampler.abort()  # type: ignore[attr-defined]
