"""Accelerator profiles: the catalogue, native-format validation, the mapping to model Numerics."""

import jax.numpy as jnp
import pytest
from pydantic import ValidationError

from hetrl.core.precision import FORMATS
from hetrl.samplers.profiles import (
    CATALOGUE,
    REFERENCE_KIND,
    AcceleratorProfile,
    SamplerNumerics,
    WEIGHT_FORMAT_SPEEDUP,
    get_profile,
    pool_numerics,
    sampler_numerics,
)

REQUIRED = ("b200", "h200", "h100", "a100", "l40s", "mi300x", "tpu-v6e", "tpu-v5e")


def test_catalogue_has_every_required_kind_with_sane_fields():
    for kind in REQUIRED:
        p = CATALOGUE[kind]
        assert p.kind == kind
        assert "bf16" in p.weight_formats and "bf16" in p.kv_formats
        assert p.compute_dtype == "bf16" and p.accum_dtype == "fp32"
        assert p.price_per_hour_usd > 0 and p.relative_throughput > 0
        assert set(p.weight_formats) <= set(FORMATS) and set(p.kv_formats) <= set(FORMATS)
    ref = CATALOGUE[REFERENCE_KIND]
    assert ref.weight_formats == ("fp32",) and ref.compute_dtype == ref.softmax_dtype == "fp32"


@pytest.mark.parametrize("kind, native, foreign", [
    ("b200", ["bf16", "fp8_e4m3", "nvfp4", "mxfp4"], []),
    ("h200", ["bf16", "fp8_e4m3", "fp8_e4m3_block"], ["nvfp4", "fp8_e4m3fnuz"]),
    ("h100", ["bf16", "fp8_e4m3"], ["nvfp4", "mxfp4"]),
    ("a100", ["bf16", "int8"], ["fp8_e4m3", "fp8_e4m3_block", "nvfp4"]),
    ("l40s", ["bf16", "fp8_e4m3"], ["nvfp4"]),
    ("mi300x", ["bf16", "fp8_e4m3fnuz"], ["fp8_e4m3", "nvfp4"]),
    ("tpu-v6e", ["bf16", "int8"], ["fp8_e4m3", "nvfp4"]),
    ("tpu-v5e", ["bf16", "int8"], ["fp8_e4m3"]),
])
def test_native_weight_formats(kind, native, foreign):
    for fmt in native:
        assert sampler_numerics(kind, fmt).weight_format == fmt
    for fmt in foreign:
        with pytest.raises(ValidationError, match=rf"accelerator '{kind}' does not run weight format '{fmt}' natively"):
            sampler_numerics(kind, fmt)


def test_kv_format_validation_names_kind_and_format():
    assert sampler_numerics("h100", "fp8_e4m3", "fp8_e4m3").kv_format == "fp8_e4m3"
    assert sampler_numerics("b200", "nvfp4", "nvfp4").name == "b200-nvfp4-nvfp4"
    with pytest.raises(ValidationError, match="accelerator 'a100' does not run KV-cache format 'fp8_e4m3' natively"):
        sampler_numerics("a100", "bf16", "fp8_e4m3")
    with pytest.raises(ValidationError, match="accelerator 'mi300x' does not run KV-cache format 'fp8_e4m3'"):
        SamplerNumerics(profile=CATALOGUE["mi300x"], weight_format="bf16", kv_format="fp8_e4m3")


def test_unknown_kind_and_format_are_refused():
    with pytest.raises(ValueError, match="unknown accelerator kind 'v100'"):
        get_profile("v100")
    with pytest.raises(ValidationError, match="unknown format 'fp6'"):
        AcceleratorProfile(kind="x", weight_formats=("bf16", "fp6"), kv_formats=("bf16",),
                           price_per_hour_usd=1.0, spot_price_per_hour_usd=0.5, relative_throughput=1.0)


def test_overrides_revalidate():
    p = get_profile("h100", price_per_hour_usd=2.49)
    assert p.price_per_hour_usd == 2.49 and CATALOGUE["h100"].price_per_hour_usd != 2.49
    assert sampler_numerics("h100", reduction_chunks=8).profile.reduction_chunks == 8
    with pytest.raises(ValidationError):
        get_profile("h100", price_per_hour_usd=-1.0)


