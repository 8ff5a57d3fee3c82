"""The rollout index: the controller's audit keys of each event, beside the generic log.

The store knows nothing about rollouts. The keys audit looks events up by (group,
prompt, target step; train step and weight version when recorded) live in the
controller's tables, written by indexers registered with the store (:func:`attach`) in
the same transaction as their events, and compacted with them:

- ``rollout_index``: one row per non-sibling event, every key a column, keyed by
  ``(run_id, seq)``, with partial indexes of the sparse keys and a (type, train step) index.
- ``rollout_sibling_index``: one narrow ``(run_id, seq, group_id)`` row per sibling event
  (nine in ten events; on SQLite a ``WITHOUT ROWID`` table).
- ``rollout_step_marks``: the sibling events' train step and weight version as marks, a
  row at the last event of each run of equal values; an event takes the first mark at or
  after it.

The tables come from the controller's alembic branch ``rollout_index``
(``controller/index_migrations``, registered on import: :data:`SCHEMA_BRANCH`).
Lookups (:func:`read_where`) and history reads (:func:`read_indexed`) return
:class:`IndexedEvent`: a stored event plus its keys, whichever table holds them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, Index, MetaData, PrimaryKeyConstraint, String, Table

from rolloutlog.eventstore import EventStore, NewEvent, StoredEvent
from rolloutlog.eventstore.errors import StoreError
from rolloutlog.eventstore.history import history_ranges
from rolloutlog.eventstore.schema import events as events_table
from rolloutlog.eventstore.schema import metadata as store_metadata
from rolloutlog.eventstore.schema_branches import SchemaBranch, register_schema_branch

from . import index_migrations
from .domain.events import (
    CODEC,
    AuditKeys,
    RolloutEvent,
    SiblingAborted,
    SiblingCompleted,
    SiblingDispatched,
    SiblingFailed,
)

if TYPE_CHECKING:
    from rolloutlog.eventstore import EventStoreProtocol

#: The controller's tables (alembic compares them with its revisions, like the store's).
# (SQLAlchemy's stubs type the convention as a TypedDict-or-Mapping union dict() refuses.)
metadata = MetaData(naming_convention=dict(store_metadata.naming_convention))  # type: ignore[arg-type]

TABLE = "rollout_index"
rollout_index = Table(
    TABLE,
    metadata,
    Column("run_id", String(128), nullable=False),
    Column("seq", BigInteger, nullable=False),
    # The event's type again: "the batch of step t" is one (type, step) index seek.
    Column("type", String(64), nullable=False),
    # The group / prompt / target step the event is about (NULL when none).
    Column("group_id", BigInteger, nullable=True),
    Column("prompt_index", BigInteger, nullable=True),
    Column("target_step", BigInteger, nullable=True),
    # The trainer's next step and weight version when the event was recorded.
    Column("train_step", BigInteger, nullable=True),
    Column("weight_version", BigInteger, nullable=True),
    PrimaryKeyConstraint("run_id", "seq", name="pk_rollout_index"),
)
# The sparse keys' indexes are partial (revision 0009): an event updates only the B-trees
# of the keys it has. Every lookup is an equality, which implies the key IS NOT NULL.
for _name, _column in (
    ("ix_rollout_index_run_group", rollout_index.c.group_id),
    ("ix_rollout_index_run_prompt", rollout_index.c.prompt_index),
    ("ix_rollout_index_run_target_step", rollout_index.c.target_step),
):
    Index(
        _name,
        rollout_index.c.run_id,
        _column,
        sqlite_where=_column.isnot(None),
        postgresql_where=_column.isnot(None),
    )
# "The batch of step t" is one seek; a step alone, one seek per event type (read_where).
Index(
    "ix_rollout_index_run_type_step",
    rollout_index.c.run_id,
    rollout_index.c.type,
    rollout_index.c.train_step,
)

COLUMNS = (
    "run_id",
    "seq",
    "type",
    "group_id",
    "prompt_index",
    "target_step",
    "train_step",
    "weight_version",
)

#: Event types whose keys are only their group: indexed in ``rollout_sibling_index``.
SIBLING_TYPES: frozenset[str] = frozenset(
    cls.event_type for cls in (SiblingDispatched, SiblingCompleted, SiblingFailed, SiblingAborted)
)

SIBLING_TABLE = "rollout_sibling_index"
rollout_sibling_index = Table(
    SIBLING_TABLE,
    metadata,
    Column("run_id", String(128), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("group_id", BigInteger, nullable=False),
    PrimaryKeyConstraint("run_id", "seq", name="pk_rollout_sibling_index"),
    # SQLite: the rows live in the primary key's B-tree (no rowid table beside it). With
    # three columns, the group index below holds every column: no lookup reads the table.
    sqlite_with_rowid=False,
)
Index(
    "ix_rollout_sibling_index_run_group",
    rollout_sibling_index.c.run_id,
    rollout_sibling_index.c.group_id,
)
SIBLING_COLUMNS = ("run_id", "seq", "group_id")

MARKS_TABLE = "rollout_step_marks"
rollout_step_marks = Table(
    MARKS_TABLE,
    metadata,
    Column("run_id", String(128), nullable=False),
    # The last event of a run of equal values: the values hold for every event after the
    # previous mark, up to and including this one.
    Column("seq", BigInteger, nullable=False),
    Column("train_step", BigInteger, nullable=True),
    Column("weight_version", BigInteger, nullable=True),
    PrimaryKeyConstraint("run_id", "seq", name="pk_rollout_step_marks"),
    sqlite_with_rowid=False,
)
# read_where(train_step=): the marks of a step (a few per step), then their ranges. The
# weight version too, so the index covers every column a lookup reads (SQLite's planner
# would otherwise range the primary key of the run instead).
Index(
    "ix_rollout_step_marks_run_train_step",
    rollout_step_marks.c.run_id,
    rollout_step_marks.c.train_step,
    rollout_step_marks.c.weight_version,
)
MARKS_COLUMNS = ("run_id", "seq", "train_step", "weight_version")

#: Every table of the rollout index (a compaction removes their rows with the events).
TABLES = (TABLE, SIBLING_TABLE, MARKS_TABLE)


class IndexedEvent(NamedTuple):
    """A stored event with its rollout index keys (NULL keys: an event without a row)."""

    run_id: str
    seq: int
    epoch: int
    type: str
    schema_version: int
    payload: str
    recorded_at: datetime
    train_step: int | None
    weight_version: int | None
    group_id: int | None
    prompt_index: int | None
    target_step: int | None

    @classmethod
    def of(cls, row: StoredEvent, derived: tuple[Any, ...] | None) -> IndexedEvent:
        """Join a stored event with its ``rollout_index`` row (in :data:`COLUMNS` order)."""
        if derived is None:
            return cls(*row, None, None, None, None, None)
        _r, _s, _t, gid, pidx, tstep, step, wv = derived
        return cls(*row, step, wv, gid, pidx, tstep)

    @classmethod
    def of_sibling(
        cls, row: StoredEvent, group_id: int, mark: tuple[Any, ...] | None
    ) -> IndexedEvent:
        """Join a sibling event with its group and its step mark (in MARKS_COLUMNS order)."""
        step, wv = (None, None) if mark is None else (mark[2], mark[3])
        return cls(*row, step, wv, group_id, None, None)


class RolloutIndexer:
    """The :class:`rolloutlog.eventstore.Indexer` of ``rollout_index``.

    Reads each event's ``derived`` tuple, ``(group_id, prompt_index, target_step,
    train_step, weight_version)`` as :func:`encode` builds it; events without one (not
    written by the controller) get no row, nor do sibling events (:class:`SiblingIndexer`).
    """

    table = TABLE
    columns = COLUMNS

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        """One row per event that carries rollout keys and is not a sibling event."""
        # (Checks inlined: this runs for every event of every append.)
        return [
            (run_id, first_seq + i, ev[0], *d)
            for i, ev in enumerate(batch)
            if (d := ev[4]) is not None and (ev[0] not in SIBLING_TYPES or d[0] is None)
        ]


class SiblingIndexer:
    """The :class:`rolloutlog.eventstore.Indexer` of ``rollout_sibling_index``: the group
    of each sibling event."""

    table = SIBLING_TABLE
    columns = SIBLING_COLUMNS

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        """One ``(run_id, seq, group_id)`` row per sibling event."""
        return [
            (run_id, first_seq + i, d[0])
            for i, ev in enumerate(batch)
            if ev[0] in SIBLING_TYPES and (d := ev[4]) is not None and d[0] is not None
        ]


class StepMarkIndexer:
    """The :class:`rolloutlog.eventstore.Indexer` of ``rollout_step_marks``: a mark at the
    last event of each run of equal (train step, weight version) in a batch."""

    table = MARKS_TABLE
    columns = MARKS_COLUMNS

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        """The batch's marks (at least one when any event carries keys)."""
        out: list[tuple[Any, ...]] = []
        step: Any = None
        version: Any = None
        at = 0  # 0: no keyed event yet (offsets start at 1)
        # (Compared column by column, no tuple per event: this runs for every event.)
        for i, ev in enumerate(batch, first_seq):
            derived = ev[4]
            if derived is None:
                continue
            if derived[3] != step or derived[4] != version:
                if at:
                    out.append((run_id, at, step, version))
                step, version = derived[3], derived[4]
            at = i
        if at:
            out.append((run_id, at, step, version))
        return out


