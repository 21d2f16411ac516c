"""The tiny runs the tests train: one override set, spelled for each kind of caller.

:data:`TINY_RUN` is the cheapest real run of a shipped config: a random tiny Qwen3 built on the
fly (no warm start), no console, :data:`TINY_BATCH` (2 groups of 2 rollouts of at most 16 new
tokens a step), :data:`ONE_REPLICA` and no held-out evaluation (:data:`NO_EVAL`). A test adds
what it is about after it (a later override of the same key wins). :func:`set_args` spells
overrides as ``hetrl`` command-line arguments, :func:`as_mapping` as an experiment grid's
``overrides`` map. (A module, not conftest fixtures: the command lines are built by plain
helpers at module level.)
"""

from __future__ import annotations

from typing import Any, Iterable

import yaml

__all__ = ["QUIET", "TINY_BATCH", "ONE_REPLICA", "NO_EVAL", "TINY_MODEL", "TINY_RUN", "replicas", "set_args",
           "as_mapping"]

QUIET = "logging.console=false"
TINY_BATCH = ("async.batch_groups=2", "async.group_size=2", "async.max_new_tokens=16")
NO_EVAL = "environment.options.eval.every=0"
TINY_MODEL = "model={tiny: qwen3}"


def replicas(n: int) -> str:
    """The fleet as one pool of ``n`` BF16 B200 replicas named ``b200-bf16``."""
    return f"fleet.pools=[{{name: b200-bf16, accelerator: b200, weight_precision: bf16, replicas: {n}}}]"


ONE_REPLICA = replicas(1)
TINY_RUN = (TINY_MODEL, QUIET, *TINY_BATCH, ONE_REPLICA, NO_EVAL)


def set_args(overrides: Iterable[str]) -> list[str]:
    """``["--set", o1, "--set", o2, ...]``."""
    return [arg for o in overrides for arg in ("--set", o)]


def as_mapping(overrides: Iterable[str]) -> dict[str, Any]:
    """``{"a.b": value}`` of ``a.b=value`` overrides (values parsed as YAML, as ``--set`` does)."""
    return {key: yaml.safe_load(value) for key, _, value in (o.partition("=") for o in overrides)}
