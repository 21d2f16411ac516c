"""``async.weight_update: abort`` end to end on the local backend (the logic is the shared loop's,
hetrl.orchestrator.loop, so the Ray backend runs the same code).

One short run with a fast pool and a slow one (1.5 s before every call, so new weights are
published while its calls run). Every generate call is recorded with the weight version it
sampled at and the newest published version when it returned. With abort, no group that reached
the buffer may contain a call that newer weights overtook (such groups must be retracted and
their prompts submitted again); under between_requests the slow pool's groups would be buffered
anyway.

A second run holds every call of the slow pool open for 30 s on a replica that can abort: each
publication must abort the calls in flight (the Abortable capability, through the replica
supervisor), their groups retracted and submitted again under new ids, nothing lost or duplicated.
"""

import dataclasses
import threading

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


def abort_run_config(out):
    """The tiny abort run both fixtures train: two pools, two-turn episodes, no evaluation."""
    return load_config("tiny_mixed.yaml", [
        f"output_dir={out}",
        "steps=3", *TINY_BATCH,
        f"async.max_staleness={MAX_STALENESS}", "async.weight_update=abort",
        "fleet.pools=[{name: fast, accelerator: h100, weight_precision: fp8_e4m3},"
        " {name: slow, accelerator: a100, weight_precision: bf16}]",
        "environment.options={eval: {every: 0}, coding: {max_turns: 2}}",
    ])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("abort-run")
    cfg = abort_run_config(out)
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


class HeldUntilAbort(Slow):
    """A slow replica that can abort (the loop is under test here, not an engine): each call
    samples its tokens, then holds them for up to ``hold_s`` seconds, as a slow accelerator
    would still be decoding; an :meth:`abort` during the hold ends the call at once, every
    generation cut to its first token with ``finish_reason="abort"`` (an engine's partial
    answer). Records ``(group ids, aborted)`` per call; calls after an abort are not affected."""

    supports_abort = True

    def __init__(self, inner, hold_s):
        super().__init__(inner, 0.0)
        self.hold_s = hold_s
        self.calls: list[tuple[set[str], bool]] = []
        self._running: threading.Event | None = None
        self._lock = threading.Lock()

    def generate(self, requests):
        out = self.inner.generate(requests)
        aborted = threading.Event()
        with self._lock:
            self._running = aborted
        aborted.wait(self.hold_s)
        with self._lock:
            self._running = None
        self.calls.append(({r.request_id.split("/")[0] for r in requests}, aborted.is_set()))
        if not aborted.is_set():
            return out
        return [dataclasses.replace(g, token_ids=g.token_ids[:1], logprobs=g.logprobs[:1],
                                    policy_version=g.policy_version[:1], finish_reason="abort",
                                    support=_first_span(g.support)) for g in out]

    def abort(self):
        with self._lock:
            if self._running is not None:
                self._running.set()


def _first_span(support):
    if support is None:
        return None
    end = int(support.offsets[1])
    return dataclasses.replace(support, ids=support.ids[:end], offsets=support.offsets[:2],
                               logprobs=support.logprobs[:end])


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("abort-held-run")
    cfg = abort_run_config(out)
    held: list[HeldUntilAbort] = []

    def wrap(pool, index, sampler):
        if pool.name != "slow":
            return sampler
        held.append(HeldUntilAbort(sampler, 30.0))
        return held[-1]

    result = LocalOrchestrator(cfg, wrap_sampler=wrap, console=False).run()
    return result, held


def test_a_publication_aborts_the_calls_in_flight_and_their_groups_are_regenerated(held_run):
    """Without the abort capability (or without the loop using it) the slow replica's calls
    would hold their turns for 30 s each and none would be aborted."""
    result, held = held_run
    assert result.final["version"] == 3
    aborted = {g for h in held for groups, cut in h.calls if cut for g in groups}
    assert aborted, "no call was aborted by a publication"
    assert not aborted & set(result.received)  # an aborted turn is never buffered ...
    assert aborted <= set(result.retracted) | set(result.unfinished)  # ... its group retracted
    audit = result.audit()
    assert audit["lost"] == [] and audit["duplicated"] == [] and audit["unaccounted"] == 0
    assert len(set(result.submitted)) == len(result.submitted)  # re-submitted under new ids
    check_staleness(result, MAX_STALENESS)
