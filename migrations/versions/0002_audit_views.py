"""Audit views: each run's current history and the lifecycle of its groups, steps and prompts.

Revision ID: 0002_audit_views
Revises: 0001_initial
Create Date: 2026-12-01

Every view is restricted to the *current history* of each run: the chain of epochs that
:meth:`rolloutlog.eventstore.EventStore.history_segments` walks. Rows that a restore abandoned stay
in ``events`` (for audit and salvage) but appear only in ``abandoned_events``.

The history rule, computed in SQL by ``history_spans`` with a recursive CTE:

* epoch ``e`` wrote offsets ``first_seq(e) .. first_seq(e+1) - 1`` (the newest epoch up to
  ``runs.last_seq``); the *writer* of offset ``s`` is the epoch whose range holds ``s``;
* the history starts at the newest epoch and takes its range up to ``last_seq`` (empty
  when it has written nothing yet); then it continues at the writer of its ``resume_seq``, up to
  ``resume_seq``; and so on until a ``resume_seq`` of 0.

This is *not* "a row of epoch ``e`` is abandoned iff its offset exceeds the smallest
``resume_seq`` of a later epoch": a restore may resume from an offset that an earlier
restore had abandoned (restoring an older branch's checkpoint), which brings that range
back, and an epoch that wrote nothing never contributes its ``resume_seq``.

The payload is JSON text: SQLite reads it with ``json_extract``, PostgreSQL with
``payload::jsonb ->> 'field'`` (cast to the field's type), so each dialect gets its own
DDL. The SQL is frozen here on purpose: a later revision that changes a view drops and
re-creates it. A later revision that alters ``events``, ``epochs`` or ``runs`` must drop
these views first and re-create them after (PostgreSQL refuses to alter a column a view
uses; SQLite's batch table rebuild fails to rename a table that views refer to).
"""

from __future__ import annotations

from alembic import op

revision = "0002_audit_views"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

#: Views in creation order (each only uses tables and the views before it).
VIEW_NAMES = (
    "history_spans",
    "history_events",
    "abandoned_events",
    "group_lifecycle",
    "step_batches",
    "step_staleness",
    "prompt_outcomes",
    "recoveries",
    "run_summary",
)


class _Json:
    """Typed reads of one field of a JSON-text ``payload`` column, per dialect."""

    def __init__(self, dialect: str) -> None:
        if dialect not in ("sqlite", "postgresql"):
            raise NotImplementedError(f"audit views support sqlite and postgresql, not {dialect}")
        self.pg = dialect == "postgresql"

    def _raw(self, field: str, col: str) -> str:
        if self.pg:
            return f"({col}::jsonb ->> '{field}')"
        return f"json_extract({col}, '$.{field}')"

    def int(self, field: str, col: str = "payload") -> str:
        """An integer field (SQL NULL when absent or JSON null)."""
        return f"{self._raw(field, col)}::bigint" if self.pg else self._raw(field, col)

    def text(self, field: str, col: str = "payload") -> str:
        """A string field."""
        return self._raw(field, col)

    def float(self, field: str, col: str = "payload") -> str:
        """A number field, as a double."""
        if self.pg:
            return f"{self._raw(field, col)}::double precision"
        return f"CAST({self._raw(field, col)} AS REAL)"

    def flag(self, field: str, col: str = "payload") -> str:
        """A boolean field as 1 / 0 (NULL when absent): aggregates and CASE work alike."""
        if self.pg:
            return f"(CASE WHEN {self._raw(field, col)}::boolean THEN 1 ELSE 0 END)"
        return self._raw(field, col)

    @property
    def double(self) -> str:
        """The name of the double-precision type."""
        return "DOUBLE PRECISION" if self.pg else "REAL"


def _bool(expr: str) -> str:
    """A SQL boolean (PostgreSQL boolean, SQLite 1/0) from a condition; NULL stays NULL."""
    return f"CASE WHEN {expr} THEN TRUE WHEN NOT ({expr}) THEN FALSE END"


