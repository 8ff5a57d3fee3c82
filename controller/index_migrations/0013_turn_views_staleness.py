"""Multi-turn views again: the staleness policy's decisions (``TrajectoryTooStale``).

Revision ID: 0013_turn_views_staleness
Revises: 0012_turn_views
Create Date: 2026-12-05

``0012_turn_views`` with one more trajectory event (``controller/domain/trajectory.py``):
``TrajectoryTooStale``, the per-trajectory staleness policy's decision (kept, aborted,
restarted). In ``turns`` it is kind ``too_stale`` (``outcome``: what the policy did,
``detail``: its reason); ``trajectories`` gains ``stale_outcome`` (the newest decision's
outcome) and ``turns_abandoned`` (model calls the policy abandoned: ``turns`` counts
every model call recorded, abandoned ones included).

The three views are dropped and created again (``trajectories`` and ``tool_calls`` read
``turns``); a downgrade restores 0012's. The SQL is frozen here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from alembic import op

revision = "0013_turn_views_staleness"
down_revision = "0012_turn_views"
branch_labels = None
depends_on = None

#: The trajectory event types and their kind in ``turns`` (frozen here).
_KINDS = (
    ("TrajectoryStarted", "start"),
    ("ModelCallCompleted", "model_call"),
    ("ToolCallRequested", "tool_request"),
    ("ToolCallCompleted", "tool_result"),
    ("ToolCallFailed", "tool_failure"),
    ("EnvironmentStepped", "environment_step"),
    ("TrajectoryCompleted", "completed"),
    ("TrajectoryResumed", "resumed"),
    ("LateResultRefused", "late_refused"),
    ("TrajectoryTooStale", "too_stale"),
)


class _Json:
    """Typed reads of one field of the JSON-text ``payload`` column, per dialect."""

    def __init__(self, dialect: str) -> None:
        if dialect not in ("sqlite", "postgresql"):
            raise NotImplementedError(f"audit views support sqlite and postgresql, not {dialect}")
        self.pg = dialect == "postgresql"

    def raw(self, field: str, col: str = "ev.payload") -> str:
        if self.pg:
            return f"({col}::jsonb ->> '{field}')"
        return f"json_extract({col}, '$.{field}')"

    def int(self, field: str, col: str = "ev.payload") -> str:
        return f"{self.raw(field, col)}::bigint" if self.pg else self.raw(field, col)

    def float(self, field: str, col: str = "ev.payload") -> str:
        if self.pg:
            return f"{self.raw(field, col)}::double precision"
        return f"CAST({self.raw(field, col)} AS REAL)"

    def flag(self, field: str, col: str = "ev.payload") -> str:
        """A JSON boolean as a SQL boolean (PostgreSQL) or 1 / 0 (SQLite)."""
        return f"{self.raw(field, col)}::boolean" if self.pg else self.raw(field, col)

    def json_text(self, field: str, col: str = "ev.payload") -> str:
        """A JSON object field as JSON text."""
        if self.pg:
            return f"(({col}::jsonb -> '{field}')::text)"
        return f"json_extract({col}, '$.{field}')"


def _bool(expr: str) -> str:
    return f"CASE WHEN {expr} THEN TRUE WHEN NOT ({expr}) THEN FALSE END"


def view_sql(dialect: str) -> dict[str, str]:
    """The ``SELECT`` of every view for ``dialect``, in creation order."""
    j = _Json(dialect)
    types = ", ".join(f"'{t}'" for t, _ in _KINDS)
    kind = "CASE ev.type " + " ".join(f"WHEN '{t}' THEN '{k}'" for t, k in _KINDS) + " END"
    tokens = (
        "CASE ev.type WHEN 'ModelCallCompleted' THEN " + j.int("output_tokens") + " "
        "WHEN 'TrajectoryCompleted' THEN "
        + j.int("model_tokens")
        + " + "
        + j.int("observation_tokens")
        + " ELSE "
        + j.int("observation_tokens")
        + " END"
    )
    weight_version = f"CASE WHEN ev.type = 'ModelCallCompleted' THEN {j.int('weight_version')} END"
    outcome = (
        f"CASE ev.type WHEN 'ModelCallCompleted' THEN {j.raw('finish_reason')} "
        f"WHEN 'ToolCallCompleted' THEN {j.raw('source')} "
        f"WHEN 'ToolCallFailed' THEN {j.raw('outcome')} "
        f"WHEN 'TrajectoryCompleted' THEN {j.raw('finish')} "
        f"WHEN 'LateResultRefused' THEN {j.raw('kind')} "
        f"WHEN 'TrajectoryTooStale' THEN {j.raw('outcome')} END"
    )
    detail = (
        f"CASE ev.type WHEN 'ToolCallRequested' THEN {j.json_text('arguments')} "
        f"WHEN 'ToolCallCompleted' THEN {j.raw('result')} "
        f"WHEN 'ToolCallFailed' THEN {j.raw('reason')} "
        f"WHEN 'EnvironmentStepped' THEN {j.raw('observation')} "
        f"WHEN 'TrajectoryStarted' THEN {j.raw('observation')} "
        f"WHEN 'LateResultRefused' THEN {j.raw('reason')} "
        f"WHEN 'TrajectoryTooStale' THEN {j.raw('reason')} END"
    )
    reward = (
        f"CASE ev.type WHEN 'EnvironmentStepped' THEN {j.float('reward')} "
        f"WHEN 'TrajectoryCompleted' THEN {j.float('final_reward')} END"
    )
    in_history = _bool(
        "EXISTS (SELECT 1 FROM history_spans h WHERE h.run_id = ev.run_id "
        "AND ev.seq BETWEEN h.first_seq AND h.last_seq)"
    )
    turns = f"""
