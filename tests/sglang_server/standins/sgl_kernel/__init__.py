"""Pure-torch stand-in for SGLang's kernel package, pinned to SGLang 0.5.23 on CPU.

What this is: NOT the real ``sgl-kernel`` / ``sglang-kernel``. PyPI only ships CUDA
builds of that package, so on this CPU-only test machine there is nothing to install.
SGLang 0.5.23 run with ``SGLANG_USE_CPU_ENGINE=1`` imports a handful of ``*_cpu``
names from ``sgl_kernel`` at module load time (see the list below) and calls
``torch.ops.sgl_kernel.murmur_hash32_cpu`` for seeded sampling (``sampling_seed``).
This module provides exactly those names so that ``python -m sglang.launch_server
--device cpu`` can serve a small dense model (Qwen3) for hetrl's integration tests.

Names imported by sglang 0.5.23 under ``is_cpu()`` (found by an AST scan of its source):

* ``assign_req_to_token_pool_cpu``   sglang/srt/mem_cache/allocation.py (plain generation:
  implemented here)
* ``copy_all_layer_kv_cache_cpu``    sglang/kernels/ops/kvcache/cache_move.py (KV-slot moves,
  speculative decoding: implemented here, a byte copy through raw pointers)
* ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``
  (speculative/cache_locs.py), ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu``
  (speculative/eagle.py), ``rotate_input_ids_cpu`` (speculative/multi_layer_eagle.py),
  ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu`` (speculative/spec_tree.py),
  ``build_draft_decode_metadata_cpu`` (intel_amx_backend.py, lazily): speculative decoding
  only; they raise NotImplementedError.
* ``sgl_kernel.mamba``: ``causal_conv1d_fn_cpu``, ``causal_conv1d_update_cpu``,
  ``chunk_gated_delta_rule_cpu`` (linear-attention models only): NotImplementedError.

It deliberately does NOT register ``torch.ops.sgl_kernel.convert_weight_packed``, so SGLang's
Intel-AMX path (``cpu_has_amx_support()``) stays off and every layer uses its torch-native
fallback. A different SGLang version may import other names: re-run the scan in
tests/sglang_server/README.md and update this file with the version pin.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+hetrl.standin.sglang-0.5.23"
STANDIN_FOR_SGLANG = "0.5.23"


def _not_implemented(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is hetrl's pure-torch CPU stand-in for "
            "sgl-kernel (tests/sglang_server/standins), which only supports plain generation, "
            "not speculative decoding or linear-attention models."
        )

    fn.__name__ = name
    fn.__qualname__ = name
    return fn


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc.

    Same semantics as the triton kernel ``assign_req_to_token_pool`` in
    sglang/srt/mem_cache/allocation.py: out_cache_loc holds the new slots of all
    requests back to back, in request order."""
    del pool_len  # the row length; req_to_token already knows its shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For each buffer (base address, row bytes): row[tgt_loc[j]] = row[src_loc[j]].

    Same semantics as ``copy_all_layer_kv_cache_tiled`` in
    sglang/kernels/ops/kvcache/cache_move.py: all source rows are read before any target
    row is written, so overlapping moves are safe."""
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    if tgt.numel() == 0:
        return
    nrows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (nrows * int(stride))).from_address(int(ptr))
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(nrows, int(stride))
        rows[tgt] = rows[src].clone()


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    m = 0xFFFFFFFF
    k = (k * 0xCC9E2D51) & m
    k = ((k << 15) | (k >> 17)) & m
    k = (k * 0x1B873593) & m
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & m
    return (h * 5 + 0xE6546B64) & m


def _murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[n, m] uint32 hashes; mirrors ``murmur_hash32_kernel`` (sglang/kernels/ops/sampling/
    murmur_hash.py) bit for bit. Arithmetic is in int64: only the low 32 bits of each product
    are kept, and those survive int64 wrap-around."""
    m = 0xFFFFFFFF
    s = seed.to(torch.int64)
    seed_lo = (s & m)[:, None]
    seed_hi = ((s >> 32) & m)[:, None]
    pos = (positions.to(torch.int64) & m)[:, None]
    col = (col_indices.to(torch.int64) & m)[None, :]
    h = torch.zeros((), dtype=torch.int64)
    h = _murmur3_mix(h, seed_lo)
    h = _murmur3_mix(h, seed_hi)
    h = _murmur3_mix(h, pos)
    h = _murmur3_mix(h, col)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & m
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & m
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


# torch.ops.sgl_kernel.murmur_hash32_cpu (called by sglang/kernels/ops/sampling/murmur_hash.py
# when a request sets sampling_params.sampling_seed on CPU).
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
if not hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
    _LIB.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    _LIB.impl("murmur_hash32_cpu", _murmur_hash32, "CompositeExplicitAutograd")


assign_draft_cache_locs_contiguous_cpu = _not_implemented("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_implemented("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _not_implemented("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_implemented("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _not_implemented("rotate_input_ids_cpu")
build_tree_kernel_efficient_cpu = _not_implemented("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_implemented("verify_tree_greedy_cpu")
build_draft_decode_metadata_cpu = _not_implemented("build_draft_decode_metadata_cpu")
