"""Contract: snapshots are found by offset (newest at or before), per run, bytes intact."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rolloutlog.eventstore import EventStore, Snapshot


def test_no_snapshot_is_none(store: EventStore) -> None:
    store.create_run("r1")
    assert store.load_snapshot("r1") is None
    assert store.load_snapshot("r1", 100) is None
    assert store.load_snapshot("ghost") is None


def test_newest_at_or_before_an_offset(store: EventStore) -> None:
    store.create_run("r1")
    blobs = {seq: bytes([seq]) * seq + b"\x00\xff" for seq in (10, 20, 30)}
    # Saved out of order: lookup is by offset, not by insertion time.
    for seq in (20, 10, 30):
        store.save_snapshot("r1", seq, 2, blobs[seq])
    expected = {
        None: 30,
        0: None,
        9: None,
        10: 10,
        11: 10,
        19: 10,
        20: 20,
        29: 20,
        30: 30,
        10**12: 30,
    }
    for at, seq in expected.items():
        snap = store.load_snapshot("r1", at)
        if seq is None:
            assert snap is None, at
            continue
        assert isinstance(snap, Snapshot)
        assert (snap.run_id, snap.seq, snap.schema_version) == ("r1", seq, 2), at
        assert snap.data == blobs[seq]
        assert isinstance(snap.data, bytes)
        assert snap.created_at.utcoffset() == timedelta(0)
        assert abs(datetime.now(UTC) - snap.created_at) < timedelta(minutes=1)


def test_snapshot_at_the_same_offset_is_replaced(store: EventStore) -> None:
    store.create_run("r1")
    store.save_snapshot("r1", 5, 1, b"old")
    store.save_snapshot("r1", 5, 2, b"new")
    snap = store.load_snapshot("r1", 5)
    assert snap is not None
    assert (snap.schema_version, snap.data) == (2, b"new")


def test_snapshots_are_per_run(store: EventStore) -> None:
    store.create_run("a")
    store.create_run("b")
    store.save_snapshot("a", 7, 1, b"a7")
    store.save_snapshot("b", 3, 1, b"b3")
    a = store.load_snapshot("a")
    b = store.load_snapshot("b", 100)
    assert a is not None and b is not None
    assert (a.run_id, a.seq, a.data) == ("a", 7, b"a7")
    assert (b.run_id, b.seq, b.data) == ("b", 3, b"b3")
    assert store.load_snapshot("b", 2) is None


def test_large_snapshot_round_trips(store: EventStore) -> None:
    store.create_run("r1")
    data = bytes(range(256)) * 8192  # 2 MiB
    store.save_snapshot("r1", 1, 1, data)
    snap = store.load_snapshot("r1", 1)
    assert snap is not None and snap.data == data