def test_model_numerics_mapping():
    ref = sampler_numerics(REFERENCE_KIND).model_numerics()
    assert (ref.compute_dtype, ref.accum_dtype, ref.softmax_dtype, ref.kv_format, ref.reduction_chunks) == (
        jnp.float32, jnp.float32, jnp.float32, "fp32", 1)
    b200 = sampler_numerics("b200", "nvfp4", "fp8_e4m3").model_numerics()
    assert (b200.compute_dtype, b200.accum_dtype, b200.softmax_dtype, b200.kv_format) == (
        jnp.bfloat16, jnp.float32, jnp.float32, "fp8_e4m3")
    assert b200.reduction_chunks == CATALOGUE["b200"].reduction_chunks
    assert sampler_numerics("tpu-v6e").model_numerics().softmax_dtype == jnp.bfloat16
    # the kinds do not all compute alike: several distinct (softmax, chunks) variants
    variants = {(CATALOGUE[k].softmax_dtype, CATALOGUE[k].reduction_chunks) for k in REQUIRED}
    assert len(variants) >= 3


def test_sampler_info_throughput_and_cost():
    n = sampler_numerics("b200", "nvfp4")
    info = n.sampler_info()
    assert (info.pool, info.accelerator, info.weight_precision, info.kv_precision, info.engine) == (
        "b200-nvfp4-bf16", "b200", "nvfp4", "bf16", "embedded")
    assert info.activation_precision == "nvfp4" and sampler_numerics("b200").sampler_info().activation_precision == "none"
    assert n.sampler_info("pool-a", engine="sglang").pool == "pool-a"
    assert n.relative_throughput() > sampler_numerics("b200").relative_throughput() > sampler_numerics("h100").relative_throughput()
    assert n.cost_per_hour() == CATALOGUE["b200"].price_per_hour_usd
    assert n.param_format == "bf16" and sampler_numerics(REFERENCE_KIND).param_format == "fp32"


@pytest.mark.parametrize("kind, weight, served", [
    ("h100", "fp8_e4m3", "fp8_e4m3"),        # FP8 W8A8, per-token dynamic activation scales
    ("h200", "fp8_e4m3_block", "fp8_e4m3_g128"),  # 128 x 128 block weights, 1 x 128 activation groups
    ("mi300x", "fp8_e4m3fnuz", "fp8_e4m3fnuz"),
    ("b200", "nvfp4", "nvfp4"),              # W4A4
    ("b200", "mxfp4", "none"),
    ("a100", "int8", "int8"),                # INT8 W8A8 per token on GPUs
    ("tpu-v6e", "int8", "none"),             # weight-only int8 on TPUs
    ("h100", "bf16", "none"),
    ("fp32", "fp32", "none"),
])
def test_default_activation_format_is_what_engines_serve(kind, weight, served):
    n = sampler_numerics(kind, weight)
    assert n.activation_format == served
    assert n.model_numerics().activation_format == served
    assert served in CATALOGUE[kind].activation_formats


def test_activation_format_validation_names_kind_and_format():
    assert sampler_numerics("h100", "fp8_e4m3", activation_format="none").activation_format == "none"
    assert sampler_numerics("b200", "bf16", activation_format="nvfp4").model_numerics().activation_format == "nvfp4"
    with pytest.raises(ValidationError, match="accelerator 'h100' does not run activation format 'nvfp4' natively"):
        sampler_numerics("h100", "fp8_e4m3", activation_format="nvfp4")
    with pytest.raises(ValidationError, match="accelerator 'a100' does not run activation format 'fp8_e4m3'"):
        sampler_numerics("a100", "int8", activation_format="fp8_e4m3")
    with pytest.raises(ValidationError, match="activation format 'fp7'"):
        sampler_numerics("b200", "bf16", activation_format="fp7")


@pytest.mark.parametrize("kind", sorted(CATALOGUE))
@pytest.mark.parametrize("mode", ["on_demand", "spot"])
def test_pool_numerics_override_the_price_of_its_mode_only(kind, mode):
    base = sampler_numerics(kind)
    other = "spot" if mode == "on_demand" else "on_demand"
    n = pool_numerics(kind, None, None, None, mode, price_per_hour_usd=0.123, relative_throughput=2.5)
    assert n.cost_per_hour(mode) == 0.123
    assert n.cost_per_hour(other) == base.cost_per_hour(other)
    assert n.relative_throughput() == pytest.approx(2.5 * WEIGHT_FORMAT_SPEEDUP[n.weight_format])
    assert pool_numerics(kind, None, None, None, mode) == base
