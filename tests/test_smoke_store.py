"""A first round trip on both backends (the full contract suite is in tests/store/)."""

from __future__ import annotations

from datetime import UTC, datetime

from rolloutlog.eventstore import EventStore, NewEvent


def test_append_read_round_trip(db_url: str) -> None:
    store = EventStore.open(db_url)
    store.create_run("r1")
    now = datetime.now(UTC)
    batch = [NewEvent("T", 1, f'{{"i": {i}}}', now) for i in range(3)]
    assert store.append("r1", batch, expected_seq=1, epoch=1) == 3
    got = list(store.read("r1"))
    assert [e.seq for e in got] == [1, 2, 3]
    assert [e.payload for e in got] == [e.payload for e in batch]
    store.close()
