"""Per-step scalars for experiment trackers: TensorBoard, and a hook for any other.

Every trained step of the run's history gives one dict of scalars (:func:`step_scalars`,
from the projection's :class:`~rolloutlog.controller.metrics.projection.StepRow`), handed to each
:class:`StepSink` as the step is folded. :class:`StepPublisher` keeps the sinks
consistent with the history across restores: a step is written once; when a restore
re-trains steps that were already written (in the abandoned branch), the sink is first
told to ``purge(from_step)``, then the history's steps are written again.

:class:`TensorBoardSink` writes TensorBoard event files itself (the TFRecord framing and
the few protobuf fields of a scalar event), so it needs no dependency. Its purge is
TensorBoard's own: a ``SessionLog.START`` event at step N makes TensorBoard drop the
events of steps >= N written before it (``purge_step`` in other writers). Each step also
records the log offset of its ``StepTrained`` event (tag ``rollout/offset``): a new
process reads the directory back and writes only what is missing or different.

Other trackers (W&B, trackio, MLflow, ...) plug in with the same dict::

    class WandbSink:
        def write_step(self, step, scalars, wall_time): wandb.log(scalars, step=step)
        def purge(self, from_step): pass  # or rewind the W&B run to from_step
        def close(self): wandb.finish()

    live.add_step_sink(WandbSink())
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

from .projection import MetricsProjection, StepRow

log = logging.getLogger(__name__)

#: The tag that carries each step's log offset (how a restarted sink recognises steps).
OFFSET_TAG = "rollout/offset"


def step_scalars(row: StepRow) -> dict[str, float]:
    """The per-step scalars of one trained step (tags ``rollout/<name>``)."""
    values: dict[str, float | int | None] = {
        "reward_mean": row.reward_mean,
        "staleness_max": row.staleness_max,
        "staleness_mean": row.staleness_mean,
        "groups": row.groups,
        "shortfall": row.shortfall,
        "weight_version": row.weight_version,
        "epoch": row.epoch,
        "wall_seconds": row.wall_seconds,
        "tokens_generated": row.tokens_generated,
        "tokens_committed": row.tokens_committed,
        "groups_committed": row.groups_committed,
        "groups_evicted": row.groups_evicted,
        "prompts_dropped": row.prompts_dropped,
        "offset": row.offset,
    }
    return {f"rollout/{k}": float(v) for k, v in values.items() if v is not None}


class StepSink(Protocol):
    """Where per-step scalars go (TensorBoard, W&B, trackio, ...)."""

    def write_step(self, step: int, scalars: Mapping[str, float], wall_time: float) -> None:
        """Record ``scalars`` for train ``step`` (``wall_time``: Unix seconds, log time)."""
        ...

    def purge(self, from_step: int) -> None:
        """Forget what was written for steps >= ``from_step`` (a restore re-trains them)."""
        ...

    def close(self) -> None:
        """Flush and release the sink."""
        ...


def _f32(value: float) -> float:
    """``value`` as a float32 holds it (TensorBoard scalars are float32)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


class StepPublisher:
    """Hands each new trained step of a projection's history to a sink, once.

    ``written`` maps step -> the log offset of the ``StepTrained`` written for it (as a
    float32, the way TensorBoard stores it); a history row whose step was written with
    another offset was re-trained after a restore: the sink purges from there first.
    """

    def __init__(self, sink: StepSink, written: Mapping[int, float] | None = None) -> None:
        self.sink = sink
        self.written: dict[int, float] = dict(written or {})

    def publish(self, projection: MetricsProjection) -> int:
        """Write the history's steps not written yet; returns how many were written."""
        rows = projection.steps
        start = len(rows)
        for i, row in enumerate(rows):
            if self.written.get(row.step) != _f32(row.offset):
                start = i
                break
        if start == len(rows):
            return 0
        first = rows[start].step
        if any(step >= first for step in self.written):
            self.sink.purge(first)
            self.written = {s: o for s, o in self.written.items() if s < first}
        for row in rows[start:]:
            self.sink.write_step(row.step, step_scalars(row), row.time.timestamp())
            self.written[row.step] = _f32(row.offset)
        return len(rows) - start


