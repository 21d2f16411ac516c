"""Import hygiene and the no-pickle rule, checked on the source tree."""

import pathlib
import re
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "hetrl"


def test_core_imports_no_framework():
    code = "import hetrl.core, sys; print(sorted(m for m in ('jax', 'torch', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_source_has_no_framework_import():
    pattern = re.compile(r"^\s*(import|from)\s+(jax|torch|flax|optax|megatron)\b", re.M)
    offenders = [p.name for p in (SRC / "core").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_no_pickle_anywhere():
    pattern = re.compile(
        r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|joblib)\b"
        r"|\bpickle\.loads?\(|allow_pickle\s*=\s*True|\btorch\.load\(|\bnp\.load\(|\bnumpy\.load\(",
        re.M,
    )
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
