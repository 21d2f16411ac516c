"""What ``hetrl fleet simulate`` simulates: a model, a trainer, a workload and sampler pools.

A :class:`SimConfig` (YAML; ``extra`` keys are refused) describes one asynchronous run at
cluster scale. The physical models, each a documented modelling choice rather than a
measurement:

* **Decode throughput** of a replica: ``tokens/s = reference_tokens_per_s x relative_throughput
  x accelerators_per_replica``, with ``relative_throughput`` the pool's profile and weight
  format (:meth:`hetrl.samplers.profiles.SamplerNumerics.relative_throughput`, H100-bf16 = 1)
  and ``reference_tokens_per_s`` the decode tokens/s of one H100 in bf16 for this model
  (default :meth:`SimConfig.reference_tps`: memory-bound decode, ``max_batch`` sequences per
  weight read at 50% of the H100's 3.35 TB/s: ``0.5 · 3.35e12 · max_batch / (2 · params)``).
  A replica generates its whole batch in ``batch tokens / tokens/s`` (the fleet's modelled
  clock, :class:`hetrl.samplers.fleet.FleetConfig`).
* **Weight sync**: a replica whose weights are older than the newest published ones first loads
  them: ``sync_overhead_s + 2 · params bytes / (link_gbps · 1e9 / 8)`` (bf16 weights over the
  pool's link).
* **Trainer step**: ``6 · active params · step tokens / (count · peak · mfu) + step_overhead_s``,
  with ``peak`` the trainer accelerator's dense bf16 FLOP/s (:data:`PEAK_BF16_TFLOPS`, vendor
  datasheets) and ``step tokens = batch_groups · group_size · (prompt + response tokens)``.
* **Responses**: each sample's length is drawn from a gamma distribution of mean
  ``response_tokens`` and coefficient of variation ``response_cv`` (capped at ``max_tokens``).
* **Preemption** (spot pools): each replica is preempted at a Poisson rate
  ``preemptions_per_hour``; its work in flight is lost (billed) and re-queued, and it is back,
  weights reloaded, ``restart_s`` later (not billed while away).
* **Mismatch**: a pool's masked fraction (the share of its trained tokens the correction masks
  out) is ``masked_fraction`` if given, else the measured table :func:`masked_fraction`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetrl.config import load_yaml
from hetrl.errors import UserError
from hetrl.samplers.profiles import PriceMode, SamplerNumerics, known_kind, pool_numerics, sampler_numerics

__all__ = ["PEAK_BF16_TFLOPS", "WEIGHT_MASKED", "KV_MASKED", "reference_tps", "masked_fraction", "ModelSpec", "TrainerSpec",
           "WorkloadSpec", "SimPool", "SimConfig", "load_yaml_model",
           "load_sim_config"]

#: Dense bf16 tensor-core / MXU peak, TFLOP/s per accelerator (vendor datasheets, without sparsity).
PEAK_BF16_TFLOPS: dict[str, float] = {
    "b200": 2250.0, "h200": 989.0, "h100": 989.0, "a100": 312.0, "l40s": 362.0, "mi300x": 1307.0,
    "tpu-v6e": 918.0, "tpu-v5e": 197.0,
}

#: Masked fraction (``mismatch/masked_frac/any`` under the ``hetrl`` correction preset) by weight
#: format, measured on the tiny Qwen3 of the default experiment grid (docs/results/default:
#: bf16 pools 0.0007-0.0022, fp8 pools 0.0023-0.0097, int8 0-0.0052, b200-nvfp4 0.077-0.080),
#: weights-only quantization (measured before pools quantized activations too).
WEIGHT_MASKED: dict[str, float] = {
    "fp32": 0.0, "bf16": 0.0015, "fp16": 0.0015, "fp8_e4m3": 0.007, "fp8_e4m3_block": 0.007,
    "fp8_e4m3fnuz": 0.007, "int8": 0.0026, "nvfp4": 0.078, "mxfp4": 0.078,
}
#: Added for the KV-cache format, from the same grid's partial-alignment arms (bf16 weights with
#: an fp8 KV cache: +0.004 to +0.010; int8: +0.0003 to +0.006). nvfp4 KV is not measured: set to
#: the fp8 figure x 3, an extrapolation.
KV_MASKED: dict[str, float] = {
    "fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "fp8_e4m3": 0.009, "fp8_e4m3_block": 0.009, "fp8_e4m3fnuz": 0.009,
    "int8": 0.004, "nvfp4": 0.027, "mxfp4": 0.027,
}

_H100_BYTES_PER_S = 3.35e12

M = TypeVar("M", bound=BaseModel)


def reference_tps(model: "ModelSpec", max_batch: int, override: float | None = None) -> float:
    """Decode tokens/s of one H100 in bf16 for ``model``: ``override``, else memory-bound decode
    of ``max_batch`` sequences per weight read at 50% of 3.35 TB/s (see the module docstring)."""
    return override if override is not None else 0.5 * _H100_BYTES_PER_S * max_batch / (2.0 * model.params)


def masked_fraction(weight_format: str, kv_format: str) -> float:
    """The measured-table masked fraction of a pool: ``WEIGHT_MASKED[weight] + KV_MASKED[kv]``."""
    return WEIGHT_MASKED[weight_format] + KV_MASKED[kv_format]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSpec(_Strict):
    """The policy: ``params_b`` billions of parameters (what is synced and read per decode step)
    and ``active_params_b`` of them active per token (MoE; default all), for the trainer's FLOPs."""

    name: str = "model"
    params_b: float = Field(gt=0.0, allow_inf_nan=False)
    active_params_b: float | None = Field(None, gt=0.0, allow_inf_nan=False)

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def active_params(self) -> float:
        return (self.active_params_b or self.params_b) * 1e9


