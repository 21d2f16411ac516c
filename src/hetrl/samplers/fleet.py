"""The sampler fleet: pools of replicas, capacity routing, re-queueing, metrics and cost (DESIGN §4-5).

A **pool** (:class:`PoolConfig`) is ``name``, ``engine`` (``embedded | sglang | sglang-jax``),
an accelerator profile with weight and KV formats (validated natively:
:class:`hetrl.samplers.profiles.SamplerNumerics`), ``replicas`` and, for server engines, one
endpoint per replica. A :class:`Fleet` holds a :class:`Replica` (a :class:`Sampler` plus its
bookkeeping) per pool replica.

**Jobs.** The unit of routing is a *job*: the requests of one prompt (the G samples of a group,
or one turn of them), generated together by one replica, so a group comes from one pool.
:meth:`Fleet.submit` queues jobs FIFO.

**Routing and pacing.** Queued jobs are assigned, in order, to the alive replica with the
smallest load ``(assigned requests + job size) / capacity``, where ``capacity`` is the pool's
relative decode throughput (profile x weight format; per replica, so a pool's share is
throughput x replicas). A replica holds at most ``slots = max(1, round(max_batch · capacity /
max capacity))`` assigned requests (a job larger than that only goes to an idle replica);
whatever does not fit waits in the queue. So a slow pool gets work in proportion to its speed,
never more than it can finish in about the time a fast one finishes a full batch, which keeps
the staleness of its rollouts bounded, and it is never starved: it receives a job whenever it
has a free slot.

**Shares** (``routing: autopilot``): :meth:`Fleet.set_shares` gives each pool a target share of
the requests (summing to 1); a replica's ``capacity`` in the load above is then its pool's share
/ the pool's alive replicas, and a pool of share 0 gets no jobs (pinned ones included: they are
routed like any other) unless no alive replica has a share (then capacity routing applies).
A replica's slots become the fewer of its speed's slots and ``max(1, round(max_batch x its
routing capacity / the largest))``: a pool of a small share is throttled even when every pool
is busy, and no pool holds more than its speed allows, so the staleness bound above holds.

**Serving.** Each replica's worker (a thread of the orchestrator, or :meth:`Fleet.generate`)
calls :meth:`Fleet.serve_once`: load the newest published weights if the replica's are older
(weights change only between calls, so weight versions are monotone per replica and per pool),
ask :attr:`Fleet.health_probe` (default: ``health()`` before every call; the orchestrator's
:class:`hetrl.orchestrator.supervisor.ReplicaSupervisor` probes only when due), take assigned jobs (up to ``max_batch`` requests; at least one job), call
``generate`` once, and return a :class:`JobResult` per job.

**Failure.** A replica that raises, reports unhealthy, or returns generations that do not
match its requests one to one is marked dead; every job assigned to it (in flight or waiting)
goes back to the front of the queue, in order, and is routed elsewhere, so a job is delivered
exactly once. A dead replica serves again only once :meth:`Fleet.revive` puts it back with a new
sampler (the orchestrator's replica supervisor does so per :class:`RestartPolicy`); otherwise the
pool shrinks.

**Quarantine.** A pool whose rollouts are rejected too often (the policy is
:class:`hetrl.core.admission.QuarantineConfig`, ``FleetConfig.quarantine``; the orchestrator's
replica supervisor decides, from the admission gate's record) is taken out by
:meth:`Fleet.quarantine`: its replicas stop serving like dead ones, its assigned and in-flight jobs go back to the queue for the other pools (the results of a call
already running are discarded), and the reason is logged and kept in :attr:`Fleet.quarantined`.

**Metrics** (:meth:`Fleet.metrics`), per pool under ``pool/<name>/``: ``requests`` (completed),
``jobs``, ``tokens`` (generated), ``errors``, ``requeues`` (jobs sent back), ``busy_s``
(summed busy time of the replicas: wall time of ``generate`` calls, or modelled from tokens and
throughput, see :class:`FleetConfig`), ``replicas_alive``, ``restarts``; mismatch metrics
aggregated over training steps (:meth:`Fleet.record_mismatch`); cost two ways: on busy time,
``cost/usd = price_per_hour x accelerators_per_replica x busy hours``, and on rented time,
``cost/rented_usd`` (the same price x ``rented_s``: the wall time every replica has been held
since the fleet was built, idle, dead or quarantined included, until :meth:`Fleet.close`),
with ``price_per_hour`` the pool's on-demand or spot price (``PoolConfig.price``);
``trained_tokens`` (:meth:`Fleet.record_trained`), ``cost/usd_per_trained_token`` and
``cost/rented_usd_per_trained_token``, ``idle_fraction`` (``1 - busy_s / rented_s``),
``quarantined`` (0 or 1); fleet totals under ``fleet/``. Rented time is wall time, so it and
``idle_fraction`` compare with busy time on the ``wall`` cost clock (real accelerators, or
embedded pools under ``pacing: modelled``); on the ``modelled`` clock busy time is accelerator
time and rented time this machine's. The main per-pool figures, typed:
:meth:`Fleet.pool_figures` (:class:`PoolFigures`, what the orchestrator's step recorder reads).

**Pacing** (``FleetConfig.pacing: modelled``): every replica's ``generate`` calls are slowed
to its profile's modelled decode rate relative to the fleet's fastest pool, which runs at CPU
speed and whose measured rate is shared (:mod:`hetrl.samplers.pacing`), so per-pool speed,
queueing and staleness follow the catalogue on an all-CPU embedded fleet.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hetrl.core.admission import QuarantineConfig
from hetrl.samplers.autopilot import AutopilotConfig
from hetrl.samplers.base import Generation, GenerationRequest, Sampler, SamplerHealth
from hetrl.samplers.faults import ChaosConfig
from hetrl.samplers.pacing import Paced, ReferenceRate
from hetrl.samplers.profiles import CATALOGUE, PriceMode, SamplerNumerics, known_kind, pool_numerics

__all__ = ["Engine", "Endpoint", "ServerOptions", "is_loopback_host", "PoolConfig", "RestartPolicy", "FleetConfig", "Replica", "JobResult", "Fleet", "PoolFigures",
           "FleetError", "SamplerFactory"]

Engine = Literal["embedded", "sglang", "sglang-jax"]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
log = logging.getLogger(__name__)


def is_loopback_host(host: str) -> bool:
    """``localhost``, an IPv4 address in 127.0.0.0/8 or ``::1``."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name
        return False


