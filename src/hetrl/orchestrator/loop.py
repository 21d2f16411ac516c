"""The asynchronous loop (DESIGN §5), shared by every backend: the driver that feeds the fleet,
plays episodes, buffers groups, steps the trainer, publishes weights and logs.

A backend (:mod:`hetrl.orchestrator.local`: in-process; :mod:`hetrl.orchestrator.ray_backend`:
Ray actors) only decides where the samplers and the trainer run and how calls reach them: it
implements :meth:`AsyncOrchestrator._create_sampler` (an object with the
:class:`hetrl.samplers.base.Sampler` protocol, built by :func:`build_embedded_sampler`) and
:meth:`AsyncOrchestrator._create_trainer` (a :class:`hetrl.orchestrator.trainer_handle.TrainerHandle`, built by
:func:`build_trainer`: the JAX or the Megatron trainer, as ``trainer.kind`` says), and may start
and stop its machinery. Everything below is the same
for all backends.

Threads of the driver:

* under the default ``async`` schedule (:mod:`hetrl.orchestrator.schedule`), one **rollout
  worker per pool replica**: ``fleet.serve_once(replica)`` takes the first turn of
  groups routed to it; the worker then plays each group's episodes to the end on the same replica
  (:class:`hetrl.orchestrator.episodes.EpisodeRunner`), with rewards from the environment,
  passes every rollout through the replica supervisor's admission
  (:meth:`hetrl.orchestrator.supervisor.ReplicaSupervisor.admit`: the
  :class:`hetrl.core.admission.RolloutGate` rejects malformed or poisoned ones, counted per pool
  and reason, never trained; a pool that returns too many is quarantined: the fleet stops routing
  to it and its work, queued, in flight or returned afterwards, is sampled again on the other
  pools) and puts the group into the :class:`RolloutBuffer`;
* the **trainer loop** (the calling thread): ``buffer.take(batch_groups, trainer.version)``
  returns as soon as that many groups are ready, none older than ``max_staleness`` versions; the
  batch is collated and trained on with one ``train_step``; the new weights are published to the
  fleet with the new version, through the run's weight transports
  (:mod:`hetrl.orchestrator.transport`: staged once per version, loaded by each replica between
  calls; embedded replicas in place). While it waits for a batch it lets the supervisor tend the
  fleet (``supervisor.tend``: dead replicas rebuilt per ``fleet.restart``, in restart threads).

**Replicas** are looked after by one :class:`hetrl.orchestrator.supervisor.ReplicaSupervisor`:
health probes (when due, not before every call), restarts, quarantine (the admission gate's
record, re-applied to the fleet on resume) and aborts; the fleet only routes and serves.
Under ``fleet.routing: autopilot`` each step's per-pool records also set the fleet's routing
shares (:mod:`hetrl.orchestrator.routing`), its decisions in the step's metrics.

**Weight updates** (``async.weight_update``). ``between_requests``: replicas load new weights
between generate calls; a call in flight, and the later turns of its groups, finish on the
weights they started with. ``abort``: in addition, each publication aborts the calls running on
every replica whose sampler can abort (:class:`hetrl.samplers.base.Abortable`: the embedded
engine, locally or in a Ray actor, stops within a quarter of its decode steps), and a group whose
generation overlaps a newer publication is retracted at the next turn boundary (after its first
turn, before each later turn, and when its last turn returns; a turn cut by an abort is always
overtaken): nothing of it is buffered, and its prompt is submitted again as a new group, so it
is regenerated on the new weights (counted as ``rollout/retracted``). So no buffered group was
overtaken by newer weights while any of its turns was generated, and no aborted turn is ever
trained on. On a replica that cannot abort (an SGLang pool) the turn running when the weights
change still runs to its end, so abort saves only the later turns there.

**Feeding and pacing.** Prompts cycle through the train functions of the synthetic coding suite,
reshuffled every pass by ``seed``, each pass with fresh examples and hidden tests
(:class:`hetrl.orchestrator.tasks.TaskSource`), so the policy learns to read examples, not one
instance; with ``environment.name: coding`` they cycle through the train tasks of its task files
(every pass the same tasks, reshuffled; :func:`hetrl.envs.task_files.task_splits`). Every group's state is recorded once, in the :class:`hetrl.orchestrator.ledger.GroupLedger`
(only live groups hold memory, so a long run's memory does not grow with its passes). At
most ``(max_staleness + 1) * batch_groups`` groups are outstanding (submitted and not yet trained
or dropped, buffered ones included; a trained batch stops counting once its step is published), so
no pool gets far ahead of the trainer; with ``max_staleness = 0`` this is the synchronous schedule
(generate a batch, train on it, publish, generate the next). Groups the buffer evicts under
``stale_policy: regenerate`` are sampled again under a new group id. Every group id is submitted
once and put at most once: a job of a replica that dies is re-queued by the fleet and finished
elsewhere; a group whose *later* turns fail, or that is retracted, is re-submitted under a new
group id.

**Outputs**: all in the run folder ``output_dir`` (:mod:`hetrl.orchestrator.run_folder`: its
layout, and the refusal of a new run in a folder that holds one): ``config.yaml``,
``metrics.jsonl`` and TensorBoard event files in ``tensorboard/``, trainer checkpoints in
``checkpoints/`` every ``checkpointing.every`` steps and at the end, each with the buffer's
snapshot ``buffer-<step>.json`` and the loop's state ``loop-<step>.json`` beside it and the
policy exported as an HF checkpoint ``hf/step-<step>/`` (``hf/latest`` the newest), the held-out
episodes of each evaluation in ``generations/eval-<step>.jsonl``, a W&B run with ``logging.wandb``
(:mod:`hetrl.orchestrator.monitors`); ``plots/*.png``;
``summary.json``.

**Resume** (``checkpointing.resume``, ``hetrl train --resume``): the newest checkpoint is
restored (model, optimizer, step) with the buffer as it was (its pending groups are trained, the
ids it has seen stay refused) and the loop's state: the data order continues where it stopped,
group ids continue after the last one used (no id is reused), the prompts of groups in flight at
the checkpoint are submitted first, and the counters (rollout counts, the fleet's requests,
tokens, busy time and cost) continue. Metric records the interrupted run wrote after the
checkpoint are dropped from the JSONL (those steps are trained again; a new TensorBoard event
file starts at the checkpoint's step). Under the default ``async`` schedule the samplers' random
streams and the timing are not replayed, so a resumed run continues the same training, not the
same samples. Under ``async.schedule: lockstep`` (:class:`hetrl.orchestrator.schedule.LockstepSchedule`)
nothing depends on timing, and a run resumed from any checkpoint reproduces the uninterrupted
run exactly (every metric but wall-clock timings).

A resume is refused when there is nothing to resume or when it changes a setting the checkpoint
fixes (:meth:`hetrl.orchestrator.run_folder.RunFolder.check_start`); the summary of a resumed
run covers the whole run (its history and counts from step 1; ``wall_s`` is this session's).

**Held-out evaluation** every ``environment.options.eval.every`` steps: a fixed subset of
``eval.tasks`` held-out tasks, one episode each, with the trainer's current weights on a
reference (unquantized fp32) embedded sampler, greedy (``top_k=1``) or at temperature 1;
``eval/success`` is the fraction whose hidden tests all pass, ``eval/reward`` the mean reward.

The trainer is the JAX trainer or the Megatron trainer (``trainer.kind``; the Megatron one as a
single rank, in the driver or in one Ray actor). Both take the same batches and publish HF
weights, so nothing else in the loop depends on which.
"""

