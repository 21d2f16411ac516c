"""The Qwen2/Qwen3 decoder as a megatron-core ``GPTModel`` (local, non-Transformer-Engine spec).

The layout follows :class:`hetrl.models.ModelConfig` exactly: token embedding, N pre-norm blocks
``x += proj(attn(rope(qk_norm?(q)), rope(qk_norm?(k)), v))`` with RMSNorm and grouped-query
attention (``num_query_groups`` = KV heads, ``kv_channels`` = head_dim, q/k/v biases for Qwen2,
per-head RMS QK-norm for Qwen3), ``x += fc2(silu(gate) * up)`` (SwiGLU, no biases), a final RMSNorm
and an output layer tied to the embedding or not. RoPE is plain (``rotary_base = rope_theta``,
``rotary_percent = 1``, non-interleaved halves as in HF); dropout is zero.

Shapes: ``input_ids`` [B, L] int, ``attention_mask`` [B, L] bool (True = real token). megatron
takes the mask as [B, 1, L, L] bool with True = *masked*, so :func:`attention_mask_4d` builds
``masked[b, 0, i, j] = (j > i) or not key_valid[b, j]``; :func:`forward_logits` returns logits
[B, L, V] in float32 (``logits[b, j]`` predicts ``input_ids[b, j + 1]``, the batch's
``target_ids[b, j]``).

Parallelism: :func:`initialize_parallel` (the entry into megatron) starts ``torch.distributed`` (NCCL with CUDA, gloo
without) and megatron's parallel state for ``tensor × pipeline × data`` ranks (a :class:`MeshConfig` resolved
against the world size). The output layer
gathers the vocabulary (``parallel_output=False``) since the correction needs full-vocabulary
logits.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.nn.functional as F

from hetrl.models import ModelConfig
from hetrl.core.training import MeshConfig
from hetrl.trainer_megatron.cpu_shim import apply_cpu_shim_if_needed

__all__ = [
    "initialize_parallel", "transformer_config", "build_gpt_model", "attention_mask_4d",
    "forward_logits", "unwrap",
]


def _free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_parallel(mesh: MeshConfig = MeshConfig(), seed: int = 0) -> tuple[int, int, int]:
    """Start ``torch.distributed`` (from the usual RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    variables, single-process defaults otherwise) and megatron's parallel state for ``mesh`` on
    its world size, then seed the model-parallel RNG tracker with ``seed``; returns the
    ``(tensor, pipeline, data)`` sizes (data = the mesh's data x fsdp). Idempotent for the same sizes. Without CUDA, the CPU test shim
    is applied first (:mod:`.cpu_shim`).

    A single process (no ``WORLD_SIZE``) without ``MASTER_PORT`` takes a free local port, not
    torch's fixed 29500, so single-rank runs side by side on one machine (an experiment grid's
    ``--jobs``) do not collide on it."""
    apply_cpu_shim_if_needed()
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = "29500" if "WORLD_SIZE" in os.environ else str(_free_local_port())
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    data, fsdp, tensor = mesh.resolve(torch.distributed.get_world_size())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor, mesh.pipeline)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return tensor, mesh.pipeline, data * fsdp


def transformer_config(model: ModelConfig, bf16: bool, *, tensor: int = 1, pipeline: int = 1, kernel_fusion: bool = False):
    """megatron ``TransformerConfig`` of the architecture.

    ``bf16``: parameters and activations in bfloat16 (attention softmax still in float32);
    otherwise float32 everywhere. ``tensor``, ``pipeline``: the model-parallel sizes. ``kernel_fusion``: megatron's fused kernels (masked softmax,
    bias-dropout-add, RoPE, SwiGLU); they need CUDA.
    """
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=model.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        use_cpu_initialization=True,
        masked_softmax_fusion=kernel_fusion,
        bias_activation_fusion=kernel_fusion,
        bias_dropout_fusion=kernel_fusion,
        apply_rope_fusion=kernel_fusion,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,
    )


def build_gpt_model(model: ModelConfig, config) -> torch.nn.Module:
    """A megatron ``GPTModel`` for ``model`` under the TransformerConfig ``config``, on the
    current device (CUDA, or the CPU), in float32 (wrap it in ``Float16Module`` for bf16).
    Parameters are randomly initialized; load real weights with :mod:`.weights`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=model.rope_theta,
        rotary_percent=1.0,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return gpt.float().to(device)


def attention_mask_4d(key_valid: torch.Tensor) -> torch.Tensor:
    """megatron's boolean attention mask [B, 1, L, L] (True = masked) from ``key_valid`` [B, L]:
    causal, and padded keys never attended to."""
    L = key_valid.shape[1]
    future = torch.triu(torch.ones(L, L, dtype=torch.bool, device=key_valid.device), diagonal=1)
    return future[None, None] | ~key_valid[:, None, None, :]


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """Float32 logits [B, L, V] of ``model`` (a GPTModel, possibly wrapped) on ``input_ids`` [B, L]
    with positions ``0..L-1`` and the causal + padding mask of ``key_valid`` [B, L]."""
    B, L = input_ids.shape
    positions = torch.arange(L, device=input_ids.device)[None].expand(B, L)
    logits = model(input_ids, positions, attention_mask_4d(key_valid))
    return logits.float()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
