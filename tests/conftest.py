"""Shared pytest setup: hypothesis profiles (CI is the default: derandomized, bounded) and the
fixtures every test module gets: the tiny HF checkpoints (:func:`tiny_checkpoint`, a builder, and
``tiny_checkpoints`` / ``hf_models`` of :mod:`conftest_models`). Rollouts are built by
:mod:`factories`; the override set of a tiny run is :mod:`tiny_run`."""

import collections
import json
import os
import pathlib

from xla_env import apply_suite_flags

# One persistent XLA compilation cache for the whole suite (before anything imports JAX; the
# test's `hetrl` subprocesses inherit it): the tiny runs compile the same programs dozens of
# times (about 20% of a tiny run's time). A cached executable is the one a fresh compile makes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
apply_suite_flags()  # XLA compiles fast at its lowest optimization level (xla_env.py)

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


# ---------------------------------------------------------------------- heaviest files first
FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")
"""Each test file's measured seconds (setup, call and teardown of its tests, on 2 cores), so
that the pytest-xdist workers take the heaviest files first (``make test`` runs ``--dist
loadfile --no-loadscope-reorder``): taken in name order, the longest files (minutes each) came
last and one worker finished them alone. A file not in the table counts as quick. Refresh it
with ``pytest --store-file-seconds`` (the whole suite)."""


def pytest_addoption(parser):
    parser.addoption("--store-file-seconds", action="store_true",
                     help=f"write each test file's measured seconds to {FILE_SECONDS.name} (test order)")


def pytest_collection_modifyitems(config, items):
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))  # stable: a file's own order holds


_measured: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    _measured[pathlib.Path(report.fspath).name] += report.duration


def pytest_sessionfinish(session):
    if session.config.getoption("--store-file-seconds") and not hasattr(session.config, "workerinput"):
        FILE_SECONDS.write_text(json.dumps({name: round(s, 1) for name, s in _measured.most_common()}, indent=1) + "\n")
