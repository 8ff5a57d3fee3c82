"""Retention: compact a run's old history down to a snapshot (``rolloutlog compact``).

A compaction keeps everything needed to rebuild the run at any offset at or after a
*base*: the newest snapshot at or before the requested offset that lies in the run's
current history. It removes, in one transaction:

* every event with ``seq < base`` (the history before the base and the ranges that
  restores abandoned before it); the event *at* the base is kept, so a checkpoint that
  sits exactly on the base can still be restored;
* every snapshot older than the base;
* payloads referenced only by removed events: a payload that a kept event or a kept
  snapshot still refers to (a completion of a group that is live at the base) stays.

With an archive path the removed rows are first written to a JSONL file (fsynced, then
renamed into place), one object per line: a ``compaction`` header, then ``event``,
``snapshot`` and ``payload`` rows with every column (binary columns base64).
:func:`read_archive` reads it back. Each compaction is recorded in the ``compactions``
table (revision 0003); :func:`check_replayable` turns a rebuild that would need removed
events into a :class:`CompactedHistoryError` that names the compaction.

Derived rows (the tables of the store's indexers, see :mod:`rolloutlog.eventstore.indexing`, plus
any the caller names in ``derived_tables``) follow their events: the rows of removed
events are removed in the same transaction and archived as ``derived`` lines.

The store is generic: which payload ids an event or a snapshot refers to is the
caller's knowledge. Events: :func:`json_payload_refs` (a top-level ``payload_id`` string
of the JSON payload) by default. Snapshots: ``snapshot_refs``; without it no payload is
removed, since a kept snapshot might still need any of them.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .errors import RunNotFoundError, StoreError
from .indexing import check_table_name
from .records import Snapshot, StoredEvent
from .schema import compactions, events, payloads, runs, snapshots
from .store import EventStore, _parse_ts

ARCHIVE_FORMAT = 1
#: Payload ids deleted per statement (well under every driver's parameter limit).
_DELETE_CHUNK = 500

EventRefs = Callable[[StoredEvent], Iterable[str]]
SnapshotRefs = Callable[[bytes], Iterable[str]]


class CompactionError(StoreError):
    """A compaction was refused (no usable snapshot, nothing to do, archive exists...)."""


class CompactedHistoryError(StoreError):
    """A rebuild needs events that a compaction removed; names that compaction."""


@dataclass(frozen=True)
class CompactionRecord:
    """One row of the ``compactions`` table."""

    run_id: str
    upto_seq: int
    snapshot_seq: int
    compacted_at: datetime
    events_removed: int
    snapshots_removed: int
    payloads_removed: int
    archive: str | None

    def describe(self) -> str:
        """A one-line description for error messages."""
        where = f", archived to {self.archive}" if self.archive else ", not archived"
        return (
            f"compacted at {self.compacted_at.isoformat(timespec='seconds')}: events "
            f"1..{self.upto_seq} removed, base snapshot at offset {self.snapshot_seq}{where}"
        )


@dataclass
class CompactionPlan:
    """What a compaction removes (``dry_run``: would remove) and keeps."""

    run_id: str
    before_offset: int
    snapshot_seq: int
    upto_seq: int
    events_removed: int = 0
    history_events_removed: int = 0
    abandoned_events_removed: int = 0
    snapshots_removed: list[int] = field(default_factory=list)
    payloads_removed: list[str] = field(default_factory=list)
    payloads_kept: int = 0
    #: Derived rows removed (would be removed), per derived table.
    derived_removed: dict[str, int] = field(default_factory=dict)
    archive: str | None = None
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (payload ids counted, not listed)."""
        out = asdict(self)
        out["payloads_removed"] = len(self.payloads_removed)
        out["snapshots_removed"] = len(self.snapshots_removed)
        return out


