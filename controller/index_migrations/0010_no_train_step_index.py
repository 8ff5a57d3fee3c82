"""One fewer B-tree per event: the rollout index's train-step index is dropped.

Revision ID: 0010_no_train_step_index
Revises: 0009_partial_key_indexes
Create Date: 2026-12-02

A sibling event (most of a run) wrote 7 B-trees: ``events`` and its primary key, then
``rollout_index``, its primary key ``(run_id, seq)``, and the group, train-step and
(type, train-step) indexes. ``ix_rollout_index_run_train_step`` is dropped: the
``(run_id, type, train_step)`` index already serves a type and a step, and a step alone
is read through it one seek per event type (``read_where`` lists the run's types with a
loose index scan of the same index, then seeks each type's step).

Tried and not shipped: making the table ``WITHOUT ROWID`` on SQLite (the rows in the
primary-key B-tree, one B-tree fewer). With no statistics SQLite's planner then prefers a
range of that primary key (``run_id = ?``, the whole run) to the key indexes whenever a
query reads columns the index does not cover: a prompt lookup at 1M events went from
0.35 ms to 108 ms, and so would a user's audit query.

Downgrade re-creates the index.
"""

from __future__ import annotations

from alembic import op

revision = "0010_no_train_step_index"
down_revision = "0009_partial_key_indexes"
branch_labels = None
depends_on = None

_STEP_INDEX = "ix_rollout_index_run_train_step"


def upgrade() -> None:
    """Drop the train-step index (the type-and-step index serves a step alone)."""
    op.drop_index(_STEP_INDEX, table_name="rollout_index")


def downgrade() -> None:
    """Re-create it."""
    op.create_index(_STEP_INDEX, "rollout_index", ["run_id", "train_step"])
