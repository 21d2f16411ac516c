"""The rollout schema shared by every process: samplers write it, the orchestrator moves it,
trainers read it (DESIGN §2).

* :class:`SamplerInfo`, :class:`SamplingParams` -- typed metadata (pydantic).
* :class:`SamplingSupport` -- the per-token kept set S_t as CSR: for response token ``t`` the
  entries ``ids[offsets[t]:offsets[t+1]]`` with log-probs ``logprobs[...]`` under the sampler.
  ``kind="kept"``: S_t is the exact set left after top-k/top-p and ``log q`` is renormalized over
  it (what mask replay needs). ``kind="head"``: sampling was not truncated and S_t is only the
  top-k head of the full distribution (the score-centering tail approximation uses it).
* :class:`Rollout` -- one sampled trajectory (multi-turn included: tool/env tokens sit in the
  response with ``loss_mask=False`` and an empty support span), with :meth:`Rollout.validate`.
* :class:`RolloutBatch` -- rollouts collated by :func:`collate` into padded numpy arrays.

Token alignment in a batch: ``input_ids[b]`` is prompt + response. Every per-token array is
aligned to the *target* position: entry ``j`` describes the token ``input_ids[b, j + 1]``, the
one predicted by the logits at position ``j``. So a trainer computes ``logits = model(input_ids)``
of shape ``[B, L, V]`` and uses ``logits[b, j]`` with ``target_ids[b, j]``, ``loss_mask[b, j]``,
``sampler_logprobs[b, j]`` and ``support_*[b, j, :]`` directly.

Serialization never uses pickle: rollouts travel as msgpack (:func:`encode_rollouts` /
:func:`decode_rollouts`), batches as safetensors (:meth:`RolloutBatch.to_bytes`). Both
round-trip exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal, Sequence

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest value a float32 batch field (reward, temperature) holds: larger ones are refused."""

FinishReason = Literal["stop", "length", "abort", "error"]
SupportKind = Literal["kept", "head"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
SUPPORT_KINDS: tuple[str, ...] = ("kept", "head")

#: Tolerances of the log-prob consistency checks. Samplers compute in fp32 or lower; a kept
#: support whose probabilities do not sum to 1 within LOGPROB_MASS_TOL (in log space) or whose
#: sampled-token log-prob differs from its support entry by more than LOGPROB_MATCH_TOL is
#: inconsistent and rejected.
LOGPROB_MASS_TOL = 1e-3
LOGPROB_MATCH_TOL = 1e-3

#: Support-width buckets used by :func:`collate` so that compiled shapes repeat.
DEFAULT_K_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024)


class RolloutError(ValueError):
    """A rollout failed validation or decoding. ``field`` names the offending field."""

    def __init__(self, rollout_id: str | None, field: str, message: str):
        self.rollout_id = rollout_id
        self.field = field
        self.reason = message
        where = f"rollout {rollout_id!r}" if rollout_id is not None else "rollout"
        super().__init__(f"{where}: field '{field}': {message}")


class SamplerInfo(BaseModel):
    """Which sampler produced a rollout: pool, hardware kind and its numerics, engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str = Field(min_length=1)
    accelerator: str = Field(min_length=1, description="profile kind, e.g. b200, mi300x, tpu-v6e")
    weight_precision: str = Field(min_length=1, description="e.g. bf16, fp8_e4m3, nvfp4")
    kv_precision: str = Field(min_length=1)
    activation_precision: str = Field("none", min_length=1,
                                      description="format of the linear layers' inputs, e.g. fp8_e4m3; none: compute dtype")
    engine: str = Field(min_length=1, description="embedded | sglang | sglang-jax")
    engine_version: str = ""


class SamplingParams(BaseModel):
    """Sampling parameters a rollout was generated with. ``top_k=0`` means no top-k. Every value
    fits the batch's dtype (float32 temperature, int32 top-k), so collating never overflows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, gt=0.0, le=_FLOAT32_MAX, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, le=np.iinfo(np.int32).max)

    @property
    def truncated(self) -> bool:
        """True when top-k or top-p removes part of the vocabulary (mask replay is needed)."""
        return self.top_p < 1.0 or self.top_k > 0


