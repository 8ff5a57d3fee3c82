"""An in-memory event store with exactly the contract of :class:`EventStore`.

For tests and benchmarks (the durability-overhead baseline). It raises the same errors
in the same situations — conflicts, fencing, unknown runs, missing payloads — and is
run through the same contract suite as the SQLite and PostgreSQL backends. Nothing
survives the process.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from .errors import (
    AppendConflictError,
    CorruptLogError,
    EpochFencedError,
    PayloadNotFoundError,
    RunExistsError,
    RunNotFoundError,
    StoreError,
)
from .history import history_segments, read_history
from .indexing import Indexer, check_indexer
from .records import NewEvent, PayloadPut, RunInfo, Snapshot, StoredEvent


@dataclass
class _Run:
    info: RunInfo
    events: list[StoredEvent] = field(default_factory=list)
    epochs: list[tuple[int, int]] = field(default_factory=list)  # (first_seq, resume_seq)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    payloads: dict[str, bytes] = field(default_factory=dict)
    # Derived rows of each indexer's table, in sequence order.
    derived: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)


class MemoryEventStore:
    """The :class:`EventStore` API over Python lists, guarded by one lock."""

    dialect = "memory"
    readonly = False

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self.url = "memory://"
        self._indexers: list[Indexer] = []

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> MemoryEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFoundError(f"no run {run_id!r} in memory")
        return run

    # ------------------------------------------------------------------ runs
    def create_run(
        self,
        run_id: str,
        *,
        config_fingerprint: str = "",
        config_json: str = "{}",
        epoch: int = 1,
        first_events: Sequence[NewEvent] = (),
        payload_puts: Sequence[PayloadPut] = (),
    ) -> RunInfo:
        """Register a new run with its first events, atomically (see ``EventStore.create_run``)."""
        if not run_id or len(run_id) > 128:
            raise StoreError(f"run id must be 1..128 characters, got {run_id!r}")
        if payload_puts and not first_events:
            raise StoreError("payloads must be written together with the events that use them")
        with self._lock:
            if run_id in self._runs:
                raise RunExistsError(f"run {run_id!r} already exists")
            info = RunInfo(run_id, datetime.now(UTC), config_fingerprint, config_json, epoch, 0)
            run = _Run(info=info, epochs=[(1, 0)])
            if first_events:
                self._append_locked(run, first_events, 1, epoch, payload_puts)
            self._runs[run_id] = run
            return run.info

    def get_run(self, run_id: str) -> RunInfo:
        """The run's row."""
        with self._lock:
            return self._run(run_id).info

    def list_runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        with self._lock:
            return sorted((r.info for r in self._runs.values()), key=lambda i: i.created_at)

    def open_epoch(
        self,
        run_id: str,
        *,
        expected_epoch: int | None = None,
        resume_seq: int | None = None,
        lock_timeout_s: float | None = None,
    ) -> int:
        """Raise the epoch (see :meth:`EventStore.open_epoch`; no locks to time out)."""
        with self._lock:
            run = self._run(run_id)
            info = run.info
            if expected_epoch is not None and info.current_epoch != expected_epoch:
                raise EpochFencedError(run_id, expected_epoch, info.current_epoch)
            resume = info.last_seq if resume_seq is None else resume_seq
            if not 0 <= resume <= info.last_seq:
                raise StoreError(
                    f"cannot resume run {run_id!r} from offset {resume}: "
                    f"the log holds offsets 1..{info.last_seq}"
                )
            run.info = replace(info, current_epoch=info.current_epoch + 1)
            run.epochs.append((info.last_seq + 1, resume))
            return info.current_epoch + 1

    def history_segments(self, run_id: str, to_seq: int | None = None) -> list[tuple[int, int]]:
        """See :meth:`EventStore.history_segments`."""
        with self._lock:
            run = self._run(run_id)
            return history_segments(run_id, list(run.epochs), run.info.last_seq, to_seq)

    def read_history(
        self, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
    ) -> Iterator[StoredEvent]:
        """See :meth:`EventStore.read_history`."""
        return read_history(self, run_id, to_seq, from_seq=from_seq)

    # ------------------------------------------------------------------ append / read
    def append(
        self,
        run_id: str,
        batch: Sequence[NewEvent],
        *,
        expected_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut] = (),
        lock_timeout_s: float | None = None,
    ) -> int:
        """See :meth:`EventStore.append`: all or nothing, same errors (no locks to time out)."""
        if not batch and not payload_puts:
            return expected_seq - 1
        if expected_seq < 1:
            raise StoreError(f"expected_seq must be >= 1, got {expected_seq}")
        with self._lock:
            return self._append_locked(self._run(run_id), batch, expected_seq, epoch, payload_puts)

    def _append_locked(
        self,
        run: _Run,
        batch: Sequence[NewEvent],
        expected_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut],
    ) -> int:
        run_id = run.info.run_id
        # The caller holds the lock.
        info = run.info
        if info.current_epoch != epoch:
            raise EpochFencedError(run_id, epoch, info.current_epoch)
        if batch and info.last_seq + 1 != expected_seq:
            raise AppendConflictError(run_id, expected_seq, info.last_seq + 1)
        # Build the derived rows first: an indexer that fails leaves nothing written.
        derived = [(ix.table, ix.rows(run_id, expected_seq, batch)) for ix in self._indexers]
        if any(not isinstance(ev.payload, str) for ev in batch):
            raise StoreError(f"appending to run {run_id!r}: an event payload is not text")
        for p in payload_puts:
            run.payloads.setdefault(p.payload_id, bytes(p.data))
        for i, ev in enumerate(batch):
            run.events.append(
                StoredEvent(
                    run_id,
                    expected_seq + i,
                    epoch,
                    ev.type,
                    ev.schema_version,
                    ev.payload,
                    ev.recorded_at.astimezone(UTC),
                )
            )
        if batch:
            for table, rows in derived:
                run.derived.setdefault(table, []).extend(rows)
        last = expected_seq + len(batch) - 1 if batch else info.last_seq
        run.info = replace(info, last_seq=last)
        return expected_seq + len(batch) - 1

    def last_seq(self, run_id: str) -> int:
        """Sequence of the newest event (0 when empty)."""
        return self.get_run(run_id).last_seq

    def read(
        self,
        run_id: str,
        from_seq: int = 1,
        to_seq: int | None = None,
        *,
        page_size: int = 2000,
    ) -> Iterator[StoredEvent]:
        """Events ``from_seq..to_seq`` in order, page by page like the SQL store (events
        appended between pages are seen).

        Checks the log is whole as :meth:`EventStore.read` does (:class:`CorruptLogError`).
        An unknown run has no events.
        """
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return
            last = run.info.last_seq
            _check_ends(run_id, run.events, last)
        expected = max(1, from_seq)
        upper = last if to_seq is None else min(to_seq, last)
        while expected <= upper:
            with self._lock:
                last = run.info.last_seq
                upper = last if to_seq is None else min(to_seq, last)
                lo = bisect.bisect_left(run.events, expected, key=lambda e: e.seq)
                hi = bisect.bisect_right(run.events, upper, key=lambda e: e.seq)
                chunk = run.events[lo : min(hi, lo + page_size)]
            for row in chunk:
                if row.seq != expected:
                    if row.seq < expected:
                        raise CorruptLogError(
                            run_id, row.seq, "duplicate", "the offset is stored twice"
                        )
                    raise CorruptLogError(
                        run_id, expected, "missing", f"offsets must run from 1 to last_seq = {last}"
                    )
                expected += 1
                yield row
            if len(chunk) < page_size:
                break
        if expected <= upper:
            raise CorruptLogError(
                run_id, expected, "missing", f"offsets must run from 1 to last_seq = {last}"
            )

    def check_log(self, run_id: str | None = None) -> None:
        """See :meth:`EventStore.check_log`."""
        with self._lock:
            found = [
                (rid, list(run.events), run.info.last_seq)
                for rid, run in self._runs.items()
                if run_id is None or rid == run_id
            ]
        for rid, events, last in found:
            _check_ends(rid, events, last)
            _check_range(rid, events, 1, last, last)

    def add_indexer(self, indexer: Indexer) -> None:
        """See :meth:`EventStore.add_indexer`."""
        with self._lock:
            if any(ix is indexer for ix in self._indexers):
                return
            check_indexer(indexer, self._indexers)
            self._indexers.append(indexer)

    @property
    def indexers(self) -> tuple[Indexer, ...]:
        """The registered indexers, in registration order."""
        return tuple(self._indexers)

    def derived_rows(
        self,
        table: str,
        run_id: str,
        from_seq: int = 1,
        to_seq: int | None = None,
        *,
        limit: int | None = None,
        **equals: Any,
    ) -> list[tuple[Any, ...]]:
        """See :meth:`EventStore.derived_rows`."""
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise StoreError(f"limit must be an int >= 0, got {limit!r}")
        with self._lock:
            indexer = next((ix for ix in self._indexers if ix.table == table), None)
            if indexer is None:
                raise StoreError(f"no indexer writes table {table!r}: add_indexer() it first")
            unknown = sorted(set(equals) - set(indexer.columns))
            if unknown:
                raise StoreError(f"table {table!r} has no columns {unknown}")
            rows = list(self._runs[run_id].derived.get(table, ())) if run_id in self._runs else []
        hi = 2**62 if to_seq is None else to_seq
        where = [(indexer.columns.index(c), v) for c, v in equals.items()]
        out = [r for r in rows if from_seq <= r[1] <= hi and all(r[k] == v for k, v in where)]
        return out if limit is None else out[:limit]

    # ------------------------------------------------------------------ snapshots / payloads
    def save_snapshot(self, run_id: str, seq: int, schema_version: int, data: bytes) -> None:
        """Store a state blob covering ``1..seq``."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise StoreError(f"saving a snapshot of run {run_id!r}: data must be bytes")
        with self._lock:
            self._run(run_id).snapshots[seq] = Snapshot(
                run_id, seq, schema_version, datetime.now(UTC), bytes(data)
            )

    def load_snapshot(
        self, run_id: str, at_or_before: int | None = None, *, check: bool = True
    ) -> Snapshot | None:
        """The newest snapshot with ``seq <= at_or_before`` (the log checked whole up to
        it unless ``check`` is False: see :meth:`EventStore.load_snapshot`)."""
        with self._lock:
            if run_id not in self._runs:
                return None
            snaps = self._runs[run_id].snapshots
            keys = sorted(snaps)
            if at_or_before is not None:
                keys = keys[: bisect.bisect_right(keys, at_or_before)]
            snap = snaps[keys[-1]] if keys else None
        if snap is not None and check:
            self.check_log(run_id)
        return snap

    def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None:
        """See :meth:`EventStore.check_whole`: the ends, then offsets ``from_seq..upto``."""
        with self._lock:
            if run_id not in self._runs:
                return
            run = self._runs[run_id]
            events, last = list(run.events), run.info.last_seq
        _check_ends(run_id, events, last)
        _check_range(run_id, events, max(1, from_seq), min(upto, last), last)

    def put_payload(self, run_id: str, payload_id: str, kind: str, data: bytes) -> None:
        """Store a payload (idempotent by id)."""
        if not isinstance(kind, str) or not isinstance(data, bytes | bytearray | memoryview):
            raise StoreError(f"storing payload {payload_id!r}: kind must be text, data bytes")
        with self._lock:
            self._run(run_id).payloads.setdefault(payload_id, bytes(data))

    def get_payload(self, run_id: str, payload_id: str) -> bytes:
        """A payload's bytes."""
        with self._lock:
            run = self._runs.get(run_id)
            data = run.payloads.get(payload_id) if run is not None else None
        if data is None:
            raise PayloadNotFoundError(f"no payload {payload_id!r} in run {run_id!r}")
        return data


