"""SQL audit of a stored run: canned queries over the audit views, and a read-only runner.

The views (created by the alembic revisions ``0006_rollout_views``,
``0007_prompt_passes``, ``0008_engine_views``, ``0012_turn_views`` and
``0013_turn_views_staleness``, documented in
``docs/sql-cookbook.md``) hold each run's *current history* only: events a restore
abandoned appear in ``abandoned_events`` and nowhere else, except in the multi-turn views
(``turns``, ``trajectories``, ``tool_calls``), which read both and say which
(``in_history``): a restore reuses the turns an abandoned branch recorded.

:class:`SqlAudit` opens the log read-only and runs one query per transaction, read-only
by construction (``docs/sql-cookbook.md``, "Read-only by construction"):

* PostgreSQL: user SQL (:meth:`SqlAudit.select`) runs only as a reader role (see
  :func:`role_problems`; ``rolloutlog db create-reader`` makes one) unless
  ``allow_privileged_role``; it is sent as one prepared statement (the extended protocol:
  the server refuses a second statement), in a ``SET TRANSACTION READ ONLY`` transaction
  that one statement cannot end, with ``statement_timeout``, on a connection discarded
  afterwards;
* SQLite: the file is opened ``mode=ro`` with ``PRAGMA query_only = ON``, and an
  authorizer allows ``SELECT``, column reads and :data:`SQLITE_FUNCTIONS` only;
* both: :func:`check_select`, a lexer that follows PostgreSQL's rules, refuses anything
  but one ``SELECT`` / ``WITH`` statement and functions with side effects, with clear
  messages.

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

from rolloutlog.eventstore import EventStore, RunNotFoundError, StoreError
from rolloutlog.eventstore.driver_errors import DriverFault, driver_fault

# The views audited are the rollout index's branch: its module registers that branch, so
# the schema check of the log opened here includes it.
from . import rollout_index as _rollout_index  # noqa: F401

#: The audit views and what each holds (columns: ``docs/sql-cookbook.md``).
VIEWS: dict[str, str] = {
    "history_spans": "the contiguous offset ranges of each run's current history",
    "history_events": "the events of each run's current history (abandoned rows left out)",
    "abandoned_events": "the events a restore abandoned (kept for audit and salvage)",
    "group_lifecycle": "one row per group: stamps, generation, commit, selection, fate",
    "step_batches": "one row per group selected for a train step",
    "step_staleness": "one row per selected batch: size, shortfall, staleness, reward",
    "prompt_outcomes": "one row per pulled prompt (pass, index): trained, dropped, evicted or live",
    "recoveries": "one row per restore (and takeover) in the history, with its counts",
    "run_summary": "one row per run: epochs, history size, steps, prompt outcomes",
    "sample_engines": "one row per completed sibling attempt, with the engine that made it",
    "engine_membership": "one row per engine joined, lost or refit",
    "engine_lost_attempts": "one row per attempt in flight on an engine when it was lost",
    "turns": "one row per trajectory event (model call, tool call, environment step...), "
    "history and abandoned, in log order",
    "trajectories": "one row per multi-turn trajectory: prompt, attempts, turns, tokens, end",
    "tool_calls": "one row per tool call requested, with its result or failure",
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


# PostgreSQL's lexer (scan.l): ident_start = [A-Za-z\200-\377_], ident_cont adds digits
# and '$'; a dollar-quote tag is $tag$ with tag = ident_start [A-Za-z\200-\377_0-9]*.
# \200-\377 are the bytes of every non-ASCII character in UTF-8.
_NON_ASCII = "\x80-\U0010ffff"
_IDENT_START = f"A-Za-z_{_NON_ASCII}"
_IDENT_CONT = f"A-Za-z_0-9${_NON_ASCII}"
_DOLLAR_TAG = re.compile(f"\\$(?:[{_IDENT_START}][A-Za-z_0-9{_NON_ASCII}]*)?\\$")
# A number ends before a '$' (``1$a$`` is 1 then a dollar quote, as in PostgreSQL).
_IDENT_OR_NUMBER = re.compile(f"[{_IDENT_START}][{_IDENT_CONT}]*|[0-9][A-Za-z_0-9.{_NON_ASCII}]*")
#: An unquoted identifier (or keyword) of a code segment.
_WORD = re.compile(f"(?<![{_IDENT_CONT}])[{_IDENT_START}][{_IDENT_CONT}]*")
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_UNICODE_ESCAPE = re.compile(r"\\(?:\\|([0-9A-Fa-f]{4})|\+([0-9A-Fa-f]{6}))")


def _segments(sql: str) -> list[_Segment]:
    """Split SQL into code, quoted literals/identifiers and comments, as PostgreSQL does.

    Unquoted identifiers (which may hold ``$`` and non-ASCII letters: ``€$a$`` is one
    identifier, not ``€`` followed by a dollar quote) and numbers are skipped whole, so a
    ``$`` inside them never opens a dollar quote. Raises :class:`QueryRefusedError` for an
    unterminated literal or comment.
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
        elif ch in ("'", '"') or (ch in "eEuU" and _quote_prefix(sql, i)):
            # E'...' (backslash escapes apply), U&'...' / U&"..." (Unicode escapes).
            prefix = _quote_prefix(sql, i) if ch in "eEuU" else ""
            begin = i
            i += len(prefix)
            quote = sql[i]
            escape = prefix.upper() == "E"
            flush_code(begin)
            j = i + 1
            while True:
                if j >= n:
                    what = "string literal" if quote == "'" else "quoted identifier"
                    raise QueryRefusedError(f"unterminated {what} in the SQL")
                if escape and sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == quote:
                    if j + 1 < n and sql[j + 1] == quote:  # doubled quote
                        j += 2
                        continue
                    break
                j += 1
            out.append(_Segment("string" if quote == "'" else "ident", sql[begin : j + 1]))
            i = start = j + 1
        elif ch == "$":
            m = _DOLLAR_TAG.match(sql, i)
            if m is None:  # $1 (a positional parameter) or a stray '$'
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
            m = _IDENT_OR_NUMBER.match(sql, i)
            i = m.end() if m else i + 1
    flush_code(n)
    return out


