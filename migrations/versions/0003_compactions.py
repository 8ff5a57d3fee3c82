"""Compaction records, and an index for per-step audit lookups.

Revision ID: 0003_compactions
Revises: 0002_audit_views
Create Date: 2026-12-02

* ``compactions``: one row per compaction of a run (see ``eventstore/compaction.py`` and
  ``docs/retention.md``): events ``1..upto_seq`` were removed, the snapshot at
  ``snapshot_seq`` is the run's new base, and ``archive`` names the JSONL file the removed
  rows were exported to (NULL when they were not).
* ``ix_events_run_type_step`` on ``events(run_id, type, train_step)``: "the batch of step
  t" and "the steps a prompt was selected for" are index lookups (the canned audit
  queries in ``controller/sql_audit.py``), not scans of the whole history.

Neither touches a column of ``events``, ``epochs`` or ``runs``, so the audit views of
0002 stay as they are (no drop / re-create needed).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_compactions"
down_revision = "0002_audit_views"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the compactions table and the per-type step index."""
    op.create_table(
        "compactions",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("upto_seq", sa.BigInteger(), nullable=False),
        sa.Column("snapshot_seq", sa.BigInteger(), nullable=False),
        sa.Column("compacted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("events_removed", sa.BigInteger(), nullable=False),
        sa.Column("snapshots_removed", sa.BigInteger(), nullable=False),
        sa.Column("payloads_removed", sa.BigInteger(), nullable=False),
        sa.Column("archive", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "upto_seq", name="pk_compactions"),
    )
    op.create_index("ix_events_run_type_step", "events", ["run_id", "type", "train_step"])


def downgrade() -> None:
    """Drop what the upgrade created."""
    op.drop_index("ix_events_run_type_step", table_name="events")
    op.drop_table("compactions")