def _check_range(run_id: str, events: list[StoredEvent], lo: int, hi: int, last: int) -> None:
    """The rows with offsets in ``lo..hi`` must be exactly ``lo, lo + 1, .. hi`` in order
    (the first wrong one is named)."""
    if hi < lo:
        return
    got = [e.seq for e in events if lo <= e.seq <= hi]
    why = f"offsets must run from 1 to last_seq = {last}"
    for expected, seq in zip(range(lo, hi + 1), got, strict=False):
        if seq != expected:
            if seq < expected:
                raise CorruptLogError(run_id, seq, "duplicate", why)
            raise CorruptLogError(run_id, expected, "missing", why)
    if len(got) < hi - lo + 1:
        raise CorruptLogError(run_id, lo + len(got), "missing", why)
    if len(got) > hi - lo + 1:
        raise CorruptLogError(run_id, got[hi - lo + 1], "duplicate", why)


def _check_ends(run_id: str, events: list[StoredEvent], last: int) -> None:
    """The stored rows must end at ``last`` (an extra row beyond it, or rows missing at the end)."""
    beyond = [e.seq for e in events if e.seq > last] if events and events[-1].seq > last else []
    if beyond:
        raise CorruptLogError(run_id, min(beyond), "extra", f"beyond last_seq = {last}")
    if last and (not events or events[-1].seq < last):
        missing = events[-1].seq + 1 if events else 1
        raise CorruptLogError(
            run_id, missing, "missing", f"offsets must run from 1 to last_seq = {last}"
        )