from __future__ import annotations

import abc
import json
import logging
import pathlib
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hetrl.config import ConfigError, RunConfig
from hetrl.core.admission import RolloutGate
from hetrl.core.buffer import RolloutBuffer, RolloutGroup
from hetrl.core.schema import SamplingParams, collate
from hetrl.envs.base import ChatFormat, Task
from hetrl.envs.agent import AgentRepoEnv
from hetrl.envs.coding import CodingEnv
from hetrl.envs.options import CodingEnvOptions, EvalOptions, SyntheticEnvOptions
from hetrl.envs.sandbox import DEFAULT_HIDDEN, Sandbox
from hetrl.envs.task_files import hidden_paths, task_splits
from hetrl.envs.tasks_synthetic import SuiteConfig, synthetic_suite
from hetrl.models.config import ModelConfig
from hetrl.models.resolve import resolve_model
from hetrl.orchestrator.episodes import EpisodeRunner
from hetrl.orchestrator.evaluation import evaluate_tasks
from hetrl.orchestrator.ledger import Closed, GroupLedger, GroupSpec
from hetrl.orchestrator.monitors import build_monitors
from hetrl.orchestrator.preflight import check_runnable
from hetrl.orchestrator.recorder import StepRecorder
from hetrl.orchestrator.report import RunConsole, write_plots
from hetrl.orchestrator.run_folder import RunFolder, write_atomic
from hetrl.orchestrator.routing import make_router
from hetrl.orchestrator.schedule import Driver, Schedule, make_schedule
from hetrl.orchestrator.supervisor import FleetExhausted, ReplicaSupervisor
from hetrl.orchestrator.tasks import TaskSource
from hetrl.orchestrator.trainer_handle import TrainerHandle, TrainerSetup
from hetrl.orchestrator.transport import SharedDiskTransport, WeightPublisher, WeightTransport
from hetrl.samplers.base import Generation, GenerationRequest, Sampler, can_reseed
from hetrl.samplers.faults import ChaosLedger, ChaosSampler
from hetrl.samplers.fleet import Fleet, JobResult, PoolConfig, Replica
from hetrl.samplers.profiles import SamplerNumerics, sampler_numerics
from hetrl.stopping import Stopped

__all__ = ["EvalOptions", "SyntheticEnvOptions", "AsyncOrchestrator", "RunResult",
           "SamplerWrapper", "Retracted", "build_embedded_sampler", "SAMPLER_BATCH", "write_atomic"]

log = logging.getLogger(__name__)

SamplerWrapper = Callable[[PoolConfig, int, Sampler], Sampler]
"""Wraps replica ``index`` of a pool (tests: slow or failing pools); must keep ``info``."""

SAMPLER_BATCH = 16
"""Rows of every embedded generate call (fewer are padded): one compiled batch shape."""

WORKER_JOIN_S = 120.0
"""How long the end of a run (or a stop) waits for the rollout workers to leave the call they are in:
a thread still inside JAX when the interpreter exits aborts the process."""