def _quote_prefix(sql: str, i: int) -> str:
    """``E`` / ``U&`` when a string or quoted identifier starts at ``i`` with that prefix."""
    rest = sql[i : i + 3]
    if rest[:1] in ("e", "E") and rest[1:2] == "'":
        return rest[:1]
    if rest[:1] in ("u", "U") and rest[1:2] == "&" and rest[2:3] in ("'", '"'):
        return rest[:2]
    return ""


def _unicode_char(m: re.Match[str]) -> str:
    """The character a ``U&`` escape (``\\XXXX``, ``\\+XXXXXX``, ``\\\\``) stands for."""
    code = m.group(1) or m.group(2)
    return "\\" if code is None else chr(int(code, 16))


def _identifiers(segments: list[_Segment]) -> list[str]:
    """The names the SQL uses, as the server resolves them: unquoted ones lower-cased,
    quoted ones (``"x"``, ``U&"\\0078"``) exact. Raises :class:`QueryRefusedError` for a
    ``UESCAPE`` clause (not needed in an audit query, and it would change the escapes)."""
    names: list[str] = []
    for seg in segments:
        if seg.kind == "code":
            words = [w.lower() for w in _WORD.findall(seg.text)]
            if "uescape" in words:
                raise QueryRefusedError("UESCAPE is not supported in audit queries")
            names.extend(words)
        elif seg.kind == "ident":
            text = seg.text
            unicode = text[:2].upper() == "U&"
            body = text[3:-1] if unicode else text[1:-1]
            body = body.replace('""', '"')
            if unicode:
                body = _UNICODE_ESCAPE.sub(_unicode_char, body)
            names.append(body)
    return names


#: Functions with effects beyond reading the log (server files, other sessions, locks,
#: settings, large objects, SQL run from a string, extensions): refused by name in every
#: audit query, whatever the role. The reader role cannot run most of them anyway; this
#: also covers a privileged role run with the override.
_SIDE_EFFECT_FUNCTION = re.compile(
    r"""(
      pg_terminate_backend | pg_cancel_backend | pg_reload_conf | pg_rotate_logfile
    | pg_read_file | pg_read_binary_file | pg_stat_file | pg_ls_\w* | pg_file_\w*
    | pg_logdir_ls | pg_\w*advisory\w* | set_config | pg_notify | lo_\w* | lowrite | loread
    | pg_switch_wal | pg_create_restore_point | pg_backup_\w* | pg_start_backup
    | pg_stop_backup | pg_promote | pg_wal_replay_\w* | pg_log_backend_memory_contexts
    | pg_\w*replication_slot\w* | pg_logical_\w* | pg_replication_origin_\w*
    | pg_stat_reset\w* | pg_stat_statements_reset | pg_import_system_collations
    | pg_prewarm | query_to_xml\w* | cursor_to_xml\w* | ts_stat | dblink\w* | nextval
    | setval | txid_current | pg_current_xact_id | load_extension | fts3_tokenizer
    )""",
    re.VERBOSE,
)