ROLLOUT_INDEXER = RolloutIndexer()
SIBLING_INDEXER = SiblingIndexer()
STEP_MARK_INDEXER = StepMarkIndexer()
INDEXERS = (ROLLOUT_INDEXER, SIBLING_INDEXER, STEP_MARK_INDEXER)

#: The alembic branch that creates these tables (``controller/index_migrations``).
#: Registered when this module is imported: a process that runs or reads rollouts
#: creates, checks and upgrades them with the store's tables; one that uses the store
#: alone never sees them.
SCHEMA_BRANCH = SchemaBranch(
    "rollout_index", Path(index_migrations.__file__).resolve().parent, metadata
)
register_schema_branch(SCHEMA_BRANCH)


def attach(store: EventStoreProtocol) -> None:
    """Have ``store`` write the rollout index in every append (idempotent)."""
    for indexer in INDEXERS:
        store.add_indexer(indexer)


def encode(
    event: RolloutEvent,
    *,
    recorded_at: datetime,
    train_step: int | None = None,
    weight_version: int | None = None,
) -> NewEvent:
    """A rollout event as a row to append, carrying its keys for :data:`ROLLOUT_INDEXER`."""
    keys: AuditKeys = event.audit_keys()  # (group_id, prompt_index, target_step)
    return CODEC.encode(event, recorded_at=recorded_at, derived=(*keys, train_step, weight_version))


