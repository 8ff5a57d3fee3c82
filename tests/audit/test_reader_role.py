"""``rolloutlog db create-reader`` and the reader role on PostgreSQL: what the role may do
(SELECT on the log's tables and views, nothing else), idempotent re-runs that cover
tables added later, refusals, ``audit --sql`` refusing privileged roles unless
overridden, and the read commands (audit, replay, metrics, serve-metrics) working with
the reader's URL."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from audit_helpers import BuiltRun, drop_role
from click.testing import CliRunner, Result

from rolloutlog.cli import main
from rolloutlog.controller.sql_audit import role_problems
from rolloutlog.eventstore import EventStore

pytestmark = pytest.mark.postgres


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run ``rolloutlog ARGS`` in-process."""
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def one_error_line(result: Result) -> str:
    """The single ``error:`` / ``Error:`` line of a failed command (no traceback)."""
    err = result.stderr.strip()
    assert err.count("\n") == 0 and err.lower().startswith("error: "), err
    assert "Traceback" not in result.output
    return err


def admin(url: str) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT")


@pytest.fixture
def roles(pg_url: str) -> Iterator[list[str]]:
    """Names of roles the test makes (unique); each is dropped after the test."""
    made: list[str] = []
    try:
        yield made
    finally:
        for role in reversed(made):
            drop_role(pg_url, role)


def new_role(roles: list[str], prefix: str = "rl_t") -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    roles.append(name)
    return name


def test_create_reader_grants_select_only_and_is_idempotent(pg_url: str, roles: list[str]) -> None:
    with EventStore.open(pg_url) as store:
        store.create_run("r")
    role = new_role(roles)
    secret = "s3cr%t'pw"
    result = cli(
        "db", "create-reader", pg_url, "--role", role, "--password-env", "RL_TEST_PW", "--json",
        env={"RL_TEST_PW": secret},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert secret not in result.output
    out = json.loads(result.stdout)
    assert out["created"] is True and out["password_set"] is True
    assert {"events", "runs", "epochs", "alembic_version", "history_events", "run_summary"} <= (
        set(out["relations"])
    )
    reader_url = sa.engine.make_url(out["reader_url"])
    assert reader_url.username == role and reader_url.password is None
    engine = admin(pg_url)
    with engine.connect() as conn:
        attrs = conn.exec_driver_sql(
            "SELECT rolsuper, rolcreaterole, rolcreatedb, rolinherit, rolcanlogin, "
            "rolpassword IS NOT NULL, (SELECT setconfig FROM pg_db_role_setting "
            "WHERE setrole = a.oid AND setdatabase = 0) FROM pg_authid a WHERE rolname = %(r)s",
            {"r": role},
        ).one()
        assert tuple(attrs[:6]) == (False, False, False, False, True, True)
        assert set(attrs[6]) == {"default_transaction_read_only=on", "statement_timeout=60000"}
        members = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_auth_members m JOIN pg_roles u ON u.oid = m.member "
            "WHERE u.rolname = %(r)s",
            {"r": role},
        ).scalar()
        assert members == 0
        assert role_problems(conn, role) == []

    # As the reader: reads work; writes and DDL are refused by privileges even in a
    # read-write transaction the reader opens itself.
    conninfo = reader_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as raw:
        assert raw.execute("SELECT count(*) FROM runs").fetchone() == (1,)
        assert raw.execute("SHOW default_transaction_read_only").fetchone() == ("on",)
        for sql in (
            "DELETE FROM events",
            "UPDATE runs SET current_epoch = 7",
            "CREATE TABLE stolen (a int)",
            "TRUNCATE events",
        ):
            with raw.transaction():
                raw.execute("SET TRANSACTION READ WRITE")
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    with raw.transaction():
                        raw.execute(sql)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            raw.execute("SET ROLE postgres")

    # A table the log's owner adds later is readable at once (default privileges); a
    # re-run recomputes the grants over the schema: revoked SELECT comes back, an extra
    # write grant goes away.
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE TABLE controller_index (a int)")
        conn.exec_driver_sql("INSERT INTO controller_index VALUES (1)")
    with psycopg.connect(conninfo, autocommit=True) as raw:
        assert raw.execute("SELECT a FROM controller_index").fetchall() == [(1,)]
    with engine.connect() as conn:
        conn.exec_driver_sql(f'REVOKE SELECT ON controller_index FROM "{role}"')
        conn.exec_driver_sql(f'GRANT INSERT ON events TO "{role}"')
        assert role_problems(conn, role) == ["can write to events"]
    again = cli("db", "create-reader", pg_url, "--role", role, "--json")
    assert again.exit_code == 0, again.output
    out2 = json.loads(again.stdout)
    assert out2["created"] is False and "controller_index" in out2["relations"]
    with engine.connect() as conn:
        assert role_problems(conn, role) == []
        can = conn.exec_driver_sql(
            "SELECT has_table_privilege(%(r)s, 'controller_index', 'SELECT')", {"r": role}
        ).scalar()
        assert can is True
        pw = conn.exec_driver_sql(
            "SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = %(r)s", {"r": role}
        ).scalar()
        assert pw is True  # a re-run without --password-env keeps the password
    engine.dispose()
    human = cli("db", "create-reader", pg_url, "--role", role)
    assert human.exit_code == 0
    assert human.stdout.strip() == out["reader_url"]
    assert f"updated role {role}" in human.stderr


