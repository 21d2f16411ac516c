"""A synthetic suite of tiny programming tasks that a small model trained from scratch can learn
on a CPU.

Each task is a one-line Python function ``f`` over a list of ints or a string, built by composing
1-3 operations of a small grammar (:data:`OPS`: add k, multiply, negate, square, reverse, sort,
filter even/odd/positive, slice, sum, max, len, upper, count a char, ...). The tier is the number
of composed operations. What the generator guarantees:

* the same ``seed`` gives the same tasks, prompts, examples and splits, on any machine;
* every task is a distinct *function*: programs are deduplicated by their outputs on fixed probe
  inputs (so "sort then sort" never appears next to "sort"), identity and constant functions are
  dropped, and a program's tier is the fewest operations that express it;
* two kinds of held-out split (:class:`SuiteConfig.split`), both per tier:

  - ``"instances"`` (the default): held-out tasks are *fresh instances* -- new visible examples
    and hidden-test draws -- of a sample of the suite's functions; training sees every function,
    but never these draws. It measures how well the policy reads examples and picks the function
    among the ones it knows (what a tiny model trained for minutes can learn, and what RL
    sharpens);
  - ``"functions"``: held-out tasks are *unseen functions* (train and held-out are disjoint sets
    of functions). It measures compositional generalization, which tiny models trained for
    minutes barely show (about 1% success); report it as such.

  Since the hidden tests include the probe inputs, no reference of one task passes all hidden
  tests of another;
* every operation is total (``max``/``min`` of an empty list are 0, ``first`` is ``sum(xs[:1])``),
  so a task's inputs are unconstrained and two programs with equal outputs on the probes are the
  same function there; the visible examples (in the prompt) and the hidden tests are distinct
  inputs;
* the reference answer is a short fenced ``def f(...)`` whose outputs equal the expected values
  (checked in the sandbox by the tests); prompts and answers stay around 100 tokens.

Expected values come from Python callables that mirror each operation's code template; no text is
ever evaluated in the parent.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hetrl.envs.coding import FunctionCase, FunctionTask

# Precedence of an expression: ADD (a + b) < MUL (a * b) < UNARY (-a) < ATOM (names, calls, ...).
ADD, MUL, UNARY, ATOM = range(4)


@dataclass(frozen=True)
class Op:
    """One operation: ``template`` with ``{e}`` for the operand, which must bind at least as tight
    as ``needs`` (else it is parenthesized); the result binds as ``binds``; ``fn`` computes it."""

    name: str
    src: str  # input type: "L" list of ints, "S" string, "I" int
    dst: str
    template: str
    needs: int
    binds: int
    fn: Callable[[Any], Any]

    def code(self, operand: str, operand_binds: int) -> str:
        return self.template.format(e=operand if operand_binds >= self.needs else f"({operand})")


def _ops() -> tuple[Op, ...]:
    ops = [
        *(Op(f"add{k}", "L", "L", f"[x + {k} for x in {{e}}]", ADD, ATOM,
             lambda xs, k=k: [x + k for x in xs]) for k in (1, 2, 3)),
        *(Op(f"mul{k}", "L", "L", f"[x * {k} for x in {{e}}]", ADD, ATOM,
             lambda xs, k=k: [x * k for x in xs]) for k in (2, 3)),
        Op("neg", "L", "L", "[-x for x in {e}]", ADD, ATOM, lambda xs: [-x for x in xs]),
        Op("square", "L", "L", "[x * x for x in {e}]", ADD, ATOM, lambda xs: [x * x for x in xs]),
        Op("abs", "L", "L", "[abs(x) for x in {e}]", ADD, ATOM, lambda xs: [abs(x) for x in xs]),
        Op("reverse", "L", "L", "{e}[::-1]", ATOM, ATOM, lambda xs: xs[::-1]),
        Op("sort", "L", "L", "sorted({e})", ADD, ATOM, sorted),
        Op("sortdesc", "L", "L", "sorted({e}, reverse=True)", ADD, ATOM, lambda xs: sorted(xs, reverse=True)),
        Op("even", "L", "L", "[x for x in {e} if x % 2 == 0]", ADD, ATOM, lambda xs: [x for x in xs if x % 2 == 0]),
        Op("odd", "L", "L", "[x for x in {e} if x % 2 == 1]", ADD, ATOM, lambda xs: [x for x in xs if x % 2 == 1]),
        Op("pos", "L", "L", "[x for x in {e} if x > 0]", ADD, ATOM, lambda xs: [x for x in xs if x > 0]),
        Op("take2", "L", "L", "{e}[:2]", ATOM, ATOM, lambda xs: xs[:2]),
        Op("drop1", "L", "L", "{e}[1:]", ATOM, ATOM, lambda xs: xs[1:]),
        Op("unique", "L", "L", "sorted(set({e}))", ADD, ATOM, lambda xs: sorted(set(xs))),
        Op("sum", "L", "I", "sum({e})", ADD, ATOM, sum),
        Op("len", "L", "I", "len({e})", ADD, ATOM, len),
        Op("max", "L", "I", "max({e}, default=0)", ADD, ATOM, lambda xs: max(xs, default=0)),
        Op("min", "L", "I", "min({e}, default=0)", ADD, ATOM, lambda xs: min(xs, default=0)),
        Op("first", "L", "I", "sum({e}[:1])", ATOM, ATOM, lambda xs: sum(xs[:1])),
        *(Op(f"iadd{k}", "I", "I", f"{{e}} + {k}", ADD, ADD, lambda n, k=k: n + k) for k in (1, 2, 3)),
        *(Op(f"imul{k}", "I", "I", f"{{e}} * {k}", MUL, MUL, lambda n, k=k: n * k) for k in (2, 3)),
        Op("ineg", "I", "I", "-{e}", UNARY, UNARY, lambda n: -n),
        Op("iabs", "I", "I", "abs({e})", ADD, ATOM, abs),
        Op("mod10", "I", "I", "{e} % 10", MUL, MUL, lambda n: n % 10),
        Op("upper", "S", "S", "{e}.upper()", ATOM, ATOM, str.upper),
        Op("sreverse", "S", "S", "{e}[::-1]", ATOM, ATOM, lambda s: s[::-1]),
        Op("ssort", "S", "S", "''.join(sorted({e}))", ADD, ATOM, lambda s: "".join(sorted(s))),
        Op("nospace", "S", "S", "{e}.replace(' ', '')", ATOM, ATOM, lambda s: s.replace(" ", "")),
        Op("noa", "S", "S", "{e}.replace('a', '')", ATOM, ATOM, lambda s: s.replace("a", "")),
        Op("strip", "S", "S", "{e}.strip()", ATOM, ATOM, str.strip),
        Op("stake3", "S", "S", "{e}[:3]", ATOM, ATOM, lambda s: s[:3]),
        Op("title", "S", "S", "{e}.title()", ATOM, ATOM, str.title),
        Op("slen", "S", "I", "len({e})", ADD, ATOM, len),
        Op("counta", "S", "I", "{e}.count('a')", ATOM, ATOM, lambda s: s.count("a")),
        Op("countsp", "S", "I", "{e}.count(' ')", ATOM, ATOM, lambda s: s.count(" ")),
    ]
    return tuple(ops)


OPS: tuple[Op, ...] = _ops()
PARAM = {"L": "xs", "S": "s"}
_ALPHABET = "abcde "


@dataclass(frozen=True)
class Program:
    """A composition of operations applied left to right to the input."""

    ops: tuple[Op, ...]

    @property
    def src(self) -> str:
        return self.ops[0].src

    @property
    def key(self) -> str:
        return "-".join(op.name for op in self.ops)

    def __call__(self, value: Any) -> Any:
        for op in self.ops:
            value = op.fn(value)
        return value

    def source(self) -> str:
        expr, binds = PARAM[self.src], ATOM
        for op in self.ops:
            expr, binds = op.code(expr, binds), op.binds
        return f"def f({PARAM[self.src]}):\n    return {expr}\n"


def _sample_input(rng: np.random.Generator, src: str, min_len: int) -> Any:
    if src == "L":
        return [int(v) for v in rng.integers(-5, 10, size=int(rng.integers(min_len, 6)))]
    return "".join(rng.choice(list(_ALPHABET), size=int(rng.integers(min_len, 9))))


def _probes() -> dict[str, list[Any]]:
    """Fixed inputs that tell the functions apart: hand-picked edge cases plus random draws."""
    rng = np.random.default_rng(12345)
    lists = [[], [0], [3], [-2], [1, 2], [2, 1], [-3, 4, 0], [5, 5, 2, -1], [7, -6, 3, 8, 1], [4, 4, 4],
             [9, 0, -5, 2, 6, 1], [1, 3, 5, 7]]
    strings = ["", "a", "b", " a", "abc", "cab ", " de a", "aaab", "e d c b a", "bead ace", "ad  be", "cc"]
    out = {}
    for src, fixed in (("L", lists), ("S", strings)):
        values = fixed + [_sample_input(rng, src, 0) for _ in range(12)]
        out[src] = list({json.dumps(v): v for v in values}.values())  # distinct, in order
    return out


#: Inputs every task's hidden tests include (unless shown as a visible example).
PROBES = _probes()


def _fingerprint(program: Program) -> str:
    return json.dumps([program(value) for value in PROBES[program.src]])


@functools.lru_cache(maxsize=None)
def programs_by_tier(max_tier: int = 3) -> dict[int, tuple[Program, ...]]:
    """Every distinct function of each tier (deterministic order). A program is kept at the first
    tier where its behaviour appears; identity and constant functions are dropped. Every
    operation is total, so equal outputs on the probes mean the same function on them."""
    seen = {(src, json.dumps(PROBES[src])) for src in PARAM}  # the identities
    out: dict[int, tuple[Program, ...]] = {}
    for tier in range(1, max_tier + 1):
        kept = []
        for ops in itertools.product(OPS, repeat=tier):
            if ops[0].src not in PARAM or any(a.dst != b.src for a, b in zip(ops, ops[1:])):
                continue
            program = Program(ops)
            fp = (program.src, _fingerprint(program))
            if fp in seen or len({json.dumps(v) for v in json.loads(fp[1])}) == 1:
                continue
            seen.add(fp)
            kept.append(program)
        out[tier] = tuple(kept)
    return out


def make_task(program: Program, seed: int, n_visible: int = 3, n_hidden: int = 8) -> FunctionTask:
    """One task for ``program``: distinct inputs drawn from a generator seeded by (seed,
    program); visible examples are non-trivial (length >= 2 and, where the function allows,
    distinct outputs). The hidden tests are ``n_hidden`` random inputs plus every probe input not
    shown, so no other function of the suite passes all of them."""
    digest = hashlib.sha256(f"{seed}:{program.key}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    visible: list[FunctionCase] = []
    hidden: list[FunctionCase] = []
    used: set[str] = set()
    for attempt in range(1000):
        if len(hidden) == n_hidden:
            break
        want_visible = len(visible) < n_visible
        value = _sample_input(rng, program.src, 2 if want_visible else 0)
        key = json.dumps(value)
        if key in used:
            continue
        expected = program(value)
        if want_visible and attempt < 100 and any(json.dumps(c.expected) == json.dumps(expected) for c in visible):
            continue
        used.add(key)
        (visible if want_visible else hidden).append(FunctionCase(args=(value,), expected=expected))
    if len(hidden) < n_hidden:
        raise ValueError(f"cannot find {n_visible + n_hidden} distinct inputs for {program.key}")
    hidden += [FunctionCase(args=(value,), expected=program(value))
               for value in PROBES[program.src] if json.dumps(value) not in used]
    examples = "\n".join(f"f({c.args[0]!r}) == {c.expected!r}" for c in visible)
    return FunctionTask(
        task_id=f"syn-t{len(program.ops)}-{program.key}", family="synthetic",
        prompt=f"Write a Python function f.\n{examples}", entry_point="f",
        visible=tuple(visible), hidden=tuple(hidden),
        reference=f"```python\n{program.source()}```", tier=len(program.ops),
    )


class SuiteConfig(BaseModel):
    """Everything that determines a suite: ``seed`` (which functions are held out and the example
    draws), ``tiers``, ``max_per_tier`` distinct functions per tier (None: all),
    ``heldout_fraction`` of them held out, the ``split`` kind (module docstring) and
    ``n_visible`` examples in a prompt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = Field(0, ge=0)
    tiers: tuple[int, ...] = (1, 2)
    heldout_fraction: float = Field(0.3, gt=0, lt=1)
    max_per_tier: int | None = Field(200, ge=1)
    split: Literal["instances", "functions"] = "instances"
    n_visible: int = Field(3, ge=1, le=8)
    n_hidden: int = Field(8, ge=1)


