"""Weight sync: seconds from ``publish`` until every replica serves the new version, per transport.

For Qwen3-like models from the tiny one to about 100M parameters (built locally from random
weights), one published float32 HF weight set reaches ``--replicas`` replicas through each
transport of :mod:`hetrl.orchestrator.transport`:

* ``in-process`` (bf16, fp8_e4m3, nvfp4 b200 pools): staged once per format, each embedded
  replica swaps its parameter arrays in place; quantizing formats report the quantization alone
  (the same ``quantize_dequantize`` calls, timed apart) beside the total;
* ``shared-disk``: the checksummed export once, then each replica reads the safetensors back and
  loads them in place (what a server's ``/update_weights_from_disk`` does, minus the server);
* ``ray-object-store`` (not with ``--quick``): ``ray.put`` once, each replica actor (a private
  local Ray instance) fetches it by reference and loads it in place.

The clock stops when every replica reports the new version (``health().weight_version``).
Beside each figure, this machine's floor for the same bytes measured in the same run: a numpy
copy of the published arrays (memcpy) and writing them to a file in the same directory and
reading them back (page cache, no fsync, like the export), each measured just before every
publication; ``x floor`` is the median of the per-publication ratios (load on the machine shifts
both alike). Medians of ``--repeats`` publications after one warm-up (jit compilation).

    .venv/bin/python bench/weight_sync.py [--sizes tiny,10M,30M,100M] [--replicas 2] [--repeats 3]
        [--out bench/results] [--quick]

Writes ``weight_sync.json`` and ``weight_sync.png`` to ``--out``. ``--quick``: the tiny model,
1 repeat, no Ray.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from hetrl.bench_command import output_dir, script_parser
from hetrl.core.precision import quantize_dequantize
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import read_safetensors
from hetrl.models.tiny import TINY_QWEN3, random_state_dict
from hetrl.orchestrator.transport import InProcessTransport, RayObjectStoreTransport, SharedDiskTransport
from hetrl.samplers.embedded import QUANTIZED_WEIGHT, EmbeddedSampler
from hetrl.samplers.profiles import sampler_numerics
from hetrl.samplers.weight_set import WeightSet

SIZES: dict[str, ModelConfig] = {
    "tiny": TINY_QWEN3,
    "10M": TINY_QWEN3.model_copy(update=dict(vocab_size=16384, hidden_size=256, intermediate_size=768,
                                             num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=64, tie_word_embeddings=True)),
    "30M": TINY_QWEN3.model_copy(update=dict(vocab_size=16384, hidden_size=512, intermediate_size=1536,
                                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                             head_dim=64, tie_word_embeddings=True)),
    "100M": TINY_QWEN3.model_copy(update=dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                              num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                              head_dim=64, tie_word_embeddings=True)),
}
FORMATS = ("bf16", "fp8_e4m3", "nvfp4")
SHAPES = dict(max_batch=1, batch_buckets=(1,))


def _serve_all(replicas, version: int) -> None:
    if any(r.health().weight_version != version for r in replicas):
        raise RuntimeError(f"a replica does not serve version {version}")


def memcpy_s(weights) -> float:
    """Seconds of one numpy copy of every array."""
    start = time.perf_counter()
    copies = [w.copy() for w in weights.values()]
    elapsed = time.perf_counter() - start
    del copies
    return elapsed


def disk_s(weights, root: pathlib.Path) -> tuple[float, float]:
    """Seconds to write the arrays' bytes to one file under ``root`` and to read them back."""
    path = root / "floor.bin"
    total = sum(w.nbytes for w in weights.values())
    start = time.perf_counter()
    with open(path, "wb") as f:
        for w in weights.values():
            f.write(memoryview(np.ascontiguousarray(w)).cast("B"))
    write = time.perf_counter() - start
    start = time.perf_counter()
    back = np.fromfile(path, dtype=np.uint8, count=total)
    read = time.perf_counter() - start
    del back
    path.unlink()
    return write, read


