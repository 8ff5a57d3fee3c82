"""SQL audit of a stored run: canned queries over the audit views, and a read-only runner.

The views (created by the alembic revision ``0002_audit_views``, documented in
``docs/sql-cookbook.md``) hold each run's *current history* only: events a restore
abandoned appear in ``abandoned_events`` and nowhere else.

:class:`SqlAudit` opens the log read-only and runs one ``SELECT`` per transaction. User
SQL (:meth:`SqlAudit.select`) is refused unless it is a single ``SELECT`` / ``WITH``
statement, and read-only is also enforced by the database itself, so a write hidden
where the text check cannot see it (a data-modifying CTE, ``SELECT ... INTO``, a
function) fails too and changes nothing:

* SQLite: the file is opened with ``mode=ro`` and every connection has
  ``PRAGMA query_only = ON``;
* PostgreSQL: the session has ``default_transaction_read_only = on`` and every query
  runs in a transaction opened with ``SET TRANSACTION READ ONLY``.

Parameters are written ``:name`` (``:run_id``, ``:prompt_index``...) on both dialects.
"""

from __future__ import annotations

import base64
import re
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from eventstore import EventStore, RunNotFoundError, StoreError

#: The audit views and what each holds (columns: ``docs/sql-cookbook.md``).
VIEWS: dict[str, str] = {
    "history_spans": "the contiguous offset ranges of each run's current history",
    "history_events": "the events of each run's current history (abandoned rows left out)",
    "abandoned_events": "the events a restore abandoned (kept for audit and salvage)",
    "group_lifecycle": "one row per group: stamps, generation, commit, selection, fate",
    "step_batches": "one row per group selected for a train step",
    "step_staleness": "one row per selected batch: size, shortfall, staleness, reward",
    "prompt_outcomes": "one row per pulled prompt: trained, dropped, evicted or live",
    "recoveries": "one row per restore (and takeover) in the history, with its counts",
    "run_summary": "one row per run: epochs, history size, steps, prompt outcomes",
}

#: Default limit of rows a query returns (more are reported as truncated).
DEFAULT_LIMIT = 10_000
#: Default statement timeout in seconds (a runaway audit query must not hold the log).
DEFAULT_TIMEOUT_S = 60.0


class AuditError(StoreError):
    """An audit query could not run; the message says why."""


class QueryRefusedError(AuditError):
    """The SQL is not a single read-only ``SELECT`` / ``WITH`` statement."""


class ReadOnlyViolationError(QueryRefusedError):
    """The database refused a write attempted by the query (nothing was changed)."""


class MissingParameterError(AuditError):
    """The SQL uses a ``:name`` parameter that was not given."""


# ---------------------------------------------------------------- lexing user SQL


@dataclass(frozen=True)
class _Segment:
    kind: str  # code | string | ident | comment | dollar
    text: str


_DOLLAR_TAG = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def _segments(sql: str) -> list[_Segment]:
    """Split SQL into code, quoted literals/identifiers and comments.

    Raises :class:`QueryRefusedError` for an unterminated literal or comment.
    """
    out: list[_Segment] = []
    i, n, start = 0, len(sql), 0

    def flush_code(upto: int) -> None:
        if upto > start:
            out.append(_Segment("code", sql[start:upto]))

    while i < n:
        ch = sql[i]
        nxt = sql[i + 1] if i + 1 < n else ""
        if ch == "-" and nxt == "-":
            flush_code(i)
            end = sql.find("\n", i)
            end = n if end < 0 else end
            out.append(_Segment("comment", sql[i:end]))
            i = start = end
        elif ch == "/" and nxt == "*":
            flush_code(i)
            depth, j = 1, i + 2
            while j < n and depth:
                if sql.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif sql.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            if depth:
                raise QueryRefusedError("unterminated /* comment in the SQL")
            out.append(_Segment("comment", sql[i:j]))
            i = start = j
        elif ch in ("'", '"'):
            # E'...' (PostgreSQL escape string): backslash escapes apply.
            escape = (
                ch == "'" and i > start and sql[i - 1] in "eE"
                and (i - 1 == 0 or not (sql[i - 2].isalnum() or sql[i - 2] == "_"))
            )  # fmt: skip
            begin = i - 1 if escape else i
            flush_code(begin)
            j = i + 1
            while True:
                if j >= n:
                    what = "string literal" if ch == "'" else "quoted identifier"
                    raise QueryRefusedError(f"unterminated {what} in the SQL")
                if escape and sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == ch:
                    if j + 1 < n and sql[j + 1] == ch:  # doubled quote
                        j += 2
                        continue
                    break
                j += 1
            out.append(_Segment("string" if ch == "'" else "ident", sql[begin : j + 1]))
            i = start = j + 1
        elif ch == "$" and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            m = _DOLLAR_TAG.match(sql, i)
            if m is None:
                i += 1
                continue
            tag = m.group(0)
            end = sql.find(tag, m.end())
            if end < 0:
                raise QueryRefusedError(f"unterminated {tag}-quoted string in the SQL")
            flush_code(i)
            out.append(_Segment("dollar", sql[i : end + len(tag)]))
            i = start = end + len(tag)
        else:
            i += 1
    flush_code(n)
    return out