def encode_many(
    events: Sequence[RolloutEvent],
    *,
    recorded_at: datetime,
    train_step: int | None = None,
    weight_version: int | None = None,
) -> list[NewEvent]:
    """:func:`encode` of one command's events (one time, one trainer state), in one call."""
    return CODEC.encode_many(
        events,
        recorded_at=recorded_at,
        derived=[(*ev.audit_keys(), train_step, weight_version) for ev in events],
    )


# ---------------------------------------------------------------- reads
#: Events read per chunk by :func:`read_indexed` (bounds memory on long histories).
_CHUNK = 5000


class _Marks:
    """The step marks covering events ``lo..hi`` of a run, looked up in sequence order."""

    def __init__(self, store: EventStoreProtocol, run_id: str, lo: int, hi: int) -> None:
        self.rows = store.derived_rows(MARKS_TABLE, run_id, lo, hi)
        # The events after the last mark in range belong to the next mark after it.
        self.rows += store.derived_rows(MARKS_TABLE, run_id, hi + 1, limit=1)
        self.i = 0

    def at(self, seq: int) -> tuple[Any, ...] | None:
        """The first mark at or after ``seq`` (calls come with increasing ``seq``)."""
        rows = self.rows
        while self.i < len(rows) and rows[self.i][1] < seq:
            self.i += 1
        return rows[self.i] if self.i < len(rows) else None


def read_indexed(
    store: EventStoreProtocol, run_id: str, from_seq: int = 1, to_seq: int | None = None
) -> Iterator[IndexedEvent]:
    """Events ``from_seq..to_seq`` in order, each with its index keys."""
    attach(store)
    upper = store.last_seq(run_id) if to_seq is None else to_seq
    lo = max(1, from_seq)
    while lo <= upper:
        hi = min(upper, lo + _CHUNK - 1)
        keys = {r[1]: r for r in store.derived_rows(TABLE, run_id, lo, hi)}
        groups = {r[1]: r[2] for r in store.derived_rows(SIBLING_TABLE, run_id, lo, hi)}
        marks = _Marks(store, run_id, lo, hi) if groups else None
        for row in store.read(run_id, lo, hi):
            group = groups.get(row.seq)
            if group is not None and marks is not None:
                yield IndexedEvent.of_sibling(row, group, marks.at(row.seq))
            else:
                yield IndexedEvent.of(row, keys.get(row.seq))
        lo = hi + 1


