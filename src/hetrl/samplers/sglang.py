"""SGLang (GPU) and sglang-jax (TPU) server pools behind the :class:`Sampler` protocol.

One :class:`ServerSampler` is one fleet replica; it talks to one or more server endpoints over
HTTP through one persistent ``httpx.AsyncClient`` (kept-alive connections) on its own event-loop
thread: every request of a ``generate`` call is sent concurrently (the server batches them) to
the endpoint with the fewest requests in flight (ties: round-robin). A request that fails to
connect, times out, or gets a 5xx answer is retried (``tenacity``) after an exponential backoff
(``backoff_s · 2^attempt``) on another endpoint when there is one, up to ``retries`` times; an
endpoint that failed is avoided until it answers ``/health`` again (probed by :meth:`health`,
the fleet's health path, never before a generate call). When a request is out of
retries the call raises :class:`ServerError`, and the fleet marks the replica dead and re-queues
its jobs on other replicas (:mod:`hetrl.samplers.fleet`). A 4xx answer is a bad request: it is
raised at once, never retried. ``api_key_env`` adds ``Authorization: Bearer <key>``.

**Generation** posts ``/generate`` with token ids in (``input_ids``), the request's sampling
parameters, ``return_logprob`` (with ``top_logprobs_num = H``, ``server.top_logprobs_num``, when
the support is the head or is rebuilt from it), and
``ignore_eos`` with the request's own ``stop_token_ids``, so it stops exactly where the embedded
engine would. Each answer becomes a :class:`Generation`: the output ids; per token the weight
version it was sampled with (``meta_info.weight_versions`` spans, else ``weight_version``, else
this replica's version); the finish reason; and the support with the sampler log-probs. For
truncated sampling with ``server.sampling_mask: native`` the server returns the kept set it
sampled from and the log-probs renormalized over it (``return_sampling_mask`` with
``sampling_logprobs_mode: support``; SGLang's returned log-probs are otherwise those of the full
temperature-scaled distribution, before top-k/top-p); with ``head`` the kept set is rebuilt from
the head (:func:`hetrl.samplers.head_support.support_from_head`, which states the exactness rule
and refuses what it cannot rebuild exactly unless ``server.support: head_tail``). Untruncated
sampling records the head (kind ``'head'``).

**Weight sync** (``server.weight_sync``). ``disk`` (SGLang): the weights of version v are
exported once to ``<weights_dir>/v<v>`` (:mod:`hetrl.samplers.weight_export`: atomic, with a
checksum manifest, verified before use), every endpoint is told to load it with
``POST /update_weights_from_disk {model_path, weight_version: "v"}``, and the version it then
reports at ``GET /model_info`` must be ``"v"``, or the update fails. The replica's first
action is the same load of the run's base checkpoint as version 0, so rollouts never come from
whatever the server was started with. On GPUs, ``/update_weights_from_tensor`` or
``/update_weights_from_distributed`` (NCCL broadcast from the trainer ranks) skip the disk; they
need the trainer and servers in one CUDA process group and are the fast path a GPU deployment
should add. ``restart`` (sglang-jax, which has no weight-update endpoint): after the export,
``server.restart_command`` is run (argv; ``{model_path}``, ``{endpoint}``, ``{version}`` are
substituted) once per endpoint, e.g. a script that restarts the server on the new directory,
and the replica waits for ``/health`` before it samples again; versions are this replica's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pathlib
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import httpx
import numpy as np
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from hetrl.core.schema import SamplerInfo, SamplingSupport
from hetrl.errors import UserError
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import check_state_dict, verify_manifest
from hetrl.samplers.base import CapabilityMissing, Generation, GenerationRequest, SamplerHealth, check_request
from hetrl.samplers.fleet import PoolConfig
from hetrl.samplers.head_support import HeadSupportError, check_head_params, support_from_head
from hetrl.samplers.profiles import SamplerNumerics
from hetrl.samplers.weight_export import export_weights, prune_exports
from hetrl.samplers.weight_set import WeightSet

__all__ = ["ServerError", "ServerUnreachable", "ServerSampler", "disk_export"]

log = logging.getLogger(__name__)
KEEP_EXPORTS = 4
"""Weight versions kept on disk under ``weights_dir``."""
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class ServerError(RuntimeError):
    """A server endpoint failed (unreachable, timed out, 5xx, or an answer hetrl cannot use)."""


class ServerUnreachable(ServerError, UserError):
    """No endpoint of a replica answers at all when it is first contacted (no server running
    there, or a wrong address): the user's to fix, reported as one line."""