def _check_endpoint(url: str, info: ValidationInfo) -> str:
    """A server base URL: ``http`` or ``https``, a host, a valid port if given; no credentials,
    query or fragment. Plain ``http`` only to a loopback host unless the pool sets
    ``allow_insecure_http`` (a field declared before ``endpoints``, so it is in ``info.data``)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a non-numeric or out-of-range port
    except ValueError as err:
        raise ValueError(f"{url!r} is not a valid URL: {err}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r} carries credentials; name an environment variable in api_key_env instead")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must be a base URL, without query or fragment")
    if parts.scheme == "http" and not is_loopback_host(parts.hostname) and not info.data.get("allow_insecure_http"):
        raise ValueError(f"{url!r}: plain http to a non-loopback host sends prompts, completions and the API key "
                         "unencrypted; use https, or set allow_insecure_http: true on the pool")
    return url


Endpoint = Annotated[str, AfterValidator(_check_endpoint)]
"""A server base URL, checked by :func:`_check_endpoint`."""


class ServerOptions(BaseModel):
    """How a server pool (engine ``sglang`` or ``sglang-jax``) is driven
    (:mod:`hetrl.samplers.sglang`).

    ``sampling_mask``: where the support of truncated sampling comes from (default ``native``
    for sglang, ``head`` for sglang-jax). ``native``: the
    server's own record of the set it sampled from (SGLang's ``return_sampling_mask``, with the
    renormalized log-probs over it), exact for any top-k / top-p; SGLang needs a finite top-k of
    at most ``sampling_mask_max_tokens`` (its ``--sampling-mask-max-tokens``) for it, so top-p
    alone is sent as top-k = vocabulary size when the vocabulary fits, and refused otherwise. ``head``: rebuilt from the
    log-prob head of ``top_logprobs_num`` tokens per token (for servers without sampling-mask
    output); exact when ``top_k <= top_logprobs_num``, refused otherwise unless ``support:
    head_tail`` opts into the head/tail approximation (DESIGN §3.5). Untruncated sampling records
    the head either way. Requests time out after ``request_timeout_s``
    (connecting: ``connect_timeout_s``) and are retried ``retries`` times with a backoff of
    ``backoff_s · 2^attempt``. ``weight_sync``: ``disk`` (``/update_weights_from_disk``; the
    default for ``sglang``) or ``restart`` (run ``restart_command`` per endpoint and wait up to
    ``ready_timeout_s`` for it; the only option for ``sglang-jax``, which has no weight-update
    endpoint)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sampling_mask: Literal["native", "head"] | None = None
    sampling_mask_max_tokens: int = Field(4096, ge=1, description="the servers' --sampling-mask-max-tokens")
    top_logprobs_num: int = Field(64, ge=1)
    support: Literal["exact", "head_tail"] = "exact"
    request_timeout_s: float = Field(600.0, gt=0.0, allow_inf_nan=False)
    connect_timeout_s: float = Field(10.0, gt=0.0, allow_inf_nan=False)
    retries: int = Field(2, ge=0)
    backoff_s: float = Field(0.5, ge=0.0, allow_inf_nan=False)
    weight_sync: Literal["disk", "restart"] | None = None
    restart_command: tuple[str, ...] = ()
    ready_timeout_s: float = Field(300.0, gt=0.0, allow_inf_nan=False)

    def resolved_sampling_mask(self, engine: str) -> str:
        """``sampling_mask``, or the engine's default (``head`` for sglang-jax, which returns no
        sampling mask, else ``native``)."""
        return self.sampling_mask or ("head" if engine == "sglang-jax" else "native")

    def resolved_weight_sync(self, engine: str) -> str:
        """``weight_sync``, or the engine's default (``restart`` for sglang-jax, else ``disk``)."""
        return self.weight_sync or ("restart" if engine == "sglang-jax" else "disk")