def check_select(sql: str) -> str:
    """Return ``sql`` without its trailing ``;`` if it is one ``SELECT`` / ``WITH`` statement.

    A lexical first line of defence (the database enforces read-only on its own); raises
    :class:`QueryRefusedError` naming what is wrong.
    """
    segments = _segments(sql)
    code = [s for s in segments if s.kind == "code"]
    words = re.findall(r"[A-Za-z_]+", " ".join(s.text for s in code))
    if not "".join(s.text for s in segments if s.kind != "comment").strip():
        raise QueryRefusedError("the SQL is empty")
    first = "".join(s.text for s in segments if s.kind != "comment").strip()
    head = words[0].upper() if words else ""
    if head not in ("SELECT", "WITH") or not first[:1].isalpha():
        shown = first.split(None, 1)[0][:30] if first else ""
        raise QueryRefusedError(
            f"only a single SELECT or WITH query may run (read-only audit), not {shown!r}"
        )
    # A ';' may only end the statement: nothing but blanks and comments after it.
    kept: list[str] = []
    ended = False
    for seg in segments:
        if seg.kind != "code":
            if ended and seg.kind != "comment":
                raise QueryRefusedError("only one statement may run: remove what follows ';'")
            if not ended:
                kept.append(seg.text)
            continue
        text = seg.text
        if ended:
            if text.strip(" \t\r\n;"):
                raise QueryRefusedError("only one statement may run: remove what follows ';'")
            continue
        cut = text.find(";")
        if cut >= 0:
            if text[cut:].strip(" \t\r\n;"):
                raise QueryRefusedError("only one statement may run: remove what follows ';'")
            ended = True
            text = text[:cut]
        kept.append(text)
    return "".join(kept).rstrip()


def param_names(sql: str) -> list[str]:
    """The ``:name`` parameters ``sql`` uses (outside literals and comments), in order."""
    names: list[str] = []
    for seg in _segments(sql):
        if seg.kind == "code":
            for name in _PARAM.findall(seg.text):
                if name not in names:
                    names.append(name)
    return names


def _to_pyformat(sql: str) -> str:
    """``:name`` -> ``%(name)s`` and ``%`` -> ``%%`` (psycopg's placeholder syntax)."""
    parts: list[str] = []
    for seg in _segments(sql):
        text = seg.text.replace("%", "%%")
        if seg.kind == "code":
            text = _PARAM.sub(lambda m: f"%({m.group(1)})s", text)
        parts.append(text)
    return "".join(parts)


# ---------------------------------------------------------------- results


def jsonable(value: Any) -> Any:
    """A JSON-friendly form of a database value (timestamps as ISO text, bytes as base64)."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    return value


@dataclass(frozen=True)
class QueryResult:
    """Rows of one query: column names, JSON-friendly row dicts, and whether it was cut."""

    columns: list[str]
    rows: list[dict[str, Any]]
    truncated: bool = False

    def column(self, name: str) -> list[Any]:
        """The values of one column."""
        return [r[name] for r in self.rows]


# ---------------------------------------------------------------- canned queries

Q_SUMMARY = """
SELECT run_id, current_epoch, epochs, last_seq, history_events, abandoned_events,
       steps_trained, prompts_pulled, prompts_trained, prompts_dropped, prompts_evicted,
       prompts_live
FROM run_summary
ORDER BY created_at, run_id
"""

_EVENT_COLS = (
    "seq, epoch, type, recorded_at, group_id, prompt_index, target_step, train_step, "
    "weight_version, payload"
)

Q_PROMPT_VIEW = f"""
SELECT {_EVENT_COLS}
FROM history_events
WHERE run_id = :run_id
  AND (prompt_index = :prompt_index
       OR group_id IN (SELECT group_id FROM history_events
                       WHERE run_id = :run_id AND prompt_index = :prompt_index)
       OR (type IN ('BatchSelected', 'StepTrained')
           AND train_step IN (SELECT train_step FROM history_events
                              WHERE run_id = :run_id AND prompt_index = :prompt_index
                                AND type = 'GroupSelected')))
