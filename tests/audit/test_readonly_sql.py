"""The read-only SQL runner: the lexical check, parameters, limits and timeouts, and
read-only enforced by the database itself on both dialects (a refused write is a clear
error and changes nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from audit_helpers import BuiltRun

from rolloutlog.controller.sql_audit import (
    AuditError,
    MissingParameterError,
    QueryRefusedError,
    ReadOnlyViolationError,
    SqlAudit,
    _to_pyformat,
    check_select,
    param_names,
)
from rolloutlog.eventstore import EventStore, SchemaMismatchError, StoreUnavailableError, migrate

# ---------------------------------------------------------------- the lexical check


@pytest.mark.parametrize(
    ("sql", "kept"),
    [
        ("SELECT 1", "SELECT 1"),
        ("  select 1 ;  ", "  select 1"),
        ("SELECT 1;;\n-- done\n", "SELECT 1"),
        ("-- a comment; with a semicolon\nSELECT 1", "-- a comment; with a semicolon\nSELECT 1"),
        ("/* lead */ WITH x AS (SELECT 1) SELECT * FROM x", None),
        ("SELECT ';' AS s, \"a;b\" FROM t", None),
        ("SELECT 'it''s; fine'", None),
        ("SELECT E'a\\'; b'", None),
        ("SELECT $$ ; $$, $tag$ ; $tag$", None),
        ("SELECT 1 /* ; */", None),
    ],
)
def test_single_select_is_accepted(sql: str, kept: str | None) -> None:
    assert check_select(sql) == (kept if kept is not None else sql)


@pytest.mark.parametrize(
    ("sql", "why"),
    [
        ("", "empty"),
        ("  -- only a comment", "empty"),
        ("DELETE FROM events", "only a single SELECT"),
        ("insert into runs values (1)", "only a single SELECT"),
        ("PRAGMA query_only = OFF", "only a single SELECT"),
        ("ATTACH DATABASE 'x.db' AS x", "only a single SELECT"),
        ("SET default_transaction_read_only = off", "only a single SELECT"),
        ("(SELECT 1)", "only a single SELECT"),
        ("SELECT 1; DELETE FROM events", "only one statement"),
        ("SELECT 1; SELECT 2", "only one statement"),
        ("SELECT 1 -- x\n; DROP TABLE runs", "only one statement"),
        ("SELECT 1; 'x'", "only one statement"),
        ("SELECT 'unterminated", "unterminated string"),
        ('SELECT "x', "unterminated quoted identifier"),
        ("SELECT 1 /* never closed", "unterminated /*"),
        ("SELECT $q$ open", "unterminated"),
    ],
)
def test_anything_else_is_refused(sql: str, why: str) -> None:
    with pytest.raises(QueryRefusedError, match=why):
        check_select(sql)


@pytest.mark.parametrize(
    "sql",
    [
        # issue 10: '€$a$' is an identifier (PostgreSQL's ident_cont holds '$' and every
        # non-ASCII letter), so the ';' after it ends the statement.
        "SELECT 1 AS €$a$; COMMIT; BEGIN READ WRITE; DELETE FROM events; "
        "UPDATE runs SET current_epoch = 7; COMMIT; SELECT 1 AS €$a$",
        "SELECT 1 AS a$b$; DELETE FROM events; SELECT 1 AS x$b$",
        "SELECT 1 AS é$x$; DELETE FROM events; SELECT 1 AS y$x$",
        "SELECT 1$a$; DELETE FROM events; $a$",  # a number, then a real dollar quote
        "SELECT 'a\\'; DELETE FROM events; --'",
        "SELECT abcE'x\\'; DELETE FROM events; --'",  # E' only starts a word
    ],
)
def test_identifiers_and_numbers_never_open_a_dollar_quote(sql: str) -> None:
    if sql.startswith("SELECT 1$a$"):
        assert check_select(sql) == sql  # $a$ ... $a$ is one string: a single statement
        return
    with pytest.raises(QueryRefusedError, match="only one statement"):
        check_select(sql)


@pytest.mark.parametrize(
    ("sql", "name"),
    [
        ("SELECT pg_advisory_lock(1)", "pg_advisory_lock"),
        ("SELECT PG_TRY_ADVISORY_XACT_LOCK(1)", "pg_try_advisory_xact_lock"),
        ("SELECT \"lo_import\"('/etc/passwd')", "lo_import"),
        ("SELECT pg_catalog.set_config('role', 'x', false)", "set_config"),
        ('SELECT U&"\\0070g_reload_conf"()', "pg_reload_conf"),
        ("SELECT U&\"pg\\+00005Fls_dir\"('.')", "pg_ls_dir"),
        ("SELECT query_to_xml('DELETE FROM events', true, true, '')", "query_to_xml"),
        ("SELECT load_extension('x')", "load_extension"),
    ],
)
def test_side_effect_functions_are_refused_in_any_spelling(sql: str, name: str) -> None:
    with pytest.raises(QueryRefusedError, match=f"{name} has effects beyond reading"):
        check_select(sql)


def test_names_in_strings_and_quoted_case_are_not_calls() -> None:
    assert check_select("SELECT 'pg_advisory_lock(1)' AS s") == "SELECT 'pg_advisory_lock(1)' AS s"
    assert check_select('SELECT 1 AS "SET_CONFIG"') == 'SELECT 1 AS "SET_CONFIG"'
    with pytest.raises(QueryRefusedError, match="UESCAPE"):
        check_select("SELECT U&\"!0061\" UESCAPE '!'")


def test_parameters_are_found_outside_literals_and_casts() -> None:
    sql = (
        "SELECT x::bigint, '12:30:00', \"a:b\", arr[1:2] -- :not_me\n"
        "FROM t WHERE run_id = :run_id AND step = :train_step AND again = :run_id"
    )
    assert param_names(sql) == ["run_id", "train_step"]
    converted = _to_pyformat("SELECT '50%', x::int FROM t WHERE a LIKE 'G%' AND b = :b")
    assert converted == "SELECT '50%%', x::int FROM t WHERE a LIKE 'G%%' AND b = %(b)s"


# ---------------------------------------------------------------- against a database


def _fingerprint(url: str) -> tuple[int, ...]:
    """Row counts of the log's tables and the newest offset, read behind the audit."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.exec_driver_sql(
                "SELECT (SELECT COUNT(*) FROM events), (SELECT COUNT(*) FROM runs), "
                "(SELECT COUNT(*) FROM epochs), (SELECT COUNT(*) FROM payloads), "
                "(SELECT MAX(last_seq) FROM runs)"
            ).one()
        return tuple(int(v) for v in row)
    finally:
        engine.dispose()