class PoolConfig(BaseModel):
    """One pool of identical replicas. ``weight_precision`` / ``kv_precision`` default to the
    profile's defaults and must be native to ``accelerator``; ``activation_precision`` (the
    format the linear layers' inputs are rounded to per token, or ``none``) defaults to what
    serving engines ship for that weight format on that kind
    (:func:`hetrl.samplers.profiles.served_activation_format`: W8A8 for FP8 and GPU INT8 weights,
    W4A4 for NVFP4, ``none`` otherwise) and must be native too; ``price`` picks the profile's
    ``on_demand`` or ``spot`` price; ``price_per_hour_usd`` (overriding the price of that mode)
    and ``relative_throughput`` override the profile's (per accelerator). ``endpoints`` (server
    engines only) lists one server base URL per replica; ``sglang-jax`` runs on TPU kinds,
    ``sglang`` on GPU kinds.

    Security (server engines): ``api_key_env`` names the environment variable that holds the
    servers' API key, read when a client is built (:meth:`auth_headers`), so the key is never in
    the config nor in its printed form. Endpoints must be ``https://`` unless their host is
    loopback (``localhost``, 127.0.0.0/8, ``::1``); ``allow_insecure_http: true`` accepts plain
    ``http://`` to other hosts (e.g. a trusted private network)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="pool name, used in metric keys and SamplerInfo.pool")
    engine: Engine = "embedded"
    accelerator: str = Field(description="profile kind: " + ", ".join(CATALOGUE))
    weight_precision: str | None = None
    kv_precision: str | None = None
    activation_precision: str | None = None
    replicas: int = Field(1, ge=1)
    accelerators_per_replica: int = Field(1, ge=1, description="accelerators one replica occupies (cost)")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="environment variable holding the servers' API key")
    allow_insecure_http: bool = Field(False, description="accept plain http:// to non-loopback hosts")
    endpoints: tuple[Endpoint, ...] = ()
    server: ServerOptions = ServerOptions()
    price: PriceMode = Field("on_demand", description="which of the profile's prices the pool pays")
    price_per_hour_usd: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    relative_throughput: float | None = Field(None, gt=0.0, allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"pool name {v!r} must match {_NAME.pattern} (it is used in metric keys)")
        return v

    @field_validator("accelerator")
    @classmethod
    def _kind(cls, v: str) -> str:
        return known_kind(v)

    @field_validator("weight_precision", "kv_precision")
    @classmethod
    def _native(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("accelerator")
        if v is None or kind is None:
            return v
        profile = CATALOGUE[kind]
        native = profile.weight_formats if info.field_name == "weight_precision" else profile.kv_formats
        if v not in native:
            what = "weight" if info.field_name == "weight_precision" else "KV-cache"
            raise ValueError(f"accelerator {kind!r} does not run {what} format {v!r} natively "
                             f"(native: {', '.join(native)})")
        return v

    @field_validator("activation_precision")
    @classmethod
    def _native_activation(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("accelerator")
        if v is None or kind is None:
            return v
        native = CATALOGUE[kind].activation_formats
        if v not in native:
            raise ValueError(f"accelerator {kind!r} does not run activation format {v!r} natively "
                             f"(native: {', '.join(native)})")
        return v

    @model_validator(mode="after")
    def _engine(self) -> "PoolConfig":
        tpu = self.accelerator.startswith("tpu")
        if self.engine == "embedded" and (self.endpoints or self.api_key_env or self.allow_insecure_http
                                          or self.server != ServerOptions()):
            raise ValueError(f"pool {self.name!r}: embedded pools take no endpoints, api_key_env, "
                             "allow_insecure_http or server options")
        if self.engine != "embedded" and self.activation_precision is not None:
            raise ValueError(f"pool {self.name!r}: activation_precision sets how the embedded engine computes; a "
                             f"{self.engine!r} server quantizes activations as its checkpoint and launch flags say")
        if self.engine != "embedded" and len(self.endpoints) != self.replicas:
            raise ValueError(f"pool {self.name!r}: engine {self.engine!r} needs one endpoint per replica "
                             f"({self.replicas} replicas, {len(self.endpoints)} endpoints)")
        if self.engine == "sglang-jax" and not tpu:
            raise ValueError(f"pool {self.name!r}: engine 'sglang-jax' serves TPUs, not {self.accelerator!r}")
        if self.engine == "sglang" and tpu:
            raise ValueError(f"pool {self.name!r}: engine 'sglang' serves GPUs; use 'sglang-jax' for {self.accelerator!r}")
        sync = self.server.resolved_weight_sync(self.engine)
        if self.engine == "sglang-jax" and sync == "disk":
            raise ValueError(f"pool {self.name!r}: sglang-jax servers have no /update_weights_from_disk endpoint; "
                             "use server.weight_sync: restart with a server.restart_command")
        if sync == "restart" and not self.server.restart_command:
            raise ValueError(f"pool {self.name!r}: server.weight_sync 'restart' needs server.restart_command "
                             "(argv run per endpoint to restart it on {model_path})")
        return self

    def auth_headers(self) -> dict[str, str]:
        """HTTP headers authenticating to the pool's servers: ``Authorization: Bearer <key>``
        with the key read now from the environment variable ``api_key_env`` (none without
        ``api_key_env``). Raises ValueError naming the variable when it is unset or empty."""
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"pool {self.name!r}: api_key_env names the environment variable "
                             f"{self.api_key_env!r}, which is not set")
        return {"Authorization": f"Bearer {key}"}

    def numerics(self) -> SamplerNumerics:
        """The pool's :class:`SamplerNumerics` (profile with this pool's overrides applied)."""
        return pool_numerics(self.accelerator, self.weight_precision, self.kv_precision, self.activation_precision,
                             self.price, self.price_per_hour_usd, self.relative_throughput)


class RestartPolicy(BaseModel):
    """What happens to a replica that dies (its generate call raised, or it reported itself
    unhealthy): its jobs are re-queued at once; then, ``delay_s`` seconds later, the loop builds
    it again (a new embedded engine or Ray actor; a new client of the same server endpoint, which
    must answer its health check) and puts it back into routing, at most ``max_per_replica``
    times per replica (0: the pool shrinks instead). A quarantined pool is never restarted.
    ``health_every_s``: a replica that answered healthy is asked again before a call only after
    this long (and always after a restart or a weight load); 0 probes before every call.
    (:class:`hetrl.orchestrator.supervisor.ReplicaSupervisor` applies it.)"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_per_replica: int = Field(3, ge=0)
    delay_s: float = Field(2.0, ge=0.0, allow_inf_nan=False)
    health_every_s: float = Field(30.0, ge=0.0, allow_inf_nan=False)


