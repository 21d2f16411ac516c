"""The RAY backend of the asynchronous loop (DESIGN §5): every pool replica's sampler and the
trainer live in Ray actors, the route to many machines.

The loop is :class:`hetrl.orchestrator.loop.AsyncOrchestrator`, unchanged: the driver keeps the
fleet (routing, re-queueing, cost), the buffer, the episodes (environments and sandbox) and the
logs, and reaches the actors through two proxies with the interfaces the loop already uses:

* :class:`RaySampler` (the :class:`hetrl.samplers.base.Sampler` protocol, with the hosted
  sampler's optional capabilities: reseed, and abort, which reaches the running call) over an
  actor hosting :func:`build_embedded_sampler` (one per replica, and one for the held-out
  evaluation);
* :class:`RayTrainer` (:class:`TrainerHandle`) over an actor hosting :func:`build_trainer`; with
  ``trainer.world_size`` N > 1, :class:`RayTrainerRanks` over N actors hosting one
  :class:`~hetrl.orchestrator.trainer_ranks.RankTrainer` each, placed in one placement group
  (bundles of one CPU, and one GPU each where the cluster has N GPUs; ``PACK``: one node when it
  fits, several otherwise), joined at rank 0's node address by ``torch.distributed`` (Megatron)
  or ``jax.distributed`` (JAX). Every call runs on every rank; rank 0's result is the handle's
  and log-probs are reassembled from every rank's rows. A rank that fails ends the gang: every
  rank actor is killed and the call raises one :class:`TrainerRankFailed` naming the rank.

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
from hetrl.errors import UserError
from hetrl.orchestrator.loop import AsyncOrchestrator, build_embedded_sampler
from hetrl.orchestrator.trainer_handle import TrainerHandle, TrainerSetup, build_trainer
from hetrl.orchestrator.trainer_ranks import RankTrainer, TrainerRankFailed, assemble_logprobs
from hetrl.orchestrator.transport import RayObjectStoreTransport, WeightTransport, object_ref
from hetrl.samplers.base import Generation, GenerationRequest, Sampler, SamplerHealth
from hetrl.samplers.profiles import SamplerNumerics
from hetrl.stopping import reclaim_signals

__all__ = ["RayOrchestrator", "RaySampler", "RayTrainer", "RayTrainerRanks", "HostActor", "TrainerActor"]

PLACEMENT_TIMEOUT_S = 120.0
"""How long the trainer ranks' placement group may wait for its resources before the run is refused."""


class _Host:
    """Hosts the object ``build(*args, **kwargs)`` in an actor's process: :meth:`call` runs one
    of its methods, :meth:`attribute` reads one attribute. Calls run one at a time, in order, on
    the thread that built the object (what the trainers need: the megatron CPU shim's
    torch-function mode holds per thread)."""

    def __init__(self, build: Callable[..., Any], *args: Any, **kwargs: Any):
        self._obj = build(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._obj, method)(*args, **kwargs)

    def attribute(self, name: str) -> Any:
        return getattr(self._obj, name)


TrainerActor = ray.remote(num_cpus=0)(_Host)
"""A :class:`_Host` actor for a trainer (or one trainer rank)."""


@ray.remote(num_cpus=0, concurrency_groups={"signal": 1})
class HostActor(_Host):
    """A :class:`_Host` actor whose :meth:`signal` runs beside its calls (its own concurrency
    group, so calls run on a thread of the default group), for methods meant to reach a call
    that is running (a sampler's ``abort``)."""

    @ray.method(concurrency_group="signal")
    def signal(self, method: str) -> Any:
        return getattr(self._obj, method)()


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
    """:class:`TrainerHandle` over a :class:`TrainerActor` hosting the trainer. ``version`` is read
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


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """This node's address and a free port on it (run in rank 0's bundle)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class RayTrainerRanks(RayTrainer):
    """:class:`TrainerHandle` over ``actors``, one :class:`TrainerActor` per trainer rank hosting a
    :class:`RankTrainer` (see the module docstring); ``version`` is rank 0's."""

    def __init__(self, actors: Sequence["ray.actor.ActorHandle"]):
        super().__init__(actors[0])
        self.actors = list(actors)
        self._failed: str | None = None

    def _gang(self, op: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``op`` on every rank; every rank's result, in rank order."""
        if self._failed is not None:
            raise TrainerRankFailed(self._failed)
        refs = [a.call.remote("execute", op, *args, **kwargs) for a in self.actors]
        pending = list(refs)
        while pending:  # a failed rank leaves the others waiting in a collective: stop at the first failure
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as err:  # noqa: BLE001  (any rank's failure ends the gang)
                cause = [line for line in str(err).splitlines() if line.strip()][-1:]  # the rank's own exception
                self._failed = (f"trainer ranks failed in {op} ({len(self.actors)} ranks on Ray): rank "
                                f"{refs.index(done[0])} failed: {cause[0].strip() if cause else type(err).__name__}")
                for actor in self.actors:
                    ray.kill(actor)
                raise TrainerRankFailed(self._failed) from err
        return ray.get(refs)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._gang(method, *args, **kwargs)[0]

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        return assemble_logprobs(batch.input_ids.shape, self._gang("logprobs", batch))


class RayOrchestrator(AsyncOrchestrator):
    """Runs a config with every sampler and the trainer in Ray actors (see the module docstring)."""

    backend = "ray"

    def _start_backend(self) -> None:
        self._actors: list[ray.actor.ActorHandle] = []
        self._placement_groups: list[Any] = []
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
        from ray.util.placement_group import remove_placement_group

        for group in self._placement_groups:
            remove_placement_group(group)
        self._placement_groups.clear()
        if self._owns_ray:
            ray.shutdown()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def _keep(self, actor: "ray.actor.ActorHandle") -> "ray.actor.ActorHandle":
        """``actor``, killed when the run's backend stops."""
        self._actors.append(actor)
        return actor

    def _host(self, build: Callable[..., Any], *args: Any, **kwargs: Any) -> "ray.actor.ActorHandle":
        return self._keep(HostActor.remote(build, *args, **kwargs))

    def _create_sampler(self, numerics: SamplerNumerics, *, pool: str, seed: int) -> Sampler:
        return RaySampler(self._host(build_embedded_sampler, self.model_dir, numerics, pool=pool, seed=seed))

    def _create_trainer(self, setup: TrainerSetup) -> TrainerHandle:
        if setup.settings.world_size > 1:
            return RayTrainerRanks(self._place_ranks(setup))
        return RayTrainer(self._keep(TrainerActor.remote(build_trainer, self.model_dir, setup)))

    def _place_ranks(self, setup: TrainerSetup) -> list["ray.actor.ActorHandle"]:
        """One actor per trainer rank, each in its bundle of one placement group (see the module
        docstring); the group is removed with the run's actors."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = setup.settings.world_size
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= n else 0
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
        group = placement_group([bundle] * n, strategy="PACK")
        self._placement_groups.append(group)
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise UserError(f"trainer.world_size: {n} trainer ranks need {n} x {bundle} in one placement group and "
                            f"the Ray cluster has {ray.cluster_resources()}; lower trainer.world_size or add "
                            f"resources (ray.num_cpus, nodes)") from None
        in_bundle = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(n)]
        address, port = ray.get(_rendezvous.options(scheduling_strategy=in_bundle[0]).remote())
        return [self._keep(TrainerActor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=in_bundle[rank])
                           .remote(RankTrainer, self.model_dir, setup, rank, n, port, address, 0 if gpus else None))
                for rank in range(n)]

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