@dataclass
class Archive:
    """The rows a compaction exported, as read back by :func:`read_archive`."""

    header: dict[str, Any]
    events: list[StoredEvent]
    snapshots: list[Snapshot]
    payloads: dict[str, tuple[str, bytes]]  # payload_id -> (kind, data)
    #: Derived rows (column -> value) of the removed events, per derived table.
    derived: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def json_payload_refs(event: StoredEvent) -> Iterable[str]:
    """The default event reference rule: a top-level ``"payload_id"`` string."""
    if '"payload_id"' not in event.payload:
        return ()
    value = json.loads(event.payload).get("payload_id")
    return (value,) if isinstance(value, str) else ()


# ---------------------------------------------------------------------------- records
def _sql_store(store: object) -> EventStore | None:
    # Only the SQL backends can be compacted; the in-memory store never is.
    return store if isinstance(store, EventStore) else None


def list_compactions(store: object, run_id: str) -> list[CompactionRecord]:
    """The run's compactions, oldest first (always empty for a non-SQL store)."""
    sql = _sql_store(store)
    if sql is None:
        return []
    with sql._translate_errors(f"reading the compactions of run {run_id!r}"):
        with sql.engine.connect() as conn:
            rows = conn.execute(
                sa.select(compactions)
                .where(compactions.c.run_id == run_id)
                .order_by(compactions.c.upto_seq)
            ).all()
    return [
        CompactionRecord(
            r.run_id,
            r.upto_seq,
            r.snapshot_seq,
            _parse_ts(r.compacted_at),
            r.events_removed,
            r.snapshots_removed,
            r.payloads_removed,
            r.archive,
        )
        for r in rows
    ]


def compaction_base(store: object, run_id: str) -> CompactionRecord | None:
    """The run's newest compaction (its base snapshot), or None if never compacted."""
    done = list_compactions(store, run_id)
    return done[-1] if done else None


def check_replayable(
    store: object,
    run_id: str,
    segments: Sequence[tuple[int, int]],
    start_seq: int,
    to_seq: int | None,
) -> None:
    """Raise :class:`CompactedHistoryError` if rebuilding needs removed events.

    ``segments``: the history being replayed; ``start_seq``: the offset the rebuild
    starts after (the snapshot it loaded, 0 without one). Every event read is then
    ``> start_seq``; one ``<= upto_seq`` of the newest compaction is gone.
    """
    base = compaction_base(store, run_id)
    if base is None:
        return
    for first, last in segments:
        lo = max(first, start_seq + 1)
        if lo <= last and lo <= base.upto_seq:
            target = "the end of the history" if to_seq is None else f"offset {to_seq}"
            raise CompactedHistoryError(
                f"run {run_id!r} cannot be rebuilt at {target}: it needs events from offset "
                f"{lo}, but the run was {base.describe()}. Restore or replay at an offset "
                f">= {base.snapshot_seq} whose history passes through that snapshot"
                + (f", or read the removed events from {base.archive}" if base.archive else "")
            )


