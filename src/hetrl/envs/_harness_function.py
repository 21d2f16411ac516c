"""Function-test harness, run as the sandbox program by :mod:`hetrl.envs.coding` (stdlib only).

Input (stdin, JSON): ``{"nonce", "module", "entry", "calls": [call, ...], "cpu_s", "wall_s",
"max_out_chars"}`` where each call is the typed encoding (``_hetrl_typed``, a copy of
:mod:`hetrl.envs.typed` in the run directory) of an ``(args, kwargs)`` pair. It imports ``module``
from the run directory, calls ``entry(*args, **kwargs)`` for every call and writes one line per
call to the *original* stdout: ``NONCE {"i": i, "out": <typed encoding>}`` or
``NONCE {"i": i, "error": "Type: message"}``, or once ``NONCE {"load_error": ...}``. The
candidate's own prints go to stderr. Expected values never enter the sandbox, and nothing here
decides a reward: the grader decodes the typed values and compares them (or hands them to trusted
test code) in its own process.

The import and each call are limited to ``cpu_s`` seconds of this process's CPU time
(``ITIMER_PROF``), so a grade does not depend on how busy the machine is, and to ``wall_s``
seconds of wall clock (``ITIMER_REAL``), a backstop for code that blocks without computing.
"""

import json
import os
import signal
import sys


class _Timeout(BaseException):  # not an Exception: a candidate's `except Exception` cannot eat it
    pass


def _on_timer(signum, _frame):
    raise _Timeout("CPU" if signum == signal.SIGPROF else "wall")


def _limit(cpu_s, wall_s):
    """Arm (or, with zeros, disarm) the CPU-time and wall-clock limits of the next call."""
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    signal.setitimer(signal.ITIMER_REAL, wall_s)


def _describe(exc):
    if isinstance(exc, _Timeout):
        return f"Timeout: the call took too long ({exc.args[0]} time limit)"
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:300] + "..."


def main():
    spec = json.loads(sys.stdin.read())
    results = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    nonce = spec["nonce"]

    def emit(record):
        results.write(f"{nonce} {json.dumps(record)}\n")
        results.flush()

    sys.path.insert(0, os.getcwd())
    import _hetrl_typed as typed

    signal.signal(signal.SIGALRM, _on_timer)
    signal.signal(signal.SIGPROF, _on_timer)
    limits = (spec["cpu_s"], spec["wall_s"])
    try:
        _limit(*limits)
        module = __import__(spec["module"])
        _limit(0, 0)
        fn = getattr(module, spec["entry"])
    except BaseException as exc:
        _limit(0, 0)
        emit({"load_error": _describe(exc)})
        return
    for i, call in enumerate(spec["calls"]):
        args, kwargs = typed.decode(call)
        try:
            _limit(*limits)
            out = fn(*args, **kwargs)
            _limit(0, 0)
        except BaseException as exc:
            _limit(0, 0)
            emit({"i": i, "error": _describe(exc)})
            continue
        try:
            text = json.dumps(typed.encode(out), separators=(",", ":"))
        except Exception as exc:  # not transferable, too deep, or a value whose methods raise
            emit({"i": i, "error": f"ReturnValueError: {_describe(exc)}"})
            continue
        if len(text) > spec["max_out_chars"]:
            emit({"i": i, "error": "ReturnValueError: the return value is too large"})
        else:
            results.write(f'{nonce} {{"i": {i}, "out": {text}}}\n')
            results.flush()


if __name__ == "__main__":
    main()
