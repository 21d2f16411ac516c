"""Shared fixtures for model tests: tiny HF checkpoints built once per session.

``conftest.py`` registers the fixtures for every test module (importing them into a module, as
older modules do, still works). The
checkpoints are ``TINY_QWEN3`` (untied, QK-norm) and ``TINY_QWEN2`` (tied, q/k/v biases) with
``init_std=0.2`` weights, so logits are far from uniform, and RMSNorm weights drawn as
``1 + 0.1 N(0, 1)`` instead of ones, so a norm weight that is dropped or misapplied shows
(:func:`hetrl.parity.build_parity_checkpoint`).
"""

import pytest

from hetrl.models.tiny import TINY_QWEN2, TINY_QWEN3

INIT_STD = 0.2
CONFIGS = {"qwen3": TINY_QWEN3, "qwen2": TINY_QWEN2}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """``{"qwen3": dir, "qwen2": dir}``: complete tiny HF checkpoint directories."""
    from hetrl.parity import build_parity_checkpoint

    return {name: build_parity_checkpoint(tmp_path_factory.mktemp(f"tiny_{name}"), config, seed=0, init_std=INIT_STD)
            for name, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints) -> dict:  # noqa: F811
    """``{"qwen3": model, "qwen2": model}``: the reference ``transformers`` models, float32, eval mode."""
    import torch
    import transformers

    return {arch: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for arch, path in tiny_checkpoints.items()}