ORDER BY seq
"""

# The canned lookups below drive from the events indexes (prompt, group, type + step) and
# keep only rows of the current history (the run's few history_spans), instead of
# filtering the history_events view, which joins every history row before filtering
# (docs/benchmarks.md, "Scale": seconds at 10M events; these take < 1 ms). They rely
# on the store's train_step column of GroupSelected, BatchSelected and StepTrained
# rows being the step in their payload (the decider only accepts those for the next
# train step, and the controller stamps each row with the step before applying it).
_H = "h AS (SELECT first_seq, last_seq FROM history_spans WHERE run_id = :run_id)"


def _in_history(alias: str) -> str:
    return f"EXISTS (SELECT 1 FROM h WHERE {alias}.seq BETWEEN h.first_seq AND h.last_seq)"


_EV_COLS = ", ".join("ev." + c.strip() for c in _EVENT_COLS.split(","))

Q_PROMPT = f"""
WITH {_H},
mine AS (
    SELECT ev.seq, ev.group_id, ev.type, ev.train_step FROM events ev
    WHERE ev.run_id = :run_id AND ev.prompt_index = :prompt_index AND {_in_history("ev")}
),
cand AS (
    SELECT seq FROM mine
    UNION
    SELECT ev.seq FROM events ev
    WHERE ev.run_id = :run_id AND ev.group_id IN (SELECT group_id FROM mine)
    UNION
    SELECT ev.seq FROM events ev
    WHERE ev.run_id = :run_id AND ev.type IN ('BatchSelected', 'StepTrained')
      AND ev.train_step IN (SELECT train_step FROM mine WHERE type = 'GroupSelected')
)
SELECT {_EV_COLS}
FROM cand c JOIN events ev ON ev.run_id = :run_id AND ev.seq = c.seq
WHERE {_in_history("ev")}
ORDER BY ev.seq
"""


def _json_int(dialect: str, field: str, col: str = "ev.payload") -> str:
    """An integer field of a JSON-text column, typed as the audit views type it."""
    if dialect == "postgresql":
        return f"(({col})::jsonb ->> '{field}')::bigint"
    return f"json_extract({col}, '$.{field}')"


def _sql_bool(expr: str) -> str:
    return f"CASE WHEN {expr} THEN TRUE WHEN NOT ({expr}) THEN FALSE END"


def step_query(dialect: str) -> str:
    """The step_batches rows of one step (``:run_id``, ``:train_step``) by index lookups.

    Returns exactly what :data:`Q_STEP_VIEW` returns (same columns, values and types).
    ``s`` is MATERIALIZED so the planner cannot trade the (type, step) index for the
    group index to skip the ORDER BY (a scan of the run on SQLite).
    """
    ts = _json_int(dialect, "train_step")
    return f"""
WITH {_H},
s AS MATERIALIZED (
    SELECT ev.seq, ev.recorded_at, ev.group_id, ev.prompt_index, ev.target_step,
           {ts} AS train_step, {_json_int(dialect, "staleness")} AS staleness
    FROM events ev
    WHERE ev.run_id = :run_id AND ev.type = 'GroupSelected' AND ev.train_step = :train_step
      AND {ts} = :train_step AND {_in_history("ev")}
),
t AS (
    SELECT ev.recorded_at, {_json_int(dialect, "weight_version")} AS weight_version
    FROM events ev
    WHERE ev.run_id = :run_id AND ev.type = 'StepTrained' AND ev.train_step = :train_step
      AND {ts} = :train_step AND {_in_history("ev")}
),
tt AS (SELECT MIN(recorded_at) AS trained_at, MIN(weight_version) AS weight_version FROM t)
SELECT s.train_step, s.group_id, s.prompt_index, s.target_step, s.staleness,
       s.seq AS selected_seq, {_sql_bool("tt.trained_at IS NOT NULL")} AS trained,
       tt.trained_at, tt.weight_version
FROM s CROSS JOIN tt
ORDER BY s.group_id
"""


Q_GROUP = f"""
SELECT {_EVENT_COLS}
FROM history_events
WHERE run_id = :run_id
  AND (group_id = :group_id
       OR (type IN ('BatchSelected', 'StepTrained')
           AND train_step IN (SELECT train_step FROM history_events
                              WHERE run_id = :run_id AND group_id = :group_id
                                AND type = 'GroupSelected')))
ORDER BY seq
"""

#: The step query over the step_batches view (see :func:`step_query`).
Q_STEP_VIEW = """
SELECT train_step, group_id, prompt_index, target_step, staleness, selected_seq, trained,
       trained_at, weight_version
