"""The trainer as ``trainer.world_size`` ranks on this machine (local backend): :class:`TrainerRanks`.

Megatron: the loop's process is rank 0 and holds the trainer; ranks 1..N-1 are worker processes
(``multiprocessing`` spawn) joined by ``torch.distributed`` over a private loopback port (gloo on
CPU with the CPU shim, NCCL with CUDA, ``LOCAL_RANK`` = rank). JAX: every rank is a worker process
(the loop's own JAX runs the embedded samplers as one process), joined by ``jax.distributed`` on a
loopback coordinator at the same port (``HETRL_COORDINATOR``; each process keeps the devices the
loop's environment gives it, e.g. ``--xla_force_host_platform_device_count``), the mesh laid over
every process's devices. Every rank builds the same trainer
(:func:`~hetrl.orchestrator.trainer_handle.build_trainer`) and runs the same call sequence in
lockstep: for every handle call (``train_step``, ``logprobs``, ``export_hf_weights``, ``save``,
``restore``, ``checkpoint_steps``, ``close``) the loop sends the command to every worker, runs it
on its own rank 0 if it holds one, then collects every reply. Rank 0's result is the handle's;
a worker rank 0 sends its metrics and results as JSON and its HF export as safetensors, and every
worker reports its trainer's ``version`` with each reply. An in-process rank 0 is built and
called on one thread of its own, so that the loop can wait on it and on the workers at once.

Batches: the loop sends each worker the whole step batch (:meth:`RolloutBatch.to_bytes`,
safetensors; old log-probs as ``.npy`` without pickle) and every rank takes the rows of its
share: Megatron, its data-parallel rank's :func:`balanced_shares` of the rows' token counts
(equal row counts, token sums as even as a greedy split makes them; tensor ranks of one
data-parallel rank take the same rows); JAX, the rows its process's devices own in the mesh
(:meth:`~hetrl.trainer_jax.trainer.JaxTrainer.local_rows`, contiguous). The trainer normalizes
the loss over the global batch, so N ranks compute the 1-rank loss. ``logprobs`` are reassembled
in batch order; ``train_step``'s metrics are rank 0's (the trainer computes them over the global
batch). The HF export is gathered by the trainer (over tensor ranks, or from every process);
rank 0's is returned. Nothing received is unpickled: commands and replies are JSON, arrays
safetensors / ``.npy``.

Failure: a worker that raises replies with its traceback and exits (closing its sockets, which
ends rank 0's pending gloo collective); a worker that dies is seen through its process sentinel.
Either surfaces in the loop as one :class:`TrainerRankFailed` naming the rank and the call, the
other workers are killed and every later call refuses. Workers die with the loop: each watches
its parent's sentinel and exits when the parent is gone (SIGKILL included) and ignores SIGINT
(Ctrl-C reaches the loop, which stops and checkpoints through the ranks).
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import signal
import socket
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from hetrl.core.schema import RolloutBatch
from hetrl.orchestrator.trainer_handle import TrainerHandle, TrainerSetup, build_trainer

__all__ = ["TrainerRanks", "TrainerRankFailed", "RankTrainer", "balanced_shares", "assemble_logprobs"]

_JOIN_S = 30.0


class TrainerRankFailed(RuntimeError):
    """A trainer rank failed (raised, or its process died); the ranks are stopped."""


def balanced_shares(tokens: np.ndarray, parts: int) -> list[np.ndarray]:
    """Row indices of ``parts`` equal shares of ``len(tokens)`` rows (a multiple of ``parts``),
    each ascending, their token sums balanced greedily: rows by decreasing ``tokens`` (ties by
    index) each go to the share with the fewest tokens that still has room (ties: the lowest
    share). One share is every row in order."""
    rows = len(tokens)
    if rows % parts:
        raise ValueError(f"{rows} rows do not split into {parts} equal shares")
    size, sums = rows // parts, [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(rows), key=lambda r: (-int(tokens[r]), r)):
        j = min((j for j in range(parts) if len(shares[j]) < size), key=lambda j: (sums[j], j))
        shares[j].append(i)
        sums[j] += int(tokens[i])
    return [np.array(sorted(s), np.int64) for s in shares]


# ---------------------------------------------------------------------- wire (no pickle)
def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array), allow_pickle=False)
    return out.getvalue()


def _from_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _plain(value: Any) -> Any:
    """JSON for numpy scalars (a trainer's metrics)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not sent to or from a trainer rank")


def _send(conn: multiprocessing.connection.Connection, header: dict, *payloads: bytes) -> None:
    conn.send_bytes(json.dumps({**header, "payloads": len(payloads)}, default=_plain).encode())
    for p in payloads:
        conn.send_bytes(p)


def _receive(conn: multiprocessing.connection.Connection) -> tuple[dict, list[bytes]]:
    header = json.loads(conn.recv_bytes())
    return header, [conn.recv_bytes() for _ in range(header["payloads"])]


# ---------------------------------------------------------------------- one rank's side of a call
def _share(trainer: Any, batch: RolloutBatch) -> np.ndarray:
    """The rows of ``batch`` this rank trains on (see the module docstring)."""
    local_rows = getattr(trainer, "local_rows", None)  # JAX: the rows this process's devices own
    if local_rows is not None:
        return np.arange(batch.batch_size)[local_rows(batch.batch_size)]
    rank, size = trainer.data_parallel
    return balanced_shares(batch.attention_mask.sum(axis=1), size)[rank]


def _execute(trainer: Any, op: str, batch: RolloutBatch | None, old: np.ndarray | None, kwargs: dict) -> Any:
    """Run ``op`` on this rank's ``trainer`` (the same on every rank): ``train_step`` and
    ``logprobs`` on this rank's share of ``batch`` (``logprobs`` returns ``(rows, values)``)."""
    if op == "train_step":
        rows = _share(trainer, batch)
        return trainer.train_step(batch.select(rows), None if old is None else old[rows])
    if op == "logprobs":
        rows = _share(trainer, batch)
        return rows, trainer.logprobs(batch.select(rows))
    if op in ("export_hf_weights", "save", "restore", "checkpoint_steps", "close"):
        return getattr(trainer, op)(**kwargs)
    raise ValueError(f"unknown trainer command {op!r}")


def _exit_with_parent() -> None:
    """Exit this process at once when its parent is gone (for a daemon thread)."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def _rank_environment(rank: int, world_size: int, port: int, address: str = "127.0.0.1",
                      local_rank: int | None = None) -> dict[str, str]:
    """How rank ``rank`` finds the others at rank 0's ``address:port``: ``torch.distributed``'s
    variables and the JAX coordinator's (:func:`hetrl.trainer_jax.mesh.initialize_distributed`)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "MASTER_ADDR": address, "MASTER_PORT": str(port), "HETRL_COORDINATOR": f"{address}:{port}",
            "HETRL_NUM_PROCESSES": str(world_size), "HETRL_PROCESS_ID": str(rank)}


