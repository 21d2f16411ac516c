"""Shared pytest setup: hypothesis profiles (CI is the default: derandomized, bounded) and the
fixtures every test module gets: the tiny HF checkpoints (:func:`tiny_checkpoint`, a builder, and
``tiny_checkpoints`` / ``hf_models`` of :mod:`conftest_models`). Rollouts are built by
:mod:`factories`; the override set of a tiny run is :mod:`tiny_run`."""

import os
import pathlib

# One persistent XLA compilation cache for the whole suite (before anything imports JAX; the
# test's `hetrl` subprocesses inherit it): the tiny runs compile the same programs dozens of
# times (about 20% of a tiny run's time). A cached executable is the one a fresh compile makes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest
from hypothesis import HealthCheck, settings

from conftest_models import hf_models, tiny_checkpoints  # noqa: F401  (fixtures for every module)

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``build(config=TINY_QWEN3, *, seed=0, init_std=0.02) -> directory``: a complete tiny HF
    checkpoint (config, tokenizer, safetensors; :func:`hetrl.models.tiny.build_tiny_checkpoint`),
    built once per session for each setting and shared (treat it as read-only)."""
    from hetrl.models.tiny import TINY_QWEN3, build_tiny_checkpoint

    built: dict = {}

    def build(config=TINY_QWEN3, *, seed: int = 0, init_std: float = 0.02):
        key = (config.model_dump_json(), seed, init_std)
        if key not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{config.model_type}-{seed}") / "model"
            built[key] = build_tiny_checkpoint(directory, config, seed=seed, init_std=init_std)
        return built[key]

    return build
