"""What the loop would refuse about a valid config, checked before anything starts (and by
``hetrl train --dry-run``), each problem with its fix.

A config can be valid (every key typed and in range, :mod:`hetrl.config`) and still not runnable
by this loop: an environment it does not run, a trainer mesh that does not fill
``trainer.world_size`` ranks (Megatron) or the devices of
``trainer.world_size`` processes (JAX), a step's batch that does not split over the data-parallel ranks, a model
path that is not there, outputs on an object store. :func:`runnable_problems` lists them;
:func:`check_runnable` raises one :class:`~hetrl.config.ConfigError` naming them all.
"""

from __future__ import annotations

import math
import pathlib

from hetrl.config import ConfigError, RunConfig
from hetrl.models.resolve import check_model_path

__all__ = ["runnable_problems", "check_runnable"]

def _megatron_problems(config: RunConfig) -> list[str]:
    t, m = config.trainer, config.trainer.mesh
    n = t.world_size
    try:
        _, _, data = t.parallel_sizes(n)
    except ValueError:
        fixed = math.prod(s for s in (m.data, m.fsdp, m.tensor) if s != -1) * m.pipeline
        return [f"trainer.mesh: data {m.data} x fsdp {m.fsdp} x tensor {m.tensor} needs "
                f"{'a multiple of ' if -1 in (m.data, m.fsdp, m.tensor) else ''}{fixed} trainer ranks and "
                f"trainer.world_size is {n}; set trainer.world_size to fit the mesh (or the mesh sizes to fit "
                f"{n} ranks: one of data, fsdp, tensor may be -1)"]
    problems = []
    rows = config.async_.batch_groups * config.async_.group_size
    if rows % data:
        problems.append(f"async: a step's {rows} rollouts (batch_groups x group_size) do not split evenly over "
                        f"{data} data-parallel trainer ranks; make batch_groups x group_size a multiple of {data}")
    return problems


def _trainer_problems(config: RunConfig) -> list[str]:
    t = config.trainer
    m = t.mesh
    if t.kind == "megatron":
        return _megatron_problems(config)
    problems = []
    d = t.distributed
    if d.auto or d.coordinator_address or (d.num_processes or 1) > 1:
        problems.append("trainer.distributed: the loop starts the JAX trainer's processes itself (trainer.world_size, "
                        "on a loopback coordinator); remove trainer.distributed and set trainer.world_size")
    fixed = math.prod(s for s in (m.data, m.fsdp, m.tensor) if s != -1)
    if fixed > 1:
        import jax

        per_process = jax.local_device_count()
        devices = per_process * t.world_size
        try:
            m.resolve(devices)
        except ValueError:
            problems.append(f"trainer.mesh: data {m.data} x fsdp {m.fsdp} x tensor {m.tensor} needs "
                            f"{'a multiple of ' if -1 in (m.data, m.fsdp, m.tensor) else ''}{fixed} "
                            f"devices and the trainer has {devices} ({t.world_size} process(es) x {per_process} "
                            f"{jax.default_backend()} devices); set the mesh sizes or trainer.world_size to fit, "
                            f"e.g. trainer.mesh: {{data: 1, fsdp: -1, tensor: 1}}")
    return problems


def _path_problems(config: RunConfig) -> list[str]:
    problems = []
    try:
        check_model_path(config.model)
    except ConfigError as err:
        problems.append(str(err))
    if "://" in config.output_dir:
        problems.append(f"output_dir: {config.output_dir!r} is a URL; the loop writes to a local (or mounted) "
                        f"directory, give a path")
    return problems


def _environment_problems(config: RunConfig) -> list[str]:
    """Task sets of ``name: coding`` that are neither a named set nor an existing file or directory."""
    from hetrl.envs.task_files import NAMED_SOURCES

    if config.environment.name != "coding":
        return []
    options = config.environment.options
    return [f"environment.options.{key}: no task set {source!r}: name one of {', '.join(NAMED_SOURCES)}, an "
            f"existing .jsonl file or a repository-task directory"
            for key, source in (("train", options.train), ("heldout", options.heldout))
            if source is not None and source not in NAMED_SOURCES and not pathlib.Path(source).exists()]


def runnable_problems(config: RunConfig) -> list[str]:
    """Every reason the loop would refuse ``config`` (empty: it would start), each with its fix."""
    return _environment_problems(config) + _trainer_problems(config) + _path_problems(config)


def check_runnable(config: RunConfig, source: str = "the config") -> None:
    """Raise :class:`ConfigError` naming every problem of :func:`runnable_problems` (``source``:
    the config file, for the message)."""
    problems = runnable_problems(config)
    if len(problems) == 1:
        raise ConfigError(f"{source}: cannot run: {problems[0]}")
    if problems:
        raise ConfigError(f"{source}: cannot run:\n  " + "\n  ".join(problems))
