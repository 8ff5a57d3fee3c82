"""Alembic environment and the store's revisions (SQLite and PostgreSQL).

``versions/`` holds the log's own revisions (the generic event store: runs, events,
epochs, payloads, snapshots, compactions), labelled ``eventstore``. Tables an
application keeps beside the log come with revisions of their own, registered as
branches (:mod:`rolloutlog.eventstore.schema_branches`): the controller's rollout index
is the branch ``rollout_index`` in ``controller/index_migrations/``. Revisions 0001-0003
predate the split and created the rollout audit keys and views too; 0005 removes them
from the store's tables.
"""

from __future__ import annotations

# This folder is the package rolloutlog.migrations (pyproject's package-dir). Imported as a bare
# `migrations` (the repository root on sys.path, an IDE's auto-import) it would be a second copy
# of every module, whose classes and errors are not rolloutlog's: refuse it.
if __name__ == "migrations":
    raise ImportError(
        "import rolloutlog.migrations, not migrations: this folder is installed as the package "
        "rolloutlog.migrations, and a bare `migrations` import would load a second copy of it",
        name=__name__,
    )
