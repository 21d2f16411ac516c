"""Rollout schema: validation names the field, collation layout, exact serialization."""

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from factories import random_batch, random_rollout
from hetrl.core.schema import (
    Rollout,
    RolloutBatch,
    RolloutError,
    SamplingParams,
    SamplingSupport,
    collate,
    decode_rollouts,
    decode_rollouts_lenient,
    encode_rollouts,
)

VOCAB = 50


@pytest.fixture
def rollout() -> Rollout:
    r, _ = random_rollout(np.random.default_rng(0), vocab=VOCAB, response_len=7, env_every=3)
    return r.validate(VOCAB)


def with_support(r: Rollout, **changes) -> Rollout:
    return dataclasses.replace(r, support=dataclasses.replace(r.support, **changes))


def _first_trainable(r: Rollout) -> int:
    return int(np.flatnonzero(r.loss_mask)[0])


def _malformed(r: Rollout):
    """(case name, mutated rollout, field the error must name)."""
    T = r.response_ids.shape[0]
    t = _first_trainable(r)
    s = r.support
    lo, hi = s.offsets[t], s.offsets[t + 1]
    nan_lp = r.sampler_logprobs.copy(); nan_lp[t] = np.nan
    inf_lp = r.sampler_logprobs.copy(); inf_lp[t] = -np.inf
    big_id = r.response_ids.copy(); big_id[t] = VOCAB
    neg_id = r.response_ids.copy(); neg_id[t] = -1
    # replace the sampled token by an id that is not in its kept span
    outside = next(v for v in range(VOCAB) if v not in set(s.ids[lo:hi].tolist()))
    not_in_support = r.response_ids.copy(); not_in_support[t] = outside
    unsorted = s.offsets.copy(); unsorted[t + 1], unsorted[t + 2] = s.offsets[t + 2] + 1, s.offsets[t + 1]
    bad_start = s.offsets.copy(); bad_start[0] = 1
    sup_lp_nan = s.logprobs.copy(); sup_lp_nan[lo] = np.nan
    sup_ids_big = s.ids.copy(); sup_ids_big[lo] = VOCAB + 3
    dup_ids = s.ids.copy(); dup_ids[lo + 1] = dup_ids[lo]
    not_normalized = s.logprobs.copy(); not_normalized[lo:hi] -= 0.5
    mismatch_lp = r.sampler_logprobs.copy(); mismatch_lp[t] -= 0.2
    versions = r.policy_version.copy(); versions[t] = 5
    return [
        ("response length mismatch: loss_mask", dataclasses.replace(r, loss_mask=r.loss_mask[:-1]), "loss_mask"),
        ("response length mismatch: logprobs", dataclasses.replace(r, sampler_logprobs=r.sampler_logprobs[:-1]), "sampler_logprobs"),
        ("response length mismatch: versions", dataclasses.replace(r, policy_version=r.policy_version[:-1]), "policy_version"),
        ("offsets length mismatch", with_support(r, offsets=s.offsets[:-1]), "support.offsets"),
        ("support logprobs length mismatch", with_support(r, logprobs=s.logprobs[:-1]), "support.logprobs"),
        ("response id outside vocab", dataclasses.replace(r, response_ids=big_id), "response_ids"),
        ("negative response id", dataclasses.replace(r, response_ids=neg_id), "response_ids"),
        ("prompt id outside vocab", dataclasses.replace(r, prompt_ids=np.full(3, VOCAB + 1, np.int32)), "prompt_ids"),
        ("support id outside vocab", with_support(r, ids=sup_ids_big), "support.ids"),
        ("NaN sampler logprob", dataclasses.replace(r, sampler_logprobs=nan_lp), "sampler_logprobs"),
        ("inf sampler logprob", dataclasses.replace(r, sampler_logprobs=inf_lp), "sampler_logprobs"),
        ("NaN support logprob", with_support(r, logprobs=sup_lp_nan), "support.logprobs"),
        ("sampled token not in support", dataclasses.replace(r, response_ids=not_in_support), "support.ids"),
        ("unsorted offsets", with_support(r, offsets=unsorted), "support.offsets"),
        ("offsets not starting at 0", with_support(r, offsets=bad_start), "support.offsets"),
        ("duplicate support id", with_support(r, ids=dup_ids), "support.ids"),
        ("kept support not normalized", with_support(r, logprobs=not_normalized), "support.logprobs"),
        ("sampler logprob inconsistent with support", dataclasses.replace(r, sampler_logprobs=mismatch_lp), "sampler_logprobs"),
        ("float token ids", dataclasses.replace(r, response_ids=r.response_ids.astype(np.float32)), "response_ids"),
        ("int loss mask", dataclasses.replace(r, loss_mask=r.loss_mask.astype(np.int8)), "loss_mask"),
        ("empty response", dataclasses.replace(r, response_ids=r.response_ids[:0]), "response_ids"),
        ("truncated sampling without support", dataclasses.replace(r, support=None), "support"),
        ("head kind under truncation", with_support(r, kind="head"), "support.kind"),
        ("NaN reward", dataclasses.replace(r, reward=float("nan")), "reward"),
        ("reward beyond float32", dataclasses.replace(r, reward=1e39), "reward"),  # a finite float64, inf in a batch
        ("unknown finish reason", dataclasses.replace(r, finish_reason="timeout"), "finish_reason"),
        ("empty group id", dataclasses.replace(r, group_id=""), "group_id"),
        ("decreasing versions", dataclasses.replace(r, policy_version=versions), "policy_version"),
        ("span wider than top_k", dataclasses.replace(r, sampling=SamplingParams(top_p=0.9, top_k=2)), "support.offsets"),
    ]