def build_embedded_sampler(model_dir: str | pathlib.Path, numerics: SamplerNumerics, *, pool: str, seed: int) -> Sampler:
    """The embedded sampler of one replica (or of the evaluation) over the checkpoint in
    ``model_dir``: ``SAMPLER_BATCH`` rows per compiled generate call."""
    from hetrl.samplers.embedded import EmbeddedSampler

    return EmbeddedSampler.from_checkpoint(model_dir, numerics, pool=pool, seed=seed, max_batch=SAMPLER_BATCH,
                                           batch_buckets=(SAMPLER_BATCH,))


class Retracted(Exception):
    """A group's generation overlapped a newer weight publication (``weight_update: abort``)."""


@dataclass
class RunResult:
    """What a run did. ``trained`` lists ``(group_id, pool, min_version, trainer_version)`` per
    trained group in order; ``received`` every group id put into the buffer; ``submitted``
    every group id sent to the fleet; ``retracted`` every group id retracted under
    ``weight_update: abort``; ``rejected`` every group id none of whose rollouts was admitted
    (:class:`hetrl.core.admission.RolloutGate`); ``failed`` every group id whose later turn
    failed (its prompt submitted again); ``unfinished`` every group id still in flight when the
    run stopped; ``rollout_versions[replica key]`` the first-token weight version of each valid
    rollout that replica produced, in arrival order; ``rollout_spans[replica key]`` the
    ``(min, max)`` token version of each; ``rewards`` the environment reward of each.

    Conservation (what the soak run checks): every ``submitted`` id is in ``received``,
    ``rejected``, ``retracted`` or ``failed`` (at most one of them) or else in ``unfinished``;
    and the ``received`` groups are each trained once, dropped by the staleness policy, or still
    pending in the buffer."""

    history: list[dict[str, Any]]
    final: dict[str, Any]
    trained: list[tuple[str, str, int, int]]
    received: list[str]
    submitted: list[str]
    retracted: list[str]
    rollout_versions: dict[str, list[int]]
    rollout_spans: dict[str, list[tuple[int, int]]]
    rewards: list[float]
    output_dir: pathlib.Path
    metrics_path: pathlib.Path
    tensorboard_dir: pathlib.Path
    plots: list[pathlib.Path]
    checkpoint_dir: pathlib.Path
    checkpoint_steps: list[int] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)

    def audit(self) -> dict[str, Any]:
        """The conservation check of the class docstring: counts of each outcome, ``lost`` (ids
        submitted and accounted nowhere), ``duplicated`` (ids trained twice or with two
        outcomes) and ``unaccounted`` (received groups neither trained, dropped nor pending)."""
        outcomes = {"received": self.received, "rejected": self.rejected, "retracted": self.retracted,
                    "failed": self.failed}
        trained = [g for g, *_ in self.trained]
        seen = Counter(g for ids in outcomes.values() for g in set(ids))  # id -> how many outcomes name it
        repeats = Counter(trained) + Counter(g for ids in outcomes.values() for g in ids)
        duplicated = sorted({g for g, n in repeats.items() if n > seen[g] + (g in trained)} | {g for g, n in seen.items() if n > 1})
        accounted = set(seen) | set(self.unfinished)
        dropped, pending = int(self.final.get("groups_dropped", 0)), int(self.final.get("groups_pending", 0))
        return {
            "submitted": len(self.submitted), **{k: len(v) for k, v in outcomes.items()},
            "unfinished": len(set(self.unfinished) - set(seen)), "trained": len(trained), "dropped": dropped,
            "pending": pending, "lost": sorted(set(self.submitted) - accounted), "duplicated": duplicated,
            "unaccounted": len(self.received) - len(trained) - dropped - pending,
        }


