"""Partial indexes for the rollout index's sparse keys: fewer B-trees per append.

Revision ID: 0009_partial_key_indexes
Revises: 0008_engine_views
Create Date: 2026-12-01

Most events are about one sibling (``SiblingDispatched``, ``SiblingCompleted``): they
have a ``group_id`` but no ``prompt_index`` or ``target_step``; step-level events
(``StepAdmitted``, ``BatchSelected``, ``StepTrained``, ...) have no ``group_id``. A full
index still takes an insert for every NULL key, so each appended event updated all five
secondary B-trees of ``rollout_index``. The three key indexes become partial
(``WHERE key IS NOT NULL``): an event updates only the ones whose key it has. Every
lookup is an equality on the key (``read_where``, the audit views, the cookbook), which
both SQLite and PostgreSQL prove implies ``key IS NOT NULL``, so the same lookups use
them. ``train_step`` is set on every row and the ``(type, train_step)`` index serves
"the batch of step t": both stay full.

Downgrade re-creates the full indexes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_partial_key_indexes"
down_revision = "0008_engine_views"
branch_labels = None
depends_on = None

#: (index name, column) of the sparse keys.
_SPARSE = (
    ("ix_rollout_index_run_group", "group_id"),
    ("ix_rollout_index_run_prompt", "prompt_index"),
    ("ix_rollout_index_run_target_step", "target_step"),
)


def upgrade() -> None:
    """Each sparse key's index: full -> partial (only rows that have the key)."""
    for name, column in _SPARSE:
        op.drop_index(name, table_name="rollout_index")
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(
            name,
            "rollout_index",
            ["run_id", column],
            sqlite_where=where,
            postgresql_where=where,
        )


def downgrade() -> None:
    """Back to full indexes."""
    for name, column in _SPARSE:
        op.drop_index(name, table_name="rollout_index")
        op.create_index(name, "rollout_index", ["run_id", column])
