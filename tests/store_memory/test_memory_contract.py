"""The store contract that needs no SQL (:class:`rolloutlog.testing.EventStoreContract`),
run against MemoryEventStore and EventStore on SQLite and PostgreSQL alike, so the
in-memory store used by tests and benchmarks is exactly as strict as the real ones. A
third-party store runs the same suite by subclassing the contract (docs/api.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutlog.eventstore import EventStore, EventStoreProtocol, MemoryEventStore
from rolloutlog.testing import EventStoreContract


class TestMemoryStore(EventStoreContract):
    def create_store(self, tmp_path: Path) -> EventStoreProtocol:
        return MemoryEventStore()


class TestSQLiteStore(EventStoreContract):
    def create_store(self, tmp_path: Path) -> EventStoreProtocol:
        return EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")


@pytest.mark.postgres
class TestPostgresStore(EventStoreContract):
    @pytest.fixture(autouse=True)
    def _database(self, pg_url: str) -> None:
        self.url = pg_url

    def create_store(self, tmp_path: Path) -> EventStoreProtocol:
        return EventStore.open(self.url)
