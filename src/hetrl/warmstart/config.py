"""Configuration of a warm start (pydantic, framework-free): which tasks, which model, how long.

A warm start trains a tiny Qwen3 from scratch on (task prompt, reference answer) transcripts of
the synthetic suite's train functions (:func:`hetrl.envs.tasks_synthetic.suite_programs`), each
function shown with ``variants`` different example draws, so the model must read the examples
rather than memorize a prompt; held-out draws (and, with ``suite.split="functions"``, held-out
functions) are never seen. :meth:`WarmstartConfig.key`
names the result, so a run config can ask for "the warm start with these settings" and build it
once.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetrl.envs.tasks_synthetic import SuiteConfig

__all__ = ["WarmstartModel", "WarmstartTraining", "WarmstartEval", "WarmstartConfig"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WarmstartModel(_Frozen):
    """Shape of the Qwen3 decoder trained from scratch (``head_dim = hidden_size / heads``)."""

    vocab_size: int = Field(512, ge=64)
    hidden_size: int = Field(128, ge=16)
    intermediate_size: int = Field(384, ge=16)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(1024, ge=128)

    @model_validator(mode="after")
    def _heads(self) -> "WarmstartModel":
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads")
        return self


class WarmstartTraining(_Frozen):
    """SFT schedule: ``steps`` AdamW steps of ``batch_size`` transcripts drawn uniformly with
    replacement, sequences padded to ``seq_len``; warmup then cosine decay to 10%."""

    steps: int = Field(1500, ge=1)
    batch_size: int = Field(32, ge=1)
    seq_len: int = Field(144, ge=16)
    learning_rate: float = Field(2e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    variants: int = Field(100, ge=1, description="example draws per train function")


class WarmstartEval(_Frozen):
    """Held-out evaluation after training: ``tasks`` held-out tasks (None: all), ``samples``
    episodes each sampled at ``temperature`` (and one greedily), of up to ``max_turns`` turns."""

    tasks: int | None = Field(None, ge=1)
    samples: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(64, ge=8)
    max_turns: int = Field(1, ge=1)


class WarmstartConfig(_Frozen):
    """Everything that determines a warm start. ``seed`` fixes the initialization and the batch
    order; ``suite`` the tasks, their example draws and the held-out split (the RL run that starts
    from this model evaluates on the same suite by default)."""

    seed: int = Field(0, ge=0)
    suite: SuiteConfig = SuiteConfig()
    model: WarmstartModel = WarmstartModel()
    training: WarmstartTraining = WarmstartTraining()
    eval: WarmstartEval = WarmstartEval()

    def key(self) -> str:
        """A short stable name of the settings that change the trained weights (not ``eval``)."""
        payload = self.model_dump(mode="json", exclude={"eval"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
