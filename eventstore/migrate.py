"""Schema creation and verification through alembic (the migrations live in ``migrations/``,
installed as the package ``rolloutlog.migrations``), with the branches of the tables an
application keeps beside the log (:mod:`rolloutlog.eventstore.schema_branches`).

The store refuses a database whose alembic revision is not this code's head, and says
which command fixes it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from . import schema_head
from .errors import SchemaMismatchError
from .schema import metadata as store_metadata
from .schema_branches import SchemaBranch, schema_branches

# The first revision's tables; a database that has them without alembic_version is foreign.
_OWN_TABLES = {"runs", "events", "epochs", "payloads", "snapshots"}


def migrations_dir() -> Path:
    """Folder of the alembic environment shipped with rolloutlog
    (:func:`schema_head.migrations_dir`, which a test replaces to play a newer rolloutlog)."""
    return schema_head.migrations_dir()


def alembic_config(
    connection: Connection | None = None,
    url: str | None = None,
    *,
    branches: Sequence[SchemaBranch] | None = None,
) -> Config:
    """An alembic Config for rolloutlog's migrations, bound to a connection or a URL.

    ``branches``: the branches beside the store's revisions (default: those registered
    in this process; ``()``: the store's alone).
    """
    cfg = Config()
    root = migrations_dir()
    cfg.set_main_option("script_location", str(root))
    # The log's revisions (versions/) and those of the branches (the tables an
    # application keeps beside the log).
    if branches is None:
        branches = schema_branches()
    locations = [str(root / "versions"), *(str(b.versions) for b in branches)]
    cfg.attributes["target_metadata"] = [
        store_metadata,
        *(b.metadata for b in branches if b.metadata is not None),
    ]
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", os.pathsep.join(locations).replace("%", "%%"))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest migration revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "rolloutlog ships at least one migration"
    return head


def current_revision(conn: Connection) -> str | None:
    """The database's alembic revision, or None for a database alembic has not touched."""
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` (default: head)."""
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade the schema to ``revision`` (``base`` removes everything)."""
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), revision)


def _fix_hint(engine: Engine) -> str:
    return f"rolloutlog db upgrade {engine.url.render_as_string(hide_password=True)}"


def check(engine: Engine) -> str:
    """Return the head revision if the database is at it; raise SchemaMismatchError otherwise."""
    head = head_revision()
    with engine.connect() as conn:
        current = current_revision(conn)
        tables = set(sa.inspect(conn).get_table_names())
    if current == head:
        return head
    where = engine.url.render_as_string(hide_password=True)
    if current is None:
        if tables & _OWN_TABLES:
            raise SchemaMismatchError(
                f"{where} has rolloutlog-like tables but no alembic revision; "
                "it was not created by rolloutlog's migrations"
            )
        raise SchemaMismatchError(
            f"{where} has no rolloutlog schema; create it with: {_fix_hint(engine)}"
        )
    known = {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current not in known and not schema_branches() and _store_tables_current(engine):
        # A process that uses the store alone, on a database that also holds a branch's
        # tables (a rollout log): the revision is that branch's, and the store's own
        # tables are exactly this code's.
        return head
    if current not in known:
        raise SchemaMismatchError(
            f"{where} is at schema revision {current!r}, which this rolloutlog does not know "
            f"(its head is {head!r}); it was written by a newer rolloutlog: upgrade rolloutlog"
        )
    raise SchemaMismatchError(
        f"{where} is at schema revision {current!r} but this rolloutlog expects {head!r}; "
        f"run: {_fix_hint(engine)}"
    )


def _store_tables_current(engine: Engine) -> bool:
    """Whether the store's tables are there and exactly as this code's schema has them
    (alembic's comparison, limited to those tables; other tables are not looked at)."""
    from alembic.autogenerate import compare_metadata

    own = set(store_metadata.tables)

    def include_name(name: str | None, type_: str, parent: dict[str, str | None]) -> bool:
        if type_ == "table":
            return name in own
        return parent.get("table_name") in own if type_ in ("column", "index") else True

    with engine.connect() as conn:
        if not own <= set(sa.inspect(conn).get_table_names()):
            return False
        ctx = MigrationContext.configure(
            conn, opts={"compare_type": True, "include_name": include_name}
        )
        return not compare_metadata(ctx, store_metadata)


def ensure_schema(engine: Engine) -> str:
    """Create the schema on an empty database; otherwise verify it is at head.

    A database whose store tables are at the store's head and that has none of the
    tables of the registered branches (a store created by a process that registered
    none) gets those branches' tables too: like an empty database, nothing is altered.
    """
    with engine.connect() as conn:
        current = current_revision(conn)
        tables = set(sa.inspect(conn).get_table_names())
    if current is None and not (tables & _OWN_TABLES):
        upgrade(engine)
    elif current is not None and current != head_revision() and _branches_absent(tables):
        store_head = ScriptDirectory.from_config(alembic_config(branches=())).get_current_head()
        if current == store_head:
            upgrade(engine)
    return check(engine)


def _branches_absent(tables: set[str]) -> bool:
    """Whether none of the registered branches' tables exists (and some branch is)."""
    theirs = {t for b in schema_branches() if b.metadata is not None for t in b.metadata.tables}
    return bool(theirs) and not (tables & theirs)
