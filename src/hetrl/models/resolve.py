"""The policy checkpoint a run starts from: the run config's ``model`` section made a directory.

Configuration only describes the model (:class:`hetrl.config.ModelSection`); this module, called
by the orchestrator's setup, finds or builds it: ``path`` is checked to be an HF checkpoint,
a ``tiny`` model is built (random weights, once) and a ``warmstart`` is trained by
:func:`hetrl.warmstart.train.run_warmstart` (once, minutes), both cached by their settings
under ``cache_dir`` (None: the caller's default, the run folder's ``model/``).
"""

from __future__ import annotations

import pathlib

from hetrl.config import ConfigError, ModelSection

__all__ = ["check_model_path", "resolve_model"]


CHECKPOINT_FILES = ("config.json", "tokenizer.json")
"""What a ``model.path`` directory must hold for a run to load it (weights: ``*.safetensors``)."""


def check_model_path(section: ModelSection) -> None:
    """Raise :class:`ConfigError` (one line: the path and the fix) if ``section.path`` is set and
    is not an HF checkpoint directory holding :data:`CHECKPOINT_FILES`; nothing otherwise."""
    if section.path is None:
        return
    path = pathlib.Path(section.path)
    missing = [f for f in CHECKPOINT_FILES if not (path / f).is_file()]
    if not path.is_dir():
        raise ConfigError(f"model.path: {section.path} does not exist; point model.path at an HF checkpoint "
                          "directory (config.json, tokenizer.json, *.safetensors), or set model.tiny / "
                          "model.warmstart instead")
    if missing:
        raise ConfigError(f"model.path: {section.path} has no {' or '.join(missing)}: it is not an HF checkpoint "
                          "directory")


def resolve_model(section: ModelSection, default_cache: str | pathlib.Path, *, console: bool = True) -> pathlib.Path:
    """The checkpoint directory of ``section``: ``path`` (checked by :func:`check_model_path`),
    or the tiny / warm-started checkpoint built once under ``section.cache_dir`` (else
    ``default_cache``); ``console`` shows the warm start's progress while it trains."""
    check_model_path(section)
    if section.path is not None:
        return pathlib.Path(section.path)
    root = pathlib.Path(section.cache_dir if section.cache_dir is not None else default_cache)
    if section.warmstart is not None:
        from hetrl.warmstart.command import default_directory
        from hetrl.warmstart.train import RESULT_FILE, run_warmstart

        target = default_directory(section.warmstart.key(), root)
        if not (target / RESULT_FILE).exists():
            run_warmstart(section.warmstart, target, console=console)
        return target
    from hetrl.models.tiny import TINY_QWEN2, TINY_QWEN3, build_tiny_checkpoint

    target = root / f"tiny-{section.tiny}-seed{section.seed}"
    if not (target / "config.json").exists():
        build_tiny_checkpoint(target, TINY_QWEN3 if section.tiny == "qwen3" else TINY_QWEN2, seed=section.seed)
    return target
