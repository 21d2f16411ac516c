"""Training checkpoints with Orbax: parameters, optimizer state, metadata.

One checkpoint per step under ``directory/<step>/`` with three items:

* ``params`` and ``opt_state``: pytrees of (possibly sharded, multi-host) ``jax.Array`` s,
  written by every process for its own shards and restored straight into the shardings of an
  abstract target (``jax.ShapeDtypeStruct`` with ``sharding``), so a restore needs no host copy;
* ``meta``: JSON (step, trainer version, the model config, anything the caller adds).

The position in the data is the loop's, saved beside the checkpoint by the orchestrator
(``loop-<step>.json``, :class:`hetrl.orchestrator.tasks.TaskSource`), the same for either trainer.

Retention: at most ``keep`` checkpoints remain (Orbax ``max_to_keep``; oldest deleted first).
Saves are asynchronous when ``async_save`` (device-to-host copy is synchronous, the write runs in
the background); :meth:`TrainCheckpointer.wait` blocks until it is on disk.

Interruption: a checkpoint is written into ``<step>.orbax-checkpoint-tmp`` and only renamed to
``<step>`` once every item is on disk (on object stores, a ``commit_success.txt`` marks it
finalized instead), so a save interrupted halfway leaves the previous checkpoints as the latest
loadable ones; the unfinished temporary directory is removed by the next checkpointer on that
directory (before its first save).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["TrainCheckpointer", "abstract_like"]


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` (shape, dtype, sharding) per array leaf: an Orbax restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class TrainCheckpointer:
    """Save / restore training state under ``directory`` keeping the newest ``keep``."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int | None = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                                                 cleanup_tmp_directories=True),
            item_handlers={
                "params": ocp.StandardCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        """Write checkpoint ``step`` (collective: every process calls it)."""
        items = dict(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
        )
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, params_target: Any, opt_state_target: Any,
                step: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
        """``(params, opt_state, meta)`` of checkpoint ``step`` (default: the latest), placed as
        the abstract targets say. Raises ``FileNotFoundError`` when there is no such checkpoint."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint {'at all' if step is None else f'for step {step}'} in {self.directory}")
        items = dict(
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_state_target),
            meta=ocp.args.JsonRestore(),
        )
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        return out["params"], out["opt_state"], dict(out["meta"])

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Block until every pending asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
