#!/usr/bin/env python3.11
"""Build (once) the virtual environment that runs a real SGLang 0.5.23 server on CPU.

    python3.11 tests/sglang_server/bootstrap.py [--venv PATH] [--python EXE] [--force]

Prints the venv's python path on stdout (the only thing written to stdout; progress and
errors go to stderr), so a caller can do ``PY=$(python3.11 tests/sglang_server/bootstrap.py)``.
Default venv: ``.venv-sglang`` at the repository root. Stdlib only.

Idempotent: the venv holds a stamp with a hash of requirements.txt, constraints.txt and the
stand-ins; when it matches, nothing runs (well under a second). When the package pins
changed, the venv is rebuilt from scratch; when only the stand-ins changed, they are
re-copied. A lock file serializes concurrent runs.

Steps of a build (all pip calls are --no-deps, so nothing unlisted is ever resolved):
  1. python3.11 -m venv PATH
  2. pip install --no-deps -c constraints.txt torch==2.13.0+cpu   (local CPU wheel only)
  3. pip install --no-deps --only-binary=:all: -c constraints.txt -r requirements.txt
  4. copy the stand-ins into site-packages: standins/sgl_kernel (pure-torch stand-in for the
     CUDA-only sgl-kernel) and standins/hetrl_sglang_startup.py + a .pth that imports it
     (registers the torchvision op schemas the CUDA torchvision wheel needs on CPU torch)
  5. smoke test: torch is the CPU build, and sglang's HTTP server module imports with
     SGLANG_USE_CPU_ENGINE=1
  6. write the stamp
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
DEFAULT_VENV = REPO_ROOT / ".venv-sglang"
REQUIREMENTS = HERE / "requirements.txt"
CONSTRAINTS = HERE / "constraints.txt"
STANDINS = HERE / "standins"

SGLANG_VERSION = "0.5.23"
TORCH_REQUIREMENT = "torch==2.13.0+cpu"
TORCH_VERSION = "2.13.0+cpu"
PYTHON_VERSION = (3, 11)
# Bump when the build steps change in a way that needs a rebuild.
BOOTSTRAP_SCHEMA = 1

STAMP_NAME = ".hetrl-sglang-stamp.json"
LOCK_NAME = ".hetrl-sglang-bootstrap.lock"
LOG_NAME = "hetrl-sglang-bootstrap.log"
PTH_NAME = "hetrl_sglang_startup.pth"

SMOKE_TEST = f"""
import sys, torch
assert torch.__version__ == {TORCH_VERSION!r} and torch.version.cuda is None, (
    f"expected the CPU build of torch {TORCH_VERSION}, got {{torch.__version__}} (cuda={{torch.version.cuda}})")
import torchvision, sgl_kernel, sglang
assert sglang.__version__ == {SGLANG_VERSION!r}, sglang.__version__
from sglang.srt.entrypoints.http_server import launch_server  # the whole server import graph
print("smoke ok: torch", torch.__version__, "torchvision", torchvision.__version__, "sglang", sglang.__version__)
"""


class BootstrapError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[sglang-bootstrap] {msg}", file=sys.stderr, flush=True)


def _hash_files(paths: list[Path], base: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(base)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def packages_hash() -> str:
    h = hashlib.sha256(f"schema={BOOTSTRAP_SCHEMA};torch={TORCH_REQUIREMENT}".encode())
    h.update(_hash_files([REQUIREMENTS, CONSTRAINTS], HERE).encode())
    return h.hexdigest()[:16]


def standin_files() -> list[Path]:
    return [p for p in STANDINS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def standins_hash() -> str:
    return _hash_files(standin_files(), HERE)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def read_stamp(venv: Path) -> dict:
    try:
        return json.loads((venv / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}


def run_logged(cmd: list[str], logf, *, env: dict | None = None, what: str) -> None:
    """Run cmd with its output appended to the log; on failure raise with the log's tail."""
    shown = " ".join(c if "\n" not in c else "<script>" for c in cmd)
    log(f"{what}: {shown}")
    logf.write(f"\n$ {' '.join(cmd)}\n")
    logf.flush()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    logf.flush()
    if proc.returncode != 0:
        tail = _tail(Path(logf.name), 40)
        raise BootstrapError(
            f"{what} failed (exit {proc.returncode}) after {time.monotonic() - t0:.0f}s.\n"
            f"Command: {shown}\nLast lines of {logf.name}:\n{tail}"
        )
    log(f"{what}: done in {time.monotonic() - t0:.0f}s")


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def site_packages(venv: Path) -> Path:
    sp = venv / "lib" / f"python{PYTHON_VERSION[0]}.{PYTHON_VERSION[1]}" / "site-packages"
    if not sp.is_dir():
        raise BootstrapError(f"site-packages not found at {sp}")
    return sp