# ---------------------------------------------------------------------------- TensorBoard
def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint((number << 3) | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def encode_event(
    wall_time: float,
    step: int,
    *,
    scalars: Mapping[str, float] | None = None,
    file_version: str | None = None,
    session_start: bool = False,
) -> bytes:
    """One ``tensorflow.Event`` protobuf: scalars (``Summary.Value.simple_value``), the
    file version header, or a ``SessionLog`` START (TensorBoard's purge marker)."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars is not None:
        summary = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
            for tag, v in scalars.items()
        )
        out += _bytes_field(5, summary)
    if session_start:
        out += _bytes_field(7, _field(1, 0, _varint(1)))  # session_log: SessionLog{START}
    return out


def frame(record: bytes) -> bytes:
    """A TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", _masked(length)) + record + struct.pack("<I", _masked(record))


def read_records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (CRCs checked; a torn tail, from a crash, ends it)."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        length_bytes = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        end = pos + 12 + length + 4
        if length_crc != _masked(length_bytes) or end > len(data):
            return
        record = data[pos + 12 : pos + 12 + length]
        (crc,) = struct.unpack("<I", data[end - 4 : end])
        if crc != _masked(record):
            return
        yield record
        pos = end


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            yield number, wire, value
        elif wire == 1:
            yield number, wire, data[pos : pos + 8]
            pos += 8
        elif wire == 5:
            yield number, wire, data[pos : pos + 4]
            pos += 4
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            yield number, wire, data[pos : pos + length]
            pos += length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def decode_event(record: bytes) -> tuple[float, int, dict[str, float], bool]:
    """``(wall_time, step, scalars, session_start)`` of an event :func:`encode_event` wrote."""
    wall_time, step, scalars, start = 0.0, 0, {}, False
    for number, _wire, value in _fields(record):
        if number == 1 and isinstance(value, bytes):
            (wall_time,) = struct.unpack("<d", value)
        elif number == 2 and isinstance(value, int):
            step = value
        elif number == 5 and isinstance(value, bytes):
            for vnum, _, item in _fields(value):
                if vnum != 1 or not isinstance(item, bytes):
                    continue
                tag, number_value = "", 0.0
                for inum, _, part in _fields(item):
                    if inum == 1 and isinstance(part, bytes):
                        tag = part.decode()
                    elif inum == 2 and isinstance(part, bytes):
                        (number_value,) = struct.unpack("<f", part)
                scalars[tag] = number_value
        elif number == 7 and isinstance(value, bytes):
            start = any(n == 1 and v == 1 for n, _, v in _fields(value))
    return wall_time, step, scalars, start


def read_scalars(directory: Path) -> dict[int, dict[str, float]]:
    """What TensorBoard shows for ``directory``: step -> scalars, files in name order,
    a ``SessionLog.START`` at step N dropping the steps >= N read before it."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for record in read_records(path):
            _t, step, scalars, start = decode_event(record)
            if start:
                out = {s: v for s, v in out.items() if s < step}
            if scalars:
                out.setdefault(step, {}).update(scalars)
    return out


class TensorBoardSink:
    """Writes per-step scalars as TensorBoard event files under ``directory`` (one new
    file per process, ``events.out.tfevents.<time>.<host>.<pid>``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{now:017.6f}.{socket.gethostname()}.{os.getpid()}"
        self.path = directory / name
        self._file = self.path.open("ab")
        self._write(encode_event(now, 0, file_version="brain.Event:2"))

    def written_offsets(self) -> dict[int, float]:
        """step -> log offset of the steps the directory already holds (for a new
        process: :class:`StepPublisher` writes only what is missing or different)."""
        return {
            step: scalars[OFFSET_TAG]
            for step, scalars in read_scalars(self.directory).items()
            if OFFSET_TAG in scalars
        }

    def _write(self, record: bytes) -> None:
        self._file.write(frame(record))
        self._file.flush()

    def write_step(self, step: int, scalars: Mapping[str, float], wall_time: float) -> None:
        """One scalar event per step, all tags in it."""
        self._write(encode_event(wall_time, step, scalars=scalars))

    def purge(self, from_step: int) -> None:
        """TensorBoard drops the steps >= ``from_step`` written before this marker."""
        self._write(encode_event(time.time(), from_step, session_start=True))

    def close(self) -> None:
        """Close the file."""
        self._file.close()
