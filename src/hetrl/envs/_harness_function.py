"""Function-test harness, run as the sandbox program by :mod:`hetrl.envs.coding` (stdlib only).

Input (stdin, JSON): ``{"nonce", "module", "entry", "calls": [call, ...], "timeout_s",
"max_out_chars"}`` where each call is the typed encoding (``_hetrl_typed``, a copy of
:mod:`hetrl.envs.typed` in the run directory) of an ``(args, kwargs)`` pair. It imports ``module``
from the run directory, calls ``entry(*args, **kwargs)`` for every call and writes one line per
call to the *original* stdout: ``NONCE {"i": i, "out": <typed encoding>}`` or
``NONCE {"i": i, "error": "Type: message"}``, or once ``NONCE {"load_error": ...}``. The
candidate's own prints go to stderr. Expected values never enter the sandbox, and nothing here
decides a reward: the grader decodes the typed values and compares them (or hands them to trusted
test code) in its own process.
"""

import json
import os
import signal
import sys


class _Timeout(BaseException):  # not an Exception: a candidate's `except Exception` cannot eat it
    pass


def _on_alarm(*_):
    raise _Timeout()


def _describe(exc):
    if isinstance(exc, _Timeout):
        return "Timeout: the call took too long"
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

    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
        module = __import__(spec["module"])
        signal.setitimer(signal.ITIMER_REAL, 0)
        fn = getattr(module, spec["entry"])
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit({"load_error": _describe(exc)})
        return
    for i, call in enumerate(spec["calls"]):
        args, kwargs = typed.decode(call)
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
            out = fn(*args, **kwargs)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
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
