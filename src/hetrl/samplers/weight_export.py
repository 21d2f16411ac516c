"""Publishing trainer weights to a directory server pools load from (DESIGN §5).

A version ``v`` is exported once, as a complete HF checkpoint directory ``<root>/v<v:08d>``:
the safetensors and their manifest (:func:`hetrl.models.hf_io.save_state_dict`) plus the
model's non-weight files (``config.json``, tokenizer, generation config) copied from the base
checkpoint. It is written under a temporary name in the same directory and renamed into place,
so a reader sees either no directory or a complete one; a directory already there (another
replica exported it first) is verified against its manifest and reused. Every replica of every
server pool reads the same export; :func:`prune_exports` keeps the newest few.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import threading
import uuid
from typing import Mapping

import numpy as np

from hetrl.models.hf_io import save_state_dict, verify_manifest

__all__ = ["MODEL_FILES", "export_directory", "export_weights", "prune_exports", "save_hf_checkpoint"]

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")
"""Non-weight files of an HF checkpoint copied into every export (those the base has)."""

_lock = threading.Lock()
_verified: set[pathlib.Path] = set()  # exports this process checked against their manifest


def save_hf_checkpoint(directory: str | os.PathLike, weights: Mapping[str, np.ndarray],
                       base_dir: str | os.PathLike) -> None:
    """Write HF-named ``weights`` to ``directory`` as a complete HF checkpoint: the safetensors
    and their manifest, and the :data:`MODEL_FILES` the base checkpoint ``base_dir`` has."""
    save_state_dict(directory, weights)
    for name in MODEL_FILES:
        if (pathlib.Path(base_dir) / name).exists():
            shutil.copyfile(pathlib.Path(base_dir) / name, pathlib.Path(directory) / name)


def export_directory(root: str | os.PathLike, version: int) -> pathlib.Path:
    """Where version ``version`` is (or will be) exported under ``root``."""
    return pathlib.Path(root) / f"v{int(version):08d}"


def export_weights(root: str | os.PathLike, version: int, weights: Mapping[str, np.ndarray],
                   base_dir: str | os.PathLike) -> pathlib.Path:
    """Export HF-named ``weights`` as version ``version`` under ``root`` (atomically, once; see
    the module docstring) and return the directory, verified against its manifest."""
    target = export_directory(root, version)
    with _lock:
        if not target.exists():
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                save_hf_checkpoint(tmp, weights, base_dir)
                try:
                    os.rename(tmp, target)
                except OSError:
                    if not target.exists():  # not a lost race with another process: a real failure
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if target not in _verified:  # once per process, not once per replica
            verify_manifest(target, required=True)
            _verified.add(target)
    return target


def prune_exports(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest versions under ``root`` (servers hold loaded weights in
    memory, and replicas only ever load the newest published version)."""
    versions = sorted(p for p in pathlib.Path(root).glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit())
    with _lock:
        for old in versions[: max(0, len(versions) - keep)]:
            shutil.rmtree(old, ignore_errors=True)
            _verified.discard(old)
