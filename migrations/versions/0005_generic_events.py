"""The events table becomes generic: the rollout audit columns and their indexes go.

Revision ID: 0005_generic_events
Revises: 0004_rollout_index
Create Date: 2026-12-03

The store's revision. ``0004_rollout_index`` (the controller's) has copied the columns
into its index and dropped the views that used them; this drops the five columns and
the five secondary indexes of revisions 0001 and 0003, so an append updates only the
table and its primary key. Downgrade re-adds them empty (0004's downgrade refills them).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_generic_events"
down_revision = "0004_rollout_index"
branch_labels = None
depends_on = None

_INDEXES = {
    "ix_events_run_group": ["run_id", "group_id"],
    "ix_events_run_prompt": ["run_id", "prompt_index"],
    "ix_events_run_train_step": ["run_id", "train_step"],
    "ix_events_run_target_step": ["run_id", "target_step"],
    "ix_events_run_type_step": ["run_id", "type", "train_step"],
}
_COLUMNS = ("train_step", "weight_version", "group_id", "prompt_index", "target_step")


def upgrade() -> None:
    """Drop the audit indexes and columns of ``events``."""
    for name in _INDEXES:
        op.drop_index(name, table_name="events")
    with op.batch_alter_table("events") as batch:
        for col in _COLUMNS:
            batch.drop_column(col)


def downgrade() -> None:
    """Re-add the columns (NULL) and their indexes."""
    with op.batch_alter_table("events") as batch:
        for col in _COLUMNS:
            batch.add_column(sa.Column(col, sa.BigInteger(), nullable=True))
    for name, cols in _INDEXES.items():
        op.create_index(name, "events", cols)
