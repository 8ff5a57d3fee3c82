"""The store's schema without the controller: the rollout index is a branch of its own.

A process that uses the event store alone creates the store's tables only, and imports
nothing of the controller. A process that imports the controller (which registers the
``rollout_index`` branch) adds the branch's tables to such a database when it opens it,
and runs on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import SCHEMA_BRANCH
from rolloutlog.eventstore import EventStore, migrate
from rolloutlog.eventstore.schema_branches import schema_branches

_STORE_ONLY = """
import json, sys
import sqlalchemy as sa
from rolloutlog.eventstore import EventStore, migrate
store = EventStore.open(sys.argv[1])
with store.engine.connect() as conn:
    tables = sorted(sa.inspect(conn).get_table_names())
    revision = migrate.current_revision(conn)
store.close()
loaded = sorted(m for m in sys.modules if m.startswith("rolloutlog.controller"))
print(json.dumps({"tables": tables, "revision": revision, "controller_modules": loaded}))
"""


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


def _store_only(url: str) -> dict[str, Any]:
    """What a process that imports the store alone sees when it opens ``url``."""
    done = subprocess.run(
        [sys.executable, "-c", _STORE_ONLY, url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


def test_the_store_creates_its_schema_without_the_controller(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    seen = _store_only(url)
    assert seen["controller_modules"] == []
    assert seen["revision"] == "0005_generic_events"
    assert set(seen["tables"]) == {
        "alembic_version",
        "runs",
        "events",
        "epochs",
        "payloads",
        "snapshots",
        "compactions",
    }

    # This process registered the rollout index's branch: opening the store adds it.
    assert SCHEMA_BRANCH in schema_branches()
    store = EventStore.open(url)
    try:
        with store.engine.connect() as conn:
            assert migrate.current_revision(conn) == migrate.head_revision()
        assert {"rollout_index", "rollout_sibling_index", "rollout_step_marks"} <= _tables(url)
        ctl = RolloutController.start(
            store,
            "r",
            RolloutConfig(group_size=2, groups_per_step=2),
            dataset_fingerprint="d",
            dataset_size=10,
        )
        ctl.close()
        assert store.last_seq("r") >= 1
    finally:
        store.close()

    # And a store-only process opens the rollout log: the revision is the branch's, the
    # store's own tables are exactly its schema.
    seen = _store_only(url)
    assert seen["controller_modules"] == []
    assert seen["revision"] == migrate.head_revision()
    assert "rollout_index" in seen["tables"]
