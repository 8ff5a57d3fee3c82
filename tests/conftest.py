"""Shared fixtures: a fresh SQLite file and a fresh PostgreSQL database per test session.

PostgreSQL: ``ROLLOUTLOG_TEST_PG_URL`` (default: the local server, database ``test``).
Each session creates its own scratch database on that server and drops it at the end.
In CI (``CI`` set) an unreachable PostgreSQL fails the run; elsewhere those tests skip
with the reason.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import settings
from suite_scheduling import (
    ENGINE_FIXTURES,
    ENGINE_PARAMS,
    engine_group,
    make_scheduler,
    write_estimates,
)

# No per-example time limit: Hypothesis's 200 ms deadline fails the first example of a
# fresh clone (building its Unicode tables takes over a second on this 2-core machine).
# Speed is the benchmarks' business; a test that hangs still meets pytest-timeout.
settings.register_profile("rolloutlog", deadline=None)
settings.load_profile("rolloutlog")

# pytest-xdist's workers (`make test`) start with COLUMNS=80 and LINES=24 in their
# environment; a serial run has neither. The CLI sizes its tables by COLUMNS, so a test
# of a table would wrap at 80 columns on a worker only.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)

PG_URL = os.environ.get(
    "ROLLOUTLOG_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _pg_unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"PostgreSQL is required in CI but unavailable: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable ({reason}); set ROLLOUTLOG_TEST_PG_URL to test it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses a session engine is in that engine's group (engine_group)."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        groups = {ENGINE_FIXTURES[f] for f in fixtures if f in ENGINE_FIXTURES}
        callspec = getattr(item, "callspec", None)
        for name in ("backend", "model_backend"):
            if callspec is not None and callspec.params.get(name) in ENGINE_PARAMS:
                groups.add(ENGINE_PARAMS[callspec.params[name]])
        if len(groups) > 1 or (groups and engine_group(item.nodeid) not in groups):
            raise pytest.UsageError(
                f"{item.nodeid} uses the session engine {' and '.join(sorted(groups))}: "
                "add it to ENGINE_TESTS in tests/suite_scheduling.py (one worker runs each "
                "engine's tests)"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup``: the work units of tests/suite_scheduling.py, longest first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return make_scheduler(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-table",
        metavar="PATH",
        help="write each test's duration (setup + call + teardown) as the scheduler's "
        "estimates table (tests/durations.json)",
    )


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--durations-table", None)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller (or a serial run) writes it, from every worker's reports
    write_estimates(Path(path), _durations)


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """URL of a scratch database created for this session on the test PostgreSQL."""
    try:
        admin = sa.create_engine(
            PG_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
        )
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:  # any driver or connection failure means "unavailable"
        _pg_unavailable(f"{type(exc).__name__}: {exc}".splitlines()[0])
    name = f"rolloutlog_t_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A PostgreSQL URL whose schema is empty at the start of the test."""
    engine = sa.create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()
    yield pg_server_url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A URL of a new SQLite file in the test's temporary folder."""
    return f"sqlite:///{tmp_path / 'log.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using this runs once on a SQLite file and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'log.db'}"
    return request.getfixturevalue("pg_url")
