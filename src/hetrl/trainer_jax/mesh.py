"""Device mesh, shardings and multi-host plumbing.

The mesh has axes ``("data", "fsdp", "tensor")`` (:data:`~hetrl.trainer_jax.config.MESH_AXES`)
over all global devices, in ``jax.devices()`` order, so the devices of one process are
contiguous along the outer axes. Parameters carry their sharding as nnx metadata
(``nnx.with_partitioning`` over ``"fsdp"`` / ``"tensor"``); :func:`state_shardings` turns it into
``NamedSharding`` s, replicating any dimension the mesh axis does not divide. Batches are
sharded on their leading axis over ``("data", "fsdp")``.

Multi-host: :func:`initialize_distributed` joins the processes; each process holds only the
rows of a global batch its devices own (:func:`local_batch_rows`) and
:func:`shard_batch` assembles the global array from every process's share
(``jax.make_array_from_process_local_data``). Host-side values come back with
:func:`local_rows_to_numpy` (this process's rows of a batch-sharded array),
:func:`replicated_to_numpy` (a replicated array) and :func:`gather_to_host` (a whole sharded
tree, gathered from all processes).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetrl.trainer_jax.config import MESH_AXES, DistributedConfig, MeshConfig

BATCH_AXES: tuple[str, str] = ("data", "fsdp")
"""Mesh axes the batch dimension is split over."""

__all__ = [
    "BATCH_AXES",
    "initialize_distributed",
    "make_mesh",
    "batch_sharding",
    "replicated",
    "fit_spec",
    "state_shardings",
    "place",
    "local_batch_rows",
    "shard_batch",
    "local_rows_to_numpy",
    "replicated_to_numpy",
    "gather_to_host",
]


# ====================================================================== start-up
def initialize_distributed(config: DistributedConfig = DistributedConfig()) -> bool:
    """Join a multi-process run before any JAX computation; return True if one was joined.

    Explicit mode (a coordinator address in ``config`` or ``HETRL_COORDINATOR``) needs the
    process count and id (config or ``HETRL_NUM_PROCESSES`` / ``HETRL_PROCESS_ID``); ``auto``
    lets JAX detect the cluster. Neither: single process, nothing is done. The CPU backend's
    cross-process collectives (``config.cpu_collectives``) are selected first, since CPU
    devices of different processes can only talk through them.
    """
    address = config.coordinator_address or os.environ.get("HETRL_COORDINATOR")
    if address is None and not config.auto:
        return False
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    if address is None:
        jax.distributed.initialize(initialization_timeout=config.initialization_timeout_s)
        return True
    num = config.num_processes if config.num_processes is not None else os.environ.get("HETRL_NUM_PROCESSES")
    pid = config.process_id if config.process_id is not None else os.environ.get("HETRL_PROCESS_ID")
    if num is None or pid is None:
        raise ValueError("a coordinator address needs num_processes and process_id (config or HETRL_NUM_PROCESSES / HETRL_PROCESS_ID)")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(num),
        process_id=int(pid),
        local_device_ids=list(config.local_device_ids) if config.local_device_ids is not None else None,
        initialization_timeout=config.initialization_timeout_s,
    )
    return True


# ====================================================================== mesh and shardings
def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data x fsdp x tensor`` mesh (all axes ``AxisType.Auto``) over ``devices``
    (default: every global device)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``("data", "fsdp")``, every other axis replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _axis_size(mesh: Mesh, entry: str | tuple[str, ...] | None) -> int:
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[n] for n in names)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """``spec`` padded to ``len(shape)`` with every entry whose mesh size does not divide its
    dimension replaced by ``None`` (replicated), so any mesh accepts any parameter."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return PartitionSpec(*(e if dim % _axis_size(mesh, e) == 0 else None for e, dim in zip(entries, shape)))


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """``NamedSharding`` per leaf of an nnx ``State`` from its partitioning metadata (leaves
    without metadata are replicated); same tree structure as ``state``."""
    from flax import nnx

    specs = nnx.get_partition_spec(state)
    return jax.tree.map(
        lambda spec, leaf: NamedSharding(mesh, fit_spec(spec, np.shape(leaf), mesh)),
        specs, state, is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def place(tree: Any, shardings: Any) -> Any:
    """Global arrays from host values every process holds in full: leaf ``x`` becomes an
    array of sharding ``s`` whose shards are the slices ``x[index]`` (no cross-host traffic)."""

    def put(x: Any, s: NamedSharding) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


# ====================================================================== batches across processes
def local_batch_rows(mesh: Mesh, global_batch: int) -> slice:
    """The rows ``[start, stop)`` of a ``global_batch``-row batch that this process's devices
    hold under :func:`batch_sharding`: the share this process loads. Single process: all."""
    split = _axis_size(mesh, BATCH_AXES)
    if global_batch % split:
        raise ValueError(f"global batch of {global_batch} rows does not split over data x fsdp = {split} shards")
    index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch,))
    rows = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop) for s in index_map.values()})
    for (_, stop), (start, _) in zip(rows, rows[1:]):
        if start != stop:
            raise ValueError(f"this process's batch rows {rows} are not contiguous; order the mesh devices by process")
    return slice(rows[0][0], rows[-1][1])


def shard_batch(local: Mapping[str, np.ndarray], mesh: Mesh, global_batch: int) -> dict[str, jax.Array]:
    """Global batch arrays ``[global_batch, ...]`` from this process's rows
    (``local[k]`` holds rows :func:`local_batch_rows` of array ``k``)."""
    rows = local_batch_rows(mesh, global_batch)
    sharding = batch_sharding(mesh)
    out = {}
    for name, value in local.items():
        value = np.asarray(value)
        if value.shape[0] != rows.stop - rows.start:
            raise ValueError(f"{name}: this process holds rows {rows.start}:{rows.stop} but got {value.shape[0]} rows")
        out[name] = jax.make_array_from_process_local_data(sharding, value, (global_batch, *value.shape[1:]))
    return out


def local_rows_to_numpy(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded array, in order (replicas counted once)."""
    pieces: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = (shard.index[0].start or 0) if shard.index else 0
        pieces.setdefault(start, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)


def replicated_to_numpy(tree: Any) -> Any:
    """Host copies of fully replicated arrays (e.g. metrics), read from a local replica."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def gather_to_host(tree: Any) -> Any:
    """Full host (numpy) copies of a tree of global arrays, gathered from every process."""
    return multihost_utils.process_allgather(tree, tiled=True)
