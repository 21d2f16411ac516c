"""The embedded sampler: an in-process JAX inference engine with an accelerator profile.

:class:`EmbeddedSampler` implements :class:`hetrl.samplers.base.Sampler`. It runs the real
Qwen model (:mod:`hetrl.models.qwen_jax`) with a pool's numerics (:mod:`hetrl.samplers.profiles`),
so its mismatch with the trainer is computed, never injected:

* **weights**: every linear projection of the decoder layers (``q/k/v/o_proj``,
  ``gate/up/down_proj``; HF layout ``[out, in]``) is rounded with
  :func:`hetrl.core.precision.quantize_dequantize` to the pool's weight format (per output
  channel / 16- or 32-element blocks along ``in``); embeddings, norms, biases and the LM head
  stay in the profile's compute dtype, as quantized serving checkpoints keep them. This is
  applied at load and at every :meth:`EmbeddedSampler.update_weights`.
* **weight updates** happen in place: :func:`stage_parameters` turns HF weights straight into
  the parameter arrays of the model the sampler built once (:func:`parameter_layout`: which
  array each HF tensor becomes, transposed or not), so an update swaps arrays of identical
  shapes, dtypes and placement: no model is rebuilt and the compiled generate function is reused.
  Given a :class:`hetrl.samplers.weight_set.WeightSet`, the arrays of one weight format are staged
  once per version and shared by every replica of that format (:func:`staged_parameters`).
* **compute**: the model's ``Numerics`` come from :meth:`SamplerNumerics.model_numerics`
  (compute / accumulation / softmax dtypes, KV-cache format applied on every cache write, split-K
  chunking); the parameters are stored in the compute dtype.

One :meth:`EmbeddedSampler.generate` call is split into chunks of at most ``max_batch``
requests; each chunk runs as a few compiled programs (:func:`_generate_chunk`):

1. **prefill** (:func:`_prefill`): prompts are left-padded to a bucketed length ``P`` (row b's
   real tokens sit at slots ``[P − P_b, P)``), with per-row positions ``0 .. P_b − 1`` and an
   attention mask over key slots that hides the padding, ``N`` being the bucketed
   ``max_new_tokens``. The LM head runs on the hidden state at slot ``P − 1`` only; its logits
   give the first token.
2. **decode** (:func:`_decode`): ``jax.lax.while_loop`` s over steps ``n = 1 .. N − 1`` feed
   token ``n − 1`` at slot ``P + n − 1`` (position ``P_b + n − 1``) through the KV-cached model
   and sample token ``n`` (:func:`hetrl.samplers.sampling.sample`, its Gumbel noise drawn for
   every step in the prefill); they exit early once every row is done. A row is done after a
   stop token (``finish_reason="stop"``; the stop token is part of the response) or after its
   own ``max_new_tokens`` (``"length"``). The steps run in a few runs (:func:`_decode_runs`):
   between two, every ``N // ABORT_CHECKS`` steps, the host checks whether the call was aborted
   (:meth:`EmbeddedSampler.abort`); if so it stops, and the rows not yet done end with
   ``finish_reason="abort"`` and the tokens sampled so far (the
   :class:`hetrl.samplers.base.Abortable` capability). Attention reads every slot of the cache,
   so the cache holds ``P + N // 2`` slots for steps ``n <= N // 2`` and is grown (one copy,
   :func:`_grow`) to ``P + N`` for the rest (:func:`_decode_segments`): one program per cache
   size. No program calls back into Python, so JAX's persistent compilation cache keeps them
   across processes (a restarted run, a test suite's many runs) when it is enabled.

Compiled shapes repeat: batch sizes, prompt lengths and new-token counts are rounded up to
fixed buckets (powers of two), padding rows are dummies that finish at once, and the jit cache is
shared by every sampler with the same model structure and numerics. Per token it records the
sampled id, log q(a_t), the support (kind ``'kept'`` for truncated sampling, ``'head'`` of the
full distribution otherwise; see :mod:`hetrl.samplers.sampling` for the cap semantics) and the
policy version. Draws are deterministic given ``seed``: each call splits the sampler's PRNG key,
and row b's draw at step n depends only on (call key, chunk, b, n).
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetrl.core.precision import quantize_dequantize
from hetrl.core.schema import SamplerInfo, SamplingSupport
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import check_state_dict, load_state_dict
from hetrl.models.qwen_jax import KVCache, QwenModel, grow_cache, hf_parameters, init_cache
from hetrl.samplers.base import Generation, GenerationRequest, SamplerHealth, check_request
from hetrl.samplers.profiles import SamplerNumerics
from hetrl.samplers.sampling import DEFAULT_SUPPORT_CAP, check_params, draw_noise, row_keys, sample
from hetrl.samplers.weight_set import WeightSet

__all__ = ["EmbeddedSampler", "quantize_weights", "QUANTIZED_WEIGHT", "DEFAULT_LENGTH_BUCKETS", "DEFAULT_BATCH_BUCKETS",
           "ParameterLayout", "parameter_layout", "stage_parameters", "staged_parameters", "staging_key", "storage_format",
           "compiled_programs"]

QUANTIZED_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
"""HF names of the tensors stored in the pool's weight format (the rest: compute dtype)."""

