"""Plain helpers shared by the event store contract tests (imported by the test modules)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.eventstore import NewEvent

#: The helper script run as a child process by the crash and multi-process tests.
WORKER = Path(__file__).with_name("store_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
#: A fixed base time with microseconds; offsets keep every event's timestamp distinct.
T0 = datetime(2026, 11, 30, 12, 34, 56, 123456, tzinfo=UTC)


#: The ``db_url`` of the memory backend: no database behind it.
MEMORY_URL = "memory://"


def skip_if_memory(db_url: str, why: str) -> None:
    """Skip a test that needs a real database on the memory backend."""
    if db_url == MEMORY_URL:
        pytest.skip(f"inherently SQL ({why}): the memory store has no database")


def make_event(i: int, **overrides: object) -> NewEvent:
    """Event ``i`` of a test log: every column set, all derived from ``i``; its
    ``derived`` values are the keys :class:`KeyIndexer` indexes it by."""
    fields: dict[str, object] = {
        "type": f"Type{i % 3}",
        "schema_version": 1 + i % 2,
        "payload": f'{{"i": {i}, "text": "é✓ {i}"}}',
        "recorded_at": T0 + timedelta(seconds=i, microseconds=i),
        "derived": (i % 5, 100 + i % 7),
    }
    fields.update(overrides)
    return NewEvent(**fields)  # type: ignore[arg-type]


class KeyIndexer:
    """A test indexer: ``(run_id, seq, k1, k2)`` rows from each event's ``derived``."""

    table = "test_keys"
    columns = ("run_id", "seq", "k1", "k2")

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        """One row per event that carries keys."""
        return [
            (run_id, first_seq + i, *ev.derived)
            for i, ev in enumerate(batch)
            if ev.derived is not None
        ]


def make_batch(start: int, n: int) -> list[NewEvent]:
    """Events ``start .. start + n - 1`` (by :func:`make_event`)."""
    return [make_event(i) for i in range(start, start + n)]


def worker_cmd(*args: str) -> list[str]:
    """Command line running ``store_worker.py`` with this interpreter."""
    return [sys.executable, str(WORKER), *args]


def create_key_table(store: Any) -> None:
    """Create :class:`KeyIndexer`'s table on a SQL store (nothing on the memory store)."""
    if hasattr(store, "engine"):
        with store.engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE IF NOT EXISTS test_keys (run_id VARCHAR(128) NOT NULL, "
                "seq BIGINT NOT NULL, k1 BIGINT, k2 BIGINT, PRIMARY KEY (run_id, seq))"
            )


def with_key_index(store: Any, indexer: KeyIndexer | None = None) -> KeyIndexer:
    """Register ``indexer`` (a plain :class:`KeyIndexer` by default), creating its table
    on a SQL store; return it."""
    create_key_table(store)
    indexer = indexer or KeyIndexer()
    store.add_indexer(indexer)
    return indexer