class RankTrainer:
    """Rank ``rank`` of ``world_size`` trainer ranks, in a process of its own (a worker process
    here, or a Ray actor): joins the others at rank 0's ``address:port`` (``local_rank``: its
    device index on its node) and builds the trainer; :meth:`execute` runs one gang call on this
    rank's share."""

    def __init__(self, model_dir: str | pathlib.Path, setup: TrainerSetup, rank: int, world_size: int, port: int,
                 address: str = "127.0.0.1", local_rank: int | None = None):
        os.environ.update(_rank_environment(rank, world_size, port, address, local_rank))
        self.trainer = build_trainer(model_dir, setup)

    @property
    def version(self) -> int:
        return self.trainer.version

    def execute(self, op: str, batch: RolloutBatch | None = None, old: np.ndarray | None = None, **kwargs: Any) -> Any:
        return _execute(self.trainer, op, batch, old, kwargs)


def assemble_logprobs(shape: tuple[int, ...], parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """A batch's log-probs [B, L] from every rank's ``(rows, values)`` of :func:`_execute`'s
    ``logprobs`` (tensor ranks of one data-parallel rank repeat the same rows)."""
    out = np.empty(shape, np.float32)
    for rows, values in parts:
        out[rows] = values
    return out


def _reply(conn: multiprocessing.connection.Connection, rank: int, op: str, result: Any, version: int) -> None:
    """Send ``op``'s ``result`` (log-probs as ``.npy``; the HF export as safetensors, from rank 0
    only; anything else as JSON) with the trainer's ``version``."""
    header = {"ok": True, "version": version}
    if op == "logprobs":
        _send(conn, header, _npy(result[0]), _npy(result[1]))
    elif op == "export_hf_weights":
        from safetensors.numpy import save

        _send(conn, header, *([save({k: np.ascontiguousarray(v) for k, v in result.items()})] if rank == 0 else []))
    else:
        _send(conn, {**header, "result": result})


def _decode(op: str, header: dict, payloads: list[bytes]) -> Any:
    """A worker rank 0's result of ``op`` from its reply (inverse of :func:`_reply`)."""
    if op == "logprobs":
        return _from_npy(payloads[0]), _from_npy(payloads[1])
    if op == "export_hf_weights":
        from safetensors.numpy import load

        return load(payloads[0])
    return header["result"]


def _worker_main(conn: multiprocessing.connection.Connection, rank: int, world_size: int, port: int,
                 model_dir: str, setup: TrainerSetup) -> None:
    """Rank ``rank``: build the trainer, then run each command from rank 0 until ``close``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    op = "start"
    try:
        rank_trainer = RankTrainer(model_dir, setup, rank, world_size, port)
        _send(conn, {"ok": True, "version": rank_trainer.version})
        while True:
            header, payloads = _receive(conn)
            op = header["op"]
            batch = RolloutBatch.from_bytes(payloads[0]) if header["batch"] else None
            old = _from_npy(payloads[1]) if header["old"] else None
            _reply(conn, rank, op, rank_trainer.execute(op, batch, old, **header["kwargs"]), rank_trainer.version)
            if op == "close":
                return
    except EOFError:  # rank 0 is gone
        os._exit(1)
    except BaseException:
        try:
            _send(conn, {"ok": False, "op": op, "error": traceback.format_exc()})
        finally:
            os._exit(1)  # closes this rank's sockets: rank 0's pending collective fails instead of waiting


class _Rank0Thread:
    """Runs rank 0's trainer calls on one thread; :attr:`done` (a connection) becomes readable
    when a call finishes, so the caller can wait on it beside the workers."""

    def __init__(self):
        self.done, self._signal = multiprocessing.Pipe(duplex=False)
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._serve, name="trainer-rank-0", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._calls)
                call, future = self._calls.pop(0)
            try:
                future.set_result(call())
            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                future.set_exception(err)
            self._signal.send_bytes(b"")

    def submit(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._ready:
            self._calls.append((call, future))
            self._ready.notify()
        return future


class TrainerRanks:
    """A :class:`TrainerHandle` over ``setup.settings.world_size`` trainer ranks on this machine
    (see the module docstring): Megatron's rank 0 in this process, every other rank (JAX: every
    rank) in a worker process."""

    def __init__(self, model_dir: str | pathlib.Path, setup: TrainerSetup):
        self.world_size = setup.settings.world_size
        self._first_worker = 1 if setup.settings.kind == "megatron" else 0
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._failed: str | None = None
        self._version = 0
        self._lock = threading.Lock()
        for rank in range(self._first_worker, self.world_size):
            ours, theirs = context.Pipe()
            # not daemonic: dist_checkpointing's save starts a process of its own in every rank
            proc = context.Process(target=_worker_main, name=f"hetrl-trainer-rank-{rank}",
                                   args=(theirs, rank, self.world_size, port, str(model_dir), setup))
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        atexit.register(self._stop_workers)  # before multiprocessing's own exit hook joins them
        self._rank0 = _Rank0Thread() if self._first_worker else None

        def build() -> TrainerHandle:
            saved = {k: os.environ.get(k) for k in _rank_environment(0, 1, 0)}
            os.environ.update(_rank_environment(0, self.world_size, port))
            try:
                return build_trainer(model_dir, setup)
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

        self._trainer: TrainerHandle | None = self._collect("start", self._submit(build))[0]

    def _submit(self, call: Callable[[], Any]) -> Future | None:
        """``call`` on the in-process rank 0, if there is one."""
        return self._rank0.submit(call) if self._rank0 is not None else None

    # ------------------------------------------------------------------ lockstep calls
    def _collect(self, op: str, future: Future | None) -> tuple[Any, list[tuple[dict, list[bytes]]]]:
        """Wait for the in-process rank 0's ``future`` (if any) and one reply from every worker;
        returns rank 0's result and the workers' replies (rank order). Any failure stops the
        ranks and raises :class:`TrainerRankFailed`."""
        replies: dict[int, tuple[dict, list[bytes]]] = {}
        rank0_done = future is None
        while not (rank0_done and len(replies) == len(self._conns)):
            pending = [i for i in range(len(self._conns)) if i not in replies]
            watched = [self._rank0.done] if not rank0_done else []
            watched += [self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending]
            for ready in multiprocessing.connection.wait(watched):
                if self._rank0 is not None and ready is self._rank0.done:
                    self._rank0.done.recv_bytes()
                    rank0_done = True
                    if future.exception() is not None:
                        # a worker's failure ends rank 0's collective: prefer the worker's account of it
                        self._fail(op, self._worker_failure(pending, wait_s=2.0) or
                                   f"rank 0 raised {type(future.exception()).__name__}: {future.exception()}",
                                   cause=future.exception())
            for i in pending:
                if i in replies:
                    continue
                if self._conns[i].poll() or not self._procs[i].is_alive():
                    reply = self._reply(i)
                    if isinstance(reply, str):
                        self._fail(op, reply)
                    replies[i] = reply
        ordered = [replies[i] for i in range(len(self._conns))]
        if future is not None:
            return future.result(), ordered
        header, payloads = ordered[0]
        self._version = header.get("version", self._version)
        return (_decode(op, header, payloads) if op != "start" else None), ordered[1:]

    def _reply(self, i: int) -> tuple[dict, list[bytes]] | str:
        """Worker ``i``'s reply, or why there is none (its error, or its exit), once its pipe is
        readable or its process has ended."""
        rank = i + self._first_worker
        try:
            if self._conns[i].poll():
                header, payloads = _receive(self._conns[i])
                if header["ok"]:
                    return header, payloads
                return f"rank {rank} raised in {header['op']}:\n{header['error']}"
        except (EOFError, OSError):
            pass
        self._procs[i].join(_JOIN_S)
        return f"rank {rank} exited with code {self._procs[i].exitcode}"

    def _worker_failure(self, pending: list[int], wait_s: float) -> str | None:
        """The first failure among the ``pending`` workers seen within ``wait_s`` seconds."""
        watched = [self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending]
        if not watched or not multiprocessing.connection.wait(watched, timeout=wait_s):
            return None
        for i in pending:
            if self._conns[i].poll() or not self._procs[i].is_alive():
                reply = self._reply(i)
                if isinstance(reply, str):
                    return reply
        return None

    def _fail(self, op: str, why: str, cause: BaseException | None = None) -> None:
        self._failed = f"trainer ranks failed in {op} ({self.world_size} ranks): {why}"
        self._stop_workers()
        raise TrainerRankFailed(self._failed) from cause

    def _stop_workers(self) -> None:
        """Kill the workers still running and wait for them (idempotent)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(_JOIN_S)
        for conn in self._conns:
            conn.close()
        atexit.unregister(self._stop_workers)

    def _call(self, op: str, batch: RolloutBatch | None = None, old: np.ndarray | None = None, **kwargs: Any):
        """Run ``op`` on every rank in lockstep; rank 0's result and the workers' replies."""
        with self._lock:
            if self._failed is not None:
                raise TrainerRankFailed(self._failed)
            payloads = ([batch.to_bytes()] if batch is not None else []) + ([_npy(old)] if old is not None else [])
            header = {"op": op, "batch": batch is not None, "old": old is not None, "kwargs": kwargs}
            for conn in self._conns:
                try:
                    _send(conn, header, *payloads)
                except (BrokenPipeError, OSError):
                    pass  # that rank is dead: _collect reports it
            return self._collect(op, self._submit(lambda: _execute(self._trainer, op, batch, old, kwargs)))

    # ------------------------------------------------------------------ TrainerHandle
    @property
    def version(self) -> int:
        """Rank 0's trainer's version (a worker rank 0's, as of its last reply)."""
        return self._trainer.version if self._trainer is not None else self._version

    def train_step(self, batch: RolloutBatch, old_logprobs: np.ndarray | None = None) -> dict[str, float]:
        return self._call("train_step", batch, None if old_logprobs is None else np.asarray(old_logprobs, np.float32))[0]

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        first, replies = self._call("logprobs", batch)
        return assemble_logprobs(batch.input_ids.shape, [first] + [(_from_npy(rows), _from_npy(values))
                                                                   for _, (rows, values) in replies])

    def export_hf_weights(self) -> dict[str, np.ndarray]:
        return self._call("export_hf_weights")[0]

    def save(self, *, force: bool = True) -> bool:
        return self._call("save", force=force)[0]

    def restore(self) -> int:
        return self._call("restore")[0]

    def checkpoint_steps(self) -> list[int]:
        if self._trainer is not None:
            return self._trainer.checkpoint_steps()
        return self._call("checkpoint_steps")[0]

    def close(self) -> None:
        """Close every rank's trainer and end the worker processes."""
        if self._failed is None:
            try:
                self._call("close")
            finally:
                for proc in self._procs:
                    proc.join(_JOIN_S)
                self._stop_workers()
