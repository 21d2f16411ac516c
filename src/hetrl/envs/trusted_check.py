"""Trusted ``check(candidate)`` grading: HumanEval-style test code runs in the grader's process,
and ``candidate`` is a proxy whose every call runs in the sandbox.

The test code (``def check(candidate): assert candidate(...) == ...``) is the task author's, so it
is trusted; the candidate's code is not, so it never runs here. A call of the proxy is answered
with the typed value (:mod:`hetrl.envs.typed`) that the sandboxed function returned: a plain
built-in value decoded in this process, never an object the candidate constructed, so no
``__eq__`` of the candidate's can decide an assertion. A call that raised in the sandbox raises
here a fresh exception of the same built-in class (``RuntimeError`` for any other class).

Calls are batched: :func:`run_check` runs ``check`` in rounds. In a round every call whose result
is known is answered; an unknown call is recorded and answered with a placeholder that compares
equal to anything (so ``assert candidate(x) == y`` lines go on collecting calls) and refuses any
other use (the round stops there). The recorded calls then run in one sandbox run, and the next
round starts ``check`` afresh. A round in which every call was known decides the grade: pass when
``check`` returns, fail when it raises. Tests whose calls do not depend on earlier results (nearly
all) take one sandbox run; a test whose arguments depend on earlier results (HumanEval/32 feeds each
result to a helper before the next call) takes one run per dependent call. Each round gets the same fresh ``random`` module seeded identically,
so tests drawing random inputs make the same calls every round, whichever thread grades.
"""

from __future__ import annotations

import builtins
import random
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hetrl.envs import typed

__all__ = ["CallResult", "CheckResult", "CandidateError", "compile_check", "run_check"]


@dataclass(frozen=True)
class CallResult:
    """The outcome of one sandboxed call: its typed return ``value`` when ``ok``, else ``error``:
    ``"Type: message"`` when the call ``raised``, otherwise why no result came back."""

    ok: bool
    value: Any = None
    error: str = ""
    raised: bool = False


@dataclass(frozen=True)
class CheckResult:
    """``passed``: ``check`` returned with every call answered; else ``error`` names the failure
    (``"AssertionError"``, the class of another exception, or why grading stopped). ``calls``
    distinct calls ran in ``rounds`` sandbox runs."""

    passed: bool
    error: str | None
    calls: int
    rounds: int


class CandidateError(RuntimeError):
    """Raised in the trusted test code for a call that raised a non-builtin exception, or gave no
    result, in the sandbox."""


class _Incomplete(BaseException):
    """Stops a collecting round (not an Exception: the test code cannot catch it by accident)."""


class _Pending:
    """The answer to a call not yet run: equal to anything, usable for nothing else."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __bool__(self) -> bool:
        raise _Incomplete()

    def __repr__(self) -> str:
        return "<pending>"


#: Exceptions the proxy re-raises under their own class (any other becomes CandidateError).
_BUILTIN_ERRORS = {name: cls for name, cls in vars(builtins).items()
                   if isinstance(cls, type) and issubclass(cls, Exception)}


def _raise_for(error: str) -> None:
    name = error.split(":", 1)[0].strip()
    if name == "Timeout":
        raise TimeoutError(f"the candidate's call timed out: {error}")
    raise _BUILTIN_ERRORS.get(name, CandidateError)(f"the candidate raised {error}")


class _Proxy:
    """``candidate`` of one round: answers known calls, records unknown ones."""

    def __init__(self, known: dict[str, CallResult], pending: dict[str, tuple], max_calls: int):
        self._known, self._pending, self._max_calls = known, pending, max_calls
        self._calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls > self._max_calls:  # repeated calls included: `while candidate(x) == 0` on a placeholder
            raise _Incomplete()
        try:
            key = typed.dumps((args, kwargs))
        except typed.TypedError as exc:
            if self._pending:  # an argument computed from a placeholder: wait for its result
                raise _Incomplete() from None
            raise TypeError(f"the test passed an argument that cannot reach the sandbox: {exc}") from None
        result = self._known.get(key)
        if result is None:
            self._pending[key] = (args, kwargs)
            return _Pending()
        if not result.ok:
            if not result.raised:
                raise CandidateError(f"the candidate's call gave no result: {result.error}")
            _raise_for(result.error)
        return typed.decode(typed.encode(result.value))  # a fresh copy: the test may mutate it


def _seeded_import(seed: int) -> Callable[..., Any]:
    """``__import__`` that gives ``random`` as a private module seeded with ``seed``."""
    rng = random.Random(seed)
    module = types.ModuleType("random")
    module.__dict__.update({name: getattr(rng, name) if callable(value) and hasattr(rng, name) else value
                            for name, value in vars(random).items() if not name.startswith("_")})

    def import_(name: str, *args: Any, **kwargs: Any) -> Any:
        return module if name == "random" else builtins.__import__(name, *args, **kwargs)

    return import_


def compile_check(context: str, test: str, where: str) -> types.CodeType:
    """The code object of ``context`` (code the test may use: a HumanEval prompt's helpers)
    followed by ``test``; ValueError naming ``where`` when it is not valid Python."""
    source = f"{context}\n\n{test}\n"
    try:
        return compile(source, f"<{where} test>", "exec")
    except SyntaxError as err:
        raise ValueError(f"{where}: the test code is not valid Python (line {err.lineno}: {err.msg})") from None


def _run_once(code: types.CodeType, entry_point: str, proxy: _Proxy, seed: int) -> str | None:
    """Run ``check(proxy)`` once, with ``entry_point`` bound to the proxy too (as where the
    answer's code precedes the test: HumanEval/33's test calls the function by name): None when
    it returned, else the exception's class name."""
    namespace: dict[str, Any] = {"__name__": "__hetrl_check__",
                                 "__builtins__": {**vars(builtins), "__import__": _seeded_import(seed)}}
    try:
        exec(code, namespace)
        namespace[entry_point] = proxy
        namespace["check"](proxy)
    except _Incomplete:
        return "incomplete"
    except Exception as exc:  # the test failed (an assertion, or an error in the test's own code)
        return type(exc).__name__
    return None


def run_check(code: types.CodeType, entry_point: str, call: Callable[[Sequence[tuple]], Sequence[CallResult] | str],
              *, max_rounds: int = 256, max_calls: int = 4096, seed: int = 0) -> CheckResult:
    """Grade by running ``check(candidate)`` of ``code`` (see the module docstring; the function
    is ``entry_point``). ``call(batch)``
    runs a batch of ``(args, kwargs)`` calls in the sandbox and returns one :class:`CallResult`
    per call, or a string when the candidate's code could not load (the grade then fails with it)."""
    known: dict[str, CallResult] = {}
    for round_ in range(max_rounds + 1):
        pending: dict[str, tuple] = {}
        error = _run_once(code, entry_point, _Proxy(known, pending, max_calls), seed)
        if not pending:
            if error == "incomplete":
                error = f"more than {max_calls} calls of the candidate"
            return CheckResult(error is None, error, len(known), round_)
        if round_ == max_rounds:
            break
        results = call(list(pending.values()))
        if isinstance(results, str):
            return CheckResult(False, results, len(known), round_ + 1)
        known.update(zip(pending, results))
    return CheckResult(False, f"the calls were not settled in {max_rounds} rounds", len(known), max_rounds)
