"""SQLite's append connection (eventstore/sqlite_writer.py): the rules SQLAlchemy used to
keep for the appends, kept without it. One connection for every append; a refusal or a
bad row found in Python keeps it; a driver error or an interrupt rolls back and closes it,
and the next append opens a fresh one; a thread waits for it at most busy_timeout_ms; it
is never used across a fork; and close() closes it, now or when the append using it
ends. Each case also checks that nothing of a failed append was written and that the
write lock was given back."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from storetest_helpers import KeyIndexer, make_batch, with_key_index

from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    NewEvent,
    StoreError,
    StoreUnavailableError,
    sqlite_writer,
)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "log.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[EventStore]:
    opened = EventStore.open(f"sqlite:///{db_path}?busy_timeout_ms=300")
    opened.create_run("r")
    yield opened
    opened.close()


def _writer(store: EventStore) -> sqlite_writer.SqliteWriter:
    writer = store._sqlite_writer
    assert writer is not None
    return writer


def _stored(db_path: Path) -> tuple[int, list[int], int]:
    """(runs.last_seq, the stored offsets, test_keys rows), read on a connection of its own."""
    with sqlite3.connect(db_path) as conn:
        last = conn.execute("SELECT last_seq FROM runs WHERE run_id = 'r'").fetchone()[0]
        seqs = [s for (s,) in conn.execute("SELECT seq FROM events ORDER BY seq")]
        has_keys = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'test_keys'"
        ).fetchone()[0]
        keys = conn.execute("SELECT count(*) FROM test_keys").fetchone()[0] if has_keys else 0
    return last, seqs, keys


def _write_lock_free(db_path: Path) -> bool:
    """Whether another connection can take the write lock at once."""
    conn = sqlite3.connect(db_path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


class _RaisingIndexer(KeyIndexer):
    """A KeyIndexer that raises ``error`` (once) when it builds rows."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().rows(run_id, first_seq, batch)