def view_sql(dialect: str) -> dict[str, str]:
    """The ``SELECT`` of every view for ``dialect`` (``sqlite`` or ``postgresql``)."""
    j = _Json(dialect)
    sql: dict[str, str] = {}

    # One row per contiguous range of a run's current history (what history_segments
    # returns for the run): the epoch that wrote it and its first and last offsets.
    sql["history_spans"] = """
WITH RECURSIVE ranges AS (
    SELECT e.run_id, e.epoch, e.first_seq, e.resume_seq,
           COALESCE(
               LEAD(e.first_seq) OVER (PARTITION BY e.run_id ORDER BY e.epoch) - 1,
               r.last_seq
           ) AS end_seq
    FROM epochs e JOIN runs r ON r.run_id = e.run_id
),
chain (run_id, epoch, first_seq, last_seq, resume_seq) AS (
    SELECT w.run_id, w.epoch, w.first_seq, r.last_seq, w.resume_seq
    FROM runs r
    JOIN ranges w
      ON w.run_id = r.run_id
     AND w.epoch = (SELECT MAX(e2.epoch) FROM epochs e2 WHERE e2.run_id = r.run_id)
    UNION ALL
    SELECT w.run_id, w.epoch, w.first_seq, c.resume_seq, w.resume_seq
    FROM chain c
    JOIN ranges w
      ON w.run_id = c.run_id
     AND c.resume_seq BETWEEN w.first_seq AND w.end_seq
     AND w.epoch < c.epoch
)
SELECT run_id, epoch, first_seq, last_seq FROM chain WHERE first_seq <= last_seq
"""

    cols = (
        "ev.run_id, ev.seq, ev.epoch, ev.type, ev.schema_version, ev.recorded_at, "
        "ev.train_step, ev.weight_version, ev.group_id, ev.prompt_index, ev.target_step, "
        "ev.payload"
    )
    sql["history_events"] = f"""
SELECT {cols}
FROM events ev
JOIN history_spans h
  ON h.run_id = ev.run_id AND ev.seq BETWEEN h.first_seq AND h.last_seq
"""
    sql["abandoned_events"] = f"""
SELECT {cols}
FROM events ev
WHERE NOT EXISTS (
    SELECT 1 FROM history_spans h
    WHERE h.run_id = ev.run_id AND ev.seq BETWEEN h.first_seq AND h.last_seq
)
"""

    trained_steps = f"""
    SELECT run_id, train_step, MIN(seq) AS trained_seq, MIN(recorded_at) AS trained_at,
           MIN(weight_version) AS weight_version
    FROM (
        SELECT run_id, seq, recorded_at, {j.int("train_step")} AS train_step,
               {j.int("weight_version")} AS weight_version
        FROM history_events WHERE type = 'StepTrained'
    ) st
    GROUP BY run_id, train_step"""

    sql["group_lifecycle"] = f"""
WITH g AS (
    SELECT run_id, group_id,
        MAX(prompt_index) AS prompt_index,
        MAX(CASE WHEN type = 'SparePulled' THEN 1 ELSE 0 END) AS was_spare,
        MIN(CASE WHEN type IN ('GroupAdmitted', 'SparePulled') THEN recorded_at END)
            AS pulled_at,
        MIN(CASE WHEN type IN ('GroupAdmitted', 'SpareAssigned') THEN recorded_at END)
            AS admitted_at,
        MIN(CASE WHEN type IN ('GroupAdmitted', 'SpareAssigned') THEN target_step END)
            AS admitted_step,
        MIN(target_step) AS target_step,
        MAX(CASE WHEN type = 'GroupBorrowed' THEN {j.int("from_step")} END)
            AS borrowed_from_step,
        MAX(CASE WHEN type = 'SpareAssigned' THEN {j.int("replaces_group_id")} END)
            AS replaces_group_id,
        MAX(CASE WHEN type = 'SpareAssigned' THEN {j.int("repays_group_id")} END)
            AS repays_group_id,
        SUM(CASE WHEN type = 'SiblingDispatched' THEN 1 ELSE 0 END) AS dispatches,
        SUM(CASE WHEN type = 'SiblingCompleted' THEN 1 ELSE 0 END) AS completions,
        SUM(CASE WHEN type = 'SiblingCompleted' AND {j.int("salvaged_from")} IS NOT NULL
                 THEN 1 ELSE 0 END) AS salvaged,
        SUM(CASE WHEN type = 'SiblingFailed' THEN 1 ELSE 0 END) AS failures,
        SUM(CASE WHEN type = 'SiblingAborted' THEN 1 ELSE 0 END) AS aborts,
        MIN(CASE WHEN type = 'GroupCommitted' THEN recorded_at END) AS committed_at,
        MIN(CASE WHEN type = 'GroupCommitted' THEN {j.int("oldest_weight_version")} END)
            AS oldest_weight_version,
        MAX(CASE WHEN type = 'GroupSelected' THEN {j.int("train_step")} END)
            AS selected_train_step,
        MAX(CASE WHEN type = 'GroupSelected' THEN recorded_at END) AS selected_at,
        MAX(CASE WHEN type = 'GroupSelected' THEN {j.int("staleness")} END) AS staleness,
        MAX(CASE WHEN type = 'GroupEvicted' THEN recorded_at END) AS evicted_at,
        MAX(CASE WHEN type = 'GroupEvicted' THEN {j.text("reason")} END) AS evicted_reason,
        MAX(CASE WHEN type = 'GroupEvicted' THEN {j.int("staleness")} END)
            AS evicted_staleness,
        MAX(CASE WHEN type = 'GroupEvicted' THEN {j.flag("recovered")} END)
            AS evicted_recovered_flag,
        MAX(CASE WHEN type = 'PromptDropped' THEN recorded_at END) AS dropped_at,
        MAX(CASE WHEN type = 'PromptDropped' THEN {j.text("reason")} END) AS dropped_reason,
        MAX(CASE WHEN type IN ('PromptDropped', 'GroupEvicted') THEN {j.text("outcome")} END)
            AS vacate_outcome,
        MIN(seq) AS first_seq,
        MAX(seq) AS last_seq
    FROM history_events
    WHERE group_id IS NOT NULL
    GROUP BY run_id, group_id
),
t AS ({trained_steps}
)
SELECT g.run_id, g.group_id, g.prompt_index,
    CASE WHEN g.was_spare = 1 THEN 'spare' ELSE 'step' END AS pulled_as,
    g.pulled_at, g.admitted_at, g.admitted_step, g.target_step, g.borrowed_from_step,
    g.replaces_group_id, g.repays_group_id,
    g.dispatches, g.completions, g.salvaged, g.failures, g.aborts,
    g.committed_at, g.oldest_weight_version,
    g.selected_train_step, g.selected_at, g.staleness,
    {_bool("t.trained_at IS NOT NULL")} AS trained,
    t.trained_at,
    g.evicted_at, g.evicted_reason, g.evicted_staleness,
    {_bool("g.evicted_recovered_flag = 1")} AS evicted_recovered,
    g.dropped_at, g.dropped_reason, g.vacate_outcome,
    CASE
        WHEN g.dropped_at IS NOT NULL THEN 'dropped'
        WHEN g.evicted_at IS NOT NULL THEN 'evicted'
        WHEN t.trained_at IS NOT NULL THEN 'trained'
        WHEN g.selected_train_step IS NOT NULL THEN 'selected'
        WHEN g.committed_at IS NOT NULL THEN 'ready'
        WHEN g.admitted_at IS NOT NULL THEN 'admitted'
        ELSE 'spare'
    END AS phase,
    g.first_seq, g.last_seq
FROM g
LEFT JOIN t ON t.run_id = g.run_id AND t.train_step = g.selected_train_step
"""

    sql["step_batches"] = f"""
WITH s AS (
    SELECT run_id, seq, recorded_at, group_id, prompt_index, target_step,
           {j.int("train_step")} AS train_step, {j.int("staleness")} AS staleness
    FROM history_events WHERE type = 'GroupSelected'
),
t AS ({trained_steps}
)
SELECT s.run_id, s.train_step, s.group_id, s.prompt_index, s.target_step, s.staleness,
    s.seq AS selected_seq, s.recorded_at AS selected_at,
    {_bool("t.trained_at IS NOT NULL")} AS trained,
    t.trained_at, t.weight_version
FROM s
LEFT JOIN t ON t.run_id = s.run_id AND t.train_step = s.train_step
"""

    sql["step_staleness"] = f"""
WITH b AS (
    SELECT run_id, seq, recorded_at, {j.int("train_step")} AS train_step,
           {j.int("shortfall")} AS shortfall
    FROM history_events WHERE type = 'BatchSelected'
),
s AS (
    SELECT run_id, train_step, COUNT(*) AS groups, MIN(staleness) AS min_staleness,
           MAX(staleness) AS max_staleness,
           CAST(AVG(staleness) AS {j.double}) AS avg_staleness
    FROM step_batches GROUP BY run_id, train_step
),
c AS (
    SELECT run_id, group_id, reward,
           ROW_NUMBER() OVER (PARTITION BY run_id, group_id, sibling ORDER BY seq DESC) AS nth
    FROM (
        SELECT run_id, group_id, seq, {j.int("sibling")} AS sibling,
               {j.float("reward")} AS reward
        FROM history_events WHERE type = 'SiblingCompleted'
    ) sc
),
r AS (
    SELECT sb.run_id, sb.train_step, CAST(AVG(c.reward) AS {j.double}) AS mean_reward,
           COUNT(c.reward) AS completions
    FROM step_batches sb
    JOIN c ON c.run_id = sb.run_id AND c.group_id = sb.group_id AND c.nth = 1
    GROUP BY sb.run_id, sb.train_step
),
t AS ({trained_steps}
)
SELECT b.run_id, b.train_step, COALESCE(s.groups, 0) AS groups, b.shortfall,
    s.min_staleness, s.max_staleness, s.avg_staleness,
    r.mean_reward, COALESCE(r.completions, 0) AS completions,
    b.seq AS selected_seq, b.recorded_at AS selected_at,
    {_bool("t.trained_at IS NOT NULL")} AS trained,
    t.trained_at, t.weight_version
FROM b
LEFT JOIN s ON s.run_id = b.run_id AND s.train_step = b.train_step
LEFT JOIN r ON r.run_id = b.run_id AND r.train_step = b.train_step
LEFT JOIN t ON t.run_id = b.run_id AND t.train_step = b.train_step
"""

    sql["prompt_outcomes"] = """
SELECT run_id, prompt_index, group_id,
    CASE WHEN phase IN ('trained', 'dropped', 'evicted') THEN phase ELSE 'live' END
        AS outcome,
    CASE WHEN phase = 'trained' THEN selected_train_step END AS train_step,
    CASE phase WHEN 'dropped' THEN dropped_reason WHEN 'evicted' THEN evicted_reason END
        AS reason,
    CASE phase
        WHEN 'trained' THEN trained_at
        WHEN 'dropped' THEN dropped_at
        WHEN 'evicted' THEN evicted_at
    END AS decided_at,
    phase, target_step
FROM group_lifecycle
"""

    sql["recoveries"] = f"""
SELECT ev.run_id, 'restore' AS kind, ev.seq, ev.epoch, ev.recorded_at,
    {j.int("from_offset", "ev.payload")} AS from_offset,
    {j.text("mode", "ev.payload")} AS mode,
    {j.text("granularity", "ev.payload")} AS granularity,
    {_bool(j.flag("forced", "ev.payload") + " = 1")} AS forced,
    {j.int("checkpoint_train_step", "ev.payload")} AS checkpoint_train_step,
    {j.int("checkpoint_weight_version", "ev.payload")} AS checkpoint_weight_version,
    {j.int("complete_groups_restored", "ev.payload")} AS complete_groups_restored,
    {j.int("unfinished_groups_found", "ev.payload")} AS unfinished_groups_found,
    {j.int("siblings_reused", "ev.payload")} AS siblings_reused,
    {j.int("siblings_rerun", "ev.payload")} AS siblings_rerun,
    {j.int("siblings_salvaged", "ev.payload")} AS siblings_salvaged,
    (SELECT COUNT(*) FROM history_events x
      WHERE x.run_id = ev.run_id AND x.epoch = ev.epoch AND x.type = 'GroupEvicted'
        AND {j.flag("recovered", "x.payload")} = 1) AS recovered_groups_evicted,
    ep.first_seq - 1 - {j.int("from_offset", "ev.payload")} AS rolled_back_events
FROM history_events ev
JOIN epochs ep ON ep.run_id = ev.run_id AND ep.epoch = ev.epoch
WHERE ev.type = 'RunRestored'
UNION ALL
SELECT ev.run_id, 'resume' AS kind, ev.seq, ev.epoch, ev.recorded_at,
    ep.resume_seq AS from_offset, NULL AS mode, NULL AS granularity, NULL AS forced,
    NULL AS checkpoint_train_step, NULL AS checkpoint_weight_version,
    NULL AS complete_groups_restored, NULL AS unfinished_groups_found,
    NULL AS siblings_reused,
    {j.int("siblings_rerun", "ev.payload")} AS siblings_rerun,
    NULL AS siblings_salvaged,
    (SELECT COUNT(*) FROM history_events x
      WHERE x.run_id = ev.run_id AND x.epoch = ev.epoch AND x.type = 'GroupEvicted'
        AND {j.flag("recovered", "x.payload")} = 1) AS recovered_groups_evicted,
    ep.first_seq - 1 - ep.resume_seq AS rolled_back_events
FROM history_events ev
JOIN epochs ep ON ep.run_id = ev.run_id AND ep.epoch = ev.epoch
WHERE ev.type = 'RunResumed'
"""

    sql["run_summary"] = """
WITH ep AS (
    SELECT run_id, COUNT(*) AS epochs FROM epochs GROUP BY run_id
),
hs AS (
    SELECT run_id, SUM(last_seq - first_seq + 1) AS events FROM history_spans GROUP BY run_id
),
st AS (
    SELECT run_id, SUM(CASE WHEN trained THEN 1 ELSE 0 END) AS trained
    FROM step_staleness GROUP BY run_id
),
po AS (
    SELECT run_id, COUNT(*) AS pulled,
        SUM(CASE WHEN outcome = 'trained' THEN 1 ELSE 0 END) AS trained,
        SUM(CASE WHEN outcome = 'dropped' THEN 1 ELSE 0 END) AS dropped,
        SUM(CASE WHEN outcome = 'evicted' THEN 1 ELSE 0 END) AS evicted,
        SUM(CASE WHEN outcome = 'live' THEN 1 ELSE 0 END) AS live
    FROM prompt_outcomes GROUP BY run_id
)
SELECT r.run_id, r.created_at, r.current_epoch, r.last_seq,
    CAST(COALESCE(ep.epochs, 0) AS BIGINT) AS epochs,
    CAST(COALESCE(hs.events, 0) AS BIGINT) AS history_events,
    CAST(r.last_seq - COALESCE(hs.events, 0) AS BIGINT) AS abandoned_events,
    CAST(COALESCE(st.trained, 0) AS BIGINT) AS steps_trained,
    CAST(COALESCE(po.pulled, 0) AS BIGINT) AS prompts_pulled,
    CAST(COALESCE(po.trained, 0) AS BIGINT) AS prompts_trained,
    CAST(COALESCE(po.dropped, 0) AS BIGINT) AS prompts_dropped,
    CAST(COALESCE(po.evicted, 0) AS BIGINT) AS prompts_evicted,
    CAST(COALESCE(po.live, 0) AS BIGINT) AS prompts_live
FROM runs r
LEFT JOIN ep ON ep.run_id = r.run_id
LEFT JOIN hs ON hs.run_id = r.run_id
LEFT JOIN st ON st.run_id = r.run_id
LEFT JOIN po ON po.run_id = r.run_id
"""
    assert tuple(sql) == VIEW_NAMES
    return sql


def upgrade() -> None:
    """Create the audit views with the current dialect's JSON functions."""
    for name, select in view_sql(op.get_bind().dialect.name).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def downgrade() -> None:
    """Drop the audit views (dependents first)."""
    for name in reversed(VIEW_NAMES):
        op.execute(f"DROP VIEW IF EXISTS {name}")
