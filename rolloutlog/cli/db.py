"""``rolloutlog db``: create, verify, upgrade and downgrade the log's schema (alembic), and
create a PostgreSQL role that can only read the log (``create-reader``).

Exit codes of every subcommand: 0 success; 1 the database is reachable but its schema
is not what was asked for (``check`` on an empty database, an older or a newer
revision; a refused upgrade); 2 the command could not run (malformed URL, unreachable
server, missing directory, unknown revision name, any other store error).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import Connection, Engine

# `db` creates, checks and upgrades the rollout index's branch with the store's tables.
from rolloutlog.controller import rollout_index as _rollout_index  # noqa: F401
from rolloutlog.controller.sql_audit import DEFAULT_TIMEOUT_S, log_schema, role_problems
from rolloutlog.eventstore import migrate
from rolloutlog.eventstore.errors import SchemaMismatchError, StoreError
from rolloutlog.eventstore.schema import metadata
from rolloutlog.eventstore.store import EventStore, normalise_url

from ._options import flag, json_option, seconds_option, shown

#: Exit status when the schema is not the one asked for (the database itself is fine).
EXIT_SCHEMA = 1
#: Exit status when the command could not run at all.
EXIT_ERROR = 2

_OWN_TABLES = frozenset(metadata.tables)

T = TypeVar("T")


class _Failure(Exception):
    """A failure carrying its exit status and message, raised inside a command body."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def _fail(message: str, exit_code: int, *, as_json: bool, payload: dict[str, Any]) -> NoReturn:
    """Print ``error: message`` on stderr (and the JSON object when asked), then exit."""
    if as_json:
        click.echo(json.dumps({**payload, "ok": False, "error": message}, sort_keys=True))
    click.echo(f"error: {message}", err=True)
    sys.exit(exit_code)


def _display(url: str) -> str:
    """The URL as shown to the user: normalised, password hidden; raw text if unparseable."""
    try:
        return normalise_url(url).render_as_string(hide_password=True)
    except StoreError:
        return url


@contextmanager
def _engine(url: str, *, readonly: bool) -> Iterator[Engine]:
    """An engine on ``url`` made the way :class:`EventStore` makes it (pragmas, drivers).

    Raises :class:`StoreError` subclasses for a malformed URL or an unreachable database.
    """
    store = EventStore.open(url, create=False, readonly=readonly, check_schema=False)
    try:
        yield store.engine
    finally:
        store.close()


def _known_revisions() -> set[str]:
    script = ScriptDirectory.from_config(migrate.alembic_config())
    return {s.revision for s in script.walk_revisions()}


def _inspect(engine: Engine) -> tuple[str | None, set[str]]:
    """The database's revision and its table names."""
    try:
        with engine.connect() as conn:
            return migrate.current_revision(conn), set(sa.inspect(conn).get_table_names())
    except sa.exc.DBAPIError as exc:
        raise _Failure(f"cannot read the schema version: {exc.orig}", EXIT_ERROR) from exc


def _run(as_json: bool, payload: dict[str, Any], body: Callable[[], T]) -> T:
    """Run ``body()``, turning store errors and refusals into ``error:`` lines and exit codes."""
    try:
        return body()
    except _Failure as exc:
        _fail(exc.message, exc.exit_code, as_json=as_json, payload=payload)
    except SchemaMismatchError as exc:
        _fail(str(exc), EXIT_SCHEMA, as_json=as_json, payload=payload)
    except StoreError as exc:
        _fail(str(exc), EXIT_ERROR, as_json=as_json, payload=payload)
    except CommandError as exc:
        _fail(f"alembic: {exc}", EXIT_ERROR, as_json=as_json, payload=payload)
    except sa.exc.DBAPIError as exc:
        _fail(f"database error: {exc.orig}", EXIT_ERROR, as_json=as_json, payload=payload)


_URL_HELP = "URL is sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def db() -> None:
    """Create, check, upgrade and downgrade the log's database schema; create-reader
    makes a PostgreSQL role that can only read the log.

    Exit status: 0 success, 1 schema not at the expected revision, 2 error (bad URL,
    unreachable database, unknown revision).
    """