class _BlockingIndexer(KeyIndexer):
    """A KeyIndexer that waits for ``release`` (inside the append's transaction)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        self.entered.set()
        assert self.release.wait(10), "the test never released the blocked append"
        return super().rows(run_id, first_seq, batch)


def test_every_append_uses_one_connection_outside_the_pool(
    store: EventStore, db_path: Path
) -> None:
    with_key_index(store)
    for k in range(20):
        store.append("r", make_batch(10 * k, 10), expected_seq=10 * k + 1, epoch=1)
    assert _writer(store).connections_opened == 1
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert _stored(db_path) == (200, list(range(1, 201)), 200)


def test_refusals_keep_the_connection(store: EventStore, db_path: Path) -> None:
    store.append("r", make_batch(0, 3), expected_seq=1, epoch=1)
    with pytest.raises(AppendConflictError):
        store.append("r", make_batch(3, 3), expected_seq=2, epoch=1)
    with pytest.raises(EpochFencedError):
        store.append("r", make_batch(3, 3), expected_seq=4, epoch=2)
    with pytest.raises(StoreError, match="no run 'nope'"):
        store.append("nope", make_batch(3, 3), expected_seq=1, epoch=1)
    assert _write_lock_free(db_path)
    store.append("r", make_batch(3, 3), expected_seq=4, epoch=1)
    assert _writer(store).connections_opened == 1
    assert _stored(db_path)[:2] == (6, list(range(1, 7)))


def test_a_driver_error_rolls_back_and_the_next_append_reopens(
    store: EventStore, db_path: Path
) -> None:
    with_key_index(store)
    store.append("r", make_batch(0, 2), expected_seq=1, epoch=1)
    with sqlite3.connect(db_path) as conn:  # a derived row that the next append collides with
        conn.execute("INSERT INTO test_keys VALUES ('r', 4, 0, 0)")
    with pytest.raises(StoreError, match=r"appending to run 'r'.*UNIQUE constraint failed"):
        store.append("r", make_batch(2, 3), expected_seq=3, epoch=1)
    assert _stored(db_path) == (2, [1, 2], 3)
    assert _write_lock_free(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM test_keys WHERE seq = 4")
    store.append("r", make_batch(2, 3), expected_seq=3, epoch=1)
    assert _writer(store).connections_opened == 2
    assert _stored(db_path) == (5, [1, 2, 3, 4, 5], 5)


@pytest.mark.parametrize(
    ("error", "connections"),
    [(ValueError("bad keys"), 1), (KeyboardInterrupt(), 2)],
    ids=["python-error-keeps-it", "interrupt-closes-it"],
)
def test_a_failure_before_sqlite_rolls_back(
    store: EventStore, db_path: Path, error: BaseException, connections: int
) -> None:
    with_key_index(store, _RaisingIndexer(error))
    with pytest.raises(type(error)):
        store.append("r", make_batch(0, 4), expected_seq=1, epoch=1)
    assert _stored(db_path) == (0, [], 0)
    assert _write_lock_free(db_path)
    store.append("r", make_batch(0, 4), expected_seq=1, epoch=1)
    assert _writer(store).connections_opened == connections
    assert _stored(db_path) == (4, [1, 2, 3, 4], 4)


def test_another_connections_write_lock_times_out_and_loses_nothing(
    store: EventStore, db_path: Path
) -> None:
    store.append("r", make_batch(0, 1), expected_seq=1, epoch=1)
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="database is locked"):
            store.append("r", make_batch(1, 2), expected_seq=2, epoch=1)
        assert 0.25 <= time.monotonic() - started < 5  # busy_timeout_ms=300
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.append("r", make_batch(1, 2), expected_seq=2, epoch=1)
    assert _stored(db_path)[:2] == (3, [1, 2, 3])


def test_a_thread_waits_for_the_writer_at_most_busy_timeout(
    store: EventStore, db_path: Path
) -> None:
    blocking = _BlockingIndexer()
    with_key_index(store, blocking)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            store.append("r", make_batch(0, 2), expected_seq=1, epoch=1)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    holder = threading.Thread(target=first)
    holder.start()
    try:
        assert blocking.entered.wait(10)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=r"waited 0.3 s \(busy_timeout_ms\)"):
            store.append("r", make_batch(2, 2), expected_seq=3, epoch=1)
        assert 0.25 <= time.monotonic() - started < 5
    finally:
        blocking.release.set()
        holder.join(10)
    assert not holder.is_alive() and errors == []
    store.append("r", make_batch(2, 2), expected_seq=3, epoch=1)
    assert _stored(db_path) == (4, [1, 2, 3, 4], 4)


def test_threads_appending_to_one_store_take_turns(store: EventStore, db_path: Path) -> None:
    deadline = time.monotonic() + 60

    def appender(k: int) -> None:
        for i in range(25):
            while time.monotonic() < deadline:
                nxt = store.last_seq("r") + 1
                try:
                    store.append("r", make_batch(1000 * k + 4 * i, 4), expected_seq=nxt, epoch=1)
                    break
                except AppendConflictError:
                    continue

    threads = [threading.Thread(target=appender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert _stored(db_path)[:2] == (400, list(range(1, 401)))
    assert _writer(store).connections_opened == 1


def test_close_closes_now_or_when_the_running_append_ends(store: EventStore, db_path: Path) -> None:
    store.append("r", make_batch(0, 1), expected_seq=1, epoch=1)
    writer = _writer(store)
    first = writer._db
    assert first is not None
    store.close()
    assert writer._db is None
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        first.execute("SELECT 1")
    # A closed store still appends (as its engine still connects): on a new connection.
    blocking = _BlockingIndexer()
    with_key_index(store, blocking)
    done = threading.Thread(
        target=store.append, args=("r", make_batch(1, 2)), kwargs={"expected_seq": 2, "epoch": 1}
    )
    done.start()
    assert blocking.entered.wait(10)
    second = writer._db
    store.close()  # does not wait for the append, nor close under it
    assert writer._db is second
    blocking.release.set()
    done.join(10)
    assert not done.is_alive()
    assert writer._db is None and writer.connections_opened == 2
    assert _stored(db_path) == (3, [1, 2, 3], 2)


def test_a_connection_from_before_a_fork_is_neither_used_nor_closed(
    store: EventStore, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.append("r", make_batch(0, 1), expected_seq=1, epoch=1)
    writer = _writer(store)
    parents = writer._db
    assert parents is not None
    real_pid = sqlite_writer.os.getpid()
    monkeypatch.setattr(sqlite_writer.os, "getpid", lambda: real_pid + 1)
    store.append("r", make_batch(1, 1), expected_seq=2, epoch=1)
    assert writer._db is not parents and writer.connections_opened == 2
    assert parents.execute("SELECT 1").fetchone() == (1,)  # still open: the parent's
    parents.close()
    assert _stored(db_path)[:2] == (2, [1, 2])