FROM step_batches
WHERE run_id = :run_id AND train_step = :train_step
ORDER BY group_id
"""

Q_DROPPED = """
SELECT p.prompt_index, p.group_id, p.outcome, p.target_step, p.reason,
       g.vacate_outcome AS slot, r.prompt_index AS replaced_by_prompt, p.decided_at
FROM prompt_outcomes p
JOIN group_lifecycle g ON g.run_id = p.run_id AND g.group_id = p.group_id
LEFT JOIN group_lifecycle r ON r.run_id = p.run_id AND r.replaces_group_id = p.group_id
WHERE p.run_id = :run_id AND p.outcome IN ('dropped', 'evicted')
ORDER BY p.prompt_index
"""

Q_STALENESS = """
SELECT train_step, groups, shortfall, min_staleness, max_staleness, avg_staleness,
       mean_reward, trained, trained_at
FROM step_staleness
WHERE run_id = :run_id
ORDER BY train_step
"""

Q_RECOVERY = """
SELECT kind, seq, epoch, recorded_at, from_offset, mode, granularity, forced,
       checkpoint_train_step, checkpoint_weight_version, complete_groups_restored,
       unfinished_groups_found, siblings_reused, siblings_rerun, siblings_salvaged,
       recovered_groups_evicted, rolled_back_events
