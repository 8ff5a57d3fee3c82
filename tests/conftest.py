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


# pytest-xdist (`make test`: -n N --dist loadgroup) runs the tests of one session vLLM
# engine of tests/backends on one worker, so each engine (1.5-4.5 GB) starts once per run,
# not once per worker. Those tests are known by their node id: the controller schedules
# before any worker has collected (and xdist 3.8's own xdist_group marks do not reach the
# node ids under pytest 9). tests/backends/conftest.py checks at collection that every
# test using an engine fixture is covered here.
_ENGINE_TESTS = {
    "tests/backends/test_contract.py::test_vllm_engine_failure_names_the_cause": "vllm_engine",
    "tests/backends/test_fleet.py::test_sigkill_one_vllm_engine_then_restart_and_refit": (
        "vllm_servers"
    ),
    "tests/backends/test_fleet_weights.py::"
    "test_vllm_engines_reused_from_an_earlier_run_are_refit_and_probed": "vllm_servers",
}


def engine_group(nodeid: str) -> str | None:
    """The session engine a test of tests/backends uses (by its parameters), or None."""
    if not nodeid.startswith("tests/backends/"):
        return None
    base, _, params = nodeid.partition("[")
    parts = params.rstrip("]").split("-")
    if "vllm_server" in parts or "vllm_fleet" in parts:
        return "vllm_servers"
    if "vllm" in parts:
        return "vllm_engine"
    return _ENGINE_TESTS.get(base)


_ENGINE_PARAMS = {
    "vllm": "vllm_engine",
    "vllm_server": "vllm_servers",
    "vllm_fleet": "vllm_servers",
}
_ENGINE_FIXTURES = {
    "vllm_session_backend": "vllm_engine",
    "vllm_server_engines": "vllm_servers",
    "vllm_server_session_backend": "vllm_servers",
    "vllm_fleet_session_backend": "vllm_servers",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses a session engine is in that engine's group (engine_group)."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        groups = {_ENGINE_FIXTURES[f] for f in fixtures if f in _ENGINE_FIXTURES}
        callspec = getattr(item, "callspec", None)
        for name in ("backend", "model_backend"):
            if callspec is not None and callspec.params.get(name) in _ENGINE_PARAMS:
                groups.add(_ENGINE_PARAMS[callspec.params[name]])
        if len(groups) > 1 or (groups and engine_group(item.nodeid) not in groups):
            raise pytest.UsageError(
                f"{item.nodeid} uses the session engine {' and '.join(sorted(groups))}: "
                "add it to _ENGINE_TESTS in tests/conftest.py (one worker runs each "
                "engine's tests)"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup``: xdist's group scheduling, the groups being the engines."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class EngineGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = engine_group(nodeid)
            return f"@{group}" if group is not None else super()._split_scope(nodeid)

    return EngineGroupScheduling(config, log)


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
