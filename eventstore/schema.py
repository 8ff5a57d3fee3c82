"""SQLAlchemy Core tables: the single source of truth for the log's schema.

The alembic revisions in ``migrations/versions`` create exactly these tables; a test
compares the two. Column names are the ones users see in SQL audit queries. The log is
generic: tables that index events by application keys belong to the application (see
:mod:`rolloutlog.eventstore.indexing`).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)

# Deterministic constraint names so alembic autogenerate/compare agrees across dialects.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

runs = Table(
    "runs",
    metadata,
    Column("run_id", String(128), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("config_fingerprint", String(128), nullable=False),
    Column("config_json", Text, nullable=False),
    # The epoch of the writer that may append; raising it fences every older writer.
    Column("current_epoch", Integer, nullable=False),
    # Sequence of the newest event (0 for an empty run); appends compare-and-set it.
    Column("last_seq", BigInteger, nullable=False),
)

events = Table(
    "events",
    metadata,
    Column("run_id", String(128), nullable=False),
    # Per-run contiguous sequence number: the offset. Starts at 1.
    Column("seq", BigInteger, nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("type", String(64), nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("payload", Text, nullable=False),
    # No secondary index: an append updates only the table and its primary key. Lookups
    # by application keys go through an application's index table, written in the same
    # transaction by an indexer (see eventstore/indexing.py; revision 0005 moved the
    # rollout audit columns of revisions 0001-0003 out of this table).
    PrimaryKeyConstraint("run_id", "seq", name="pk_events"),
)

epochs = Table(
    "epochs",
    metadata,
    Column("run_id", String(128), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("opened_at", DateTime(timezone=True), nullable=False),
    # The offset this epoch's history continues from: events after it that were written
    # by older epochs are abandoned (a restore to a checkpoint), not part of the history.
    Column("resume_seq", BigInteger, nullable=False),
    # First sequence number written by this epoch (last_seq + 1 when it was opened).
    Column("first_seq", BigInteger, nullable=False),
    PrimaryKeyConstraint("run_id", "epoch", name="pk_epochs"),
)

payloads = Table(
    "payloads",
    metadata,
    Column("run_id", String(128), nullable=False),
    Column("payload_id", String(64), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("data", LargeBinary, nullable=False),
    PrimaryKeyConstraint("run_id", "payload_id", name="pk_payloads"),
)

snapshots = Table(
    "snapshots",
    metadata,
    Column("run_id", String(128), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("data", LargeBinary, nullable=False),
    PrimaryKeyConstraint("run_id", "seq", name="pk_snapshots"),
)

# One row per compaction of a run (revision 0003; see eventstore/compaction.py): events
# 1..upto_seq were removed and the snapshot at snapshot_seq became the run's base.
compactions = Table(
    "compactions",
    metadata,
    Column("run_id", String(128), nullable=False),
    Column("upto_seq", BigInteger, nullable=False),
    Column("snapshot_seq", BigInteger, nullable=False),
    Column("compacted_at", DateTime(timezone=True), nullable=False),
    Column("events_removed", BigInteger, nullable=False),
    Column("snapshots_removed", BigInteger, nullable=False),
    Column("payloads_removed", BigInteger, nullable=False),
    # The JSONL file the removed rows were exported to (NULL: not exported).
    Column("archive", Text, nullable=True),
    PrimaryKeyConstraint("run_id", "upto_seq", name="pk_compactions"),
)