def train_draw(seed: int, epoch: int) -> int:
    """The example-draw seed of pass ``epoch`` (0, 1, ...) over the train functions of suite
    ``seed``: ``seed·10⁶ + 1 + epoch``. A warm start with ``variants = n`` trains on passes
    ``0 .. n-1``; an RL run draws pass ``e`` on its ``e``-th pass, so it never sees one instance
    of a function again and again."""
    return seed * 1_000_000 + 1 + epoch


def heldout_draw(seed: int) -> int:
    """The example-draw seed of held-out instances of suite ``seed``: negative, so it never equals
    a train draw (:func:`train_draw` is positive)."""
    return -(seed + 1)


def split_programs(seed: int = 0, tiers: tuple[int, ...] = (1, 2, 3), heldout_fraction: float = 0.2,
                   max_per_tier: int | None = 400) -> tuple[tuple[Program, ...], tuple[Program, ...]]:
    """``(rest, heldout)`` programs for ``seed``: per tier, the distinct functions are shuffled by
    ``seed``, at most ``max_per_tier`` kept, and the first ``heldout_fraction`` of them (at least
    one) held out. The two sets are disjoint functions."""
    if not 0 < heldout_fraction < 1:
        raise ValueError("heldout_fraction must be in (0, 1)")
    by_tier = programs_by_tier(max(tiers))
    rest: list[Program] = []
    heldout: list[Program] = []
    for tier in sorted(tiers):
        programs = list(by_tier[tier])
        order = np.random.default_rng([seed, tier]).permutation(len(programs))
        chosen = [programs[i] for i in order[: max_per_tier or len(programs)]]
        n_held = max(1, int(round(heldout_fraction * len(chosen))))
        heldout += chosen[:n_held]
        rest += chosen[n_held:]
    return tuple(rest), tuple(heldout)