WITH te AS (
    SELECT ev.run_id, ev.seq, ev.epoch, ev.recorded_at, ev.type, ix.group_id,
        {j.int("sibling")} AS sibling, {j.int("attempt")} AS attempt, ev.payload
    FROM rollout_index ix
    JOIN events ev ON ev.run_id = ix.run_id AND ev.seq = ix.seq
    WHERE ix.type IN ({types})
)
SELECT ev.run_id, ev.group_id, ev.sibling,
    MAX(CASE WHEN ev.type = 'TrajectoryStarted' THEN ev.seq END) OVER (
        PARTITION BY ev.run_id, ev.group_id, ev.sibling ORDER BY ev.seq
        ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS trajectory_seq,
    ev.seq, ev.epoch, ev.recorded_at, {in_history} AS in_history, ev.attempt,
    {j.int("turn")} AS turn, {kind} AS kind, {tokens} AS tokens,
    {weight_version} AS weight_version, {j.raw("engine_id")} AS engine_id,
    {j.raw("tool")} AS tool, {j.int("call")} AS call,
    {j.raw("idempotency_key")} AS idempotency_key, {outcome} AS outcome,
    {detail} AS detail, {j.float("seconds")} AS seconds, {reward} AS reward,
    {j.flag("done")} AS done, ev.payload
FROM te ev
"""
    trajectories = f"""
WITH s AS (
    SELECT run_id, group_id, sibling, seq AS trajectory_seq, epoch AS started_epoch,
        attempt AS started_attempt, in_history, {j.int("prompt_index", "payload")} AS prompt_index,
        {j.int("data_pass", "payload")} AS data_pass,
        {j.int("prompt_tokens", "payload")} AS prompt_tokens
    FROM turns WHERE kind = 'start'
),
a AS (
    SELECT run_id, group_id, sibling, trajectory_seq,
        SUM(CASE WHEN kind = 'resumed' THEN 1 ELSE 0 END) AS resumes,
        SUM(CASE WHEN kind = 'model_call' THEN 1 ELSE 0 END) AS model_calls,
        SUM(CASE WHEN kind = 'tool_request' THEN 1 ELSE 0 END) AS tool_calls,
        SUM(CASE WHEN kind = 'tool_failure' THEN 1 ELSE 0 END) AS tool_failures,
        SUM(CASE WHEN kind = 'environment_step' THEN 1 ELSE 0 END) AS environment_steps,
        SUM(CASE WHEN kind = 'late_refused' THEN 1 ELSE 0 END) AS late_refused,
        SUM(CASE WHEN kind = 'too_stale' THEN {j.int("turns_abandoned", "payload")} ELSE 0 END)
            AS turns_abandoned,
        MAX(CASE WHEN kind = 'too_stale' THEN seq END) AS stale_seq,
        SUM(CASE WHEN kind = 'model_call' THEN tokens ELSE 0 END) AS model_tokens,
        SUM(CASE WHEN kind IN ('start', 'tool_result', 'tool_failure', 'environment_step')
                 THEN tokens ELSE 0 END) AS observation_tokens,
        MIN(weight_version) AS oldest_weight_version,
        MAX(weight_version) AS newest_weight_version,
        MAX(CASE WHEN kind = 'completed' THEN seq END) AS completed_seq,
        MAX(seq) AS last_seq
    FROM turns
    GROUP BY run_id, group_id, sibling, trajectory_seq
),
lt AS (
    SELECT run_id, seq, epoch, attempt FROM turns
)
SELECT s.run_id, s.group_id, s.sibling, s.trajectory_seq, s.prompt_index, s.data_pass,
    s.prompt_tokens, s.in_history, s.started_epoch, s.started_attempt,
    l.epoch AS last_epoch, l.attempt AS last_attempt,
    CAST(a.resumes AS BIGINT) AS resumes, CAST(a.model_calls AS BIGINT) AS turns,
    CAST(a.tool_calls AS BIGINT) AS tool_calls,
    CAST(a.tool_failures AS BIGINT) AS tool_failures,
    CAST(a.environment_steps AS BIGINT) AS environment_steps,
    CAST(a.late_refused AS BIGINT) AS late_refused,
    CAST(a.model_tokens AS BIGINT) AS model_tokens,
    CAST(a.observation_tokens AS BIGINT) AS observation_tokens,
    a.oldest_weight_version, a.newest_weight_version,
    {_bool("a.completed_seq IS NOT NULL")} AS completed,
    c.outcome AS finish, c.reward AS final_reward, a.completed_seq, a.last_seq,
    st.outcome AS stale_outcome, CAST(a.turns_abandoned AS BIGINT) AS turns_abandoned
FROM s
JOIN a ON a.run_id = s.run_id AND a.group_id = s.group_id AND a.sibling = s.sibling
      AND a.trajectory_seq = s.trajectory_seq
JOIN lt l ON l.run_id = a.run_id AND l.seq = a.last_seq
LEFT JOIN turns c ON c.run_id = a.run_id AND c.seq = a.completed_seq
LEFT JOIN turns st ON st.run_id = a.run_id AND st.seq = a.stale_seq
"""
    tool_calls = f"""
SELECT r.run_id, r.group_id, r.sibling, r.trajectory_seq, t.prompt_index, t.data_pass,
    r.turn, r.call, r.tool, r.detail AS arguments, r.idempotency_key,
    {j.flag("idempotent", "r.payload")} AS idempotent,
    {j.flag("status_check", "r.payload")} AS status_check,
    CASE WHEN a.seq IS NULL THEN 'open'
         WHEN a.kind = 'tool_result' THEN 'completed' ELSE 'failed' END AS status,
    a.outcome, a.detail AS result, a.seconds,
    r.seq AS requested_seq, r.epoch AS requested_epoch, r.attempt AS requested_attempt,
    r.in_history,
    a.seq AS result_seq, a.epoch AS result_epoch, a.attempt AS result_attempt
FROM turns r
JOIN trajectories t ON t.run_id = r.run_id AND t.group_id = r.group_id
    AND t.sibling = r.sibling AND t.trajectory_seq = r.trajectory_seq
LEFT JOIN turns a ON a.run_id = r.run_id AND a.group_id = r.group_id
    AND a.sibling = r.sibling AND a.trajectory_seq = r.trajectory_seq
    AND a.kind IN ('tool_result', 'tool_failure') AND a.idempotency_key = r.idempotency_key
WHERE r.kind = 'tool_request'
"""
    return {"turns": turns, "trajectories": trajectories, "tool_calls": tool_calls}


def _previous() -> Any:
    """Revision 0012's module (its frozen views, for the downgrade)."""
    path = Path(__file__).with_name("0012_turn_views.py")
    spec = importlib.util.spec_from_file_location("_rolloutlog_0012_turn_views", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _drop(names: list[str]) -> None:
    for name in reversed(names):  # dependents first
        op.execute(f"DROP VIEW IF EXISTS {name}")


def upgrade() -> None:
    """Create the multi-turn views again, with the staleness decisions."""
    views = view_sql(op.get_bind().dialect.name)
    _drop(list(views))
    for name, select in views.items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def downgrade() -> None:
    """Back to 0012's views."""
    dialect = op.get_bind().dialect.name
    _drop(list(view_sql(dialect)))
    for name, select in _previous().view_sql(dialect).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")
