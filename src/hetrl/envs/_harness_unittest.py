"""Unit-test harness, run as the sandbox program by :mod:`hetrl.envs.coding` (stdlib only).

Input (stdin, JSON): ``{"nonce", "files": ["tests/test_x.py", ...], "timeout_s"}``. It loads each
test file as module ``tests.test_x`` (the run directory first on ``sys.path``), runs its tests
with :mod:`unittest`, each under a time limit, and writes one line per test to the *original*
stdout: ``NONCE {"id": "tests.test_x.Class.test_y", "status": "pass|fail|error|skip",
"message": ...}``; a file that does not load gives ``{"file": ..., "status": "error", ...}``.
The code under test prints to stderr. The tests run in the same process as the candidate code,
so a candidate that deliberately tampers with the runner could forge results (see coding.py).
"""

import importlib.util
import json
import os
import signal
import sys
import traceback
import unittest

MAX_MESSAGE_CHARS = 600


class _Timeout(BaseException):  # not an Exception: a candidate's `except Exception` cannot eat it
    pass


def _on_alarm(*_):
    raise _Timeout("the test took too long")


def _short(text):
    """Trimmed to the last MAX_MESSAGE_CHARS, with run-directory paths made relative."""
    text = text.replace(os.getcwd() + os.sep, "")
    return text if len(text) <= MAX_MESSAGE_CHARS else "..." + text[-MAX_MESSAGE_CHARS:]


class _Recorder(unittest.TestResult):
    """Records one outcome per test (the first failure or error wins)."""

    def __init__(self):
        super().__init__()
        self.outcomes = {}

    def _set(self, test, status, message=""):
        self.outcomes.setdefault(test.id(), (status, _short(message)))

    def addSuccess(self, test):
        self._set(test, "pass")

    def addFailure(self, test, err):
        self._set(test, "fail", "".join(traceback.format_exception_only(err[0], err[1])).strip())

    def addError(self, test, err):
        lines = traceback.format_exception(*err)
        self._set(test, "error", "".join(lines[-3:]).strip())

    def addSkip(self, test, reason):
        self._set(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        self._set(test, "pass")

    def addUnexpectedSuccess(self, test):
        self._set(test, "fail", "unexpected success")


def _iter_tests(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _iter_tests(item)
        else:
            yield item


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
    for path in spec["files"]:
        name = path[:-3].replace("/", ".")
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            signal.setitimer(signal.ITIMER_REAL, 0)
            tests = list(_iter_tests(unittest.defaultTestLoader.loadTestsFromModule(module)))
        except BaseException as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"file": path, "status": "error", "message": _short(f"{type(exc).__name__}: {exc}")})
            continue
        for test in tests:
            recorder = _Recorder()
            try:
                signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
                test.run(recorder)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except BaseException as exc:
                signal.setitimer(signal.ITIMER_REAL, 0)
                recorder.outcomes.setdefault(test.id(), ("error", _short(f"{type(exc).__name__}: {exc}")))
            status, message = recorder.outcomes.get(test.id(), ("error", "no outcome recorded"))
            emit({"id": test.id(), "status": status, "message": message})


if __name__ == "__main__":
    main()