def check_select(sql: str) -> str:
    """Return ``sql`` without its trailing ``;`` if it is one ``SELECT`` / ``WITH`` statement.

    A lexical first line of defence, which gives clear messages: one statement per
    execution is enforced by the driver (PostgreSQL: extended protocol, a prepared
    statement; SQLite: ``execute`` runs one statement) and read-only by the database
    (reader role, read-only transaction, SQLite authorizer). Also refuses functions with
    side effects (:data:`_SIDE_EFFECT_FUNCTION`). Raises :class:`QueryRefusedError`
    naming what is wrong.
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
    for name in _identifiers(segments):
        if _SIDE_EFFECT_FUNCTION.fullmatch(name):
            raise QueryRefusedError(
                f"{name} has effects beyond reading the log (server files, sessions, locks, "
                "settings or large objects): it is refused in an audit query"
            )
    # A ';' may only end the statement: nothing but blanks and comments after it.
    kept: list[str] = []
    ended = False
    for seg in segments:
        text = seg.text
        if not ended:
            if seg.kind != "code" or ";" not in text:
                kept.append(text)
                continue
            before, text = text.split(";", 1)
            kept.append(before)
            ended = True
        if seg.kind != "comment" and text.strip(" \t\r\n;"):
            raise QueryRefusedError("only one statement may run: remove what follows ';'")
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

# The canned lookups below drive from the rollout index's indexes (prompt, group, type +
# step; controller/rollout_index.py), join events by primary key for the rest, and
# keep only rows of the current history (the run's few history_spans), instead of
# filtering the history_events view, which joins every history row before filtering
# (docs/benchmarks.md, "Scale": seconds at 10M events; these take < 1 ms). They rely
# on the index's train_step of GroupSelected, BatchSelected and StepTrained
# rows being the step in their payload (the decider only accepts those for the next
# train step, and the controller stamps each row with the step before applying it).
_H = "h AS (SELECT first_seq, last_seq FROM history_spans WHERE run_id = :run_id)"


def _in_history(alias: str) -> str:
    return f"EXISTS (SELECT 1 FROM h WHERE {alias}.seq BETWEEN h.first_seq AND h.last_seq)"


# An event's keys come from its rollout_index row, or (a sibling event) from its
# rollout_sibling_index row and the first step mark at or after it (revision 0011).
_KEY_EXPR = {
    "group_id": "COALESCE(ix.group_id, sx.group_id) AS group_id",
    "prompt_index": "ix.prompt_index",
    "target_step": "ix.target_step",
    "train_step": "COALESCE(ix.train_step, m.train_step) AS train_step",
    "weight_version": "COALESCE(ix.weight_version, m.weight_version) AS weight_version",
}
_EV_COLS = ", ".join(_KEY_EXPR.get(c.strip(), "ev." + c.strip()) for c in _EVENT_COLS.split(","))

Q_PROMPT = f"""
WITH {_H},
mine AS (
    SELECT ix.seq, ix.group_id, ix.type, ix.train_step FROM rollout_index ix
    WHERE ix.run_id = :run_id AND ix.prompt_index = :prompt_index AND {_in_history("ix")}
),
cand AS (
    SELECT seq FROM mine
    UNION
    SELECT ix.seq FROM rollout_index ix
    WHERE ix.run_id = :run_id AND ix.group_id IN (SELECT group_id FROM mine)
    UNION
    SELECT sx.seq FROM rollout_sibling_index sx
    WHERE sx.run_id = :run_id AND sx.group_id IN (SELECT group_id FROM mine)
    UNION
    SELECT ix.seq FROM rollout_index ix
    WHERE ix.run_id = :run_id AND ix.type IN ('BatchSelected', 'StepTrained')
      AND ix.train_step IN (SELECT train_step FROM mine WHERE type = 'GroupSelected')
)
SELECT {_EV_COLS}
FROM cand c
JOIN events ev ON ev.run_id = :run_id AND ev.seq = c.seq
LEFT JOIN rollout_index ix ON ix.run_id = :run_id AND ix.seq = c.seq
LEFT JOIN rollout_sibling_index sx ON sx.run_id = :run_id AND sx.seq = c.seq
LEFT JOIN rollout_step_marks m ON sx.seq IS NOT NULL AND m.run_id = :run_id AND m.seq = (
    SELECT MIN(m2.seq) FROM rollout_step_marks m2 WHERE m2.run_id = :run_id AND m2.seq >= c.seq)
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
    SELECT ev.seq, ev.recorded_at, ix.group_id, ix.prompt_index, ix.target_step,
           {ts} AS train_step, {_json_int(dialect, "staleness")} AS staleness
    FROM rollout_index ix JOIN events ev ON ev.run_id = ix.run_id AND ev.seq = ix.seq
    WHERE ix.run_id = :run_id AND ix.type = 'GroupSelected' AND ix.train_step = :train_step
      AND {ts} = :train_step AND {_in_history("ix")}
),
t AS (
    SELECT ev.recorded_at, {_json_int(dialect, "weight_version")} AS weight_version
    FROM rollout_index ix JOIN events ev ON ev.run_id = ix.run_id AND ev.seq = ix.seq
    WHERE ix.run_id = :run_id AND ix.type = 'StepTrained' AND ix.train_step = :train_step
      AND {ts} = :train_step AND {_in_history("ix")}
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


# ---------------------------------------------------------------- roles (PostgreSQL)

#: The command that creates a role fit for ``audit --sql`` (named in refusals).
READER_COMMAND = "rolloutlog db create-reader URL --role NAME"

#: Predefined roles whose members reach the server's files, programs or other sessions.
DANGEROUS_PREDEFINED_ROLES = (
    "pg_read_server_files",
    "pg_write_server_files",
    "pg_execute_server_program",
    "pg_signal_backend",
    "pg_write_all_data",
    "pg_checkpoint",
)


class PrivilegedRoleError(QueryRefusedError):
    """``--sql`` would run as a role that can write, create roles, or is a superuser."""


def log_schema(conn: Connection) -> str:
    """The schema that holds the log's ``events`` table (first in the search path)."""
    name = conn.exec_driver_sql(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = to_regclass('events')"
    ).scalar()
    if name is None:
        raise AuditError("no rolloutlog events table in the search path of this connection")
    return str(name)


_ROLE_SQL = """
WITH target AS (
    SELECT oid, rolname, rolsuper FROM pg_roles WHERE rolname = %(role)s
), via AS (
    SELECT r.oid, r.rolname, r.rolsuper, r.rolcreaterole
    FROM pg_roles r, target t
    WHERE NOT t.rolsuper AND pg_has_role(t.oid, r.oid, 'MEMBER')
    UNION ALL
    SELECT oid, rolname, rolsuper, FALSE FROM target WHERE rolsuper
)
SELECT v.rolname, v.rolname = t.rolname AS itself, v.rolsuper, v.rolcreaterole,
       has_database_privilege(v.oid, current_database(), 'CREATE') AS create_in_db,
       has_schema_privilege(v.oid, %(schema)s, 'CREATE') AS create_in_schema,
       ARRAY(
           SELECT c.relname::text FROM pg_class c
           WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = %(schema)s)
             AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
             AND has_table_privilege(v.oid, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE, TRIGGER')
           ORDER BY c.relname
       ) AS writable
FROM via v, target t
ORDER BY itself DESC, v.rolname
"""


def role_problems(conn: Connection, role: str | None = None) -> list[str]:
    """Why ``role`` (default: the connected role) is more than a reader of the log.

    Empty for a role fit for ``audit --sql``: not a superuser, cannot create roles, has
    no write privilege (INSERT, UPDATE, DELETE, TRUNCATE, TRIGGER) on any table or view
    of the log's schema, cannot create objects in that schema or the database, and is no
    member of a predefined role that reaches server files, programs or other sessions.
    Roles it is a member of count too (``SET ROLE`` reaches them whatever ``INHERIT``).
    """
    name = role if role is not None else str(conn.exec_driver_sql("SELECT current_user").scalar())
    schema = log_schema(conn)
    rows = conn.exec_driver_sql(_ROLE_SQL, {"role": name, "schema": schema}).all()
    if not rows:
        raise AuditError(f"no role {name!r} on this server")
    problems: list[str] = []
    for r in rows:
        who = "" if r.itself else f" through its membership in {r.rolname!r}"
        if r.rolsuper:
            problems.append(f"is a superuser{who}")
            continue
        if r.rolcreaterole:
            problems.append(f"can create roles{who}")
        if r.rolname in DANGEROUS_PREDEFINED_ROLES:
            problems.append(f"is a member of {r.rolname}")
        if r.writable:
            problems.append(f"can write to {', '.join(r.writable)}{who}")
        if r.create_in_schema:
            problems.append(f"can create objects in schema {schema}{who}")
        if r.create_in_db:
            problems.append(f"can create schemas in the database{who}")
    return problems


# ---------------------------------------------------------------- SQLite authorizer

#: SQLite functions an audit query may call: pure scalar, aggregate, window, date/time
#: and JSON functions. Everything else (``load_extension``, ``fts3_tokenizer``, any
#: application function) is refused by the authorizer.
_FUNCTION_NAMES = """
    abs avg char coalesce concat concat_ws count cume_dist date datetime dense_rank
    first_value format glob group_concat hex ifnull iif instr json json_array
    json_array_length json_extract json_group_array json_group_object json_object
    json_patch json_quote json_remove json_replace json_set json_type json_valid
    jsonb julianday lag last_value lead length like likelihood likely lower ltrim max
    min nth_value ntile nullif octet_length percent_rank printf quote random randomblob
    rank replace round row_number rtrim sign string_agg strftime substr substring sum
    time timediff total trim typeof unhex unicode unixepoch unlikely upper zeroblob
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln
    log log10 log2 mod pi pow power radians sin sinh sqrt tan tanh trunc
    sqlite_version
"""
SQLITE_FUNCTIONS = frozenset(_FUNCTION_NAMES.split())

_SQLITE_ACTIONS = {
    getattr(sqlite3, n): n.removeprefix("SQLITE_").replace("_", " ")
    for n in dir(sqlite3)
    if n.startswith("SQLITE_")
    and n.removeprefix("SQLITE_").split("_")[0]
    in ("CREATE", "DROP", "INSERT", "UPDATE", "DELETE", "PRAGMA", "ATTACH", "DETACH",
        "ALTER", "TRANSACTION", "REINDEX", "ANALYZE", "SAVEPOINT")
}  # fmt: skip


class _SqliteAuthorizer:
    """Allows reads only: ``SELECT``, column reads, recursive CTEs and the functions of
    :data:`SQLITE_FUNCTIONS`; records what it denied, for the error message."""

    def __init__(self) -> None:
        self.denied: list[str] = []

    def __call__(
        self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None
    ) -> int:
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in SQLITE_FUNCTIONS:
                return sqlite3.SQLITE_OK
            self.denied.append(f"function {arg2}()")
            return sqlite3.SQLITE_DENY
        what = _SQLITE_ACTIONS.get(action, f"action {action}")
        self.denied.append(f"{what} {arg1}" if arg1 else what)
        return sqlite3.SQLITE_DENY


# ---------------------------------------------------------------- the runner


class SqlAudit:
    """A read-only audit connection to a rolloutlog database.

    ``allow_privileged_role``: on PostgreSQL, :meth:`select` (user SQL) refuses to run as
    a role that can write, create roles or is a superuser (see :func:`role_problems`)
    unless this is set; every query still runs in a read-only transaction with the
    timeout either way. Raises :class:`StoreError` subclasses (bad URL, unreachable
    database, a schema not at this rolloutlog's head) from the constructor.
    """

    def __init__(
        self,
        url: str,
        *,
        limit: int | None = DEFAULT_LIMIT,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        allow_privileged_role: bool = False,
    ) -> None:
        self.store = EventStore.open(url, readonly=True, create=False)
        self.dialect = self.store.dialect
        self.limit = limit
        self.timeout_s = timeout_s
        self.allow_privileged_role = allow_privileged_role
        self.where = self.store.url.render_as_string(hide_password=True)
        self._role_ok = False

    def close(self) -> None:
        """Release the connections."""
        self.store.close()

    def __enter__(self) -> SqlAudit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the role
    def role_problems(self) -> list[str]:
        """Why the connection's role is more than a reader (always empty on SQLite)."""
        if self.dialect == "sqlite":
            return []
        try:
            with self.store.engine.connect() as conn:
                return role_problems(conn)
        except sa.exc.DBAPIError as exc:
            raise self._translate(exc) from exc

    def require_reader(self) -> None:
        """Raise :class:`PrivilegedRoleError` if user SQL would run as a privileged role
        (PostgreSQL, without ``allow_privileged_role``)."""
        if self._role_ok or self.allow_privileged_role or self.dialect == "sqlite":
            return
        problems = self.role_problems()
        if problems:
            user = self.store.url.username or "the default user"
            raise PrivilegedRoleError(
                f"refused: --sql would run as role {user!r}, which {'; '.join(problems)}. "
                f"Audit SQL runs as a read-only role: create one with `{READER_COMMAND}` "
                "and pass the URL it prints, or pass --allow-privileged-role to run it "
                "anyway (still in a read-only transaction with the timeout)"
            )
        self._role_ok = True

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
            return self._query(Q_SUMMARY)
        run_id = self.resolve_run(run_id)
        sql = Q_SUMMARY.replace("ORDER BY", "WHERE run_id = :run_id\nORDER BY")
        return self._query(sql, {"run_id": run_id})

    def prompt_history(self, run_id: str, prompt_index: int) -> QueryResult:
        """Every history event about a prompt: its group's events (siblings included) and
        the batch selection and train step of the step it was selected for."""
        return self._query(Q_PROMPT, {"run_id": run_id, "prompt_index": prompt_index})

    def group_history(self, run_id: str, group_id: int) -> QueryResult:
        """Every history event about a group (as :meth:`prompt_history`)."""
        return self._query(Q_GROUP, {"run_id": run_id, "group_id": group_id})

    def step_batch(self, run_id: str, train_step: int) -> QueryResult:
        """The groups selected for ``train_step`` with their staleness."""
        return self._query(step_query(self.dialect), {"run_id": run_id, "train_step": train_step})

    def dropped(self, run_id: str) -> QueryResult:
        """Prompts that left the run untrained (dropped or evicted), why, and their slot."""
        return self._query(Q_DROPPED, {"run_id": run_id})

    def staleness(self, run_id: str) -> QueryResult:
        """Per selected step: groups, shortfall, staleness min/max/avg, mean reward."""
        return self._query(Q_STALENESS, {"run_id": run_id})

    def recovery(self, run_id: str) -> QueryResult:
        """The recovery report of each restore (and takeover) in the run's history."""
        return self._query(Q_RECOVERY, {"run_id": run_id})

    # ---------------------------------------------------------------- any SELECT
    def select(
        self,
        sql: str,
        params: Mapping[str, Any] | None = None,
        *,
        limit: int | None = -1,
        check: bool = True,
    ) -> QueryResult:
        """Run one read-only user query; ``:name`` parameters come from ``params``.

        ``limit``: most rows returned (-1: the audit's default, None: all).
        ``check=False`` skips the lexical check (tests use it to prove that the driver and
        the database refuse on their own). On PostgreSQL the connection's role must be a
        reader (:meth:`require_reader`). Raises :class:`QueryRefusedError` (and its
        :class:`PrivilegedRoleError`, :class:`ReadOnlyViolationError`),
        :class:`MissingParameterError` or :class:`AuditError`.
        """
        statement = check_select(sql) if check else sql
        self.require_reader()
        return self._query(statement, params, limit=limit, user=True)

    def _query(
        self,
        statement: str,
        params: Mapping[str, Any] | None = None,
        *,
        limit: int | None = -1,
        user: bool = False,
    ) -> QueryResult:
        """Run ``statement`` read-only. ``user``: SQL from outside rolloutlog, which on
        PostgreSQL is always prepared (one statement) and whose connection is discarded."""
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
        guard = _ReadOnlyTransaction(self, discard=user)
        with guard as conn:
            raw_conn = conn.connection.dbapi_connection
            assert raw_conn is not None
            cur = raw_conn.cursor()
            try:
                if self.dialect == "sqlite":
                    # sqlite3 runs one statement per execute (more is a ProgrammingError).
                    cur.execute(statement, bound)
                else:
                    # prepare=True: the extended protocol (Parse/Bind/Execute), in which the
                    # server accepts exactly one statement; without parameters psycopg
                    # would use the simple protocol, which runs a whole script.
                    text = _to_pyformat(statement) if bound else statement
                    # psycopg's cursor here; SQLAlchemy types the raw cursor as a DBAPI one.
                    cur.execute(text, bound or None, prepare=True if user else None)  # type: ignore[call-arg]
                if cur.description is None:
                    raise QueryRefusedError("the statement returned no rows: not a query")
                columns = [d[0] for d in cur.description]
                raw = cur.fetchall() if cap is None else cur.fetchmany(cap + 1)
            except (self._driver_error, sqlite3.Warning) as exc:
                raise self._translate(exc, guard.denied) from exc
            except sa.exc.DBAPIError as exc:
                raise self._translate(exc, guard.denied) from exc
            finally:
                cur.close()
        truncated = cap is not None and len(raw) > cap
        rows = [
            {c: jsonable(v) for c, v in zip(columns, row, strict=True)}
            for row in (raw[:cap] if truncated else raw)
        ]
        return QueryResult(columns, rows, truncated)

    # ---------------------------------------------------------------- internals
    @property
    def _driver_error(self) -> type[Exception]:
        """The driver's base exception class (``sqlite3.Error``, ``psycopg.Error``)."""
        error: type[Exception] = self.store.engine.dialect.loaded_dbapi.Error
        return error

    def _translate(self, exc: BaseException, denied: list[str] | None = None) -> AuditError:
        orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
        lines = str(orig if orig is not None else exc).strip().splitlines()
        msg = lines[0] if lines else type(exc).__name__
        if denied:
            what = ", ".join(dict.fromkeys(denied))
            writes = [d for d in denied if not d.startswith("function ")]
            if writes:
                return ReadOnlyViolationError(
                    f"refused: the audit connection is read-only and the query tried "
                    f"{what}; nothing was changed"
                )
            return QueryRefusedError(
                f"refused: the query calls {what}, which audit queries may not call; "
                f"nothing was changed (allowed: {', '.join(sorted(SQLITE_FUNCTIONS))})"
            )
        fault = driver_fault(self.dialect, orig)
        if fault is DriverFault.NOT_ONE_STATEMENT:
            return QueryRefusedError(
                f"only one statement that parses may run (database said: {msg})"
            )
        if fault is DriverFault.READ_ONLY:
            return ReadOnlyViolationError(
                f"refused: the audit connection is read-only and the query tried to write; "
                f"nothing was changed (database said: {msg})"
            )
        if fault is DriverFault.PERMISSION:
            return ReadOnlyViolationError(
                f"refused: the audit role may only read the log; nothing was changed "
                f"(database said: {msg})"
            )
        if fault is DriverFault.TIMEOUT:
            return AuditError(f"the query ran past the {self.timeout_s:g}s timeout ({msg})")
        return AuditError(f"the query failed on {self.where}: {msg}")


class _ReadOnlyTransaction:
    """One read-only transaction, enforced by the database and rolled back at the end.

    SQLite: ``PRAGMA query_only`` on a file opened ``mode=ro``, and an authorizer that
    allows reads only. PostgreSQL: ``SET TRANSACTION READ ONLY`` (the query runs as one
    prepared statement, so it cannot end the transaction) with ``statement_timeout``;
    with ``discard`` (user SQL) the connection is discarded afterwards, so no session
    state a query might leave (settings, locks, prepared statements) outlives it.
    """

    def __init__(self, audit: SqlAudit, *, discard: bool) -> None:
        self.audit = audit
        self.discard = discard
        self._conn: Connection | None = None
        self.denied: list[str] = []

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
                authorizer = _SqliteAuthorizer()
                self.denied = authorizer.denied
                raw.set_authorizer(authorizer)
            else:
                conn.exec_driver_sql("SET TRANSACTION READ ONLY")
                # The views' plans are over-estimated on small or unanalysed tables, and
                # JIT-compiling them costs seconds; audit queries never gain from JIT.
                conn.exec_driver_sql("SET LOCAL jit = off")
                if audit.timeout_s is not None:
                    ms = max(1, int(audit.timeout_s * 1000))
                    conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        return conn

    def __exit__(self, *exc: object) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            if self.audit.dialect == "sqlite":
                if not conn.invalidated:
                    raw = conn.connection.dbapi_connection
                    if isinstance(raw, sqlite3.Connection):
                        # Before the rollback, which the authorizer would refuse.
                        raw.set_authorizer(None)
                        raw.set_progress_handler(None, 0)
                conn.rollback()
            else:
                try:
                    conn.rollback()
                except sa.exc.DBAPIError:
                    self.discard = True  # a broken connection never goes back to the pool
                if self.discard:
                    conn.invalidate()
        finally:
            conn.close()