def read_history_indexed(
    store: EventStoreProtocol, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
) -> Iterator[IndexedEvent]:
    """The history (see :meth:`EventStore.history_segments`) with index keys, in order;
    the rows of abandoned branches it passes over are checked whole
    (:func:`~rolloutlog.eventstore.history.history_ranges`)."""
    for first, last in history_ranges(store, run_id, to_seq, from_seq=from_seq):
        yield from read_indexed(store, run_id, first, last)


def read_where(
    store: EventStoreProtocol,
    run_id: str,
    *,
    group_id: int | None = None,
    prompt_index: int | None = None,
    train_step: int | None = None,
    target_step: int | None = None,
    event_type: str | None = None,
) -> list[IndexedEvent]:
    """Events of one group / prompt / step (and / or of one type), through the index, in
    order (all of the run's events, abandoned ones included, when no key is given).

    Sibling events have no prompt or target step; a lookup by a sibling event type alone
    reads the run's sibling rows (there is no type index of them).
    """
    equals = {
        k: v
        for k, v in (
            ("group_id", group_id),
            ("prompt_index", prompt_index),
            ("train_step", train_step),
            ("target_step", target_step),
            ("type", event_type),
        )
        if v is not None
    }
    if not equals:
        return list(read_indexed(store, run_id))
    attach(store)
    out: list[IndexedEvent] = []
    if event_type is None or event_type not in SIBLING_TYPES:
        out += _keyed_where(store, run_id, equals)
    if (
        prompt_index is None
        and target_step is None
        and (event_type is None or event_type in SIBLING_TYPES)
    ):
        if isinstance(store, EventStore):
            out += _sql_sibling_where(store, run_id, group_id, train_step, event_type)
        else:
            out += _sibling_where(store, run_id, group_id, train_step, event_type)
    out.sort(key=lambda r: r.seq)
    return out


def _keyed_where(
    store: EventStoreProtocol, run_id: str, equals: dict[str, Any]
) -> list[IndexedEvent]:
    """The events of ``rollout_index`` (not sibling events) whose keys equal ``equals``."""
    if isinstance(store, EventStore):
        return _sql_read_where(store, run_id, equals)
    event_type = equals.get("type")
    keyed = {k: v for k, v in equals.items() if k != "type"}
    if not keyed:  # the in-memory store looks derived rows up by key: filter a type here
        rows = store.derived_rows(TABLE, run_id)
    else:
        rows = store.derived_rows(TABLE, run_id, **keyed)
    out = []
    for derived in rows:
        if event_type is not None and derived[2] != event_type:
            continue
        for row in store.read(run_id, derived[1], derived[1]):
            out.append(IndexedEvent.of(row, derived))
    return out


def _sibling_where(
    store: EventStoreProtocol,
    run_id: str,
    group_id: int | None,
    train_step: int | None,
    event_type: str | None,
) -> list[IndexedEvent]:
    """Sibling events of a group and / or step and / or type (any store; few rows)."""
    if group_id is not None:
        rows = store.derived_rows(SIBLING_TABLE, run_id, group_id=group_id)
    else:
        rows = store.derived_rows(SIBLING_TABLE, run_id)
    if not rows:
        return []
    marks = _Marks(store, run_id, rows[0][1], rows[-1][1])
    out = []
    for _run, seq, group in rows:
        mark = marks.at(seq)
        if train_step is not None and (mark is None or mark[2] != train_step):
            continue
        for row in store.read(run_id, seq, seq):
            if event_type is None or row.type == event_type:
                out.append(IndexedEvent.of_sibling(row, group, mark))
    return out


#: The run's distinct event types in the index: a loose scan of the (type, step) index,
#: one seek per type (both databases run it as such; neither skip-scans on its own).
_RUN_TYPES = sa.text(
    """
WITH RECURSIVE t(type) AS (
    SELECT MIN(type) FROM rollout_index WHERE run_id = :run_id
    UNION ALL
    SELECT (SELECT MIN(ix.type) FROM rollout_index ix
            WHERE ix.run_id = :run_id AND ix.type > t.type)
    FROM t WHERE t.type IS NOT NULL
)
SELECT type FROM t WHERE type IS NOT NULL
"""
)


