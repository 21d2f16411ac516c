"""The staleness-bounded rollout buffer: bound, exactly-once, conservation, pacing, threads, resume."""

import json
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetrl.core.buffer import PoolCounters, RolloutBuffer, RolloutGroup
from hetrl.core.schema import Rollout, SamplerInfo, SamplingParams

POOLS = ("fast-b200", "mid-h100", "slow-l40s")


def rollout(group_id: str, i: int, pool: str, versions, trainable=None) -> Rollout:
    versions = np.asarray(versions, dtype=np.int32)
    T = versions.shape[0]
    return Rollout(
        rollout_id=f"{group_id}/{i}", group_id=group_id, prompt_ids=np.array([1, 2], dtype=np.int32),
        response_ids=np.arange(3, 3 + T, dtype=np.int32),
        loss_mask=np.ones(T, bool) if trainable is None else np.asarray(trainable, bool),
        sampler_logprobs=np.full(T, -0.5, np.float32), policy_version=versions, reward=float(i % 2),
        finish_reason="stop", sampling=SamplingParams(),
        sampler=SamplerInfo(pool=pool, accelerator=pool.split("-")[1], weight_precision="bf16",
                            kv_precision="bf16", engine="embedded"),
    )


def group(group_id: str, pool: str, version: int, size: int = 2, span: int = 0) -> RolloutGroup:
    """A group whose tokens run from ``version`` to ``version + span`` (a partial rollout)."""
    return RolloutGroup(group_id, f"prompt-{group_id}",
                        tuple(rollout(group_id, i, pool, [version, version + span]) for i in range(size)))


def check_conservation(buf: RolloutBuffer) -> None:
    for pool, c in buf.counters().items():
        assert c.groups_in == c.groups_out + c.dropped + c.pending, pool
        assert c.pending >= 0 and 0 <= c.regenerated <= c.dropped
    assert sum(c.pending for c in buf.counters().values()) == len(buf)


# ---------------------------------------------------------------------- the group
def test_group_versions_use_trainable_tokens_only():
    r = rollout("g", 0, "fast-b200", [1, 5, 6], trainable=[False, True, True])
    g = RolloutGroup("g", "p", (r, rollout("g", 1, "fast-b200", [4, 7])))
    assert (g.min_version, g.max_version, g.pool) == (4, 7, "fast-b200")
    env_only = rollout("h", 0, "fast-b200", [2, 3], trainable=[False, False])
    assert RolloutGroup("h", "p", (env_only,)).min_version == 2


@pytest.mark.parametrize("make, message", [
    (lambda: RolloutGroup("g", "p", ()), "no rollouts"),
    (lambda: RolloutGroup("g", "p", (rollout("other", 0, "fast-b200", [0]),)), "group 'other'"),
    (lambda: RolloutGroup("g", "p", (rollout("g", 0, "fast-b200", [0]), rollout("g", 1, "slow-l40s", [0]))), "several pools"),
])
def test_group_rejects_malformed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_construction():
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(-1)
    with pytest.raises(ValueError, match="stale_policy"):
        RolloutBuffer(1, "keep")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- basics
def test_take_order_and_bound():
    buf = RolloutBuffer(max_staleness=2)
    for gid, pool, v in [("a", "fast-b200", 5), ("b", "slow-l40s", 3), ("c", "fast-b200", 1), ("d", "mid-h100", 4)]:
        buf.put(group(gid, pool, v))
    out = buf.take(2, trainer_version=5)
    assert [g.group_id for g in out] == ["b", "d"]  # c (v1 < 5-2) is dropped; oldest policy first
    c = buf.counters()
    assert c["fast-b200"].dropped == 1 and c["slow-l40s"].groups_out == 1 and c["slow-l40s"].max_staleness_out == 2
    assert buf.take(2, trainer_version=5) == []  # only "a" is left
    assert [g.group_id for g in buf.take(1, trainer_version=6)] == ["a"]
    check_conservation(buf)


def test_partial_rollout_age_is_its_oldest_token():
    buf = RolloutBuffer(max_staleness=1)
    buf.put(group("old-start", "slow-l40s", 2, span=3))  # tokens from v2 to v5
    assert buf.take(1, trainer_version=5) == []
    assert buf.counters()["slow-l40s"].dropped == 1


