"""Accelerator profiles: what a sampler pool's hardware computes with (DESIGN §4).

An :class:`AcceleratorProfile` names a kind (``b200``, ``mi300x``, ``tpu-v6e``, ...) and its
numerics: the weight and KV-cache formats its kernels run natively (names of
:data:`hetrl.core.precision.FORMATS`), the activation/compute dtype of the matmuls, the
accumulation dtype, the attention-softmax dtype, and a reduction variant (``reduction_chunks``:
the contraction axis of each matmul is split into that many chunks whose partial sums are
added in the accumulation dtype, like a split-K kernel; different kinds sum in different
orders). It also carries a price per accelerator-hour and a relative decode throughput, for the
fleet's cost accounting.

A pool picks ``profile + weight format + KV format + activation format``:
:class:`SamplerNumerics`, validated against the profile (an fp8 weight on an A100, which has no
FP8 tensor cores, is refused with an error naming the kind and the format).
:meth:`SamplerNumerics.model_numerics` maps it onto the JAX model's ``Numerics`` so the embedded
sampler really computes with those numerics.

The activation format (:data:`hetrl.core.precision.ACTIVATION_FORMATS`) is what the inputs of the
linear layers are rounded to, per token with dynamic scales. By default it is what serving engines
ship for the weight format on that kind (:func:`served_activation_format`): FP8 weights run as
W8A8 with per-token FP8 activations (vLLM / SGLang on Hopper, Ada, Blackwell; FNUZ on MI300),
DeepSeek-style 128 x 128 block FP8 weights with 1 x 128 activation groups, NVFP4 as W4A4 on
Blackwell, INT8 as per-token W8A8 on GPUs; weight-only (``"none"``: activations in the compute
dtype) for bf16 / fp16 / fp32, for MXFP4 and for the formats a kind's engines run weight-only
(:attr:`AcceleratorProfile.weight_only_formats`: INT8 on TPUs, where vLLM's ``tpu_int8`` and
JetStream default to no activation quantization). A kind runs an activation format natively when
it runs the format's tensor-core type: ``fp8_e4m3`` / ``fp8_e4m3_g128`` where it runs FP8
weights, the others where it runs the same weight format.

Which parts of the numerics are hardware facts and which are modelling choices:

* native formats are hardware (tensor-core / MXU support) plus what serving engines ship for it
  (e.g. NVFP4 KV caches on Blackwell in TensorRT-LLM);
* bf16 compute with fp32 accumulation is what every listed kind's tensor cores / MXUs do;
* the softmax dtype and the split-K chunk counts are *representative* choices that differ per
  kind so that pools do not compute bit-identically, as real kernels do not; they are not
  measurements of a particular kernel.

Prices (``price_per_hour_usd``, USD per accelerator per hour) are approximate public on-demand
list prices, rounded, as of 2025: GPU figures from the neocloud / hyperscaler on-demand price
lists (per-node prices divided by the accelerators per node), TPU figures from Google Cloud's
on-demand per-chip-hour prices (us regions). They vary by provider, region and date by 2x or
more: treat them as defaults and override them (:func:`get_profile` takes overrides, a fleet
config can too). Spot / preemptible prices (``spot_price_per_hour_usd``) are approximate public
spot or preemptible list prices of the same providers, rounded, as of 2025 (roughly 40-60% of
on-demand; they move daily); a pool picks one with ``price: on_demand | spot``. Relative
throughput is decode tokens/s relative to an H100 SXM at the same precision, taken as the
HBM-bandwidth ratio (decode is bandwidth-bound; MI300X discounted for software maturity);
:meth:`SamplerNumerics.relative_throughput` adds a per-format factor for the smaller weight reads
of low-precision formats.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.core.precision import ACTIVATION_FORMATS, FORMATS
from hetrl.core.schema import SamplerInfo

__all__ = [
    "DType",
    "PriceMode",
    "AcceleratorProfile",
    "SamplerNumerics",
    "CATALOGUE",
    "REFERENCE_KIND",
    "get_profile",
    "known_kind",
    "sampler_numerics",
    "pool_numerics",
    "served_activation_format",
    "WEIGHT_FORMAT_SPEEDUP",
]

DType = Literal["fp32", "bf16", "fp16"]
PriceMode = Literal["on_demand", "spot"]

#: Decode-throughput factor of a weight format relative to bf16: decode reads every weight once
#: per step, so fewer bytes per weight mean more tokens/s; the factors are below the byte ratios
#: (2x for 8-bit, 4x for 4-bit) because activations, KV reads and dequantization also cost.
WEIGHT_FORMAT_SPEEDUP: dict[str, float] = {
    "fp32": 0.5, "bf16": 1.0, "fp16": 1.0, "fp8_e4m3": 1.5, "fp8_e4m3_block": 1.45, "fp8_e4m3fnuz": 1.5,
    "int8": 1.4, "nvfp4": 2.2, "mxfp4": 2.1,
}


class AcceleratorProfile(BaseModel):
    """One accelerator kind and its native numerics (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(min_length=1)
    description: str = ""
    weight_formats: tuple[str, ...] = Field(min_length=1, description="weight formats run natively")
    kv_formats: tuple[str, ...] = Field(min_length=1, description="KV-cache formats run natively")
    compute_dtype: DType = "bf16"
    accum_dtype: DType = "fp32"
    softmax_dtype: DType = "fp32"
    reduction_chunks: int = Field(1, ge=1, description="split-K chunks of every matmul contraction")
    price_per_hour_usd: float = Field(ge=0.0, allow_inf_nan=False, description="on-demand USD per accelerator-hour")
    spot_price_per_hour_usd: float = Field(ge=0.0, allow_inf_nan=False, description="spot USD per accelerator-hour")
    relative_throughput: float = Field(gt=0.0, allow_inf_nan=False, description="decode tokens/s vs H100 SXM")
    default_weight_format: str = "bf16"
    default_kv_format: str = "bf16"
    weight_only_formats: tuple[str, ...] = Field((), description="weight formats its engines serve weight-only")

    @property
    def activation_formats(self) -> tuple[str, ...]:
        """Activation formats run natively: ``"none"`` and those whose tensor-core type the kind
        runs (``fp8_e4m3`` and ``fp8_e4m3_g128`` with FP8 E4M3 weights, the others with the same
        weight format)."""
        fp8 = "fp8_e4m3" in self.weight_formats
        return ("none",) + tuple(f for f in ACTIVATION_FORMATS[1:]
                                 if f in self.weight_formats or (fp8 and f == "fp8_e4m3_g128"))

    @model_validator(mode="after")
    def _formats(self) -> "AcceleratorProfile":
        for name in ("weight_formats", "kv_formats", "weight_only_formats"):
            unknown = [f for f in getattr(self, name) if f not in FORMATS]
            if unknown:
                raise ValueError(f"profile {self.kind!r}: {name} has unknown format {unknown[0]!r}; known: {', '.join(FORMATS)}")
        if self.default_weight_format not in self.weight_formats:
            raise ValueError(f"profile {self.kind!r}: default_weight_format {self.default_weight_format!r} is not in weight_formats")
        if self.default_kv_format not in self.kv_formats:
            raise ValueError(f"profile {self.kind!r}: default_kv_format {self.default_kv_format!r} is not in kv_formats")
        return self


def _gpu(kind: str, description: str, weights: tuple[str, ...], kv: tuple[str, ...], *, price: float, spot: float,
         throughput: float, chunks: int, softmax: DType = "fp32") -> AcceleratorProfile:
    return AcceleratorProfile(kind=kind, description=description, weight_formats=weights, kv_formats=kv,
                              compute_dtype="bf16", accum_dtype="fp32", softmax_dtype=softmax,
                              reduction_chunks=chunks, price_per_hour_usd=price, spot_price_per_hour_usd=spot,
                              relative_throughput=throughput)


REFERENCE_KIND = "fp32"

_HOPPER_W = ("bf16", "fp16", "fp8_e4m3", "fp8_e4m3_block", "int8")
_HOPPER_KV = ("bf16", "fp16", "fp8_e4m3")

CATALOGUE: dict[str, AcceleratorProfile] = {
    p.kind: p
    for p in (
        # Exact reference for tests: fp32 everywhere, one reduction chunk, no quantization.
        AcceleratorProfile(kind=REFERENCE_KIND, description="exact fp32 reference (tests; not a real accelerator)",
                           weight_formats=("fp32",), kv_formats=("fp32",), compute_dtype="fp32",
                           accum_dtype="fp32", softmax_dtype="fp32", reduction_chunks=1,
                           price_per_hour_usd=0.0, spot_price_per_hour_usd=0.0, relative_throughput=0.05,
                           default_weight_format="fp32", default_kv_format="fp32"),
        # Blackwell: 5th-gen tensor cores run FP8, NVFP4 and MXFP4 natively; TensorRT-LLM ships
        # NVFP4 KV caches. ~$6/GPU-h on-demand (8x HGX B200 nodes); HBM3e 8 TB/s = 2.4x H100.
        _gpu("b200", "NVIDIA B200 (Blackwell)", ("bf16", "fp16", "fp8_e4m3", "fp8_e4m3_block", "nvfp4", "mxfp4", "int8"),
             ("bf16", "fp16", "fp8_e4m3", "nvfp4"), price=6.25, spot=3.50, throughput=2.4, chunks=4),
        # Hopper with HBM3e: same tensor cores and kernels as H100 (FP8, no FP4), so the same
        # numerics; 4.8 TB/s = 1.43x H100.
        _gpu("h200", "NVIDIA H200 (Hopper, 141 GB)", _HOPPER_W, _HOPPER_KV, price=4.50, spot=2.50, throughput=1.43, chunks=2),
        # Hopper: FP8 E4M3 tensor cores (per-channel or DeepSeek-style 128x128 blocks); 3.35 TB/s.
        _gpu("h100", "NVIDIA H100 SXM (Hopper)", _HOPPER_W, _HOPPER_KV, price=3.50, spot=2.00, throughput=1.0, chunks=2),
        # Ampere: BF16 / INT8 tensor cores, no FP8; A100 80 GB SXM, 2.0 TB/s = 0.61x H100.
        _gpu("a100", "NVIDIA A100 80GB (Ampere, no FP8)", ("bf16", "fp16", "int8"), ("bf16", "fp16", "int8"),
             price=2.00, spot=1.10, throughput=0.61, chunks=1),
        # Ada: FP8 tensor cores; GDDR6 864 GB/s = 0.26x H100.
        _gpu("l40s", "NVIDIA L40S (Ada)", ("bf16", "fp16", "fp8_e4m3", "int8"), ("bf16", "fp16", "fp8_e4m3"),
             price=1.60, spot=0.90, throughput=0.26, chunks=2, softmax="bf16"),
        # CDNA3: FP8 in the FNUZ variant (max 240, no negative zero / inf); 5.3 TB/s, discounted to 1.2x.
        _gpu("mi300x", "AMD Instinct MI300X (CDNA3)", ("bf16", "fp16", "fp8_e4m3fnuz", "int8"),
             ("bf16", "fp16", "fp8_e4m3fnuz"), price=3.00, spot=1.80, throughput=1.2, chunks=4),
        # Trillium: MXU runs bf16 and int8 (FP8 arrives natively only with TPU7x, so it is not
        # listed); bf16 VPU, modelled with a bf16 softmax; 1.6 TB/s = 0.48x H100. GCP $2.70/chip-h.
        AcceleratorProfile(kind="tpu-v6e", description="Google TPU v6e (Trillium)", weight_formats=("bf16", "int8"),
                           kv_formats=("bf16", "int8"), compute_dtype="bf16", accum_dtype="fp32",
                           softmax_dtype="bf16", reduction_chunks=2, price_per_hour_usd=2.70, spot_price_per_hour_usd=1.10,
                           relative_throughput=0.48, weight_only_formats=("int8",)),
        # TPU v5e: bf16 and int8 MXU; 819 GB/s = 0.24x H100. GCP $1.20/chip-h.
        AcceleratorProfile(kind="tpu-v5e", description="Google TPU v5e", weight_formats=("bf16", "int8"),
                           kv_formats=("bf16", "int8"), compute_dtype="bf16", accum_dtype="fp32",
                           softmax_dtype="fp32", reduction_chunks=4, price_per_hour_usd=1.20, spot_price_per_hour_usd=0.50,
                           relative_throughput=0.24, weight_only_formats=("int8",)),
    )
}
"""Every known profile by kind."""


def known_kind(kind: str) -> str:
    """``kind`` if it is in :data:`CATALOGUE`; else ValueError naming the known kinds."""
    if kind not in CATALOGUE:
        raise ValueError(f"unknown accelerator kind {kind!r}; known kinds: {', '.join(CATALOGUE)}")
    return kind


def get_profile(kind: str, **overrides: Any) -> AcceleratorProfile:
    """The catalogue profile ``kind`` with fields replaced by ``overrides`` (re-validated), e.g.
    ``get_profile("h100", price_per_hour_usd=2.49)``."""
    known_kind(kind)
    if not overrides:
        return CATALOGUE[kind]
    return AcceleratorProfile.model_validate({**CATALOGUE[kind].model_dump(), **overrides})


_SERVED_ACTIVATIONS: dict[str, str] = {"fp8_e4m3": "fp8_e4m3", "fp8_e4m3fnuz": "fp8_e4m3fnuz",
                                       "fp8_e4m3_block": "fp8_e4m3_g128", "int8": "int8", "nvfp4": "nvfp4"}
"""Weight format -> the activation format engines pair it with (absent: weight-only)."""


def served_activation_format(profile: AcceleratorProfile, weight_format: str) -> str:
    """The activation format serving engines run with ``weight_format`` on ``profile``'s kind
    (see the module docstring); ``"none"`` for weight-only serving."""
    if weight_format in profile.weight_only_formats:
        return "none"
    return _SERVED_ACTIVATIONS.get(weight_format, "none")


class SamplerNumerics(BaseModel):
    """A pool's numerics: a profile plus the weight, KV and activation formats it runs, validated
    against what the profile supports natively. ``activation_format`` None (the default) becomes
    :func:`served_activation_format` of the weight format on validation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: AcceleratorProfile
    weight_format: str
    kv_format: str
    activation_format: str | None = None

    @model_validator(mode="after")
    def _native(self) -> "SamplerNumerics":
        p = self.profile
        if self.activation_format is None and self.weight_format in p.weight_formats:
            object.__setattr__(self, "activation_format", served_activation_format(p, self.weight_format))
        if self.activation_format is not None and self.activation_format not in p.activation_formats:
            raise ValueError(
                f"accelerator {p.kind!r} does not run activation format {self.activation_format!r} natively "
                f"(native activation formats: {', '.join(p.activation_formats)})"
            )
        if self.weight_format not in p.weight_formats:
            raise ValueError(
                f"accelerator {p.kind!r} does not run weight format {self.weight_format!r} natively "
                f"(native weight formats: {', '.join(p.weight_formats)})"
            )
        if self.kv_format not in p.kv_formats:
            raise ValueError(
                f"accelerator {p.kind!r} does not run KV-cache format {self.kv_format!r} natively "
                f"(native KV formats: {', '.join(p.kv_formats)})"
            )
        return self

    @property
    def kind(self) -> str:
        return self.profile.kind

    @property
    def name(self) -> str:
        """``kind-weight-kv``, e.g. ``b200-nvfp4-bf16``: a default pool name."""
        return f"{self.kind}-{self.weight_format}-{self.kv_format}"

    @property
    def param_format(self) -> str:
        """The format of the tensors that stay unquantized (embeddings, norms, LM head, biases):
        the compute dtype."""
        return self.profile.compute_dtype

    def relative_throughput(self) -> float:
        """Decode tokens/s relative to an H100 SXM in bf16."""
        return self.profile.relative_throughput * WEIGHT_FORMAT_SPEEDUP[self.weight_format]

    def cost_per_hour(self, price: PriceMode = "on_demand") -> float:
        """USD per accelerator-hour at the ``on_demand`` or ``spot`` price."""
        return self.profile.spot_price_per_hour_usd if price == "spot" else self.profile.price_per_hour_usd

    def sampler_info(self, pool: str | None = None, engine: str = "embedded", engine_version: str = "") -> SamplerInfo:
        """The :class:`SamplerInfo` rollouts of this pool carry."""
        return SamplerInfo(pool=pool or self.name, accelerator=self.kind, weight_precision=self.weight_format,
                           kv_precision=self.kv_format, activation_precision=self.activation_format, engine=engine,
                           engine_version=engine_version)

    def model_numerics(self):
        """The JAX model's ``Numerics`` for this pool: compute / accumulation / softmax dtypes of
        the profile, the KV format, and the profile's split-K chunk count. Imports jax."""
        import jax.numpy as jnp

        from hetrl.models.qwen_jax import Numerics

        dt: Mapping[str, Any] = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
        p = self.profile
        return Numerics(compute_dtype=dt[p.compute_dtype], accum_dtype=dt[p.accum_dtype],
                        softmax_dtype=dt[p.softmax_dtype], kv_format=self.kv_format,
                        activation_format=self.activation_format, reduction_chunks=p.reduction_chunks)


def sampler_numerics(kind: str, weight_format: str | None = None, kv_format: str | None = None,
                     activation_format: str | None = None, **profile_overrides: Any) -> SamplerNumerics:
    """``SamplerNumerics`` for a catalogue kind; formats default to the profile's defaults, the
    activation format to what engines serve with the weight format."""
    profile = get_profile(kind, **profile_overrides)
    return SamplerNumerics(profile=profile, weight_format=weight_format or profile.default_weight_format,
                           kv_format=kv_format or profile.default_kv_format, activation_format=activation_format)


def pool_numerics(kind: str, weight_format: str | None, kv_format: str | None, activation_format: str | None,
                  price: PriceMode = "on_demand", price_per_hour_usd: float | None = None,
                  relative_throughput: float | None = None) -> SamplerNumerics:
    """A pool's :func:`sampler_numerics`, with its overrides applied to the profile:
    ``price_per_hour_usd`` replaces the price of the pool's ``price`` mode (on-demand or spot),
    ``relative_throughput`` the per-accelerator throughput; None keeps the catalogue's."""
    price_field = "spot_price_per_hour_usd" if price == "spot" else "price_per_hour_usd"
    overrides = {k: v for k, v in ((price_field, price_per_hour_usd), ("relative_throughput", relative_throughput))
                 if v is not None}
    return sampler_numerics(kind, weight_format, kv_format, activation_format, **overrides)
