"""Fixtures of the event store contract suite.

Every contract test takes ``db_url`` (from ``tests/conftest.py``) and so runs once on a
fresh SQLite file and once on a fresh PostgreSQL schema: one abstract contract, checked
against each backend. Plain helpers live in ``storetest_helpers.py``; this folder is put
on ``sys.path`` so the test modules import them whatever pytest's import mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from rolloutlog.eventstore import EventStore

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def open_store() -> Iterator[Callable[..., EventStore]]:
    """Factory of stores (``open_store(url, **kw)``), each closed at teardown."""
    opened: list[EventStore] = []

    def _open(url: str, **kw: object) -> EventStore:
        store = EventStore.open(url, **kw)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def store(db_url: str, open_store: Callable[..., EventStore]) -> EventStore:
    """A store on a fresh database of the parametrized backend."""
    return open_store(db_url)


@pytest.fixture
def raw_sql(db_url: str) -> Iterator[Callable[..., list[tuple]]]:
    """Run SQL on the test database behind the store's back (simulating other writers).

    ``raw_sql(sql, params)`` executes in its own committed transaction and returns the
    rows of a SELECT (else ``[]``). Parameters use SQLAlchemy's ``:name`` style.
    """
    engine = sa.create_engine(db_url)

    def _run(sql: str, params: dict[str, object] | None = None) -> list[tuple]:
        with engine.begin() as conn:
            res = conn.execute(sa.text(sql), params or {})
            return [tuple(r) for r in res.fetchall()] if res.returns_rows else []

    yield _run
    engine.dispose()