DEFAULT_LENGTH_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

ABORT_CHECKS = 4
"""How often a call of ``N`` new tokens checks its abort flag: every ``max(1, N // ABORT_CHECKS)``
decode steps. Each check ends a decode run (a host round trip and a program launch, costly next
to a small model's decode step), so a call checks a few times rather than at every step."""

_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def storage_format(name: str, numerics: SamplerNumerics) -> str:
    """The format the pool stores HF tensor ``name`` in: ``numerics.weight_format`` for
    :data:`QUANTIZED_WEIGHT` tensors, the compute dtype (``param_format``) for every other one."""
    return numerics.weight_format if QUANTIZED_WEIGHT.fullmatch(name) else numerics.param_format


def quantize_weights(state: Mapping[str, np.ndarray], numerics: SamplerNumerics) -> dict[str, np.ndarray]:
    """HF state dict as the pool stores it: every tensor rounded to its :func:`storage_format`
    (float32 arrays out)."""
    return {name: quantize_dequantize(np.asarray(value, dtype=np.float32), storage_format(name, numerics))
            for name, value in state.items()}


@dataclass(frozen=True)
class ParameterLayout:
    """Where HF tensors go among the parameter arrays of a :class:`QwenModel` flattened as
    ``jax.tree.flatten(nnx.split(model)[1])``: ``entries`` holds ``(hf name, array index,
    transposed)`` (HF ``[out, in]`` kernels are stored ``[in, out]``); ``treedef`` the flattening's
    structure."""

    entries: tuple[tuple[str, int, bool], ...]
    treedef: Any


@functools.lru_cache(maxsize=None)
def parameter_layout(config: ModelConfig, param_format: str) -> ParameterLayout:
    """The :class:`ParameterLayout` of ``config``'s model with parameters in ``param_format``
    (built abstractly, nothing computed; cached)."""
    model = nnx.eval_shape(lambda: QwenModel(config, rngs=nnx.Rngs(0), param_dtype=_DTYPES[param_format]))
    leaves, treedef = jax.tree.flatten(nnx.split(model)[1])
    index = {id(leaf): i for i, leaf in enumerate(leaves)}
    entries = tuple((name, index[id(param.get_value())], transposed)
                    for name, (param, transposed) in hf_parameters(model).items())
    if sorted(i for _, i, _ in entries) != list(range(len(leaves))):
        raise RuntimeError("the model has parameter arrays that no HF tensor fills")
    return ParameterLayout(entries, treedef)


@functools.partial(jax.jit, static_argnames=("transposed", "dtype"))
def _to_parameter(value, *, transposed: bool, dtype):
    """One HF tensor (float32, already rounded to its storage format) as a parameter array."""
    return (value.T if transposed else value).astype(dtype)


