"""``hetrl parity``: one HF checkpoint in every backend present, compared on one batch.

    hetrl parity [--checkpoint DIR | --model qwen3|qwen2] [--seed N] [--json PATH]

Backends (:data:`BACKENDS`; one whose libraries do not import is listed as *absent*):
``transformers`` (the reference: ``AutoModelForCausalLM`` in float32), ``jax`` / ``jax-bf16``
(:class:`~hetrl.trainer_jax.JaxTrainer`, FP32 or BF16 compute over FP32 weights), ``megatron`` /
``megatron-bf16`` (:class:`~hetrl.trainer_megatron.MegatronTrainer`, FP32, or BF16 through
``Float16Module``) and ``embedded`` (:class:`~hetrl.samplers.embedded.EmbeddedSampler` in the
exact ``fp32`` profile). Without ``--checkpoint`` the tiny Qwen3 (or Qwen2) checkpoint of
:func:`build_parity_checkpoint` is built in a temporary directory.

The batch (:func:`parity_batch`, ``[B, L]`` with supports ``[B, L, K]``, deterministic in the
seed): random prompts continued by the embedded engine, half the rows by the exact fp32 sampler
(its ``log q`` must equal the reference's ``log p``) and half by the same engine over FP8 E4M3
weights (a real weight-precision mismatch, so that MIS masks some rows); kept top-k/top-p
supports and full-distribution heads alternate; groups of two rows with rewards 0 and 1. Without
the embedded engine, :func:`random_batch` draws random tokens and sampler distributions instead.

Every row (:func:`check`) states its tolerance; ``log p(a_t)`` is taken as the loss takes it (mask
replay over kept supports, the full softmax at temperature T elsewhere), over trainable tokens:

* log-probs, FP32, every backend vs the reference: ``max_t |log p_x(a_t) − log p_ref(a_t)|`` ≤
  1e-5 (the sampler: its recorded ``log q`` on the rows it sampled);
* log-probs, BF16: ``mean_t |log p_megatron-bf16 − log p_jax-bf16|`` ≤ 2e-2;
* loss, FP32, preset ``hetrl``: ``|L_megatron − L_jax|`` ≤ 1e-5;
* one AdamW step from the same weights: ``max_W ‖ΔW_megatron − ΔW_jax‖₂ / ‖ΔW_jax‖₂`` ≤ 1e-4 over
  every HF tensor W (``ε = 1e-3`` so the first update depends on the gradient, not only its sign).
  The worst tensors are the small norm weights (QK-norm, RMSNorm), whose gradients sum many
  cancelling terms: on the default Qwen3 batch each trainer's update of ``k_norm`` is ~6e-5 from a
  float64 transformers update and the two differ by 7-8e-5, so this row sits near the FP32 floor.

The exit code is 0 iff at least one row was checked and none failed. :func:`load_backends`,
:func:`parity_batch`, :func:`check` and :func:`report` are the steps of :func:`run`, separately
callable (a test swaps in a backend loaded from perturbed weights and expects FAIL rows).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import numpy as np

from hetrl.core.correction import replay_logprobs
from hetrl.core.schema import Rollout, RolloutBatch, SamplerInfo, SamplingParams, SamplingSupport, collate
from hetrl.core.xp import log_softmax
from hetrl.models import ModelConfig, load_state_dict, save_state_dict
from hetrl.models.tiny import TINY_QWEN2, TINY_QWEN3, build_tiny_checkpoint

__all__ = [
    "BACKENDS", "Row", "build_parity_checkpoint", "load_backends", "parity_batch", "random_batch", "check", "report",
    "reference_logprobs", "transformers_logits", "update_relative_error", "add_arguments", "run",
]

FP32_LOGPROB_ATOL = 1e-5
BF16_LOGPROB_MEAN_BOUND = 2e-2
LOSS_ATOL = 1e-5
UPDATE_RTOL = 1e-4

TINY_MODELS = {"qwen3": TINY_QWEN3, "qwen2": TINY_QWEN2}
PARITY_INIT_STD = 0.1
"""Weight scale of the default checkpoint: mean log p(a) ≈ −3.9 over a 512-token vocabulary. The
BF16 bound depends on the logit scale: at init_std 0.1 the BF16 Megatron–JAX mean |Δ log p| was
9e-3 here, at 0.2 it was 2.5e-2."""

OPTIMIZER = dict(learning_rate=1e-3, eps=1e-3, grad_clip=None)
"""AdamW of both trainers' step (no weight decay, no clipping; a large ε, see the module docstring)."""
MEGATRON_MICRO_BATCH = 3  # the step accumulates over several micro-batches, the last one ragged