def test_create_reader_refusals(pg_url: str, roles: list[str], sqlite_url: str) -> None:
    with EventStore.open(sqlite_url):
        pass
    result = cli("db", "create-reader", sqlite_url, "--role", "r")
    assert result.exit_code == 2 and "for PostgreSQL" in one_error_line(result)
    # An empty database has no log to read.
    result = cli("db", "create-reader", pg_url, "--role", new_role(roles))
    assert result.exit_code == 1 and "rolloutlog db upgrade" in one_error_line(result)
    with EventStore.open(pg_url):
        pass
    for bad in ("1abc", "a-b", 'x"; DROP ROLE postgres; --', "pg_reader", "x" * 64):
        result = cli("db", "create-reader", pg_url, "--role", bad)
        assert result.exit_code == 2 and "--role" in one_error_line(result), bad
    result = cli("db", "create-reader", pg_url, "--role", "postgres")
    assert result.exit_code == 2 and "connects as" in one_error_line(result)
    result = cli(
        "db", "create-reader", pg_url, "--role", new_role(roles), "--password-env", "RL_NOPE",
        env={"RL_NOPE": ""},
    )  # fmt: skip
    assert result.exit_code == 2 and "RL_NOPE" in one_error_line(result)
    su, group, member = new_role(roles), new_role(roles), new_role(roles)
    engine = admin(pg_url)
    with engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{su}" SUPERUSER')
        conn.exec_driver_sql(f'CREATE ROLE "{group}"')
        conn.exec_driver_sql(f'CREATE ROLE "{member}" LOGIN IN ROLE "{group}"')
    result = cli("db", "create-reader", pg_url, "--role", su)
    assert result.exit_code == 2 and "is a superuser" in one_error_line(result)
    result = cli("db", "create-reader", pg_url, "--role", member)
    assert result.exit_code == 2
    assert f"REVOKE {group} FROM {member}" in one_error_line(result)
    with engine.connect() as conn:  # the refusals changed nothing
        su_row = conn.exec_driver_sql(
            "SELECT rolsuper FROM pg_roles WHERE rolname = %(r)s", {"r": su}
        ).scalar()
        assert su_row is True
        grants = conn.exec_driver_sql(
            "SELECT has_table_privilege(%(r)s, 'events', 'SELECT')", {"r": member}
        ).scalar()
        assert grants is False
    engine.dispose()