def _sql_read_where(store: EventStore, run_id: str, equals: dict[str, Any]) -> list[IndexedEvent]:
    """One indexed join (the equality columns' index, then the events primary key)."""
    ix, ev = rollout_index, events_table
    q = sa.select(
        ev.c.run_id,
        ev.c.seq,
        ev.c.epoch,
        ev.c.type,
        ev.c.schema_version,
        ev.c.payload,
        ev.c.recorded_at,
        ix.c.train_step,
        ix.c.weight_version,
        ix.c.group_id,
        ix.c.prompt_index,
        ix.c.target_step,
    ).select_from(ix.join(ev, sa.and_(ev.c.run_id == ix.c.run_id, ev.c.seq == ix.c.seq)))
    q = q.where(ix.c.run_id == run_id, *(ix.c[k] == v for k, v in equals.items()))
    # No ORDER BY: SQLite's planner (no statistics) would walk the primary key to skip
    # the sort instead of seeking the key's index; the rows are sorted here instead.
    with store.engine.connect() as conn:
        if set(equals) == {"train_step"}:
            # No index starts with the step (revision 0010): seek (type, step) per type.
            types = conn.execute(_RUN_TYPES, {"run_id": run_id}).scalars().all()
            q = q.where(ix.c.type.in_(types))
        rows = conn.execute(q).all()
    return [IndexedEvent._make((*r[:6], _utc(r[6]), *r[7:])) for r in rows]


#: A sibling event's step mark: the first mark at or after it (one primary-key seek).
_MARK_OF = """
LEFT JOIN rollout_step_marks m ON m.run_id = sx.run_id AND m.seq = (
    SELECT MIN(m2.seq) FROM rollout_step_marks m2
    WHERE m2.run_id = sx.run_id AND m2.seq >= sx.seq)
"""
_SIBLING_COLS = (
    "ev.run_id, ev.seq, ev.epoch, ev.type, ev.schema_version, ev.payload, ev.recorded_at, "
    "m.train_step, m.weight_version, sx.group_id"
)
#: The sibling events of a step: the step's marks (its index), each mark's range back to
#: the mark before it, the sibling rows in that range (primary-key ranges). MATERIALIZED:
#: without statistics SQLite would rather walk the run's sibling rows and probe marks.
_SIBLINGS_OF_STEP = f"""
WITH r AS MATERIALIZED (
    SELECT m.seq AS hi, m.train_step, m.weight_version,
           COALESCE((SELECT MAX(p.seq) FROM rollout_step_marks p
                     WHERE p.run_id = m.run_id AND p.seq < m.seq), 0) AS lo
    FROM rollout_step_marks m WHERE m.run_id = :run_id AND m.train_step = :train_step
)
SELECT {_SIBLING_COLS.replace("m.train_step, m.weight_version", "r.train_step, r.weight_version")}
FROM r
JOIN rollout_sibling_index sx ON sx.run_id = :run_id AND sx.seq > r.lo AND sx.seq <= r.hi
JOIN events ev ON ev.run_id = sx.run_id AND ev.seq = sx.seq
"""


def sibling_query(
    group_id: int | None, train_step: int | None, event_type: str | None
) -> tuple[str, dict[str, Any]]:
    """The SQL (``:run_id`` and the keys given) of :func:`read_where`'s sibling events: by
    the group index, by the step marks' index and their ranges, or the run's rows."""
    params: dict[str, Any] = {}
    where = []
    if group_id is not None:
        sql = (
            f"SELECT {_SIBLING_COLS} FROM rollout_sibling_index sx "
            "JOIN events ev ON ev.run_id = sx.run_id AND ev.seq = sx.seq "
            f"{_MARK_OF} WHERE sx.run_id = :run_id AND sx.group_id = :group_id"
        )
        params["group_id"] = group_id
        if train_step is not None:
            where.append("m.train_step = :train_step")
            params["train_step"] = train_step
    elif train_step is not None:
        sql = f"SELECT * FROM ({_SIBLINGS_OF_STEP}) s WHERE 1 = 1"
        params["train_step"] = train_step
    else:
        sql = (
            f"SELECT {_SIBLING_COLS} FROM rollout_sibling_index sx "
            "JOIN events ev ON ev.run_id = sx.run_id AND ev.seq = sx.seq "
            f"{_MARK_OF} WHERE sx.run_id = :run_id"
        )
    if event_type is not None:
        wrapped = group_id is None and train_step is not None  # columns of subquery s
        where.append(f"{'type' if wrapped else 'ev.type'} = :type")
        params["type"] = event_type
    if where:
        sql += " AND " + " AND ".join(where)
    return sql, params