EXACT_POOL = "embedded-fp32"
MISMATCHED_POOL = "embedded-fp32-fp8w"
ROWS_PER_POOL = 8
SUPPORT_CAP, HEAD_SIZE = 16, 8
SAMPLINGS = (SamplingParams(temperature=0.8, top_k=8, top_p=0.9), SamplingParams(temperature=1.0))
"""Alternating per row: a kept top-k/top-p set (replayed), and untruncated sampling with a head."""


# ====================================================================== checkpoint
def build_parity_checkpoint(directory: str | os.PathLike, config: ModelConfig = TINY_QWEN3, seed: int = 0,
                            init_std: float = PARITY_INIT_STD) -> pathlib.Path:
    """A tiny HF checkpoint (:func:`hetrl.models.tiny.build_tiny_checkpoint`, weights
    ``N(0, init_std)``) whose RMSNorm weights are ``1 + 0.1 N(0, 1)`` instead of ones (drawn with
    ``seed + 1``), so a norm weight that is dropped or misapplied shows."""
    directory = build_tiny_checkpoint(directory, config, seed=seed, init_std=init_std)
    rng = np.random.default_rng(seed + 1)
    state = load_state_dict(directory)
    save_state_dict(directory, {k: (1 + 0.1 * rng.normal(size=v.shape)).astype(np.float32) if k.endswith("norm.weight") else v
                                for k, v in state.items()})
    return directory


# ====================================================================== backends
@dataclass(frozen=True)
class BackendSpec:
    """A backend: the modules it needs and what it is."""

    modules: tuple[str, ...]
    description: str


BACKENDS: dict[str, BackendSpec] = {
    "transformers": BackendSpec(("torch", "transformers"), "transformers AutoModelForCausalLM, float32 (reference)"),
    "jax": BackendSpec(("jax", "flax", "optax"), "JaxTrainer, fp32 compute"),
    "jax-bf16": BackendSpec(("jax", "flax", "optax"), "JaxTrainer, bf16 compute over fp32 weights"),
    "megatron": BackendSpec(("torch", "megatron.core"), "MegatronTrainer, fp32"),
    "megatron-bf16": BackendSpec(("torch", "megatron.core"), "MegatronTrainer, bf16 (Float16Module)"),
    "embedded": BackendSpec(("jax", "flax"), "EmbeddedSampler, exact fp32 profile"),
}
REFERENCE_ORDER = ("transformers", "jax", "megatron")
"""The reference is the first of these present."""