# ---------------------------------------------------------------------------- compaction
def compact(
    store: EventStore,
    run_id: str,
    before_offset: int,
    *,
    archive: str | Path | None = None,
    dry_run: bool = False,
    event_refs: EventRefs = json_payload_refs,
    snapshot_refs: SnapshotRefs | None = None,
    verify_snapshot: Callable[[Snapshot], None] | None = None,
    derived_tables: Sequence[str] = (),
) -> CompactionPlan:
    """Compact ``run_id`` up to the newest current-history snapshot ``<= before_offset``.

    ``archive``: export the removed rows to this JSONL file first (refused if it exists).
    ``dry_run``: compute and return the plan, change nothing, write no archive.
    ``verify_snapshot``: called on the base snapshot before anything is removed (e.g.
    decode it); an exception aborts the compaction. ``derived_tables``: index tables
    keyed by ``(run_id, seq)`` whose rows follow their events, besides those of the
    store's registered indexers. See the module docstring for what is removed and kept.
    Raises :class:`CompactionError` when there is nothing to compact.
    """
    info = store.get_run(run_id)
    if not 1 <= before_offset <= info.last_seq:
        raise CompactionError(
            f"offset {before_offset} is outside run {run_id!r} (1..{info.last_seq})"
        )
    current = store.history_segments(run_id)
    base = _choose_base(store, run_id, before_offset, current)
    previous = compaction_base(store, run_id)
    if previous is not None and base.seq <= previous.snapshot_seq:
        raise CompactionError(
            f"run {run_id!r} is already {previous.describe()}; the newest snapshot at or "
            f"before offset {before_offset} in the current history is at {base.seq}: "
            "nothing more to compact"
        )
    if verify_snapshot is not None:
        verify_snapshot(base)
    archive_path = Path(archive) if archive is not None else None
    if archive_path is not None and archive_path.exists() and not dry_run:
        raise CompactionError(f"archive {archive_path} already exists: choose a new file")
    upto = base.seq - 1
    plan = CompactionPlan(
        run_id=run_id,
        before_offset=before_offset,
        snapshot_seq=base.seq,
        upto_seq=upto,
        archive=str(archive_path) if archive_path is not None else None,
        dry_run=dry_run,
    )
    tables = list(dict.fromkeys([*(ix.table for ix in store.indexers), *derived_tables]))
    for table in tables:
        check_table_name(table)
        plan.derived_removed[table] = _count_derived(store, table, run_id, upto)
    in_history = [(f, min(last, upto)) for f, last in current if f <= upto]
    candidates: set[str] = set()
    for row in store.read(run_id, 1, upto):
        plan.events_removed += 1
        if any(f <= row.seq <= last for f, last in in_history):
            plan.history_events_removed += 1
        candidates.update(event_refs(row))
    plan.abandoned_events_removed = plan.events_removed - plan.history_events_removed
    plan.snapshots_removed = _snapshot_seqs(store, run_id, below=base.seq)
    if snapshot_refs is not None and candidates:
        needed = _kept_refs(store, run_id, upto, base.seq, event_refs, snapshot_refs)
        existing = _existing_payloads(store, run_id, candidates)
        plan.payloads_removed = sorted(existing - needed)
        plan.payloads_kept = len(existing & needed)
    else:
        plan.payloads_kept = len(candidates)
    if dry_run:
        return plan
    if archive_path is not None:
        _write_archive(store, plan, archive_path)
    _delete(store, plan)
    return plan


def _count_derived(store: EventStore, table: str, run_id: str, upto: int) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(f"SELECT COUNT(*) FROM {table} WHERE run_id = :r AND seq <= :u"),
                {"r": run_id, "u": upto},
            ).scalar_one()
        )


def _choose_base(
    store: EventStore, run_id: str, before_offset: int, current: Sequence[tuple[int, int]]
) -> Snapshot:
    """The newest snapshot ``<= before_offset`` whose offset is in the current history."""
    bound = before_offset
    while True:
        snap = store.load_snapshot(run_id, at_or_before=bound)
        if snap is None:
            raise CompactionError(
                f"run {run_id!r} has no snapshot at or before offset {before_offset} in its "
                "current history: take a snapshot of the run first or compact before a "
                "later offset"
            )
        if any(first <= snap.seq <= last for first, last in current):
            return snap
        bound = snap.seq - 1  # a snapshot of an abandoned branch: look further back


def _snapshot_seqs(store: EventStore, run_id: str, *, below: int) -> list[int]:
    with store.engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(snapshots.c.seq)
                .where(snapshots.c.run_id == run_id, snapshots.c.seq < below)
                .order_by(snapshots.c.seq)
            ).scalars()
        )


def _kept_refs(
    store: EventStore,
    run_id: str,
    upto: int,
    base_seq: int,
    event_refs: EventRefs,
    snapshot_refs: SnapshotRefs,
) -> set[str]:
    """Payload ids that kept events and kept snapshots refer to."""
    needed: set[str] = set()
    for row in store.read(run_id, upto + 1):
        needed.update(event_refs(row))
    with store.engine.connect() as conn:
        seqs = list(
            conn.execute(
                sa.select(snapshots.c.seq).where(
                    snapshots.c.run_id == run_id, snapshots.c.seq >= base_seq
                )
            ).scalars()
        )
    for seq in seqs:
        snap = store.load_snapshot(run_id, at_or_before=seq)
        if snap is not None:
            needed.update(snapshot_refs(snap.data))
    return needed


