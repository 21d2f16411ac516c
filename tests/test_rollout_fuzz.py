"""Fuzzing the rollout decoder and validator (bytes that cross a process or machine boundary).

Inputs: random bytes, valid messages with flipped bytes, and structured mutations of valid
messages (a value replaced by arbitrary msgpack data, a key deleted or added, an array record's
dtype, shape or bytes changed, NaN/inf/extreme values written into an array). Properties:
nothing raises but :class:`RolloutError`; every error names a field of the schema, the unknown
field it found, or the message itself; every rollout either decodes into one that validates and collates, or is
rejected on its own; a deleted required field or an unknown one is the field named. When atheris
is installed, a bounded coverage-guided run (tests/fuzz_rollouts_atheris.py) checks the same.
"""

from __future__ import annotations

import copy
import pathlib
import resource
import subprocess
import sys
from dataclasses import fields

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import random_rollout
from hetrl.core.schema import (
    Rollout,
    RolloutError,
    SamplerInfo,
    SamplingParams,
    collate,
    decode_rollouts,
    decode_rollouts_lenient,
    encode_rollouts,
)

VOCAB = 50
FUZZ = settings(max_examples=150, deadline=None)
TOP = {f.name for f in fields(Rollout)}
KNOWN = (TOP | {f"support.{k}" for k in ("ids", "offsets", "logprobs", "kind")}
         | {f"sampling.{k}" for k in SamplingParams.model_fields} | {f"sampler.{k}" for k in SamplerInfo.model_fields}
         | {"<message>", "<root>"})
REQUIRED = sorted(f.name for f in fields(Rollout) if f.name not in ("support", "timings"))


def _message() -> bytes:
    rng = np.random.default_rng(7)
    rs = [random_rollout(rng, vocab=VOCAB, response_len=5, env_every=3, rollout_id="r0")[0],
          random_rollout(rng, vocab=VOCAB, response_len=4, sampling=SamplingParams(), head_size=3,
                         rollout_id="r1", group_id="g0")[0]]
    return encode_rollouts(rs)


VALID = _message()
PAYLOAD = msgpack.unpackb(VALID, raw=False)  # array records stay {"__ndarray__": [dtype, shape, bytes]}


def _check(data: bytes) -> tuple[list[Rollout], list[RolloutError]]:
    """Decode ``data`` both ways and assert the properties of the module docstring."""
    rollouts, errors = decode_rollouts_lenient(data, vocab_size=VOCAB)
    for err in errors:
        assert type(err) is RolloutError
        assert err.field in KNOWN or err.field.split(".")[0] in TOP or err.reason == "unknown field", err
        assert f"'{err.field}'" in str(err)
    for r in rollouts:
        r.validate(VOCAB)
    if rollouts:
        collate(rollouts)
    try:
        strict = decode_rollouts(data, vocab_size=VOCAB)
    except RolloutError:
        assert errors
    else:
        assert not errors and len(strict) == len(rollouts)
    return rollouts, errors


def _paths(node, prefix=()):
    """Every path (tuple of keys / indices) into the plain msgpack structure ``node``."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


PATHS = [p for p in _paths(PAYLOAD) if len(p) >= 1]


def _get(node, path):
    for k in path:
        node = node[k]
    return node


DICTS = [p for p in _paths(PAYLOAD) if isinstance(_get(PAYLOAD, p), dict)]
ARRAYS = [p for p in DICTS if "__ndarray__" in _get(PAYLOAD, p)]
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SPECIAL = (np.nan, np.inf, -np.inf, 1e30, -1e30, 2**31 - 1, -(2**31), -1, VOCAB, 0)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_are_rejected_cleanly(data):
    _check(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6))
def test_valid_message_with_flipped_bytes(flips):
    data = bytearray(VALID)
    for pos, value in flips:
        data[pos] = value
    _check(bytes(data))


@FUZZ
@given(st.sampled_from(PATHS), msgpack_values)
def test_any_value_replaced_by_arbitrary_data(path, value):
    payload = copy.deepcopy(PAYLOAD)
    _get(payload, path[:-1])[path[-1]] = value
    _check(msgpack.packb(payload, use_bin_type=True))


@FUZZ
@given(st.sampled_from(ARRAYS), st.data())
def test_array_records_with_wrong_dtype_shape_or_bytes(path, data):
    payload = copy.deepcopy(PAYLOAD)
    record = _get(payload, path)["__ndarray__"]
    which = data.draw(st.sampled_from(["dtype", "shape", "bytes", "special"]))
    if which == "dtype":
        record[0] = data.draw(st.sampled_from(["object", "float128", "int64", "float16", "bool", "uint8", "complex64"]))
    elif which == "shape":
        record[1] = data.draw(st.lists(st.integers(0, 2**40), max_size=3))
    elif which == "bytes":
        record[2] = data.draw(st.binary(max_size=64))
    else:
        arr = np.frombuffer(record[2], dtype=np.dtype(record[0]).newbyteorder("<")).copy()
        if arr.size and arr.dtype.kind in "fiu":
            value = data.draw(st.sampled_from(SPECIAL))
            fits = arr.dtype.kind == "f" or (float(value).is_integer()
                                             and np.iinfo(arr.dtype).min <= value <= np.iinfo(arr.dtype).max)
            if fits:
                arr[data.draw(st.integers(0, arr.size - 1))] = value
        record[2] = arr.tobytes()
    _check(msgpack.packb(payload, use_bin_type=True))


@pytest.mark.parametrize("name", REQUIRED)
def test_a_missing_required_field_is_named(name):
    payload = copy.deepcopy(PAYLOAD)
    del payload["rollouts"][1][name]
    rollouts, errors = _check(msgpack.packb(payload, use_bin_type=True))
    assert [r.rollout_id for r in rollouts] == ["r0"]
    assert [e.field for e in errors] == [name]


@FUZZ
@given(st.text(min_size=1, max_size=10).filter(lambda k: k not in TOP), msgpack_values)
def test_an_unknown_field_is_named(key, value):
    payload = copy.deepcopy(PAYLOAD)
    payload["rollouts"][0][key] = value
    rollouts, errors = _check(msgpack.packb(payload, use_bin_type=True))
    assert [r.rollout_id for r in rollouts] == ["r1"]
    assert [e.field for e in errors] == [key]


@pytest.mark.parametrize("path", ARRAYS, ids=lambda p: ".".join(map(str, p)))
def test_a_malformed_array_rejects_only_its_rollout_naming_the_field(path):
    payload = copy.deepcopy(PAYLOAD)
    _get(payload, path)["__ndarray__"][0] = "object"
    rollouts, errors = _check(msgpack.packb(payload, use_bin_type=True))
    index, field = path[1], ".".join(map(str, path[2:]))
    assert [r.rollout_id for r in rollouts] == [f"r{1 - index}"]
    assert [(e.rollout_id, e.field) for e in errors] == [(f"r{index}", field)] and "object" in str(errors[0])


def test_coverage_guided_fuzzing_with_atheris(tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "valid").write_bytes(VALID)
    script = pathlib.Path(__file__).with_name("fuzz_rollouts_atheris.py")
    # libFuzzer reads its RSS as ru_maxrss, which Linux carries across fork and exec: the child
    # starts at this worker's peak. The 2 GiB budget is therefore counted above that peak.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    proc = subprocess.run([sys.executable, str(script), str(corpus), "-runs=5000", "-seed=1", "-max_len=4096",
                           f"-rss_limit_mb={inherited_mb + 2048}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Done 5000 runs" in proc.stderr