class TrainerSpec(_Strict):
    """``count`` trainer accelerators of ``accelerator`` at ``mfu`` of their bf16 peak
    (``peak_tflops`` overrides :data:`PEAK_BF16_TFLOPS`); they are billed on rented time at the
    ``price`` mode's rate. ``step_overhead_s``: per step, beyond the FLOPs (optimizer, export)."""

    accelerator: str = "b200"
    count: int = Field(8, ge=1)
    mfu: float = Field(0.35, gt=0.0, le=1.0)
    peak_tflops: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    step_overhead_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    step_s: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="fixed step time (overrides the FLOPs model)")
    price: PriceMode = "on_demand"

    @field_validator("accelerator")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in PEAK_BF16_TFLOPS:
            raise ValueError(f"unknown trainer accelerator {v!r}; known: {', '.join(PEAK_BF16_TFLOPS)}")
        return v

    def price_per_s(self) -> float:
        """USD per second for all ``count`` accelerators."""
        return self.count * sampler_numerics(self.accelerator).cost_per_hour(self.price) / 3600.0

    def step_time(self, model: ModelSpec, step_tokens: float) -> float:
        """Seconds per training step (see the module docstring)."""
        if self.step_s is not None:
            return self.step_s
        peak = (self.peak_tflops or PEAK_BF16_TFLOPS[self.accelerator]) * 1e12
        return 6.0 * model.active_params * step_tokens / (self.count * peak * self.mfu) + self.step_overhead_s


class WorkloadSpec(_Strict):
    """The loop's shape: ``batch_groups`` groups of ``group_size`` samples per step, ``steps``
    steps, ``max_staleness`` and ``stale_policy`` as in ``async`` of a run config; prompt and
    response lengths in tokens (responses gamma-distributed, see the module docstring)."""

    prompt_tokens: int = Field(512, ge=0)
    response_tokens: float = Field(1024.0, gt=0.0, allow_inf_nan=False)
    response_cv: float = Field(0.5, ge=0.0, allow_inf_nan=False)
    max_tokens: int = Field(4096, ge=1)
    group_size: int = Field(8, ge=1)
    batch_groups: int = Field(64, ge=1)
    steps: int = Field(50, ge=1)
    max_staleness: int = Field(2, ge=0)
    stale_policy: Literal["drop", "regenerate"] = "drop"


