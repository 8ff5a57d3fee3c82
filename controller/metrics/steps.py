"""Per-step scalars for experiment trackers: TensorBoard, and a hook for any other.

Every trained step of the run's history gives one dict of scalars (:func:`step_scalars`,
from the projection's :class:`~rolloutlog.controller.metrics.projection.StepRow`), handed to each
:class:`StepSink` as the step is folded. :class:`StepPublisher` keeps the sinks
consistent with the history across restores: a step is written once; when a restore
re-trains steps that were already written (in the abandoned branch), the sink is first
told to ``purge(from_step)``, then the history's steps are written again.

:class:`TensorBoardSink` writes TensorBoard event files with tensorboardX (the
``tensorboard`` extra: ``pip install 'rolloutlog[tensorboard]'``). Its purge is
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
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from rolloutlog.eventstore.errors import RolloutlogError

from .fold import MetricsProjection, StepRow

#: A ``tensorboardX.proto.event_pb2.Event`` (tensorboardX is optional and untyped).
Event = Any

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
#: What a missing tensorboardX says (one line, naming the extra).
TENSORBOARD_MISSING = (
    "TensorBoard files need tensorboardX, which is not installed: "
    "pip install 'rolloutlog[tensorboard]'"
)


class TensorBoardUnavailableError(RolloutlogError, ImportError):
    """tensorboardX is not installed (the ``tensorboard`` extra)."""


def _tensorboardx() -> Any:
    """The tensorboardX modules the sink uses (raises :class:`TensorBoardUnavailableError`).

    Importing tensorboardX sets ``CRC32C_SW_MODE`` in ``os.environ`` when it is unset;
    library code changes nothing process-wide, so that is undone here."""
    unset = "CRC32C_SW_MODE" not in os.environ
    try:
        import tensorboardX.event_file_writer as writer
        import tensorboardX.record_writer as records
        from tensorboardX.proto import event_pb2, summary_pb2
    except ImportError as exc:
        raise TensorBoardUnavailableError(TENSORBOARD_MISSING) from exc
    finally:
        if unset:
            os.environ.pop("CRC32C_SW_MODE", None)

    class Modules:
        EventsWriter = writer.EventsWriter
        masked_crc32c = records.masked_crc32c
        Event = event_pb2.Event
        SessionLog = event_pb2.SessionLog
        Summary = summary_pb2.Summary

    return Modules


def read_records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (CRCs checked with tensorboardX's CRC-32C; a torn
    tail, from a crash, ends it)."""
    masked = _tensorboardx().masked_crc32c
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        length_bytes = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        end = pos + 12 + length + 4
        if length_crc != masked(length_bytes) or end > len(data):
            return
        record = data[pos + 12 : pos + 12 + length]
        (crc,) = struct.unpack("<I", data[end - 4 : end])
        if crc != masked(record):
            return
        yield record
        pos = end


def read_events(path: Path) -> Iterator[Event]:
    """The ``Event`` protobufs of one event file."""
    event_class = _tensorboardx().Event
    for record in read_records(path):
        yield event_class.FromString(record)


def is_purge(event: Event) -> bool:
    """Whether ``event`` is TensorBoard's purge marker (``SessionLog.START``)."""
    start = _tensorboardx().SessionLog.START
    return bool(event.HasField("session_log") and event.session_log.status == start)


def event_scalars(event: Event) -> dict[str, float]:
    """The scalars of one event (tag -> value)."""
    return {v.tag: v.simple_value for v in event.summary.value if v.HasField("simple_value")}


def read_scalars(directory: Path) -> dict[int, dict[str, float]]:
    """What TensorBoard shows for ``directory``: step -> scalars, files in name order,
    a ``SessionLog.START`` at step N dropping the steps >= N read before it."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for event in read_events(path):
            if is_purge(event):
                out = {s: v for s, v in out.items() if s < event.step}
            scalars = event_scalars(event)
            if scalars:
                out.setdefault(event.step, {}).update(scalars)
    return out


class TensorBoardSink:
    """Writes per-step scalars as TensorBoard event files under ``directory`` with
    tensorboardX: one new file per process, each event written and flushed at once (no
    writer thread). Raises :class:`TensorBoardUnavailableError` without tensorboardX."""

    def __init__(self, directory: Path) -> None:
        self._tbx = _tensorboardx()
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # tensorboardX names files by the second; TensorBoard reads them in name order,
        # so the microseconds (then the pid) order two processes of the same second.
        micros = int(time.time() % 1 * 1_000_000)
        self._writer = self._tbx.EventsWriter(
            str(directory / "events"), filename_suffix=f".{micros:06d}.{os.getpid()}"
        )
        self._writer.flush()
        self.path = Path(self._writer._file_name)

    def written_offsets(self) -> dict[int, float]:
        """step -> log offset of the steps the directory already holds (for a new
        process: :class:`StepPublisher` writes only what is missing or different)."""
        return {
            step: scalars[OFFSET_TAG]
            for step, scalars in read_scalars(self.directory).items()
            if OFFSET_TAG in scalars
        }

    def _write(self, event: Event) -> None:
        self._writer.write_event(event)
        self._writer.flush()

    def write_step(self, step: int, scalars: Mapping[str, float], wall_time: float) -> None:
        """One scalar event per step, all tags in it."""
        summary = self._tbx.Summary(
            value=[self._tbx.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        )
        self._write(self._tbx.Event(wall_time=wall_time, step=step, summary=summary))

    def purge(self, from_step: int) -> None:
        """TensorBoard drops the steps >= ``from_step`` written before this marker."""
        start = self._tbx.SessionLog(status=self._tbx.SessionLog.START)
        self._write(self._tbx.Event(wall_time=time.time(), step=from_step, session_log=start))

    def close(self) -> None:
        """Close the file."""
        self._writer.close()
