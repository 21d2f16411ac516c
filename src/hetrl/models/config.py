"""Decoder configuration for the Qwen2 / Qwen3 family, read from and written to HF ``config.json``.

Architecture (both): token embedding, N blocks of
``x += o_proj(attn(rope(q_norm?(q_proj(rms(x)))), rope(k_norm?(k_proj(rms(x)))), v_proj(rms(x))))``
and ``x += down(silu(gate(rms(x))) * up(rms(x)))``, a final RMSNorm, and an LM head (tied to the
embedding or not). Attention is grouped-query: ``num_attention_heads`` query heads share
``num_key_value_heads`` key/value heads. Qwen2 has biases on q/k/v; Qwen3 has none but RMS-norms
each query and key head (QK-norm) before RoPE.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ModelConfig(BaseModel):
    """The fields of HF ``Qwen2Config`` / ``Qwen3Config`` that define the computation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: Literal["qwen2", "qwen3"] = "qwen3"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(4096, gt=0)
    rope_theta: float = Field(1_000_000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        return self

    @property
    def attention_bias(self) -> bool:
        """Qwen2 has q/k/v biases, Qwen3 has none."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalizes each query/key head before RoPE."""
        return self.model_type == "qwen3"

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Parse an HF config dict; refuses features the implementations do not have."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"config.json: model_type {model_type!r} is not supported (supported: {sorted(ARCHITECTURES)})")
        if hf.get("rope_scaling"):
            raise ValueError(f"config.json: rope_scaling {hf['rope_scaling']!r} is not supported (only plain RoPE)")
        if hf.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        if model_type == "qwen3" and hf.get("attention_bias"):
            raise ValueError("config.json: attention_bias=true is not supported for qwen3")
        hf = dict(hf)
        rope = hf.pop("rope_parameters", None)  # transformers >= 5 writes RoPE settings here
        if rope:
            if rope.get("rope_type", "default") != "default":
                raise ValueError(f"config.json: rope_parameters {rope!r} is not supported (only plain RoPE)")
            hf["rope_theta"] = rope["rope_theta"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        fields = {k: hf[k] for k in cls.model_fields if k in hf and k not in ("head_dim", "eos_token_id")}
        return cls(**fields, head_dim=head_dim, eos_token_id=eos[0] if isinstance(eos, list) else eos)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF ``config.json`` dict that ``transformers`` loads as this architecture."""
        out = self.model_dump()
        out.update(
            architectures=[ARCHITECTURES[self.model_type]],
            hidden_act="silu",
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            use_sliding_window=False,
            rope_scaling=None,
            torch_dtype="float32",
        )
        if self.model_type == "qwen3":
            out["attention_bias"] = False
        return out

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "ModelConfig":
        """From a checkpoint directory (its ``config.json``) or a ``config.json`` file."""
        path = pathlib.Path(path)
        file = path / "config.json" if path.is_dir() else path
        return cls.from_hf_dict(json.loads(file.read_text()))

    def save(self, directory: str | pathlib.Path) -> None:
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2))

    # ------------------------------------------------------------------ derived sizes
    def parameter_count(self) -> int:
        H, I, V, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        per_layer = 2 * H + H * q + 2 * H * kv + q * H + 3 * H * I
        per_layer += (q + 2 * kv) if self.attention_bias else 0
        per_layer += 2 * hd if self.qk_norm else 0
        return V * H * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + H
