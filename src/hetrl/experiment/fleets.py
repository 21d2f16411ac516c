"""Random fleets for the any-mixture sweep: accelerator kinds, precisions and replica shares
drawn from the profile catalogue (:data:`hetrl.samplers.profiles.CATALOGUE`).

Fleet ``i`` of :func:`draw_fleets` is the ``i``-th draw of one ``numpy`` generator seeded with
``AnyMixtureConfig.seed``, so a fleet does not change when more are asked for. One draw:

1. the pool count ``k`` uniform in ``[min_pools, max_pools]``;
2. ``k`` distinct kinds uniformly from ``kinds``;
3. per kind, a weight format and a KV format uniformly from the kind's native ones;
4. the replica shares: ``replicas`` split into ``k`` positive parts by ``k − 1`` distinct cut
   points drawn uniformly from ``1 .. replicas − 1`` (every composition equally likely).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hetrl.experiment.config import AnyMixtureConfig
from hetrl.samplers.profiles import CATALOGUE

__all__ = ["RandomFleet", "draw_fleets"]


@dataclass(frozen=True)
class RandomFleet:
    """Fleet ``index``: its pools as ``fleet.pools`` entries of a run config."""

    index: int
    pools: tuple[dict[str, Any], ...]

    def describe(self) -> str:
        """E.g. ``b200 nvfp4/bf16 x3 + tpu-v6e bf16/int8 x3`` (kind weight/KV x replicas)."""
        return " + ".join(f"{p['accelerator']} {p['weight_precision']}/{p['kv_precision']} x{p['replicas']}"
                          for p in self.pools)


def _draw(rng: np.random.Generator, index: int, spec: AnyMixtureConfig) -> RandomFleet:
    k = int(rng.integers(spec.min_pools, spec.max_pools + 1))
    kinds = [spec.kinds[i] for i in rng.choice(len(spec.kinds), size=k, replace=False)]
    cuts = np.sort(rng.choice(np.arange(1, spec.replicas), size=k - 1, replace=False))
    shares = np.diff(np.concatenate([[0], cuts, [spec.replicas]])).astype(int)
    pools = []
    for kind, replicas in zip(kinds, shares):
        profile = CATALOGUE[kind]
        weight = profile.weight_formats[int(rng.integers(len(profile.weight_formats)))]
        kv = profile.kv_formats[int(rng.integers(len(profile.kv_formats)))]
        pools.append({"name": f"{kind}-{weight}-{kv}", "accelerator": kind, "weight_precision": weight,
                      "kv_precision": kv, "replicas": int(replicas)})
    return RandomFleet(index, tuple(pools))


def draw_fleets(spec: AnyMixtureConfig) -> list[RandomFleet]:
    """The ``spec.fleets`` random fleets of ``spec`` (module docstring)."""
    rng = np.random.default_rng(spec.seed)
    return [_draw(rng, i, spec) for i in range(spec.fleets)]