def _existing_payloads(store: EventStore, run_id: str, ids: set[str]) -> set[str]:
    found: set[str] = set()
    ordered = sorted(ids)
    with store.engine.connect() as conn:
        for i in range(0, len(ordered), _DELETE_CHUNK):
            chunk = ordered[i : i + _DELETE_CHUNK]
            found.update(
                conn.execute(
                    sa.select(payloads.c.payload_id).where(
                        payloads.c.run_id == run_id, payloads.c.payload_id.in_(chunk)
                    )
                ).scalars()
            )
    return found


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _write_archive(store: EventStore, plan: CompactionPlan, path: Path) -> None:
    """Write every row the plan removes to ``path`` (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".partial")
    run_id = plan.run_id
    with tmp.open("w", encoding="utf-8") as out:
        header = {
            "kind": "compaction",
            "format": ARCHIVE_FORMAT,
            "run_id": run_id,
            "upto_seq": plan.upto_seq,
            "snapshot_seq": plan.snapshot_seq,
            "events": plan.events_removed,
            "snapshots": len(plan.snapshots_removed),
            "payloads": len(plan.payloads_removed),
            "written_at": datetime.now(UTC).isoformat(),
        }
        out.write(json.dumps(header) + "\n")
        for row in store.read(run_id, 1, plan.upto_seq):
            rec = {"kind": "event", **row._asdict()}
            rec["recorded_at"] = row.recorded_at.isoformat()
            out.write(json.dumps(rec) + "\n")
        for seq in plan.snapshots_removed:
            snap = store.load_snapshot(run_id, at_or_before=seq)
            assert snap is not None and snap.seq == seq
            out.write(
                json.dumps(
                    {
                        "kind": "snapshot",
                        "run_id": run_id,
                        "seq": snap.seq,
                        "schema_version": snap.schema_version,
                        "created_at": snap.created_at.isoformat(),
                        "data": _b64(snap.data),
                    }
                )
                + "\n"
            )
        with store.engine.connect() as conn:
            for table in plan.derived_removed:
                res = conn.execute(
                    sa.text(f"SELECT * FROM {table} WHERE run_id = :r AND seq <= :u ORDER BY seq"),
                    {"r": run_id, "u": plan.upto_seq},
                )
                for r in res.mappings():
                    out.write(
                        json.dumps({"kind": "derived", "table": table, "row": dict(r)}, default=str)
                        + "\n"
                    )
            for i in range(0, len(plan.payloads_removed), _DELETE_CHUNK):
                chunk = plan.payloads_removed[i : i + _DELETE_CHUNK]
                rows = conn.execute(
                    sa.select(payloads.c.payload_id, payloads.c.kind, payloads.c.data).where(
                        payloads.c.run_id == run_id, payloads.c.payload_id.in_(chunk)
                    )
                ).all()
                for pr in rows:
                    out.write(
                        json.dumps(
                            {
                                "kind": "payload",
                                "run_id": run_id,
                                "payload_id": pr.payload_id,
                                "payload_kind": pr.kind,
                                "data": _b64(bytes(pr.data)),
                            }
                        )
                        + "\n"
                    )
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _delete(store: EventStore, plan: CompactionPlan) -> None:
    """Remove the plan's rows and record the compaction, in one write transaction."""
    run_id = plan.run_id
    with store._translate_errors(f"compacting run {run_id!r}"):
        with store._writer.begin() as conn:
            # Serialise with appends and restores of this run (PostgreSQL row lock; on
            # SQLite the write transaction already holds the database's write lock).
            row = conn.execute(
                sa.select(runs.c.last_seq).where(runs.c.run_id == run_id).with_for_update()
            ).first()
            if row is None:
                raise RunNotFoundError(f"no run {run_id!r}")
            current = store.history_segments(run_id)
            if not any(f <= plan.snapshot_seq <= last for f, last in current):
                raise CompactionError(
                    f"run {run_id!r} was restored while compacting: offset "
                    f"{plan.snapshot_seq} left its history; nothing was removed"
                )
            done = conn.execute(
                sa.select(sa.func.max(compactions.c.snapshot_seq)).where(
                    compactions.c.run_id == run_id
                )
            ).scalar()
            if done is not None and done >= plan.snapshot_seq:
                raise CompactionError(
                    f"run {run_id!r} was compacted concurrently up to {done}; nothing removed"
                )
            removed = conn.execute(
                events.delete().where(events.c.run_id == run_id, events.c.seq <= plan.upto_seq)
            ).rowcount
            if removed != plan.events_removed:
                raise CompactionError(
                    f"run {run_id!r}: expected to remove {plan.events_removed} events, found "
                    f"{removed}; rolled back"
                )
            for table, count in plan.derived_removed.items():
                gone = conn.execute(
                    sa.text(f"DELETE FROM {table} WHERE run_id = :r AND seq <= :u"),
                    {"r": run_id, "u": plan.upto_seq},
                ).rowcount
                if gone != count:
                    raise CompactionError(
                        f"run {run_id!r}: expected to remove {count} rows of {table}, found "
                        f"{gone}; rolled back"
                    )
            conn.execute(
                snapshots.delete().where(
                    snapshots.c.run_id == run_id, snapshots.c.seq < plan.snapshot_seq
                )
            )
            for i in range(0, len(plan.payloads_removed), _DELETE_CHUNK):
                chunk = plan.payloads_removed[i : i + _DELETE_CHUNK]
                conn.execute(
                    payloads.delete().where(
                        payloads.c.run_id == run_id, payloads.c.payload_id.in_(chunk)
                    )
                )
            conn.execute(
                compactions.insert().values(
                    run_id=run_id,
                    upto_seq=plan.upto_seq,
                    snapshot_seq=plan.snapshot_seq,
                    compacted_at=datetime.now(UTC),
                    events_removed=plan.events_removed,
                    snapshots_removed=len(plan.snapshots_removed),
                    payloads_removed=len(plan.payloads_removed),
                    archive=plan.archive,
                )
            )