WRITES = [
    "DELETE FROM events",
    "UPDATE runs SET last_seq = 0",
    "INSERT INTO runs (run_id, created_at, config_fingerprint, config_json, current_epoch, "
    "last_seq) VALUES ('x', CURRENT_TIMESTAMP, '', '{}', 1, 0)",
    "DROP VIEW history_events",
    "CREATE TABLE stolen (a INTEGER)",
    "DROP TABLE events",
]


@pytest.mark.parametrize("write", WRITES)
def test_the_database_refuses_writes_the_check_would_stop(audit_run: BuiltRun, write: str) -> None:
    """With the lexical check off, the database itself still refuses every write."""
    b = audit_run
    before = _fingerprint(b.url)
    with pytest.raises(ReadOnlyViolationError, match=r"read-only.*nothing was changed"):
        b.audit.select(write, check=False)
    assert _fingerprint(b.url) == before
    assert b.audit.select("SELECT COUNT(*) AS n FROM history_events").rows[0]["n"] == len(b.history)


def test_a_write_hidden_in_a_cte_is_refused(audit_run: BuiltRun) -> None:
    b = audit_run
    before = _fingerprint(b.url)
    if b.dialect == "sqlite":
        hidden = ["WITH x AS (SELECT 1) DELETE FROM events WHERE seq IN (SELECT * FROM x)"]
    else:
        hidden = [
            "WITH d AS (DELETE FROM events RETURNING seq) SELECT COUNT(*) FROM d",
            "SELECT * INTO stolen FROM events",
            "WITH u AS (UPDATE runs SET last_seq = 0 RETURNING run_id) SELECT * FROM u",
        ]
    for sql in hidden:
        check_select(sql)  # it passes the lexical check: a WITH / SELECT statement
        with pytest.raises(ReadOnlyViolationError, match="nothing was changed"):
            b.audit.select(sql)
    assert _fingerprint(b.url) == before


