"""Whether a database is at this code's schema head, read without alembic.

Opening a log checks its schema. Through alembic that imports alembic, mako and pygments
into the host process (about 15k objects its garbage collector then walks in every full
collection, for the life of the process) only to learn that an existing database is at
head, which is the usual case. This module reads the head from the revision scripts'
own ``revision`` / ``down_revision`` assignments (parsed, never imported) and the
database's ``alembic_version`` row with plain SQL; it answers only "at head, certainly";
anything else (no version table, several rows, several heads, a script it cannot read,
``depends_on``) is left to :mod:`~rolloutlog.eventstore.migrate`, which decides as before.
"""

from __future__ import annotations

import ast
import importlib.resources
from collections.abc import Iterable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .schema_branches import schema_branches

_NAMES = ("revision", "down_revision", "depends_on")


def migrations_dir() -> Path:
    """Folder of the alembic environment shipped with rolloutlog (the one place both
    this reader and :mod:`~rolloutlog.eventstore.migrate` find it).

    Found as the package resource ``rolloutlog.migrations`` (never a top-level
    ``migrations`` module, which a user's project may have: Django, alembic).
    """
    return Path(str(importlib.resources.files("rolloutlog.migrations"))).resolve()


def version_locations() -> list[Path]:
    """The folders of revision scripts alembic reads in this process: the store's and
    those of the registered branches (as :func:`migrate.alembic_config` lists them)."""
    return [migrations_dir() / "versions", *(b.versions for b in schema_branches())]


def _assignments(script: Path) -> dict[str, object] | None:
    """The script's top-level ``revision``, ``down_revision`` and ``depends_on`` values,
    or None when it has no literal ``revision`` (not a revision script we can read)."""
    found: dict[str, object] = {}
    try:
        body = ast.parse(script.read_text(encoding="utf-8")).body
    except (OSError, SyntaxError, ValueError):  # unreadable here: alembic decides
        return None
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in _NAMES:
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                return None
    return found if isinstance(found.get("revision"), str) else None


def single_head(locations: Iterable[Path]) -> str | None:
    """The one revision no other script names as its ``down_revision``, or None when
    there is not exactly one or a script is outside what this reader trusts."""
    revisions: set[str] = set()
    downs: set[str] = set()
    for folder in locations:
        for script in sorted(folder.glob("*.py")):
            if script.name == "__init__.py":
                continue
            found = _assignments(script)
            if found is None or found.get("depends_on") is not None:
                return None
            revisions.add(str(found["revision"]))
            down = found.get("down_revision")
            if isinstance(down, str):
                downs.add(down)
            elif isinstance(down, tuple) and all(isinstance(d, str) for d in down):
                downs.update(down)
            elif down is not None:
                return None
    heads = revisions - downs
    return next(iter(heads)) if len(heads) == 1 else None


def at_head(conn: Connection) -> bool:
    """True only when the database's one ``alembic_version`` row is this code's head."""
    head = single_head(version_locations())
    if head is None or "alembic_version" not in sa.inspect(conn).get_table_names():
        return False
    rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").fetchall()
    return len(rows) == 1 and rows[0][0] == head
