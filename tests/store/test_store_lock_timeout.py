"""Takeover with a hung writer is bounded (issue 9, item 10), on PostgreSQL.

A writer frozen in the middle of a commit holds the run's row lock. A takeover waits at
most its configured time, then fails naming the session that holds the lock, and the
epoch stays where it was. A writer stuck behind a lock gives up the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from storetest_helpers import make_batch

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore, LockTimeoutError

pytestmark = pytest.mark.postgres

HOLDER = "hung-writer-under-test"


@pytest.fixture
def hold_lock(pg_url: str) -> Iterator[Callable[[str], int]]:
    """``hold_lock(sql)``: run ``sql`` in a transaction left open (a frozen writer) from a
    session named HOLDER; returns that session's pid. Rolled back at teardown."""
    engine = sa.create_engine(pg_url, connect_args={"application_name": HOLDER})
    conns: list[sa.Connection] = []

    def _hold(sql: str) -> int:
        conn = engine.connect()
        conns.append(conn)
        conn.begin()
        conn.exec_driver_sql(sql)
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())

    yield _hold
    for conn in conns:
        conn.rollback()
        conn.close()
    engine.dispose()


def test_open_epoch_behind_a_row_lock_fails_in_time_naming_the_holder(pg_url, hold_lock) -> None:
    store = EventStore.open(pg_url)
    try:
        store.create_run("r1")
        store.append("r1", make_batch(1, 3), expected_seq=1, epoch=1)
        pid = hold_lock("SELECT * FROM runs WHERE run_id = 'r1' FOR UPDATE")
        started = time.monotonic()
        with pytest.raises(LockTimeoutError) as info:
            store.open_epoch("r1", expected_epoch=1, lock_timeout_s=0.5)
        assert time.monotonic() - started < 10
        message = str(info.value)
        assert f"pid {pid}" in message and HOLDER in message, message
        assert "idle in transaction" in message
        assert "0.5s" in message
        assert store.get_run("r1").current_epoch == 1  # nothing changed
    finally:
        store.close()


def test_takeover_behind_a_frozen_append_fails_naming_the_writer(pg_url, hold_lock) -> None:
    """RolloutController.open with a short takeover_timeout_s behind a writer frozen after
    its compare-and-set (the runs row updated, not yet committed)."""
    store = EventStore.open(pg_url)
    try:
        RolloutController.start(
            store, "r", RolloutConfig(), dataset_fingerprint="d", dataset_size=10
        ).close()
        pid = hold_lock("UPDATE runs SET last_seq = last_seq WHERE run_id = 'r'")
        started = time.monotonic()
        with pytest.raises(LockTimeoutError) as info:
            RolloutController.open(store, "r", store_config=StoreConfig(takeover_timeout_s=0.5))
        assert time.monotonic() - started < 10
        assert f"pid {pid}" in str(info.value) and HOLDER in str(info.value)
        assert store.get_run("r").current_epoch == 1
    finally:
        store.close()


def test_a_writer_behind_a_lock_gives_up_after_its_timeout(pg_url, hold_lock) -> None:
    store = EventStore.open(pg_url)
    try:
        store.create_run("r1")
        pid = hold_lock("SELECT * FROM runs WHERE run_id = 'r1' FOR UPDATE")
        started = time.monotonic()
        with pytest.raises(LockTimeoutError, match=f"pid {pid}"):
            store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1, lock_timeout_s=0.3)
        assert time.monotonic() - started < 10
        assert store.last_seq("r1") == 0
    finally:
        store.close()


def test_connections_are_named_for_the_holder_report(pg_url) -> None:
    store = EventStore.open(pg_url)
    try:
        with store.engine.connect() as conn:
            name = conn.exec_driver_sql("SHOW application_name").scalar_one()
        assert name.startswith("rolloutlog pid ")
    finally:
        store.close()
