"""Range reports: the metrics of any stored run and offset range, recomputed offline
from the log (``rolloutlog metrics``, ``rolloutlog report``, tests comparing live with
offline values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolloutlog.eventstore import EventStoreProtocol

from .exposition import Family
from .fold import MetricsProjection, WorkTotals


@dataclass
class RangeReport:
    """The projection of a range of a run: ``final`` (the history) folded up to the
    range's end, ``base`` a copy taken just before its first event (None: from the
    start); ``work`` the work done by every stored event up to the range's end (all
    epochs), ``work_base`` the same just before the range."""

    final: MetricsProjection
    base: MetricsProjection | None
    work: WorkTotals | None = None
    work_base: WorkTotals | None = None

    @property
    def run_id(self) -> str | None:
        """The run (the ``run_id`` label of exported series)."""
        return self.final.run_id

    def values(self) -> dict[str, Any]:
        """See :meth:`MetricsProjection.values` (counters count only the range)."""
        return self.final.values(self.base, work=self.work, work_since=self.work_base)

    def families(self) -> list[Family]:
        """See :meth:`MetricsProjection.families`."""
        return self.final.families(self.base, work=self.work, work_since=self.work_base)


def project_history(
    store: EventStoreProtocol,
    run_id: str,
    *,
    from_seq: int | None = None,
    to_seq: int | None = None,
) -> RangeReport:
    """Recompute the metrics of a stored run offline.

    The history fold always starts at the beginning of the history that leads to
    ``to_seq`` (default: the current history), so gauges are right at ``to_seq``; with
    ``from_seq``, the history counters and the series cover events ``from_seq..to_seq``
    of that history only. The work-done counters count every stored event in
    ``from_seq..to_seq``, all epochs (abandoned branches included).

    A compacted run starts from its metrics base (the fold of the removed events, saved
    by the compaction: see :mod:`rolloutlog.controller.metrics.retention`), so its values
    equal those before the compaction. A range the base cannot serve (``to_seq`` before
    the base, or ``from_seq`` in ``2..base``: the metrics just before it are gone) raises
    :class:`~rolloutlog.eventstore.compaction.CompactedHistoryError`.
    """
    from ..rollout_history import iter_history
    from .live import ProjectionFollower
    from .retention import load_metrics_base

    start = load_metrics_base(store, run_id)
    if start is not None:
        _check_range_after_base(run_id, start.seq, from_seq, to_seq)
        proj = start.start()[0]
    else:
        proj = MetricsProjection()
    base: MetricsProjection | None = None
    for row, event in iter_history(store, run_id, to_seq, from_seq=proj.offset + 1):
        if from_seq is not None and base is None and row.seq >= from_seq:
            base = proj.copy(state=False)
        proj.apply_row(row, event)
    if from_seq is not None and base is None:
        base = proj.copy(state=False)  # the range holds no event of this history
    follower = ProjectionFollower()
    work_base: WorkTotals | None = None
    if from_seq is not None and from_seq > 1:
        follower.sync(store, run_id, to_seq=from_seq - 1)
        work_base = follower.work.copy()
    follower.sync(store, run_id, to_seq=to_seq)
    return RangeReport(
        proj,
        base if from_seq is not None and from_seq > 1 else None,
        follower.work,
        work_base,
    )


def _check_range_after_base(
    run_id: str, base_seq: int, from_seq: int | None, to_seq: int | None
) -> None:
    """Refuse a range of a run compacted at ``base_seq`` that needs removed events."""
    from rolloutlog.eventstore.compaction import CompactedHistoryError

    if to_seq is not None and to_seq < base_seq:
        raise CompactedHistoryError(
            f"run {run_id!r} was compacted up to its snapshot at offset {base_seq}: the "
            f"metrics at offset {to_seq} are gone (ask for offsets >= {base_seq})"
        )
    if from_seq is not None and 1 < from_seq <= base_seq:
        raise CompactedHistoryError(
            f"run {run_id!r} was compacted up to its snapshot at offset {base_seq}: a range "
            f"from offset {from_seq} needs the metrics before it, which are gone (start the "
            f"range at 1 or at {base_seq + 1} or later)"
        )