@dataclass(frozen=True, eq=False)
class SamplingSupport:
    """CSR support: ``ids[offsets[t]:offsets[t+1]]`` is S_t for response token ``t``.

    Shapes: ``ids`` [nnz] int, ``offsets`` [T+1] int (``offsets[0] == 0``, non-decreasing,
    ``offsets[-1] == nnz``), ``logprobs`` [nnz] float = log q(v) for v in S_t.
    """

    ids: np.ndarray
    offsets: np.ndarray
    logprobs: np.ndarray
    kind: SupportKind = "kept"

    def __post_init__(self) -> None:
        for name in ("ids", "offsets", "logprobs"):
            object.__setattr__(self, name, np.asarray(getattr(self, name)))

    @classmethod
    def from_lists(
        cls, ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], kind: SupportKind = "kept"
    ) -> "SamplingSupport":
        """Build from one list of ids and one of log-probs per response token."""
        lengths = [len(s) for s in ids]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat_ids = np.asarray([i for s in ids for i in s], dtype=np.int32)
        flat_lp = np.asarray([v for s in logprobs for v in s], dtype=np.float32)
        return cls(ids=flat_ids, offsets=offsets, logprobs=flat_lp, kind=kind)

    def span_lengths(self) -> np.ndarray:
        """``|S_t|`` per response token, shape [T]."""
        return np.diff(self.offsets)