@db.command()
@click.argument("url")
@shown("--revision", default="head", help="Alembic revision to upgrade to.")
@json_option()
def upgrade(url: str, revision: str, as_json: bool) -> None:
    """Upgrade the schema at URL to the newest revision (creates it on an empty database).

    An empty SQLite file is created. A database written by a newer rolloutlog, or with
    rolloutlog-like tables that alembic never created, is refused (exit 1).
    """
    shown = _display(url)
    payload: dict[str, Any] = {"url": shown, "head": migrate.head_revision()}

    def body() -> tuple[str | None, str | None]:
        with _engine(url, readonly=False) as engine:
            before, tables = _inspect(engine)
            payload["previous"] = before
            if before is None and tables & _OWN_TABLES:
                found = ", ".join(sorted(tables & _OWN_TABLES))
                raise SchemaMismatchError(
                    f"{shown} has rolloutlog-like tables ({found}) "
                    "but no alembic revision; it was not created by rolloutlog's migrations, "
                    "so it is left untouched"
                )
            if before is not None and before not in _known_revisions():
                raise SchemaMismatchError(
                    f"{shown} is at schema revision {before!r}, which this rolloutlog does not "
                    f"know (its head is {payload['head']!r}); it was written by a newer "
                    "rolloutlog: upgrade rolloutlog, not the database"
                )
            migrate.upgrade(engine, revision)
            after, _ = _inspect(engine)
            if revision == "head":
                migrate.check(engine)
            return before, after

    before, after = _run(as_json, payload, body)
    if as_json:
        out = {**payload, "ok": True, "revision": after, "previous": before}
        click.echo(json.dumps(out, sort_keys=True))
    elif before == after:
        click.echo(f"{shown} is already at revision {after}")
    else:
        click.echo(f"upgraded {shown} from {before or 'empty'} to revision {after}")


@db.command()
@click.argument("url")
@json_option()
def check(url: str, as_json: bool) -> None:
    """Exit 0 if the schema at URL is at this rolloutlog's head revision, printing it.

    Exit 1 (with the reason and the fixing command on stderr) for an empty database or a
    database at another revision; exit 2 if the database cannot be reached. Read-only:
    the database is never modified.
    """
    shown = _display(url)
    head = migrate.head_revision()
    payload: dict[str, Any] = {"url": shown, "head": head, "revision": None}

    def body() -> str:
        parsed = normalise_url(url)
        if parsed.get_backend_name() == "sqlite":
            path = Path(parsed.database or "")
            if path.parent.exists() and not path.exists():
                raise SchemaMismatchError(
                    f"{path} does not exist, so it has no rolloutlog schema; create it with: "
                    f"rolloutlog db upgrade {shown}"
                )
        with _engine(url, readonly=True) as engine:
            current, _ = _inspect(engine)
            payload["revision"] = current
            return migrate.check(engine)

    revision = _run(as_json, payload, body)
    if as_json:
        click.echo(json.dumps({**payload, "ok": True, "revision": revision}, sort_keys=True))
    else:
        click.echo(f"{shown} is at head revision {revision}")


@db.command()
@click.argument("url")
@click.argument("revision")
@flag("--yes", "Do not ask for confirmation.")
@json_option()
def downgrade(url: str, revision: str, yes: bool, as_json: bool) -> None:
    """Downgrade the schema at URL to REVISION (``base`` drops every rolloutlog table).

    Downgrading destroys the data of the tables it removes: you are asked to confirm
    unless ``--yes`` is given.
    """
    shown = _display(url)
    payload: dict[str, Any] = {"url": shown, "head": migrate.head_revision()}
    if not yes and not click.confirm(
        f"Downgrade {shown} to {revision}? Tables removed by the downgrade lose their data",
        err=True,
    ):
        _fail("downgrade cancelled", EXIT_ERROR, as_json=as_json, payload=payload)

    def body() -> tuple[str | None, str | None]:
        with _engine(url, readonly=False) as engine:
            before, _ = _inspect(engine)
            payload["previous"] = before
            if before is None:
                raise SchemaMismatchError(f"{shown} has no rolloutlog schema to downgrade")
            if before not in _known_revisions():
                raise SchemaMismatchError(
                    f"{shown} is at schema revision {before!r}, which this rolloutlog does not "
                    "know; downgrade it with the rolloutlog that wrote it"
                )
            migrate.downgrade(engine, revision)
            after, _ = _inspect(engine)
            return before, after

    before, after = _run(as_json, payload, body)
    if as_json:
        out = {**payload, "ok": True, "revision": after, "previous": before}
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(f"downgraded {shown} from {before} to {after or 'base (no rolloutlog tables)'}")


_ROLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def _ident(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _ddl(conn: Connection, statement: str) -> None:
    """Run one utility statement as written (no parameter parsing: a ``%`` stays a ``%``)."""
    conn.execution_options(no_parameters=True).exec_driver_sql(statement)


def _setup_reader(
    conn: Connection, role: str, password: str | None, timeout_s: float
) -> dict[str, Any]:
    """Create or update ``role`` as a reader of the log; return what was done.

    Everything runs in the caller's transaction: a refusal leaves the server unchanged.
    """
    me = str(conn.exec_driver_sql("SELECT current_user").scalar())
    if role == me:
        raise _Failure(
            f"role {role!r} is the role this command connects as: pick another name", EXIT_ERROR
        )
    schema = log_schema(conn)
    database = str(conn.exec_driver_sql("SELECT current_database()").scalar())
    existing = conn.exec_driver_sql(
        "SELECT rolsuper FROM pg_roles WHERE rolname = %(r)s", {"r": role}
    ).first()
    if existing is not None:
        if existing.rolsuper:
            raise _Failure(
                f"role {role!r} exists and is a superuser; a reader role must not be one: "
                "pick another name",
                EXIT_ERROR,
            )
        member_of = (
            conn.exec_driver_sql(
                "SELECT b.rolname FROM pg_auth_members m JOIN pg_roles b ON b.oid = m.roleid "
                "JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = %(r)s ORDER BY 1",
                {"r": role},
            )
            .scalars()
            .all()
        )
        if member_of:
            granted = ", ".join(member_of)
            raise _Failure(
                f"role {role!r} exists and is a member of {granted}; a reader role belongs to "
                f"no role: pick another name, or REVOKE {granted} FROM {role}",
                EXIT_ERROR,
            )
    q = _ident(role)
    verb = "ALTER" if existing is not None else "CREATE"
    _ddl(conn, f"{verb} ROLE {q} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT "
               "NOREPLICATION NOBYPASSRLS")  # fmt: skip
    if password is not None:
        from psycopg import sql as pgsql  # PostgreSQL only: psycopg is an optional extra

        raw = conn.connection.dbapi_connection
        literal = pgsql.Literal(password).as_string(raw)
        _ddl(conn, f"ALTER ROLE {q} PASSWORD {literal}")
    # Session defaults of the role: read-only transactions and a bounded statement time.
    _ddl(conn, f"ALTER ROLE {q} SET default_transaction_read_only = on")
    _ddl(conn, f"ALTER ROLE {q} SET statement_timeout = {max(1, int(timeout_s * 1000))}")
    _ddl(conn, f"GRANT CONNECT ON DATABASE {_ident(database)} TO {q}")
    _ddl(conn, f"REVOKE CREATE, TEMPORARY ON DATABASE {_ident(database)} FROM {q}")
    _ddl(conn, f"GRANT USAGE ON SCHEMA {_ident(schema)} TO {q}")
    _ddl(conn, f"REVOKE CREATE ON SCHEMA {_ident(schema)} FROM {q}")
    # Every table and view of the log's schema, listed now: tables that later migrations
    # (or the controller) add are covered by a re-run and by the default privileges below.
    relations = (
        conn.exec_driver_sql(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %(s)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f') ORDER BY 1",
            {"s": schema},
        )
        .scalars()
        .all()
    )
    for rel in relations:
        target = f"{_ident(schema)}.{_ident(rel)}"
        _ddl(conn, f"REVOKE ALL ON TABLE {target} FROM {q}")
        _ddl(conn, f"GRANT SELECT ON TABLE {target} TO {q}")
    _ddl(conn, f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {_ident(schema)} FROM {q}")
    owner = conn.exec_driver_sql(
        "SELECT pg_get_userbyid(relowner), pg_has_role(relowner, 'MEMBER') FROM pg_class "
        "WHERE oid = to_regclass('events')"
    ).one()
    default_privileges = bool(owner[1])
    if default_privileges:
        # Tables the log's owner creates later in the schema are readable at once.
        _ddl(
            conn,
            f"ALTER DEFAULT PRIVILEGES FOR ROLE {_ident(owner[0])} IN SCHEMA {_ident(schema)} "
            f"GRANT SELECT ON TABLES TO {q}",
        )
    problems = role_problems(conn, role)
    if problems:
        raise _Failure(
            f"role {role!r} still {'; '.join(problems)} (through PUBLIC or another grant "
            f"this command cannot revoke per role); fix that (for example REVOKE CREATE ON "
            f"SCHEMA {schema} FROM PUBLIC) and run the command again; nothing was changed",
            EXIT_ERROR,
        )
    return {
        "role": role,
        "created": existing is None,
        "schema": schema,
        "database": database,
        "relations": list(relations),
        "default_privileges_for": owner[0] if default_privileges else None,
        "statement_timeout_ms": max(1, int(timeout_s * 1000)),
        "password_set": password is not None,
    }


@db.command("create-reader")
@click.argument("url")
@click.option("--role", required=True, help="Name of the reader role (created if missing).")
@click.option(
    "--password-env",
    metavar="VAR",
    help="Set the role's password from environment variable VAR (never on the command line).",
)
@seconds_option(
    "--statement-timeout",
    "timeout_s",
    default=DEFAULT_TIMEOUT_S,
    help="statement_timeout of the role's sessions, in seconds.",
)
@json_option()
def create_reader(
    url: str, role: str, password_env: str | None, timeout_s: float, as_json: bool
) -> None:
    """Create (or update) a PostgreSQL role that can only read the log at URL.

    URL connects as a role that may create roles and grant on the log's tables (the
    owner, or a superuser). The reader logs in, is no superuser, cannot create roles,
    databases or objects, belongs to no role, and has SELECT on every table and view of
    the log's schema and nothing else; its sessions default to read-only transactions
    with a statement timeout. Re-running it is safe and grants on tables added since.
    Prints the URL to pass to audit, replay, metrics and serve-metrics (without the
    password: give it as PGPASSWORD or in ~/.pgpass).
    """
    shown = _display(url)
    payload: dict[str, Any] = {"url": shown, "role": role}

    def body() -> tuple[str, dict[str, Any]]:
        parsed = normalise_url(url)
        if parsed.get_backend_name() != "postgresql":
            raise _Failure(
                "create-reader is for PostgreSQL: a SQLite log is audited through a file "
                "opened read-only and an authorizer that allows reads only, no role needed",
                EXIT_ERROR,
            )
        if not _ROLE_NAME.fullmatch(role) or role.lower().startswith("pg_"):
            raise _Failure(
                f"--role {role!r}: use 1-63 letters, digits and '_', starting with a letter "
                "or '_' (not 'pg_')",
                EXIT_ERROR,
            )
        password: str | None = None
        if password_env is not None:
            password = os.environ.get(password_env)
            if not password:
                raise _Failure(
                    f"--password-env {password_env}: the environment variable is not set or "
                    "is empty",
                    EXIT_ERROR,
                )
        with _engine(url, readonly=False) as engine:
            migrate.check(engine)
            with engine.begin() as conn:
                done = _setup_reader(conn, role, password, timeout_s)
        reader_url = parsed.set(username=role, password=None).render_as_string(hide_password=False)
        return reader_url, done

    reader_url, done = _run(as_json, payload, body)
    if as_json:
        click.echo(
            json.dumps({**payload, **done, "ok": True, "reader_url": reader_url}, sort_keys=True)
        )
        return
    click.echo(reader_url)
    action = "created" if done["created"] else "updated"
    click.echo(
        f"{action} role {role}: SELECT on {len(done['relations'])} tables and views of schema "
        f"{done['schema']} ({', '.join(done['relations'])}), read-only sessions, "
        f"statement_timeout {done['statement_timeout_ms']} ms",
        err=True,
    )
    if done["password_set"]:
        click.echo(
            f"password set from ${password_env}; it is not printed: pass it as PGPASSWORD or "
            "in ~/.pgpass",
            err=True,
        )
