"""Unit-test harness, run as the sandbox program by :mod:`hetrl.envs.coding` (stdlib only).

Input (stdin, JSON): ``{"nonce", "tests": {"tests/test_x.py": source, ...}, "cpu_s", "wall_s"}``. The test
sources come from the grader's pristine copy, in memory: they are read here before any of the
candidate's code loads and run from that copy, whatever the candidate writes to disk (hidden test
files are never on disk at all). For each file this process, which never imports the candidate's
code, forks a child that loads the file as module ``tests.test_x`` (the run directory first on
``sys.path``), runs its tests with :mod:`unittest`, each under a limit of ``cpu_s`` seconds of the
child's CPU time (``ITIMER_PROF``: a grade does not depend on how busy the machine is) and a
backstop of ``wall_s`` seconds of wall clock (``ITIMER_REAL``, for code that blocks), and sends
one record per test through a pipe: ``{"id": "tests.test_x.Class.test_y", "status":
"pass|fail|error|skip", "message": ...}`` (or ``{"file": ..., "status": "error", ...}`` when the
file does not load). The parent relays the first record per test id to the *original* stdout as
``NONCE <record>``. A child has no descriptor of that stdout (its output goes to stderr), and this
process is made non-dumpable first, so a child cannot reach the parent's descriptors through
``/proc``: what the candidate's code can forge is the records of the tests that run in its own
process. The grader's canary tests (appended to the sources) detect the usual ways of doing that
(patching ``unittest``, reporting every test passed), and ``assertEqual`` refuses a value whose own
``__eq__`` would decide a comparison with a plain value. Residual risk: code in the test's process
that tells the canaries apart (they are in the sources it can read) and forges only the other
tests' records, or undoes the guard, or answers a bare ``assert x == y`` with such an object.
"""

import ctypes
import json
import os
import signal
import sys
import traceback
import unittest

MAX_MESSAGE_CHARS = 600
PR_SET_DUMPABLE = 4


class _Timeout(BaseException):  # not an Exception: a candidate's `except Exception` cannot eat it
    pass


def _on_timer(signum, _frame):
    raise _Timeout(f"the test took too long ({'CPU' if signum == signal.SIGPROF else 'wall'} time limit)")


def _limit(cpu_s, wall_s):
    """Arm (or, with zeros, disarm) the CPU-time and wall-clock limits of the next test."""
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    signal.setitimer(signal.ITIMER_REAL, wall_s)


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


_PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


def _candidate_class(cls, test_module):
    """Whether ``cls`` was defined by the candidate: in a module loaded from the run directory
    other than the test file (the standard library's ``Decimal`` or ``Fraction`` are not)."""
    if cls.__module__ == test_module:
        return False
    path = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return path.startswith(os.getcwd() + os.sep)


def _guard_assert_equal(test_module):
    """``assertEqual(x, plain)`` refuses an ``x`` of a class the candidate defined whose own
    ``__eq__`` would decide the comparison (an object whose ``__eq__`` is always true, an ``int``
    subclass that says so): such an ``x`` must be a subclass of the plain value's type keeping its
    ``__eq__``."""
    original = unittest.TestCase.assertEqual

    def assert_equal(self, first, second, msg=None):
        for a, b in ((first, second), (second, first)):
            if type(b) in _PLAIN and type(a) is not type(b) and _candidate_class(type(a), test_module) \
                    and getattr(type(a), "__eq__", None) is not getattr(type(b), "__eq__", None):
                raise self.failureException(f"{type(a).__name__} compared with a {type(b).__name__} by its own __eq__")
        return original(self, first, second, msg)

    unittest.TestCase.assertEqual = assert_equal


def _run_file(path, source, limits, send):
    """In the child: load one test file from its pristine ``source`` and run its tests, each
    under ``limits`` = (CPU seconds, wall seconds)."""
    name = path[:-3].replace("/", ".")
    _guard_assert_equal(name)
    signal.signal(signal.SIGALRM, _on_timer)
    signal.signal(signal.SIGPROF, _on_timer)
    try:
        _limit(*limits)
        module = type(sys)(name)
        module.__file__ = os.path.join(os.getcwd(), path)
        sys.modules[name] = module
        exec(compile(source, path, "exec"), module.__dict__)
        _limit(0, 0)
        tests = list(_iter_tests(unittest.defaultTestLoader.loadTestsFromModule(module)))
    except BaseException as exc:
        _limit(0, 0)
        send({"file": path, "status": "error", "message": _short(f"{type(exc).__name__}: {exc}")})
        return
    for test in tests:
        recorder = _Recorder()
        try:
            _limit(*limits)
            test.run(recorder)
            _limit(0, 0)
        except BaseException as exc:
            _limit(0, 0)
            recorder.outcomes.setdefault(test.id(), ("error", _short(f"{type(exc).__name__}: {exc}")))
        status, message = recorder.outcomes.get(test.id(), ("error", "no outcome recorded"))
        send({"id": test.id(), "status": status, "message": message})


def main():
    spec = json.loads(sys.stdin.read())
    try:
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl: a child can open this process's descriptors through /proc
    results = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    nonce = spec["nonce"]
    sys.path.insert(0, os.getcwd())
    for path, source in spec["tests"].items():
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: no descriptor of the results stream, nothing of the nonce kept
            try:
                os.close(read_end)
                results.close()
                nonce = None
                channel = os.fdopen(write_end, "w", encoding="utf-8")

                def send(record):
                    channel.write(json.dumps(record) + "\n")
                    channel.flush()

                _run_file(path, source, (spec["cpu_s"], spec["wall_s"]), send)
            finally:
                os._exit(0)
        os.close(write_end)
        seen = set()
        module = path[:-3].replace("/", ".") + "."
        with os.fdopen(read_end, "r", encoding="utf-8", errors="replace") as channel:
            for line in channel:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                key = record.get("id", record.get("file"))
                mine = key == path if "id" not in record else isinstance(key, str) and key.startswith(module)
                if mine and key not in seen:  # the first record of each of this file's tests only
                    seen.add(key)
                    results.write(f"{nonce} {json.dumps(record)}\n")
                    results.flush()
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
