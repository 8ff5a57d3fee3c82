"""Readers that tail the log wake on appends: LISTEN/NOTIFY on PostgreSQL, polling on SQLite."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest

from rolloutlog.eventstore import EventStore, NewEvent
from rolloutlog.eventstore.pg_append import CHANNEL, notify_payload, parse_notify
from rolloutlog.eventstore.watch import AppendWatcher


def _events(n: int) -> list[NewEvent]:
    now = datetime.now(UTC)
    return [NewEvent("Tick", 1, f'{{"i": {i}}}', now) for i in range(n)]


def test_notify_payload_round_trips_and_foreign_payloads_are_ignored() -> None:
    assert parse_notify(notify_payload("run a", 42)) == ("run a", 42)
    assert parse_notify("hello") is None and parse_notify("x y") is None


@pytest.mark.postgres
def test_a_committed_append_wakes_a_listener_at_once(pg_url: str) -> None:
    with EventStore.open(pg_url) as writer, EventStore.open(pg_url, readonly=True) as reader:
        writer.create_run("r1")
        watcher = AppendWatcher(reader)
        try:
            assert watcher.listening
            assert watcher.wait(0.05) == {}  # nothing appended: a plain timeout
            timer = threading.Timer(
                0.2, lambda: writer.append("r1", _events(3), expected_seq=1, epoch=1)
            )
            timer.start()
            started = time.monotonic()
            woke = watcher.wait(30.0)
            waited = time.monotonic() - started
            timer.join(10)
        finally:
            watcher.close()
    assert woke == {"r1": 3}
    assert waited < 25.0, "woke by the notification, not by the 30 s timeout"


@pytest.mark.postgres
def test_a_refused_append_notifies_nobody(pg_url: str) -> None:
    """The notification is part of the append statement: a refused compare-and-set
    (wrong expected offset) writes nothing and wakes no one."""
    from rolloutlog.eventstore import AppendConflictError

    with EventStore.open(pg_url) as store:
        store.create_run("r2")
        watcher = AppendWatcher(store)
        try:
            with pytest.raises(AppendConflictError):
                store.append("r2", _events(2), expected_seq=5, epoch=1)
            assert watcher.wait(0.5) == {}
            assert store.last_seq("r2") == 0
        finally:
            watcher.close()


def test_sqlite_waits_out_the_timeout(sqlite_url: str) -> None:
    with EventStore.open(sqlite_url) as store:
        watcher = AppendWatcher(store)
        assert not watcher.listening
        started = time.monotonic()
        assert watcher.wait(0.1) == {}
        assert time.monotonic() - started >= 0.09
        watcher.close()


@pytest.mark.postgres
def test_serve_metrics_tailer_folds_an_append_long_before_its_poll_interval(pg_url: str) -> None:
    from rolloutlog.controller.config import RolloutConfig
    from rolloutlog.controller.domain import AdmitStep
    from rolloutlog.controller.metrics.live import LogTailer
    from rolloutlog.controller.rollout_controller import RolloutController

    store = EventStore.open(pg_url)
    ctl = RolloutController.start(
        store, "tail", RolloutConfig(group_size=2, groups_per_step=2),
        dataset_fingerprint="d", dataset_size=16,
    )  # fmt: skip
    tailer = LogTailer(store, "tail", interval=60.0)
    try:
        tailer.start()
        deadline = time.monotonic() + 20
        while tailer.polls < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        before = tailer.follower.projection.values(work=tailer.follower.work)["offset"]
        ctl.execute(AdmitStep())
        ctl.flush()
        want = ctl.state.last_seq
        # Its own deadline, still well inside the 60 s poll interval: only the
        # notification can wake the tailer in time.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with tailer.follower.lock:
                now = tailer.follower.projection.values(work=tailer.follower.work)["offset"]
            if now >= want:
                break
            time.sleep(0.02)
        assert before < want <= now, "the tailer woke on the append's notification"
        assert tailer.polls >= 2
    finally:
        tailer.close()
        ctl.close()
        store.close()
    assert CHANNEL == "rolloutlog_appends"