def _sql_sibling_where(
    store: EventStore,
    run_id: str,
    group_id: int | None,
    train_step: int | None,
    event_type: str | None,
) -> list[IndexedEvent]:
    """Sibling events of a group, a step or a type (see :func:`sibling_query`)."""
    sql, params = sibling_query(group_id, train_step, event_type)
    with store.engine.connect() as conn:
        typed = sa.text(sql).columns(recorded_at=events_table.c.recorded_at.type)
        rows = conn.execute(typed, {"run_id": run_id, **params}).all()
    return [IndexedEvent._make((*r[:6], _utc(r[6]), r[7], r[8], r[9], None, None)) for r in rows]


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


#: Group ids per lookup of :func:`read_groups` (bounds the statement's size).
_GROUP_CHUNK = 500


class GroupEventRow(NamedTuple):
    """An event as :func:`read_groups` returns it: what decoding and folding need."""

    seq: int
    epoch: int
    type: str
    schema_version: int
    payload: str


def read_groups(
    store: EventStoreProtocol,
    run_id: str,
    group_ids: Sequence[int],
    event_types: frozenset[str],
    *,
    from_group: int | None = None,
) -> Iterator[GroupEventRow]:
    """The events of types ``event_types`` (none of them a sibling event type) of the
    groups ``group_ids`` and, if ``from_group`` is given, of every group id at or above it,
    in every epoch (abandoned branches included), through the group index. Each group's
    events come in log order (groups in no particular order); on SQL the cost is that of
    the events returned, not of the run's history."""
    if event_types & SIBLING_TYPES:
        raise StoreError(
            f"read_groups reads rollout_index events, not sibling events "
            f"({sorted(event_types & SIBLING_TYPES)})"
        )
    attach(store)
    wanted = sorted({int(g) for g in group_ids})
    if isinstance(store, EventStore):
        yield from _sql_read_groups(store, run_id, wanted, sorted(event_types), from_group)
        return
    # Any other store (in memory): one pass over its index rows.
    live = set(wanted)
    for derived in store.derived_rows(TABLE, run_id):
        gid = derived[3]
        if derived[2] not in event_types or gid is None:
            continue
        if gid in live or (from_group is not None and gid >= from_group):
            for row in store.read(run_id, derived[1], derived[1]):
                yield GroupEventRow(row.seq, row.epoch, row.type, row.schema_version, row.payload)


def _ints(values: Sequence[int]) -> str:
    """Ints as an SQL list (``int()`` each: nothing but digits enters the statement)."""
    return ", ".join(str(int(v)) for v in values)


def _sql_read_groups(
    store: EventStore,
    run_id: str,
    group_ids: list[int],
    event_types: list[str],
    from_group: int | None,
) -> Iterator[GroupEventRow]:
    """:func:`read_groups` on SQL: chunks of group ids (the group index's seeks, then the
    events primary key), and one range of the group index above ``from_group``. Driver
    SQL, plain tuples: the group ids are ints, written into the statement."""
    mark = "?" if store.engine.dialect.name == "sqlite" else "%s"
    base = (
        "SELECT ev.seq, ev.epoch, ev.type, ev.schema_version, ev.payload "
        "FROM rollout_index ix JOIN events ev ON ev.run_id = ix.run_id AND ev.seq = ix.seq "
        f"WHERE ix.run_id = {mark} AND ix.type IN ({', '.join([mark] * len(event_types))})"
    )
    params = (run_id, *event_types)
    queries = [
        f"{base} AND ix.group_id IN ({_ints(group_ids[i : i + _GROUP_CHUNK])})"
        for i in range(0, len(group_ids), _GROUP_CHUNK)
    ]
    if from_group is not None:
        # Group ids above the live ones' (admitted by an abandoned branch, not yet again).
        above = f"{base} AND ix.group_id >= {int(from_group):d}"
        live_above = [g for g in group_ids if g >= from_group]
        if live_above:
            above += f" AND ix.group_id NOT IN ({_ints(live_above)})"
        queries.append(above)
    make = GroupEventRow._make
    for sql in queries:
        with store.engine.connect() as conn:  # a short read per chunk
            rows = list(conn.exec_driver_sql(sql, params).all())
        rows.sort(key=lambda r: r[0])
        for r in rows:
            yield make(r)
