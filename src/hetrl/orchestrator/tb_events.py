"""TensorBoard event files of scalar metrics, written and read without TensorFlow or TensorBoard.

An event file (``events.out.tfevents.<unix seconds>.<host>.<pid>.<n>``) is a sequence of
**TFRecord** records, each one serialized ``Event`` protobuf::

    uint64 length          little-endian, the byte count of data
    uint32 masked_crc(length bytes)
    bytes  data[length]
    uint32 masked_crc(data)

with ``masked_crc(b) = ((c >> 15) | (c << 17)) + 0xA282EAD8  (mod 2^32)``, ``c = CRC-32C(b)``
(Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; the check
value of ``b"123456789"`` is 0xE3069283), stored little-endian.

The messages (field numbers of TensorFlow's ``event.proto`` / ``summary.proto``; only the
fields used here)::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

Protobuf wire format: every field is ``key = (field_number << 3) | wire_type`` as a varint, then
the payload: wire type 0 a varint (base-128, low 7 bits first, high bit = more bytes follow;
an int64 is taken mod 2^64, so a negative one is 10 bytes), 1 eight bytes little-endian (double),
2 a varint length then that many bytes (strings, nested messages), 5 four bytes little-endian
(float). So the keys are ``0x09`` wall_time, ``0x10`` step, ``0x1A`` file_version, ``0x2A``
summary, ``0x0A`` value / tag, ``0x15`` simple_value.

A file starts with the event ``{wall_time, file_version: "brain.Event:2"}``; each
:meth:`EventFileWriter.add_scalars` call appends one event with ``step`` and one ``Value`` per
scalar (values rounded to float32, non-finite ones kept). :func:`read_events` reads a file back
by the same spec, checking both CRCs of every record, and skips fields it does not know.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Mapping

__all__ = ["EventFileWriter", "Event", "EventFileError", "crc32c", "masked_crc32c", "read_events", "read_scalars",
           "FILE_VERSION"]

FILE_VERSION = "brain.Event:2"
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord uses it (see the module docstring)."""
    c = _U32
    table = _TABLE
    for byte in data:
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ _U32


def masked_crc32c(data: bytes) -> int:
    """``((c >> 15) | (c << 17)) + 0xA282EAD8`` mod 2^32 with ``c = crc32c(data)``."""
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & _U32) + _MASK_DELTA) & _U32


# ---------------------------------------------------------------------- encoding
def _varint(value: int) -> bytes:
    value &= _U64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field_number: int, wire_type: int) -> bytes:
    return _varint((field_number << 3) | wire_type)


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _key(field_number, 2) + _varint(len(payload)) + payload


def _encode_event(wall_time: float, step: int | None = None, file_version: str | None = None,
                  scalars: Mapping[str, float] | None = None) -> bytes:
    out = _key(1, 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode("utf-8"))
    if scalars is not None:
        values = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode("utf-8")) + _key(2, 5) + struct.pack("<f", value))
            for tag, value in scalars.items())
        out += _length_delimited(5, values)
    return out


def _record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFileWriter:
    """Appends scalar events to a new event file in ``directory`` (created with its parents).

    The file is named ``events.out.tfevents.<unix seconds>.<host>.<pid>.<n>``, ``n`` counting
    the writers this process opened, so two writers never share a file."""

    _opened = itertools.count()

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{next(self._opened)}"
        self.path = self.directory / name
        self._file: BinaryIO = self.path.open("xb")
        self._file.write(_record(_encode_event(now, file_version=FILE_VERSION)))
        self._file.flush()

    def add_scalars(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        """One event at ``step`` holding every ``tag -> value`` of ``scalars`` (float32)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        bad = [tag for tag in scalars if not isinstance(tag, str) or not tag]
        if bad:
            raise ValueError(f"scalar tags must be non-empty strings, got {bad[0]!r}")
        values = {tag: float(v) for tag, v in scalars.items()}
        self._file.write(_record(_encode_event(time.time() if wall_time is None else wall_time, step, scalars=values)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "EventFileWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- reading
class EventFileError(ValueError):
    """A malformed event file; the message names the file and the byte offset."""


@dataclass
class Event:
    """One decoded event: ``scalars`` maps each ``Value.tag`` with a ``simple_value`` to it."""

    wall_time: float = 0.0
    step: int = 0
    file_version: str | None = None
    scalars: dict[str, float] = field(default_factory=dict)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field_number, wire_type, payload)`` of a message: ints for wire types 0, 1 and 5 (raw
    little-endian for 1 and 5), bytes for 2."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise ValueError(f"truncated fixed{size * 8} field {number}")
            value, pos = int.from_bytes(buf[pos: pos + size], "little"), pos + size
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError(f"length-delimited field {number} runs past the message")
            value, pos = buf[pos: pos + size], pos + size
        else:
            raise ValueError(f"field {number} has unsupported wire type {wire}")
        yield number, wire, value


def _decode_event(data: bytes) -> Event:
    event = Event()
    for number, wire, value in _fields(data):
        if number == 1 and wire == 1:
            event.wall_time = struct.unpack("<d", value.to_bytes(8, "little"))[0]
        elif number == 2 and wire == 0:
            event.step = value - (1 << 64) if value >> 63 else value
        elif number == 3 and wire == 2:
            event.file_version = value.decode("utf-8")
        elif number == 5 and wire == 2:
            for vn, vw, vpayload in _fields(value):
                if vn != 1 or vw != 2:
                    continue
                tag, simple = None, None
                for n, w, v in _fields(vpayload):
                    if n == 1 and w == 2:
                        tag = v.decode("utf-8")
                    elif n == 2 and w == 5:
                        simple = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                if tag is not None and simple is not None:
                    event.scalars[tag] = simple
    return event


def read_events(path: str | os.PathLike) -> list[Event]:
    """Every event of the file at ``path``, in order; raises :class:`EventFileError` on a CRC
    mismatch, a truncated record or an undecodable event."""
    path = pathlib.Path(path)
    buf = path.read_bytes()
    events, pos = [], 0
    while pos < len(buf):
        if pos + 12 > len(buf):
            raise EventFileError(f"{path}: truncated record header at byte {pos}")
        header = buf[pos: pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", buf[pos + 8: pos + 12])
        if header_crc != masked_crc32c(header):
            raise EventFileError(f"{path}: length CRC mismatch in the record at byte {pos}")
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(buf):
            raise EventFileError(f"{path}: record at byte {pos} runs past the end of the file")
        data = buf[start:end]
        (data_crc,) = struct.unpack("<I", buf[end: end + 4])
        if data_crc != masked_crc32c(data):
            raise EventFileError(f"{path}: data CRC mismatch in the record at byte {pos}")
        try:
            events.append(_decode_event(data))
        except (ValueError, UnicodeDecodeError) as err:
            raise EventFileError(f"{path}: the record at byte {pos} is not a valid Event: {err}") from None
        pos = end + 4
    return events


def read_scalars(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` in file order, from :func:`read_events`."""
    out: dict[str, list[tuple[int, float]]] = {}
    for event in read_events(path):
        for tag, value in event.scalars.items():
            out.setdefault(tag, []).append((event.step, value))
    return out