def timed_publications(publish, floor, repeats: int) -> list[tuple[float, float]]:
    """``(sync s, floor s)`` of ``repeats`` publications ``publish(version)``, each floor measured
    just before its publication (so load on the machine shifts both alike), after one warm-up."""
    publish(1)
    pairs = []
    for v in range(2, repeats + 2):
        floor_s = floor()
        start = time.perf_counter()
        publish(v)
        pairs.append((time.perf_counter() - start, floor_s))
    return pairs


def in_process(config, weights, fmt: str, n_replicas: int):
    """``publish(version)`` through the in-process transport to ``n_replicas`` b200 replicas in ``fmt``."""
    numerics = sampler_numerics("b200", fmt)
    replicas = [EmbeddedSampler(config, weights, numerics, **SHAPES) for _ in range(n_replicas)]
    transport = InProcessTransport(config, [numerics])

    def publish(v: int) -> None:
        published = WeightSet(v, weights)
        transport.stage(published)
        for r in replicas:
            r.update_weights(v, published)
        _serve_all(replicas, v)
    return publish


def quantization_s(weights, fmt: str) -> float:
    """The quantize-dequantize calls staging one version in ``fmt`` makes (b200 pools: bf16
    compute, so only the :data:`QUANTIZED_WEIGHT` tensors of a narrower format are quantized)."""
    if fmt == "bf16":
        return 0.0
    start = time.perf_counter()
    for name, w in weights.items():
        if QUANTIZED_WEIGHT.fullmatch(name):
            quantize_dequantize(w, fmt)
    return time.perf_counter() - start


def shared_disk(config, weights, n_replicas: int, root: pathlib.Path):
    """``publish(version)`` through the shared-disk transport; each bf16 replica reads the export."""
    numerics = sampler_numerics("b200", "bf16")
    (root / "base").mkdir(parents=True, exist_ok=True)
    (root / "base" / "config.json").write_text(config.model_dump_json())
    replicas = [EmbeddedSampler(config, weights, numerics, **SHAPES) for _ in range(n_replicas)]
    transport = SharedDiskTransport(config, root / "weights", root / "base")

    def publish(v: int) -> None:
        published = WeightSet(v, weights)
        transport.stage(published)
        for r in replicas:
            r.update_weights(v, read_safetensors(root / "weights" / f"v{v:08d}" / "model.safetensors"))
        _serve_all(replicas, v)
    return publish


def ray_object_store(config, weights, n_replicas: int):
    """``(publish(version), close)`` through the Ray transport to ``n_replicas`` bf16 actors."""
    import ray

    from hetrl.orchestrator.ray_backend import HostActor, RaySampler

    numerics = sampler_numerics("b200", "bf16")
    actors = [HostActor.remote(EmbeddedSampler, config, weights, numerics, **SHAPES) for _ in range(n_replicas)]
    replicas = [RaySampler(a) for a in actors]
    transport = RayObjectStoreTransport()
    _serve_all(replicas, 0)  # every actor is up

    def publish(v: int) -> None:
        published = WeightSet(v, weights)
        transport.stage(published)
        for r in replicas:  # the fleet's workers load concurrently; here one after the other
            r.update_weights(v, published)
        _serve_all(replicas, v)

    def close() -> None:
        for a in actors:
            ray.kill(a)
    return publish, close


