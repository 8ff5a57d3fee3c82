"""Fewer B-trees per event: ``rollout_index`` clustered on its key, one step index.

Revision ID: 0010_clustered_rollout_index
Revises: 0009_partial_key_indexes
Create Date: 2026-12-02

A sibling event (most of a run) wrote 7 B-trees: ``events`` and its primary key, then
``rollout_index``'s rowid table, its primary key ``(run_id, seq)``, and the group,
train-step and (type, train-step) indexes. This revision takes two of them away:

- On SQLite the table becomes ``WITHOUT ROWID``: its rows live in the primary-key B-tree
  itself (the rows are eight small keys, the case that layout is made for), so the rowid
  table and the separate primary-key index are one B-tree. PostgreSQL tables are heaps
  whatever the declaration; there the table is unchanged.
- ``ix_rollout_index_run_train_step`` is dropped on both databases: the
  ``(run_id, type, train_step)`` index already serves a type and a step, and a step
  alone is read through it one seek per event type (``read_where`` lists the run's types
  with a loose index scan of the same index, then seeks each).

SQLite cannot change a table's rowid layout in place: the table is rebuilt (create,
copy, drop, rename) with ``legacy_alter_table`` on, so that the rename leaves the audit
views of 0006-0008 alone; they name the table, and the rebuilt one takes its name.

Downgrade rebuilds the rowid table and re-creates the train-step index.
"""

from __future__ import annotations

from alembic import op

revision = "0010_clustered_rollout_index"
down_revision = "0009_partial_key_indexes"
branch_labels = None
depends_on = None

_COLUMNS = (
    "run_id VARCHAR(128) NOT NULL, seq BIGINT NOT NULL, type VARCHAR(64) NOT NULL, "
    "group_id BIGINT, prompt_index BIGINT, target_step BIGINT, train_step BIGINT, "
    "weight_version BIGINT, CONSTRAINT pk_rollout_index PRIMARY KEY (run_id, seq)"
)
_NAMES = "run_id, seq, type, group_id, prompt_index, target_step, train_step, weight_version"
#: The indexes the table keeps, as 0009 left them: (name, columns, partial predicate).
_KEPT = (
    ("ix_rollout_index_run_group", "run_id, group_id", "group_id IS NOT NULL"),
    ("ix_rollout_index_run_prompt", "run_id, prompt_index", "prompt_index IS NOT NULL"),
    ("ix_rollout_index_run_target_step", "run_id, target_step", "target_step IS NOT NULL"),
    ("ix_rollout_index_run_type_step", "run_id, type, train_step", None),
)
_STEP_INDEX = "ix_rollout_index_run_train_step"


def _rebuild_sqlite(without_rowid: bool) -> None:
    """Re-create ``rollout_index`` with or without a rowid, its rows and kept indexes."""
    layout = " WITHOUT ROWID" if without_rowid else ""
    op.execute("PRAGMA legacy_alter_table = ON")
    try:
        op.execute(f"CREATE TABLE rollout_index_rebuilt ({_COLUMNS}){layout}")
        op.execute(
            f"INSERT INTO rollout_index_rebuilt ({_NAMES}) SELECT {_NAMES} FROM rollout_index"
        )
        op.execute("DROP TABLE rollout_index")  # and its indexes
        op.execute("ALTER TABLE rollout_index_rebuilt RENAME TO rollout_index")
    finally:
        op.execute("PRAGMA legacy_alter_table = OFF")
    # Indexes after the copy: one sorted build each instead of row-by-row inserts.
    for name, columns, where in _KEPT:
        partial = f" WHERE {where}" if where else ""
        op.execute(f"CREATE INDEX {name} ON rollout_index ({columns}){partial}")


def upgrade() -> None:
    """SQLite: rebuild the table WITHOUT ROWID; both: drop the train-step index."""
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_sqlite(without_rowid=True)  # the rebuild leaves the step index out
    else:
        op.drop_index(_STEP_INDEX, table_name="rollout_index")


def downgrade() -> None:
    """Back to a rowid table with its train-step index."""
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_sqlite(without_rowid=False)
    op.create_index(_STEP_INDEX, "rollout_index", ["run_id", "train_step"])
