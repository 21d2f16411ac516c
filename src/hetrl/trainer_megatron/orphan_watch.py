"""Megatron's checkpoint-writer results queue, served by a process that dies with its trainer.

megatron-core's torch_dist writer (``filesystem_async._get_write_results_queue``) starts a
``spawn`` multiprocessing manager on the first save: a server process that outlives a SIGKILLed
trainer forever. :func:`install_results_queue` gives the writer its queue first, from a manager
whose server exits within a second of its parent. This module imports neither torch nor megatron
at import time, so the server process (which unpickles :func:`exit_when_orphaned`) stays light.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.managers import SyncManager

__all__ = ["exit_when_orphaned", "install_results_queue"]


def exit_when_orphaned(parent: int, poll_s: float = 1.0) -> None:
    """In a child process: exit once its parent ``parent`` is gone (``getppid`` polled each
    ``poll_s`` seconds, by a daemon thread)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def install_results_queue() -> None:
    """Set megatron's writer results queue (once per process) to one served by a manager that
    exits with this process; the queue's proxy keeps its manager alive."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(exit_when_orphaned, (os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
