"""Admission into the buffer: poisoned rollouts are rejected with the field, counted per pool and
reason, stale ones are held back, and a pool with too many is quarantined."""

import dataclasses

import numpy as np
import pytest
from pydantic import ValidationError

from factories import random_rollout, sampler_info
from hetrl.core.admission import STALE, QuarantineConfig, RolloutGate
from hetrl.core.schema import Rollout, SamplingParams, SamplingSupport

VOCAB = 50
PUBLISHED = 5
MAX_STALENESS = 2


def good(pool: str = "p", version: int = PUBLISHED, seed: int = 0, **kw) -> Rollout:
    r, _ = random_rollout(np.random.default_rng(seed), vocab=VOCAB, response_len=6, env_every=3, pool=pool,
                          version=version, rollout_id=f"{pool}-{seed}", **kw)
    return r


def gate(**quarantine) -> RolloutGate:
    return RolloutGate(QuarantineConfig(**quarantine), vocab_size=VOCAB, max_length=64, max_staleness=MAX_STALENESS)


def _poisoned(r: Rollout) -> list[tuple[str, Rollout, str]]:
    """(case, poisoned copy of ``r``, the field its rejection must name)."""
    t = int(np.flatnonzero(r.loss_mask)[0])
    s = r.support
    lo, hi = s.offsets[t], s.offsets[t + 1]

    def edit(name, **where):
        arr = getattr(r, name).copy()
        for i, v in where.items():
            arr[int(i[1:])] = v
        return dataclasses.replace(r, **{name: arr})

    outside = next(v for v in range(VOCAB) if v not in set(s.ids[lo:hi].tolist()))
    head_lp = s.logprobs.copy()
    head_lp[lo:hi] += 1.0  # a head whose probabilities sum past 1
    head = dataclasses.replace(r, sampling=SamplingParams(), support=SamplingSupport(s.ids, s.offsets, head_lp, "head"),
                               sampler_logprobs=np.where(r.loss_mask, 0.0, r.sampler_logprobs).astype(np.float32))
    return [
        ("NaN log-prob", edit("sampler_logprobs", **{f"t{t}": np.nan}), "sampler_logprobs"),
        ("inf log-prob", edit("sampler_logprobs", **{f"t{t}": -np.inf}), "sampler_logprobs"),
        ("id outside the vocabulary", edit("response_ids", **{f"t{t}": VOCAB + 3}), "response_ids"),
        ("support missing the sampled token", edit("response_ids", **{f"t{t}": outside}), "support.ids"),
        ("wrong length", dataclasses.replace(r, sampler_logprobs=r.sampler_logprobs[:-1]), "sampler_logprobs"),
        ("log-prob inconsistent with its support entry", edit("sampler_logprobs", **{f"t{t}": r.sampler_logprobs[t] - 0.3}),
         "sampler_logprobs"),
        ("support log-probs not a (sub)distribution", head, "support.logprobs"),
        ("version never published", edit("policy_version", **{f"t{len(r.loss_mask) - 1}": PUBLISHED + 1}),
         "policy_version"),
        ("claims another pool", dataclasses.replace(r, sampler=sampler_info("elsewhere")), "sampler.pool"),
    ]


def test_every_poisoned_rollout_is_rejected_naming_the_field_and_counted_per_pool():
    g = gate(max_rejection_rate=1.0)
    clean = good("p")
    cases = _poisoned(clean)
    for name, bad, field in cases:
        out = g.admit("p", [bad], published_version=PUBLISHED)
        assert out.admitted == [] and out.stale == [], name
        (err,) = out.rejected
        assert err.field == field and clean.rollout_id in str(err), f"{name}: {err}"
    out = g.admit("q", [good("q")], published_version=PUBLISHED)
    assert len(out.admitted) == 1 and out.rejected == []
    m = g.metrics()
    assert m["pool/p/admission/rejected"] == len(cases) and m["pool/p/admission/admitted"] == 0
    for field in {f for _, _, f in cases}:
        assert m[f"pool/p/admission/rejected/{field}"] == sum(f == field for _, _, f in cases)
    assert m["pool/q/admission/rejected"] == 0 and m["pool/q/admission/admitted"] == 1
    assert m["admission/rejected"] == len(cases) and m["admission/quarantined_pools"] == 0


def test_upstream_rejections_count_with_the_rest():
    g = gate(max_rejection_rate=1.0)
    _, bad, _ = _poisoned(good())[0]
    with pytest.raises(Exception) as info:
        bad.validate(VOCAB)
    out = g.admit("p", [good(seed=1)], [info.value], published_version=PUBLISHED)
    assert len(out.admitted) == 1 and out.rejected == [info.value]
    assert g.metrics()["pool/p/admission/rejected/sampler_logprobs"] == 1


