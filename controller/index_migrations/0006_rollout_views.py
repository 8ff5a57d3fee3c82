"""The audit views again, now over the events table joined with the rollout index.

Revision ID: 0006_rollout_views
Revises: 0005_generic_events, 0004_rollout_index
Create Date: 2026-12-03

The views, their columns and their meaning are those of ``0002_audit_views`` (see its
docstring for the history rule); only ``history_events`` and ``abandoned_events`` change:
they take the audit keys from ``rollout_index`` (left-joined on ``(run_id, seq)``: an
event without an index row reads as NULL keys) instead of from columns of ``events``.
Every other view reads those two, so its SQL is 0002's, unchanged.

The SQL of the two views is frozen here; the rest is 0002's frozen SQL. A later revision
that changes a view drops and re-creates it; one that alters ``events``, ``epochs``,
``runs`` or ``rollout_index`` drops these views first and re-creates them after.
"""

from __future__ import annotations

from alembic import context, op

revision = "0006_rollout_views"
down_revision = ("0005_generic_events", "0004_rollout_index")
branch_labels = None
depends_on = None

_COLS = (
    "ev.run_id, ev.seq, ev.epoch, ev.type, ev.schema_version, ev.recorded_at, "
    "ix.train_step, ix.weight_version, ix.group_id, ix.prompt_index, ix.target_step, "
    "ev.payload"
)
_JOIN_INDEX = "LEFT JOIN rollout_index ix ON ix.run_id = ev.run_id AND ix.seq = ev.seq"


def view_sql(dialect: str) -> dict[str, str]:
    """The ``SELECT`` of every view for ``dialect``, in creation order."""
    legacy = context.script.get_revision("0002_audit_views")
    assert legacy is not None and legacy.module is not None
    sql: dict[str, str] = dict(legacy.module.view_sql(dialect))
    sql["history_events"] = f"""
SELECT {_COLS}
FROM events ev
JOIN history_spans h
  ON h.run_id = ev.run_id AND ev.seq BETWEEN h.first_seq AND h.last_seq
{_JOIN_INDEX}
"""
    sql["abandoned_events"] = f"""
SELECT {_COLS}
FROM events ev
{_JOIN_INDEX}
WHERE NOT EXISTS (
    SELECT 1 FROM history_spans h
    WHERE h.run_id = ev.run_id AND ev.seq BETWEEN h.first_seq AND h.last_seq
)
"""
    return sql


def upgrade() -> None:
    """Create the audit views with the current dialect's JSON functions."""
    for name, select in view_sql(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def downgrade() -> None:
    """Drop the audit views (dependents first)."""
    for name in reversed(list(view_sql(op.get_bind().dialect.name))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
