"""The rollout index: the controller's audit keys of each event, beside the generic log.

The event store knows nothing about rollouts. The keys audit looks events up by (the
group, prompt and target step an event is about; the train step and weight version when
it was recorded) live in the controller's own table ``rollout_index``, one row per event
keyed by ``(run_id, seq)``. :data:`ROLLOUT_INDEXER` is registered with the store
(:func:`attach`) and writes those rows in the same transaction as their events, so a row
exists exactly when its event does; a compaction removes them with their events.

The table is created by the controller's own alembic revisions
(``controller/index_migrations``): ``0004_rollout_index`` created it and backfilled it
from the audit columns the ``events`` table had in revisions 0001-0003, and
``0006_rollout_views`` re-created the audit views on top of it; ``0009`` made the
indexes of the sparse keys partial; ``0010`` dropped the train-step index (the
type-and-step index serves a step alone).

Lookups (:func:`read_where`) and history reads (:func:`read_indexed`) return
:class:`IndexedEvent`: a stored event plus its keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, Index, MetaData, PrimaryKeyConstraint, String, Table

from rolloutlog.eventstore import EventStore, NewEvent, StoredEvent
from rolloutlog.eventstore.schema import events as events_table
from rolloutlog.eventstore.schema import metadata as store_metadata

from .domain.events import CODEC, AuditKeys, RolloutEvent

if TYPE_CHECKING:
    from rolloutlog.eventstore import EventStoreProtocol

#: The controller's tables (alembic compares them with its revisions, like the store's).
metadata = MetaData(naming_convention=dict(store_metadata.naming_convention))

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
#: The audit keys a lookup can filter on.
KEYS = ("group_id", "prompt_index", "target_step", "train_step")


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


class RolloutIndexer:
    """The :class:`rolloutlog.eventstore.Indexer` of ``rollout_index``.

    Reads each event's ``derived`` tuple, ``(group_id, prompt_index, target_step,
    train_step, weight_version)`` as :func:`encode` builds it; events without one (not
    written by the controller) get no row.
    """

    table = TABLE
    columns = COLUMNS

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        """One row per event that carries rollout keys."""
        return [
            (run_id, first_seq + i, ev.type, *ev.derived)
            for i, ev in enumerate(batch)
            if ev.derived is not None
        ]


ROLLOUT_INDEXER = RolloutIndexer()


def attach(store: EventStoreProtocol) -> None:
    """Have ``store`` write the rollout index in every append (idempotent)."""
    store.add_indexer(ROLLOUT_INDEXER)


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
        for row in store.read(run_id, lo, hi):
            yield IndexedEvent.of(row, keys.get(row.seq))
        lo = hi + 1


def read_history_indexed(
    store: EventStoreProtocol, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
) -> Iterator[IndexedEvent]:
    """The history (see :meth:`EventStore.history_segments`) with index keys, in order."""
    for first, last in store.history_segments(run_id, to_seq):
        if last < from_seq:
            continue
        yield from read_indexed(store, run_id, max(first, from_seq), last)


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
    order (all of the run's events, abandoned ones included, when no key is given)."""
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
    if event_type is not None and not isinstance(store, EventStore):
        # The in-memory store's derived rows are looked up by key; filter its rows instead.
        keyed = read_where(
            store,
            run_id,
            group_id=group_id,
            prompt_index=prompt_index,
            train_step=train_step,
            target_step=target_step,
        )
        return [row for row in keyed if row.type == event_type]
    if isinstance(store, EventStore):
        return _sql_read_where(store, run_id, equals)
    attach(store)
    out = []
    for derived in store.derived_rows(TABLE, run_id, **equals):
        for row in store.read(run_id, derived[1], derived[1]):
            out.append(IndexedEvent.of(row, derived))
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
    out = [IndexedEvent(*r[:6], _utc(r[6]), *r[7:]) for r in rows]
    out.sort(key=lambda r: r.seq)
    return out


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
