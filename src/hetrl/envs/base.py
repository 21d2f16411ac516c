"""The environment interface for multi-turn episodes (text in, text out).

An :class:`Environment` runs one episode at a time: :meth:`Environment.reset` takes a task (a
pydantic model) and returns the first :class:`Observation` (chat messages); each
:meth:`Environment.step` takes the policy's action text for one turn and returns a
:class:`StepResult` with the next observation (None once the episode is done), the reward and
diagnostics. Rewards are computed by the environment, never by the trainer. Environments are
tokenizer-agnostic; :class:`ChatFormat` is the bridge to token ids for the orchestrator, which
appends the environment's tokens to a rollout with ``loss_mask=False`` (DESIGN §2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant"]
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    content: str


class Observation(BaseModel):
    """What the environment shows the policy at the start of a turn: the messages to append to
    the conversation (the first observation holds the whole prompt)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: tuple[Message, ...] = Field(min_length=1)

    @property
    def text(self) -> str:
        """The messages' contents joined by blank lines (for text-only policies and logs)."""
        return "\n\n".join(m.content for m in self.messages)


class StepResult(BaseModel):
    """Outcome of one turn. ``observation`` is None exactly when ``done``; ``reward`` is the
    reward earned by this turn (sparse environments give it on the last turn)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    observation: Observation | None
    reward: float = Field(allow_inf_nan=False)
    done: bool
    info: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _observation_iff_running(self) -> "StepResult":
        if (self.observation is None) != self.done:
            raise ValueError("observation must be None exactly when the episode is done")
        return self


class Task(BaseModel):
    """Base class of task specifications: immutable, serializable, identified by ``task_id``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str = Field(min_length=1)
    family: str = Field(min_length=1)


class Environment(ABC):
    """One episode at a time; create one instance per concurrent episode."""

    @abstractmethod
    def reset(self, task: Task) -> Observation:
        """Start an episode on ``task`` and return the first observation."""

    @abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply the policy's action for this turn. Raises RuntimeError when no episode runs."""


class ChatFormat:
    """Messages to token ids in the ``<|im_start|>role\\n...<|im_end|>\\n`` chat style (the one of
    the tiny tokenizers in :mod:`hetrl.models.tiny`, and of Qwen).

    Each piece of text is encoded on its own between the special-token ids, so the ids equal those
    of encoding the rendered text with a tokenizer that splits on its special tokens, and content
    can never produce a special token. Content containing the marker strings is rejected.
    """

    def __init__(self, encode: Callable[[str], Sequence[int]], im_start_id: int, im_end_id: int):
        self._encode = encode
        self.im_start_id, self.im_end_id = im_start_id, im_end_id

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ChatFormat":
        """From a ``tokenizers.Tokenizer`` or a Hugging Face ``PreTrainedTokenizer(Fast)``."""
        if hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers
            ids = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
            return cls(lambda s: tokenizer.encode(s, add_special_tokens=False), ids[0], ids[1])
        start, end = tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)
        if start is None or end is None:
            raise ValueError(f"tokenizer lacks {IM_START} / {IM_END}")
        return cls(lambda s: tokenizer.encode(s, add_special_tokens=False).ids, start, end)

    @staticmethod
    def _checked(messages: Sequence[Message]) -> Sequence[Message]:
        for m in messages:
            if IM_START in m.content or IM_END in m.content:
                raise ValueError(f"{m.role} message content contains a chat marker")
        return messages

    @staticmethod
    def render(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The chat-template text (no tokenizer needed)."""
        text = "".join(f"{IM_START}{m.role}\n{m.content}{IM_END}\n" for m in ChatFormat._checked(messages))
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
        """Token ids of :meth:`render`."""
        ids: list[int] = []
        for m in self._checked(messages):
            ids += [self.im_start_id, *self._encode(f"{m.role}\n{m.content}"), self.im_end_id, *self._encode("\n")]
        if add_generation_prompt:
            ids += [self.im_start_id, *self._encode("assistant\n")]
        return ids

    def env_tokens(self, observation: Observation) -> list[int]:
        """Ids that follow an assistant turn ending with its ``<|im_end|>`` (the stop token the
        sampler produced): the template's newline, the observation's messages and the next
        generation prompt. Appended to a rollout with ``loss_mask=False``."""
        return [*self._encode("\n"), *self.encode(observation.messages, add_generation_prompt=True)]
