"""Where a run's metric records go: behind one :class:`Monitor` interface, the JSON-lines file
(:class:`JsonlMonitor`, always), TensorBoard event files (:class:`TensorBoardMonitor`, through
``tensorboardX``) and, with ``logging.wandb`` set, a Weights & Biases run (:class:`WandbMonitor`,
the optional ``wandb`` extra). :class:`Monitors` fans every record out to all of them;
:func:`build_monitors` makes the set a run config asks for.

A record is a flat mapping with an integer ``step``; every other real-valued entry is a scalar
at that step (TensorBoard and W&B); the JSONL keeps the whole record.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol

import numpy as np

if TYPE_CHECKING:
    from hetrl.config import RunConfig, WandbSection

__all__ = ["Monitor", "JsonlMonitor", "TensorBoardMonitor", "WandbMonitor", "Monitors", "build_monitors", "scalars"]


class Monitor(Protocol):
    """A sink of metric records."""

    def log(self, record: Mapping[str, Any]) -> None:
        """Record one step's metrics (``record["step"]``: the step)."""
        ...

    def close(self) -> None:
        """Flush and release what the monitor holds."""
        ...


def _plain(value: Any) -> Any:
    """Numpy scalars and arrays (``np.float32``, ``np.int64``, ``np.bool_``, ...) as plain Python
    numbers, bools and lists, also inside lists, tuples and maps."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _clean(value: Any) -> Any:
    """JSON-safe plain data (:func:`_plain`): non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Every real-valued entry of ``record`` but ``step`` (bools excluded), as floats."""
    plain = _plain(record)
    return {k: float(v) for k, v in plain.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


class JsonlMonitor:
    """Appends one JSON object per record to ``path`` (created with its parents); numpy values
    are written as plain numbers (lists for arrays), non-finite floats as ``null``."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(_clean(_plain(record)), sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _summary_writer() -> type:
    """``tensorboardX.SummaryWriter``, imported without torch where torch is not loaded yet.

    tensorboardX imports torch at module level whenever it is installed (the ``megatron`` extra
    installs it), only to name ``torch.Tensor`` in its type hints; a run with the JAX trainer
    never uses torch, and that import was about 2 s of CPU of every such run's start-up. While
    tensorboardX loads, ``import torch`` fails as if torch were absent (the library's own
    fallback); the block is lifted at once, so torch imports normally afterwards."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardMonitor:
    """A new TensorBoard event file in ``directory`` (``tensorboardX.SummaryWriter``): each
    scalar of a record (:func:`scalars`, non-finite values kept) at the record's step, flushed
    after every record."""

    def __init__(self, directory: str | os.PathLike):
        SummaryWriter = _summary_writer()
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)  # a NaN (an empty mean) is a value here
        self.directory = pathlib.Path(directory)
        self._writer = SummaryWriter(logdir=str(self.directory))

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbMonitor:
    """A Weights & Biases run (``wandb.init``) with the resolved run ``config``: online when
    ``WANDB_API_KEY`` is set, else offline (run files under ``<directory>/wandb``, to upload
    later with ``wandb sync``). Each record's scalars are logged at its step."""

    def __init__(self, settings: "WandbSection", directory: str | os.PathLike, config: Mapping[str, Any], name: str):
        import wandb

        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self._run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or name,
                               tags=list(settings.tags), config=dict(config), dir=str(self.directory),
                               mode=self.mode, settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, record: Mapping[str, Any]) -> None:
        self._run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class Monitors:
    """Every record to each of ``monitors``, in order; :meth:`close` closes them all (the first
    error is raised after all were tried)."""

    def __init__(self, monitors: Iterable[Monitor]):
        self.monitors = list(monitors)

    def log(self, record: Mapping[str, Any]) -> None:
        for m in self.monitors:
            m.log(record)

    def close(self) -> None:
        error: BaseException | None = None
        for m in self.monitors:
            try:
                m.close()
            except BaseException as err:  # close the others first
                error = error or err
        if error is not None:
            raise error


def build_monitors(config: "RunConfig", metrics_path: str | os.PathLike,
                   tensorboard_dir: str | os.PathLike) -> Monitors:
    """The JSONL file at ``metrics_path``, TensorBoard events in ``tensorboard_dir`` and, when
    ``config.logging.wandb`` is set, a W&B run under ``config.output_dir``."""
    monitors: list[Monitor] = [JsonlMonitor(metrics_path), TensorBoardMonitor(tensorboard_dir)]
    if config.logging.wandb is not None:
        monitors.append(WandbMonitor(config.logging.wandb, config.output_dir,
                                     config.resolved(), config.name))
    return Monitors(monitors)