# ---------------------------------------------------------------------------- archive
def iter_archive(path: str | Path) -> Iterator[dict[str, Any]]:
    """The archive's JSON objects, in file order."""
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_archive(path: str | Path) -> Archive:
    """Read a compaction archive back into records (binary columns decoded)."""
    header: dict[str, Any] | None = None
    evs: list[StoredEvent] = []
    snaps: list[Snapshot] = []
    pays: dict[str, tuple[str, bytes]] = {}
    derived: dict[str, list[dict[str, Any]]] = {}
    for rec in iter_archive(path):
        kind = rec.pop("kind")
        if kind == "compaction":
            if rec.get("format") != ARCHIVE_FORMAT:
                raise CompactionError(f"{path}: unknown archive format {rec.get('format')!r}")
            header = rec
        elif kind == "event":
            rec["recorded_at"] = datetime.fromisoformat(rec["recorded_at"])
            # Archives written before revision 0005 also carry the rollout audit columns
            # the events table had then; the event is the rest.
            evs.append(StoredEvent(**{f: rec[f] for f in StoredEvent._fields}))
        elif kind == "derived":
            derived.setdefault(rec["table"], []).append(rec["row"])
        elif kind == "snapshot":
            snaps.append(
                Snapshot(
                    rec["run_id"],
                    rec["seq"],
                    rec["schema_version"],
                    datetime.fromisoformat(rec["created_at"]),
                    base64.b64decode(rec["data"]),
                )
            )
        elif kind == "payload":
            pays[rec["payload_id"]] = (rec["payload_kind"], base64.b64decode(rec["data"]))
        else:
            raise CompactionError(f"{path}: unknown archive record kind {kind!r}")
    if header is None:
        raise CompactionError(f"{path} has no compaction header: not a rolloutlog archive")
    return Archive(header, evs, snaps, pays, derived)