def test_duplicates_are_ignored_forever():
    buf = RolloutBuffer(max_staleness=4)
    assert buf.put(group("g", "fast-b200", 0))
    assert not buf.put(group("g", "fast-b200", 0))
    assert buf.take(1, 0)[0].group_id == "g"
    assert not buf.put(group("g", "slow-l40s", 0))  # even after it was taken
    c = buf.counters()
    assert c["fast-b200"].duplicates == 1 and c["slow-l40s"].duplicates == 1 and c["slow-l40s"].groups_in == 0
    check_conservation(buf)


def test_regenerate_policy_hands_prompts_back():
    buf = RolloutBuffer(max_staleness=0, stale_policy="regenerate")
    buf.put(group("g1", "slow-l40s", 0))
    buf.put(group("g2", "fast-b200", 1))
    assert [g.group_id for g in buf.take(1, trainer_version=1)] == ["g2"]
    regen = buf.pop_regenerations()
    assert [(s.group_id, s.prompt_id, s.pool, s.min_version, s.trainer_version) for s in regen] == [
        ("g1", "prompt-g1", "slow-l40s", 0, 1)]
    assert buf.pop_regenerations() == []
    # a group arriving already stale is evicted at put (the latest trainer version is known)
    buf.put(group("g3", "slow-l40s", 0))
    assert len(buf) == 0 and buf.pop_regenerations()[0].group_id == "g3"
    c = buf.counters()["slow-l40s"]
    assert (c.dropped, c.regenerated) == (2, 2)
    check_conservation(buf)


def test_trainer_version_must_not_decrease():
    buf = RolloutBuffer(1)
    buf.take(1, 3)
    with pytest.raises(ValueError, match="below the latest"):
        buf.take(1, 2)


def test_metrics_keys():
    buf = RolloutBuffer(1)
    buf.put(group("g", "fast-b200", 0))
    m = buf.metrics()
    assert m["buffer/groups_in"] == 1.0 and m["buffer/pending"] == 1.0
    assert m["pool/fast-b200/buffer/pending"] == 1.0 and m["pool/fast-b200/buffer/max_staleness_out"] == -1.0


# ---------------------------------------------------------------------- properties
op = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(POOLS), st.integers(0, 6), st.integers(0, 2), st.integers(0, 9)),
    st.tuples(st.just("take"), st.integers(1, 4), st.integers(0, 2)),
    st.tuples(st.just("snapshot")),
)


@given(ops=st.lists(op, max_size=60), max_staleness=st.integers(0, 3), policy=st.sampled_from(["drop", "regenerate"]))
def test_random_sequences_keep_every_invariant(ops, max_staleness, policy):
    """Random arrivals (ages relative to the trainer, partial spans, duplicate ids), takes with a
    growing trainer version, and snapshot/restore round trips: the staleness bound always holds,
    nothing is returned twice, and in = out + dropped + pending."""
    buf = RolloutBuffer(max_staleness, policy)
    version, returned, accepted, regenerated = 0, [], set(), []
    for o in ops:
        if o[0] == "put":
            _, pool, age, span, gid = o
            v = max(0, version - age)
            fresh = f"g{gid}" not in accepted
            assert buf.put(group(f"g{gid}", pool, v, span=min(span, version - v))) == fresh
            accepted.add(f"g{gid}")
        elif o[0] == "take":
            _, n, bump = o
            version += bump
            out = buf.take(n, version)
            assert len(out) in (0, n)
            for g in out:
                assert g.min_version >= version - max_staleness
            returned += [g.group_id for g in out]
        else:
            data = json.loads(json.dumps(buf.snapshot()))
            buf = RolloutBuffer.restore(data)
            assert buf.snapshot() == data
        regenerated += [s.group_id for s in buf.pop_regenerations()]
        check_conservation(buf)
    assert len(returned) == len(set(returned))
    counters = buf.counters()
    total = PoolCounters(**{k: sum(getattr(c, k) for c in counters.values()) for k in ("groups_in", "groups_out", "dropped", "regenerated", "duplicates")})
    assert total.groups_in == len(accepted) and total.groups_out == len(returned)
    assert len(regenerated) == (total.dropped if policy == "regenerate" else 0)
    assert set(returned).isdisjoint(regenerated)