@dataclass(frozen=True, eq=False)
class Rollout:
    """One sampled trajectory. Per response token ``t`` (shape [T] each):

    ``response_ids[t]``; ``loss_mask[t]`` (False for tool/env tokens); ``sampler_logprobs[t]`` =
    log q(a_t) under the distribution really sampled from (after temperature and truncation;
    ignored where ``loss_mask`` is False); ``policy_version[t]`` = weight version that produced
    the token. ``support`` holds S_t and log q over it (see :class:`SamplingSupport`).
    """

    rollout_id: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    sampler_logprobs: np.ndarray
    policy_version: np.ndarray
    reward: float
    finish_reason: FinishReason
    sampling: SamplingParams
    sampler: SamplerInfo
    support: SamplingSupport | None = None
    timings: dict[str, float] = field(default_factory=dict)

    _ARRAYS = ("prompt_ids", "response_ids", "loss_mask", "sampler_logprobs", "policy_version")

    def __post_init__(self) -> None:
        for name in self._ARRAYS:
            object.__setattr__(self, name, np.asarray(getattr(self, name)))

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int | None = None, max_length: int | None = None,
                 max_version: int | None = None) -> "Rollout":
        """Check every invariant of DESIGN §2; raise :class:`RolloutError` naming the field.

        Returns ``self`` so it can be chained. ``vocab_size`` enables the id-range checks,
        ``max_length`` bounds prompt + response length and ``max_version`` (the latest published
        weight version) bounds ``policy_version``: a newer one was never published.
        """
        rid = self.rollout_id if isinstance(self.rollout_id, str) else None

        def fail(name: str, message: str) -> None:
            raise RolloutError(rid, name, message)

        for name in ("rollout_id", "group_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                fail(name, f"must be a non-empty string, got {value!r}")
        if not isinstance(self.sampling, SamplingParams):
            fail("sampling", f"must be SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.sampler, SamplerInfo):
            fail("sampler", f"must be SamplerInfo, got {type(self.sampler).__name__}")
        if self.finish_reason not in FINISH_REASONS:
            fail("finish_reason", f"must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if (isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward)
                or abs(self.reward) > _FLOAT32_MAX):
            fail("reward", f"must be a finite number within float32 range (batches hold it as float32), "
                           f"got {self.reward!r}")
        if not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in self.timings.items()):
            fail("timings", "must map strings to numbers")

        _check_ids(fail, "prompt_ids", self.prompt_ids, vocab_size, min_len=1)
        _check_ids(fail, "response_ids", self.response_ids, vocab_size, min_len=1)
        T = self.response_ids.shape[0]
        if max_length is not None and self.prompt_ids.shape[0] + T > max_length:
            fail("response_ids", f"prompt + response length {self.prompt_ids.shape[0] + T} exceeds {max_length}")

        mask = self.loss_mask
        if mask.dtype != np.bool_:
            fail("loss_mask", f"must be a bool array, got dtype {mask.dtype}")
        _check_shape(fail, "loss_mask", mask, (T,))

        lp = self.sampler_logprobs
        if lp.dtype.kind != "f":
            fail("sampler_logprobs", f"must be a float array, got dtype {lp.dtype}")
        _check_shape(fail, "sampler_logprobs", lp, (T,))
        bad = np.flatnonzero(~np.isfinite(lp))
        if bad.size:
            fail("sampler_logprobs", f"non-finite value {lp[bad[0]]} at token {bad[0]}")
        bad = np.flatnonzero(mask & (lp > LOGPROB_MASS_TOL))
        if bad.size:
            fail("sampler_logprobs", f"log-prob {lp[bad[0]]} > 0 at token {bad[0]}")

        ver = self.policy_version
        if ver.dtype.kind not in "iu":
            fail("policy_version", f"must be an integer array, got dtype {ver.dtype}")
        _check_shape(fail, "policy_version", ver, (T,))
        trained_versions = ver[mask]
        if trained_versions.size and trained_versions.min() < 0:
            fail("policy_version", "negative version on a trainable token")
        if trained_versions.size > 1 and np.any(np.diff(trained_versions) < 0):
            fail("policy_version", "versions decrease along the response")
        if max_version is not None and ver.size and ver.max() > max_version:
            fail("policy_version", f"version {ver.max()} was never published (the latest is {max_version})")

        if self.support is None:
            if self.sampling.truncated:
                fail("support", "sampling truncates the vocabulary (top_p < 1 or top_k > 0) but no support was recorded")
        else:
            _check_support(fail, self, vocab_size)
        return self

    def version_span(self) -> tuple[int, int]:
        """``(oldest, newest)`` ``policy_version`` of the trainable tokens (of all tokens when
        none is trainable): what staleness is measured on."""
        v = self.policy_version[self.loss_mask] if np.any(self.loss_mask) else self.policy_version
        return int(v.min()), int(v.max())

    # ------------------------------------------------------------------ plain-data form
    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, numbers, dicts, numpy arrays) for serialization."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sampling"] = self.sampling.model_dump()
        out["sampler"] = self.sampler.model_dump()
        out["timings"] = dict(self.timings)
        if self.support is not None:
            s = self.support
            out["support"] = {"ids": s.ids, "offsets": s.offsets, "logprobs": s.logprobs, "kind": s.kind}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Rollout":
        """Inverse of :meth:`to_dict`; raises :class:`RolloutError` naming a missing/bad field.

        Structure only: call :meth:`validate` for the semantic checks.
        """
        if not isinstance(data, dict):
            raise RolloutError(None, "<root>", f"must be a map, got {type(data).__name__}")
        rid = data.get("rollout_id") if isinstance(data.get("rollout_id"), str) else None
        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        unknown = sorted(set(map(str, data)) - names)
        if unknown:
            raise RolloutError(rid, unknown[0], "unknown field")
        missing = [name for name in required if name not in data]
        if missing:
            raise RolloutError(rid, missing[0], "missing")
        kwargs = dict(data)
        for name, model in (("sampling", SamplingParams), ("sampler", SamplerInfo)):
            try:
                kwargs[name] = model.model_validate(data[name])
            except ValidationError as err:
                first = err.errors()[0]
                loc = ".".join(str(p) for p in first["loc"])
                raise RolloutError(rid, f"{name}.{loc}" if loc else name, first["msg"]) from None
        for name in cls._ARRAYS:
            _require_array(rid, name, data[name])
        sup = data.get("support")
        if sup is not None:
            if not isinstance(sup, dict) or set(sup) != {"ids", "offsets", "logprobs", "kind"}:
                raise RolloutError(rid, "support", "must be a map with ids, offsets, logprobs, kind")
            for key in ("ids", "offsets", "logprobs"):
                _require_array(rid, f"support.{key}", sup[key])
            if sup["kind"] not in SUPPORT_KINDS:
                raise RolloutError(rid, "support.kind", f"must be one of {SUPPORT_KINDS}, got {sup['kind']!r}")
            kwargs["support"] = SamplingSupport(**sup)
        timings = data.get("timings", {})
        if not isinstance(timings, dict):
            raise RolloutError(rid, "timings", "must be a map")
        kwargs["timings"] = timings
        return cls(**kwargs)


