"""PostgreSQL's pipelined append (a batch over ``append_chunk_events`` events): its
failure paths. The contract suite runs every store test on it too (the
``postgres_pipelined`` backend of ``db_url``); here, what only it can get wrong: a refusal
or an error in any statement of the pipeline writes nothing, the next append on the same
store works (a pipeline that aborts can leave psycopg believing in a prepared statement
the server never made), no warning is logged, and the URL option is checked."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from storetest_helpers import make_batch, make_event, with_key_index

from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    LockTimeoutError,
    StoreError,
    StoreUrlError,
)
from rolloutlog.eventstore.pg_append import PgAppendStatement

pytestmark = pytest.mark.postgres

CHUNK = 3


@pytest.fixture
def store(pg_url: str) -> Iterator[EventStore]:
    """A store whose appends of more than CHUNK events are pipelined."""
    opened = EventStore.open(f"{pg_url}?append_chunk_events={CHUNK}")
    opened.create_run("r")
    yield opened
    opened.close()


@pytest.fixture
def chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first offsets of the chunk statements built (proof that the pipeline ran)."""
    built: list[int] = []
    real = PgAppendStatement.chunk

    def spy(self: PgAppendStatement, run_id: str, first_seq: int, *args: object) -> object:
        built.append(first_seq)
        return real(self, run_id, first_seq, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PgAppendStatement, "chunk", spy)
    return built


def _rows(store: EventStore) -> list[tuple[int, str]]:
    with store.engine.connect() as conn:
        return [
            (int(seq), str(payload))
            for seq, payload in conn.exec_driver_sql(
                "SELECT seq, payload FROM events WHERE run_id = 'r' ORDER BY seq"
            )
        ]


def test_a_large_batch_goes_in_chunks_and_reads_back(store: EventStore, chunks: list[int]) -> None:
    batch = make_batch(1, 3 * CHUNK + 2)
    assert store.append("r", batch, expected_seq=1, epoch=1) == len(batch)
    assert chunks == [4, 7, 10]  # the head holds 1..3
    assert [(ev.seq, ev.payload, ev.recorded_at) for ev in store.read("r")] == [
        (i, ev.payload, ev.recorded_at) for i, ev in enumerate(batch, 1)
    ]
    # A batch of CHUNK events or fewer is one statement.
    assert store.append("r", make_batch(12, CHUNK), expected_seq=12, epoch=1) == 14
    assert chunks == [4, 7, 10]


@pytest.mark.parametrize("size", [2 * CHUNK + 1, 300])
def test_refusals_write_nothing_and_later_appends_work(
    store: EventStore, caplog: pytest.LogCaptureFixture, size: int
) -> None:
    """Conflicts and fencing, again and again past psycopg's prepare threshold (5 runs of
    a statement), each between two appends that must succeed on the same store. In a
    pipeline of 100 statements psycopg reads the head's refusal while later ones are
    still being sent: it must end quietly there too (no "error ignored" warning)."""
    caplog.set_level(logging.WARNING)
    seq = 1
    for round_no in range(8):
        batch = make_batch(seq, size)
        with pytest.raises(AppendConflictError) as info:
            store.append("r", batch, expected_seq=seq + 1, epoch=1)
        assert info.value.actual_next_seq == seq
        with pytest.raises(EpochFencedError):
            store.append("r", batch, expected_seq=seq, epoch=2)
        assert store.last_seq("r") == seq - 1, round_no
        seq = store.append("r", batch, expected_seq=seq, epoch=1) + 1
    assert [s for s, _ in _rows(store)] == list(range(1, seq))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("where", ["head", "chunk", "last chunk"])
def test_an_error_in_any_statement_writes_nothing(store: EventStore, where: str) -> None:
    """A payload PostgreSQL refuses (a NUL) in the head, a middle chunk or the last one."""
    store.append("r", make_batch(1, 2), expected_seq=1, epoch=1)
    before = _rows(store)
    n = 3 * CHUNK + 1
    bad = {"head": 0, "chunk": CHUNK + 1, "last chunk": n - 1}[where]
    batch = [
        make_event(3 + i, payload='{"x": "\x00"}') if i == bad else make_event(3 + i)
        for i in range(n)
    ]
    with pytest.raises(StoreError, match="NUL"):
        store.append("r", batch, expected_seq=3, epoch=1)
    assert _rows(store) == before
    assert store.last_seq("r") == 2
    # The same store appends on (a new connection: the failed one was closed).
    assert store.append("r", make_batch(3, n), expected_seq=3, epoch=1) == 2 + n


def test_a_bad_derived_row_writes_nothing_and_leaves_no_transaction(store: EventStore) -> None:
    """The tail's rows are built last, after the events went out: a bad one (not one value
    per column) fails the append, and nothing of it stays open on a pooled connection."""
    indexer = with_key_index(store)
    real_rows = indexer.rows
    indexer.rows = lambda run_id, first_seq, batch: [("r", first_seq)]  # type: ignore[method-assign]
    with pytest.raises(StoreError, match="one value per column"):
        store.append("r", make_batch(1, 2 * CHUNK), expected_seq=1, epoch=1)
    assert _rows(store) == []
    with store.engine.connect() as conn:
        open_xacts = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%%'"
        ).scalar_one()
    assert open_xacts == 0
    indexer.rows = real_rows  # type: ignore[method-assign]
    assert store.append("r", make_batch(1, 2 * CHUNK), expected_seq=1, epoch=1) == 2 * CHUNK
    with store.engine.connect() as conn:
        keys = conn.exec_driver_sql("SELECT seq FROM test_keys ORDER BY seq").scalars().all()
    assert keys == list(range(1, 2 * CHUNK + 1))


def test_a_pipelined_append_behind_a_row_lock_times_out(store: EventStore, pg_url: str) -> None:
    store.append("r", make_batch(1, 2), expected_seq=1, epoch=1)
    holder = sa.create_engine(pg_url)
    try:
        with holder.connect() as conn:
            conn.begin()
            conn.exec_driver_sql("SELECT * FROM runs WHERE run_id = 'r' FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(LockTimeoutError):
                store.append(
                    "r", make_batch(3, 2 * CHUNK), expected_seq=3, epoch=1, lock_timeout_s=0.3
                )
            assert time.monotonic() - started < 10
            conn.rollback()
    finally:
        holder.dispose()
    assert store.last_seq("r") == 2
    assert store.append("r", make_batch(3, 2 * CHUNK), expected_seq=3, epoch=1) == 2 + 2 * CHUNK


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_a_bad_chunk_size_in_the_url_is_refused_by_name(pg_url: str, value: str) -> None:
    with pytest.raises(StoreUrlError, match=f"append_chunk_events='{value}'"):
        EventStore.open(f"{pg_url}?append_chunk_events={value}")


def test_chunk_size_zero_appends_every_batch_as_one_statement(
    pg_url: str, chunks: list[int]
) -> None:
    with EventStore.open(f"{pg_url}?append_chunk_events=0") as store:
        store.create_run("r")
        assert store.append("r", make_batch(1, 600), expected_seq=1, epoch=1) == 600
    assert chunks == []
