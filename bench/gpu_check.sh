#!/usr/bin/env bash
# GPU check kit (issue 18, item 5): one prepared run, under 8 minutes on one NVIDIA GPU, of the
# JAX and Megatron trainer steps on CUDA (no CPU shim) with tokens/s and MFU against the bf16
# matmul peak measured in the same run, the HF round trip, the embedded sampler on the GPU and
# `hetrl parity`. The stages are bench/gpu_check.py's (its docstring says what each checks).
#
#   bench/gpu_check.sh --out DIR [--wheels DIR] [--python EXE] [--cpu-smoke]
#
# --out DIR      where gpu_check.json, parity.json, gpu_check.png and gpu_check.log go (created)
# --wheels DIR   wheels to install first, for a machine without network: every *.whl there is
#                installed (pip install --no-index --no-deps --target) into a fresh temporary
#                folder put first on PYTHONPATH (nothing of the machine's own is changed)
# --python EXE   the interpreter (default: python3); it must have torch and jax for its devices
# --cpu-smoke    the smallest sizes on whatever devices there are (gpu_check.py --quick): the same
#                stages and code paths, runnable on a CPU machine; tests/test_gpu_check.py runs it
#
# Without --wheels, hetrl is imported from this checkout's src/ unless the interpreter has it.
# Exit code: 0 if every stage passed, 1 if one failed, 2 on a bad argument.
#
# Preparing the wheels for the H200 machine lent by the device tool (Python 3.12, torch, JAX with
# CUDA, flax, optax, orbax, transformers already there; no network), from the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip wheel --no-deps -w .whl .
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl -c constraints.txt megatron-core pydantic \
#       pydantic_core annotated-types typing-inspection typing_extensions array-api-compat \
#       portpicker
#
# (about 10 MB: megatron-core, the project and what its trainers import that the machine lacks),
# then, in one device `run` with carry [".whl"] and timeout_s 600:
#
#   bash bench/gpu_check.sh --wheels .whl --out $OUT
set -euo pipefail

usage() { echo "usage: bench/gpu_check.sh --out DIR [--wheels DIR] [--python EXE] [--cpu-smoke]" >&2; exit 2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="" wheels="" python=python3 quick=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
    --wheels) [ $# -ge 2 ] || usage; wheels=$2; shift 2 ;;
    --python) [ $# -ge 2 ] || usage; python=$2; shift 2 ;;
    --cpu-smoke) quick=(--quick); shift ;;
    *) echo "bench/gpu_check.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$out" ] || usage
if [ -n "$wheels" ] && ! compgen -G "$wheels/*.whl" > /dev/null; then
  echo "bench/gpu_check.sh: --wheels $wheels: no *.whl there (see this script's header for how to prepare them)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee -a "$out/gpu_check.log") 2>&1

echo "== gpu_check.sh $(date -u +%FT%TZ) on $(hostname), $(nproc) cores; repo $repo"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
if [ -n "$wheels" ]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/hetrl-gpu-check-site.XXXXXX")
  echo "== installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif ! "$python" -c "import hetrl" 2> /dev/null; then
  export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$repo"
status=0
"$python" bench/gpu_check.py "${quick[@]}" --out "$out" || status=$?
echo "== gpu_check.sh done: exit $status; $out/gpu_check.json"
exit $status