def suite_programs(config: SuiteConfig) -> tuple[tuple[Program, ...], tuple[Program, ...]]:
    """``(train, heldout)`` programs of ``config``: with ``split="functions"`` disjoint (those of
    :func:`split_programs`); with ``"instances"`` training has every function, the held-out ones
    included (their held-out draws stay unseen)."""
    rest, heldout = split_programs(config.seed, config.tiers, config.heldout_fraction, config.max_per_tier)
    return (rest if config.split == "functions" else rest + heldout), heldout


def suite_task(program: Program, config: SuiteConfig, draw: int) -> FunctionTask:
    """The task of ``program`` with example draw ``draw`` in ``config``'s format."""
    return make_task(program, draw, config.n_visible, config.n_hidden)


def _task_order(program: Program) -> tuple[int, str]:
    return len(program.ops), f"syn-t{len(program.ops)}-{program.key}"


@dataclass(frozen=True)
class SyntheticSuite:
    """Train and held-out tasks of ``config``, each sorted by tier then id; ``programs`` are the
    train functions in the order of ``train``."""

    config: SuiteConfig
    programs: tuple[Program, ...]
    train: tuple[FunctionTask, ...]
    heldout: tuple[FunctionTask, ...]

    def tier(self, tier: int, split: str = "train") -> tuple[FunctionTask, ...]:
        return tuple(t for t in getattr(self, split) if t.tier == tier)

    def train_pass(self, epoch: int) -> tuple[FunctionTask, ...]:
        """The train tasks of pass ``epoch``: ``train`` for 0, else the same functions with the
        examples and hidden tests of :func:`train_draw` ``(seed, epoch)``, ids suffixed
        ``@<epoch>``."""
        if epoch == 0:
            return self.train
        draw = train_draw(self.config.seed, epoch)
        return tuple(suite_task(p, self.config, draw).model_copy(update={"task_id": f"{t.task_id}@{epoch}"})
                     for p, t in zip(self.programs, self.train))


@functools.lru_cache(maxsize=8)
def synthetic_suite(config: SuiteConfig = SuiteConfig()) -> SyntheticSuite:
    """The suite of ``config``: one train task per train program (draw :func:`train_draw`
    ``(seed, 0)``) and one held-out task per held-out program (draw ``train_draw(seed, 0)`` for
    ``split="functions"``, :func:`heldout_draw` for ``"instances"``)."""
    train, heldout = (tuple(sorted(ps, key=_task_order)) for ps in suite_programs(config))
    held_draw = train_draw(config.seed, 0) if config.split == "functions" else heldout_draw(config.seed)
    return SyntheticSuite(config=config, programs=train,
                          train=tuple(suite_task(p, config, train_draw(config.seed, 0)) for p in train),
                          heldout=tuple(suite_task(p, config, held_draw) for p in heldout))