class AsyncOrchestrator(abc.ABC):
    """Runs ``config`` (see the module docstring); subclasses place the samplers and the trainer.

    ``wrap_sampler`` wraps each replica's sampler (on the driver side); ``console`` turns the rich
    live display on or off (default: ``logging.console``)."""

    backend: str
    """The backend's name (``config.backend``)."""

    def __init__(self, config: RunConfig, *, wrap_sampler: SamplerWrapper | None = None, console: bool | None = None):
        check_runnable(config)
        self.options: SyntheticEnvOptions | CodingEnvOptions = config.environment.options
        self.config = config
        self.wrap_sampler = wrap_sampler
        self.console = config.logging.console if console is None else console
        self.display = RunConsole(config.steps, self.console)
        self.folder = RunFolder(pathlib.Path(config.output_dir))
        self.folder.check_start(config)
        self.output_dir = self.folder.root
        self.metrics_path = self.folder.metrics
        self.tensorboard_dir = self.folder.tensorboard
        self.checkpoint_dir = self.folder.checkpoints
        self.chaos_ledger = ChaosLedger()
        self._incarnations: dict[str, int] = {}
        self._stop_requested = threading.Event()

    def request_stop(self) -> None:
        """Finish the step in progress (an evaluation stops between its batches), checkpoint and
        return from :meth:`run`; during the set-up, :meth:`run` raises
        :class:`~hetrl.stopping.Stopped` at its next stage instead (thread-safe; e.g. on SIGTERM,
        when a preemptible machine is reclaimed)."""
        self._stop_requested.set()

    # ================================================================== backend hooks
    def _start_backend(self) -> None:
        """Start what the samplers and the trainer run on (before :meth:`_setup`)."""

    def _stop_backend(self) -> None:
        """Release it (always called once :meth:`_start_backend` returned)."""

    @abc.abstractmethod
    def _create_sampler(self, numerics: SamplerNumerics, *, pool: str, seed: int) -> Sampler:
        """``build_embedded_sampler(self.model_dir, numerics, pool=pool, seed=seed)``, wherever it runs."""

    @abc.abstractmethod
    def _create_trainer(self, setup: TrainerSetup) -> TrainerHandle:
        """``build_trainer(self.model_dir, setup)``, wherever it runs."""

    @abc.abstractmethod
    def _embedded_transport(self, numerics: Sequence[SamplerNumerics]) -> WeightTransport:
        """The :class:`~hetrl.orchestrator.transport.WeightTransport` to the embedded replicas
        of pools with these ``numerics``, wherever they run."""

    def _transports(self) -> list[WeightTransport]:
        """The transports to this run's pools: the backend's to embedded replicas, the shared
        disk (the run folder's ``weights/``) to server pools."""
        pools = self.config.fleet.pools
        embedded = [p.numerics() for p in pools if p.engine == "embedded"]
        return ([self._embedded_transport(embedded)] if embedded else []) + (
            [SharedDiskTransport(self.model_config, self.folder.weights, self.model_dir)]
            if any(p.engine != "embedded" for p in pools) else [])

    # ================================================================== setup
    def _setup(self) -> None:
        from tokenizers import Tokenizer

        cfg = self.config
        self.folder.write_config(cfg)
        if cfg.model.warmstart is not None:
            self.display.phase("warm start")
        self.model_dir = resolve_model(cfg.model, self.folder.models, console=self.console)
        self.display.phase("set-up")
        self._check_stop()
        self.model_config = ModelConfig.load(self.model_dir)
        tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.chat = ChatFormat.from_tokenizer(tokenizer)
        stops = tuple(dict.fromkeys(i for i in (self.chat.im_end_id, self.model_config.eos_token_id) if i is not None))
        coding = self.options.coding
        if isinstance(self.options, CodingEnvOptions):  # task sets from files; their data hidden from the sandbox
            sources = [s for s in (self.options.train, self.options.heldout) if s is not None]
            suite = task_splits(self.options.train, self.options.heldout, self.options.heldout_fraction, cfg.seed,
                                repo_only=self.options.agent is not None)
            hidden = tuple(p for s in sources for p in hidden_paths(s))
            agent = self.options.agent
        else:
            suite = synthetic_suite(self.options.suite or (cfg.model.warmstart.suite if cfg.model.warmstart
                                                           else SuiteConfig(seed=cfg.seed)))
            hidden, agent = (), None
        sandbox = Sandbox(coding.limits, require=coding.require_isolation, hidden=DEFAULT_HIDDEN + hidden)
        self.runner = EpisodeRunner(
            self.chat, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            (lambda: AgentRepoEnv(agent, coding, sandbox)) if agent else (lambda: CodingEnv(coding, sandbox)),
            max_new_tokens=cfg.async_.max_new_tokens,
            max_length=self.model_config.max_position_embeddings, vocab_size=self.model_config.vocab_size,
            stop_token_ids=stops,
        )
        self.suite = suite
        self.eval_tasks = suite.heldout[: self.options.eval.tasks]

        setup = TrainerSetup.of(cfg, self.checkpoint_dir.resolve())
        self.needs_old_logprobs = setup.correction.ppo_clip is not None
        self.trainer = self._create_trainer(setup)
        self._check_stop()
        self.fleet = Fleet.from_config(cfg.fleet, self._make_sampler)
        self.publisher = WeightPublisher(self.fleet, self._transports())
        self._check_stop()
        self.pool_names = tuple(self.fleet.pools)
        self._eval_sampler = (self._create_sampler(sampler_numerics("fp32"), pool="eval", seed=cfg.seed)
                              if self.options.eval.every else None)
        self.buffer = RolloutBuffer(cfg.async_.max_staleness, cfg.async_.stale_policy)
        self.gate = RolloutGate(cfg.fleet.quarantine, vocab_size=self.model_config.vocab_size,
                                max_length=self.model_config.max_position_embeddings,
                                max_staleness=cfg.async_.max_staleness)
        self._resume_state: dict[str, Any] | None = None
        self._resumed_history: list[dict[str, Any]] = []
        if cfg.checkpointing.resume and self.checkpoint_dir.exists() and self.trainer.checkpoint_steps():
            step = self.trainer.restore()
            snap = self.checkpoint_dir / f"buffer-{step}.json"
            if snap.exists():
                self.buffer = RolloutBuffer.restore(json.loads(snap.read_text()))
            state = self.checkpoint_dir / f"loop-{step}.json"
            if state.exists():
                self._resume_state = json.loads(state.read_text())
            self._resumed_history = _truncate_metrics(self.metrics_path, step)
        if self.trainer.version > 0:
            self.publisher.publish(self.trainer.version, self.trainer.export_hf_weights())
        self._check_stop()

    def _check_stop(self) -> None:
        """A safe point of the set-up: raise :class:`~hetrl.stopping.Stopped` if a stop was requested
        (nothing trained yet, so nothing to checkpoint)."""
        if self._stop_requested.is_set():
            raise Stopped("the set-up")

    def _make_sampler(self, pool: PoolConfig, numerics: SamplerNumerics, index: int) -> Sampler:
        """Replica ``index`` of ``pool``: an embedded engine (placed by the backend), or an HTTP
        client of the pool's ``index``-th server (in the driver, whatever the backend)."""
        if pool.engine == "embedded":
            seed = (self.config.seed * 1_000_003 + zlib.crc32(pool.name.encode()) * 101 + index) % (2**31)
            sampler = self._create_sampler(numerics, pool=pool.name, seed=seed)
        else:
            from hetrl.samplers.sglang import ServerSampler

            sampler = ServerSampler(pool, numerics, model_dir=self.model_dir, weights_dir=self.folder.weights,
                                    endpoints=[pool.endpoints[index]])
        if self.config.fleet.chaos is not None:
            chaos = self.config.fleet.chaos
            incarnation = self._incarnations[f"{pool.name}/{index}"] = self._incarnations.get(f"{pool.name}/{index}", -1) + 1
            seed = zlib.crc32(f"{chaos.seed}/{pool.name}/{index}/{incarnation}".encode())
            sampler = ChaosSampler(sampler, chaos, seed, self.chaos_ledger)
        sampler = self.wrap_sampler(pool, index, sampler) if self.wrap_sampler else sampler
        if self.config.async_.schedule == "lockstep" and not can_reseed(sampler):
            raise ConfigError(f"async.schedule: lockstep reseeds every replica each step, and the "
                              f"{type(sampler).__name__} sampler of pool {pool.name!r} cannot reseed; "
                              "use schedule: async, or a sampler (wrapper) that forwards reseed")
        return sampler

    # ================================================================== the fleet side
    def _top_up(self) -> None:
        """Submit groups until ``(max_staleness + 1) * batch_groups`` are outstanding; stale
        evictions queued for regeneration go first."""
        a = self.config.async_
        target = (a.max_staleness + 1) * a.batch_groups
        with self._lock:
            self.ledger.drop(self.buffer.pop_evicted())
            regen = [self.tasks.resolve(s.prompt_id) for s in self.buffer.pop_regenerations()]
            while not self._stop.is_set() and (regen or self.ledger.outstanding < target):
                if regen:
                    self._submit_locked(regen.pop(0))
                else:
                    self._submit_locked(*self._carried_over.pop(0)) if self._carried_over \
                        else self._submit_locked(self.tasks.next())

    def _submit_locked(self, task: Task, gid: str | None = None, replica: str | None = None) -> None:
        """Submit ``task`` as a group (one fleet job of ``group_size`` requests); holds the lock.
        A new group takes the next id and the schedule's pin; a group carried over from a
        checkpoint (``gid``) keeps its id and pin, so a resumed lockstep run serves it where the
        uninterrupted run did."""
        a = self.config.async_
        if gid is None:
            gid, replica = f"g{self._next_gid:06d}", self.schedule.pin(self._next_gid)
            self._next_gid += 1
        spec = GroupSpec(gid, task, self.tasks.prompt(task), time.monotonic(), replica)
        self.ledger.submit(spec)
        self.fleet.submit(gid, self.runner.requests(gid, spec.prompt, a.group_size, a.sampling), replica=replica)

    def _worker(self, replica: Replica) -> None:
        """Serve ``replica`` until stopped or dead; play each finished job's group and buffer it."""
        while not self._stop.is_set() and replica.alive:
            for result in self.fleet.serve_once(replica, timeout=0.2):
                if self._stop.is_set():
                    return
                self._finish_group(replica, result)
            self._top_up()

    def _retract_if_stale(self, version: int) -> None:
        """Under ``weight_update: abort``, raise :class:`Retracted` if weights newer than
        ``version`` were published."""
        if self.config.async_.weight_update == "abort" and version < self.fleet.published_version:
            raise Retracted

    def _retract_if_overtaken(self, generations: Sequence[Generation]) -> None:
        """Under ``weight_update: abort``, raise :class:`Retracted` if newer weights overtook a
        turn: published after its oldest token's version, or its call aborted by a publication."""
        if self.config.async_.weight_update == "abort" and any(g.finish_reason == "abort" for g in generations):
            raise Retracted
        self._retract_if_stale(_oldest_version(generations))

    def _continue_fn(self, replica: Replica) -> Callable[[Sequence[GenerationRequest]], list[Generation]]:
        """Later turns of a group on ``replica``; under ``abort`` retracted before a turn would
        start on old weights and after a turn that newer weights overtook."""
        def generate(requests: Sequence[GenerationRequest]) -> list[Generation]:
            self._retract_if_stale(replica.weight_version or 0)
            out = replica.sampler.generate(requests)
            self._retract_if_overtaken(out)
            return out
        return generate

    def _finish_group(self, replica: Replica, result: JobResult) -> None:
        """Play the group of ``result`` to its end, admit its rollouts and buffer it, closing it
        in the ledger as received, rejected, retracted (submitted again) or failed (submitted
        again); a group the buffer cannot take any more (the run is over) stays in flight."""
        with self._lock:
            spec = self.ledger.spec(result.job_id)
        if spec is None:  # the fleet delivered a job again after it was closed: nothing to do
            return
        sampling = self.config.async_.sampling
        try:
            self._retract_if_overtaken(result.generations)
            outcome = self.runner.run_group(spec.group_id, spec.task, spec.prompt, result.generations, sampling,
                                            self._continue_fn(replica))
        except Retracted:  # weights changed under it: regenerate the prompt on the new ones
            self._close_and_resubmit(spec, "retracted")
            return
        except Exception:  # a later turn failed on this replica: redo the prompt as a new group
            with self._lock:
                self._counts["continuation_failures"] += 1
            self._close_and_resubmit(spec, "failed")
            return
        pool = replica.pool.name
        admission = self.supervisor.admit(pool, outcome.rollouts, outcome.rejected,
                                          published_version=self.fleet.published_version)
        buffered = admission.admitted + admission.stale  # the buffer drops or regenerates the stale ones
        quarantined = self.supervisor.is_quarantined(pool)
        with self._lock:
            self._counts["rollouts_rejected"] += len(admission.rejected) + len(outcome.errors)
            self._counts["rollouts_valid"] += len(buffered)
            self._errors.extend([str(e) for e in admission.rejected[-5:]] + outcome.errors[-5:])
            if not buffered:
                self._counts["groups_rerouted" if quarantined else "groups_rejected"] += 1
        if not buffered:  # if its pool is out, sample the prompt again on the others
            self._close_and_resubmit(spec, "rejected", again=quarantined)
            return
        with self._lock:
            for r in buffered:
                self._rollout_versions.setdefault(replica.key, []).append(int(r.policy_version[0]))
                self._rollout_spans.setdefault(replica.key, []).append(
                    (int(r.policy_version.min()), int(r.policy_version.max())))
                self._rewards.append(float(r.reward))
        group = RolloutGroup(spec.group_id, spec.task.task_id, tuple(buffered))
        with self._lock:  # buffered and no longer in flight at once, as a checkpoint's state sees it
            try:
                accepted = self.buffer.put(group)
            except RuntimeError:  # buffer closed: the run is over
                return
            if accepted:
                self.ledger.receive(spec.group_id)
            else:
                self.ledger.close(spec.group_id, "refused")

    def _rebuild_sampler(self, replica: Replica) -> Sampler:
        """A new sampler for the dead ``replica`` (the supervisor's restarts)."""
        return self._make_sampler(replica.pool, self.fleet.numerics[replica.pool.name], replica.index)

    def _record_error(self, message: str) -> None:
        with self._lock:
            self._errors.append(message)

    def _start_worker(self, replica: Replica) -> None:
        self._start_thread(self._worker, replica, name=f"worker-{replica.key}")

    def _start_thread(self, target: Callable[[Replica], None], replica: Replica, *, name: str) -> None:
        """Start ``target(replica)`` in a thread :meth:`_shutdown` joins; none once it began."""
        with self._lock:
            if self._stop.is_set():
                return
            thread = threading.Thread(target=target, args=(replica,), name=name, daemon=True)
            self._threads.append(thread)
            thread.start()

    def _shutdown(self) -> None:
        """Stop the driver's threads and join every one: the stop flag is set under the lock that
        :meth:`_start_thread` holds, so no thread joins the list after it and none is missed.
        The calls running on replicas that can abort are aborted (their groups stay unfinished
        either way), so their workers leave at once."""
        with self._lock:
            self._stop.set()
        self.fleet.close()
        self.buffer.close()
        self.supervisor.abort_in_flight()
        deadline = time.monotonic() + WORKER_JOIN_S  # a worker may be inside a generate call (or its compilation)
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _close_and_resubmit(self, spec: GroupSpec, outcome: Closed, again: bool = True) -> None:
        """Close ``spec``'s group as ``outcome`` and (``again``, unless stopping) submit its task
        as a new group, at once."""
        with self._lock:
            self.ledger.close(spec.group_id, outcome)
            if again and not self._stop.is_set():
                self._submit_locked(spec.task)

    # ================================================================== evaluation
    def _evaluate(self, weights: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Held-out success and mean reward of the trainer's current ``weights`` (see the module
        docstring), by :func:`hetrl.orchestrator.evaluation.evaluate_tasks`."""
        assert self._eval_sampler is not None
        self._eval_sampler.update_weights(self.trainer.version, weights)
        self._eval_sampler.reseed(self.config.seed)  # the same noise at every evaluation: paired comparisons
        e = self.options.eval
        sampling = SamplingParams(temperature=1.0, top_k=1) if e.greedy else self.config.async_.sampling
        episodes: list[dict[str, Any]] = []
        try:
            scores = evaluate_tasks(self.runner, self._eval_sampler, list(self.eval_tasks) * e.samples, sampling,
                                    prefix=f"eval{self.trainer.version}", batch=SAMPLER_BATCH, episodes=episodes,
                                    stop=self._stop_requested.is_set,
                                    progress=lambda k, n: self.display.progress("evaluation", k, n))
        except Stopped:  # no score: the run stops at once (checkpointed by the trainer loop)
            return {}
        self.display.phase("training")
        self.folder.write_generations(self.trainer.version, episodes)
        return {f"eval/{k}": v for k, v in scores.items()}

    # ================================================================== the trainer loop
    def run(self) -> RunResult:
        """Train for ``config.steps`` steps (from the resumed step, if any); returns the record."""
        t_start = time.monotonic()
        self.display.phase("set-up")
        self._start_backend()
        try:
            self._setup()
            return self._train(t_start)
        finally:
            self._stop_backend()
            self.display.close()

    def _train(self, t_start: float) -> RunResult:
        cfg = self.config
        self.schedule: Schedule = make_schedule(cfg.async_.schedule, self.fleet,
                                                Driver(self._top_up, self._finish_group, self._start_worker), cfg.seed)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.tasks = TaskSource(self.suite, np.random.default_rng(cfg.seed), self.runner.prompt_ids, self.runner.fits)
        self.ledger = GroupLedger(self.buffer.pending_ids())  # a resumed buffer's groups are live
        self._next_gid = 0
        self._counts = {k: 0 for k in ("rollouts_valid", "rollouts_rejected", "groups_rejected", "groups_rerouted",
                                       "continuation_failures", "groups_trained")}
        # (task, group id, pinned replica) of the groups in flight at the checkpoint a resumed run starts from
        self._carried_over: list[tuple[Task, str, str | None]] = []
        self._errors: list[str] = []
        self.supervisor = ReplicaSupervisor(
            self.fleet, self.gate, cfg.fleet.restart, self._rebuild_sampler,
            start_thread=lambda target, replica, name: self._start_thread(target, replica, name=name),
            on_revived=self.schedule.revived, on_error=self._record_error)
        self.router = make_router(self.fleet, cfg.fleet.routing, cfg.fleet.autopilot)
        if self._resume_state is not None:
            self._restore_loop_state(self._resume_state)
        self._rollout_versions: dict[str, list[int]] = {}
        self._rollout_spans: dict[str, list[tuple[int, int]]] = {}
        self._rewards: list[float] = []
        eval_every = self.options.eval.every
        writer = build_monitors(cfg, self.metrics_path, self.tensorboard_dir)
        recorder = StepRecorder(
            self.fleet, self.buffer, monitors=writer, display=self.display, total_steps=cfg.steps,
            log_every=cfg.logging.every, history=self._resumed_history, t_start=t_start,
            sources=[self.gate.metrics] + ([self.chaos_ledger.metrics] if cfg.fleet.chaos is not None else []))
        if eval_every and self.trainer.version == 0:  # the starting policy's score, to compare the run's with
            scores = self._evaluate(self.trainer.export_hf_weights())  # {} when stopped during it
            if scores:
                recorder.log({"step": 0, **scores})
        self._threads: list[threading.Thread] = []  # every thread started, joined by _shutdown
        self._top_up()
        self.schedule.start()
        a = cfg.async_
        recorder.start()
        exhausted: FleetExhausted | None = None
        try:
            self.display.start_training(self.trainer.version)
            with self.display:
                while self.trainer.version < cfg.steps and not self._stop_requested.is_set():
                    wait_start = time.monotonic()
                    groups: list[RolloutGroup] = []
                    while not groups and not self._stop_requested.is_set():
                        self.schedule.before_take(self.trainer.version)
                        groups = self.buffer.take(a.batch_groups, self.trainer.version,
                                                  timeout=self.schedule.take_timeout_s)
                        self._top_up()
                        self.supervisor.tend(need_replicas=not groups)
                    if not groups:  # stopped while waiting for a batch
                        break
                    wait_s = time.monotonic() - wait_start
                    version = self.trainer.version
                    rollouts = [r for g in groups for r in g.rollouts]
                    batch = collate(rollouts, pad_id=self.model_config.pad_token_id or 0,
                                    length_multiple=_length_bucket(rollouts), pool_names=self.pool_names)
                    step_start = time.monotonic()
                    old = self.trainer.logprobs(batch) if self.needs_old_logprobs else None
                    metrics = self.trainer.train_step(batch, old)
                    step_s = time.monotonic() - step_start
                    weights = self.publisher.publish(self.trainer.version, self.trainer.export_hf_weights())
                    if a.weight_update == "abort":
                        self.supervisor.abort_in_flight()
                    with self._lock:
                        self.ledger.train(((g.group_id, g.pool, g.min_version) for g in groups), version)
                    self._top_up()  # the trained batch no longer counts: sample the next at once
                    for g in groups:
                        self.fleet.record_trained(g.pool, int(sum(r.loss_mask.sum() for r in g.rollouts)))
                    self._counts["groups_trained"] += len(groups)
                    record = recorder.record(
                        self.trainer.version, trained_at=version, groups=groups, batch=batch, metrics=metrics,
                        wait_s=wait_s, step_s=step_s,
                        counts={**self._counts, "retracted": len(self.ledger.closed["retracted"])})
                    if self.router is not None:
                        record.scalars.update(self.router.step(record.pools))
                    if eval_every and (self.trainer.version % eval_every == 0 or self.trainer.version == cfg.steps):
                        record.scalars.update(self._evaluate(weights))
                    if self.trainer.save(force=False):
                        self._snapshot_state(weights)
                    recorder.commit(record)
        except FleetExhausted as err:  # ends like a stop (checkpointed, summarized), then reported
            exhausted = err
        finally:
            self._shutdown()
            writer.close()
        if not self.trainer.checkpoint_steps() or self.trainer.checkpoint_steps()[-1] != self.trainer.version:
            self.trainer.save(force=True)
            self._snapshot_state()
        steps = self.trainer.checkpoint_steps()
        self.trainer.close()
        self._prune_snapshots(steps)
        self.folder.prune_hf(steps)
        history = recorder.history
        plots = write_plots(history, self.pool_names, self.folder.plots)
        fm = self.fleet.metrics()
        bm = self.buffer.metrics()
        final = {
            "backend": self.backend,
            "wall_s": time.monotonic() - t_start, "version": self.trainer.version,
            "max_staleness": max([recorder.max_staleness_seen]
                                 + [int(r["staleness/max"]) for r in history if "staleness/max" in r]),
            "groups_trained": self._counts["groups_trained"], "groups_dropped": int(bm["buffer/dropped"]),
            "groups_retracted": len(self.ledger.closed["retracted"]),
            "rollouts_rejected": self._counts["rollouts_rejected"], "requeues": int(fm["fleet/requeues"]),
            "output_dir": str(self.output_dir), "errors_sample": self._errors[-5:],
            "continuation_failures": self._counts["continuation_failures"],
            "quarantined": self.supervisor.quarantined(), "replica_restarts": int(fm["fleet/restarts"]),
            "groups_pending": len(self.buffer), "groups_in_flight": len(self.ledger.in_flight()),
            "steps": cfg.steps, "stopped": self.trainer.version < cfg.steps,
            **({k.replace("chaos/", "chaos_"): int(v) for k, v in self.chaos_ledger.metrics().items()}
               if cfg.fleet.chaos is not None else {}),
        }
        if exhausted is not None:
            final["error"] = (f"{exhausted}. Stopped at step {self.trainer.version}, checkpointed: fix the pools, "
                              f"then run the same command with --resume")
        self.folder.summary.write_text(json.dumps(final, indent=2))
        if exhausted is not None:
            raise FleetExhausted(final["error"]) from None
        led = self.ledger
        return RunResult(history, final, list(led.trained), list(led.received), list(led.submitted),
                         list(led.closed["retracted"]), {k: list(v) for k, v in self._rollout_versions.items()},
                         {k: list(v) for k, v in self._rollout_spans.items()}, list(self._rewards),
                         self.output_dir, self.metrics_path, self.tensorboard_dir, plots, self.checkpoint_dir, steps,
                         list(led.closed["rejected"]), list(led.closed["failed"]), [g.group_id for g in led.in_flight()])

    # ================================================================== helpers
    def _snapshot_state(self, weights: Mapping[str, np.ndarray] | None = None) -> None:
        """Beside the trainer's checkpoint at its version: the buffer (``buffer-<v>.json``) and the
        loop's own state (``loop-<v>.json``: data order, next group id, the groups in flight (task,
        id, pinned replica), counters, the fleet's cumulative counters, the admission gate's record and the
        autopilot's state),
        taken together under the lock; and the policy as an HF checkpoint ``hf/step-<v>``
        (``weights``: the trainer's export at this version, if the caller has it)."""
        v = self.trainer.version
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            buffer = self.buffer.snapshot()
            loop = {
                "version": v, "next_gid": self._next_gid, **self.tasks.state(),
                "in_flight": [[g.task.task_id, g.group_id, g.replica] for g in self.ledger.in_flight()], "counts": dict(self._counts),
                "fleet": self.fleet.counters_state(), "admission": self.supervisor.state(), "chaos": self.chaos_ledger.state(),
                "routing": self.router.state() if self.router is not None else {},
            }
        write_atomic(self.checkpoint_dir / f"buffer-{v}.json", json.dumps(buffer))
        write_atomic(self.checkpoint_dir / f"loop-{v}.json", json.dumps(loop))
        self.folder.export_hf(v, self.trainer.export_hf_weights() if weights is None else weights, self.model_dir)
        self.folder.prune_hf(self.trainer.checkpoint_steps())

    def _restore_loop_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`_snapshot_state`'s record: the data order where it was, group ids
        after the last one used, the counters, and the groups that were in flight first (their ids and
        pins kept)."""
        self.tasks.restore(state)
        self._next_gid = int(state["next_gid"])
        self._counts.update({k: int(v) for k, v in state["counts"].items() if k in self._counts})
        in_flight = state.get("in_flight", [[t, None, None] for t in state.get("in_flight_tasks", [])])  # older: tasks only
        self._carried_over = [(self.tasks.resolve(t), gid, replica) for t, gid, replica in in_flight]
        self.chaos_ledger.restore(state.get("chaos", {}))
        self.fleet.restore_counters(state["fleet"])
        self.supervisor.restore(state["admission"])
        if self.router is not None:
            self.router.restore(state.get("routing", {}))

    def _prune_snapshots(self, keep_steps: list[int]) -> None:
        for pattern in ("buffer-*.json", "loop-*.json"):
            for path in self.checkpoint_dir.glob(pattern):
                if int(path.stem.split("-")[1]) not in keep_steps:
                    path.unlink()


def _truncate_metrics(path: pathlib.Path, step: int) -> list[dict[str, Any]]:
    """Keep the records of ``path`` (JSON lines) up to ``step``, the checkpoint a run resumes
    from (later ones were written by the interrupted run after it and are trained again);
    returns them. A torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(record)
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    return kept


def _oldest_version(generations: Sequence[Generation]) -> int:
    """The smallest weight version of any token of ``generations``."""
    return min(int(g.policy_version.min()) for g in generations)


def _length_bucket(rollouts) -> int:
    """The power of two (>= 64) that holds the longest prompt + response: with
    ``length_multiple`` set to it, collate pads to it, so the train step compiles per bucket."""
    longest = max(r.prompt_ids.shape[0] + r.response_ids.shape[0] for r in rollouts)
    return max(64, 1 << (longest - 1).bit_length())