def _row(base: dict, transport: str, fmt: str, pairs, floor: str, quantize_s: float = 0.0) -> dict:
    syncs = [p[0] for p in pairs]
    return dict(base, transport=transport, format=fmt, sync_s=statistics.median(syncs), sync_min_s=min(syncs),
                quantize_s=quantize_s, floor=floor, floor_s=statistics.median(p[1] for p in pairs),
                x_floor=statistics.median(a / b for a, b in pairs))


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)} (default all; --quick tiny)")
    parser.add_argument("--replicas", type=int, default=2, help="replicas per transport (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed publications (default 3, with --quick 1)")
    args = parser.parse_args(argv)
    names = args.sizes.split(",") if args.sizes else (["tiny"] if args.quick else list(SIZES))
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown size {unknown[0]!r}; known: {', '.join(SIZES)}")
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    repeats = args.repeats or (1 if args.quick else 3)
    out = output_dir(args, __file__)
    with_ray = not args.quick
    if with_ray:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private instance on this machine only
        ray_dir = tempfile.mkdtemp(prefix="hetrl-ray-", dir="/tmp")  # Ray's socket paths must stay short
        ray.init(num_cpus=1, _temp_dir=ray_dir, include_dashboard=False, object_store_memory=2 << 30,
                 log_to_driver=False)

    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="weight-sync-", dir=out) as scratch:
            for name in names:
                config = SIZES[name]
                weights = random_state_dict(config, seed=0)
                scratch_dir = pathlib.Path(scratch)
                base = dict(size=name, params=sum(w.size for w in weights.values()),
                            bytes=sum(w.nbytes for w in weights.values()), replicas=args.replicas,
                            memcpy_s=min(memcpy_s(weights) for _ in range(5)),
                            disk_write_s=min(disk_s(weights, scratch_dir)[0] for _ in range(3)),
                            disk_read_s=min(disk_s(weights, scratch_dir)[1] for _ in range(3)))
                memcpy = lambda: memcpy_s(weights)  # noqa: E731
                for fmt in FORMATS:
                    pairs = timed_publications(in_process(config, weights, fmt, args.replicas), memcpy, repeats)
                    rows.append(_row(base, "in-process", fmt, pairs, "memcpy", quantization_s(weights, fmt)))
                pairs = timed_publications(shared_disk(config, weights, args.replicas, scratch_dir / name),
                                           lambda: sum(disk_s(weights, scratch_dir)), repeats)
                rows.append(_row(base, "shared-disk", "bf16", pairs, "disk write + read"))
                if with_ray:
                    publish, close = ray_object_store(config, weights, args.replicas)
                    try:
                        rows.append(_row(base, "ray-object-store", "bf16", timed_publications(publish, memcpy, repeats),
                                         "memcpy"))
                    finally:
                        close()
                print(f"{name}: done", flush=True)
    finally:
        if with_ray:
            ray.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
    table = Table(title=f"publish -> every replica serves the new version ({args.replicas} replicas, median of {repeats})")
    for col in ("size", "params", "transport", "format", "sync s", "min s", "quantize s", "floor", "floor s", "x floor"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["size"], f"{r['params'] / 1e6:.1f}M", r["transport"], r["format"], f"{r['sync_s']:.4f}",
                      f"{r['sync_min_s']:.4f}", f"{r['quantize_s']:.4f}", r["floor"], f"{r['floor_s']:.4f}",
                      f"{r['x_floor']:.1f}")
    Console().print(table)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.processor() or platform.machine(),
                cores=os.cpu_count(), replicas=args.replicas, repeats=repeats, quick=args.quick,
                load_average=os.getloadavg())
    (out / "weight_sync.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("| size | params | transport | format | sync s | quantize s | floor | floor s | x floor |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['transport']} | {r['format']} | {r['sync_s']:.3f} | "
              f"{r['quantize_s']:.3f} | {r['floor']} | {r['floor_s']:.3f} | {r['x_floor']:.1f} |")
    plot(rows, out / "weight_sync.png")
    print(f"wrote {out / 'weight_sync.json'} and {out / 'weight_sync.png'}")


def plot(rows, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series = sorted({(r["transport"], r["format"]) for r in rows})
    for transport, fmt in series:
        pts = sorted((r["params"], r["sync_s"]) for r in rows if (r["transport"], r["format"]) == (transport, fmt))
        ax.plot(*zip(*pts), marker="o", label=f"{transport} {fmt}")
    params = sorted({r["params"] for r in rows})  # floors as measured beside the publications
    memcpy = [statistics.median(r["floor_s"] for r in rows if r["params"] == p and r["floor"] == "memcpy") for p in params]
    disk = [statistics.median(r["floor_s"] for r in rows if r["params"] == p and r["floor"] != "memcpy") for p in params]
    ax.plot(params, memcpy, "k--", label="memcpy floor")
    ax.plot(params, [3 * m for m in memcpy], "k:", label="3x memcpy floor")
    ax.plot(params, disk, "k-.", label="disk write+read floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds from publish to every replica serving it")
    ax.set_title("weight sync per transport")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