def test_valid_rollout_passes(rollout):
    assert rollout.validate(VOCAB) is rollout


def test_every_malformed_case_is_rejected_naming_the_field(rollout):
    cases = _malformed(rollout)
    assert len(cases) >= 25
    for name, bad, field in cases:
        with pytest.raises(RolloutError) as info:
            bad.validate(VOCAB)
        assert info.value.field == field, f"{name}: named {info.value.field!r}, expected {field!r}: {info.value}"
        assert rollout.rollout_id in str(info.value) and f"'{field}'" in str(info.value), name


def test_env_token_with_a_support_span_is_rejected(rollout):
    t = int(np.flatnonzero(~rollout.loss_mask)[0])
    spans = [list(rollout.support.ids[a:b]) for a, b in zip(rollout.support.offsets[:-1], rollout.support.offsets[1:])]
    lps = [list(rollout.support.logprobs[a:b]) for a, b in zip(rollout.support.offsets[:-1], rollout.support.offsets[1:])]
    spans[t], lps[t] = [int(rollout.response_ids[t])], [0.0]
    bad = dataclasses.replace(rollout, support=SamplingSupport.from_lists(spans, lps))
    with pytest.raises(RolloutError, match="non-trainable token"):
        bad.validate(VOCAB)


def test_head_support_may_miss_the_sampled_token():
    rng = np.random.default_rng(3)
    r, _ = random_rollout(rng, vocab=VOCAB, sampling=SamplingParams(), head_size=1, response_len=20, logit_scale=0.1)
    # with flat logits and a head of one, some sampled tokens fall in the tail: still valid
    starts = r.support.offsets[:-1]
    assert np.any(r.support.ids[starts] != r.response_ids)
    r.validate(VOCAB)


def _assert_rollouts_equal(a: Rollout, b: Rollout):
    da, db = a.to_dict(), b.to_dict()
    assert da.keys() == db.keys()
    for k in da:
        if isinstance(da[k], np.ndarray):
            assert da[k].dtype == db[k].dtype and np.array_equal(da[k], db[k], equal_nan=True), k
        elif k == "support" and da[k] is not None:
            for kk in da[k]:
                assert np.array_equal(da[k][kk], db[k][kk]) if kk != "kind" else da[k][kk] == db[k][kk]
        else:
            assert da[k] == db[k], k