FROM recoveries
WHERE run_id = :run_id
ORDER BY seq
"""


# ---------------------------------------------------------------- the runner


class SqlAudit:
    """A read-only audit connection to a rolloutlog database.

    Raises :class:`StoreError` subclasses (bad URL, unreachable database, a schema not
    at this rolloutlog's head) from the constructor.
    """

    def __init__(
        self,
        url: str,
        *,
        limit: int | None = DEFAULT_LIMIT,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.store = EventStore.open(url, readonly=True, create=False)
        self.dialect = self.store.dialect
        self.limit = limit
        self.timeout_s = timeout_s
        self.where = self.store.url.render_as_string(hide_password=True)

    def close(self) -> None:
        """Release the connections."""
        self.store.close()

    def __enter__(self) -> SqlAudit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- runs
    def runs(self) -> list[str]:
        """Run ids in creation order."""
        return [r.run_id for r in self.store.list_runs()]

    def resolve_run(self, run_id: str | None) -> str:
        """``run_id`` if the run exists; without one, the only run of the database."""
        if run_id is not None:
            try:
                self.store.get_run(run_id)
            except RunNotFoundError as exc:
                known = ", ".join(self.runs()) or "none"
                raise RunNotFoundError(
                    f"no run {run_id!r} in {self.where} (runs: {known})"
                ) from exc
            return run_id
        runs = self.runs()
        if not runs:
            raise RunNotFoundError(f"{self.where} holds no runs")
        if len(runs) > 1:
            raise AuditError(
                f"{self.where} holds {len(runs)} runs ({', '.join(runs)}): pick one with --run"
            )
        return runs[0]

    # ---------------------------------------------------------------- canned queries
    def summary(self, run_id: str | None = None) -> QueryResult:
        """One row per run (or only ``run_id``): epochs, history size, prompt outcomes."""
        if run_id is None:
            return self.select(Q_SUMMARY)
        run_id = self.resolve_run(run_id)
        sql = Q_SUMMARY.replace("ORDER BY", "WHERE run_id = :run_id\nORDER BY")
        return self.select(sql, {"run_id": run_id})

    def prompt_history(self, run_id: str, prompt_index: int) -> QueryResult:
        """Every history event about a prompt: its group's events (siblings included) and
        the batch selection and train step of the step it was selected for."""
        return self.select(Q_PROMPT, {"run_id": run_id, "prompt_index": prompt_index})

    def group_history(self, run_id: str, group_id: int) -> QueryResult:
        """Every history event about a group (as :meth:`prompt_history`)."""
        return self.select(Q_GROUP, {"run_id": run_id, "group_id": group_id})

    def step_batch(self, run_id: str, train_step: int) -> QueryResult:
        """The groups selected for ``train_step`` with their staleness."""
        return self.select(step_query(self.dialect), {"run_id": run_id, "train_step": train_step})

    def dropped(self, run_id: str) -> QueryResult:
        """Prompts that left the run untrained (dropped or evicted), why, and their slot."""
        return self.select(Q_DROPPED, {"run_id": run_id})

    def staleness(self, run_id: str) -> QueryResult:
        """Per selected step: groups, shortfall, staleness min/max/avg, mean reward."""
        return self.select(Q_STALENESS, {"run_id": run_id})

    def recovery(self, run_id: str) -> QueryResult:
        """The recovery report of each restore (and takeover) in the run's history."""
        return self.select(Q_RECOVERY, {"run_id": run_id})

    # ---------------------------------------------------------------- any SELECT
    def select(
        self,
        sql: str,
        params: Mapping[str, Any] | None = None,
        *,
        limit: int | None = -1,
        check: bool = True,
    ) -> QueryResult:
        """Run one read-only query; ``:name`` parameters come from ``params``.

        ``limit``: most rows returned (-1: the audit's default, None: all).
        ``check=False`` skips the lexical check (tests use it to prove that the database
        itself refuses writes). Raises :class:`QueryRefusedError`,
        :class:`ReadOnlyViolationError`, :class:`MissingParameterError` or
        :class:`AuditError`.
        """
        statement = check_select(sql) if check else sql
        names = param_names(statement)
        given = dict(params or {})
        missing = [n for n in names if n not in given]
        if missing:
            flags = " ".join(f"--param {n}=VALUE" for n in missing)
            raise MissingParameterError(
                f"the query uses {', '.join(':' + n for n in missing)} but no value was "
                f"given ({flags})"
            )
        bound = {n: given[n] for n in names}
        cap = self.limit if limit == -1 else limit
        with self._connection() as conn:
            try:
                if bound:
                    text = statement if self.dialect == "sqlite" else _to_pyformat(statement)
                    result = conn.exec_driver_sql(text, bound)
                else:
                    result = conn.execution_options(no_parameters=True).exec_driver_sql(statement)
                if not result.returns_rows:
                    raise QueryRefusedError("the statement returned no rows: not a query")
                columns = list(result.keys())
                raw = result.fetchall() if cap is None else result.fetchmany(cap + 1)
            except sa.exc.DBAPIError as exc:
                raise self._translate(exc) from exc
        truncated = cap is not None and len(raw) > cap
        rows = [
            {c: jsonable(v) for c, v in zip(columns, row, strict=True)}
            for row in (raw[:cap] if truncated else raw)
        ]
        return QueryResult(columns, rows, truncated)

    # ---------------------------------------------------------------- internals
    def _connection(self) -> _ReadOnlyTransaction:
        return _ReadOnlyTransaction(self)

    def _translate(self, exc: sa.exc.DBAPIError) -> AuditError:
        msg = str(exc.orig if exc.orig is not None else exc).strip().splitlines()[0]
        low = msg.lower()
        if any(w in low for w in ("readonly", "read-only", "read only", "read-write")):
            return ReadOnlyViolationError(
                f"refused: the audit connection is read-only and the query tried to write; "
                f"nothing was changed (database said: {msg})"
            )
        if "statement timeout" in low or "interrupted" in low:
            return AuditError(f"the query ran past the {self.timeout_s:g}s timeout ({msg})")
        return AuditError(f"the query failed on {self.where}: {msg}")


class _ReadOnlyTransaction:
    """One read-only transaction: enforced by the database, rolled back at the end."""

    def __init__(self, audit: SqlAudit) -> None:
        self.audit = audit
        self._conn: Connection | None = None

    def __enter__(self) -> Connection:
        audit = self.audit
        try:
            conn = audit.store.engine.connect()
        except sa.exc.DBAPIError as exc:
            raise AuditError(f"cannot connect to {audit.where}: {exc.orig}") from exc
        self._conn = conn
        try:
            if audit.dialect == "sqlite":
                conn.exec_driver_sql("PRAGMA query_only = ON")
                raw = conn.connection.dbapi_connection
                assert isinstance(raw, sqlite3.Connection)
                if audit.timeout_s is not None:
                    deadline = time.monotonic() + audit.timeout_s
                    raw.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
            else:
                conn.exec_driver_sql("SET TRANSACTION READ ONLY")
                # The views' plans are over-estimated on small or unanalysed tables, and
                # JIT-compiling them costs seconds; audit queries never gain from JIT.
                conn.exec_driver_sql("SET LOCAL jit = off")
                if audit.timeout_s is not None:
                    ms = max(1, int(audit.timeout_s * 1000))
                    conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
        except BaseException:
            conn.close()
            raise
        return conn

    def __exit__(self, *exc: object) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            if self.audit.dialect == "sqlite" and not conn.invalidated:
                raw = conn.connection.dbapi_connection
                if isinstance(raw, sqlite3.Connection):
                    raw.set_progress_handler(None, 0)
            conn.rollback()
        finally:
            conn.close()
