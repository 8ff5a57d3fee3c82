"""Alembic environment and revisions for rolloutlog's database (SQLite and PostgreSQL).

One chain of revisions in two folders: ``versions/`` holds the log's own (the generic
event store: runs, events, epochs, payloads, snapshots, compactions), and
``controller/index_migrations/`` the controller's (the rollout index and the audit views
over it). Revisions 0001-0003 predate the split and mixed both.
"""

from __future__ import annotations

from pathlib import Path

# This folder is the package rolloutlog.migrations (pyproject's package-dir). Imported as a bare
# `migrations` (the repository root on sys.path, an IDE's auto-import) it would be a second copy
# of every module, whose classes and errors are not rolloutlog's: refuse it.
if __name__ == "migrations":
    raise ImportError(
        "import rolloutlog.migrations, not migrations: this folder is installed as the package "
        "rolloutlog.migrations, and a bare `migrations` import would load a second copy of it",
        name=__name__,
    )


def version_locations(script_dir: Path) -> list[Path]:
    """The folders holding the revisions of the environment at ``script_dir``."""
    import rolloutlog.controller.index_migrations as controller_revisions

    return [script_dir / "versions", Path(controller_revisions.__file__).resolve().parent]
