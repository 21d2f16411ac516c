"""The run folder: every output of one run under its ``output_dir``, and who may write there.

Layout (:class:`RunFolder`)::

    <output_dir>/
      config.yaml                 the resolved config, written when the run starts (and on each resume)
      metrics.jsonl               one JSON record per logged step (+ step 0: the starting policy's evaluation)
      tensorboard/                TensorBoard event files of the same records
      checkpoints/<step>/         trainer checkpoints, with buffer-<step>.json and loop-<step>.json beside them
      hf/step-<step>/             the policy at each kept checkpoint and at the end, as an HF checkpoint
                                  (safetensors + config + tokenizer): transformers' from_pretrained and
                                  `hetrl parity --checkpoint` load it
      hf/latest -> step-<step>    symlink to the newest export
      generations/eval-<step>.jsonl  each held-out episode of the evaluation at that step: task id, prompt,
                                  completion, reward, success
      plots/*.png, summary.json   written at the end
      model/                      tiny models built for the run (when model.cache_dir is not set)
      weights/                    weight versions exported to server pools (SGLang), if any

**A folder holds a run** when it has ``config.yaml``, ``metrics.jsonl`` or ``summary.json``, or
anything under ``checkpoints/``; an absent or empty folder, or one with only other files (an
experiment's ``train.log``), does not. A new run in a folder that holds one is refused
(:meth:`RunFolder.check_start`): two runs would append to one metrics file and delete each
other's checkpoints. ``--resume`` (``checkpointing.resume``) continues the run there from its
newest checkpoint; with no checkpoint it is refused, and so is a resume whose config differs
from the folder's ``config.yaml`` in a setting the checkpoint fixes (:data:`FIXED_BY_RUN`);
other changed settings are allowed with a warning (:func:`compare_configs`).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import yaml

from hetrl.config import ConfigError, RunConfig
from hetrl.core.checkpoints import complete_steps

__all__ = ["RunFolder", "FIXED_BY_RUN", "NOT_COMPARED", "compare_configs", "flatten", "write_atomic"]

log = logging.getLogger(__name__)

FIXED_BY_RUN = ("trainer.kind", "trainer.compute_dtype", "model.tiny", "model.seed", "model.warmstart",
                "model.path", "fleet.pools", "seed", "environment", "async.group_size", "async.batch_groups")
"""Settings (dotted prefixes of the resolved config) a resumed run must keep: the checkpoint's
trainer and its precision, the policy it started from, the fleet whose counters and buffer the
checkpoint holds, the tasks and data order, and the batch shape of the buffered groups. The
model's ``cache_dir`` is not among them: it says where a built model is kept, not which one
(a resume with another one warns, and builds the same model there if it is missing)."""

NOT_COMPARED = ("name", "output_dir", "backend", "ray", "logging", "checkpointing.resume")
"""Settings that do not change what is trained (where and how it is run and shown)."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Plain config data as ``{dotted key: leaf value}`` (lists are leaves)."""
    if not isinstance(data, Mapping):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def compare_configs(saved: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(refused, changed)``: the dotted keys of the resolved configs ``saved`` (the run's) and
    ``new`` that differ, those under :data:`FIXED_BY_RUN` and the others (each as
    ``key old -> new``), leaving out :data:`NOT_COMPARED`."""
    a, b = flatten(saved), flatten(new)
    refused, changed = set(), []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) == b.get(key) or _under(key, NOT_COMPARED):
            continue
        if _under(key, FIXED_BY_RUN):
            refused.add(next(p for p in FIXED_BY_RUN if key == p or key.startswith(p + ".")))
        else:
            changed.append(f"{key} {a.get(key)!r} -> {b.get(key)!r}")
    return sorted(refused), changed


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder (module docstring) and the checks of who may write there."""

    root: pathlib.Path

    config = property(lambda self: self.root / "config.yaml")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    tensorboard = property(lambda self: self.root / "tensorboard")
    checkpoints = property(lambda self: self.root / "checkpoints")
    plots = property(lambda self: self.root / "plots")
    summary = property(lambda self: self.root / "summary.json")
    generations = property(lambda self: self.root / "generations")
    hf = property(lambda self: self.root / "hf")
    models = property(lambda self: self.root / "model")
    weights = property(lambda self: self.root / "weights")

    def run_files(self) -> list[str]:
        """The names of what makes this folder hold a run (empty: it holds none)."""
        found = [p.name for p in (self.config, self.metrics, self.summary) if p.exists()]
        if self.checkpoints.is_dir() and any(self.checkpoints.iterdir()):
            found.append("checkpoints/")
        return found

    def check_start(self, config: RunConfig) -> None:
        """Whether ``config`` may run here; raises :class:`ConfigError` (one line) if not: a new
        run in a folder that holds one, a resume with no checkpoint, or one that changes a
        setting of :data:`FIXED_BY_RUN`. Logs a warning naming the other changed settings."""
        held = self.run_files()
        if not config.checkpointing.resume:
            if held:
                raise ConfigError(f"{self.root} already holds a run ({', '.join(held)}); continue it with --resume, "
                                  "or start a new run in a fresh output_dir (--set output_dir=DIR)")
            return
        if not complete_steps(self.checkpoints):
            where = "holds a run but no checkpoint" if held else "holds no run"
            raise ConfigError(f"--resume: nothing to resume: {self.root} {where}; "
                              f"{'delete it or choose' if held else 'run without --resume, or point output_dir at'} "
                              f"{'a fresh output_dir' if held else 'the folder of the run to continue'}")
        if not self.config.exists():
            log.warning("hetrl train: %s has no config.yaml: resuming without checking the settings", self.root)
            return
        try:
            saved = yaml.safe_load(self.config.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"--resume: cannot read {self.config}: {err}") from None
        refused, changed = compare_configs(saved if isinstance(saved, dict) else {}, config.resolved())
        if refused:
            raise ConfigError(f"--resume: settings differ from the run's ({self.config}) that a resumed run must "
                              f"keep: {', '.join(refused)}; resume with the run's settings, or start a new run "
                              "in a fresh output_dir")
        if changed:
            log.warning("hetrl train: resuming %s with changed settings: %s", self.root, "; ".join(changed))

    def write_config(self, config: RunConfig) -> None:
        """Write ``config.yaml``: the resolved config of the run (or of its latest resume)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config, config.to_yaml())

    def write_generations(self, step: int, records: Sequence[Mapping[str, Any]]) -> pathlib.Path:
        """``generations/eval-<step>.jsonl``: one JSON line per held-out episode of that evaluation."""
        self.generations.mkdir(parents=True, exist_ok=True)
        path = self.generations / f"eval-{int(step)}.jsonl"
        write_atomic(path, "".join(json.dumps(dict(r), sort_keys=True) + "\n" for r in records))
        return path

    def export_hf(self, step: int, weights: Mapping[str, np.ndarray], base_dir: str | os.PathLike) -> pathlib.Path:
        """``hf/step-<step>/``: ``weights`` as an HF checkpoint (the model's other files from
        ``base_dir``), written under a temporary name and renamed into place; then ``hf/latest``
        is pointed at it (a symlink replaced atomically)."""
        from hetrl.samplers.weight_export import save_hf_checkpoint

        target = self.hf / f"step-{int(step)}"
        tmp = self.hf / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_checkpoint(tmp, weights, base_dir)
        if target.exists():  # a resumed run trains this step again
            shutil.rmtree(target)
        os.rename(tmp, target)
        link = self.hf / ".latest.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(target.name, target_is_directory=True)
        os.replace(link, self.hf / "latest")
        return target

    def hf_steps(self) -> list[int]:
        """Steps of the HF exports under ``hf/``, sorted."""
        if not self.hf.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in self.hf.glob("step-*") if p.name[5:].isdigit())

    def prune_hf(self, keep_steps: Sequence[int]) -> None:
        """Delete the HF exports of steps neither in ``keep_steps`` (the trainer's retained
        checkpoints) nor the newest one (where ``latest`` points)."""
        steps = self.hf_steps()
        keep = set(keep_steps) | set(steps[-1:])
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.hf / f"step-{step}", ignore_errors=True)


def write_atomic(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` all or nothing (a synced temporary file beside it, then a
    rename), so a crash mid-write leaves the previous file intact: a resume reads the buffer
    snapshot of the checkpoint it restores."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
