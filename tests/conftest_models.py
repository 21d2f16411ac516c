"""Shared fixtures for model tests: tiny HF checkpoints built once per session.

Import the fixtures into a test module (``from conftest_models import tiny_checkpoints, hf_models``). The
checkpoints are ``TINY_QWEN3`` (untied, QK-norm) and ``TINY_QWEN2`` (tied, q/k/v biases) with
``init_std=0.2`` weights, so logits are far from uniform, and RMSNorm weights drawn as
``1 + 0.1 N(0, 1)`` instead of ones, so a norm weight that is dropped or misapplied shows.
"""

import numpy as np
import pytest

from hetrl.models.hf_io import load_state_dict, save_state_dict
from hetrl.models.tiny import TINY_QWEN2, TINY_QWEN3, build_tiny_checkpoint

INIT_STD = 0.2
CONFIGS = {"qwen3": TINY_QWEN3, "qwen2": TINY_QWEN2}


def perturb_norms(state: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``state`` with every ``*norm.weight`` replaced by ``1 + 0.1 N(0, 1)`` (float32)."""
    rng = np.random.default_rng(seed)
    return {k: (1 + 0.1 * rng.normal(size=v.shape)).astype(np.float32) if k.endswith("norm.weight") else v
            for k, v in state.items()}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """``{"qwen3": dir, "qwen2": dir}``: complete tiny HF checkpoint directories."""
    out = {}
    for name, config in CONFIGS.items():
        directory = build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{name}"), config, seed=0, init_std=INIT_STD)
        save_state_dict(directory, perturb_norms(load_state_dict(directory), seed=1))
        out[name] = directory
    return out


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints) -> dict:  # noqa: F811
    """``{"qwen3": model, "qwen2": model}``: the reference ``transformers`` models, float32, eval mode."""
    import torch
    import transformers

    return {arch: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for arch, path in tiny_checkpoints.items()}