def test_writes_the_text_check_cannot_see(audit_run: BuiltRun, tmp_path: Path) -> None:
    """PostgreSQL: a write inside a function, and attempts to switch read-only off.
    SQLite: ``ATTACH`` (which would reach another file) is refused by the authorizer."""
    b = audit_run
    before = _fingerprint(b.url)
    if b.dialect == "postgresql":
        engine = sa.create_engine(b.url)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION audit_test_purge() RETURNS bigint LANGUAGE sql "
                "AS $$ DELETE FROM events RETURNING seq $$"
            )
        engine.dispose()
        with pytest.raises(ReadOnlyViolationError):
            b.audit.select("SELECT audit_test_purge()")
        with pytest.raises(QueryRefusedError, match="set_config has effects beyond reading"):
            b.audit.select("SELECT set_config('transaction_read_only', 'off', true)")
        with pytest.raises(ReadOnlyViolationError):
            b.audit.select("SELECT set_config('transaction_read_only', 'off', true)", check=False)
        # Turning the session default off does not last: the connection of each audit
        # query is discarded after it.
        b.audit.select(
            "SELECT set_config('default_transaction_read_only', 'off', false)", check=False
        )
        with pytest.raises(ReadOnlyViolationError):
            b.audit.select("WITH d AS (DELETE FROM events RETURNING seq) SELECT COUNT(*) FROM d")
    else:
        other = tmp_path / "other.db"
        with pytest.raises(ReadOnlyViolationError, match="ATTACH"):
            b.audit.select(f"ATTACH DATABASE '{other}' AS x", check=False)
        assert not other.exists()
    assert _fingerprint(b.url) == before


def test_the_per_transaction_guard_alone_refuses_writes(audit_run: BuiltRun) -> None:
    """Even on a read-write session (a file opened read-write, a session whose default is
    read-write), each audit transaction is read-only: ``PRAGMA query_only`` /
    ``SET TRANSACTION READ ONLY`` hold on their own."""
    b = audit_run
    before = _fingerprint(b.url)
    with SqlAudit(b.url, allow_privileged_role=True) as audit:
        audit.store.close()
        audit.store = EventStore.open(b.url)  # read-write
        for sql in ("DELETE FROM events", "UPDATE runs SET last_seq = 0"):
            with pytest.raises(ReadOnlyViolationError):
                audit.select(sql, check=False)
        assert audit.select("SELECT COUNT(*) AS n FROM runs").rows == [{"n": 1}]
    assert _fingerprint(b.url) == before


def test_parameters_limit_and_percent(audit_run: BuiltRun) -> None:
    b = audit_run
    sql = (
        "SELECT type, COUNT(*) AS n FROM history_events WHERE run_id = :run_id "
        "AND type LIKE 'Group%' AND recorded_at > '2000-01-01 12:30:00' GROUP BY type "
        "ORDER BY type"
    )
    got = b.audit.select(sql, {"run_id": b.run.run_id, "unused": 1})
    want = sorted({e.type for e in b.history if e.type.startswith("Group")})
    assert got.column("type") == want and not got.truncated
    with pytest.raises(MissingParameterError, match=r":run_id.*--param run_id=VALUE"):
        b.audit.select(sql)
    cut = b.audit.select("SELECT seq FROM history_events ORDER BY seq", limit=5)
    assert cut.column("seq") == [e.seq for e in b.history[:5]] and cut.truncated
    with pytest.raises(AuditError, match="query failed"):
        b.audit.select("SELECT no_such_column FROM history_events")
    assert b.audit.select("SELECT 1 AS one").rows == [{"one": 1}]  # still usable


def test_timeout(audit_run: BuiltRun) -> None:
    b = audit_run
    slow = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100000000) "
        "SELECT COUNT(*) FROM c"
        if b.dialect == "sqlite"
        else "SELECT pg_sleep(5)"
    )
    with SqlAudit(b.url, timeout_s=0.3, allow_privileged_role=True) as audit:
        with pytest.raises(AuditError, match="timeout"):
            audit.select(slow)
        assert audit.select("SELECT 2 AS two").rows == [{"two": 2}]


def test_opening_errors(db_url: str, tmp_path: Path) -> None:
    if db_url.startswith("sqlite"):
        with pytest.raises(StoreUnavailableError, match="does not exist"):
            SqlAudit(f"sqlite:///{tmp_path / 'missing.db'}")
    # A database at the revision before the views: the error names the fix.
    with EventStore.open(db_url) as store:
        store.create_run("r")
        migrate.downgrade(store.engine, "0001_initial")
    with pytest.raises(SchemaMismatchError, match="rolloutlog db upgrade"):
        SqlAudit(db_url)
