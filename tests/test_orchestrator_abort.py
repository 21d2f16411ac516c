"""``async.weight_update: abort`` end to end on the local backend (the logic is the shared loop's,
hetrl.orchestrator.loop, so the Ray backend runs the same code).

One short run with a fast pool and a slow one (1.5 s before every call, so new weights are
published while its calls run). Every generate call is recorded with the weight version it
sampled at and the newest published version when it returned. With abort, no group that reached
the buffer may contain a call that newer weights overtook (such groups must be retracted and
their prompts submitted again); under between_requests the slow pool's groups would be buffered
anyway.
"""

import pytest

from hetrl.config import load_config
from hetrl.orchestrator.local import LocalOrchestrator
from hetrl.samplers.faults import Slow
from orchestrator_checks import check_monotone_versions, check_staleness
from tiny_run import TINY_BATCH

pytestmark = pytest.mark.slow  # each test trains tiny runs (minutes on 2 cores)

MAX_STALENESS = 1


class Recording(Slow):
    """Records ``(group ids, oldest token version, newest published version at return)`` per call."""

    def __init__(self, inner, delay, published):
        super().__init__(inner, delay)
        self.published = published
        self.calls: list[tuple[set[str], int, int]] = []

    def generate(self, requests):
        out = super().generate(requests)
        oldest = min(int(g.policy_version.min()) for g in out)
        self.calls.append(({r.request_id.split("/")[0] for r in requests}, oldest, self.published()))
        return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("abort-run")
    cfg = load_config("tiny_mixed.yaml", [
        f"output_dir={out}",
        "steps=3", *TINY_BATCH,
        f"async.max_staleness={MAX_STALENESS}", "async.weight_update=abort",
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3},"
        " {name: slow, accelerator: a100, weight_precision: bf16}]",
        "environment.options={eval: {every: 0}, coding: {max_turns: 2}}",
    ])
    holder: dict = {}
    recorders: list[Recording] = []

    def wrap(pool, index, sampler):
        recorders.append(Recording(sampler, 1.5 if pool.name == "slow" else 0.0,
                                   lambda: holder["orch"].fleet.published_version))
        return recorders[-1]

    holder["orch"] = LocalOrchestrator(cfg, wrap_sampler=wrap, console=False)
    return holder["orch"].run(), recorders


def test_abort_run_completes_with_the_invariants(run):
    result, _ = run
    assert result.final["version"] == 3
    check_staleness(result, MAX_STALENESS)
    check_monotone_versions(result)


def test_overtaken_groups_are_retracted_never_buffered(run):
    result, recorders = run
    overtaken = {g for r in recorders for groups, version, published in r.calls if version < published for g in groups}
    assert overtaken, "no call was overtaken by new weights: the run did not exercise abort"
    assert not overtaken & set(result.received)
    assert result.final["groups_retracted"] == len(result.retracted) >= 1
    assert result.history[-1]["rollout/retracted"] <= len(result.retracted)  # workers run on past the last step


def test_retracted_groups_are_resubmitted_not_lost(run):
    result, _ = run
    assert not set(result.retracted) & set(result.received)
    assert len(set(result.submitted)) == len(result.submitted)  # every resubmission is a new group id
    assert len(result.submitted) >= len(result.received) + len(result.retracted)
    ids = [g for g, *_ in result.trained]
    assert len(ids) == len(set(ids)) and set(ids) <= set(result.received)


def test_no_rollout_mixes_weight_versions(run):
    result, _ = run
    spans = [s for per_replica in result.rollout_spans.values() for s in per_replica]
    assert spans and all(lo == hi for lo, hi in spans)