def test_stale_rollouts_are_held_back_and_counted():
    g = gate(max_rejection_rate=1.0)
    edge = good(version=PUBLISHED - MAX_STALENESS)
    stale = good(version=PUBLISHED - MAX_STALENESS - 1, seed=1)
    out = g.admit("p", [edge, stale], published_version=PUBLISHED)
    assert out.admitted == [edge] and out.stale == [stale] and out.rejected == []
    m = g.metrics()
    assert m[f"pool/p/admission/rejected/{STALE}"] == 1 and m["pool/p/admission/rejection_rate"] == 0.5


def test_pool_is_quarantined_past_the_rate_once_it_has_enough_rollouts():
    g = gate(max_rejection_rate=0.5, min_rollouts=4, window=8)
    bad = [b for _, b, _ in _poisoned(good("bad"))]
    for i in range(3):  # three rejections: below min_rollouts, not judged yet
        out = g.admit("bad", [bad[i]], published_version=PUBLISHED)
        assert out.quarantined is None
        g.admit("fine", [good("fine", seed=i)], published_version=PUBLISHED)
    assert not g.is_quarantined("bad")
    out = g.admit("bad", [bad[3], good("bad", seed=9)], published_version=PUBLISHED)
    assert out.quarantined is not None and out.admitted == []  # the quarantining call admits nothing
    assert "'bad'" in out.quarantined and "4 of its last 5" in out.quarantined and "sampler_logprobs" in out.quarantined
    assert g.is_quarantined("bad") and g.quarantined() == {"bad": out.quarantined}
    later = g.admit("bad", [good("bad", seed=10)], published_version=PUBLISHED)
    assert later.admitted == [] and later.quarantined is None  # reported once; nothing admitted any more
    m = g.metrics()
    assert m["pool/bad/admission/quarantined"] == 1 and m["pool/fine/admission/quarantined"] == 0
    assert m["admission/quarantined_pools"] == 1 and m["pool/bad/admission/rejected"] == 4


def test_rejections_slide_out_of_the_window():
    g = gate(max_rejection_rate=0.5, min_rollouts=2, window=4)
    bad = [b for _, b, _ in _poisoned(good())]
    assert g.admit("p", [bad[0], good(seed=1)], published_version=PUBLISHED).quarantined is None  # 1 of 2
    for i in range(4):
        assert g.admit("p", [good(seed=2 + i)], published_version=PUBLISHED).quarantined is None
    assert g.metrics()["pool/p/admission/rejection_rate"] == 0.0
    assert g.admit("p", [bad[1], bad[2]], published_version=PUBLISHED).quarantined is None  # 2 of 4: not past 0.5
    assert g.admit("p", [bad[3]], published_version=PUBLISHED).quarantined is not None  # 3 of 4


def test_a_pool_of_stale_rollouts_is_quarantined_after_a_window_of_warm_up():
    g = gate(max_rejection_rate=0.5, min_rollouts=2, window=4)
    for seeds in ((0, 1), (2, 3)):  # no fresh rollout yet: its warm-up, up to a window of stale ones
        out = g.admit("stuck", [good("stuck", version=0, seed=i) for i in seeds], published_version=PUBLISHED)
        assert out.quarantined is None and len(out.stale) == 2
    out = g.admit("stuck", [good("stuck", version=0, seed=i) for i in (4, 5)], published_version=PUBLISHED)
    assert out.quarantined is not None and STALE in out.quarantined and out.stale == []
    assert g.metrics()[f"pool/stuck/admission/rejected/{STALE}"] == 6  # the warm-up's stale rollouts count as drops


def test_a_pool_stale_while_it_warms_up_is_judged_from_its_first_fresh_rollout_on():
    g = gate(max_rejection_rate=0.5, min_rollouts=2, window=4)
    slow_start = [good("p", version=0, seed=i) for i in range(3)]  # its first call outlived three steps (compiling)
    assert g.admit("p", slow_start, published_version=PUBLISHED).quarantined is None
    assert g.admit("p", [good("p", seed=3), good("p", seed=4)], published_version=PUBLISHED).admitted  # warm
    assert g.metrics()["pool/p/admission/rejection_rate"] == 0.0
    assert g.admit("p", [good("p", version=0, seed=i) for i in (5, 6)], published_version=PUBLISHED).quarantined is None
    assert g.admit("p", [good("p", version=0, seed=7)], published_version=PUBLISHED).quarantined is not None  # 3 of 4
    again = gate(max_rejection_rate=0.5, min_rollouts=2, window=4)
    again.restore_state(g.state())
    assert again.state() == g.state()


@pytest.mark.parametrize("kwargs", [dict(max_rejection_rate=1.5), dict(min_rollouts=0), dict(min_rollouts=9, window=8)])
def test_quarantine_config_is_checked(kwargs):
    with pytest.raises(ValidationError):
        QuarantineConfig(**kwargs)
