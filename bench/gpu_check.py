"""GPU check: JAX and Megatron steps on CUDA (tokens/s, MFU), log-prob parity, HF round trip, embedded sampler.

The Python half of the GPU check kit ``bench/gpu_check.sh`` (which installs the wheels a GPU
machine lacks and runs this script under a log; see its header for the one command a GPU session
runs). Five stages, each recorded in ``gpu_check.json`` with ``ok`` and, on failure, the error and
its traceback; a failed stage does not stop the next ones, and the exit code is 1 if any failed:

1. ``devices``: versions, torch's CUDA device, JAX's backend and devices. Without ``--quick`` a
   missing GPU (torch without CUDA, or JAX not on ``gpu``) fails here and nothing else runs.
2. ``steps``: a JaxTrainer and a MegatronTrainer in bf16 (``trainer_step.build_trainers``: BF16
   matmuls over FP32 master weights; ``Float16Module``) on one random checkpoint of
   ``trainer_step``'s model (21.0M parameters; ``--quick``: its 0.1M one). On a GPU it first checks
   that the trainers run there with no CPU shim: ``apply_cpu_shim_if_needed()`` returns False
   (the shim does nothing when CUDA is present), the Megatron parameters are on ``cuda`` and
   JAX's default backend is ``gpu``. Then steps and ``n x n`` bf16 matmuls of JAX and torch are
   timed interleaved (``trainer_step.time_interleaved``): tokens/s = B·S / median step time,
   MFU = model FLOPs of the step (``trainer_step.step_flops``, the PaLM convention) / median step
   time / peak, with peak = the better library's median matmul rate in the same run.
3. ``hf_round_trip``: on :func:`hetrl.parity.build_parity_checkpoint`'s tiny Qwen3, FP32
   trainers under ``jax.default_matmul_precision("highest")`` (no TF32): each trainer's
   ``export_hf_weights()`` right after ``from_hf`` equals the checkpoint bit for bit; then the
   Megatron trainer takes one step, its export is saved as an HF checkpoint, a JaxTrainer loads
   it and their log-probs on a :func:`hetrl.parity.random_batch` agree within
   :data:`hetrl.parity.FP32_LOGPROB_ATOL` (1e-5, the parity bound for FP32 backends).
4. ``sampler``: the embedded sampler with the ``h200`` profile (bf16 weights and KV cache) on the
   step's checkpoint, on JAX's default device: B prompts of P random tokens, exactly N new tokens
   each (top_k 50, top_p 0.95); after a compiling call, tokens/s = B·N / median wall time; every
   recorded log-prob must be finite and ≤ 0 (GPU: B=32, P=64, N=128, 3 repeats; quick: 2, 8, 8, 1).
5. ``parity``: ``hetrl parity --json`` in a child process (every backend present, with its stated
   tolerances), with ``JAX_DEFAULT_MATMUL_PRECISION=highest`` and ``NVIDIA_TF32_OVERRIDE=0`` so FP32
   means FP32 on the GPU, as on the CPU where the tolerances were set.

    bench/gpu_check.sh --out DIR [--wheels DIR]           # the kit, on a GPU machine
    .venv/bin/python bench/gpu_check.py [--out DIR] [--repeats N] [--quick]

Writes ``gpu_check.json`` (stages, figures, load averages), ``parity.json`` and ``gpu_check.png``
(tokens/s and MFU per trainer) to ``--out``. ``--quick`` (the kit's ``--cpu-smoke``): the smallest
sizes, on whatever devices there are (a CPU here), every stage and code path the same.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# JAX takes 75% of a GPU's memory at its first use unless told otherwise; torch (the Megatron
# trainer) and the parity child process share the GPU with it here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from hetrl.bench_command import output_dir, script_parser  # noqa: E402
from hetrl.models import ModelConfig, load_state_dict, save_state_dict  # noqa: E402
from hetrl.models.tiny import build_tiny_checkpoint  # noqa: E402
from hetrl.parity import FP32_LOGPROB_ATOL, build_parity_checkpoint, random_batch  # noqa: E402


def _load_trainer_step():
    """bench/trainer_step.py as a module (bench/ is not a package): its model, sizes, FLOP count,
    trainer builders and interleaved timing are this check's too."""
    path = pathlib.Path(__file__).resolve().parent / "trainer_step.py"
    spec = importlib.util.spec_from_file_location("hetrl_bench_trainer_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


trainer_step = _load_trainer_step()

GPU_STEP = dataclasses.replace(trainer_step.FULL, rows=64, peak_n=8192)
"""trainer_step's 21.0M-parameter model, 64 rows x 256 positions (16k tokens a step), an 8192³
matmul peak (an H200 reaches its bf16 rate there; 2048 would understate it)."""
QUICK_STEP = trainer_step.QUICK


@dataclasses.dataclass(frozen=True)
class SamplerSize:
    """The sampler stage's work: ``rows`` prompts of ``prompt_len`` tokens, ``new_tokens`` each."""

    rows: int
    prompt_len: int
    new_tokens: int
    repeats: int


GPU_SAMPLER, QUICK_SAMPLER = SamplerSize(32, 64, 128, 3), SamplerSize(2, 8, 8, 1)
PARITY_TIMEOUT_S = 300
FP32_ENV = dict(JAX_DEFAULT_MATMUL_PRECISION="highest", NVIDIA_TF32_OVERRIDE="0")


class GpuMissing(RuntimeError):
    """Raised by the devices stage when a full (non ``--quick``) run finds no GPU."""


# ====================================================================== stages
def devices(require_gpu: bool) -> dict:
    import jax
    import torch

    out = dict(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
               cuda_available=torch.cuda.is_available(), jax=jax.__version__, jax_backend=jax.default_backend(),
               jax_devices=[str(d) for d in jax.devices()])
    for name in ("megatron.core", "flax", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError as e:
            out[name] = f"absent ({e})"
    if torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name(0)
    if require_gpu and not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        raise GpuMissing(f"no GPU for the check: torch CUDA available = {torch.cuda.is_available()}, JAX backend = "
                         f"{jax.default_backend()!r}; run with --quick (the kit's --cpu-smoke) on a machine without one")
    return out


def steps(checkpoint: pathlib.Path, size, repeats: int, on_gpu: bool, progress) -> dict:
    import jax
    import torch

    from hetrl.trainer_megatron.cpu_shim import apply_cpu_shim_if_needed

    batch = random_batch(size.model, seed=0, rows=size.rows, prompt_lengths=(size.prompt_len, size.prompt_len),
                         response_lengths=(size.response_len, size.response_len))
    positions = int(batch.input_ids.shape[1])
    tokens, flops = size.rows * positions, trainer_step.step_flops(size.model, size.rows, positions)
    trainers = trainer_step.build_trainers(checkpoint, "bf16")
    placement = dict(cpu_shim_active=apply_cpu_shim_if_needed(), jax_backend=jax.default_backend(),
                     megatron_device=str(trainers["megatron"].device))
    if on_gpu and (placement["cpu_shim_active"] or trainers["megatron"].device.type != "cuda"
                   or placement["jax_backend"] != "gpu"):
        raise RuntimeError(f"the trainers do not run on the GPU without the CPU shim: {placement}")
    torch_device = "cuda" if on_gpu else "cpu"
    fns = trainer_step.step_fns(trainers, batch) | trainer_step.matmul_fns("bf16", size.peak_n, torch_device)
    task = progress.add_task("steps: warm-up, then interleaved steps and matmuls", total=repeats)
    times = trainer_step.time_interleaved(fns, repeats, progress, task)
    n = size.peak_n
    peaks = {lib: 2.0 * n**3 / statistics.median(times[f"{lib} matmul"]) for lib in ("jax", "torch")}
    peak = max(peaks.values())
    rows = [dict(trainer=name, dtype="bf16", step_s=statistics.median(times[name]), best_s=min(times[name]),
                 tokens_per_s=tokens / statistics.median(times[name]),
                 achieved_flops=flops / statistics.median(times[name]), mfu=flops / statistics.median(times[name]) / peak,
                 mfu_best=flops / min(times[name]) / max(2.0 * n**3 / min(times[f"{lib} matmul"]) for lib in peaks))
            for name in ("jax", "megatron")]
    return dict(placement, rows=size.rows, positions=positions, tokens=tokens, parameters=size.model.parameter_count(),
                step_flops=flops, peak_matmul_n=n, peak_bf16_flops=dict(peaks, machine=peak), trainers=rows,
                step_times_s=times)


def hf_round_trip(work: pathlib.Path) -> dict:
    import jax

    from hetrl.trainer_jax import JaxTrainer

    checkpoint = build_parity_checkpoint(work / "round-trip")
    config = ModelConfig.load(checkpoint)
    original = load_state_dict(checkpoint)
    with jax.default_matmul_precision("highest"):
        trainers = trainer_step.build_trainers(checkpoint, "fp32")
        export_diff = {name: max(float(np.abs(w[k].astype(np.float64) - original[k]).max()) for k in original)
                       for name, w in ((n, t.export_hf_weights()) for n, t in trainers.items())}
        megatron = trainers["megatron"]
        batch = random_batch(config, seed=1)
        # on-policy (log q = the trainer's log p), so MIS keeps every row and the step moves the weights
        batch = dataclasses.replace(batch, sampler_logprobs=np.where(
            batch.loss_mask, megatron.logprobs(batch), 0.0).astype(np.float32))
        megatron.train_step(batch)
        stepped = megatron.export_hf_weights()
        moved = max(float(np.abs(stepped[k].astype(np.float64) - original[k]).max()) for k in original)
        saved = work / "round-trip-stepped"
        config.save(saved)
        save_state_dict(saved, stepped)
        reloaded = JaxTrainer.from_hf(saved, trainers["jax"].config)
        diff = np.abs(reloaded.logprobs(batch).astype(np.float64) - megatron.logprobs(batch))[batch.loss_mask]
    if any(export_diff.values()):
        raise RuntimeError(f"export_hf_weights() right after from_hf differs from the checkpoint: {export_diff}")
    if not moved:
        raise RuntimeError("the Megatron step left every weight unchanged: the round trip would compare nothing new")
    if not diff.max() <= FP32_LOGPROB_ATOL:
        raise RuntimeError(f"log-probs of the JaxTrainer loaded from the stepped Megatron export differ by up to "
                           f"{diff.max():.2e} > {FP32_LOGPROB_ATOL:.0e}")
    return dict(export_max_abs_diff=export_diff, step_max_abs_change=moved, logprob_max_abs_diff=float(diff.max()),
                logprob_mean_abs_diff=float(diff.mean()), tokens=int(diff.size), tolerance=FP32_LOGPROB_ATOL)


def sampler(checkpoint: pathlib.Path, size: SamplerSize) -> dict:
    import jax

    from hetrl.core.schema import SamplingParams
    from hetrl.samplers.base import GenerationRequest
    from hetrl.samplers.embedded import EmbeddedSampler
    from hetrl.samplers.profiles import sampler_numerics

    config = ModelConfig.load(checkpoint)
    engine = EmbeddedSampler.from_checkpoint(checkpoint, sampler_numerics("h200"), pool="gpu-check", seed=0,
                                             max_batch=size.rows)
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)
    requests = [GenerationRequest(f"r{i}", rng.integers(3, config.vocab_size, size.prompt_len).astype(np.int32),
                                  sampling, size.new_tokens) for i in range(size.rows)]
    start = time.perf_counter()
    engine.generate(requests)
    compile_s = time.perf_counter() - start
    times, generated = [], []
    for _ in range(size.repeats):
        start = time.perf_counter()
        generated = engine.generate(requests)
        times.append(time.perf_counter() - start)
    new_tokens = sum(len(g.token_ids) for g in generated)
    logprobs = np.concatenate([g.logprobs for g in generated])
    if new_tokens != size.rows * size.new_tokens or not (np.isfinite(logprobs).all() and (logprobs <= 0).all()):
        raise RuntimeError(f"the sampler returned {new_tokens} tokens (expected {size.rows * size.new_tokens}) or "
                           f"log-probs outside (-inf, 0]: min {logprobs.min()}, max {logprobs.max()}")
    return dict(profile="h200", info=engine.info.model_dump(), jax_backend=jax.default_backend(),
                rows=size.rows, prompt_len=size.prompt_len, new_tokens=size.new_tokens, first_call_s=compile_s,
                call_s=times, tokens_per_s=new_tokens / statistics.median(times), mean_logprob=float(logprobs.mean()))


def parity(out: pathlib.Path) -> dict:
    path = out / "parity.json"
    # the child finds its own torch.distributed port: this process's Megatron trainers took one
    # and left it in os.environ (MASTER_ADDR / MASTER_PORT), which the child would inherit
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")} | FP32_ENV
    proc = subprocess.run([sys.executable, "-m", "hetrl.cli", "parity", "--json", str(path)], capture_output=True,
                          text=True, timeout=PARITY_TIMEOUT_S, env=env)
    if not path.is_file():
        raise RuntimeError(f"hetrl parity exited {proc.returncode} without writing {path}:\n{proc.stderr[-3000:]}")
    report = json.loads(path.read_text())
    if proc.returncode != 0:
        failed = [r for r in report["rows"] if r["status"] == "FAIL"]
        raise RuntimeError(f"hetrl parity exited {proc.returncode}; failed rows: {failed}")
    return dict(env=FP32_ENV, backends=report["backends"],
                rows=[{k: r[k] for k in ("check", "backends", "value", "tolerance", "status")} for r in report["rows"]])


# ====================================================================== driver
def run_stage(name: str, fn, results: dict, console: Console) -> bool:
    """Run ``fn()`` and record ``{"ok": True, **its dict}`` or ``{"ok": False, "error", "traceback"}``
    under ``results[name]``, with its wall time; returns ``ok``."""
    console.print(f"[bold]stage {name}[/]")
    start = time.perf_counter()
    try:
        record = dict(ok=True, **fn())
    except Exception as e:  # noqa: BLE001 - recorded, and the run goes on to the next stage
        record = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        console.print(f"[bold red]stage {name} failed[/]: {record['error']}")
    record["wall_s"] = time.perf_counter() - start
    results[name] = record
    return record["ok"]


def summary_lines(results: dict) -> list[str]:
    lines = [f"{name}: {'ok' if r['ok'] else 'FAILED: ' + r['error'].splitlines()[0]} ({r['wall_s']:.1f} s)"
             for name, r in results.items()]
    step = results.get("steps", {})
    for row in step.get("trainers", []):
        lines.append(f"  {row['trainer']} bf16 step: {row['step_s'] * 1e3:.1f} ms, {row['tokens_per_s']:.0f} tokens/s, "
                     f"MFU {100 * row['mfu']:.2f}% of {step['peak_bf16_flops']['machine'] / 1e12:.3g} TFLOP/s")
    if "tokens_per_s" in results.get("sampler", {}):
        lines.append(f"  embedded sampler (h200 profile): {results['sampler']['tokens_per_s']:.0f} tokens/s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds of the step stage (default 10, --quick 2)")
    args = parser.parse_args(argv)
    out = output_dir(args, __file__)
    step_size, sampler_size = (QUICK_STEP, QUICK_SAMPLER) if args.quick else (GPU_STEP, GPU_SAMPLER)
    repeats = args.repeats or (2 if args.quick else 10)
    console = Console(width=None if sys.stdout.isatty() else 160)
    results: dict = {}
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                machine=platform.machine(), cores=os.cpu_count(), quick=args.quick, repeats=repeats,
                load_average_1_5_15min=dict(before=os.getloadavg()))

    def stage(name, fn) -> bool:
        """Runs one stage and rewrites gpu_check.json, so a run cut short keeps the stages it finished."""
        passed = run_stage(name, fn, results, console)
        meta["load_average_1_5_15min"]["after"] = os.getloadavg()
        (out / "gpu_check.json").write_text(json.dumps(dict(meta=meta, ok=all(r["ok"] for r in results.values()),
                                                            stages=results), indent=1, default=str))
        return passed

    with tempfile.TemporaryDirectory(prefix="hetrl-gpu-check-") as tmp, Progress(console=console) as progress:
        work = pathlib.Path(tmp)
        if stage("devices", lambda: devices(require_gpu=not args.quick)):
            on_gpu = results["devices"]["cuda_available"] and results["devices"]["jax_backend"] == "gpu"
            checkpoint = build_tiny_checkpoint(work / "step", step_size.model, seed=0, init_std=0.02)
            stage("steps", lambda: steps(checkpoint, step_size, repeats, on_gpu, progress))
            stage("hf_round_trip", lambda: hf_round_trip(work))
            stage("sampler", lambda: sampler(checkpoint, sampler_size))
            stage("parity", lambda: parity(out))
    ok = all(r["ok"] for r in results.values())
    step = results.get("steps", {})
    if step.get("ok"):
        trainer_step.plot(step["trainers"], {"bf16": step["peak_bf16_flops"]}, step_size, step["positions"],
                          out / "gpu_check.png")
    for line in summary_lines(results):
        console.print(line)
    console.print(f"gpu check {'passed' if ok else 'FAILED'}; wrote {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
