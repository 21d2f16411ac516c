"""(Re)start the test SGLang server recorded in STATE_DIR on a checkpoint directory.

This is what a site's restart script does for hetrl's ``server.weight_sync: restart`` fallback
(the only weight sync sglang-jax servers allow): hetrl runs it with the exported directory of a
new weight version, and it must return once the server serves that directory. Here, for the
tests: ``STATE_DIR/server.json`` holds the running server's ``pid`` (its process-group leader)
and ``port``; that group is killed and a new server is started on the same port on MODEL_PATH,
detached, and this script exits when it is healthy (or with an error and the log tail).

    python restart.py STATE_DIR MODEL_PATH      # the first call starts the server
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import SGLangServer, SGLangServerError, free_port  # noqa: E402


def main(state_dir: str, model_path: str) -> int:
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    record = state / "server.json"
    port = None
    if record.exists():
        old = json.loads(record.read_text())
        port = old["port"]
        try:
            os.killpg(old["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait for the port to be released
            try:
                os.kill(old["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    server = SGLangServer(model_path, port=port or free_port(), log_path=state / "server.log")
    try:
        server.start()
    except SGLangServerError as err:
        print(err, file=sys.stderr)
        return 1
    record.write_text(json.dumps({"pid": server.proc.pid, "port": server.port, "url": server.url}))
    return 0  # the server lives on in its own session


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