class _BadRequest(ValueError):
    """The server refused a request (4xx): not retried."""


class _Failed(Exception):
    """One attempt of a request failed (its :class:`ServerError` in ``args[0]``): retried."""


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    failed: bool = False
    version: int | None = None  # the weight version it holds (None: unknown, must be loaded first)


class ServerSampler:
    """One replica of an ``sglang`` or ``sglang-jax`` pool (see the module docstring).

    ``model_dir``: the run's base checkpoint (config, tokenizer; version 0). ``weights_dir``: a
    directory the servers can read, where weight versions are exported. ``endpoints``: this
    replica's server URLs (default: all of the pool's). ``sync_base``: load ``model_dir`` as
    version 0 now (``disk`` sync only). :meth:`close` releases the client and its thread."""

    def __init__(self, pool: PoolConfig, numerics: SamplerNumerics, *, model_dir: str | pathlib.Path,
                 weights_dir: str | pathlib.Path, endpoints: Sequence[str] | None = None, sync_base: bool = True):
        if pool.engine == "embedded":
            raise ValueError(f"pool {pool.name!r} is embedded, not a server pool")
        self.pool = pool
        self.options = pool.server
        self.model_dir = pathlib.Path(model_dir)
        self.weights_dir = pathlib.Path(weights_dir)
        self.config = ModelConfig.load(self.model_dir)
        self.endpoints = [_Endpoint(u.rstrip("/")) for u in (endpoints or pool.endpoints)]
        if not self.endpoints:
            raise ValueError(f"pool {pool.name!r}: no endpoints")
        self._headers = pool.auth_headers()
        self._info = numerics.sampler_info(pool.name, pool.engine, "")
        self._lock = threading.Lock()
        self._round_robin = itertools.count()
        self._version = 0
        self._source = self.model_dir  # the directory of the current version
        self._in_flight = 0
        self._tokens = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"http-{pool.name}", daemon=True)
        self._thread.start()
        self._client = self._run(self._open_client())
        try:
            if sync_base and self.options.resolved_weight_sync(pool.engine) == "disk":
                verify_manifest(self.model_dir)
                self._sync(self.endpoints)
            else:  # the servers were started on the base checkpoint
                for e in self.endpoints:
                    e.version = 0
            self._info = numerics.sampler_info(pool.name, pool.engine, self._run(self._engine_version()))
        except BaseException as err:
            unreachable = isinstance(err, ServerError) and not any(self._run(self._probe_all()))
            self.close()
            if unreachable:
                raise ServerUnreachable(
                    f"pool {pool.name!r}: no {pool.engine} server answers at {', '.join(e.url for e in self.endpoints)}; "
                    f"start the server there, or fix fleet.pools[{pool.name}].endpoints") from None
            raise

    # ------------------------------------------------------------------ Sampler protocol
    @property
    def info(self) -> SamplerInfo:
        return self._info

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def in_flight(self) -> int:
        """Requests of ``generate`` calls running now."""
        with self._lock:
            return self._in_flight

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request (concurrently, on the least-loaded endpoints); in order."""
        for r in requests:
            self._check(r)
        with self._lock:
            self._in_flight += len(requests)
            version = self._version
        try:
            return self._run(self._generate_all(requests, version))
        finally:
            with self._lock:
                self._in_flight -= len(requests)

    supports_reseed = False
    """Not :class:`hetrl.samplers.base.Reseedable`: the servers' random streams are their own."""

    def reseed(self, seed: int) -> None:
        raise CapabilityMissing(f"pool {self.pool.name!r}: an {self.pool.engine} server cannot reseed its random stream")

    supports_abort = False
    """Not :class:`hetrl.samplers.base.Abortable` (yet): SGLang's ``POST /abort_request {rid}``
    would cut a request, but the client sends no request ids and the partial answer of an
    aborted request is not checked against a real server here; ``weight_update: abort`` retracts
    this pool's groups at turn boundaries."""

    def abort(self) -> None:
        raise CapabilityMissing(f"pool {self.pool.name!r}: the {self.pool.engine} client cannot abort its requests")

    def update_weights(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Export ``weights`` as ``version`` and make every endpoint load it (module docstring).
        A :class:`WeightSet` is checked and exported once per set, whichever replica (or the
        shared-disk transport, :mod:`hetrl.orchestrator.transport`) asks first."""
        directory = disk_export(version, weights, self.config, self.weights_dir, self.model_dir)
        with self._lock:
            self._version, self._source = int(version), directory
        self._sync(self.endpoints)

    def health(self) -> SamplerHealth:
        """Healthy while some endpoint answers ``/health`` and holds the current version; an
        endpoint that answers again after failing is brought to the current version first."""
        alive = self._run(self._probe_all())
        behind = [e for e, ok in zip(self.endpoints, alive) if ok and e.version != self._version]
        if behind:
            try:
                self._sync(behind)
            except ServerError as err:
                log.warning("pool %s: %s", self.pool.name, err)
        with self._lock:
            ready = sum(ok and e.version == self._version for e, ok in zip(self.endpoints, alive))
            detail = (f"{ready}/{len(alive)} endpoints healthy at version {self._version}; "
                      f"{self._tokens} tokens generated")
            return SamplerHealth(healthy=ready > 0, weight_version=self._version, in_flight=self._in_flight,
                                 detail=detail)

    # ------------------------------------------------------------------ requests
    def _check(self, r: GenerationRequest) -> None:
        check_request(r, self.config.vocab_size, self.config.max_position_embeddings)
        where = f"request {r.request_id!r}"
        if self._native_mask(r):
            if self._top_k(r) > self.options.sampling_mask_max_tokens:
                asked = (f"top_k={r.sampling.top_k}" if r.sampling.top_k else
                         f"top-p without top-k over a vocabulary of {self.config.vocab_size}")
                raise ValueError(
                    f"{where}: pool {self.pool.name!r}: a native sampling mask needs top_k <= "
                    f"{self.options.sampling_mask_max_tokens} (the server's --sampling-mask-max-tokens); got "
                    f"{asked}. Set a top-k cap, raise the server's limit and server.sampling_mask_max_tokens, "
                    "or use server.sampling_mask: head")
            return
        try:
            check_head_params(r.sampling, self._head_size, approximate=self.options.support == "head_tail")
        except HeadSupportError as err:
            raise ValueError(f"{where}: pool {self.pool.name!r}: {err}") from None

    def _native_mask(self, r: GenerationRequest) -> bool:
        return r.sampling.truncated and self.options.resolved_sampling_mask(self.pool.engine) == "native"

    def _top_k(self, r: GenerationRequest) -> int:
        """The top-k sent: the request's; top-p alone under a native mask (SGLang wants a finite
        top-k there) as the vocabulary size, which truncates nothing; else -1 (off)."""
        if r.sampling.top_k:
            return r.sampling.top_k
        return self.config.vocab_size if self._native_mask(r) else -1

    @property
    def _head_size(self) -> int:
        return min(self.options.top_logprobs_num, self.config.vocab_size)

    def _payload(self, r: GenerationRequest) -> dict[str, Any]:
        s = r.sampling
        return {
            "input_ids": [int(i) for i in r.prompt_ids],
            "sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": self._top_k(r),
                                "max_new_tokens": r.max_new_tokens, "stop_token_ids": list(r.stop_token_ids),
                                "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True},
            "return_logprob": True,
            # the support: the server's sampling mask, or else the log-prob head it is rebuilt from
            **({"return_sampling_mask": True, "sampling_logprobs_mode": "support"} if self._native_mask(r)
               else {"top_logprobs_num": self._head_size}),
        }

    async def _generate_all(self, requests: Sequence[GenerationRequest], version: int) -> list[Generation]:
        answers = await asyncio.gather(*(self._post_with_retries("/generate", self._payload(r)) for r in requests))
        gens = [self._to_generation(r, a, version) for r, a in zip(requests, answers)]
        with self._lock:
            self._tokens += sum(int(g.token_ids.shape[0]) for g in gens)
        return gens

    def _to_generation(self, r: GenerationRequest, answer: Any, version: int) -> Generation:
        where = f"pool {self.pool.name!r}, request {r.request_id!r}"
        try:
            meta = answer["meta_info"]
            token_lp = meta["output_token_logprobs"]
            ids = np.asarray(answer["output_ids"], np.int64)
            if ids.shape[0] == 0 or ids.shape[0] != len(token_lp) or any(int(t[1]) != i for t, i in zip(token_lp, ids)):
                raise ValueError(f"{ids.shape[0]} output ids do not match {len(token_lp)} token log-probs")
            if self._native_mask(r):
                support, logq = _native_support(meta, ids)
            else:
                top = meta["output_top_logprobs"]
                support, logq = support_from_head(
                    [[int(e[1]) for e in row] for row in top], [[float(e[0]) for e in row] for row in top],
                    ids, np.asarray([t[0] for t in token_lp], np.float64), r.sampling,
                    approximate=self.options.support == "head_tail")
            finish = _FINISH.get((meta.get("finish_reason") or {}).get("type"), "error")
            versions = _token_versions(meta, ids.shape[0], version)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ServerError(f"{where}: unusable /generate answer: {type(err).__name__}: {err}") from None
        return Generation(request_id=r.request_id, token_ids=ids.astype(np.int32), logprobs=logq,
                          policy_version=versions, finish_reason=finish, support=support, sampler=self._info,
                          timings={"e2e_s": float(meta.get("e2e_latency") or 0.0)})

    # ------------------------------------------------------------------ HTTP
    async def _open_client(self) -> httpx.AsyncClient:
        """The replica's client, made on its loop: requests time out after ``request_timeout_s``
        without an answer (connecting: ``connect_timeout_s``); no cap on open connections, since
        a generate call sends all its requests at once; proxy variables of the environment are
        ignored (the servers are addressed directly)."""
        timeout = httpx.Timeout(self.options.request_timeout_s, connect=self.options.connect_timeout_s)
        return httpx.AsyncClient(headers=self._headers, timeout=timeout, trust_env=False,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def _pick(self, avoid: set[str]) -> _Endpoint:
        """The least-loaded endpoint holding the current version, preferring ones that have not
        failed and are not in ``avoid`` (those this request already failed on)."""
        with self._lock:
            current = [e for e in self.endpoints if e.version == self._version]
            if not current:
                raise ServerError(f"pool {self.pool.name!r}: no endpoint holds weight version {self._version}")
            pool = [e for e in current if not e.failed and e.url not in avoid] or \
                   [e for e in current if e.url not in avoid] or current
            turn = next(self._round_robin)
            choice = min(pool, key=lambda e: (e.in_flight, (self.endpoints.index(e) - turn) % len(self.endpoints)))
            choice.in_flight += 1
            return choice

    async def _post_with_retries(self, path: str, payload: dict) -> Any:
        """POST ``payload`` to ``path`` of the endpoint :meth:`_pick` gives, again on another one
        after a backoff while retries remain (module docstring); a 4xx is raised at once."""
        errors: list[str] = []
        avoid: set[str] = set()
        attempts = self.options.retries + 1
        retrying = AsyncRetrying(stop=stop_after_attempt(attempts), retry=retry_if_exception_type(_Failed),
                                 wait=wait_exponential(multiplier=self.options.backoff_s, min=0.0), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    endpoint = self._pick(avoid)
                    try:
                        return await self._request("POST", endpoint.url + path, payload)
                    except ServerError as err:
                        errors.append(str(err))
                        avoid.add(endpoint.url)
                        with self._lock:
                            endpoint.failed = True
                        log.warning("pool %s: %s (attempt %d of %d)", self.pool.name, err,
                                    attempt.retry_state.attempt_number, attempts)
                        raise _Failed(err) from None
                    finally:
                        with self._lock:
                            endpoint.in_flight -= 1
        except _Failed:
            pass
        raise ServerError(f"pool {self.pool.name!r}: {path} failed after {attempts} attempts: " + "; ".join(errors))

    async def _request(self, method: str, url: str, payload: dict | None = None, *,
                       timeout: float | None = None) -> Any:
        """One request on the replica's client (``timeout``: this request's, default the
        client's); the answer's JSON, or its text when it is not JSON."""
        try:
            resp = await self._client.request(method, url, json=payload,
                                              **({"timeout": timeout} if timeout is not None else {}))
        except (httpx.HTTPError, OSError) as err:
            raise ServerError(f"{method} {url}: {type(err).__name__}: {err}") from None
        if 400 <= resp.status_code < 500:
            raise _BadRequest(f"{method} {url}: HTTP {resp.status_code}: {resp.text[:500]}")
        if resp.status_code >= 500:
            raise ServerError(f"{method} {url}: HTTP {resp.status_code}: {resp.text[:500]}")
        if "json" not in resp.headers.get("Content-Type", ""):
            return resp.text
        try:
            return resp.json()
        except ValueError as err:
            raise ServerError(f"{method} {url}: unreadable JSON: {err}") from None

    async def _probe_all(self, endpoints: Sequence[_Endpoint] | None = None) -> list[bool]:
        """``GET /health`` on ``endpoints`` (default: all), ``connect_timeout_s`` each; marks
        each failed or not."""
        async def probe(e: _Endpoint) -> bool:
            try:
                await self._request("GET", e.url + "/health", timeout=self.options.connect_timeout_s)
                ok = True
            except (ServerError, _BadRequest):
                ok = False
            with self._lock:
                e.failed = not ok
            return ok
        return list(await asyncio.gather(*(probe(e) for e in endpoints or self.endpoints)))

    async def _engine_version(self) -> str:
        for e in self.endpoints:
            for path in ("/server_info", "/get_server_info"):  # sglang; sglang-jax
                try:
                    info = await self._request("GET", e.url + path)
                except (ServerError, _BadRequest):
                    continue
                return f"{self.pool.engine}-{info.get('version', '')}" if isinstance(info, dict) else self.pool.engine
        raise ServerError(f"pool {self.pool.name!r}: no endpoint answers /server_info or /get_server_info "
                          f"({', '.join(e.url for e in self.endpoints)})")

    # ------------------------------------------------------------------ weights
    def _sync(self, endpoints: Sequence[_Endpoint]) -> None:
        """Bring ``endpoints`` to the current version (``disk``: load it; ``restart``: restart
        on it). An endpoint that fails is marked failed and not used until a later health check
        syncs it; raises :class:`ServerError` when none of the sampler's endpoints holds the
        current version afterwards."""
        with self._lock:
            version, directory = self._version, self._source
        if self.options.resolved_weight_sync(self.pool.engine) == "disk":
            errors = self._run(self._load_all(endpoints, directory, version))
        else:
            errors = [self._restart(e, directory, version) for e in endpoints]
        for e, err in zip(endpoints, errors):
            with self._lock:
                e.failed, e.version = (True, None) if err else (False, version)
            if err:
                log.warning("pool %s: %s", self.pool.name, err)
        if not any(e.version == version for e in self.endpoints):
            raise ServerError(f"pool {self.pool.name!r}: no endpoint loaded weight version {version}: "
                              + "; ".join(str(e) for e in errors if e))

    async def _load_all(self, endpoints: Sequence[_Endpoint], directory: pathlib.Path,
                        version: int) -> list[Exception | None]:
        """``/update_weights_from_disk`` on each endpoint, then the version ``/model_info``
        reports must be ``version``; the error of each endpoint (None: loaded)."""
        body = {"model_path": str(pathlib.Path(directory).resolve()), "weight_version": str(int(version))}

        async def load(e: _Endpoint) -> Exception | None:
            try:
                answer = await self._request("POST", e.url + "/update_weights_from_disk", body)
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise ServerError(f"{e.url}: /update_weights_from_disk refused {directory}: "
                                      f"{answer.get('message')}")
                info = await self._request("GET", e.url + "/model_info")
                reported = info.get("weight_version") if isinstance(info, dict) else None
                if reported != str(int(version)):
                    raise ServerError(f"{e.url}: reports weight version {reported!r} after loading version {version}")
            except (ServerError, _BadRequest) as err:
                return err
            return None
        return list(await asyncio.gather(*(load(e) for e in endpoints)))

    def _restart(self, e: _Endpoint, directory: pathlib.Path, version: int) -> Exception | None:
        """The restart fallback for one endpoint: run ``restart_command``, wait for ``/health``."""
        argv = [a.format(model_path=str(pathlib.Path(directory).resolve()), endpoint=e.url, version=version)
                for a in self.options.restart_command]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.options.ready_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            return ServerError(f"{e.url}: restart command {argv[0]!r} failed: {err}")
        if done.returncode != 0:
            return ServerError(f"{e.url}: restart command {argv[0]!r} exited {done.returncode}: {done.stderr[-500:]}")
        deadline = time.monotonic() + self.options.ready_timeout_s
        while not self._run(self._probe_all([e]))[0]:
            if time.monotonic() > deadline:
                return ServerError(f"{e.url}: not healthy {self.options.ready_timeout_s} s after restarting on "
                                   f"version {version}")
            time.sleep(1.0)
        return None

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro):
        """Run ``coro`` on the replica's event loop and wait for it (callers are plain threads of
        the fleet, any number at once)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the HTTP client and stop its event-loop thread (idempotent)."""
        if self._loop.is_closed():
            return
        if getattr(self, "_client", None) is not None:
            self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def disk_export(version: int, weights: Mapping[str, np.ndarray], config: ModelConfig,
                weights_dir: str | pathlib.Path, model_dir: str | pathlib.Path) -> pathlib.Path:
    """The export of ``weights`` (validated against ``config``) as ``version`` under
    ``weights_dir`` (:func:`hetrl.samplers.weight_export.export_weights`, with ``model_dir``'s
    non-weight files); for a :class:`WeightSet`, staged once per set and directory. Only the
    newest :data:`KEEP_EXPORTS` versions stay there (replicas load only the newest, and a version
    is exported whether or not a replica is alive to load it)."""
    def export(ws: Mapping[str, np.ndarray]) -> pathlib.Path:
        check_state_dict(config, ws)
        directory = export_weights(weights_dir, version, ws, model_dir)
        prune_exports(weights_dir, keep=KEEP_EXPORTS)
        return directory

    if isinstance(weights, WeightSet):
        return weights.staged(("disk", pathlib.Path(weights_dir).resolve()), export)
    return export(weights)


def _native_support(meta: Mapping[str, Any], ids: np.ndarray) -> tuple[SamplingSupport, np.ndarray]:
    """The kept sets the server reported (``output_token_sampling_mask``, with the log-probs
    renormalized over them in ``output_token_sampling_logprobs``) and ``log q(a_t)``; the sampled
    token must be in its set."""
    masks, lps = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    if len(masks) != ids.shape[0] or len(lps) != ids.shape[0]:
        raise ValueError(f"{len(masks)} sampling masks and {len(lps)} log-prob rows for {ids.shape[0]} tokens")
    logq = np.empty(ids.shape[0], np.float32)
    for t, (mask, row) in enumerate(zip(masks, lps)):
        if len(mask) != len(row):
            raise ValueError(f"token {t}: sampling mask of {len(mask)} ids but {len(row)} log-probs")
        try:
            logq[t] = row[mask.index(int(ids[t]))]
        except ValueError:
            raise ValueError(f"token {t}: sampled id {int(ids[t])} is not in its sampling mask") from None
    return SamplingSupport.from_lists(masks, lps, kind="kept"), logq


def _token_versions(meta: Mapping[str, Any], n: int, default: int) -> np.ndarray:
    """Per-token weight versions [n]: ``weight_versions`` spans (``{version, start, end}``, end
    exclusive), else ``weight_version`` for all, else ``default``. Versions hetrl did not set
    (e.g. the server's initial ``"default"``) read as ``default``."""
    def as_int(v: Any) -> int:
        return int(v) if isinstance(v, str) and v.isdigit() else default

    out = np.full(n, as_int(meta.get("weight_version")), np.int64)
    for span in meta.get("weight_versions") or ():
        out[int(span["start"]): int(span["end"])] = as_int(span["version"])
    return out
