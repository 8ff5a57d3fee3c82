"""The rollout index: the controller's audit keys of each event, out of the events table.

Revision ID: 0004_rollout_index
Revises: 0003_compactions
Create Date: 2026-12-03

The first revision of the controller's branch ``rollout_index`` (see
``rolloutlog.controller.rollout_index.SCHEMA_BRANCH``). Revisions 0001-0003 kept the
rollout audit keys (``train_step``, ``weight_version``, ``group_id``, ``prompt_index``,
``target_step``) as columns of the store's ``events`` table, with five indexes. This
revision (the controller's) creates ``rollout_index``, one row per event keyed by
``(run_id, seq)``, and backfills it from those columns; the store's
``0005_generic_events`` then drops them and ``0006_rollout_views`` re-creates the audit
views over the index. The views of 0002 are dropped here first: they use the columns
(PostgreSQL refuses to drop a column a view uses; SQLite's table rebuild fails on a
table that views refer to).

Downgrade copies the keys back into the columns (re-added by 0005's downgrade) and
re-creates the views of 0002.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0004_rollout_index"
down_revision = "0003_compactions"
branch_labels = ("rollout_index",)
depends_on = None

#: The views of 0002, dependents first (frozen here: the names as that revision made them).
_LEGACY_VIEWS = (
    "run_summary",
    "recoveries",
    "prompt_outcomes",
    "step_staleness",
    "step_batches",
    "group_lifecycle",
    "abandoned_events",
    "history_events",
    "history_spans",
)
_KEYS = ("group_id", "prompt_index", "target_step", "train_step", "weight_version")


def upgrade() -> None:
    """Drop the legacy views, create the index and backfill it from the events columns."""
    for name in _LEGACY_VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.create_table(
        "rollout_index",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("group_id", sa.BigInteger(), nullable=True),
        sa.Column("prompt_index", sa.BigInteger(), nullable=True),
        sa.Column("target_step", sa.BigInteger(), nullable=True),
        sa.Column("train_step", sa.BigInteger(), nullable=True),
        sa.Column("weight_version", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_rollout_index"),
    )
    # An event whose keys are all NULL (not written by the controller) needs no row: the
    # views left-join the index, which reads the same as a row of NULLs. A store created
    # without this branch (0005 done) has no such columns, and no keys to copy.
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("events")}
    if set(_KEYS) <= columns:
        any_key = " OR ".join(f"{k} IS NOT NULL" for k in _KEYS)
        op.execute(
            f"INSERT INTO rollout_index (run_id, seq, type, {', '.join(_KEYS)}) "
            f"SELECT run_id, seq, type, {', '.join(_KEYS)} FROM events WHERE {any_key}"
        )
    # Indexes after the backfill: one sorted build each instead of row-by-row inserts.
    op.create_index("ix_rollout_index_run_group", "rollout_index", ["run_id", "group_id"])
    op.create_index("ix_rollout_index_run_prompt", "rollout_index", ["run_id", "prompt_index"])
    op.create_index("ix_rollout_index_run_train_step", "rollout_index", ["run_id", "train_step"])
    op.create_index("ix_rollout_index_run_target_step", "rollout_index", ["run_id", "target_step"])
    op.create_index(
        "ix_rollout_index_run_type_step", "rollout_index", ["run_id", "type", "train_step"]
    )


def downgrade() -> None:
    """Copy the keys back into the events columns, drop the index, re-create 0002's views."""
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("events")}
    for key in _KEYS if set(_KEYS) <= columns else ():
        op.execute(
            f"UPDATE events SET {key} = (SELECT ix.{key} FROM rollout_index ix "
            "WHERE ix.run_id = events.run_id AND ix.seq = events.seq)"
        )
    op.drop_table("rollout_index")
    if not set(_KEYS) <= columns:
        return  # a store created without this branch: 0005's downgrade makes the views
    legacy = context.script.get_revision("0002_audit_views")
    assert legacy is not None and legacy.module is not None
    for name, select in legacy.module.view_sql(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")
