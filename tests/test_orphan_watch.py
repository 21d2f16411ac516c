"""The checkpoint writer's manager process dies with its trainer (hetrl.trainer_megatron.orphan_watch)."""

import os
import signal
import subprocess
import sys
import time

CHILD = """
import multiprocessing, os, sys, time
from multiprocessing.managers import SyncManager
from hetrl.trainer_megatron.orphan_watch import exit_when_orphaned
if __name__ == "__main__":
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(*((exit_when_orphaned, (os.getpid(),)) if sys.argv[1] == "watched" else ()))
    print(manager._process.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _server_after_parent_killed(mode: str) -> int:
    """Start a manager in a child process, SIGKILL the child; the manager server's pid."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
    server = int(proc.stdout.readline())
    assert _alive(server)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return server


def test_a_watched_manager_exits_when_its_parent_is_killed():
    server = _server_after_parent_killed("watched")
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server)


def test_an_unwatched_manager_outlives_its_killed_parent():
    """What the watch prevents (megatron's own manager): the server is orphaned, not ended."""
    server = _server_after_parent_killed("unwatched")
    try:
        time.sleep(2.5)  # longer than the watch's poll
        assert _alive(server)
    finally:
        os.kill(server, signal.SIGKILL)
