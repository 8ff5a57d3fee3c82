"""Fixtures of the rollout-domain suite.

The pure-core tests need no fixture. The controller tests open a store on a fresh SQLite
file (``sqlite_url`` from ``tests/conftest.py``) or on both backends (``db_url``). This
folder is put on ``sys.path`` so the test modules import ``domain_helpers`` whatever
pytest's import mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rolloutlog.eventstore import EventStore

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def open_store() -> Iterator[Callable[[str], EventStore]]:
    """Factory of stores (``open_store(url)``), each closed at teardown."""
    opened: list[EventStore] = []

    def _open(url: str) -> EventStore:
        store = EventStore.open(url)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def sqlite_store(sqlite_url: str, open_store: Callable[[str], EventStore]) -> EventStore:
    """A store on a fresh SQLite file."""
    return open_store(sqlite_url)


@pytest.fixture
def store(db_url: str, open_store: Callable[[str], EventStore]) -> EventStore:
    """A store on a fresh database of each backend (SQLite file, PostgreSQL)."""
    return open_store(db_url)
