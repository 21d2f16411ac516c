"""The one exception type for a failure the user can fix (a bad config, a missing path, a
server that is not running): :class:`UserError`. Its message names the cause and the fix in one
line; the command line prints it as ``hetrl <command>: <message>`` and exits 1, never with a
traceback. Anything else that escapes is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """A failure the user can fix; the message says what is wrong and how to fix it."""