def install_standins(venv: Path) -> None:
    sp = site_packages(venv)
    for entry in STANDINS.iterdir():
        if entry.name == "__pycache__":
            continue
        dest = sp / entry.name
        if dest.is_dir():
            shutil.rmtree(dest)
        if entry.is_dir():
            shutil.copytree(entry, dest, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(entry, dest)
    (sp / PTH_NAME).write_text("import hetrl_sglang_startup\n")
    log(f"stand-ins installed into {sp}")


def check_python(python: str) -> None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BootstrapError(f"cannot run the base interpreter {python!r}: {exc}") from exc
    want = "%d.%d" % PYTHON_VERSION
    if out != want:
        raise BootstrapError(
            f"{python} is Python {out}; the pinned wheels (sglang, torch 2.13.0+cpu) need Python {want}. "
            f"Run with python{want} or pass --python /path/to/python{want}."
        )


def _safe_to_delete(venv: Path) -> bool:
    """Only ever delete a venv (or a folder holding nothing but this script's own files)."""
    return (venv / "pyvenv.cfg").is_file() or all(c.name in (LOCK_NAME, LOG_NAME) for c in venv.iterdir())


def build(venv: Path, python: str, logf) -> None:
    if venv.exists():
        if not _safe_to_delete(venv):
            raise BootstrapError(f"{venv} exists and is not a virtual environment; refusing to delete it")
        if (venv / "pyvenv.cfg").is_file():
            log(f"removing the out-of-date venv {venv}")
        keep = {LOCK_NAME, LOG_NAME}
        for child in venv.iterdir():
            if child.name in keep:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    run_logged([python, "-m", "venv", str(venv)], logf, what="create venv")
    py = str(venv_python(venv))
    pip = [py, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--no-deps"]
    try:
        run_logged(pip + ["-c", str(CONSTRAINTS), TORCH_REQUIREMENT], logf, what="install torch (CPU wheel)")
    except BootstrapError as exc:
        raise BootstrapError(
            f"{exc}\n\nThe CPU wheel {TORCH_REQUIREMENT} must be reachable through pip's find-links "
            "(on this machine: /opt/wheels, set in pip.conf / PIP_FIND_LINKS). PyPI only has CUDA "
            "builds of torch, which this bootstrap never installs."
        ) from None
    run_logged(
        pip + ["--only-binary=:all:", "-c", str(CONSTRAINTS), "-r", str(REQUIREMENTS)],
        logf, what="install sglang and its CPU runtime",
    )
    install_standins(venv)
    smoke(venv, logf)


def smoke(venv: Path, logf) -> None:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    env.pop("PYTHONPATH", None)
    run_logged([str(venv_python(venv)), "-c", SMOKE_TEST], logf, env=env, what="smoke test")


@contextlib.contextmanager
def locked(venv: Path):
    import fcntl

    venv.mkdir(parents=True, exist_ok=True)
    with open(venv / LOCK_NAME, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_venv(venv: Path | str = DEFAULT_VENV, python: str | None = None, force: bool = False) -> Path:
    """Make sure ``venv`` is built and current; return its python. Raises BootstrapError."""
    venv = Path(venv).resolve()
    python = python or sys.executable
    want = {"packages": packages_hash(), "standins": standins_hash(), "sglang": SGLANG_VERSION}
    if not force and read_stamp(venv) == want and venv_python(venv).exists():
        return venv_python(venv)
    t0 = time.monotonic()
    with locked(venv):
        have = read_stamp(venv)  # another process may have finished while we waited
        if not force and have == want and venv_python(venv).exists():
            return venv_python(venv)
        (venv / STAMP_NAME).unlink(missing_ok=True)
        with open(venv / LOG_NAME, "a") as logf:
            logf.write(f"\n===== bootstrap {time.strftime('%Y-%m-%d %H:%M:%S')} want={want} have={have}\n")
            if (
                not force
                and have.get("packages") == want["packages"]
                and venv_python(venv).exists()
            ):
                log("package pins unchanged; re-installing the stand-ins only")
                install_standins(venv)
                smoke(venv, logf)
            else:
                check_python(python)
                build(venv, python, logf)
        (venv / STAMP_NAME).write_text(json.dumps(want, indent=1) + "\n")
    log(f"venv ready in {time.monotonic() - t0:.0f}s: {venv}")
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=str(DEFAULT_VENV), help=f"venv path (default: {DEFAULT_VENV})")
    ap.add_argument("--python", default=sys.executable, help="base interpreter, Python 3.11 (default: this one)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = ap.parse_args(argv)
    try:
        py = ensure_venv(args.venv, args.python, args.force)
    except BootstrapError as exc:
        print(f"[sglang-bootstrap] ERROR: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[sglang-bootstrap] interrupted; the venv has no stamp and will be rebuilt next time", file=sys.stderr)
        return 130
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
