"""The SGLang pool client's HTTP plumbing (hetrl.samplers.sglang.ServerSampler) against a plain
HTTP stand-in on loopback: one persistent client (kept-alive connections across calls), retries
with exponential backoff on 5xx, a 4xx raised at once, and no health probe on the generate path
(health is the fleet's :meth:`health` call)."""

import http.server
import json
import threading
import time
from collections import Counter

import numpy as np
import pytest

from hetrl.core.schema import SamplingParams
from hetrl.samplers.base import GenerationRequest
from hetrl.samplers.fleet import PoolConfig
from hetrl.samplers.sglang import ServerError, ServerSampler


class _Stub(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so a reused connection shows as one client port
    generate_status = 503
    seen: Counter = Counter()
    ports: set = set()

    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        type(self).seen[("GET", self.path)] += 1
        type(self).ports.add(self.client_address[1])
        self._answer(200, {"version": "stub"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen[("POST", self.path)] += 1
        type(self).ports.add(self.client_address[1])
        self._answer(self.generate_status, {"error": "busy"})

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    _Stub.seen, _Stub.ports = Counter(), set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _sampler(url, model_dir, tmp_path, **server):
    pool = PoolConfig(name="stub", engine="sglang", accelerator="h100", weight_precision="bf16", endpoints=[url],
                      server={"connect_timeout_s": 2.0, "request_timeout_s": 5.0, **server})
    return ServerSampler(pool, pool.numerics(), model_dir=model_dir, weights_dir=tmp_path / "w", sync_base=False)


REQUEST = GenerationRequest("r/0", np.array([3, 4, 5], np.int32), SamplingParams(), 4)


def test_5xx_is_retried_with_backoff_on_one_persistent_connection_without_health_probes(stub, tiny_checkpoint, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr(_Stub, "generate_status", 503)
    sampler = _sampler(stub, tiny_checkpoint(), tmp_path, retries=2, backoff_s=0.2)
    before = sum(n for (method, _), n in _Stub.seen.items() if method == "GET")
    for _ in range(2):  # two calls: the client and its connection outlive a call
        start = time.monotonic()
        with pytest.raises(ServerError, match="failed after 3 attempts.*HTTP 503"):
            sampler.generate([REQUEST])
        assert time.monotonic() - start >= 0.2 + 0.4  # backoff_s * 2^attempt before each retry
    assert _Stub.seen[("POST", "/generate")] == 6
    assert sum(n for (method, _), n in _Stub.seen.items() if method == "GET") == before  # no /health per call
    assert len(_Stub.ports) == 1  # one kept-alive connection for the info probe and every request
    assert sampler.health().healthy and _Stub.seen[("GET", "/health")] == 1
    sampler.close()
    sampler.close()


def test_4xx_is_raised_at_once(stub, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(_Stub, "generate_status", 400)
    sampler = _sampler(stub, tiny_checkpoint(), tmp_path, retries=3, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(ValueError, match="HTTP 400"):
        sampler.generate([REQUEST])
    assert time.monotonic() - start < 2.0 and _Stub.seen[("POST", "/generate")] == 1
    sampler.close()
