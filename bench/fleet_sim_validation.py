"""The fleet simulator against paced tiny runs: throughput, mean staleness per pool and dropped fraction.

For each fleet, one real run of the orchestrator (:class:`hetrl.orchestrator.local.LocalOrchestrator`,
``tiny_mixed.yaml``'s model, trainer and workload) with ``fleet.pacing: modelled`` (each
embedded replica slowed to its modelled throughput relative to the fastest pool, which runs at
CPU speed) and the busy-time clock on wall time; then ``hetrl fleet simulate`` of the same fleet
and workload, calibrated from that run with three figures only: the reference pool's CPU decode
rate (the rate that paced the run: its generated tokens per second of its calls after each
replica's first, divided by its relative throughput: the H100-bf16 equivalent), the mean trainer step time and the mean response length. Everything else
(per-pool speeds, routing, queueing, staleness, drops) is the simulator's. Compared over the
steps after the first (the first pays the jit compiles): trained tokens/s, the mean staleness of
each pool's trained tokens, and the fraction of groups dropped as too stale.

    .venv/bin/python bench/fleet_sim_validation.py [--steps 6] [--fleets two_speed,six_kinds,three_pools]
                                                   [--out bench/results] [--quick]

Writes ``fleet_sim_validation.json`` and ``.png`` to ``--out``. ``--quick``: one two-pool fleet,
3 steps, batches of 2 groups x 2 rollouts of at most 16 new tokens, work under the output directory.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import time

from hetrl.bench_command import output_dir, script_parser

FLEETS: dict[str, list[dict]] = {
    # a fast pool and one 13.5x slower
    "two_speed": [{"name": "b200-nvfp4", "accelerator": "b200", "weight_precision": "nvfp4", "kv_precision": "bf16"},
                  {"name": "l40s-fp8", "accelerator": "l40s", "weight_precision": "fp8_e4m3", "kv_precision": "bf16"}],
    # tiny_mixed.yaml's six kinds
    "six_kinds": [{"name": "b200-nvfp4", "accelerator": "b200", "weight_precision": "nvfp4", "kv_precision": "bf16"},
                  {"name": "h100-fp8", "accelerator": "h100", "weight_precision": "fp8_e4m3", "kv_precision": "fp8_e4m3"},
                  {"name": "mi300x-fp8", "accelerator": "mi300x", "weight_precision": "fp8_e4m3fnuz", "kv_precision": "bf16"},
                  {"name": "a100-bf16", "accelerator": "a100", "weight_precision": "bf16", "kv_precision": "bf16"},
                  {"name": "l40s-fp8", "accelerator": "l40s", "weight_precision": "fp8_e4m3", "kv_precision": "bf16"},
                  {"name": "tpu-v6e-bf16", "accelerator": "tpu-v6e", "weight_precision": "bf16", "kv_precision": "bf16"}],
    # two replicas of a mid pool, one slow pool
    "three_pools": [{"name": "h100-fp8", "accelerator": "h100", "weight_precision": "fp8_e4m3", "replicas": 2},
                    {"name": "a100-bf16", "accelerator": "a100", "weight_precision": "bf16"},
                    {"name": "tpu-v5e-bf16", "accelerator": "tpu-v5e", "weight_precision": "bf16"}],
}
QUICK = ["async.batch_groups=2", "async.group_size=2", "async.max_new_tokens=16"]


def _window(h: list[dict], key: str) -> float:
    return h[-1][key] - h[0][key]


def run_paced(fleet: str, steps: int, work: pathlib.Path, overrides: list[str]) -> dict:
    """One paced run of ``fleet``: measured figures over steps 2..N and the calibration."""
    from hetrl.config import load_config
    from hetrl.orchestrator.local import LocalOrchestrator

    pools = json.dumps(FLEETS[fleet])
    cfg = load_config("tiny_mixed.yaml", [
        f"output_dir={work / fleet}", "checkpointing.every=0", f"steps={steps}", "environment.options.eval.every=0",
        "fleet.pacing=modelled", "fleet.cost_clock=wall", f"fleet.pools={pools}", *overrides])
    start = time.perf_counter()
    orchestrator = LocalOrchestrator(cfg, console=False)
    result = orchestrator.run()
    measured_rate = orchestrator.fleet.replicas[0].sampler.rate.tokens_per_s()  # what paced the run
    total = time.perf_counter() - start
    h, last = result.history, result.history[-1]
    names = [p["name"] for p in FLEETS[fleet]]
    staleness = {}
    for n in names:
        w = [(r.get(f"pool/{n}/mismatch/num_tokens") or 0.0, r.get(f"pool/{n}/mismatch/staleness_mean")) for r in h[1:]]
        w = [(k, s) for k, s in w if k > 0 and s is not None]
        staleness[n] = sum(k * s for k, s in w) / sum(k for k, _ in w) if w else float("nan")
    out_groups = last["buffer/groups_out"]
    dropped = last["buffer/dropped"]
    from hetrl.samplers.fleet import PoolConfig

    caps = {n: PoolConfig.model_validate(p).numerics().relative_throughput() for n, p in zip(names, FLEETS[fleet])}
    ref = max(caps, key=caps.get)
    return dict(
        fleet=fleet, steps=steps, total_s=total, async_=cfg.async_.model_dump(), max_batch=cfg.fleet.max_batch,
        tokens_per_s=_window(h, "fleet/trained_tokens") / _window(h, "time/wall_s"),
        staleness=staleness, dropped_fraction=dropped / (out_groups + dropped) if out_groups + dropped else 0.0,
        calibration=dict(
            reference_pool=ref,
            reference_tokens_per_s=measured_rate / caps[ref],
            step_s=statistics.mean(r["time/step_s"] for r in h[1:]),
            response_tokens=last["fleet/tokens"] / last["fleet/requests"]),
        pools={n: {"requests": last[f"pool/{n}/requests"], "tokens": last[f"pool/{n}/tokens"],
                   "busy_s": last[f"pool/{n}/busy_s"]} for n in names},
    )


def simulate_like(measured: dict) -> dict:
    """The simulator on the measured run's fleet and workload, with its calibration."""
    from hetrl.fleet_sim.config import SimConfig
    from hetrl.fleet_sim.engine import simulate

    a, c = measured["async_"], measured["calibration"]
    pools = [{k: v for k, v in p.items() if k in ("name", "accelerator", "weight_precision", "kv_precision", "replicas")}
             | {"link_gbps": 1e6} for p in FLEETS[measured["fleet"]]]
    cfg = SimConfig.model_validate({
        "name": measured["fleet"], "model": {"params_b": 0.001},
        "trainer": {"step_s": c["step_s"]}, "max_batch": measured["max_batch"],
        "reference_tokens_per_s": c["reference_tokens_per_s"],
        "workload": {"prompt_tokens": 0, "response_tokens": c["response_tokens"], "response_cv": 0.5,
                     "max_tokens": a["max_new_tokens"], "group_size": a["group_size"], "batch_groups": a["batch_groups"],
                     "steps": measured["steps"], "max_staleness": a["max_staleness"], "stale_policy": a["stale_policy"]},
        "pools": pools})
    r = simulate(cfg)
    log = r["steps_log"]
    return dict(tokens_per_s=sum(s["trained_tokens"] for s in log[1:]) / (log[-1]["wall_s"] - log[0]["wall_s"]),
                staleness={p["name"]: p["staleness_mean"] for p in r["pools"]}, dropped_fraction=r["dropped_fraction"])


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["fleet"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["measured"]["tokens_per_s"] for r in rows], 0.4, label="paced run")
    ax.bar([i + 0.2 for i in x], [r["simulated"]["tokens_per_s"] for r in rows], 0.4, label="simulated")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("trained tokens/s (steps 2..N)")
    ax.legend(fontsize=8)
    for r in rows:
        ms = r["measured"]["staleness"]
        ss = r["simulated"]["staleness"]
        bx.scatter([ms[p] for p in ms], [ss[p] for p in ms], label=r["fleet"])
    top = max([1.0] + [v for r in rows for d in (r["measured"]["staleness"], r["simulated"]["staleness"])
                       for v in d.values() if v == v])
    bx.plot([0, top], [0, top], "k--", linewidth=0.8)
    bx.set_xlabel("measured mean staleness per pool")
    bx.set_ylabel("simulated")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=None, help="default 6 (with --quick 3)")
    parser.add_argument("--fleets", default=None, help="comma-separated, of: " + ", ".join(FLEETS))
    parser.add_argument("--work", type=pathlib.Path, default=None, help="run outputs (default runs/bench_fleet_sim)")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 6)
    fleets = (args.fleets or ("two_speed" if args.quick else ",".join(FLEETS))).split(",")
    unknown = [f for f in fleets if f not in FLEETS]
    if unknown or steps < 3:
        parser.error(f"unknown fleet {unknown[0]!r}" if unknown else "--steps must be >= 3")
    out = output_dir(args, __file__)
    work = args.work or (out / "fleet_sim_validation-work" if args.quick else pathlib.Path("runs/bench_fleet_sim"))
    rows = []
    for fleet in fleets:
        measured = run_paced(fleet, steps, work, QUICK if args.quick else [])
        rows.append({"fleet": fleet, "measured": measured, "simulated": simulate_like(measured)})
    print(f"{'fleet':<13}{'pool':<14}{'tok/s run':>10}{'tok/s sim':>10}{'stale run':>10}{'stale sim':>10}"
          f"{'drop run':>9}{'drop sim':>9}")
    for r in rows:
        m, s = r["measured"], r["simulated"]
        print(f"{r['fleet']:<13}{'(all)':<14}{m['tokens_per_s']:>10.1f}{s['tokens_per_s']:>10.1f}{'':>20}"
              f"{m['dropped_fraction']:>9.1%}{s['dropped_fraction']:>9.1%}")
        for p, v in m["staleness"].items():
            print(f"{'':<13}{p:<14}{'':>20}{v:>10.2f}{s['staleness'][p]:>10.2f}")
    load = os.getloadavg()
    meta = dict(date=datetime.date.today().isoformat(), machine=platform.machine(), cores=os.cpu_count(),
                loadavg_at_end=load, quick=args.quick, steps=steps, fleets=fleets)
    (out / "fleet_sim_validation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=float))
    plot(rows, out / "fleet_sim_validation.png")
    print(f"load average at the end: {load[0]:.1f}; wrote {out / 'fleet_sim_validation.json'} and .png")


if __name__ == "__main__":
    main()
