"""The RAY backend of the asynchronous loop (DESIGN §5): every pool replica's sampler and the
trainer live in Ray actors, the route to many machines.

The loop is :class:`hetrl.orchestrator.loop.AsyncOrchestrator`, unchanged: the driver keeps the
fleet (routing, re-queueing, cost), the buffer, the episodes (environments and sandbox) and the
logs, and reaches the actors through two proxies with the interfaces the loop already uses:

* :class:`RaySampler` (the :class:`hetrl.samplers.base.Sampler` protocol, with the hosted
  sampler's optional capabilities: reseed, and abort, which reaches the running call) over an
  actor hosting :func:`build_embedded_sampler` (one per replica, and one for the held-out
  evaluation);
* :class:`RayTrainer` (:class:`TrainerHandle`) over an actor hosting :func:`build_trainer`.

So the semantics are those of the local backend by construction: one generate call at a time
per replica, weights loaded between calls (versions monotone per replica), the staleness bound of
the buffer. A replica actor that dies (``ray.kill``, a crashed process, a lost node) makes its
calls raise ``RayActorError``; the fleet marks the replica dead and re-queues its jobs, which
finish elsewhere, exactly once.

Calls travel through Ray's object store with Ray's own serialization, between our own
processes only. Published weights (HF-named numpy arrays) are put into the object store once
per version (:class:`hetrl.orchestrator.transport.RayObjectStoreTransport`) and every actor is
sent the reference, fetching that one copy itself (the driver never relays weights per
replica). Actors reserve no CPU (``num_cpus=0``) so any number of them share a small machine;
the trainer's checkpoints are written by its actor to the run folder's ``checkpoints/``, which
must be on a disk the driver sees.

Ray: ``ray.address`` connects to a running cluster; otherwise a private local instance is
started (``ray.num_cpus``, files under ``ray.temp_dir`` or a fresh short directory in /tmp,
removed at the end; no dashboard) and shut down when the run ends. If Ray is already initialized
in this process (e.g. by a test), that instance is used and left running.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import ray

from hetrl.core.schema import RolloutBatch, SamplerInfo
from hetrl.orchestrator.loop import AsyncOrchestrator, build_embedded_sampler
from hetrl.orchestrator.trainer_handle import TrainerHandle, TrainerSetup, build_trainer
from hetrl.orchestrator.transport import RayObjectStoreTransport, WeightTransport, object_ref
from hetrl.samplers.base import Generation, GenerationRequest, Sampler, SamplerHealth
from hetrl.samplers.profiles import SamplerNumerics
from hetrl.stopping import reclaim_signals

__all__ = ["RayOrchestrator", "RaySampler", "RayTrainer", "HostActor"]


@ray.remote(num_cpus=0, concurrency_groups={"signal": 1})
class HostActor:
    """Hosts the object ``build(*args, **kwargs)`` in this actor's process: :meth:`call` runs one
    of its methods, :meth:`attribute` reads one attribute. Calls run one at a time, in order;
    :meth:`signal` runs beside them (its own concurrency group), for methods meant to reach a
    call that is running (a sampler's ``abort``)."""

    def __init__(self, build: Callable[..., Any], *args: Any, **kwargs: Any):
        self._obj = build(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._obj, method)(*args, **kwargs)

    @ray.method(concurrency_group="signal")
    def signal(self, method: str) -> Any:
        return getattr(self._obj, method)()

    def attribute(self, name: str) -> Any:
        return getattr(self._obj, name)


class RaySampler:
    """The :class:`Sampler` protocol over a :class:`HostActor` hosting a sampler; ``info`` is
    fetched once (the first access waits for the actor to be built)."""

    def __init__(self, actor: "ray.actor.ActorHandle"):
        self.actor = actor
        self._info: SamplerInfo | None = None
        self._supports_reseed: bool | None = None
        self._supports_abort: bool | None = None

    @property
    def info(self) -> SamplerInfo:
        if self._info is None:
            self._info = ray.get(self.actor.attribute.remote("info"))
        return self._info

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        return ray.get(self.actor.call.remote("generate", list(requests)))

    def update_weights(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Send the actor the object-store reference of ``weights`` (put once per
        :class:`~hetrl.samplers.weight_set.WeightSet`); Ray resolves it in the actor's process."""
        ray.get(self.actor.call.remote("update_weights", version, object_ref(weights)))

    def health(self) -> SamplerHealth:
        return ray.get(self.actor.call.remote("health"))

    @property
    def supports_reseed(self) -> bool:
        """Whether the hosted sampler can reseed (asked once)."""
        if self._supports_reseed is None:
            self._supports_reseed = ray.get(self.actor.attribute.remote("supports_reseed"))
        return self._supports_reseed

    def reseed(self, seed: int) -> None:
        ray.get(self.actor.call.remote("reseed", seed))

    @property
    def supports_abort(self) -> bool:
        """Whether the hosted sampler can abort (asked once)."""
        if self._supports_abort is None:
            self._supports_abort = ray.get(self.actor.attribute.remote("supports_abort"))
        return self._supports_abort

    def abort(self) -> None:
        """Abort the hosted sampler's running ``generate`` call (sent beside it: :meth:`HostActor.signal`)."""
        ray.get(self.actor.signal.remote("abort"))


class RayTrainer:
    """:class:`TrainerHandle` over a :class:`HostActor` hosting the trainer. ``version`` is read
    from the actor once and again after every call that changes it."""

    def __init__(self, actor: "ray.actor.ActorHandle"):
        self.actor = actor
        self._version: int | None = None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.actor.call.remote(method, *args, **kwargs))

    @property
    def version(self) -> int:
        if self._version is None:
            self._version = int(ray.get(self.actor.attribute.remote("version")))
        return self._version

    def train_step(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None) -> dict[str, float]:
        self._version = None
        return self._call("train_step", batch, old_logprobs)

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        return self._call("logprobs", batch)

    def export_hf_weights(self) -> dict[str, np.ndarray]:
        return self._call("export_hf_weights")

    def save(self, *, force: bool = True) -> bool:
        return self._call("save", force=force)

    def restore(self) -> int:
        self._version = None
        return self._call("restore")

    def checkpoint_steps(self) -> list[int]:
        return self._call("checkpoint_steps")

    def close(self) -> None:
        self._call("close")


class RayOrchestrator(AsyncOrchestrator):
    """Runs a config with every sampler and the trainer in Ray actors (see the module docstring)."""

    backend = "ray"

    def _start_backend(self) -> None:
        self._actors: list[ray.actor.ActorHandle] = []
        self._owns_ray = not ray.is_initialized()
        self._temp_dir: str | None = None
        if not self._owns_ray:
            return
        settings = self.config.ray
        if settings.address is not None:
            ray.init(address=settings.address)
            reclaim_signals()  # ray.init installs its own SIGTERM handler (exit 1 at once)
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private instance on this machine only
        temp_dir = settings.temp_dir
        if temp_dir is None:  # Ray's socket paths must stay short: a fresh directory right in /tmp
            temp_dir = self._temp_dir = tempfile.mkdtemp(prefix="hetrl-ray-", dir="/tmp")
        ray.init(num_cpus=settings.num_cpus, _temp_dir=str(pathlib.Path(temp_dir).resolve()),
                 include_dashboard=False)
        reclaim_signals()

    def _stop_backend(self) -> None:
        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()
        if self._owns_ray:
            ray.shutdown()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def _host(self, build: Callable[..., Any], *args: Any, **kwargs: Any) -> "ray.actor.ActorHandle":
        actor = HostActor.remote(build, *args, **kwargs)
        self._actors.append(actor)
        return actor

    def _create_sampler(self, numerics: SamplerNumerics, *, pool: str, seed: int) -> Sampler:
        return RaySampler(self._host(build_embedded_sampler, self.model_dir, numerics, pool=pool, seed=seed))

    def _create_trainer(self, setup: TrainerSetup) -> TrainerHandle:
        return RayTrainer(self._host(build_trainer, self.model_dir, setup))

    def _embedded_transport(self, numerics: Sequence[SamplerNumerics]) -> WeightTransport:
        return RayObjectStoreTransport()

    def replica_actor(self, replica_key: str) -> "ray.actor.ActorHandle":
        """The actor of replica ``<pool>/<index>`` (once the run has set up its fleet)."""
        for replica in self.fleet.replicas:
            if replica.key == replica_key:
                if not isinstance(replica.sampler, RaySampler):
                    raise ValueError(f"replica {replica_key!r} is wrapped ({type(replica.sampler).__name__})")
                return replica.sampler.actor
        raise KeyError(f"no replica {replica_key!r}; replicas: {[r.key for r in self.fleet.replicas]}")
