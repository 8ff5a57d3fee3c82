"""The events table becomes generic: the rollout audit columns and their indexes go.

Revision ID: 0005_generic_events
Revises: 0003_compactions
Create Date: 2026-12-03

The store's revision: this drops the five columns and the five secondary indexes of
revisions 0001 and 0003, so an append updates only the table and its primary key, and
the audit views of 0002 that read the columns. Where the controller's branch is
registered (``rollout_index``), its ``0004_rollout_index`` runs first (``0006`` merges
the two with this revision listed first, which is what orders them): it copies the
columns into its index and drops the views. A database whose columns hold keys is
refused without that branch, rather than losing them. Downgrade re-adds the columns
empty (0004's downgrade refills them) and, without the rollout index, re-creates the
views of 0002.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0005_generic_events"
down_revision = "0003_compactions"
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


def _has_rollout_index() -> bool:
    return "rollout_index" in sa.inspect(op.get_bind()).get_table_names()


def upgrade() -> None:
    """Drop the audit views, indexes and columns of ``events``."""
    if not _has_rollout_index():
        any_key = " OR ".join(f"{c} IS NOT NULL" for c in _COLUMNS)
        keyed = op.get_bind().exec_driver_sql(f"SELECT 1 FROM events WHERE {any_key} LIMIT 1")
        if keyed.first() is not None:
            raise RuntimeError(
                "the events table holds rollout audit keys and the rollout index that "
                "keeps them is not created; upgrade with rolloutlog's controller "
                "imported (`rolloutlog db upgrade` does)"
            )
    for name in _LEGACY_VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {name}")
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
    if not _has_rollout_index():  # otherwise 0004's downgrade, next, re-creates them
        legacy = context.script.get_revision("0002_audit_views")
        assert legacy is not None and legacy.module is not None
        for name, select in legacy.module.view_sql(op.get_bind().dialect.name).items():
            op.execute(f"CREATE VIEW {name} AS {select.strip()}")
