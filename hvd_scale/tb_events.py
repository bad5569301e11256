"""A minimal TensorBoard scalar writer: TFRecord event files from the standard library alone.

TensorBoard's own writer (``tensorboard.summary.writer``) imports TensorFlow when it is installed,
which costs every PyTorch worker seconds of start-up and fills its output with TF's notices. The
few scalars this project logs need only three protobuf messages and the TFRecord framing, both
encoded by hand here; TensorBoard reads the result like any other event file.

    Event         { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary       { repeated Value value = 1; }
    Summary.Value { string tag = 1; float simple_value = 2; }
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from typing import Mapping

__all__ = ["EventWriter", "crc32c", "masked_crc32c"]

FILE_VERSION = "brain.Event:2"
_MASK32 = 0xFFFFFFFF


def _crc32c_table() -> tuple[int, ...]:
    # Reflected CRC-32C (Castagnoli) polynomial; zlib.crc32 uses the other polynomial (0xEDB88320),
    # which TFRecord readers reject.
    poly = 0x82F63B78
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (check value: crc32c(b"123456789") == 0xE3069283)."""
    crc = _MASK32
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _MASK32


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated and offset so a CRC stored inside CRC'd data stays robust."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & _MASK32) + 0xA282EAD8) & _MASK32


def _varint(value: int) -> bytes:
    # protobuf encodes a negative int64 as its 64-bit two's complement (always 10 bytes).
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# A field's tag is (field_number << 3) | wire_type; wire types: 0 varint, 1 fixed64,
# 2 length-delimited, 5 fixed32.
def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32's range: TensorBoard shows it as +-inf, not an error
        return struct.pack("<f", math.copysign(math.inf, value))


def _summary_value(tag: str, value: float) -> bytes:
    return _len_field(1, tag.encode("utf-8")) + _key(2, 5) + _float32(value)


def _event(wall_time: float, *, step: int | None = None, file_version: str | None = None,
           values: bytes | None = None) -> bytes:
    """An encoded Event; ``values`` is the already encoded body of its Summary."""
    out = _key(1, 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _len_field(3, file_version.encode("utf-8"))
    if values is not None:
        out += _len_field(5, values)
    return out


def _record(data: bytes) -> bytes:
    # TFRecord framing: the length gets its own CRC so a reader can trust it before reading on.
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


class EventWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike):
        os.makedirs(log_dir, exist_ok=True)
        # TensorBoard's naming: the timestamp orders a run's files, host and pid keep them apart.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = os.path.join(os.fspath(log_dir), name)
        self._file = open(self.path, "wb")
        # Readers take the first record's file_version to tell the format apart.
        self._file.write(_record(_event(time.time(), file_version=FILE_VERSION)))

    def add_scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """Write one Event at ``step`` with one value per tag; NaN values (and empty events) are skipped."""
        if self._file is None:
            raise ValueError("EventWriter is closed")
        body = b"".join(_len_field(1, _summary_value(tag, float(v)))
                        for tag, v in values.items() if not math.isnan(float(v)))
        if not body:  # an event with no values would only add an empty step to the file
            return
        wall_time = time.time() if wall_time is None else wall_time
        self._file.write(_record(_event(wall_time, step=int(step), values=body)))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()  # flushes the buffer
            self._file = None

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
