"""Function-test harness, run as the sandbox program by :mod:`hetrl.envs.coding` (stdlib only).

Input (stdin, JSON): ``{"nonce", "module", "entry", "cases": [[arg, ...], ...], "timeout_s"}``.
It imports ``module`` from the run directory, calls ``entry(*args)`` for every case and writes one
line per case to the *original* stdout: ``NONCE {"i": i, "out": value}`` or
``NONCE {"i": i, "error": "Type: message"}``, or once ``NONCE {"load_error": ...}``. The
candidate's own prints go to stderr. Expected values never enter the sandbox: the parent compares.
"""

import json
import os
import signal
import sys

MAX_OUT_CHARS = 2_000


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
    for i, args in enumerate(spec["cases"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
            out = fn(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"i": i, "error": _describe(exc)})
            continue
        try:
            text = json.dumps(out)
        except (TypeError, ValueError, RecursionError):
            emit({"i": i, "error": f"ReturnValueError: cannot compare a {type(out).__name__}"})
            continue
        if len(text) > MAX_OUT_CHARS:
            emit({"i": i, "error": "ReturnValueError: the return value is too large"})
        else:
            results.write(f'{nonce} {{"i": {i}, "out": {text}}}\n')
            results.flush()


if __name__ == "__main__":
    main()