# ---------------------------------------------------------------------- pacing
def test_slow_pool_is_not_starved_by_a_fast_one():
    """A fast pool floods the buffer with fresh groups while a slow pool delivers a few old ones:
    the slow pool's groups (oldest policy) are trained first instead of expiring."""
    buf = RolloutBuffer(max_staleness=2)
    for i in range(20):
        buf.put(group(f"fast{i}", "fast-b200", 4))
    buf.put(group("slow0", "slow-l40s", 2))
    buf.put(group("slow1", "slow-l40s", 3))
    assert [g.group_id for g in buf.take(3, trainer_version=4)] == ["slow0", "slow1", "fast0"]
    assert buf.counters()["slow-l40s"].dropped == 0


# ---------------------------------------------------------------------- threads
def test_blocking_take_waits_for_producers_and_times_out():
    buf = RolloutBuffer(max_staleness=1)
    start = time.monotonic()
    assert buf.take(1, 0, timeout=0.05) == []
    assert time.monotonic() - start >= 0.05
    threading.Timer(0.05, lambda: buf.put(group("late", "slow-l40s", 0))).start()
    assert [g.group_id for g in buf.take(1, 0, timeout=5.0)] == ["late"]


def test_close_wakes_a_waiter():
    buf = RolloutBuffer(max_staleness=1)
    threading.Timer(0.05, buf.close).start()
    assert buf.take(1, 0, timeout=None) == []
    with pytest.raises(RuntimeError, match="closed"):
        buf.put(group("g", "fast-b200", 0))


def test_concurrent_producers_and_a_trainer():
    """Three pools of different speeds produce concurrently (with some duplicate re-deliveries)
    while a trainer takes batches and bumps its version: the bound holds, nothing is duplicated,
    and every group is accounted for."""
    buf = RolloutBuffer(max_staleness=1)
    version = [0]
    stop = threading.Event()

    def producer(pool: str, delay: float) -> None:
        for i in range(40):
            if stop.is_set():
                return
            v = buf.trainer_version or 0
            time.sleep(delay)  # generation time: the version may move on meanwhile
            try:
                buf.put(group(f"{pool}-{i}", pool, v))
                if i % 7 == 0:
                    buf.put(group(f"{pool}-{i}", pool, v))  # a re-queued request finishing twice
            except RuntimeError:
                return

    threads = [threading.Thread(target=producer, args=(p, d)) for p, d in zip(POOLS, (0.0005, 0.001, 0.004))]
    for t in threads:
        t.start()
    seen = []
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        out = buf.take(4, version[0], timeout=0.05)
        for g in out:
            assert g.min_version >= version[0] - 1
        seen += [g.group_id for g in out]
        if out:
            version[0] += 1
    stop.set()
    for t in threads:
        t.join()
    assert len(seen) == len(set(seen)) and seen
    counters = buf.counters()
    assert sum(c.groups_in for c in counters.values()) == 120
    assert all(c.duplicates == 6 for c in counters.values())
    assert counters["slow-l40s"].groups_out > 0
    check_conservation(buf)


# ---------------------------------------------------------------------- resume
def test_snapshot_is_json_and_restores_exactly():
    buf = RolloutBuffer(max_staleness=1, stale_policy="regenerate")
    buf.put(group("a", "fast-b200", 3, span=1))
    buf.put(group("b", "slow-l40s", 2))
    buf.put(group("c", "mid-h100", 0))
    buf.take(1, trainer_version=3)  # evicts c (regenerate), returns b
    data = json.loads(json.dumps(buf.snapshot()))
    back = RolloutBuffer.restore(data)
    assert back.snapshot() == data and back.trainer_version == 3
    assert not back.put(group("b", "slow-l40s", 2))  # seen ids survive
    assert [s.group_id for s in back.pop_regenerations()] == ["c"]
    (g,) = back.take(1, trainer_version=3)
    orig = buf.take(1, trainer_version=3)[0]
    assert g.group_id == orig.group_id == "a"
    for r1, r2 in zip(g.rollouts, orig.rollouts):
        for name in Rollout._ARRAYS:
            np.testing.assert_array_equal(getattr(r1, name), getattr(r2, name))
        assert r1.sampler == r2.sampler and r1.reward == r2.reward
    with pytest.raises(ValueError, match="snapshot"):
        RolloutBuffer.restore({"version": 99})
