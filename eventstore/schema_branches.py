"""Tables an application keeps beside the log, with alembic revisions of their own.

The store's schema (``rolloutlog.migrations``: runs, events, epochs, payloads,
snapshots, compactions) knows nothing of them. An application that keeps derived tables
in the same database (the controller's rollout index, written by an
:class:`~rolloutlog.eventstore.indexing.Indexer`) registers its revisions here as a
branch of the store's; from then on this process's :mod:`~rolloutlog.eventstore.migrate`
creates, checks and upgrades them with the store's. A process that registered nothing
creates and checks the store's tables alone.

Kept apart from ``migrate.py`` so that registering does not import alembic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import MetaData


@dataclass(frozen=True)
class SchemaBranch:
    """An alembic branch of the store's revisions: its label, the folder of its revision
    scripts and the tables they create (what ``alembic`` compares them with)."""

    label: str
    versions: Path
    metadata: MetaData | None = None


_lock = threading.Lock()
_branches: dict[str, SchemaBranch] = {}


def register_schema_branch(branch: SchemaBranch) -> None:
    """Have this process's migrations include ``branch`` (idempotent; a label registered
    with another folder is refused)."""
    with _lock:
        known = _branches.get(branch.label)
        if known is not None and known.versions != branch.versions:
            raise ValueError(
                f"schema branch {branch.label!r} is registered with {known.versions}, "
                f"not {branch.versions}"
            )
        _branches[branch.label] = branch


def schema_branches() -> tuple[SchemaBranch, ...]:
    """The branches registered in this process, in registration order."""
    with _lock:
        return tuple(_branches.values())
