"""The simulator's report: figures per pool and for the run, a printed table, JSON and a PNG.

:func:`summarize` turns a finished simulation into plain data:

* ``wall_s`` (simulated seconds until the last step was published), ``steps``,
  ``trained_groups``, ``trained_tokens`` (response tokens of trained groups), ``useful_tokens``
  (trained tokens x (1 − the pool's masked fraction)), ``tokens_per_s`` (trained tokens / wall),
  ``groups_per_s``, ``dropped`` and ``regenerated`` groups, ``dropped_fraction`` (dropped /
  (trained + dropped) groups),
  ``idle_fraction`` (1 − busy / rented over every sampler replica), ``trainer_idle_fraction``;
* cost: ``sampler_usd`` (rented time of every replica, idle included, at its pool's on-demand
  or spot price), ``trainer_usd`` (the trainer's accelerators over the whole wall time),
  ``usd`` (both), ``usd_per_mtok`` and ``usd_per_useful_mtok`` (``usd`` per million trained /
  useful tokens), ``sampler_usd_per_mtok``;
* ``little``: the mean number of groups in the system (submitted, not yet trained or dropped),
  the departure rate and the mean time in the system, whose product matches the first up to the
  groups still in the system at the end (Little's law); exactly, ``mean_in_system · wall_s =
  departed · mean_time_in_system_s + residual_time_s`` (the time so far of those still in);
* ``steps_log``: per step, the simulated time its weights were published and its trained tokens;
* ``pools``: per pool the replicas, generated / lost / trained tokens, trained groups, mean and
  max staleness of trained groups, dropped groups, preemptions, busy and rented seconds, idle
  fraction, rented cost and masked fraction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hetrl.fleet_sim.engine import _Sim

__all__ = ["summarize", "table_lines", "write_outputs"]


def _mean(xs: list) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def summarize(sim: "_Sim") -> dict[str, Any]:
    wall = sim.now
    counters = sim.buffer.counters()
    pools, trained, useful, sampler_usd, busy, rented = [], 0, 0.0, 0.0, 0.0, 0.0
    for i, p in enumerate(sim.pools):
        reps = [r for r in sim.reps if r.pool == i]
        t = sim.tally[i]
        p_busy, p_rented = sum(r.busy_s for r in reps), sum(r.rented_s for r in reps)
        usd = p.price_per_s() * p_rented
        masked = p.masked()
        pools.append({
            "name": p.name, "accelerator": p.accelerator, "weight_precision": p.numerics().weight_format,
            "kv_precision": p.numerics().kv_format, "replicas": p.replicas, "price": p.price,
            "capacity": p.capacity(), "generated_tokens": t.generated_tokens, "lost_tokens": t.lost_tokens,
            "trained_groups": t.trained_groups, "trained_tokens": t.trained_tokens,
            "staleness_mean": _mean(t.staleness), "staleness_max": max(t.staleness, default=-1),
            "dropped": counters[p.name].dropped if p.name in counters else 0, "preemptions": t.preemptions,
            "busy_s": p_busy, "rented_s": p_rented, "idle_fraction": 1.0 - p_busy / p_rented if p_rented else float("nan"),
            "usd": usd, "masked_fraction": masked,
        })
        trained += t.trained_tokens
        useful += t.trained_tokens * (1.0 - masked)
        sampler_usd += usd
        busy += p_busy
        rented += p_rented
    trainer_usd = sim.cfg.trainer.price_per_s() * wall
    usd = sampler_usd + trainer_usd
    groups = sum(p["trained_groups"] for p in pools)
    per_m = lambda x, n: x / n * 1e6 if n else float("nan")  # noqa: E731
    return {
        "name": sim.cfg.name, "seed": sim.cfg.seed, "wall_s": wall, "steps": sim.steps_done,
        "trained_groups": groups, "trained_tokens": trained, "useful_tokens": useful,
        "tokens_per_s": trained / wall if wall else float("nan"), "groups_per_s": groups / wall if wall else float("nan"),
        "dropped": sim.dropped, "regenerated": sum(c.regenerated for c in counters.values()),
        "dropped_fraction": sim.dropped / (groups + sim.dropped) if groups + sim.dropped else 0.0,
        "staleness_mean": _mean([s for t in sim.tally for s in t.staleness]),
        "idle_fraction": 1.0 - busy / rented if rented else float("nan"),
        "trainer_idle_fraction": 1.0 - sim.trainer_busy_s / wall if wall else float("nan"),
        "sampler_usd": sampler_usd, "trainer_usd": trainer_usd, "usd": usd,
        "usd_per_mtok": per_m(usd, trained), "usd_per_useful_mtok": per_m(usd, useful),
        "sampler_usd_per_mtok": per_m(sampler_usd, trained),
        "little": {"mean_in_system": sim.area / wall if wall else float("nan"),
                   "departure_rate": sim.departed / wall if wall else float("nan"),
                   "mean_time_in_system_s": sim.sojourn / sim.departed if sim.departed else float("nan"),
                   "in_system_at_end": sim.in_system,
                   "residual_time_s": sum(wall - t for t in sim.by_id.values())},
        "steps_log": [{"wall_s": t, "trained_tokens": n} for t, n in sim.step_log],
        "pools": pools,
    }


def table_lines(report: dict[str, Any]) -> list[str]:
    """The report as a fixed-width table (one line per pool) and a summary line."""
    head = f"{'pool':<18}{'reps':>5}{'price':>10}{'tok/s':>10}{'stale':>7}{'drop':>6}{'idle':>6}{'masked':>8}{'USD':>10}"
    lines = [head, "-" * len(head)]
    for p in report["pools"]:
        tps = p["trained_tokens"] / report["wall_s"] if report["wall_s"] else float("nan")
        lines.append(f"{p['name']:<18}{p['replicas']:>5}{p['price']:>10}{tps:>10.0f}{p['staleness_mean']:>7.2f}"
                     f"{p['dropped']:>6}{p['idle_fraction']:>6.2f}{p['masked_fraction']:>8.4f}{p['usd']:>10.2f}")
    lines.append(f"{report['name']}: {report['steps']} steps in {report['wall_s']:.0f} s simulated, "
                 f"{report['tokens_per_s']:.0f} trained tok/s, dropped {report['dropped_fraction']:.1%}, "
                 f"idle {report['idle_fraction']:.1%}, ${report['usd']:.2f} (samplers ${report['sampler_usd']:.2f}, "
                 f"trainer ${report['trainer_usd']:.2f}): ${report['usd_per_mtok']:.3f}/Mtok, "
                 f"${report['usd_per_useful_mtok']:.3f}/useful Mtok")
    return lines


def write_outputs(reports: list[dict[str, Any]], out: Path, stem: str) -> list[Path]:
    """``<stem>.json`` (the reports) and ``<stem>.png`` (per report: trained tokens/s and USD per
    useful Mtok; per pool: mean staleness) under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(json.dumps(reports, indent=2, default=float) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["name"] for r in reports]
    axes[0].bar(names, [r["tokens_per_s"] for r in reports])
    axes[0].set_title("trained tokens/s")
    axes[1].bar(names, [r["usd_per_useful_mtok"] for r in reports])
    axes[1].set_title("USD per useful Mtok")
    for r in reports:
        axes[2].plot([p["name"] for p in r["pools"]], [p["staleness_mean"] for p in r["pools"]], "o-", label=r["name"])
    axes[2].set_title("mean staleness per pool")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return [json_path, png_path]