def stage_parameters(weights: Mapping[str, np.ndarray], config: ModelConfig, numerics: SamplerNumerics) -> list[jax.Array]:
    """The parameter arrays (in :func:`parameter_layout` order) of ``config``'s model holding the
    HF ``weights`` as the pool stores them: each tensor rounded to its :func:`storage_format`,
    transposed where the layout says, in the compute dtype; equal to those of
    ``from_hf_state_dict(config, quantize_weights(weights, numerics), param_dtype=...)``. A tensor
    stored in the compute dtype itself is only cast (the cast rounds to nearest even, as
    :func:`quantize_dequantize` does), one pass over it. ``weights`` are not validated here."""
    layout = parameter_layout(config, numerics.param_format)
    dtype = _DTYPES[numerics.param_format]
    leaves: list[Any] = [None] * len(layout.entries)
    for name, index, transposed in layout.entries:
        value = np.asarray(weights[name], dtype=np.float32)
        fmt = storage_format(name, numerics)
        if fmt != numerics.param_format:
            value = quantize_dequantize(value, fmt)
        leaves[index] = _to_parameter(value, transposed=transposed, dtype=dtype)
    return leaves


def staging_key(config: ModelConfig, numerics: SamplerNumerics) -> tuple:
    """What the staged parameter arrays depend on: the model and the weight and compute formats
    (replicas of pools that differ only in KV cache, activation, accumulation or split-K numerics
    share them: those act at run time, not on the stored weights)."""
    return ("embedded", config, numerics.weight_format, numerics.param_format)


def staged_parameters(weights: Mapping[str, np.ndarray], config: ModelConfig, numerics: SamplerNumerics) -> list[jax.Array]:
    """:func:`stage_parameters` of validated ``weights`` (:func:`hetrl.models.hf_io.check_state_dict`;
    ``CheckpointError`` otherwise). For a :class:`WeightSet`, the check runs once per set and the
    arrays are staged once per set and :func:`staging_key`, then shared."""
    if not isinstance(weights, WeightSet):
        check_state_dict(config, weights)
        return stage_parameters(weights, config, numerics)
    weights.staged(("checked", config), lambda ws: check_state_dict(config, ws))
    return weights.staged(staging_key(config, numerics), lambda ws: stage_parameters(ws, config, numerics))


def _bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n; past the largest, the next multiple of the largest."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


_RECORDED = {"tokens": "token", "logprobs": "logprob", "count": "count", "support_ids": "support_ids",
             "support_logprobs": "support_logprobs", "cap_bound": "cap_bound"}
"""Output buffer [B, N, ...] -> the :class:`SampleResult` field recorded in it at every step."""


def _record(out: dict, r, step) -> dict:
    return {name: buf.at[:, step].set(getattr(r, _RECORDED[name])) for name, buf in out.items()}


