"""Metrics that survive compaction: the *metrics base* of a compacted run.

A compaction removes every event before its base snapshot; the domain state survives in
the snapshot, but counters, the step and restore series and the origin of
``wall_seconds`` are a fold of the removed events too. So :func:`compact_with_metrics`
(behind ``rolloutlog compact``) first folds the metrics up to the base and stores the
:class:`MetricsProjection` (without its domain state) and the :class:`WorkTotals` as one
zlib-compressed JSON payload (``kind="metrics_base"``, id ``metrics-base:<offset>``). No
event refers to it, so no compaction removes it, and restores never read it.

:func:`load_metrics_base` is where every metrics reader of a compacted run starts. A run
compacted without one starts from the domain snapshot at the base, with a warning:
gauges are right, counters, series and ``wall_seconds`` count from the base on.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutlog.eventstore import (
    EventStore,
    EventStoreProtocol,
    PayloadNotFoundError,
    Snapshot,
    StoreError,
)
from rolloutlog.eventstore.compaction import (
    CompactedHistoryError,
    CompactionError,
    CompactionPlan,
    compact,
    compaction_base,
)

from ..snapshot_encoder import decode_snapshot
from .fold import MetricsProjection, WorkTotals

log = logging.getLogger(__name__)

#: The ``kind`` of a metrics base payload.
METRICS_BASE_KIND = "metrics_base"
#: The version of the payload's JSON layout.
METRICS_BASE_FORMAT = 1


def metrics_base_id(seq: int) -> str:
    """The payload id of the metrics base at offset ``seq``."""
    return f"metrics-base:{seq}"


@dataclass
class MetricsBase:
    """Where the metrics of a compacted run start: the projection of its history and
    the work totals of every stored event, both up to and including offset ``seq``.

    ``complete`` is False when no metrics base was saved for the compaction: then both
    start at the domain snapshot with zero counts (see the module docstring)."""

    seq: int
    projection: MetricsProjection
    work: WorkTotals
    complete: bool = True

    def start(self) -> tuple[MetricsProjection, WorkTotals]:
        """Independent copies to fold on (the projection with its domain state)."""
        return self.projection.copy(), self.work.copy()


def encode_metrics_base(projection: MetricsProjection, work: WorkTotals) -> bytes:
    """The payload bytes of a metrics base (the projection's domain state left out)."""
    body = {
        "format": METRICS_BASE_FORMAT,
        "seq": projection.offset,
        "projection": projection.to_snapshot(),
        "work": work.to_snapshot(),
    }
    return zlib.compress(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), 6)


def decode_metrics_base(data: bytes) -> dict[str, Any]:
    """The JSON body of a metrics base payload (ValueError for an unknown format)."""
    body: dict[str, Any] = json.loads(zlib.decompress(data))
    if body.get("format") != METRICS_BASE_FORMAT:
        raise ValueError(f"unknown metrics base format {body.get('format')!r}")
    return body


def save_metrics_base(store: EventStoreProtocol, run_id: str, seq: int) -> MetricsBase:
    """Fold the run's metrics up to offset ``seq`` (the history leading to it, and the
    work of every stored event up to it) and store them as the metrics base at ``seq``.

    Call it before a compaction to ``seq`` removes the events it reads (a run already
    compacted starts from its current metrics base). Raises when the fold does not end
    exactly at ``seq``.
    """
    from .live import ProjectionFollower

    follower = ProjectionFollower(keep_checkpoints=0)
    follower.sync(store, run_id, to_seq=seq)
    proj, work = follower.projection, follower.work
    if proj.offset != seq or proj.state is None:
        raise ValueError(
            f"run {run_id!r}: the metrics fold ended at offset {proj.offset}, not at {seq}"
        )
    store.put_payload(
        run_id, metrics_base_id(seq), METRICS_BASE_KIND, encode_metrics_base(proj, work)
    )
    log.info("metrics: saved the metrics base of run %s at offset %s", run_id, seq)
    return MetricsBase(seq, proj.copy(), work.copy())


def load_metrics_base(store: EventStoreProtocol, run_id: str) -> MetricsBase | None:
    """Where the metrics of ``run_id`` start: None for a run never compacted (start
    from the first event), else the metrics base at its compaction's base snapshot (or,
    without one, the fallback described in the module docstring).

    Raises :class:`CompactedHistoryError` when not even the base snapshot is readable.
    """
    record = compaction_base(store, run_id)
    if record is None:
        return None
    seq = record.snapshot_seq
    snap: Snapshot | None = store.load_snapshot(run_id, at_or_before=seq)
    if snap is None or snap.seq != seq:
        raise CompactedHistoryError(
            f"run {run_id!r} was {record.describe()}, but its base snapshot is gone: its "
            "metrics cannot be computed"
        )
    try:
        state = decode_snapshot(snap.data)
    except Exception as exc:
        raise CompactedHistoryError(
            f"run {run_id!r} was {record.describe()}, but its base snapshot does not decode "
            f"({exc}): its metrics cannot be computed"
        ) from exc
    try:
        body = decode_metrics_base(store.get_payload(run_id, metrics_base_id(seq)))
        projection = MetricsProjection.from_snapshot(body["projection"], state)
        work = WorkTotals.from_snapshot(body["work"])
    except PayloadNotFoundError:
        log.warning(
            "metrics: run %s has no metrics base at offset %s (it was compacted by the "
            "library's compact() alone, or before metrics bases existed; %s): its counters, "
            "step series and wall_seconds count from offset %s on",
            run_id,
            seq,
            record.describe(),
            seq + 1,
        )
        segments = store.history_segments(run_id, seq)
        fallback = MetricsProjection.from_domain_state(state, segments)
        return MetricsBase(seq, fallback, WorkTotals(), complete=False)
    return MetricsBase(seq, projection, work)


def compact_with_metrics(
    store: EventStore,
    run_id: str,
    before_offset: int,
    *,
    archive: str | Path | None = None,
    dry_run: bool = False,
    verify_snapshot: Callable[[Snapshot], None] | None = None,
    **kwargs: Any,
) -> CompactionPlan:
    """:func:`rolloutlog.eventstore.compaction.compact`, saving the metrics base at the
    base snapshot first (not in a dry run), so the run's metrics survive.

    The metrics base is saved from the ``verify_snapshot`` hook, after the base was
    chosen and verified and before anything is removed; a failure to save it aborts the
    compaction (nothing is removed). ``kwargs`` go to ``compact``.
    """

    def verify(snap: Snapshot) -> None:
        if verify_snapshot is not None:
            verify_snapshot(snap)
        if dry_run:
            return
        try:
            save_metrics_base(store, run_id, snap.seq)
        except StoreError:
            raise
        except Exception as exc:  # a fold error: say so, as a refusal (nothing removed)
            raise CompactionError(
                f"run {run_id!r}: computing the metrics base at offset {snap.seq} failed "
                f"({type(exc).__name__}: {exc}); nothing was removed"
            ) from exc

    return compact(
        store,
        run_id,
        before_offset,
        archive=archive,
        dry_run=dry_run,
        verify_snapshot=verify,
        **kwargs,
    )
