"""Import hygiene and the no-pickle / no-eval rule, checked on the source tree (nothing that
crosses a process or machine boundary may be deserialized by executing code)."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "hetrl"


def test_core_imports_no_framework():
    code = "import hetrl.core, sys; print(sorted(m for m in ('jax', 'torch', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_source_has_no_framework_import():
    pattern = re.compile(r"^\s*(import|from)\s+(jax|torch|flax|optax|megatron)\b", re.M)
    offenders = [p.name for p in (SRC / "core").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _is_true(call: ast.Call, keyword: str) -> bool:
    return any(k.arg == keyword and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def unsafe_constructs(source: str) -> list[str]:
    """What in ``source`` can execute code hidden in data: pickle-family imports and calls,
    ``eval``/``exec``/``compile``, ``np.load(allow_pickle=True)`` (any ``allow_pickle=True``),
    ``torch.load`` without ``weights_only=True``, ``yaml.load`` without a safe loader,
    ``yaml.unsafe_load``/``full_load``. One ``line: what`` per finding."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        root = name.split(".")[0]
        what = None
        if name in ("eval", "exec", "compile", "builtins.eval", "builtins.exec", "builtins.compile"):
            what = f"{name}()"
        elif root in UNSAFE_MODULES:
            what = f"{name}()"
        elif _is_true(node, "allow_pickle"):
            what = f"{name}(allow_pickle=True)"
        elif name == "torch.load" and not _is_true(node, "weights_only"):
            what = "torch.load() without weights_only=True"
        elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.full_load_all", "yaml.unsafe_load_all"):
            what = f"{name}()"
        elif name in ("yaml.load", "yaml.load_all"):
            loader = [k.value for k in node.keywords if k.arg == "Loader"] + node.args[1:2]
            if not loader or _dotted(loader[0]).split(".")[-1] not in SAFE_YAML_LOADERS:
                what = f"{name}() without a safe Loader"
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


@pytest.mark.parametrize("snippet", [
    "import pickle", "from cloudpickle import dumps", "import dill as d", "import marshal",
    "eval(text)", "exec(code)", "compile(src, 'f', 'exec')", "builtins.eval(text)",
    "pickle.loads(data)", "np.load(path, allow_pickle=True)", "numpy.load(f, allow_pickle=True)",
    "torch.load(path)", "torch.load(path, weights_only=False)", "yaml.load(text)",
    "yaml.load(text, Loader=yaml.Loader)", "yaml.load(text, yaml.FullLoader)", "yaml.unsafe_load(text)",
    "yaml.full_load(text)",
])
def test_the_scanner_catches_every_unsafe_construct(snippet):
    assert unsafe_constructs(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "model.eval()", "re.compile(r'x')", "np.load(path)", "torch.load(path, weights_only=True)",
    "yaml.safe_load(text)", "yaml.load(text, Loader=yaml.SafeLoader)", "json.loads(text)",
])
def test_the_scanner_leaves_safe_constructs_alone(snippet):
    assert unsafe_constructs(snippet) == [], snippet


#: Modules that execute code on purpose, and what they may use: the trusted grader runs the task
#: author's test code (HumanEval's ``check(candidate)``, from the task file the user chose), never
#: the candidate's code (that only ever runs in the sandbox) nor data from a sampler.
#: The unittest harness runs inside the sandbox, on the grader's pristine copy of the test files.
EXECUTES_TRUSTED_CODE = {"envs/trusted_check.py": {"compile()", "exec()"},
                         "envs/_harness_unittest.py": {"compile()", "exec()"}}


def test_no_pickle_eval_or_unsafe_loading_anywhere_in_the_source():
    offenders = {}
    for p in sorted(SRC.rglob("*.py")):
        allowed = EXECUTES_TRUSTED_CODE.get(str(p.relative_to(SRC)), set())
        found = [f for f in unsafe_constructs(p.read_text()) if f.split(": ", 1)[1] not in allowed]
        if found:
            offenders[str(p.relative_to(SRC))] = found
    assert offenders == {}
