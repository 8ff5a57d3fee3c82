"""Sibling events in a narrow index of their own; their train step in step marks.

Revision ID: 0011_sibling_index
Revises: 0010_no_train_step_index
Create Date: 2026-12-03

Nine in ten events of a run are about one sibling (``SiblingDispatched``,
``SiblingCompleted``, ``SiblingFailed``, ``SiblingAborted``): their only key is the
group. Each wrote a ``rollout_index`` row of eight bound values into four B-trees (the
table, its primary key, the group index and the (type, train step) index). They move to:

- ``rollout_sibling_index (run_id, seq, group_id)``: on SQLite ``WITHOUT ROWID`` (the
  primary key ``(run_id, seq)`` is the table), with a ``(run_id, group_id)`` index that
  covers every column: two B-trees, three values.
- ``rollout_step_marks (run_id, seq, train_step, weight_version)``: the train step and
  weight version the controller recorded with them change only at step boundaries, so
  they are kept as marks, one at the last event of each run of equal values (new appends
  mark at least once per transaction): an event's values are the first mark's at or
  after it.

``rollout_index`` keeps every other event, unchanged. The audit views take an event's
keys from whichever table holds them (``history_events`` and ``abandoned_events``; the
views over them are re-created unchanged, dependents first). The backfill moves the
sibling rows and marks the runs of equal values among them (window functions: SQLite
3.25 or newer). Downgrade moves them back.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0011_sibling_index"
down_revision = "0010_no_train_step_index"
branch_labels = None
depends_on = None

#: The sibling event types, frozen here (the code's list may grow; this revision's may not).
_SIBLING_TYPES = "('SiblingDispatched', 'SiblingCompleted', 'SiblingFailed', 'SiblingAborted')"
_IS_SIBLING = f"type IN {_SIBLING_TYPES} AND group_id IS NOT NULL"

_COLS = (
    "ev.run_id, ev.seq, ev.epoch, ev.type, ev.schema_version, ev.recorded_at, "
    "COALESCE(ix.train_step, m.train_step) AS train_step, "
    "COALESCE(ix.weight_version, m.weight_version) AS weight_version, "
    "COALESCE(ix.group_id, sx.group_id) AS group_id, ix.prompt_index, ix.target_step, "
    "ev.payload"
)
# An event's keys: its rollout_index row, or its sibling row and the first step mark at or
# after it (one primary-key seek, for sibling rows only).
_JOIN_KEYS = """
LEFT JOIN rollout_index ix ON ix.run_id = ev.run_id AND ix.seq = ev.seq
LEFT JOIN rollout_sibling_index sx ON sx.run_id = ev.run_id AND sx.seq = ev.seq
LEFT JOIN rollout_step_marks m ON sx.seq IS NOT NULL AND m.run_id = ev.run_id AND m.seq = (
    SELECT MIN(m2.seq) FROM rollout_step_marks m2
    WHERE m2.run_id = ev.run_id AND m2.seq >= ev.seq)"""


def _revision_module(name: str):  # type: ignore[no-untyped-def]
    found = context.script.get_revision(name)
    assert found is not None and found.module is not None
    return found.module


def _previous(dialect: str) -> dict[str, str]:
    """The views at 0010: 0007's (the audit views) then 0008's (the engine views)."""
    views = dict(_revision_module("0007_prompt_passes").view_sql(dialect))
    views.update(_revision_module("0008_engine_views").view_sql(dialect))
    return views


def view_sql(dialect: str) -> dict[str, str]:
    """The ``SELECT`` of every view for ``dialect``, in creation order."""
    sql = _previous(dialect)
    sql["history_events"] = f"""
SELECT {_COLS}
FROM events ev
JOIN history_spans h
  ON h.run_id = ev.run_id AND ev.seq BETWEEN h.first_seq AND h.last_seq
{_JOIN_KEYS}
"""
    sql["abandoned_events"] = f"""
SELECT {_COLS}
FROM events ev
{_JOIN_KEYS}
WHERE NOT EXISTS (
    SELECT 1 FROM history_spans h
    WHERE h.run_id = ev.run_id AND ev.seq BETWEEN h.first_seq AND h.last_seq
)
"""
    return sql


def _recreate_views(old: dict[str, str], new: dict[str, str]) -> None:
    for name in reversed(list(old)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for name, select in new.items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def _create_tables() -> None:
    op.create_table(
        "rollout_sibling_index",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("group_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_rollout_sibling_index"),
        sqlite_with_rowid=False,
    )
    op.create_index(
        "ix_rollout_sibling_index_run_group", "rollout_sibling_index", ["run_id", "group_id"]
    )
    op.create_table(
        "rollout_step_marks",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("train_step", sa.BigInteger(), nullable=True),
        sa.Column("weight_version", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_rollout_step_marks"),
        sqlite_with_rowid=False,
    )
    op.create_index(
        "ix_rollout_step_marks_run_train_step",
        "rollout_step_marks",
        ["run_id", "train_step", "weight_version"],
    )


def upgrade() -> None:
    """Move the sibling events' rows to the narrow index and mark their steps."""
    dialect = op.get_bind().dialect.name
    differs = "IS DISTINCT FROM" if dialect == "postgresql" else "IS NOT"
    _create_tables()
    op.execute(
        "INSERT INTO rollout_sibling_index (run_id, seq, group_id) "
        f"SELECT run_id, seq, group_id FROM rollout_index WHERE {_IS_SIBLING}"
    )
    op.execute(
        f"""
INSERT INTO rollout_step_marks (run_id, seq, train_step, weight_version)
SELECT run_id, seq, train_step, weight_version FROM (
    SELECT run_id, seq, train_step, weight_version,
           LEAD(seq) OVER w AS next_seq,
           LEAD(train_step) OVER w AS next_step,
           LEAD(weight_version) OVER w AS next_version
    FROM rollout_index WHERE {_IS_SIBLING}
    WINDOW w AS (PARTITION BY run_id ORDER BY seq)
) s
WHERE next_seq IS NULL OR next_step {differs} train_step
   OR next_version {differs} weight_version
"""
    )
    _recreate_views(_previous(dialect), view_sql(dialect))
    op.execute(f"DELETE FROM rollout_index WHERE {_IS_SIBLING}")


def downgrade() -> None:
    """Move the sibling rows back into ``rollout_index``, with their marks' values."""
    dialect = op.get_bind().dialect.name
    op.execute(
        """
INSERT INTO rollout_index
    (run_id, seq, type, group_id, prompt_index, target_step, train_step, weight_version)
SELECT sx.run_id, sx.seq, ev.type, sx.group_id, NULL, NULL, m.train_step, m.weight_version
FROM rollout_sibling_index sx
JOIN events ev ON ev.run_id = sx.run_id AND ev.seq = sx.seq
LEFT JOIN rollout_step_marks m ON m.run_id = sx.run_id AND m.seq = (
    SELECT MIN(m2.seq) FROM rollout_step_marks m2
    WHERE m2.run_id = sx.run_id AND m2.seq >= sx.seq)
"""
    )
    _recreate_views(view_sql(dialect), _previous(dialect))
    op.drop_table("rollout_step_marks")
    op.drop_table("rollout_sibling_index")