def test_privileged_roles_need_the_override(audit_run: BuiltRun, roles: list[str]) -> None:
    """As ``postgres`` (a superuser) or a role that can write, ``--sql`` refuses and names
    the reader command; ``--allow-privileged-role`` runs it read-only; canned queries
    run as any role."""
    if audit_run.dialect != "postgresql":
        pytest.skip("roles are PostgreSQL's")
    b = audit_run
    sql = "SELECT count(*) AS n FROM history_events"
    result = cli("audit", b.url, "--sql", sql)
    err = one_error_line(result)
    assert result.exit_code == 1
    assert "superuser" in err and "rolloutlog db create-reader" in err
    assert "--allow-privileged-role" in err
    ok = cli("audit", b.url, "--sql", sql, "--allow-privileged-role", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout) == [{"n": len(b.history)}]
    assert cli("audit", b.url, "--json").exit_code == 0  # canned: no role check
    writer = new_role(roles, "rl_w")
    engine = admin(b.url)
    with engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{writer}" LOGIN')
        conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA public TO "{writer}"')
        conn.exec_driver_sql(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{writer}"')
        conn.exec_driver_sql(f'GRANT UPDATE ON runs TO "{writer}"')
    engine.dispose()
    writer_url = sa.engine.make_url(b.url).set(username=writer).render_as_string(False)
    try:
        result = cli("audit", writer_url, "--sql", sql)
        assert result.exit_code == 1
        err = one_error_line(result)
        assert "can write to runs" in err and "rolloutlog db create-reader" in err
        ok = cli("audit", writer_url, "--sql", sql, "--allow-privileged-role", "--json")
        assert ok.exit_code == 0, ok.output
        # The override still runs read-only: the role's UPDATE privilege does not help.
        upd = "WITH u AS (UPDATE runs SET current_epoch = 7 RETURNING 1) SELECT * FROM u"
        result = cli("audit", writer_url, "--sql", upd, "--allow-privileged-role")
        assert result.exit_code == 1 and "read-only" in one_error_line(result)
    finally:
        drop_role(b.url, writer)
        roles.remove(writer)


def _comparable(stdout: str) -> object:
    """A command's JSON output less the ``db`` field (it names the URL, which differs)."""
    value = json.loads(stdout)
    return {k: v for k, v in value.items() if k != "db"} if isinstance(value, dict) else value


def test_read_commands_work_as_the_reader(
    audit_run: BuiltRun, reader_role: tuple[str, str]
) -> None:
    """audit, replay, metrics and serve-metrics open the log read-only without writing:
    they work with a SELECT-only role and print what they print as the owner."""
    b = audit_run
    url, _role = reader_role
    for args in (
        ("audit", "--json"),
        ("audit", "--recovery", "--json"),
        ("replay", "--json"),
        ("replay", "--check", "--json"),
        ("metrics", "--json"),
    ):
        as_reader = cli(args[0], url, *args[1:])
        assert as_reader.exit_code == 0, (args, as_reader.output)
        as_owner = cli(args[0], b.url, *args[1:])
        assert _comparable(as_reader.stdout) == _comparable(as_owner.stdout), args
    proc = subprocess.Popen(
        [sys.executable, "-c", "from rolloutlog.cli import main; main()", "serve-metrics", url,
         "--port", "0", "--host", "127.0.0.1", "--interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        line = ""
        while not line and time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
        assert "serving metrics of run" in line, line
        port = int(line.split("(port ")[1].split(")")[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            body = resp.read().decode()
        assert "rollout_last_event_timestamp_seconds" in body
        assert proc.poll() is None  # still tailing: its polls as the reader work
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""


def test_role_problems_follow_memberships(pg_url: str, roles: list[str]) -> None:
    """A role is judged with every role it can SET ROLE to (whatever INHERIT), and
    membership in a predefined role that reaches other sessions or server files counts."""
    with EventStore.open(pg_url):
        pass
    writers, member, signaller = new_role(roles), new_role(roles), new_role(roles)
    engine = admin(pg_url)
    with engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{writers}"')
        conn.exec_driver_sql(f'GRANT DELETE ON events TO "{writers}"')
        conn.exec_driver_sql(f'CREATE ROLE "{member}" LOGIN NOINHERIT IN ROLE "{writers}"')
        conn.exec_driver_sql(f'CREATE ROLE "{signaller}" LOGIN IN ROLE pg_signal_backend')
        assert role_problems(conn, member) == [
            f"can write to events through its membership in {writers!r}"
        ]
        assert role_problems(conn, signaller) == ["is a member of pg_signal_backend"]
        assert role_problems(conn, "postgres") == ["is a superuser"]
    engine.dispose()
