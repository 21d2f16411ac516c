"""Tiny checkpoints built locally: random weights + a byte-level BPE tokenizer trained with
``tokenizers``, saved in the Hugging Face layout (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``), so every backend, and
``transformers`` itself, loads them exactly as it would load a real Qwen checkpoint.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterable

import numpy as np

from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import expected_shapes, save_state_dict

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_QWEN3 = ModelConfig(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    rope_theta=10_000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
)
TINY_QWEN2 = TINY_QWEN3.model_copy(update=dict(model_type="qwen2", tie_word_embeddings=True))


def random_state_dict(config: ModelConfig, seed: int = 0, init_std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named float32 weights: unit norms, N(0, init_std) everything else (biases included,
    so that parity tests exercise them)."""
    rng = np.random.default_rng(seed)
    return {
        name: np.ones(shape, dtype=np.float32) if name.endswith("norm.weight")
        else (rng.normal(size=shape) * init_std).astype(np.float32)
        for name, shape in expected_shapes(config).items()
    }


def default_corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    """A small synthetic corpus of Python-like lines and words, for the tokenizer only."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "for", "in", "if", "else", "while", "list", "str", "int", "len", "sum", "max", "min",
             "sorted", "range", "x", "y", "xs", "s", "n", "i", "result", "append", "True", "False", "None", "and",
             "or", "not", "the", "input", "output", "test", "passed", "failed", "expected", "got", "error"]
    symbols = ["(", ")", "[", "]", ":", ",", " = ", " + ", " - ", " * ", " == ", " < ", "\n    ", "0", "1", "2"]
    out = []
    for _ in range(lines):
        parts = [str(rng.choice(words)) if rng.random() < 0.6 else str(rng.choice(symbols)) for _ in range(rng.integers(3, 12))]
        out.append(" ".join(parts))
    return out


def train_tokenizer(vocab_size: int, corpus: Iterable[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` with the special tokens at ids 0, 1, 2. Digits
    are split one per token before BPE (as in Qwen's and Llama's tokenizers), so a number is read
    the same way wherever it stands: what lets a tiny model compare and compute numbers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def save_tokenizer(tokenizer, directory: str | pathlib.Path, max_length: int) -> None:
    directory = pathlib.Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "pad_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "bos_token": None,
        "unk_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }, indent=1))


def save_checkpoint(directory: str | pathlib.Path, config: ModelConfig, state: dict[str, np.ndarray], tokenizer) -> pathlib.Path:
    """Write a complete HF checkpoint (config, weights, tokenizer files, generation config) of
    ``state`` with the ``tokenizers.Tokenizer`` ``tokenizer`` to ``directory``; return it."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size={config.vocab_size}")
    config.save(directory)
    save_state_dict(directory, state)
    save_tokenizer(tokenizer, directory, config.max_position_embeddings)
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}, indent=1))
    return directory


def build_tiny_checkpoint(
    directory: str | pathlib.Path,
    config: ModelConfig = TINY_QWEN3,
    seed: int = 0,
    init_std: float = 0.02,
    corpus: Iterable[str] | None = None,
) -> pathlib.Path:
    """Write a complete tiny HF checkpoint with random weights to ``directory`` and return its path."""
    tokenizer = train_tokenizer(config.vocab_size, corpus if corpus is not None else default_corpus(seed))
    return save_checkpoint(directory, config, random_state_dict(config, seed, init_std), tokenizer)
