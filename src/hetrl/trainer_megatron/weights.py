"""HF <-> megatron-core weight mapping for the Qwen2/Qwen3 ``GPTModel`` of :mod:`.model`.

HF names (``dict[str, np.ndarray]``, see :mod:`hetrl.models.hf_io`) map to the state-dict names of
the local-spec GPTModel (layer ``i`` of HF is local layer ``i - layer_offset`` of a pipeline stage):

====================================================  ==================================================
HF                                                    megatron (``decoder.layers.{i}.`` prefix omitted)
====================================================  ==================================================
``model.embed_tokens.weight`` [V, H]                  ``embedding.word_embeddings.weight`` (first stage)
``input_layernorm.weight`` [H]                        ``input_layernorm.weight``
``self_attn.{q,k,v}_proj.weight`` / ``.bias``         ``self_attention.linear_qkv.weight`` / ``.bias``
``self_attn.o_proj.weight`` [H, nh·d]                 ``self_attention.linear_proj.weight``
``self_attn.{q,k}_norm.weight`` [d] (Qwen3)           ``self_attention.{q,k}_layernorm.weight``
``post_attention_layernorm.weight`` [H]               ``pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj.weight`` [I, H]                  ``mlp.linear_fc1.weight`` [2I, H] = [gate; up]
``mlp.down_proj.weight`` [H, I]                       ``mlp.linear_fc2.weight``
``model.norm.weight`` [H]                             ``decoder.final_layernorm.weight`` (last stage)
``lm_head.weight`` [V, H] (untied)                    ``output_layer.weight`` (last stage)
====================================================  ==================================================

The fused QKV is grouped per query group: with ``r = nh / ng`` query heads per KV head and head
size ``d``, rows ``[g·(r+2)·d, (g+1)·(r+2)·d)`` of ``linear_qkv`` hold, in order, query heads
``g·r … g·r+r-1``, key head ``g`` and value head ``g`` (the same for the bias). In the local spec the
RMSNorm weights are their own modules (``input_layernorm``, ``pre_mlp_layernorm``); only megatron's
*distributed checkpoint* renames them to ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``. Tied embeddings: the output layer reuses the embedding, and
on a last pipeline stage that is not also the first, ``output_layer.weight`` is megatron's copy of
the embedding.

Tensor parallelism (``tp`` ranks): column-parallel weights (embedding and output layer by
vocabulary rows, ``linear_qkv`` by whole query groups, ``linear_fc1`` as ``[gate_r; up_r]``) are
split along dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1, norms are
replicated. The mapping only moves and concatenates values, so HF -> megatron -> HF is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np
import torch

from hetrl.models import ModelConfig, check_state_dict

__all__ = ["StageLayout", "hf_to_megatron", "megatron_to_hf", "megatron_to_hf_units", "tensor_to_numpy"]


@dataclass(frozen=True)
class StageLayout:
    """Which part of the model one pipeline stage holds: HF layers ``[layer_offset,
    layer_offset + num_layers)`` and the embedding (first stage) / final norm and output layer
    (last stage)."""

    layer_offset: int
    num_layers: int
    first: bool
    last: bool

    @classmethod
    def whole(cls, config: ModelConfig) -> "StageLayout":
        return cls(0, config.num_hidden_layers, True, True)


_ATTN, _MLP = "self_attention.", "mlp."
# (HF suffix, megatron suffix, tensor-parallel split dim or None) for the one-to-one tensors of a layer
_LAYER_DIRECT = (
    ("input_layernorm.weight", "input_layernorm.weight", None),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", None),
    ("self_attn.o_proj.weight", _ATTN + "linear_proj.weight", 1),
    ("self_attn.q_norm.weight", _ATTN + "q_layernorm.weight", None),
    ("self_attn.k_norm.weight", _ATTN + "k_layernorm.weight", None),
    ("mlp.down_proj.weight", _MLP + "linear_fc2.weight", 1),
)


def _fuse_qkv(config: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[nh·d, ...], [ng·d, ...], [ng·d, ...] -> grouped [(nh + 2ng)·d, ...]."""
    ng, d = config.num_key_value_heads, config.head_dim
    r = config.num_attention_heads // ng
    rest = q.shape[1:]
    groups = torch.cat([q.reshape(ng, r * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return groups.reshape(ng * (r + 2) * d, *rest)


def _split_qkv(config: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    ng, d = config.num_key_value_heads, config.head_dim
    r = config.num_attention_heads // ng
    rest = qkv.shape[1:]
    groups = qkv.reshape(ng, (r + 2) * d, *rest)
    q, k, v = torch.split(groups, [r * d, d, d], dim=1)
    return q.reshape(ng * r * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def _chunk(t: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    if dim is None or size == 1:
        return t
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over {size} tensor-parallel ranks")
    return torch.chunk(t, size, dim=dim)[rank]


def _check_tp(config: ModelConfig, tp_size: int) -> None:
    for what, n in (("num_key_value_heads", config.num_key_value_heads), ("vocab_size", config.vocab_size),
                    ("intermediate_size", config.intermediate_size)):
        if n % tp_size:
            raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {tp_size}")


def hf_to_megatron(
    config: ModelConfig,
    hf: Mapping[str, np.ndarray],
    layout: StageLayout | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (pipeline stage, tensor-parallel rank) from a full HF
    state dict (checked with :func:`hetrl.models.check_state_dict`). Tensors keep their dtype
    (float32 stays float32; ``ml_dtypes.bfloat16`` becomes ``torch.bfloat16``)."""
    check_state_dict(config, hf)
    _check_tp(config, tp_size)
    layout = layout or StageLayout.whole(config)
    t = {name: _to_torch(arr) for name, arr in hf.items()}
    out: dict[str, torch.Tensor] = {}
    if layout.first:
        out["embedding.word_embeddings.weight"] = _chunk(t["model.embed_tokens.weight"], 0, tp_rank, tp_size)
    for local in range(layout.num_layers):
        src, dst = f"model.layers.{layout.layer_offset + local}.", f"decoder.layers.{local}."
        for hf_suffix, mc_suffix, dim in _LAYER_DIRECT:
            if src + hf_suffix in t:
                out[dst + mc_suffix] = _chunk(t[src + hf_suffix], dim, tp_rank, tp_size)
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = (t[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}{_ATTN}linear_qkv.{kind}"] = _chunk(_fuse_qkv(config, q, k, v), 0, tp_rank, tp_size)
        gate, up = (_chunk(t[f"{src}mlp.{p}_proj.weight"], 0, tp_rank, tp_size) for p in ("gate", "up"))
        out[f"{dst}{_MLP}linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if layout.last:
        out["decoder.final_layernorm.weight"] = t["model.norm.weight"]
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        if not config.tie_word_embeddings or not layout.first:
            out["output_layer.weight"] = _chunk(t[head], 0, tp_rank, tp_size)
    return out


def megatron_to_hf(
    config: ModelConfig, shards: Sequence[Mapping[str, torch.Tensor]], layout: StageLayout | None = None
) -> dict[str, np.ndarray]:
    """HF tensors of one pipeline stage from its megatron state dicts, one per tensor-parallel
    rank in rank order (a single dict without tensor parallelism). Inverse of
    :func:`hf_to_megatron`; on the whole model the result passes ``check_state_dict``."""
    units = megatron_to_hf_units(config, list(shards[0]), lambda names: [{n: s[n] for n in names} for s in shards], layout)
    return {name: value for unit in units for name, value in unit.items()}


_Merged = Callable[[str, int | None], torch.Tensor]
"""``merged(name, dim)``: megatron tensor ``name`` joined over the tensor-parallel ranks along ``dim``
(``None``: replicated, rank 0's)."""
_Convert = Callable[[_Merged, Sequence[Mapping[str, torch.Tensor]]], dict[str, torch.Tensor]]
"""One unit's mapping: ``convert(merged, shards) -> {HF name: tensor}``."""


def megatron_to_hf_units(
    config: ModelConfig, names: Sequence[str], gather: Callable[[Sequence[str]], Sequence[Mapping[str, torch.Tensor]]],
    layout: StageLayout | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """:func:`megatron_to_hf` a unit at a time (the embedding, each layer, the final norm and
    output layer), so that no more than one unit's gathered shards and HF tensors are held at
    once. ``names``: the stage's megatron state-dict names; ``gather(unit_names)``: those
    tensors of every tensor-parallel rank, in rank order (a collective where there are several:
    every rank must consume the whole iterator)."""
    layout = layout or StageLayout.whole(config)

    def unit(unit_names: Sequence[str], convert: _Convert) -> dict[str, np.ndarray]:
        shards = gather(unit_names)
        _check_tp(config, len(shards))

        def merged(name: str, dim: int | None) -> torch.Tensor:
            return shards[0][name] if dim is None or len(shards) == 1 else torch.cat([s[name] for s in shards], dim=dim)

        return {name: tensor_to_numpy(value) for name, value in convert(merged, shards).items()}

    if layout.first:
        yield unit(["embedding.word_embeddings.weight"],
                   lambda merged, _: {"model.embed_tokens.weight": merged("embedding.word_embeddings.weight", 0)})
    for local in range(layout.num_layers):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layout.layer_offset + local}."
        yield unit([n for n in names if n.startswith(src)], partial(_layer_to_hf, config, src, dst))
    if layout.last:
        final = [n for n in ("decoder.final_layernorm.weight", "output_layer.weight") if n in names]
        yield unit(final, partial(_final_to_hf, config, layout))


def _layer_to_hf(config: ModelConfig, src: str, dst: str, merged: _Merged,
                 shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF tensors of the layer whose megatron names start with ``src`` (HF prefix ``dst``)."""
    out: dict[str, torch.Tensor] = {}
    for hf_suffix, mc_suffix, dim in _LAYER_DIRECT:
        if src + mc_suffix in shards[0]:
            out[dst + hf_suffix] = merged(src + mc_suffix, dim)
    for kind in ("weight", "bias") if config.attention_bias else ("weight",):
        q, k, v = _split_qkv(config, merged(f"{src}{_ATTN}linear_qkv.{kind}", 0))
        out.update({f"{dst}self_attn.q_proj.{kind}": q, f"{dst}self_attn.k_proj.{kind}": k,
                    f"{dst}self_attn.v_proj.{kind}": v})
    pairs = [torch.chunk(s[f"{src}{_MLP}linear_fc1.weight"], 2, dim=0) for s in shards]
    out[f"{dst}mlp.gate_proj.weight"] = torch.cat([g for g, _ in pairs], dim=0)
    out[f"{dst}mlp.up_proj.weight"] = torch.cat([u for _, u in pairs], dim=0)
    return out


def _final_to_hf(config: ModelConfig, layout: StageLayout, merged: _Merged,
                 shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF tensors of a last stage's final norm and output layer (the embedding's copy when tied
    on a stage that does not hold the embedding)."""
    out = {"model.norm.weight": merged("decoder.final_layernorm.weight", None)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = merged("output_layer.weight", 0)
    elif not layout.first:
        out["model.embed_tokens.weight"] = merged("output_layer.weight", 0)
    return out


def _to_torch(arr: np.ndarray) -> torch.Tensor:
    arr = np.ascontiguousarray(arr)
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A detached CPU copy as numpy (``torch.bfloat16`` -> ``ml_dtypes.bfloat16``)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()
