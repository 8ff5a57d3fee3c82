"""A run's history read back from the log: decoded events with their rollout index keys
(:func:`iter_history`), the state folded from them with the domain's ``evolve``
(:func:`replay`), and the check of a checkpoint's cursors against a replayed state.

The read side (prompt ledger, replay tool, metrics) and the controller's restore both
build on this; it writes nothing, so the read side needs none of the write side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rolloutlog.eventstore import EventStoreProtocol, StoredEvent
from rolloutlog.eventstore.compaction import check_replayable
from rolloutlog.eventstore.history import skipped_ranges

from .domain import CODEC, evolve, find_violations
from .domain.errors import CursorBehindError
from .domain.events import CheckpointMarked, RolloutEvent
from .domain.state import RunState
from .rollout_index import IndexedEvent, read_history_indexed
from .snapshot_encoder import decode_snapshot

log = logging.getLogger(__name__)


@dataclass
class ReplayResult:
    """A state rebuilt from the log, and how it was rebuilt."""

    state: RunState
    snapshot_offset: int | None
    events_replayed: int
    load_seconds: float
    replay_seconds: float
    #: Seconds spent after the replay waiting for the check that the events before the
    #: snapshot are all stored (it runs beside the replay; 0 when it had finished).
    log_check_seconds: float = 0.0


def iter_history(
    store: EventStoreProtocol, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
) -> Iterator[tuple[IndexedEvent, RolloutEvent]]:
    """Decoded events of the run's history (skipping ranges a restore abandoned), each
    row with its rollout index keys."""
    for row in read_history_indexed(store, run_id, to_seq, from_seq=from_seq):
        yield row, CODEC.decode(row)  # type: ignore[misc]


def replay(
    store: EventStoreProtocol,
    run_id: str,
    to_seq: int | None = None,
    *,
    use_snapshots: bool = True,
    check_each: Callable[[RunState, StoredEvent], None] | None = None,
    check_threads: int = 2,
) -> ReplayResult:
    """Rebuild the state at ``to_seq`` (default: the end of the current history).

    From the newest usable snapshot, the events before it are never read, so they are
    checked whole (:meth:`EventStore.check_whole`, a count over the run's primary key:
    O(log size)) while the snapshot is decoded and the tail replayed: in
    ``check_threads`` disjoint ranges, each counted on a thread of its own, in the
    database and off the GIL (``StoreConfig.log_check_threads``). The rows of branches
    that restores abandoned after the snapshot (or without one) are not read either and
    are counted the same way (a cost proportional to those rows; none on a log without
    restores). Their :class:`CorruptLogError` is raised here, after the replay; a replay
    that fails first still waits for the checks to end, so no thread outlives the call.
    """
    if check_threads < 1:
        raise ValueError(f"check_threads must be >= 1, got {check_threads}")
    with ThreadPoolExecutor(
        max_workers=check_threads, thread_name_prefix="rolloutlog-log-check"
    ) as pool:
        checking: list[Future[None]] = []
        try:
            result = _replay(
                store, run_id, to_seq, use_snapshots, check_each, pool, checking, check_threads
            )
        except BaseException:
            # The replay's own error wins; the check is waited for (the pool's exit).
            for future in checking:
                future.cancel()
            raise
        waited = time.perf_counter()
        for future in checking:
            future.result()  # counts in the database: bounded by the log's size
        result.log_check_seconds = time.perf_counter() - waited
    return result


def check_ranges(upto: int, parts: int) -> list[tuple[int, int]]:
    """Offsets ``1..upto`` as at most ``parts`` disjoint ``(from_seq, upto)`` ranges of
    near-equal length, in order (none when ``upto`` < 1)."""
    parts = max(1, min(parts, upto))
    edges = [upto * k // parts for k in range(parts + 1)]
    return [(edges[k] + 1, edges[k + 1]) for k in range(parts) if edges[k + 1] > edges[k]]


def _replay(
    store: EventStoreProtocol,
    run_id: str,
    to_seq: int | None,
    use_snapshots: bool,
    check_each: Callable[[RunState, StoredEvent], None] | None,
    pool: ThreadPoolExecutor,
    checking: list[Future[None]],
    check_threads: int,
) -> ReplayResult:
    """:func:`replay`'s work; the wholeness checks of the snapshot's events are started
    on ``pool`` and put in ``checking``."""
    started = time.perf_counter()
    segments = store.history_segments(run_id, to_seq)
    state: RunState | None = None
    snap_offset: int | None = None
    counted = 0  # offsets 1..counted are checked whole by a count (the snapshot's prefix)
    if use_snapshots:
        for first, last in reversed(segments):
            snap = store.load_snapshot(run_id, at_or_before=last, check=False)
            if snap is not None and snap.seq >= first:
                for lo, hi in check_ranges(snap.seq, check_threads):
                    checking.append(pool.submit(store.check_whole, run_id, hi, from_seq=lo))
                counted = snap.seq
                try:
                    state = decode_snapshot(snap.data)
                    snap_offset = snap.seq
                except Exception as exc:  # a bad snapshot costs time, never correctness
                    log.warning("ignoring unreadable snapshot at %s: %s", snap.seq, exc)
                    state = None
                break
    # The rows of abandoned branches are never read: checked whole like the snapshot's
    # prefix (which already counts those below the snapshot), so a row missing there is
    # reported as it is by the readers of every row (metrics, audit).
    for lo, hi in skipped_ranges(segments):
        if hi > counted:
            checking.append(
                pool.submit(store.check_whole, run_id, hi, from_seq=max(lo, counted + 1))
            )
    loaded = time.perf_counter()
    if state is None:
        state = RunState()
    # After a compaction, only offsets whose rebuild starts at or after its base work.
    check_replayable(store, run_id, segments, state.last_seq, to_seq)
    count = 0
    upper = segments[-1][1] if segments else 0
    for first, last in segments:
        lo = max(first, state.last_seq + 1)
        if lo > last:
            continue
        for row in store.read(run_id, lo, min(last, upper)):
            evolve(state, CODEC.decode(row), row.seq)  # type: ignore[arg-type]
            count += 1
            if check_each is not None:
                check_each(state, row)
    return ReplayResult(state, snap_offset, count, loaded - started, time.perf_counter() - loaded)


def check_cursors(state: RunState, marker: CheckpointMarked, offset: int) -> None:
    """The checkpoint's recorded cursors must cover the work the log restores."""
    stamps = [g.target_step for g in state.groups.values() if g.target_step is not None]
    newest = max(stamps, default=-1)
    if marker.dispatch_cursor <= newest:
        culprit = next(g for g in state.groups.values() if g.target_step == newest)
        raise CursorBehindError(
            f"checkpoint at offset {offset}: field dispatch_cursor={marker.dispatch_cursor} is "
            f"stale, the restored buffer holds group {culprit.group_id} (prompt "
            f"{culprit.prompt_index}) stamped for step {newest}; refusing to restore rather "
            "than drop prompts",
            groups=(culprit.group_id,),
            offset=offset,
        )
    if marker.dataset_cursor < state.dataset_cursor:
        raise CursorBehindError(
            f"checkpoint at offset {offset}: field dataset_cursor={marker.dataset_cursor} is "
            f"behind the {state.dataset_cursor} prompts the restored state has pulled",
            offset=offset,
        )
    if (marker.dispatch_cursor, marker.dataset_cursor) != (
        state.dispatch_cursor,
        state.dataset_cursor,
    ):
        raise CursorBehindError(
            f"checkpoint at offset {offset} records dispatch_cursor={marker.dispatch_cursor}, "
            f"dataset_cursor={marker.dataset_cursor} but replay gives "
            f"{state.dispatch_cursor}, {state.dataset_cursor}",
            offset=offset,
        )
    violations = [v for v in find_violations(state) if isinstance(v, CursorBehindError)]
    if violations:
        raise violations[0]