def _require_array(rid: str | None, name: str, value: Any) -> None:
    """Raise :class:`RolloutError` naming ``name`` unless ``value`` is a decoded array."""
    if isinstance(value, _MalformedArray):
        raise RolloutError(rid, name, f"malformed array record: {value.reason}")
    if not isinstance(value, np.ndarray):
        raise RolloutError(rid, name, f"must be an array, got {type(value).__name__}")


def _check_shape(fail, name: str, arr: np.ndarray, shape: tuple[int, ...]) -> None:
    if arr.shape != shape:
        fail(name, f"shape {arr.shape} does not match the response length (expected {shape})")


def _check_ids(fail, name: str, ids: np.ndarray, vocab_size: int | None, min_len: int = 0) -> None:
    if ids.dtype.kind not in "iu":
        fail(name, f"must be an integer array, got dtype {ids.dtype}")
    if ids.ndim != 1:
        fail(name, f"must be 1-D, got shape {ids.shape}")
    if ids.shape[0] < min_len:
        fail(name, f"must hold at least {min_len} token(s)")
    if ids.size and ids.min() < 0:
        fail(name, f"negative token id {ids.min()}")
    if vocab_size is not None and ids.size and ids.max() >= vocab_size:
        fail(name, f"token id {ids.max()} outside the vocabulary of size {vocab_size}")


def _check_support(fail, rollout: Rollout, vocab_size: int | None) -> None:
    s = rollout.support
    T = rollout.response_ids.shape[0]
    if s.kind not in SUPPORT_KINDS:
        fail("support.kind", f"must be one of {SUPPORT_KINDS}, got {s.kind!r}")
    if rollout.sampling.truncated and s.kind != "kept":
        fail("support.kind", "sampling truncates the vocabulary, so the support must be the kept set ('kept')")
    off = s.offsets
    if off.dtype.kind not in "iu" or off.ndim != 1:
        fail("support.offsets", f"must be a 1-D integer array, got dtype {off.dtype} shape {off.shape}")
    if off.shape[0] != T + 1:
        fail("support.offsets", f"length {off.shape[0]} must be response length + 1 = {T + 1}")
    if off[0] != 0:
        fail("support.offsets", f"must start at 0, got {off[0]}")
    steps = np.diff(off.astype(np.int64))
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        t = bad[0]
        fail("support.offsets", f"unsorted/overlapping spans: offsets[{t}]={off[t]} > offsets[{t + 1}]={off[t + 1]}")
    _check_ids(fail, "support.ids", s.ids, vocab_size)
    nnz = s.ids.shape[0]
    if off[-1] != nnz:
        fail("support.offsets", f"last offset {off[-1]} must equal the number of support ids {nnz}")
    lp = s.logprobs
    if lp.dtype.kind != "f" or lp.shape != (nnz,):
        fail("support.logprobs", f"must be a float array of shape ({nnz},), got dtype {lp.dtype} shape {lp.shape}")
    bad = np.flatnonzero(~np.isfinite(lp))
    if bad.size:
        fail("support.logprobs", f"non-finite value {lp[bad[0]]} at entry {bad[0]}")
    if nnz and lp.max() > LOGPROB_MASS_TOL:
        fail("support.logprobs", f"log-prob {lp.max()} > 0")

    mask = rollout.loss_mask
    bad = np.flatnonzero(~mask & (steps > 0))
    if bad.size:
        fail("support.offsets", f"non-trainable token {bad[0]} must have an empty support span")
    if s.kind == "kept":
        bad = np.flatnonzero(mask & (steps == 0))
        if bad.size:
            fail("support.offsets", f"trainable token {bad[0]} has an empty kept support")
    if rollout.sampling.top_k > 0 and steps.size and steps.max() > rollout.sampling.top_k:
        t = int(np.argmax(steps))
        fail("support.offsets", f"span of token {t} holds {steps[t]} ids, more than top_k={rollout.sampling.top_k}")
    if nnz == 0:
        return

    span = np.repeat(np.arange(T), steps)  # [nnz]: which token each entry belongs to
    ids = s.ids.astype(np.int64)
    order = np.lexsort((ids, span))
    dup = (span[order][1:] == span[order][:-1]) & (ids[order][1:] == ids[order][:-1])
    if np.any(dup):
        t = span[order][1:][np.argmax(dup)]
        fail("support.ids", f"duplicate id in the span of token {t}")

    lp64 = lp.astype(np.float64)
    peak = np.full(T, -np.inf)
    np.maximum.at(peak, span, lp64)
    total = np.zeros(T)
    np.add.at(total, span, np.exp(lp64 - peak[span]))
    with np.errstate(divide="ignore"):
        mass = np.where(steps > 0, np.log(np.where(steps > 0, total, 1.0)) + np.where(steps > 0, peak, 0.0), -np.inf)
    if s.kind == "kept":
        bad = np.flatnonzero(mask & (np.abs(mass) > LOGPROB_MASS_TOL))
        what = "kept support probabilities must sum to 1"
    else:
        bad = np.flatnonzero(mask & (mass > LOGPROB_MASS_TOL))
        what = "head probabilities must sum to at most 1"
    if bad.size:
        t = bad[0]
        fail("support.logprobs", f"{what}; token {t} sums to {math.exp(mass[t]):.6f}")

    is_sampled = ids == rollout.response_ids.astype(np.int64)[span]
    contains = np.bincount(span[is_sampled], minlength=T) > 0
    if s.kind == "kept":
        bad = np.flatnonzero(mask & ~contains)
        if bad.size:
            t = bad[0]
            fail("support.ids", f"kept support of token {t} does not contain the sampled token {rollout.response_ids[t]}")
    sampled_lp = np.zeros(T, dtype=np.float64)
    sampled_lp[span[is_sampled]] = lp[is_sampled]
    gap = np.abs(sampled_lp - rollout.sampler_logprobs.astype(np.float64))
    bad = np.flatnonzero(mask & contains & (gap > LOGPROB_MATCH_TOL))
    if bad.size:
        t = bad[0]
        fail("sampler_logprobs", f"token {t}: sampler log-prob {rollout.sampler_logprobs[t]} disagrees with its support entry {sampled_lp[t]}")