def installed(name: str) -> bool:
    """Whether every module backend ``name`` needs can be imported."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in BACKENDS[name].modules)
    except ModuleNotFoundError:  # a missing parent package of a dotted name
        return False


def _jax_trainer(compute_dtype: str) -> Callable[[pathlib.Path], Any]:
    def load(directory: pathlib.Path):
        from hetrl.trainer_jax import JaxTrainer, JaxTrainerConfig, MeshConfig

        config = JaxTrainerConfig(compute_dtype=compute_dtype, mesh=MeshConfig(data=1, fsdp=1, tensor=1),
                                  optimizer=OPTIMIZER)
        return JaxTrainer.from_hf(directory, config)

    return load


def _megatron_trainer(compute_dtype: str) -> Callable[[pathlib.Path], Any]:
    def load(directory: pathlib.Path):
        from hetrl.trainer_megatron import MegatronTrainer, MegatronTrainerConfig

        config = MegatronTrainerConfig(compute_dtype=compute_dtype, micro_batch_size=MEGATRON_MICRO_BATCH,
                                       optimizer=OPTIMIZER)
        return MegatronTrainer.from_hf(directory, config)

    return load


def _transformers_model(directory: pathlib.Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _embedded_sampler(directory: pathlib.Path, weight_format: str = "fp32", pool: str = EXACT_POOL, seed: int = 0):
    from hetrl.samplers.embedded import EmbeddedSampler
    from hetrl.samplers.profiles import REFERENCE_KIND, sampler_numerics

    numerics = sampler_numerics(REFERENCE_KIND, weight_format, weight_formats=tuple(dict.fromkeys(("fp32", weight_format))))
    return EmbeddedSampler.from_checkpoint(directory, numerics, pool=pool, seed=seed, support_cap=SUPPORT_CAP,
                                           head_size=HEAD_SIZE, max_batch=ROWS_PER_POOL)


LOADERS: dict[str, Callable[[pathlib.Path], Any]] = {
    "transformers": _transformers_model, "jax": _jax_trainer("fp32"), "jax-bf16": _jax_trainer("bf16"),
    "megatron": _megatron_trainer("fp32"), "megatron-bf16": _megatron_trainer("bf16"), "embedded": _embedded_sampler,
}


def load_backends(directory: str | os.PathLike, names=tuple(BACKENDS), on_load: Callable[[str], None] | None = None) -> dict:
    """``{name: loaded backend, or None when absent}`` for ``names`` of :data:`BACKENDS`, each
    loaded from the HF checkpoint ``directory``; ``on_load(name)`` is called before each."""
    directory = pathlib.Path(directory)
    out = {}
    for name in names:
        if on_load is not None:
            on_load(name)
        out[name] = LOADERS[name](directory) if installed(name) else None
    return out


# ====================================================================== the batch
def parity_batch(directory: str | os.PathLike, sampler=None, seed: int = 0) -> RolloutBatch:
    """The batch of the module docstring: :data:`ROWS_PER_POOL` rows continued by ``sampler``
    (the exact embedded sampler) and as many by the same engine over FP8 E4M3 weights (pool
    :data:`MISMATCHED_POOL`); without a sampler, :func:`random_batch` (its sampler distributions
    are unrelated to the model, so MIS masks nearly every row: it serves the log-prob rows; the
    loss and update rows need both trainers, hence JAX, hence the sampler)."""
    config = ModelConfig.load(directory)
    if sampler is None:
        return random_batch(config, seed)
    from hetrl.samplers.base import GenerationRequest

    rng = np.random.default_rng(seed)
    pools = (sampler, _embedded_sampler(pathlib.Path(directory), "fp8_e4m3", MISMATCHED_POOL, seed + 1))
    rollouts = []
    for p, pool in enumerate(pools):
        requests = []
        for i in range(ROWS_PER_POOL):
            prompt = rng.integers(3, config.vocab_size, int(rng.integers(2, 9))).astype(np.int32)
            requests.append(GenerationRequest(f"p{p}r{i}", prompt, SAMPLINGS[i % 2], int(rng.integers(4, 13))))
        for request, gen in zip(requests, pool.generate(requests)):
            b = len(rollouts)
            rollouts.append(Rollout(
                rollout_id=request.request_id, group_id=f"g{b // 2}", prompt_ids=request.prompt_ids,
                response_ids=gen.token_ids, loss_mask=np.ones(len(gen.token_ids), bool), sampler_logprobs=gen.logprobs,
                policy_version=gen.policy_version.astype(np.int32), reward=float(b % 2), finish_reason=gen.finish_reason,
                sampling=request.sampling, sampler=gen.sampler, support=gen.support,
            ).validate(config.vocab_size, config.max_position_embeddings))
    return collate(rollouts, length_multiple=4)


def random_batch(config: ModelConfig, seed: int = 0, rows: int = 2 * ROWS_PER_POOL, support: int = 8,
                 prompt_lengths: tuple[int, int] = (2, 8), response_lengths: tuple[int, int] = (4, 12)) -> RolloutBatch:
    """``rows`` rollouts of random prompt and response ids in ``[3, V)`` (lengths drawn uniformly
    from the inclusive ranges): each response token is drawn from a random distribution
    ``q = softmax(2·N(0, 1))`` over a kept set of ``support`` random ids (recorded as the support,
    top_k = ``support``); groups of two with rewards 0, 1."""
    rng = np.random.default_rng(seed)
    info = SamplerInfo(pool="random", accelerator="none", weight_precision="none", kv_precision="none", engine="numpy")
    sampling = SamplingParams(temperature=1.0, top_k=support)
    rollouts = []
    for b in range(rows):
        T = int(rng.integers(response_lengths[0], response_lengths[1] + 1))
        P = int(rng.integers(prompt_lengths[0], prompt_lengths[1] + 1))
        kept = np.stack([rng.choice(np.arange(3, config.vocab_size), support, replace=False) for _ in range(T)])
        logq = log_softmax(2.0 * rng.normal(size=(T, support)))
        pick = np.array([rng.choice(support, p=np.exp(lq) / np.exp(lq).sum()) for lq in logq])
        rollouts.append(Rollout(
            rollout_id=f"r{b}", group_id=f"g{b // 2}", prompt_ids=rng.integers(3, config.vocab_size, P).astype(np.int32),
            response_ids=kept[np.arange(T), pick].astype(np.int32), loss_mask=np.ones(T, bool),
            sampler_logprobs=logq[np.arange(T), pick].astype(np.float32), policy_version=np.zeros(T, np.int32),
            reward=float(b % 2), finish_reason="length", sampling=sampling, sampler=info,
            support=SamplingSupport(ids=kept.reshape(-1).astype(np.int32), offsets=np.arange(T + 1) * support,
                                    logprobs=logq.reshape(-1).astype(np.float32)),
        ).validate(config.vocab_size, config.max_position_embeddings))
    return collate(rollouts, length_multiple=4)


# ====================================================================== log-probs and updates
def transformers_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Float32 logits [B, L, V] of a ``transformers`` causal LM on ids [B, L] with key mask [B, L]."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    return out.logits.float().numpy()


def reference_logprobs(logits: np.ndarray, batch: RolloutBatch, replay: bool = True) -> np.ndarray:
    """``log p(a)`` [B, L] (float64) from logits [B, L, V] in numpy: mask replay on kept rows
    (:func:`hetrl.core.correction.replay_logprobs`) when ``replay``, ``log softmax(z/T)_a``
    elsewhere."""
    temperature = batch.temperature.astype(np.float64)
    z = logits.astype(np.float64)
    full = log_softmax(z / temperature[:, None, None])
    full_a = np.take_along_axis(full, batch.target_ids[..., None].astype(np.int64), -1)[..., 0]
    replayed, _ = replay_logprobs(z, batch.target_ids, batch.support_ids, batch.support_mask, temperature)
    return np.where(batch.support_kept[:, None] & replay, replayed, full_a)


def update_relative_error(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
                          ref_before: Mapping[str, np.ndarray], ref_after: Mapping[str, np.ndarray]) -> tuple[float, str]:
    """``(max_W ‖ΔW − ΔW_ref‖₂ / ‖ΔW_ref‖₂, the W attaining it)`` over HF tensor names, with
    ``ΔW = after − before`` (float64); a tensor that moves in neither counts 0."""
    if sorted(before) != sorted(ref_before):
        raise ValueError(f"the two weight sets differ in {sorted(set(before) ^ set(ref_before))}")
    worst, worst_name = 0.0, ""
    for name in sorted(before):
        ours = after[name].astype(np.float64) - before[name].astype(np.float64)
        ref = ref_after[name].astype(np.float64) - ref_before[name].astype(np.float64)
        err = float(np.linalg.norm(ours - ref))
        rel = err / max(float(np.linalg.norm(ref)), 1e-30) if err else 0.0
        if rel >= worst:
            worst, worst_name = rel, name
    return worst, worst_name


def _step(trainer, batch: RolloutBatch) -> tuple[dict[str, float], dict, dict]:
    """``(metrics, weights before, weights after)`` of one ``train_step`` on ``batch``."""
    before = trainer.export_hf_weights()
    metrics = trainer.train_step(batch)
    return metrics, before, trainer.export_hf_weights()


# ====================================================================== the checks
@dataclass(frozen=True)
class Row:
    """One comparison: ``value`` of ``statistic`` between ``backends`` must be ≤ ``tolerance``;
    ``value`` None = a backend is absent."""

    check: str
    backends: tuple[str, str]
    statistic: str
    value: float | None
    tolerance: float
    note: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "absent"
        return "PASS" if self.value <= self.tolerance else "FAIL"  # NaN fails


def _absent(check: str, pair: tuple[str, str], statistic: str, tolerance: float, backends: Mapping) -> Row:
    missing = [n for n in pair if n is None or backends.get(n) is None]
    return Row(check, pair, statistic, None, tolerance, f"{', '.join(str(n) for n in missing)} absent")


def check(backends: Mapping[str, Any], batch: RolloutBatch) -> list[Row]:
    """The rows of the module docstring for the ``backends`` present (``None`` or missing =
    absent). Log-probs are read first; then the FP32 trainers take one step on ``batch``."""
    present = {name: b for name, b in backends.items() if b is not None}
    reference = next((n for n in REFERENCE_ORDER if n in present), None)
    mask = batch.loss_mask
    logp: dict[str, np.ndarray] = {}
    if "transformers" in present:
        logits = transformers_logits(present["transformers"], batch.input_ids, batch.attention_mask)
        logp["transformers"] = reference_logprobs(logits, batch)
    for name in ("jax", "jax-bf16", "megatron", "megatron-bf16"):
        if name in present:
            logp[name] = present[name].logprobs(batch).astype(np.float64)
    masks = dict.fromkeys(logp, mask)
    if "embedded" in present:
        if EXACT_POOL not in batch.pool_names:
            raise ValueError(f"the embedded sampler is present but the batch has no rows of pool {EXACT_POOL!r}; "
                             "build it with parity_batch(directory, sampler)")
        logp["embedded"] = batch.sampler_logprobs.astype(np.float64)
        masks["embedded"] = mask & (batch.pool_index == batch.pool_names.index(EXACT_POOL))[:, None]

    rows = []
    fp32 = "log p(a), fp32"
    for name in ("jax", "megatron", "embedded"):
        pair = (name, reference)
        if name == reference:
            continue
        if name not in logp or reference is None:
            rows.append(_absent(fp32, pair, "max |Δ|", FP32_LOGPROB_ATOL, present))
            continue
        diff = np.abs(logp[name] - logp[reference])[masks[name]]
        rows.append(Row(fp32, pair, "max |Δ|", float(diff.max()), FP32_LOGPROB_ATOL,
                        f"mean {diff.mean():.2e} over {diff.size} tokens"))
    pair = ("megatron-bf16", "jax-bf16")
    if all(n in logp for n in pair):
        diff = np.abs(logp[pair[0]] - logp[pair[1]])[mask]
        rows.append(Row("log p(a), bf16", pair, "mean |Δ|", float(diff.mean()), BF16_LOGPROB_MEAN_BOUND,
                        f"max {diff.max():.2e} over {diff.size} tokens"))
    else:
        rows.append(_absent("log p(a), bf16", pair, "mean |Δ|", BF16_LOGPROB_MEAN_BOUND, present))

    pair = ("megatron", "jax")
    if all(n in present for n in pair):
        (meg_metrics, meg_before, meg_after), (jax_metrics, jax_before, jax_after) = (_step(present[n], batch) for n in pair)
        meg_loss, jax_loss = meg_metrics["loss"], jax_metrics["loss"]
        masked = jax_metrics["mismatch/masked_frac/sequence"]
        rows.append(Row("loss, fp32, preset hetrl", pair, "|Δ|", abs(meg_loss - jax_loss), LOSS_ATOL,
                        f"megatron {meg_loss:.7f}, jax {jax_loss:.7f}; MIS masked {masked:.0%} of rows"))
        worst, name = update_relative_error(meg_before, meg_after, jax_before, jax_after)
        rows.append(Row("AdamW update, fp32", pair, "max_W ‖Δ‖/‖ΔW‖", worst, UPDATE_RTOL, f"worst: {name}"))
    else:
        rows.append(_absent("loss, fp32, preset hetrl", pair, "|Δ|", LOSS_ATOL, present))
        rows.append(_absent("AdamW update, fp32", pair, "max_W ‖Δ‖/‖ΔW‖", UPDATE_RTOL, present))
    return rows


# ====================================================================== output
def report(rows: list[Row], backends: Mapping[str, Any], batch: RolloutBatch, console, json_path=None, checkpoint=None) -> int:
    """Print the backends and the rows as rich tables to ``console``, write them as JSON to
    ``json_path`` if given; returns the exit code (0 iff some row was checked and none failed)."""
    from rich.table import Table

    reference = next((n for n in REFERENCE_ORDER if backends.get(n) is not None), None)
    status = {name: "absent" if backends.get(name) is None else "present" for name in BACKENDS}
    table = Table(title=f"hetrl parity backends (checkpoint {checkpoint})")
    for col in ("backend", "what", "status"):
        table.add_column(col)
    for name, spec in BACKENDS.items():
        table.add_row(name, spec.description, status[name] + (" (reference)" if name == reference else ""))
    console.print(table)
    pools = ", ".join(f"{p}: {int((batch.pool_index == i).sum())} rows" for i, p in enumerate(batch.pool_names))
    console.print(f"batch: {batch.batch_size} rows x {batch.input_ids.shape[1]} positions, "
                  f"{int(batch.loss_mask.sum())} trainable tokens, support width {batch.support_ids.shape[2]} ({pools})")
    table = Table(title="hetrl parity")
    for col in ("check", "backends", "statistic", "value", "tolerance", "status", "note"):
        table.add_column(col, justify="right" if col in ("value", "tolerance") else "left")
    colors = {"PASS": "green", "FAIL": "bold red", "absent": "yellow"}
    for r in rows:
        table.add_row(r.check, " vs ".join(str(b) for b in r.backends), r.statistic,
                      "—" if r.value is None else f"{r.value:.2e}", f"{r.tolerance:.0e}",
                      f"[{colors[r.status]}]{r.status}[/]", r.note)
    console.print(table)
    checked = [r for r in rows if r.status != "absent"]
    passed = bool(checked) and all(r.status == "PASS" for r in checked)
    if json_path is not None:
        payload = dict(
            checkpoint=None if checkpoint is None else str(checkpoint), passed=passed, reference=reference,
            backends=status, batch=dict(rows=batch.batch_size, positions=int(batch.input_ids.shape[1]),
                                        trainable_tokens=int(batch.loss_mask.sum()), pools=list(batch.pool_names)),
            rows=[dict(asdict(r), backends=list(r.backends), status=r.status,
                       value=None if r.value is None or math.isnan(r.value) else r.value) for r in rows],
        )
        pathlib.Path(json_path).write_text(json.dumps(payload, indent=1))
    return 0 if passed else 1


# ====================================================================== the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None,
                        help="HF checkpoint directory (config.json + safetensors); default: a tiny one built in a temp dir")
    parser.add_argument("--model", choices=sorted(TINY_MODELS), default=None,
                        help="architecture of the tiny default checkpoint (default qwen3; not with --checkpoint)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch (prompts, sampling)")
    parser.add_argument("--json", type=pathlib.Path, default=None, metavar="PATH", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Load every backend, build the batch, check, report; exit 0 iff every checked row passes
    (2 on a bad argument)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.checkpoint is not None and args.model is not None:
        console.print("hetrl parity: --model picks the tiny default checkpoint; it cannot be combined with --checkpoint")
        return 2
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        console.print(f"hetrl parity: --checkpoint {args.checkpoint}: no config.json there (expected an HF checkpoint directory)")
        return 2
    with tempfile.TemporaryDirectory(prefix="hetrl-parity-") as tmp:
        checkpoint = args.checkpoint or build_parity_checkpoint(pathlib.Path(tmp) / "tiny", TINY_MODELS[args.model or "qwen3"])
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("parity", total=len(BACKENDS) + 2)
            finished = iter(range(len(BACKENDS) + 2))

            def stage(description: str) -> None:
                progress.update(task, description=description, completed=next(finished))

            backends = load_backends(checkpoint, on_load=lambda name: stage(f"loading {name}"))
            stage("sampling the batch")
            batch = parity_batch(checkpoint, backends.get("embedded"), args.seed)
            stage("comparing")
            rows = check(backends, batch)
        label = str(args.checkpoint) if args.checkpoint is not None else f"tiny {args.model or 'qwen3'}, built in a temp dir"
        return report(rows, backends, batch, console, args.json, label)
