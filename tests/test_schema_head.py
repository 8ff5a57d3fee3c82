"""The schema check without alembic: an existing log at head opens without importing
alembic, and the alembic-free reader agrees with alembic on what the head is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

import rolloutlog.controller.rollout_index  # noqa: F401  (registers the index's branch)
from rolloutlog.eventstore import EventStore, SchemaMismatchError, migrate, schema_head

_OPEN_AT_HEAD = """
import sys
import rolloutlog.controller.rollout_index  # the branch a controller's process registers
from rolloutlog.eventstore import EventStore
EventStore.open(sys.argv[1]).close()
print(sorted(m for m in ("alembic", "mako", "pygments") if m in sys.modules))
"""


def test_the_head_read_from_the_scripts_is_alembics() -> None:
    store_only = [schema_head.version_locations()[0]]
    alembic_store_head = ScriptDirectory.from_config(
        migrate.alembic_config(branches=())
    ).get_current_head()
    assert schema_head.single_head(store_only) == alembic_store_head == "0005_generic_events"
    # With the rollout index's branch registered (imported above): one chain, one head.
    assert schema_head.single_head(schema_head.version_locations()) == migrate.head_revision()


def test_scripts_it_cannot_vouch_for_give_no_head(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('revision = "a"\ndown_revision = None\n')
    (tmp_path / "b.py").write_text('revision: str = "b"\ndown_revision = "a"\n')
    assert schema_head.single_head([tmp_path]) == "b"
    (tmp_path / "c.py").write_text('revision = "c"\ndown_revision = "a"\n')
    assert schema_head.single_head([tmp_path]) is None  # two heads: alembic decides
    (tmp_path / "c.py").write_text('revision = "c"\ndown_revision = "b"\ndepends_on = "x"\n')
    assert schema_head.single_head([tmp_path]) is None  # depends_on: alembic decides
    (tmp_path / "c.py").write_text('revision = make()\ndown_revision = "b"\n')
    assert schema_head.single_head([tmp_path]) is None  # not a literal


def test_at_head_only_for_a_database_at_head(db_url: str) -> None:
    store = EventStore.open(db_url, check_schema=False)
    try:
        with store.engine.connect() as conn:
            assert not schema_head.at_head(conn)  # empty: no version table
        migrate.upgrade(store.engine)
        with store.engine.connect() as conn:
            assert schema_head.at_head(conn)
        migrate.downgrade(store.engine, "0011_sibling_index")
        with store.engine.connect() as conn:
            assert not schema_head.at_head(conn)
    finally:
        store.close()
    # The older revision is still refused by the open (alembic's check ran).
    with pytest.raises(SchemaMismatchError, match="rolloutlog db upgrade"):
        EventStore.open(db_url, create=False)


def test_opening_a_log_at_head_imports_no_alembic(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    EventStore.open(url).close()  # created (alembic ran here, in this process)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            assert schema_head.at_head(conn)
    finally:
        engine.dispose()
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_AT_HEAD, url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