class _Aborts:
    """The calls of every embedded sampler in this process, by call id, and whether each was
    aborted: :func:`_generate_chunk` asks :meth:`aborted` between its decode runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, bool] = {}

    def open(self) -> int:
        with self._lock:
            call = next(self._ids)
            self._calls[call] = False
            return call

    def close(self, call: int) -> None:
        with self._lock:
            self._calls.pop(call, None)

    def abort(self, calls) -> None:
        with self._lock:
            for call in calls:
                if call in self._calls:
                    self._calls[call] = True

    def aborted(self, call: int) -> bool:
        with self._lock:
            return self._calls.get(call, False)


_ABORTS = _Aborts()


class _Rows(NamedTuple):
    """A chunk's per-row settings, [B] each (``stop_ids`` [B, NS] padded with -1): the prompt
    lengths, sampling parameters and new-token limits."""

    prompt_lens: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new: jax.Array
    stop_ids: jax.Array


class _DecodeState(NamedTuple):
    """The decode loop's carry: the next step ``n``, the token fed at it [B], which rows are done
    [B], their lengths so far [B], the KV cache and the output buffers (see :data:`_RECORDED`)."""

    step: jax.Array
    token: jax.Array
    done: jax.Array
    lengths: jax.Array
    cache: KVCache
    out: dict


def _decode_segments(n_steps: int) -> tuple[int, ...]:
    """The decode steps at which each cache size ends: ``(N // 2, N)`` (``(N,)`` for N = 1).

    Attention reads every slot of the cache at every step, so the first half of the steps runs
    over a cache of ``P + N // 2`` slots, grown (one copy) to ``P + N`` for the second half: the
    mean slots read per step fall from ``P + N`` to about ``P + 3N/4``. Each cache size is its own
    compiled decode program; more of them read less but compile longer (four segments measured
    no faster than two at N = 128)."""
    return (n_steps,) if n_steps < 2 else (n_steps // 2, n_steps)


def _decode_runs(n_steps: int) -> tuple[tuple[int, int], ...]:
    """The decode runs of a chunk of ``N`` new tokens, in order, as ``(end, cache)``: a run of
    the steps before step ``end`` (all of them: the steps ``1 .. N - 1``) over a cache of ``P +
    cache`` slots. Runs end where a cache size does (:func:`_decode_segments`) and at every
    ``max(1, N // ABORT_CHECKS)``-th step, where the host checks the call's abort flag."""
    every = max(1, n_steps // ABORT_CHECKS)
    segments = _decode_segments(n_steps)
    ends = sorted({*range(every, n_steps, every), *(min(last + 1, n_steps) for last in segments)} - {1})
    return tuple((end, next(last for last in segments if end - 1 <= last)) for end in ends)


def _model(leaves, graphdef, treedef) -> QwenModel:
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _key_mask(rows: _Rows, P: int, slots: int) -> jax.Array:
    """[B, slots] bool: which cache slots each row attends to (its real prompt tokens sit at
    slots ``[P - P_b, P)``; every slot from ``P`` on is its own response)."""
    return jnp.arange(slots)[None, :] >= (P - rows.prompt_lens)[:, None]


def _draw(noise, logits, rows: _Rows, step, width: int, head_size: int):
    return sample(jax.tree.map(lambda a: a[step], noise), logits, rows.temperature, rows.top_k, rows.top_p,
                  width=width, head_size=head_size)


def _stops(rows: _Rows, token) -> jax.Array:
    return jnp.any(rows.stop_ids == token[:, None], axis=-1)


_STATIC = ("graphdef", "treedef", "n_steps", "width", "head_size")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(leaves, prompt_ids, rows: _Rows, key, *, graphdef, treedef, n_steps, width, head_size):
    """The prompts through the model into a cache of ``P + N // 2`` slots (``P + N`` for N = 1)
    and the first token sampled (see the module docstring): returns the decode state at step 1
    and every step's sampling noise, [N, B, ...] (row b's draw at step n depends only on
    ``(key, b, n)``). prompt_ids [B, P] int32 left-padded."""
    model = _model(leaves, graphdef, treedef)
    B, P = prompt_ids.shape
    first = P - rows.prompt_lens
    positions = jnp.maximum(jnp.arange(P)[None, :] - first[:, None], 0).astype(jnp.int32)
    cache = init_cache(model.config, B, P + _decode_segments(n_steps)[0], dtype=model.numerics.compute_dtype)
    # every step's noise in one call (drawn per step, threefry's small loops, rolled on CPU, ran three times a step)
    noise = draw_noise(jax.vmap(lambda n: row_keys(key, B, n))(jnp.arange(n_steps)), width)
    hidden, cache = model.hidden_states(prompt_ids, positions, _key_mask(rows, P, cache.max_len), cache, jnp.int32(0))
    r = _draw(noise, model.logits(hidden[:, -1:])[:, 0], rows, 0, width, head_size)  # the LM head at the last slot only
    out = {name: jnp.zeros((B, n_steps) + getattr(r, field).shape[1:], getattr(r, field).dtype)
           for name, field in _RECORDED.items()}
    return _DecodeState(jnp.int32(1), r.token, _stops(rows, r.token) | (rows.max_new <= 1), jnp.ones((B,), jnp.int32),
                        cache, _record(out, r, 0)), noise


@functools.partial(jax.jit, static_argnames=("slots",))
def _grow(state: _DecodeState, *, slots: int) -> _DecodeState:
    return state._replace(cache=grow_cache(state.cache, slots))


@functools.partial(jax.jit, static_argnames=(*_STATIC, "prompt_slots"), donate_argnames=("state",))
def _decode(leaves, state: _DecodeState, noise, rows: _Rows, end, *, graphdef, treedef, n_steps, width, head_size,
            prompt_slots):
    """KV-cached decode steps ``state.step ..`` before step ``end`` (int32; at most ``N - 1``),
    over the cache as sized; stops early once every row is done. Step ``n`` feeds token ``n - 1``
    at slot ``P + n - 1`` (``P = prompt_slots``) and samples token ``n``."""
    model = _model(leaves, graphdef, treedef)
    P = prompt_slots
    mask = _key_mask(rows, P, state.cache.max_len)

    def body(s: _DecodeState) -> _DecodeState:
        pos = (rows.prompt_lens + s.step - 1)[:, None]
        logits, cache = model(s.token[:, None], pos, mask, s.cache, P + s.step - 1)
        r = _draw(noise, logits[:, 0], rows, s.step, width, head_size)
        return _DecodeState(s.step + 1, jnp.where(s.done, s.token, r.token),
                            s.done | _stops(rows, r.token) | (s.step + 1 >= rows.max_new),
                            jnp.where(s.done, s.lengths, s.step + 1), cache, _record(s.out, r, s.step))

    return jax.lax.while_loop(lambda s: (s.step < end) & ~jnp.all(s.done), body, state)


def _generate_chunk(leaves, prompt_ids, rows: _Rows, key, call: int, **static) -> dict[str, jax.Array]:
    """Prefill + KV-cached decode of one padded chunk (see the module docstring), as compiled
    programs run from here: :func:`_prefill`, then the :func:`_decode_runs` (a cache grown by
    :func:`_grow` between the two cache sizes). Between runs the host checks whether ``call``
    was aborted (:data:`_ABORTS`) and stops if so, or once every row is done. No program calls
    back into Python, so each is kept in JAX's persistent compilation cache. Returns a dict of
    tokens, logprobs, count [B, N], support_ids, support_logprobs [B, N, W], cap_bound [B, N],
    lengths [B] and done [B] (False: the row was cut by an abort)."""
    state, noise = _prefill(leaves, prompt_ids, rows, key, **static)
    P = prompt_ids.shape[1]
    for end, cache in _decode_runs(static["n_steps"]):
        if bool(jnp.all(state.done)) or _ABORTS.aborted(call):
            break
        if P + cache > state.cache.max_len:
            state = _grow(state, slots=P + cache)
        state = _decode(leaves, state, noise, rows, np.int32(end), prompt_slots=P, **static)
    return dict(state.out, lengths=state.lengths, done=state.done)


def compiled_programs() -> int:
    """How many programs the embedded engine has compiled in this process (for tests: a weight
    update or a repeated shape compiles none)."""
    return sum(program._cache_size() for program in (_prefill, _grow, _decode))


class EmbeddedSampler:
    """In-process JAX sampler with a pool's numerics; implements the ``Sampler`` protocol.

    ``weights``: HF-named float arrays (:mod:`hetrl.models.hf_io`), quantized on load with
    :func:`quantize_weights`. ``support_cap`` (W) bounds the recorded kept set (``top_k <= W``;
    top-p is taken within the top W) and ``head_size`` (<= W, default W) is the head recorded for
    untruncated sampling (0: no support recorded). ``max_batch`` caps the rows of one compiled
    call; ``length_buckets`` / ``batch_buckets`` are the shape buckets (prompt length and
    new-token count share ``length_buckets``).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray],
        numerics: SamplerNumerics,
        *,
        pool: str | None = None,
        version: int = 0,
        seed: int = 0,
        support_cap: int = DEFAULT_SUPPORT_CAP,
        head_size: int | None = None,
        max_batch: int = 64,
        length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    ):
        self.config = config
        self.numerics = numerics
        self.width = min(support_cap, config.vocab_size)
        self.head_size = self.width if head_size is None else head_size
        if not 0 <= self.head_size <= self.width:
            raise ValueError(f"head_size {self.head_size} must lie in [0, support cap {self.width}]")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.length_buckets = tuple(sorted(length_buckets))
        self.batch_buckets = tuple(b for b in sorted(batch_buckets) if b < max_batch) + (max_batch,)
        self._info = numerics.sampler_info(pool, "embedded", f"hetrl-embedded jax-{jax.__version__}")
        self._lock = threading.Lock()
        self._key = jax.random.key(seed)
        self._in_flight = 0
        self._calls: set[int] = set()  # ids (in _ABORTS) of the generate calls running now
        self._tokens = 0
        self._cap_bound = 0
        # the model's structure, built once (abstractly); weights only ever replace its arrays
        model = nnx.eval_shape(lambda: QwenModel(config, rngs=nnx.Rngs(0), param_dtype=_DTYPES[numerics.param_format],
                                                 numerics=numerics.model_numerics()))
        self._graphdef, state = nnx.split(model)
        self._treedef = jax.tree.structure(state)
        if self._treedef != parameter_layout(config, numerics.param_format).treedef:
            raise RuntimeError("the sampler's model does not flatten like its parameter layout")
        self._leaves = staged_parameters(weights, config, numerics)
        self._version = version

    @classmethod
    def from_checkpoint(cls, directory, numerics: SamplerNumerics, **kwargs) -> "EmbeddedSampler":
        """A sampler over an HF checkpoint directory (``config.json`` + safetensors)."""
        return cls(ModelConfig.load(directory), load_state_dict(directory), numerics, **kwargs)

    # ------------------------------------------------------------------ Sampler protocol
    @property
    def info(self) -> SamplerInfo:
        return self._info

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Load HF-named ``weights`` in place (:func:`staged_parameters`: quantized once per
        format for a :class:`WeightSet`); tokens of later calls carry ``version``. In-flight
        calls finish on the arrays they started with. Same model, same shapes: no recompilation."""
        leaves = staged_parameters(weights, self.config, self.numerics)
        with self._lock:
            self._leaves = leaves
            self._version = int(version)

    supports_reseed = True
    """It has the :class:`hetrl.samplers.base.Reseedable` capability."""

    def reseed(self, seed: int) -> None:
        """Restart the random stream at ``seed``: the same requests in the same calls then draw
        the same noise (common random numbers, e.g. for paired evaluations across steps)."""
        with self._lock:
            self._key = jax.random.key(seed)

    supports_abort = True
    """It has the :class:`hetrl.samplers.base.Abortable` capability."""

    def abort(self) -> None:
        """Cut every ``generate`` call running now at its next abort check (every ``N //
        ABORT_CHECKS`` decode steps): its unfinished requests return with
        ``finish_reason="abort"`` and their tokens so far; later calls are not affected."""
        with self._lock:
            _ABORTS.abort(self._calls)

    def health(self) -> SamplerHealth:
        with self._lock:
            detail = (f"{self._tokens} tokens generated; {self._cap_bound} top-p sets cut to the "
                      f"support cap {self.width}")
            return SamplerHealth(healthy=True, weight_version=self._version, in_flight=self._in_flight, detail=detail)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request to a stop token or ``max_new_tokens``; one Generation each, in order."""
        for r in requests:
            self._check(r)
        with self._lock:
            self._key, call_key = jax.random.split(self._key)
            leaves, version = self._leaves, self._version
            self._in_flight += len(requests)
            call = _ABORTS.open()
            self._calls.add(call)
        try:
            out: list[Generation] = []
            for i in range(0, len(requests), self.max_batch):
                chunk = requests[i : i + self.max_batch]
                out += self._run_chunk(chunk, leaves, version, jax.random.fold_in(call_key, i // self.max_batch), call)
            return out
        finally:
            with self._lock:
                self._in_flight -= len(requests)
                self._calls.discard(call)
                _ABORTS.close(call)

    # ------------------------------------------------------------------ internals
    def _check(self, r: GenerationRequest) -> None:
        check_request(r, self.config.vocab_size, self.config.max_position_embeddings)
        try:
            check_params([r.sampling.top_k], [r.sampling.top_p], self.width)
        except ValueError as err:
            raise ValueError(f"request {r.request_id!r}: {err}") from None

    def _run_chunk(self, chunk: Sequence[GenerationRequest], leaves, version: int, key, call: int) -> list[Generation]:
        n = len(chunk)
        B = _bucket(n, self.batch_buckets)
        P = _bucket(max(len(r.prompt_ids) for r in chunk), self.length_buckets)
        N = _bucket(max(r.max_new_tokens for r in chunk), self.length_buckets)
        NS = _bucket(max(1, *(len(r.stop_token_ids) for r in chunk)), (1, 2, 4, 8))
        pad = self.config.pad_token_id or 0
        prompt_ids = np.full((B, P), pad, np.int32)
        prompt_lens = np.ones(B, np.int32)
        temperature = np.ones(B, np.float32)
        top_k = np.ones(B, np.int32)  # padding rows: greedy (truncated, so no V-wide draw) ...
        top_p = np.ones(B, np.float32)
        max_new = np.ones(B, np.int32)  # ... and done after one token
        stop_ids = np.full((B, NS), -1, np.int32)
        for b, r in enumerate(chunk):
            ids = np.asarray(r.prompt_ids)
            prompt_ids[b, P - len(ids) :] = ids
            prompt_lens[b] = len(ids)
            temperature[b], top_k[b], top_p[b] = r.sampling.temperature, r.sampling.top_k, r.sampling.top_p
            max_new[b] = r.max_new_tokens
            stop_ids[b, : len(r.stop_token_ids)] = r.stop_token_ids
        start = time.perf_counter()
        res = _generate_chunk(leaves, prompt_ids, _Rows(prompt_lens, temperature, top_k, top_p, max_new, stop_ids), key,
                              call, graphdef=self._graphdef, treedef=self._treedef, n_steps=N, width=self.width,
                              head_size=self.head_size)
        res = jax.tree.map(np.asarray, jax.device_get(res))
        elapsed = time.perf_counter() - start

        gens = []
        for b, r in enumerate(chunk):
            T = int(res["lengths"][b])
            tokens = res["tokens"][b, :T]
            support = None
            if r.sampling.truncated or self.head_size > 0:
                counts = res["count"][b, :T]
                keep = np.arange(self.width)[None, :] < counts[:, None]
                offsets = np.zeros(T + 1, np.int64)
                np.cumsum(counts, out=offsets[1:])
                support = SamplingSupport(ids=res["support_ids"][b, :T][keep], offsets=offsets,
                                          logprobs=res["support_logprobs"][b, :T][keep],
                                          kind="kept" if r.sampling.truncated else "head")
            finish = ("abort" if not res["done"][b] else "stop" if int(tokens[-1]) in r.stop_token_ids
                      else "length")
            gens.append(Generation(request_id=r.request_id, token_ids=tokens, logprobs=res["logprobs"][b, :T],
                                   policy_version=np.full(T, version, np.int64), finish_reason=finish,
                                   support=support, sampler=self._info, timings={"generate_s": elapsed}))
            with self._lock:
                self._tokens += T
                self._cap_bound += int(res["cap_bound"][b, :T].sum())
        return gens
