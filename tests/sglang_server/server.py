"""Launch and stop a real SGLang 0.5.23 server on CPU, for hetrl's integration tests.

Stdlib only (HTTP through urllib). The server runs in the venv that ``bootstrap.py`` builds:

    from tests.sglang_server.server import SGLangServer   # or put this folder on sys.path

    with SGLangServer("assets/models/warmstart-a5fbb8c33aa5") as srv:
        status, body = srv.post("/generate", {"input_ids": [5, 6, 7],
                                              "sampling_params": {"max_new_tokens": 8}})

What is launched (one process group, its own session, log to a file)::

    SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 PY -m sglang.launch_server --model-path DIR
        --device cpu --host 127.0.0.1 --port P --attention-backend torch_native
        --sampling-backend pytorch --dtype float32 --max-total-tokens 8192
        --skip-server-warmup [--api-key KEY] [extra_args...]

(CUDA graphs are off by themselves with the torch_native backend; --mem-fraction-static is not
needed on CPU.) ``start()`` waits for GET /health_generate to answer 200 (that runs a one-token
generation through the scheduler); on timeout or an early exit it raises ``SGLangServerError``
with the last lines of the server log. ``stop()`` sends SIGTERM to the server, waits, then
SIGKILLs the whole process group (scheduler, detokenizer, resource tracker).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

DEFAULT_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--dtype", "float32",
    "--max-total-tokens", "8192",
    "--skip-server-warmup",
    "--sleep-on-idle",  # without it the idle scheduler busy-polls one whole core (here: 1.0 core of 2)
)
LOG_TAIL_LINES = 60


class SGLangServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path | str, n: int = LOG_TAIL_LINES) -> str:
    """The last n lines of a log; the one huge ``server_args=...`` line is shortened."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(line if len(line) <= 2000 else line[:2000] + " ...[cut]" for line in lines[-n:])


def default_python() -> str:
    """The SGLang venv's python: $HETRL_SGLANG_PYTHON, else bootstrap's default venv (built if needed)."""
    env = os.environ.get("HETRL_SGLANG_PYTHON")
    if env:
        return env
    sys.path.insert(0, str(HERE))
    try:
        import bootstrap  # noqa: PLC0415  (stdlib-only sibling module)
    finally:
        sys.path.remove(str(HERE))
    return str(bootstrap.ensure_venv())


class SGLangServer:
    """One SGLang server process group. Use as a context manager, or call start()/stop()."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout: float = 300.0,
        copy_model: bool = False,
    ):
        self.model_path = Path(model_path).resolve()
        self.python = python
        self.host = host
        self.port = port
        self.api_key = api_key
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.copy_model = copy_model
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._log_fh = None

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python or "python", "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", self.host, "--port", str(self.port),
            *DEFAULT_ARGS,
        ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)

    def start(self) -> "SGLangServer":
        if self.proc is not None:
            raise SGLangServerError("server already started")
        if not (self.model_path / "config.json").is_file():
            raise SGLangServerError(f"no config.json in model dir {self.model_path}")
        self.python = self.python or default_python()
        if self.copy_model or self.log_path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="hetrl-sglang-")
        if self.copy_model:
            dst = Path(self._tmpdir.name) / "model"
            shutil.copytree(self.model_path, dst)
            self.model_path = dst
        if self.log_path is None:
            self.log_path = Path(self._tmpdir.name) / "server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the venv must not see the repo's or another venv's modules
        env.update({"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        self._log_fh = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise SGLangServerError(
                    f"SGLang server exited with code {code} during start-up "
                    f"({time.monotonic() - t0:.0f}s). Command: {' '.join(self.command())}\n"
                    f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{log_tail(self.log_path)}"
                )
            try:
                status, _ = self.request("GET", "/health_generate", timeout=30)
                if status == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise SGLangServerError(
                    f"SGLang server not healthy after {self.startup_timeout:.0f}s on {self.url}. "
                    f"Command: {' '.join(self.command())}\n"
                    f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the server, wait up to ``grace`` s, then SIGKILL its whole process group."""
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid  # start_new_session: the server leads its own group
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def kill(self) -> None:
        """SIGKILL the whole process group now (a crash, for fault tests); stop() still cleans up."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(timeout=30)

    def close(self) -> None:
        """stop() and remove the temporary folder (copied model, default log)."""
        self.stop()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, n) if self.log_path else ""

    # ---- HTTP ------------------------------------------------------------------------------
    def request(
        self, method: str, path: str, body: dict | list | None = None, *,
        timeout: float = 120.0, api_key: str | None = None,
    ) -> tuple[int, object]:
        """(status, parsed JSON body or raw text or None). HTTP errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        key = api_key if api_key is not None else self.api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())

    def get(self, path: str, **kw) -> tuple[int, object]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: dict | list | None = None, **kw) -> tuple[int, object]:
        return self.request("POST", path, body if body is not None else {}, **kw)


def _decode(raw: bytes) -> object:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
