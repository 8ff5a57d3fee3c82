"""Attacks on ``audit --sql``, on SQLite and PostgreSQL: as a reader role made by
``rolloutlog db create-reader`` and as the privileged test role with
``--allow-privileged-role``. Each is refused with one clear line and a nonzero exit, and
every table's row count and content hash are the same before and after (on PostgreSQL
also the large objects, advisory locks, roles' settings and grants); nothing reaches
the file system.

With the lexical check switched off (``check=False``), the reader role, the extended
protocol (one statement per execution), the read-only transaction and the SQLite
authorizer still refuse every write, on their own.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from audit_helpers import BuiltRun, db_fingerprint
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutlog.cli import main
from rolloutlog.controller.sql_audit import AuditError, QueryRefusedError, SqlAudit

#: A path no attack may create (COPY TO PROGRAM 'touch', COPY TO file, ATTACH, VACUUM INTO).
MARK = Path(tempfile.gettempdir()) / f"rolloutlog-attack-{uuid.uuid4().hex}"
ISSUE = (
    "SELECT 1 AS €$a$; COMMIT; BEGIN READ WRITE; DELETE FROM events WHERE seq > 1; "
    "UPDATE runs SET last_seq = 1, current_epoch = 7; COMMIT; SELECT 1 AS €$a$"
)

#: Statement stacking in every quoting form: the text after the first statement must
#: never run. (id, SQL)
STACKED = [
    ("issue-10", ISSUE),
    ("ident-with-dollar", "SELECT 1 AS a$b$; DELETE FROM events; SELECT 1 AS x$b$"),
    ("quoted-ident-dollar", 'SELECT 1 AS "€$a$"; DELETE FROM events'),
    ("empty-dollar-quote", "SELECT $$;$$; DELETE FROM events"),
    ("tagged-dollar-quote", "SELECT $t$ $$ ; $t$; UPDATE runs SET current_epoch = 7"),
    ("non-ascii-tag", "SELECT $é$;$é$; DELETE FROM events"),
    ("nested-comment", "SELECT 1 /* a /* nested ; */ comment */; DELETE FROM events"),
    ("line-comment", "SELECT 1 -- ;\n; DELETE FROM events"),
    ("backslash-in-standard-string", "SELECT 'a\\'; DELETE FROM events; --'"),
    ("escaped-backslash-e-string", "SELECT E'a\\\\'; DELETE FROM events; --'"),
    ("escaped-quote-e-string", "SELECT E'\\''; DELETE FROM events"),
    ("doubled-quote", "SELECT 'it''s'; DELETE FROM events"),
    ("doubled-double-quote", 'SELECT "a"";"; DELETE FROM events'),
    ("unicode-ident", 'SELECT 1 AS U&"\\0061"; DELETE FROM events'),
    ("commit", "SELECT 1; COMMIT"),
    ("many-semicolons", "SELECT 1;;; DELETE FROM events"),
    ("sqlite-attach", f"SELECT 1; ATTACH DATABASE '{MARK}' AS x"),
]

#: Single statements that write, leave the read-only transaction, or have side effects.
SINGLE = [
    ("delete", "DELETE FROM events"),
    ("update-epoch", "UPDATE runs SET current_epoch = 7"),
    ("truncate", "TRUNCATE events"),
    ("drop", "DROP TABLE events"),
    ("create", "CREATE TABLE stolen (a int)"),
    ("insert-select", "INSERT INTO events SELECT * FROM events"),
    ("cte-delete", "WITH d AS (DELETE FROM events RETURNING seq) SELECT count(*) FROM d"),
    (
        "cte-update",
        "WITH u AS (UPDATE runs SET current_epoch = 7 RETURNING run_id) SELECT * FROM u",
    ),
    (
        "cte-insert",
        "WITH i AS (INSERT INTO runs (run_id, created_at, config_fingerprint, config_json, "
        "current_epoch, last_seq) VALUES ('x', CURRENT_TIMESTAMP, '', '{}', 1, 0) "
        "RETURNING run_id) SELECT * FROM i",
    ),
    ("sqlite-cte-delete", "WITH x AS (SELECT 1) DELETE FROM events"),
    ("select-into", "SELECT * INTO stolen FROM events"),
    ("for-update", "SELECT * FROM runs FOR UPDATE"),
    ("explain-analyze", "EXPLAIN ANALYZE DELETE FROM events"),
    ("do-block", "DO $$BEGIN DELETE FROM events; END$$"),
    ("copy-to-program", f"COPY (SELECT 1) TO PROGRAM 'touch {MARK}'"),
    ("copy-to-file", f"COPY events TO '{MARK}'"),
    ("set-role", "SET ROLE postgres"),
    ("set-session-authorization", "SET SESSION AUTHORIZATION postgres"),
    ("set-read-write", "SET default_transaction_read_only = off"),
    ("reset-all", "RESET ALL"),
    ("begin-read-write", "BEGIN READ WRITE"),
    ("commit-alone", "COMMIT"),
    ("rollback-alone", "ROLLBACK"),
    ("set-config-role", "SELECT set_config('role', 'postgres', false)"),
    ("set-config-rw", "SELECT set_config('default_transaction_read_only', 'off', false)"),
    ("set-config-tx-rw", "SELECT set_config('transaction_read_only', 'off', true)"),
    ("set-config-timeout", "SELECT set_config('statement_timeout', '0', false)"),
    ("lo-import", "SELECT lo_import('/etc/hostname')"),
    ("lo-create", "SELECT lo_create(0)"),
    ("lo-create-quoted", 'SELECT "lo_create"(0)'),
    ("lo-create-qualified", "SELECT pg_catalog.lo_create(0)"),
    ("lo-create-unicode", 'SELECT U&"\\006Co_create"(0)'),
    ("lo-from-bytea", "SELECT lo_from_bytea(0, 'x')"),
    ("terminate-backend", "SELECT pg_terminate_backend(pg_backend_pid())"),
    ("cancel-backend", "SELECT pg_cancel_backend(pg_backend_pid())"),
    ("reload-conf", "SELECT pg_reload_conf()"),
    ("read-file", "SELECT pg_read_file('/etc/hostname')"),
    ("ls-dir", "SELECT pg_ls_dir('.')"),
    ("advisory-lock", "SELECT pg_advisory_lock(42)"),
    ("advisory-lock-upper", "SELECT PG_ADVISORY_LOCK(42)"),
    ("try-advisory-xact-lock", "SELECT pg_try_advisory_xact_lock(42)"),
    ("query-to-xml", "SELECT query_to_xml('DELETE FROM events', true, true, '')"),
    ("notify", "SELECT pg_notify('c', 'x')"),
    ("sqlite-attach", f"ATTACH DATABASE '{MARK}' AS x"),
    ("sqlite-detach", "DETACH DATABASE main"),
    ("sqlite-pragma-query-only", "PRAGMA query_only = OFF"),
    ("sqlite-pragma-writable-schema", "PRAGMA writable_schema = ON"),
    ("sqlite-vacuum-into", f"VACUUM INTO '{MARK}'"),
    ("sqlite-load-extension", "SELECT load_extension('x')"),
    ("sqlite-temp-table", "CREATE TEMP TABLE t (a)"),
    ("sqlite-fts3-tokenizer", "SELECT fts3_tokenizer('simple')"),
]

ATTACKS = [pytest.param(sql, id=name) for name, sql in STACKED + SINGLE]


@pytest.fixture(params=["reader", "privileged"])
def target(request: pytest.FixtureRequest, audit_run: BuiltRun) -> Iterator[tuple[str, bool]]:
    """``(URL, override)``: the reader role's URL (SQLite: the file), or the privileged
    test role (a PostgreSQL superuser) with ``--allow-privileged-role``."""
    MARK.unlink(missing_ok=True)
    if request.param == "privileged" or audit_run.dialect == "sqlite":
        yield audit_run.url, request.param == "privileged"
    else:
        url, _role = request.getfixturevalue("reader_role")
        yield url, False
    assert not MARK.exists(), "an attack reached the file system"


def _audit_cli(url: str, override: bool, sql: str) -> tuple[int, str]:
    extra = ["--allow-privileged-role"] if override else []
    result = CliRunner().invoke(main, ["audit", url, *extra, "--sql", sql], catch_exceptions=False)
    return result.exit_code, result.stderr


@pytest.mark.parametrize("sql", ATTACKS)
def test_attack_is_refused_and_changes_nothing(
    audit_run: BuiltRun, target: tuple[str, bool], sql: str
) -> None:
    url, override = target
    before = db_fingerprint(audit_run.url)
    code, err = _audit_cli(url, override, sql)
    assert code == 1, err
    assert err.startswith("Error: ") and err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    assert db_fingerprint(audit_run.url) == before
    # The audit still works afterwards.
    code, err = _audit_cli(url, override, "SELECT count(*) AS n FROM history_events")
    assert code == 0, err


@pytest.mark.parametrize("sql", ATTACKS)
def test_without_the_lexer_the_database_still_refuses(
    audit_run: BuiltRun, target: tuple[str, bool], sql: str
) -> None:
    """The reader role (SQLite: the read-only file and its authorizer), the extended
    protocol and the read-only transaction hold on their own: nothing changes, stacked
    statements never run. (The privileged role relies on the lexer for side-effect
    functions such as COPY TO PROGRAM: it is skipped here.)"""
    url, override = target
    if override and audit_run.dialect == "postgresql":
        pytest.skip("a superuser with the override relies on the lexer for side effects")
    before = db_fingerprint(audit_run.url)
    with SqlAudit(url, allow_privileged_role=override) as audit:
        try:
            audit.select(sql, check=False)
            ran = True
        except AuditError as exc:
            ran = False
            assert "\n" not in str(exc)
    stacked = sql in (s for _, s in STACKED)
    assert not (stacked and ran), "a stacked statement ran"
    assert db_fingerprint(audit_run.url) == before


def test_the_issue_query_is_refused_by_the_server(audit_run: BuiltRun) -> None:
    """With the lexer off, the server itself refuses the issue's stacked query."""
    if audit_run.dialect != "postgresql":
        pytest.skip("PostgreSQL's extended protocol")
    with SqlAudit(audit_run.url, allow_privileged_role=True) as audit:
        with pytest.raises(QueryRefusedError, match="multiple commands"):
            audit.select(ISSUE, check=False)