# ====================================================================== serialization (msgpack)
_WIRE_DTYPES = {
    "bool": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32,
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
}
_ARRAY_TAG = "__ndarray__"
WIRE_VERSION = 1


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        name = obj.dtype.name
        if name not in _WIRE_DTYPES:
            raise TypeError(f"array dtype {name} cannot be serialized (allowed: {sorted(_WIRE_DTYPES)})")
        return {_ARRAY_TAG: [name, list(obj.shape), np.ascontiguousarray(obj).astype(obj.dtype.newbyteorder("<")).tobytes()]}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


@dataclass(frozen=True)
class _MalformedArray:
    """What the decoder leaves in place of an array record it cannot decode, so that the field
    holding it is named when the rollout is rejected (and the other rollouts survive)."""

    reason: str


def _unpack_hook(obj: dict) -> Any:
    if _ARRAY_TAG not in obj:
        return obj
    spec = obj[_ARRAY_TAG]
    if len(obj) != 1 or not isinstance(spec, list) or len(spec) != 3:
        return _MalformedArray("expected [dtype, shape, bytes]")
    name, shape, data = spec
    if not isinstance(name, str) or name not in _WIRE_DTYPES:
        return _MalformedArray(f"array dtype {name!r} not allowed (allowed: {sorted(_WIRE_DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) or not isinstance(data, bytes):
        return _MalformedArray("shape must be a list of sizes >= 0 and data must be bytes")
    dtype = np.dtype(_WIRE_DTYPES[name]).newbyteorder("<")
    if math.prod(shape) * dtype.itemsize != len(data):
        return _MalformedArray(f"shape {shape} and dtype {name} need {math.prod(shape) * dtype.itemsize} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def encode_rollouts(rollouts: Sequence[Rollout]) -> bytes:
    """msgpack bytes for a list of rollouts (arrays as little-endian raw buffers; no pickle)."""
    payload = {"hetrl_rollouts": WIRE_VERSION, "rollouts": [r.to_dict() for r in rollouts]}
    return msgpack.packb(payload, default=_pack_default, use_bin_type=True)


def decode_rollouts(data: bytes, vocab_size: int | None = None, validate: bool = True) -> list[Rollout]:
    """Inverse of :func:`encode_rollouts`. Raises :class:`RolloutError` on malformed input.

    With ``validate=True`` each rollout is also checked by :meth:`Rollout.validate`. To keep
    the valid rollouts of a partly malformed message, use :func:`decode_rollouts_lenient`.
    """
    rollouts, errors = decode_rollouts_lenient(data, vocab_size=vocab_size, validate=validate)
    if errors:
        raise errors[0]
    return rollouts


def decode_rollouts_lenient(
    data: bytes, vocab_size: int | None = None, validate: bool = True
) -> tuple[list[Rollout], list[RolloutError]]:
    """Decode what is well-formed; return ``(rollouts, errors)`` with one error per rejected one."""
    try:
        payload = msgpack.unpackb(data, object_hook=_unpack_hook, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated exception types on garbage
        return [], [RolloutError(None, "<message>", f"not a valid msgpack rollout message: {err}")]
    if not isinstance(payload, dict) or payload.get("hetrl_rollouts") != WIRE_VERSION or not isinstance(payload.get("rollouts"), list):
        return [], [RolloutError(None, "<message>", f"not a hetrl rollout message of wire version {WIRE_VERSION}")]
    rollouts: list[Rollout] = []
    errors: list[RolloutError] = []
    for item in payload["rollouts"]:
        try:
            r = Rollout.from_dict(item)
            rollouts.append(r.validate(vocab_size) if validate else r)
        except RolloutError as err:
            errors.append(err)
    return rollouts, errors


# ====================================================================== the batch
@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """Rollouts collated into padded numpy arrays, target-aligned (see the module docstring).

    Shapes: ``[B, L]`` for ``input_ids``, ``attention_mask``, ``target_ids``, ``loss_mask``,
    ``sampler_logprobs``, ``policy_version`` (-1 off the response); ``[B, L, K]`` for
    ``support_ids``, ``support_mask``, ``support_logprobs``; ``[B]`` for the per-rollout fields.
    ``support_kept[b]`` is True when row b's support is the exact kept set (replayable) and
    False when it is a head of the full distribution (possibly empty).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    target_ids: np.ndarray
    loss_mask: np.ndarray
    sampler_logprobs: np.ndarray
    policy_version: np.ndarray
    support_ids: np.ndarray
    support_mask: np.ndarray
    support_logprobs: np.ndarray
    support_kept: np.ndarray
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    reward: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    group_index: np.ndarray
    pool_index: np.ndarray
    rollout_ids: tuple[str, ...]
    group_ids: tuple[str, ...]
    pool_names: tuple[str, ...]

    _META = ("rollout_ids", "group_ids", "pool_names")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self._META}

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def select(self, rows: np.ndarray) -> "RolloutBatch":
        """The batch of rows ``rows`` (indices, in that order). ``group_index``, ``pool_index``,
        ``group_ids`` and ``pool_names`` keep referring to the whole batch's groups and pools."""
        rows = np.asarray(rows, np.int64)
        return replace(self, **{k: v[rows] for k, v in self.arrays.items()},
                       rollout_ids=tuple(self.rollout_ids[i] for i in rows))

    def to_bytes(self) -> bytes:
        """safetensors bytes (arrays as tensors, names in the JSON metadata); no pickle."""
        from safetensors.numpy import save

        meta = {"hetrl_batch": str(WIRE_VERSION), **{k: json.dumps(list(getattr(self, k))) for k in self._META}}
        return save({k: np.ascontiguousarray(v) for k, v in self.arrays.items()}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> "RolloutBatch":
        """Inverse of :meth:`to_bytes`."""
        from safetensors.numpy import load

        arrays = load(data)
        meta = _safetensors_metadata(data)
        if meta.get("hetrl_batch") != str(WIRE_VERSION):
            raise ValueError("not a hetrl RolloutBatch (missing or wrong 'hetrl_batch' metadata)")
        expected = {f.name for f in fields(cls)} - set(cls._META)
        if set(arrays) != expected:
            raise ValueError(f"RolloutBatch arrays differ from the schema: {sorted(set(arrays) ^ expected)}")
        return cls(**arrays, **{k: tuple(json.loads(meta[k])) for k in cls._META})


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {})


def _bucket(value: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"support width {value} exceeds the largest bucket {buckets[-1]}")


def collate(
    rollouts: Sequence[Rollout],
    *,
    pad_id: int = 0,
    length_multiple: int = 16,
    k_buckets: Sequence[int] = DEFAULT_K_BUCKETS,
    pool_names: Sequence[str] | None = None,
) -> RolloutBatch:
    """Pack validated rollouts into a :class:`RolloutBatch`.

    ``L`` = longest prompt + response, rounded up to ``length_multiple``; ``K`` = widest support
    span rounded up to the next of ``k_buckets`` (so compiled shapes repeat). Groups are indexed
    in order of first appearance. ``pool_names`` fixes the pool index order (e.g. the fleet's);
    by default pools are indexed in order of first appearance.
    """
    if not rollouts:
        raise ValueError("collate needs at least one rollout")
    B = len(rollouts)
    total = [r.prompt_ids.shape[0] + r.response_ids.shape[0] for r in rollouts]
    L = -(-max(total) // length_multiple) * length_multiple
    widest = max((int(r.support.span_lengths().max(initial=0)) if r.support is not None else 0) for r in rollouts)
    K = _bucket(max(widest, 1), k_buckets)

    input_ids = np.full((B, L), pad_id, dtype=np.int32)
    attention_mask = np.zeros((B, L), dtype=bool)
    target_ids = np.full((B, L), pad_id, dtype=np.int32)
    loss_mask = np.zeros((B, L), dtype=bool)
    sampler_logprobs = np.zeros((B, L), dtype=np.float32)
    policy_version = np.full((B, L), -1, dtype=np.int32)
    support_ids = np.zeros((B, L, K), dtype=np.int32)
    support_mask = np.zeros((B, L, K), dtype=bool)
    support_logprobs = np.zeros((B, L, K), dtype=np.float32)
    support_kept = np.zeros(B, dtype=bool)

    group_order: dict[str, int] = {}
    pools = list(pool_names) if pool_names is not None else []
    pool_order = {name: i for i, name in enumerate(pools)}
    group_index = np.zeros(B, dtype=np.int32)
    pool_index = np.zeros(B, dtype=np.int32)

    for b, r in enumerate(rollouts):
        P, T = r.prompt_ids.shape[0], r.response_ids.shape[0]
        input_ids[b, :P] = r.prompt_ids
        input_ids[b, P : P + T] = r.response_ids
        attention_mask[b, : P + T] = True
        # target position j describes input token j+1: response token t sits at j = P - 1 + t.
        target_ids[b, : P + T - 1] = input_ids[b, 1 : P + T]
        sl = slice(P - 1, P - 1 + T)
        loss_mask[b, sl] = r.loss_mask
        sampler_logprobs[b, sl] = np.where(r.loss_mask, r.sampler_logprobs, 0.0)
        policy_version[b, sl] = r.policy_version
        if r.support is not None:
            s = r.support
            steps = s.span_lengths()
            span = np.repeat(np.arange(T), steps)
            slot = np.arange(s.ids.shape[0]) - s.offsets[:-1][span]
            support_ids[b, P - 1 + span, slot] = s.ids
            support_mask[b, P - 1 + span, slot] = True
            support_logprobs[b, P - 1 + span, slot] = s.logprobs
            support_kept[b] = s.kind == "kept"
        group_index[b] = group_order.setdefault(r.group_id, len(group_order))
        if r.sampler.pool not in pool_order:
            if pool_names is not None:
                raise ValueError(f"rollout {r.rollout_id!r}: pool {r.sampler.pool!r} is not in pool_names {tuple(pools)}")
            pool_order[r.sampler.pool] = len(pools)
            pools.append(r.sampler.pool)
        pool_index[b] = pool_order[r.sampler.pool]

    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        target_ids=target_ids,
        loss_mask=loss_mask,
        sampler_logprobs=sampler_logprobs,
        policy_version=policy_version,
        support_ids=support_ids,
        support_mask=support_mask,
        support_logprobs=support_logprobs,
        support_kept=support_kept,
        prompt_lengths=np.asarray([r.prompt_ids.shape[0] for r in rollouts], dtype=np.int32),
        response_lengths=np.asarray([r.response_ids.shape[0] for r in rollouts], dtype=np.int32),
        reward=np.asarray([r.reward for r in rollouts], dtype=np.float32),
        temperature=np.asarray([r.sampling.temperature for r in rollouts], dtype=np.float32),
        top_p=np.asarray([r.sampling.top_p for r in rollouts], dtype=np.float32),
        top_k=np.asarray([r.sampling.top_k for r in rollouts], dtype=np.int32),
        group_index=group_index,
        pool_index=pool_index,
        rollout_ids=tuple(r.rollout_id for r in rollouts),
        group_ids=tuple(group_order),
        pool_names=tuple(pools),
    )
