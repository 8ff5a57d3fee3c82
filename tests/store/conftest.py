"""Fixtures of the event store contract suite.

Every contract test takes ``db_url`` (overridden here) and so runs on a fresh SQLite
file, a fresh PostgreSQL schema and a fresh :class:`MemoryEventStore`: one contract
(:class:`rolloutlog.eventstore.EventStoreProtocol`), checked against each implementation. Tests
that are inherently SQL (raw SQL behind the store's back, files, URLs, child processes
opening the database) skip on the memory store, saying so. Plain helpers live in
``storetest_helpers.py``; this folder is put on ``sys.path`` so the test modules import
them whatever pytest's import mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from rolloutlog.eventstore import EventStore, EventStoreProtocol, MemoryEventStore
from rolloutlog.eventstore.pg_append import pg_connect_url

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from storetest_helpers import MEMORY_URL, skip_if_memory  # noqa: E402


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("postgres_pipelined", marks=pytest.mark.postgres),
        "memory",
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on a SQLite file, on PostgreSQL, on PostgreSQL with every
    append of more than two events pipelined (``append_chunk_events=2``: the path of
    batches over 250 events, on the contract's small batches) and on the memory store."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'log.db'}"
    if request.param == "memory":
        return MEMORY_URL
    url = str(request.getfixturevalue("pg_url"))
    return f"{url}?append_chunk_events=2" if request.param == "postgres_pipelined" else url


@pytest.fixture
def memory_log(db_url: str) -> MemoryEventStore | None:
    """The memory backend's one log, shared by every handle of a test (None on SQL)."""
    return MemoryEventStore() if db_url == MEMORY_URL else None


@pytest.fixture
def open_store(memory_log: MemoryEventStore | None) -> Iterator[Callable[..., EventStore]]:
    """Factory of stores (``open_store(url, **kw)``), each closed at teardown.

    On the memory backend every plain ``open_store(url)`` is a handle on the test's one
    memory log (another process's view of the same database); opening with options
    (read-only, without creating or checking the schema) is inherently SQL and skips.
    """
    opened: list[EventStore] = []

    def _open(url: str, **kw: object) -> EventStore:
        if url == MEMORY_URL:
            if kw:
                skip_if_memory(url, f"opens the database with {sorted(kw)}")
            return memory_log  # type: ignore[return-value]
        store = EventStore.open(url, **kw)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def store(db_url: str, memory_log: MemoryEventStore | None) -> Iterator[EventStoreProtocol]:
    """A store on a fresh database of the parametrized backend (or the memory log)."""
    made: EventStoreProtocol = memory_log if memory_log is not None else EventStore.open(db_url)
    yield made
    made.close()


@pytest.fixture
def raw_sql(db_url: str) -> Iterator[Callable[..., list[tuple]]]:
    """Run SQL on the test database behind the store's back (simulating other writers).

    ``raw_sql(sql, params)`` executes in its own committed transaction and returns the
    rows of a SELECT (else ``[]``). Parameters use SQLAlchemy's ``:name`` style.
    """
    skip_if_memory(db_url, "raw SQL behind the store's back")
    engine = sa.create_engine(pg_connect_url(sa.engine.make_url(db_url)))

    def _run(sql: str, params: dict[str, object] | None = None) -> list[tuple]:
        with engine.begin() as conn:
            res = conn.execute(sa.text(sql), params or {})
            return [tuple(r) for r in res.fetchall()] if res.returns_rows else []

    yield _run
    engine.dispose()