# ---------------------------------------------------------------- generated queries

_FRAGMENTS = st.sampled_from(
    [
        "'a;b'", "'it''s;'", "E'\\';'", "E'\\\\'", "'\\'", "$$;$$", "$t$ ; $$ $t$", "$é$;$é$",
        "€$a$", "a$b$", '"x;y"', '"€$a$"', 'U&"\\0061"', "-- ;\n", "/* ; /* ; */ ; */",
        ";", ";", "1", ",", "AS", "x", "DELETE FROM events", "UPDATE runs SET current_epoch = 7",
        "COMMIT", "BEGIN READ WRITE", "DROP TABLE runs", "'", '"', "$", "/*", "*/",
    ]
)  # fmt: skip


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(parts=st.lists(_FRAGMENTS, min_size=1, max_size=10))
def test_generated_queries_only_read(
    audit_run: BuiltRun, target: tuple[str, bool], parts: list[str]
) -> None:
    """``SELECT`` followed by any mix of quotes, identifiers, comments, semicolons and
    writes: it either runs as one read or is refused; nothing changes."""
    url, override = target
    sql = "SELECT 1 " + " ".join(parts)
    before = db_fingerprint(audit_run.url)
    with SqlAudit(url, allow_privileged_role=override) as audit:
        try:
            audit.select(sql)
        except AuditError as exc:
            assert "\n" not in str(exc)
    assert db_fingerprint(audit_run.url) == before


def test_no_session_state_outlives_a_query(audit_run: BuiltRun, target: tuple[str, bool]) -> None:
    """Locks and settings a query takes on its session end with it (PostgreSQL discards
    the connection of every user query), even while the audit stays open."""
    if audit_run.dialect != "postgresql":
        pytest.skip("PostgreSQL sessions")
    url, override = target
    with SqlAudit(url, allow_privileged_role=override) as audit:
        audit.select("SELECT pg_advisory_lock(42)", check=False)
        audit.select("SELECT set_config('application_name', 'changed', false)", check=False)
        assert db_fingerprint(audit_run.url)["advisory_locks"] == 0
        got = audit.select("SELECT current_setting('application_name') AS a").rows
        assert got != [{"a": "changed"}]
