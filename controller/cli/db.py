"""``rolloutlog db``: create, verify, upgrade and downgrade the log's schema (alembic).

Exit codes of every subcommand: 0 success; 1 the database is reachable but its schema
is not what was asked for (``check`` on an empty database, an older or a newer
revision; a refused upgrade); 2 the command could not run (malformed URL, unreachable
server, missing directory, unknown revision name, any other store error).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import Engine

from eventstore import migrate
from eventstore.errors import SchemaMismatchError, StoreError
from eventstore.schema import metadata
from eventstore.store import EventStore, normalise_url

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
    """Create, check, upgrade and downgrade the log's database schema.

    Exit status: 0 success, 1 schema not at the expected revision, 2 error (bad URL,
    unreachable database, unknown revision).
    """


@db.command()
@click.argument("url")
@click.option(
    "--revision", default="head", show_default=True, help="Alembic revision to upgrade to."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
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
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
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