@given(seed=st.integers(0, 2**31), truncated=st.booleans(), env_every=st.sampled_from([0, 2, 3]))
def test_rollout_serialization_round_trips_exactly(seed, truncated, env_every):
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=6) if truncated else SamplingParams()
    rs = [random_rollout(rng, vocab=VOCAB, sampling=sampling, head_size=4, env_every=env_every,
                         rollout_id=f"r{i}")[0] for i in range(3)]
    data = encode_rollouts(rs)
    back = decode_rollouts(data, vocab_size=VOCAB)
    assert len(back) == 3
    for a, b in zip(rs, back):
        _assert_rollouts_equal(a, b)
    assert encode_rollouts(back) == data


def test_decoder_rejects_garbage_with_a_field_name(rollout):
    good = encode_rollouts([rollout])
    for junk in (b"", b"\x00\xff\xfe", msgpack.packb({"hetrl_rollouts": 99, "rollouts": []}), good[:-7]):
        with pytest.raises(RolloutError) as info:
            decode_rollouts(junk)
        assert info.value.field == "<message>"
    payload = msgpack.unpackb(good, raw=False)
    payload["rollouts"].append({"rollout_id": "x"})
    kept, errors = decode_rollouts_lenient(msgpack.packb(payload, use_bin_type=True), vocab_size=VOCAB)
    assert [r.rollout_id for r in kept] == [rollout.rollout_id]
    assert len(errors) == 1 and errors[0].rollout_id == "x" and errors[0].field == "group_id"


def test_decoder_rejects_forbidden_array_dtypes(rollout):
    payload = msgpack.unpackb(encode_rollouts([rollout]), raw=False)
    payload["rollouts"][0]["response_ids"]["__ndarray__"][0] = "object"
    _, errors = decode_rollouts_lenient(msgpack.packb(payload, use_bin_type=True))
    assert errors and "object" in str(errors[0])


def test_collate_layout_is_target_aligned():
    rng = np.random.default_rng(1)
    batch, _, rollouts = random_batch(rng, batch=5)
    for b, r in enumerate(rollouts):
        P, T = r.prompt_ids.shape[0], r.response_ids.shape[0]
        seq = np.concatenate([r.prompt_ids, r.response_ids])
        assert np.array_equal(batch.input_ids[b, : P + T], seq)
        # logits at position j predict input token j + 1
        assert np.array_equal(batch.target_ids[b, : P + T - 1], seq[1:])
        assert np.array_equal(batch.loss_mask[b, P - 1 : P - 1 + T], r.loss_mask)
        assert batch.loss_mask[b].sum() == r.loss_mask.sum()
        if r.support is not None:
            for t in range(T):
                span = set(r.support.ids[r.support.offsets[t] : r.support.offsets[t + 1]].tolist())
                j = P - 1 + t
                assert set(batch.support_ids[b, j][batch.support_mask[b, j]].tolist()) == span
    assert batch.support_ids.shape[-1] in (1, 8, 16)  # bucketed
    assert batch.input_ids.shape[1] % 4 == 0


def test_collate_groups_and_pools_indexed_in_order():
    rng = np.random.default_rng(2)
    batch, _, rollouts = random_batch(rng, batch=6)
    assert batch.group_ids == ("g0", "g1", "g2")
    assert list(batch.group_index) == [0, 0, 1, 1, 2, 2]
    assert [batch.pool_names[i] for i in batch.pool_index] == [r.sampler.pool for r in rollouts]
    with pytest.raises(ValueError, match="not in pool_names"):
        collate(rollouts, pool_names=["b200-bf16"])


def test_batch_serialization_round_trips_exactly():
    batch, _, _ = random_batch(np.random.default_rng(4))
    back = RolloutBatch.from_bytes(batch.to_bytes())
    for k, v in batch.arrays.items():
        assert getattr(back, k).dtype == v.dtype and np.array_equal(getattr(back, k), v), k
    for k in RolloutBatch._META:
        assert getattr(back, k) == getattr(batch, k)
    with pytest.raises(ValueError, match="hetrl"):
        from safetensors.numpy import save

        RolloutBatch.from_bytes(save({"x": np.zeros(2)}))


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("top_k", 2**31)])
def test_sampling_params_beyond_the_batch_dtypes_are_refused(field, value):
    """A batch holds temperature as float32 and top_k as int32: a finite float64 temperature past
    float32's range became inf in collate (found by the byte-flipping fuzz test), so it is refused."""
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})
