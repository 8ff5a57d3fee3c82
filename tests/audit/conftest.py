"""Fixtures of the SQL audit suite.

``audit_run`` builds the scripted run of ``audit_helpers.build_audit_run`` once per test
session and dialect (a SQLite file; a PostgreSQL database of its own, so the per-test
``pg_url`` resets of other suites never touch it). Tests that write take the
function-scoped ``db_url`` from ``tests/conftest.py`` instead.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from rolloutlog.controller.prompt_ledger import build_ledger
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.controller.rollout_index import read_history_indexed, read_indexed
from rolloutlog.controller.sql_audit import SqlAudit
from rolloutlog.eventstore import EventStore

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from audit_helpers import BuiltRun, build_audit_run, drop_role  # noqa: E402
from mt_audit_helpers import BuiltMtRun, build_mt_run  # noqa: E402


def _database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, prefix: str
) -> Iterator[str]:
    """A SQLite file, or a PostgreSQL database of its own (dropped afterwards)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp(prefix) / 'log.db'}"
        return
    server = request.getfixturevalue("pg_server_url")
    name = f"rolloutlog_{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield sa.engine.make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


_DIALECTS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session", params=_DIALECTS)
def audit_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database for the session's scripted run: a SQLite file, or a PostgreSQL database."""
    yield from _database(request, tmp_path_factory, "audit")


@pytest.fixture(scope="session", params=_DIALECTS)
def mt_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database for the session's multi-turn run (apart from the scripted run: some
    audit tests count every row of a view)."""
    yield from _database(request, tmp_path_factory, "mt")


@pytest.fixture(scope="session")
def audit_run(audit_url: str) -> Iterator[BuiltRun]:
    """The scripted run, its ledger, replayed state, history rows and a read-only audit."""
    store = EventStore.open(audit_url)
    try:
        run = build_audit_run(store)
        built = BuiltRun(
            url=audit_url,
            dialect=store.dialect,
            run=run,
            ledger=build_ledger(store, run.run_id),
            state=replay(store, run.run_id, use_snapshots=False).state,
            history=list(read_history_indexed(store, run.run_id)),
            all_rows=list(read_indexed(store, run.run_id)),
            segments=store.history_segments(run.run_id),
            audit=SqlAudit(audit_url, allow_privileged_role=True),
        )
    finally:
        store.close()
    try:
        yield built
    finally:
        built.audit.close()


@pytest.fixture(scope="session")
def mt_run(mt_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuiltMtRun]:
    """A real multi-turn run (a restore, resumed trajectories, a tool failure), in a
    database of its own (some audit tests count every row of a view)."""
    store = EventStore.open(mt_url)
    try:
        built = build_mt_run(store, mt_url, tmp_path_factory.mktemp("mt") / "ledger.tsv")
    finally:
        store.close()
    try:
        yield built
    finally:
        built.audit.close()


def _reader_role(url: str, dialect: str) -> Iterator[tuple[str, str]]:
    """``(reader URL, role)``: a reader role made by ``rolloutlog db create-reader`` on the
    PostgreSQL database ``url`` (a unique name, dropped afterwards)."""
    if dialect != "postgresql":
        pytest.skip("reader roles are PostgreSQL's")
    from click.testing import CliRunner

    from rolloutlog.cli import main

    role = f"rl_reader_{uuid.uuid4().hex[:12]}"
    try:
        result = CliRunner().invoke(
            main, ["db", "create-reader", url, "--role", role], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        yield result.stdout.strip(), role
    finally:
        drop_role(url, role)


@pytest.fixture
def reader_role(audit_run: BuiltRun) -> Iterator[tuple[str, str]]:
    """A reader role on the scripted run's PostgreSQL database (:func:`_reader_role`)."""
    yield from _reader_role(audit_run.url, audit_run.dialect)


@pytest.fixture
def mt_reader_role(mt_run: BuiltMtRun) -> Iterator[tuple[str, str]]:
    """A reader role on the multi-turn run's PostgreSQL database (:func:`_reader_role`)."""
    yield from _reader_role(mt_run.url, mt_run.dialect)