class FleetConfig(BaseModel):
    """The pools (unique names) and ``max_batch``: the most requests one ``generate`` call of
    the fastest replica takes (slower replicas get proportionally fewer slots).

    ``cost_clock``: how a replica's busy time is measured for cost accounting. ``wall``: the
    wall time of its ``generate`` calls (real accelerators). ``modelled``: generated tokens /
    (``reference_tokens_per_s`` x the pool's relative throughput), i.e. the time the pool's
    accelerator would take, for embedded pools that all run on the same CPU.

    ``pacing``: ``off`` (every embedded replica runs at CPU speed) or ``modelled`` (each
    replica's calls are slowed to its modelled decode rate relative to the fastest pool, which
    runs at CPU speed: :mod:`hetrl.samplers.pacing`).

    ``routing``: ``capacity`` (the rule above) or ``autopilot`` (the same rule, with each pool's
    share of requests set every step by :class:`hetrl.samplers.autopilot.Autopilot` from the
    pools' cost per useful trained token within the budgets ``autopilot``; the orchestrator
    feeds it: :mod:`hetrl.orchestrator.routing`).

    ``quarantine``: when a pool returning too many rejected rollouts is taken out of routing.
    ``restart``: whether and when a dead replica is built again (:class:`RestartPolicy`).
    ``chaos``: random faults injected into every replica, for soak runs and drills
    (:class:`hetrl.samplers.faults.ChaosConfig`; None: none)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pools: tuple[PoolConfig, ...] = Field(min_length=1)
    max_batch: int = Field(16, ge=1)
    cost_clock: Literal["wall", "modelled"] = "wall"
    pacing: Literal["off", "modelled"] = "off"
    reference_tokens_per_s: float = Field(1000.0, gt=0.0, allow_inf_nan=False,
                                          description="decode tokens/s of one H100-bf16 replica (modelled clock)")
    routing: Literal["capacity", "autopilot"] = "capacity"
    autopilot: AutopilotConfig = AutopilotConfig()
    quarantine: QuarantineConfig = QuarantineConfig()
    restart: RestartPolicy = RestartPolicy()
    chaos: ChaosConfig | None = None

    @field_validator("pools")
    @classmethod
    def _unique(cls, pools: tuple[PoolConfig, ...]) -> tuple[PoolConfig, ...]:
        names = [p.name for p in pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(dup)}")
        return pools


SamplerFactory = Callable[[PoolConfig, SamplerNumerics, int], Sampler]
"""Builds replica ``index`` of a pool; the sampler's ``info.pool`` must be the pool's name."""


class FleetError(RuntimeError):
    """The fleet cannot make progress (e.g. every replica is dead while jobs are queued)."""


@dataclass
class _Job:
    job_id: str
    requests: tuple[GenerationRequest, ...]
    attempts: int = 0
    pinned: str | None = None  # the replica key it must run on, while that replica is alive


@dataclass(frozen=True, eq=False)
class JobResult:
    """The generations of one job, in request order, from replica ``replica`` of ``pool``;
    ``attempts`` counts the replicas it was sent to (1 unless re-queued)."""

    job_id: str
    pool: str
    replica: str
    generations: tuple[Generation, ...]
    attempts: int


@dataclass(eq=False)
class Replica:
    """One sampler of a pool and its routing state. ``key`` is ``<pool>/<index>``."""

    pool: PoolConfig
    index: int
    sampler: Sampler
    capacity: float
    slots: int
    alive: bool = True
    weight_version: int | None = None
    assigned: deque = field(default_factory=deque)  # jobs routed here, not yet started
    in_flight: list = field(default_factory=list)   # jobs of the running generate call
    busy_s: float = 0.0
    died_at: float | None = None  # time.monotonic() of its death (None: alive, or never died)
    cause: str = ""  # what killed it last ("ExceptionType: first line of its message")
    restarts: int = 0

    @property
    def key(self) -> str:
        return f"{self.pool.name}/{self.index}"

    @property
    def load(self) -> int:
        """Requests assigned or in flight."""
        return sum(len(j.requests) for j in self.assigned) + sum(len(j.requests) for j in self.in_flight)


@dataclass(frozen=True)
class PoolFigures:
    """One pool's cumulative figures (:meth:`Fleet.pool_figures`): completed ``requests``,
    generated ``tokens``, its ``replicas`` and how many are alive, each replica's loaded weight
    version (None: none loaded yet), ``cost_usd``, whether it is ``quarantined``, the
    token-weighted run averages of its mismatch metrics (maxima for ``*_max``; empty before any
    of its tokens was trained on), its summed ``busy_s`` and ``price_per_hour_usd`` (one
    replica: accelerator price x accelerators per replica) and ``capacity`` (one replica's
    relative throughput)."""

    requests: int
    tokens: int
    replicas: int
    replicas_alive: int
    weight_versions: tuple[int | None, ...]
    cost_usd: float
    quarantined: bool
    mismatch_avg: Mapping[str, float]
    busy_s: float
    price_per_hour_usd: float
    capacity: float


@dataclass
class _PoolStats:
    requests: int = 0
    jobs: int = 0
    tokens: int = 0
    errors: int = 0
    requeues: int = 0
    trained_tokens: int = 0
    mismatch_sum: dict = field(default_factory=dict)  # metric -> Σ value·num_tokens
    mismatch_max: dict = field(default_factory=dict)  # *_max metrics -> max
    mismatch_tokens: float = 0.0


class Fleet:
    """Pools of replicas behind one job queue (see the module docstring). Thread-safe."""

    def __init__(self, replicas: Sequence[tuple[PoolConfig, Sampler]], max_batch: int = 16,
                 cost_clock: Literal["wall", "modelled"] = "wall", reference_tokens_per_s: float = 1000.0,
                 pacing: Literal["off", "modelled"] = "off"):
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.max_batch = max_batch
        self.cost_clock = cost_clock
        self.reference_tokens_per_s = reference_tokens_per_s
        self.pools: dict[str, PoolConfig] = {}
        self.numerics: dict[str, SamplerNumerics] = {}
        for pool, _ in replicas:
            if self.pools.setdefault(pool.name, pool) != pool:
                raise ValueError(f"two different pool configs are named {pool.name!r}")
            self.numerics[pool.name] = pool.numerics()
        top = max(n.relative_throughput() for n in self.numerics.values())
        self.pacing, self._top_capacity, self._reference_rate = pacing, top, ReferenceRate()
        self.replicas: list[Replica] = []
        counts: dict[str, int] = {}
        for pool, sampler in replicas:
            if sampler.info.pool != pool.name:
                raise ValueError(f"replica of pool {pool.name!r} reports pool {sampler.info.pool!r}")
            cap = self.numerics[pool.name].relative_throughput()
            index = counts[pool.name] = counts.get(pool.name, -1) + 1
            self.replicas.append(Replica(pool, index, self._paced(pool, sampler), cap,
                                         max(1, round(max_batch * cap / top))))
        self._by_key = {r.key: r for r in self.replicas}
        self._stats = {name: _PoolStats() for name in self.pools}
        self._queue: deque[_Job] = deque()
        self._job_ids: set[str] = set()
        self._cond = threading.Condition()
        self._weights: tuple[int, Mapping[str, np.ndarray]] | None = None
        self._closed = False
        self._epoch = 0  # bumped by _wake_all: waiting serve_once calls return
        self.quarantined: dict[str, str] = {}  # pool -> reason
        self.shares: dict[str, float] | None = None  # pool -> routing share (None: capacity routing)
        self._rent_start, self._rent_end = time.monotonic(), None  # the rented-time clock
        self._rent_before: dict[str, float] = {}  # replica key -> rented seconds before a resume
        self.health_probe: Callable[[Replica], SamplerHealth | None] = lambda r: r.sampler.health()
        """Asked before each ``generate`` call of a replica, in its serving thread: its health, or
        None for no probe this time (unhealthy: the replica is marked dead). Default: every call."""

    @classmethod
    def from_config(cls, config: FleetConfig, factory: SamplerFactory) -> "Fleet":
        """Build every replica of every pool with ``factory(pool, numerics, index)``."""
        built = [(p, factory(p, p.numerics(), i)) for p in config.pools for i in range(p.replicas)]
        return cls(built, max_batch=config.max_batch, cost_clock=config.cost_clock,
                   reference_tokens_per_s=config.reference_tokens_per_s, pacing=config.pacing)

    def _paced(self, pool: PoolConfig, sampler: Sampler) -> Sampler:
        """``sampler`` paced to ``pool``'s modelled throughput (``pacing: modelled``, embedded
        pools only: a server pool already runs at its hardware's speed), else itself."""
        if self.pacing != "modelled" or pool.engine != "embedded":
            return sampler
        return Paced(sampler, self.numerics[pool.name].relative_throughput() / self._top_capacity, self._reference_rate)

    # ------------------------------------------------------------------ submitting and weights
    def submit(self, job_id: str, requests: Sequence[GenerationRequest], replica: str | None = None) -> None:
        """Queue a job (the requests one replica generates together). Job ids are unique.
        ``replica``: pin it to that replica (a deterministic schedule's fixed assignment); if
        the replica dies or is quarantined, the job is routed like any other."""
        if not requests:
            raise ValueError(f"job {job_id!r} has no requests")
        with self._cond:
            if self._closed:
                raise FleetError("fleet is closed")
            if job_id in self._job_ids:
                raise ValueError(f"job id {job_id!r} was already submitted")
            self._job_ids.add(job_id)
            if replica is not None and replica not in self._by_key:
                raise ValueError(f"job {job_id!r}: no replica {replica!r}")
            self._queue.append(_Job(job_id, tuple(requests), pinned=replica))
            self._dispatch_locked()

    def publish_weights(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Make ``weights`` (HF naming) at ``version`` current; each replica loads them before
        its next ``generate`` call. Versions must increase."""
        with self._cond:
            if self._weights is not None and version <= self._weights[0]:
                raise ValueError(f"weight version {version} is not newer than {self._weights[0]}")
            self._weights = (version, weights)
            self._cond.notify_all()

    @property
    def published_version(self) -> int:
        """The latest published weight version (0 before the first publication): no replica
        can have sampled with a newer one."""
        with self._cond:
            return 0 if self._weights is None else self._weights[0]

    def quarantine(self, pool: str, reason: str) -> None:
        """Take ``pool`` out of routing for good (see the module docstring); idempotent."""
        with self._cond:
            if pool in self.quarantined:
                return
            self.quarantined[pool] = reason
            jobs = []
            for r in self.replicas:
                if r.pool.name == pool:
                    jobs += list(r.in_flight) + list(r.assigned)
                    r.alive, r.in_flight, r.assigned = False, [], deque()
            self._stats[pool].requeues += len(jobs)
            self._queue.extendleft(reversed(jobs))
            self._dispatch_locked()
            self._cond.notify_all()
            others = sorted({r.pool.name for r in self.replicas if r.alive})
        log.error("%s; %d of its jobs re-routed to the other pools (%s)", reason, len(jobs),
                  ", ".join(others) or "none left: the fleet cannot make progress")

    def revive(self, replica: str | Replica, sampler: Sampler) -> bool:
        """Put the dead ``replica`` back into routing with a freshly built ``sampler`` (it loads
        the published weights before its first call). False, and nothing changes, if the replica
        is alive, its pool is quarantined or the fleet is closed."""
        r = replica if isinstance(replica, Replica) else self._by_key[replica]
        with self._cond:
            if r.alive or self._closed or r.pool.name in self.quarantined:
                return False
            r.sampler, r.alive, r.weight_version, r.died_at = self._paced(r.pool, sampler), True, None, None
            r.restarts += 1
            self._dispatch_locked()
            self._cond.notify_all()
        log.warning("replica %s restarted (restart %d)", r.key, r.restarts)
        return True

    def set_shares(self, shares: Mapping[str, float] | None) -> None:
        """Route by ``shares`` (pool -> target fraction of requests, >= 0, summing to 1 over the
        pools that get any; pools not named get 0), or by capacity again (None); see the module
        docstring. Jobs already assigned stay where they are."""
        if shares is not None:
            unknown = sorted(set(shares) - set(self.pools))
            if unknown or any(not (v >= 0 and math.isfinite(v)) for v in shares.values()):
                raise ValueError(f"shares must be finite and >= 0 over the fleet's pools (unknown: {unknown})")
            shares = {p: float(shares.get(p, 0.0)) for p in self.pools}
        with self._cond:
            self.shares = shares
            self._dispatch_locked()

    def close(self) -> None:
        """Stop: refuse new jobs and wake every waiting :meth:`serve_once` (which returns [])."""
        with self._cond:
            self._closed = True
            if self._rent_end is None:
                self._rent_end = time.monotonic()
            self._cond.notify_all()

    # ------------------------------------------------------------------ serving
    def serve_once(self, replica: str | Replica, timeout: float | None = None) -> list[JobResult]:
        """One ``generate`` call of ``replica`` over the jobs routed to it (waiting up to
        ``timeout`` seconds for some; None: until some arrive or the fleet closes). Returns the
        finished jobs; ``[]`` when there was nothing to do or the replica failed (its jobs
        were re-queued and it is dead). Exactly one worker may serve a replica."""
        r = replica if isinstance(replica, Replica) else self._by_key[replica]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            epoch = self._epoch
            while r.alive and not self._closed and not r.assigned and epoch == self._epoch:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._cond.wait(remaining)
            if not r.alive or self._closed or not r.assigned:
                return []
            weights = self._weights
        try:
            if weights is not None and weights[0] != r.weight_version:
                r.sampler.update_weights(weights[0], weights[1])
                r.weight_version = weights[0]
            health = self.health_probe(r)
            if health is not None and not health.healthy:
                raise FleetError(f"replica {r.key} is unhealthy: {health.detail}")
        except Exception as err:
            self._fail(r, err)
            return []
        with self._cond:
            if r.in_flight:
                raise RuntimeError(f"replica {r.key} is already generating: one worker per replica")
            if not r.alive or not r.assigned:  # quarantined meanwhile: its jobs went back to the queue
                return []
            batch, size = [], 0
            while r.assigned and (not batch or size + len(r.assigned[0].requests) <= self.max_batch):
                job = r.assigned.popleft()
                job.attempts += 1
                batch.append(job)
                size += len(job.requests)
            r.in_flight = batch
        requests = [q for job in batch for q in job.requests]
        start = time.monotonic()
        try:
            generations = list(r.sampler.generate(requests))
            if [g.request_id for g in generations] != [q.request_id for q in requests]:
                raise FleetError(f"replica {r.key} returned generations that do not match its requests")
        except Exception as err:
            if self.cost_clock == "wall":
                r.busy_s += time.monotonic() - start
            self._fail(r, err)
            return []
        tokens = sum(int(g.token_ids.shape[0]) for g in generations)
        elapsed = (time.monotonic() - start if self.cost_clock == "wall"
                   else tokens / (self.reference_tokens_per_s * r.capacity))
        results, i = [], 0
        for job in batch:
            gens = tuple(generations[i: i + len(job.requests)])
            i += len(job.requests)
            results.append(JobResult(job.job_id, r.pool.name, r.key, gens, job.attempts))
        with self._cond:
            r.busy_s += elapsed
            if not r.alive:  # quarantined while generating: its jobs were re-queued, discard these
                return []
            r.in_flight = []
            stats = self._stats[r.pool.name]
            stats.jobs += len(batch)
            stats.requests += len(requests)
            stats.tokens += tokens
            self._dispatch_locked()
        return results

    def generate(self, jobs: Mapping[str, Sequence[GenerationRequest]], timeout: float | None = None) -> dict[str, JobResult]:
        """Submit ``jobs`` and serve them with one thread per alive replica until every job is
        done. Raises :class:`FleetError` if every replica dies first or ``timeout`` passes."""
        for job_id, requests in jobs.items():
            self.submit(job_id, requests)
        done: dict[str, JobResult] = {}
        finished = threading.Event()
        lock = threading.Lock()

        def work(r: Replica) -> None:
            while r.alive and not finished.is_set():
                for res in self.serve_once(r, timeout=0.05):
                    with lock:
                        done[res.job_id] = res
                        if len(done) == len(jobs):
                            finished.set()

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in self.replicas if r.alive]
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not finished.wait(0.05):
            if not any(t.is_alive() for t in threads):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
        finished.set()
        self._wake_all()
        for t in threads:
            t.join()
        if len(done) != len(jobs):
            raise FleetError(f"{len(jobs) - len(done)} of {len(jobs)} jobs unfinished "
                             f"({sum(r.alive for r in self.replicas)} replicas alive)")
        return done

    # ------------------------------------------------------------------ accounting
    def record_trained(self, pool: str, tokens: int) -> None:
        """Count ``tokens`` trainable tokens of ``pool``'s rollouts that the trainer consumed."""
        with self._cond:
            self._stats[pool].trained_tokens += int(tokens)

    def record_mismatch(self, per_pool: Mapping[str, Mapping[str, float]]) -> None:
        """Fold one step's per-pool mismatch metrics (``{pool: {metric: value}}``, as
        :func:`hetrl.core.correction.pool_mismatch` gives them) into running per-pool aggregates:
        means weighted by the step's ``num_tokens`` of that pool, maxima for ``*_max`` metrics.
        Pools not in the fleet, and pools with no tokens, are ignored."""
        with self._cond:
            for pool, step in per_pool.items():
                values = {k: float(v) for k, v in step.items()}
                n = values.pop("num_tokens", 0.0)
                if pool not in self._stats or n <= 0:
                    continue
                s = self._stats[pool]
                s.mismatch_tokens += n
                for k, v in values.items():
                    if k.endswith("_max"):
                        s.mismatch_max[k] = max(s.mismatch_max.get(k, -math.inf), v)
                    else:
                        s.mismatch_sum[k] = s.mismatch_sum.get(k, 0.0) + v * n

    def pool_figures(self) -> dict[str, "PoolFigures"]:
        """Each pool's cumulative figures, typed (the per-pool part of :meth:`metrics`)."""
        costs = {name: self.cost_usd(name) for name in self.pools}
        with self._cond:
            out = {}
            for name, s in self._stats.items():
                reps = [r for r in self.replicas if r.pool.name == name]
                avg = {k: v / s.mismatch_tokens for k, v in s.mismatch_sum.items()} | dict(s.mismatch_max)
                out[name] = PoolFigures(requests=s.requests, tokens=s.tokens, replicas=len(reps),
                                        replicas_alive=sum(r.alive for r in reps),
                                        weight_versions=tuple(r.weight_version for r in reps), cost_usd=costs[name],
                                        quarantined=name in self.quarantined, mismatch_avg=avg,
                                        busy_s=sum(r.busy_s for r in reps),
                                        price_per_hour_usd=self._price_per_second(name) * 3600.0,
                                        capacity=self.numerics[name].relative_throughput())
            return out

    def _price_per_second(self, pool: str) -> float:
        """USD per second of one replica of ``pool``: its hourly price (on-demand or spot) x
        accelerators per replica / 3600."""
        p = self.pools[pool]
        return self.numerics[pool].cost_per_hour(p.price) * p.accelerators_per_replica / 3600.0

    def cost_usd(self, pool: str) -> float:
        """``price_per_hour x accelerators_per_replica x busy hours``, summed over the pool's replicas."""
        with self._cond:
            return self._price_per_second(pool) * sum(r.busy_s for r in self.replicas if r.pool.name == pool)

    def rented_s(self, replica: Replica) -> float:
        """Seconds ``replica`` has been rented: since the fleet was built (plus what a resumed
        run's checkpoint carried) until now, or until :meth:`close`."""
        end = self._rent_end if self._rent_end is not None else time.monotonic()
        return self._rent_before.get(replica.key, 0.0) + end - self._rent_start

    def rented_cost_usd(self, pool: str) -> float:
        """``price_per_hour x accelerators_per_replica x rented hours`` (idle time included),
        summed over the pool's replicas."""
        with self._cond:
            return self._price_per_second(pool) * sum(self.rented_s(r) for r in self.replicas if r.pool.name == pool)

    def metrics(self) -> dict[str, float]:
        """Flat per-pool and fleet-total metrics (see the module docstring)."""
        out: dict[str, float] = {}
        totals = {"requests": 0.0, "jobs": 0.0, "tokens": 0.0, "errors": 0.0, "requeues": 0.0, "busy_s": 0.0,
                  "replicas_alive": 0.0, "restarts": 0.0, "trained_tokens": 0.0, "cost/usd": 0.0, "quarantined": 0.0,
                  "rented_s": 0.0, "cost/rented_usd": 0.0}
        costs = {name: self.cost_usd(name) for name in self.pools}
        with self._cond:
            rented = {r.key: self.rented_s(r) for r in self.replicas}  # one reading of the clock
            rented_costs = {name: self._price_per_second(name) * sum(rented[r.key] for r in self.replicas
                                                                     if r.pool.name == name) for name in self.pools}
            for name, s in self._stats.items():
                reps = [r for r in self.replicas if r.pool.name == name]
                row = {"requests": s.requests, "jobs": s.jobs, "tokens": s.tokens, "errors": s.errors,
                       "requeues": s.requeues, "busy_s": sum(r.busy_s for r in reps),
                       "replicas_alive": sum(r.alive for r in reps), "restarts": sum(r.restarts for r in reps),
                       "trained_tokens": s.trained_tokens,
                       "cost/usd": costs[name], "quarantined": name in self.quarantined,
                       "rented_s": sum(rented[r.key] for r in reps), "cost/rented_usd": rented_costs[name]}
                for k, v in row.items():
                    out[f"pool/{name}/{k}"] = float(v)
                    totals[k] += float(v)
                out[f"pool/{name}/cost/usd_per_trained_token"] = _per(costs[name], s.trained_tokens)
                out[f"pool/{name}/cost/rented_usd_per_trained_token"] = _per(rented_costs[name], s.trained_tokens)
                out[f"pool/{name}/idle_fraction"] = _idle(row["busy_s"], row["rented_s"])
                for k, v in s.mismatch_sum.items():
                    out[f"pool/{name}/mismatch_avg/{k}"] = v / s.mismatch_tokens
                for k, v in s.mismatch_max.items():
                    out[f"pool/{name}/mismatch_avg/{k}"] = v
            queued = len(self._queue)
        out.update({f"fleet/{k}": v for k, v in totals.items()})
        out["fleet/cost/usd_per_trained_token"] = _per(totals["cost/usd"], totals["trained_tokens"])
        out["fleet/cost/rented_usd_per_trained_token"] = _per(totals["cost/rented_usd"], totals["trained_tokens"])
        out["fleet/idle_fraction"] = _idle(totals["busy_s"], totals["rented_s"])
        out["fleet/queued_jobs"] = float(queued)
        return out

    def counters_state(self) -> dict[str, Any]:
        """The cumulative counters (per pool: requests, jobs, tokens, errors, requeues, trained
        tokens, mismatch sums; per replica: busy and rented seconds) as JSON-able data, for a checkpoint."""
        with self._cond:
            return {"pools": {name: asdict(s) for name, s in self._stats.items()},
                    "busy_s": {r.key: r.busy_s for r in self.replicas},
                    "rented_s": {r.key: self.rented_s(r) for r in self.replicas}}

    def restore_counters(self, state: Mapping[str, Any]) -> None:
        """Continue the counters of :meth:`counters_state` (a resumed run's totals then include
        the work before the checkpoint). Pools and replicas the state does not name start at 0."""
        with self._cond:
            for name, stats in state.get("pools", {}).items():
                if name in self._stats:
                    self._stats[name] = _PoolStats(**stats)
            for key, busy in state.get("busy_s", {}).items():
                if key in self._by_key:
                    self._by_key[key].busy_s = float(busy)
            self._rent_before = {key: float(v) for key, v in state.get("rented_s", {}).items() if key in self._by_key}

    # ------------------------------------------------------------------ internals
    def _wake_all(self) -> None:
        """Make every :meth:`serve_once` that is waiting for work return ``[]`` now."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def _fail(self, r: Replica, error: Exception) -> None:
        """Mark ``r`` dead (logging ``error``, what killed it) and put its jobs back at the front
        of the queue, in order."""
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("replica %s failed: %s", r.key, cause)
        with self._cond:
            r.alive, r.died_at, r.cause = False, time.monotonic(), cause
            jobs = list(r.in_flight) + list(r.assigned)
            r.in_flight, r.assigned = [], deque()
            stats = self._stats[r.pool.name]
            stats.errors += 1
            stats.requeues += len(jobs)
            self._queue.extendleft(reversed(jobs))
            self._dispatch_locked()
            self._cond.notify_all()

    def _dispatch_locked(self) -> None:
        while self._queue:
            job = self._queue[0]
            pinned = self._by_key.get(job.pinned) if job.pinned else None
            # a pin is honoured whatever the shares: the schedule pinned it under the shares of its
            # submission (a group carried over a resume keeps the pin it had before the shares changed)
            if pinned is not None and pinned.alive:
                pinned.assigned.append(self._queue.popleft())
                self._cond.notify_all()
                continue
            job.pinned = None  # its replica is gone: route it like any other
            n = len(job.requests)
            capacity = self.routing_capacity()
            slots = self._routing_slots(capacity)
            candidates = [r for r in self.replicas if capacity.get(r.key, 0.0) > 0
                          and (r.load + n <= slots[r.key] or r.load == 0)]
            if not candidates:
                return
            target = min(candidates, key=lambda r: ((r.load + n) / capacity[r.key], -r.capacity))
            target.assigned.append(self._queue.popleft())
            self._cond.notify_all()

    def routing_capacity(self) -> dict[str, float]:
        """Each alive replica's capacity in the routing rule (by key): its relative throughput,
        or under shares its pool's share / the pool's alive replicas (relative throughput again
        when no alive replica has a share, e.g. the pools with shares died since they were set)."""
        with self._cond:
            alive = [r for r in self.replicas if r.alive]
            shares = self.shares
        if shares is None:
            return {r.key: r.capacity for r in alive}
        count: dict[str, int] = {}
        for r in alive:
            count[r.pool.name] = count.get(r.pool.name, 0) + 1
        routed = {r.key: shares[r.pool.name] / count[r.pool.name] for r in alive}
        if not any(v > 0 for v in routed.values()):  # the shared pools died meanwhile: never stall
            return {r.key: r.capacity for r in alive}
        return routed

    def _routing_slots(self, capacity: Mapping[str, float]) -> dict[str, int]:
        """Each replica's slots: its own (by speed), or under shares the fewer of those and
        ``max(1, round(max_batch x routing capacity / the largest routing capacity))``."""
        if self.shares is None or not capacity:
            return {r.key: r.slots for r in self.replicas}
        top = max(capacity.values())
        return {r.key: (min(r.slots, max(1, round(self.max_batch * capacity[r.key] / top))) if r.key in capacity
                        else r.slots) for r in self.replicas}


def _per(cost: float, tokens: float) -> float:
    return cost / tokens if tokens > 0 else float("nan")


def _idle(busy_s: float, rented_s: float) -> float:
    """``1 - busy / rented`` (nan before any rented time)."""
    return 1.0 - busy_s / rented_s if rented_s > 0 else float("nan")
