"""Stopping a command on SIGINT / SIGTERM: a stop token, checked at safe points, and its handlers.

The command line (:mod:`hetrl.cli`) installs :func:`signal_handlers` before anything heavy
starts. The first SIGINT or SIGTERM requests a stop on the process's token (:func:`current`):
every phase checks it at its next safe point (the warm start between optimizer steps, the
loop's set-up between its stages, an evaluation between batches, the trainer loop between
steps) and stops there; a phase that has nothing to keep yet raises :class:`Stopped`. A second
signal (one second or more after the first: ``timeout`` delivers its signal twice, to the child
and to its process group) exits at once (``os._exit``, after the token's force hooks, e.g. killing
child processes). A stopped command exits with ``128 + signal`` (130 for SIGINT, 143 for SIGTERM), as a
shell reports a process the signal ended, so a scheduler can tell it from a finished run.

Outside the command line (tests, library use) :func:`current` is a token no signal sets, so
nothing here changes how a run behaves.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

__all__ = ["Stopped", "StopToken", "current", "signal_handlers", "reclaim_signals", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DUPLICATE_WINDOW_S = 1.0
"""A signal within this many seconds of the first is the same stop delivered twice, not a second one."""


class Stopped(Exception):
    """A stop was requested (by ``signum``, when known) while ``phase`` ran, before it had
    anything to keep."""

    def __init__(self, phase: str, signum: int | None = None):
        by = f" by {signal.Signals(signum).name}" if signum else ""
        super().__init__(f"stopped{by} during {phase}")
        self.signum = signum
        self.phase = phase


class StopToken:
    """A stop request: set once (by the first signal, or :meth:`request`), with the signal that
    set it. ``on_request`` callbacks run when it is set (at once if it already is), e.g. an
    orchestrator's ``request_stop``; ``on_force`` callbacks run before a forced exit."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None
        self.requested_at = math.inf
        self._listeners: list[Callable[[], None]] = []
        self._force_hooks: list[Callable[[], None]] = []

    def request(self, signum: int = signal.SIGTERM) -> None:
        if self._event.is_set():
            return
        self.signum = signum
        self.requested_at = time.monotonic()
        self._event.set()
        for listener in list(self._listeners):
            listener()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested or ``timeout`` passes (not from the main thread while
        signals may arrive: use :meth:`is_set` there)."""
        return self._event.wait(timeout)

    def check(self, phase: str) -> None:
        """Raise :class:`Stopped` if a stop was requested (a safe point of ``phase``)."""
        if self._event.is_set():
            raise Stopped(phase, self.signum)

    def on_request(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)
        if self._event.is_set():
            listener()

    def on_force(self, hook: Callable[[], None]) -> None:
        self._force_hooks.append(hook)

    def force(self) -> None:
        for hook in list(self._force_hooks):
            try:
                hook()
            except Exception:  # a forced exit goes on whatever a hook did
                pass

    @property
    def exit_status(self) -> int:
        """``128 + signal`` of the signal that set it (143 for SIGTERM when set without one)."""
        return 128 + (self.signum or signal.SIGTERM)


_current = StopToken()
_handler: Callable[[int, object], None] | None = None  # that of the innermost signal_handlers block


def reclaim_signals() -> None:
    """Install the stop handlers of the current :func:`signal_handlers` block again (after a
    library replaced them, as ``ray.init`` does with SIGTERM); nothing outside a block or off the
    main thread."""
    if _handler is not None and threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _handler)


def _say(line: str) -> None:
    """One line on stderr, written directly (a signal handler may interrupt a ``print``)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError):
        pass


def current() -> StopToken:
    """The token of this process's command (a never-set one outside :func:`signal_handlers`)."""
    return _current


@contextlib.contextmanager
def signal_handlers(command: str) -> Iterator[StopToken]:
    """Within the block, SIGINT and SIGTERM request a stop on a fresh :func:`current` token
    (saying so on stderr as ``command``); a second signal runs the force hooks and exits with
    ``128 + signal`` at once. The previous handlers and token are restored afterwards."""
    global _current, _handler
    token, previous_token, previous_handler = StopToken(), _current, _handler

    def handle(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if token.is_set() and time.monotonic() - token.requested_at < DUPLICATE_WINDOW_S:
            return  # the same stop delivered twice (`timeout` signals its child, then the child's process group)
        if token.is_set():
            _say(f"{command}: {name} again: exiting now")
            token.force()
            os._exit(128 + signum)
        _say(f"{command}: {name} received: stopping at the next safe point (send it again to exit at once)")
        token.request(signum)

    previous = {s: signal.signal(s, handle) for s in STOP_SIGNALS}
    _current, _handler = token, handle
    try:
        yield token
    finally:
        _current, _handler = previous_token, previous_handler
        for s, h in previous.items():
            signal.signal(s, h)
