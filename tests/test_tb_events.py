"""TensorBoard event files (hetrl.orchestrator.tb_events), checked against sources independent of
the writer: the published CRC-32C check value, the protobuf runtime decoding (and encoding) the
Event messages declared with TensorFlow's field numbers, our reader with its CRC checks, and
TensorBoard's own EventAccumulator when the package happens to be installed (it is not a
dependency)."""

import json
import math
import struct

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from hetrl.orchestrator.report import MetricsWriter
from hetrl.orchestrator.tb_events import (
    FILE_VERSION, EventFileError, EventFileWriter, crc32c, masked_crc32c, read_events, read_scalars,
)

SCALARS = {1: {"reward/mean": 0.25, "mismatch/k3": 3.1e-5}, 2: {"reward/mean": 0.5, "mismatch/k3": 2.7e-5},
           10: {"reward/mean": -1.75, "mismatch/k3": 1.0e-4, "eval/success": 0.125}}


def _event_class():
    """``Event`` of TensorFlow's event.proto / summary.proto (the fields we write), built with
    the protobuf runtime from a descriptor: an independent encoder and decoder of the wire format."""
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="hetrl_test_event.proto", package="hetrltest", syntax="proto3")
    value = fdp.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    summary = fdp.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, type_name=".hetrltest.Value", label=F.LABEL_REPEATED)
    event = fdp.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, type_name=".hetrltest.Summary", label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("hetrltest.Event"))


def _records(path):
    """The data of every record, framing parsed by hand (CRCs checked by the reader tests)."""
    buf, pos, out = path.read_bytes(), 0, []
    while pos < len(buf):
        (length,) = struct.unpack("<Q", buf[pos: pos + 8])
        out.append(buf[pos + 12: pos + 12 + length])
        pos += 12 + length + 4
    return out


@pytest.fixture
def event_file(tmp_path):
    with EventFileWriter(tmp_path) as writer:
        for step, values in SCALARS.items():
            writer.add_scalars(step, values, wall_time=1000.0 + step)
    return writer.path


def test_crc32c_matches_the_published_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720 / the CRC catalogue's check value
    assert crc32c(b"") == 0
    c = crc32c(b"abc")
    assert masked_crc32c(b"abc") == ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def test_file_name_and_records_decode_with_the_protobuf_runtime(event_file):
    assert event_file.name.startswith("events.out.tfevents.")
    Event = _event_class()
    decoded = [Event.FromString(data) for data in _records(event_file)]
    assert decoded[0].file_version == FILE_VERSION and not decoded[0].HasField("summary")
    assert [e.step for e in decoded[1:]] == list(SCALARS)
    assert [e.wall_time for e in decoded[1:]] == [1000.0 + s for s in SCALARS]
    for e, values in zip(decoded[1:], SCALARS.values()):
        got = {v.tag: v.simple_value for v in e.summary.value}
        assert got == {k: float(np.float32(x)) for k, x in values.items()}  # float32 on the wire


def test_reader_round_trips_what_the_writer_wrote(event_file):
    events = read_events(event_file)
    assert events[0].file_version == FILE_VERSION
    scalars = read_scalars(event_file)
    for tag in ("reward/mean", "mismatch/k3", "eval/success"):
        expected = [(s, float(np.float32(v[tag]))) for s, v in SCALARS.items() if tag in v]
        assert scalars[tag] == expected


def test_reader_decodes_events_the_protobuf_runtime_encoded(tmp_path):
    from hetrl.orchestrator.tb_events import _record  # the framing only; the payload is protobuf's

    Event = _event_class()
    e = Event(wall_time=5.5, step=-3)  # a negative int64 is a 10-byte varint
    v = e.summary.value.add()
    v.tag, v.simple_value = "loss", 0.375
    path = tmp_path / "events.out.tfevents.0.host"
    path.write_bytes(_record(e.SerializeToString()))
    (event,) = read_events(path)
    assert (event.wall_time, event.step, event.scalars) == (5.5, -3, {"loss": 0.375})


@pytest.mark.parametrize("where, message", [(3, "length CRC mismatch"), (-2, "data CRC mismatch"),
                                            (20, "data CRC mismatch")])
def test_a_corrupted_byte_fails_the_crc_check(event_file, where, message):
    buf = bytearray(event_file.read_bytes())
    buf[where] ^= 0x01
    event_file.write_bytes(bytes(buf))
    with pytest.raises(EventFileError, match=message):
        read_events(event_file)


def test_a_truncated_file_is_reported(event_file):
    event_file.write_bytes(event_file.read_bytes()[:-3])
    with pytest.raises(EventFileError, match="runs past the end"):
        read_events(event_file)


def test_bad_input_is_rejected_naming_it(tmp_path):
    with EventFileWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="tags must be non-empty strings"):
            writer.add_scalars(1, {"": 1.0})
        with pytest.raises(TypeError, match="step must be an int"):
            writer.add_scalars(1.5, {"a": 1.0})


def test_metrics_writer_logs_numeric_entries_beside_the_jsonl(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb")
    writer.write({"step": 1, "loss": np.float64(0.5), "count": 3, "flag": True, "name": "x", "gap": float("nan")})
    writer.write({"step": 2, "loss": 0.25, "count": 4})
    writer.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = read_scalars(path)
    assert set(scalars) == {"loss", "count", "gap"}  # bools, strings and the step itself are not scalars
    assert scalars["loss"] == [(1, 0.5), (2, 0.25)] and scalars["count"] == [(1, 3.0), (2, 4.0)]
    assert len(scalars["gap"]) == 1 and math.isnan(scalars["gap"][0][1])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_metrics_writer_writes_numpy_values_as_plain_numbers(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb")
    writer.write({"step": np.int64(3), "loss": np.float32(0.5), "count": np.int32(7), "flag": np.bool_(True),
                  "gap": np.float32("nan"), "hist": np.array([1.5, np.inf]), "pools": {"a": np.float16(2.0)}})
    writer.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 3, "loss": 0.5, "count": 7, "flag": True, "gap": None,
                                "hist": [1.5, None], "pools": {"a": 2.0}}
    assert "NaN" not in line and "Infinity" not in line  # strict JSON
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = read_scalars(path)
    assert set(scalars) == {"loss", "count", "gap"} and scalars["loss"] == [(3, 0.5)]


def test_tensorboard_reads_the_file_when_installed(event_file):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (not a dependency); the protobuf-runtime check covers the format")
    acc = event_accumulator.EventAccumulator(str(event_file.parent))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("reward/mean")] == [
        (s, pytest.approx(v["reward/mean"], rel=1e-7)) for s, v in SCALARS.items()]
