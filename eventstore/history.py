"""Which offsets make up a run's history, given its epochs (shared by every backend).

Epoch ``e`` writes offsets ``first_seq(e) .. first_seq(e+1) - 1`` and continues the
history from ``resume_seq(e)``. A restore to offset ``k`` opens an epoch with
``resume_seq = k``: the events after ``k`` written by older epochs stay stored (for
audit and salvage) but leave the history.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Protocol

from .errors import StoreError
from .records import StoredEvent


def history_segments(
    run_id: str,
    epochs: Sequence[tuple[int, int]],
    last_seq: int,
    to_seq: int | None = None,
) -> list[tuple[int, int]]:
    """Inclusive ``(first, last)`` offset ranges of the history, oldest first.

    ``epochs``: ``(first_seq, resume_seq)`` of every epoch, oldest first. Without
    ``to_seq``: the history up to the newest event; with it: the history that led to
    offset ``to_seq``.
    """
    target = last_seq if to_seq is None else to_seq
    if not 0 <= target <= last_seq:
        raise StoreError(f"offset {target} is outside run {run_id!r} (1..{last_seq})")
    writes = [
        (first, (epochs[i + 1][0] - 1) if i + 1 < len(epochs) else last_seq, resume)
        for i, (first, resume) in enumerate(epochs)
    ]
    segments: list[tuple[int, int]] = []
    upto = target
    if to_seq is None and writes:
        # The current history is the newest epoch's, even when it has written nothing
        # yet (a restore that stopped after opening its epoch): its resume offset holds.
        first, end, resume = writes.pop()
        if first <= end:
            segments.append((first, end))
        upto = resume
    # Walk back: take the range of the epoch that wrote `upto`, then continue from that
    # epoch's resume offset.
    for first, end, resume in reversed(writes):
        if upto == 0:
            break
        if not first <= upto <= end:
            continue
        segments.append((first, upto))
        upto = resume
    segments.reverse()
    return segments


def skipped_ranges(segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive ``(first, last)`` offset ranges between consecutive history segments:
    the rows of branches that a restore abandoned, which a reader of the history passes
    over."""
    return [
        (prev_last + 1, first - 1)
        for (_, prev_last), (first, _) in pairwise(segments)
        if first > prev_last + 1
    ]


class _Segmented(Protocol):
    def history_segments(self, run_id: str, to_seq: int | None = None) -> list[tuple[int, int]]: ...

    def read(
        self, run_id: str, from_seq: int = 1, to_seq: int | None = None
    ) -> Iterator[StoredEvent]: ...

    def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None: ...


def history_ranges(
    store: _Segmented, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
) -> Iterator[tuple[int, int]]:
    """The inclusive offset ranges to read for the history from ``from_seq`` on, in order.

    Before each range, the abandoned rows between it and the previous one (from
    ``from_seq`` on) are checked whole with ``check_whole``: a read checks only the rows
    it streams, so without this a row missing from a skipped branch would go unseen by
    the history's readers while a reader of every row (``metrics``, ``audit``) reports
    it. The check is a count in the database over the skipped rows' primary key range,
    so its cost is proportional to the rows the history skips (none without restores).
    """
    prev_last: int | None = None
    for first, last in store.history_segments(run_id, to_seq):
        skipped_from = prev_last + 1 if prev_last is not None and first > prev_last + 1 else None
        prev_last = last
        if last < from_seq:
            continue
        if skipped_from is not None and first - 1 >= from_seq:
            store.check_whole(run_id, first - 1, from_seq=max(skipped_from, from_seq))
        yield max(first, from_seq), last


def read_history(
    store: _Segmented, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
) -> Iterator[StoredEvent]:
    """The events of a store's history (its segments) from ``from_seq`` on, in order; the
    rows of abandoned branches it passes over are checked whole (:func:`history_ranges`)."""
    for first, last in history_ranges(store, run_id, to_seq, from_seq=from_seq):
        yield from store.read(run_id, first, last)
