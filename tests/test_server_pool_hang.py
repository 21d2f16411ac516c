"""A server pool that hangs: it accepts connections and answers its health and info probes, but
never answers ``/generate``. The pool client gives up after ``request_timeout_s`` (with its
retries), the fleet marks the replica dead and re-queues its jobs, and another pool finishes
every job exactly once. A plain-HTTP stand-in server on loopback (no SGLang needed): what is under
test is the client's and the fleet's handling, not the server."""

import http.server
import json
import threading
import time

import numpy as np
import pytest

from hetrl.core.schema import SamplingParams
from hetrl.samplers.base import Generation, GenerationRequest, SamplerHealth
from hetrl.samplers.fleet import Fleet, PoolConfig
from hetrl.samplers.sglang import ServerError, ServerSampler

HANG_S = 30.0
TIMEOUT_S = 0.5


class _Hangs(http.server.BaseHTTPRequestHandler):
    release = threading.Event()

    def do_GET(self):  # /health, /server_info: answered at once
        body = json.dumps({"version": "hangs"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # /generate: never answered (until the test ends)
        self.release.wait(HANG_S)

    def log_message(self, *args):
        pass


class _Answers:
    """A healthy replica of another pool: one fixed token per request."""

    def __init__(self, pool: PoolConfig):
        self._info = pool.numerics().sampler_info(pool.name, pool.engine, "fake")

    @property
    def info(self):
        return self._info

    def generate(self, requests):
        return [Generation(request_id=r.request_id, token_ids=np.array([5], np.int32),
                           logprobs=np.array([-0.1], np.float32), policy_version=np.zeros(1, np.int32),
                           finish_reason="length", support=None, sampler=self._info) for r in requests]

    def update_weights(self, version, weights):
        pass

    def health(self):
        return SamplerHealth(healthy=True, weight_version=0)


@pytest.fixture
def hanging_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hangs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Hangs.release.set()
    server.shutdown()
    server.server_close()
    _Hangs.release.clear()


def test_a_hanging_pool_times_out_and_its_jobs_finish_elsewhere(hanging_server, tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint()
    pool = PoolConfig(name="hangs", engine="sglang", accelerator="h100", weight_precision="bf16", endpoints=[hanging_server],
                      server={"request_timeout_s": TIMEOUT_S, "connect_timeout_s": TIMEOUT_S, "retries": 1,
                              "backoff_s": 0.01, "sampling_mask": "native"})
    hangs = ServerSampler(pool, pool.numerics(), model_dir=model_dir, weights_dir=tmp_path / "w", sync_base=False)
    request = GenerationRequest("probe/0", np.array([3, 4, 5], np.int32), SamplingParams(), 4)
    start = time.monotonic()
    with pytest.raises(ServerError):
        hangs.generate([request])
    assert time.monotonic() - start < 10 * TIMEOUT_S  # two attempts of TIMEOUT_S each, not HANG_S

    other = PoolConfig(name="other", accelerator="b200", weight_precision="bf16")
    fleet = Fleet([(pool, hangs), (other, _Answers(other))], max_batch=2)
    jobs = {f"g{i}": [GenerationRequest(f"g{i}/{k}", np.array([3, 4, 5], np.int32), SamplingParams(), 4)
                      for k in range(2)] for i in range(6)}
    done = fleet.generate(jobs, timeout=60)
    assert sorted(done) == sorted(jobs) and {r.pool for r in done.values()} == {"other"}
    m = fleet.metrics()
    assert m["pool/hangs/replicas_alive"] == 0 and m["pool/hangs/errors"] == 1 and m["pool/hangs/requeues"] >= 1
