"""Weight transports: how the trainer's weights reach the pools (DESIGN §5).

The trainer handle owns the weight version (:attr:`hetrl.orchestrator.trainer_handle.TrainerHandle.version`).
After each step the loop hands its HF-named export to :meth:`WeightPublisher.publish`, which wraps
it as one :class:`hetrl.samplers.weight_set.WeightSet` stamped with that version, lets every
:class:`WeightTransport` stage it once for the replicas it serves, and makes it the fleet's current
set (:meth:`hetrl.samplers.fleet.Fleet.publish_weights`). Each replica then loads it between two
generate calls through ``Sampler.update_weights(version, weight_set)``, taking the form its
transport staged (or staging it itself, once per set, when no transport did):

* :class:`InProcessTransport`, embedded replicas in this process: the parameter arrays of each
  weight format, quantized once per version and format and shared by every replica of that
  format, which swaps them in place (:func:`hetrl.samplers.embedded.staged_parameters`).
* :class:`SharedDiskTransport`, SGLang / sglang-jax servers: one checksummed export per version
  under the run folder's ``weights/`` (:func:`hetrl.samplers.sglang.disk_export`), which each
  server loads with ``/update_weights_from_disk`` (or is restarted on).
* :class:`RayObjectStoreTransport`, replicas in Ray actors: the arrays ``ray.put`` once per
  version; each actor is sent the reference and fetches them from the object store itself, so
  the driver never sends a replica its own copy (:func:`object_ref`).

A distributed transport (the trainer ranks broadcasting into the servers' process group:
SGLang's ``/init_weights_update_group``, then ``/begin_weight_update``,
``/update_weights_from_distributed`` beside one ``broadcast`` per tensor, ``/end_weight_update``)
is a further :class:`WeightTransport` whose :meth:`~WeightTransport.stage` would broadcast; it is
not built (tried by hand against the CPU SGLang server over gloo, where it works: BENCHMARKS.md).
"""

from __future__ import annotations

import abc
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from hetrl.models.config import ModelConfig
from hetrl.samplers.fleet import Fleet
from hetrl.samplers.profiles import SamplerNumerics
from hetrl.samplers.weight_set import WeightSet

__all__ = ["WeightTransport", "InProcessTransport", "SharedDiskTransport", "RayObjectStoreTransport",
           "WeightPublisher", "object_ref", "OBJECT_STORE"]

OBJECT_STORE = ("ray-object-store",)
"""The :class:`WeightSet` key of a set's object-store reference."""


class WeightTransport(abc.ABC):
    """Carries one published :class:`WeightSet` to the replicas of the pools it serves."""

    @abc.abstractmethod
    def stage(self, weights: WeightSet) -> None:
        """Prepare ``weights`` once for every replica this transport serves (at publication,
        before any replica loads it)."""


class InProcessTransport(WeightTransport):
    """Embedded replicas in this process (see the module docstring): stages the parameter
    arrays of each distinct weight format among ``numerics`` (one quantization per format)."""

    def __init__(self, config: ModelConfig, numerics: Iterable[SamplerNumerics]):
        from hetrl.samplers.embedded import staging_key  # JAX: only where embedded replicas are

        self.config = config
        self.numerics = tuple({staging_key(config, n): n for n in numerics}.values())

    def stage(self, weights: WeightSet) -> None:
        from hetrl.samplers.embedded import staged_parameters

        for n in self.numerics:
            staged_parameters(weights, self.config, n)


class SharedDiskTransport(WeightTransport):
    """Server replicas reading a directory they share with the driver (see the module
    docstring): exports each version once under ``root``, with ``model_dir``'s non-weight files."""

    def __init__(self, config: ModelConfig, root: str | pathlib.Path, model_dir: str | pathlib.Path):
        self.config, self.root, self.model_dir = config, pathlib.Path(root), pathlib.Path(model_dir)

    def stage(self, weights: WeightSet) -> None:
        from hetrl.samplers.sglang import disk_export

        disk_export(weights.version, weights, self.config, self.root, self.model_dir)


def object_ref(weights: Mapping[str, np.ndarray]) -> Any:
    """The object-store reference of ``weights`` (``ray.put`` of a plain dict): for a
    :class:`WeightSet`, put once per set; the caller must hold Ray initialized."""
    import ray

    if isinstance(weights, WeightSet):
        return weights.staged(OBJECT_STORE, lambda ws: ray.put(dict(ws)))
    return ray.put(dict(weights))


class RayObjectStoreTransport(WeightTransport):
    """Replicas in Ray actors (see the module docstring): puts each version into the object
    store once; :class:`hetrl.orchestrator.ray_backend.RaySampler` sends actors the reference."""

    def stage(self, weights: WeightSet) -> None:
        object_ref(weights)


class WeightPublisher:
    """Publishes the trainer's weights to ``fleet`` through ``transports`` (see the module
    docstring); holds no version of its own."""

    def __init__(self, fleet: Fleet, transports: Sequence[WeightTransport]):
        self.fleet = fleet
        self.transports = tuple(transports)

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> WeightSet:
        """Stage HF-named ``weights`` of ``version`` with every transport and make them the
        fleet's current set (versions must increase); returns the set."""
        published = WeightSet(version, weights)
        for transport in self.transports:
            transport.stage(published)
        self.fleet.publish_weights(version, published)
        return published