class SimPool(_Strict):
    """A pool: kind, formats (native to the kind, as in :class:`hetrl.samplers.fleet.PoolConfig`),
    replicas, accelerators per replica, price mode (and override), preemption rate, restart
    time, link bandwidth for weight sync, and an optional masked-fraction override."""

    name: str
    accelerator: str
    weight_precision: str | None = None
    kv_precision: str | None = None
    replicas: int = Field(1, ge=0)
    accelerators_per_replica: int = Field(1, ge=1)
    price: PriceMode = "on_demand"
    price_per_hour_usd: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    relative_throughput: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    preemptions_per_hour: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    restart_s: float = Field(120.0, ge=0.0, allow_inf_nan=False)
    link_gbps: float = Field(100.0, gt=0.0, allow_inf_nan=False)
    sync_overhead_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    masked_fraction: float | None = Field(None, ge=0.0, le=1.0)

    @field_validator("accelerator")
    @classmethod
    def _kind(cls, v: str) -> str:
        return known_kind(v)

    @model_validator(mode="after")
    def _native(self) -> "SimPool":
        self.numerics()  # raises naming the kind and the format
        return self

    def numerics(self) -> SamplerNumerics:
        """The pool's numerics, with price (of its mode) and throughput overrides. The activation
        format is what engines serve with the weight format (a simulated pool does not choose
        it: neither its throughput nor the masked-fraction table depends on it)."""
        return pool_numerics(self.accelerator, self.weight_precision, self.kv_precision, None,
                             self.price, self.price_per_hour_usd, self.relative_throughput)

    def capacity(self) -> float:
        """Relative decode throughput of one replica (H100-bf16 accelerators)."""
        return self.numerics().relative_throughput() * self.accelerators_per_replica

    def price_per_s(self) -> float:
        """USD per second of one replica."""
        return self.numerics().cost_per_hour(self.price) * self.accelerators_per_replica / 3600.0

    def masked(self) -> float:
        n = self.numerics()
        return self.masked_fraction if self.masked_fraction is not None else masked_fraction(n.weight_format, n.kv_format)


class SimConfig(_Strict):
    """One simulated run (see the module docstring). ``max_batch``: requests one call of the
    fastest replica takes (slower replicas get proportionally fewer slots, as in the fleet)."""

    name: str = "fleet"
    seed: int = 0
    model: ModelSpec
    trainer: TrainerSpec = TrainerSpec()
    workload: WorkloadSpec = WorkloadSpec()
    pools: tuple[SimPool, ...] = Field(min_length=1)
    max_batch: int = Field(64, ge=1)
    reference_tokens_per_s: float | None = Field(None, gt=0.0, allow_inf_nan=False)

    @field_validator("pools")
    @classmethod
    def _pools(cls, pools: tuple[SimPool, ...]) -> tuple[SimPool, ...]:
        names = [p.name for p in pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(dup)}")
        if not any(p.replicas for p in pools):
            raise ValueError("the fleet has no replicas")
        return pools

    def reference_tps(self) -> float:
        """Decode tokens/s of one H100 in bf16 (:func:`reference_tps`)."""
        return reference_tps(self.model, self.max_batch, self.reference_tokens_per_s)


def load_yaml_model(path: str | Path, model_cls: type[M]) -> M:
    """Read the YAML mapping at ``path`` (:func:`hetrl.config.load_yaml`: a key repeated in one
    map is refused) and validate it as ``model_cls``; a missing file, bad YAML, a non-mapping or
    an invalid key is one :class:`~hetrl.errors.UserError` line naming the file (and, for a
    validation error, the first bad key and the number of errors)."""
    p = Path(path)
    try:
        data = load_yaml(p.read_text())
    except FileNotFoundError:
        raise UserError(f"{p}: no such file") from None
    except yaml.YAMLError as err:
        raise UserError(f"{p}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping at the top level")
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise UserError(f"{p}: {loc}: {first['msg']} ({err.error_count()} error(s))") from None


def load_sim_config(path: str | Path) -> SimConfig:
    """Read and validate a simulator YAML (:func:`load_yaml_model`)."""
    return load_yaml_model(path, SimConfig)
