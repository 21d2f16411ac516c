"""Where, how often and how many trainer checkpoints: one policy for every trainer.

:class:`CheckpointConfig` is the trainers' shared setting (the JAX trainer writes Orbax
checkpoints, the Megatron trainer megatron ``dist_checkpointing`` ones, both one directory per
step under ``directory``). :func:`complete_steps` reads back which steps a directory holds.
"""

from __future__ import annotations

import pathlib

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CheckpointConfig", "complete_steps"]


class CheckpointConfig(BaseModel):
    """Checkpoints under ``directory``: one every ``every`` steps (0: only explicit saves), the
    newest ``keep`` retained (None: all). ``async_save``: write in the background (Orbax; the
    Megatron trainer saves synchronously)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    directory: str | None = None
    every: int = Field(0, ge=0)
    keep: int | None = Field(3, gt=0)
    async_save: bool = True

    def due(self, step: int) -> bool:
        """Whether a periodic save falls at ``step`` (a multiple of ``every``; never when 0)."""
        return bool(self.every) and step % self.every == 0


def complete_steps(directory: str | pathlib.Path) -> list[int]:
    """Sorted steps of the finished checkpoints in ``directory``: its subdirectories named by
    a plain decimal step (a save in progress lives under another name until it is renamed)."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())
