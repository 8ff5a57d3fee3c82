"""Engine membership views: which engine generated a sample, what died with an engine.

Revision ID: 0008_engine_views
Revises: 0006_rollout_views
Create Date: 2026-12-01

Read the current history only (``history_events``), from the event JSON (the engine id
is not a rollout-index column: audits by engine are rare and a run has few engines).

- ``sample_engines``: one row per completed sibling attempt, with the engine that
  generated it (``engine_id`` NULL for an in-process backend or an older log).
- ``engine_membership``: one row per EngineJoined / EngineLost / EngineRefit.
- ``engine_lost_attempts``: one row per sibling attempt in flight on an engine when it
  was lost (``request_id`` is ``g{group}-s{sibling}-a{attempt}``).

The SQL is frozen here; a later revision that changes a view drops and re-creates it.
"""

from __future__ import annotations

from alembic import op

revision = "0008_engine_views"
down_revision = "0007_prompt_passes"
branch_labels = None
depends_on = None


def _field(dialect: str, name: str, *, integer: bool = False, col: str = "ev.payload") -> str:
    if dialect == "postgresql":
        raw = f"({col}::jsonb ->> '{name}')"
        return f"{raw}::bigint" if integer else raw
    return f"json_extract({col}, '$.{name}')"


def view_sql(dialect: str) -> dict[str, str]:
    """The ``SELECT`` of every view for ``dialect``, in creation order."""
    if dialect not in ("sqlite", "postgresql"):
        raise NotImplementedError(f"audit views support sqlite and postgresql, not {dialect}")

    def f(name: str, integer: bool = False) -> str:
        return _field(dialect, name, integer=integer)

    if dialect == "postgresql":
        in_flight_rows = (
            "CROSS JOIN LATERAL jsonb_array_elements_text(ev.payload::jsonb -> 'in_flight') "
            "AS rid(value)"
        )
        in_flight_count = "jsonb_array_length(ev.payload::jsonb -> 'in_flight')"
    else:
        in_flight_rows = ", json_each(ev.payload, '$.in_flight') AS rid"
        in_flight_count = "json_array_length(ev.payload, '$.in_flight')"
    return {
        "sample_engines": f"""
SELECT ev.run_id, ev.seq, ev.epoch, ev.recorded_at, ev.group_id, ev.prompt_index,
    {f("sibling", True)} AS sibling, {f("attempt", True)} AS attempt,
    {f("weight_version", True)} AS weight_version, {f("engine_id")} AS engine_id,
    {f("payload_id")} AS payload_id
FROM history_events ev
WHERE ev.type = 'SiblingCompleted'
""",
        "engine_membership": f"""
SELECT ev.run_id, ev.seq, ev.epoch, ev.recorded_at, ev.type, {f("engine_id")} AS engine_id,
    {f("address")} AS address, {f("weight_version", True)} AS weight_version,
    {f("reason")} AS reason,
    CASE WHEN ev.type = 'EngineLost' THEN {in_flight_count} END AS in_flight_count
FROM history_events ev
WHERE ev.type IN ('EngineJoined', 'EngineLost', 'EngineRefit')
""",
        "engine_lost_attempts": f"""
SELECT ev.run_id, ev.seq, ev.epoch, ev.recorded_at, {f("engine_id")} AS engine_id,
    {f("reason")} AS reason, rid.value AS request_id
FROM history_events ev {in_flight_rows}
WHERE ev.type = 'EngineLost'
""",
    }


def upgrade() -> None:
    """Create the engine views."""
    for name, select in view_sql(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def downgrade() -> None:
    """Drop the engine views."""
    for name in reversed(list(view_sql(op.get_bind().dialect.name))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
