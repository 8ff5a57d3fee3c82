"""Contract: optimistic concurrency (expected_seq) and epoch fencing; a refusal writes nothing."""

from __future__ import annotations

import threading

import pytest
from storetest_helpers import make_batch

from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    PayloadNotFoundError,
    PayloadPut,
    RunNotFoundError,
)


def _log(store: EventStore, run_id: str = "r1") -> list[tuple[int, int, str]]:
    return [(e.seq, e.epoch, e.payload) for e in store.read(run_id)]


@pytest.mark.parametrize("expected_seq", [1, 5, 6, 8, 100])
def test_expected_seq_behind_or_ahead_conflicts(store: EventStore, expected_seq: int) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 6), expected_seq=1, epoch=1)
    before = _log(store)
    with pytest.raises(AppendConflictError) as info:
        store.append(
            "r1",
            make_batch(90, 3),
            expected_seq=expected_seq,
            epoch=1,
            payload_puts=[PayloadPut("p1", "tokens", b"\x01\x02")],
        )
    err = info.value
    assert (err.run_id, err.expected_seq, err.actual_next_seq) == ("r1", expected_seq, 7)
    assert f"expected next sequence {expected_seq}" in str(err)
    assert "is 7" in str(err)
    assert "nothing of this batch was written" in str(err)
    assert store.last_seq("r1") == 6
    assert _log(store) == before
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("r1", "p1")
    # The right expected_seq still works afterwards.
    assert store.append("r1", make_batch(7, 2), expected_seq=7, epoch=1) == 8


def test_conflict_on_empty_run(store: EventStore) -> None:
    store.create_run("r1")
    with pytest.raises(AppendConflictError):
        store.append("r1", make_batch(1, 2), expected_seq=2, epoch=1)
    assert store.last_seq("r1") == 0
    assert _log(store) == []


def test_append_to_unknown_run(store: EventStore) -> None:
    with pytest.raises(RunNotFoundError, match="'ghost'"):
        store.append("ghost", make_batch(1, 2), expected_seq=1, epoch=1)
    with pytest.raises(RunNotFoundError):
        store.append(
            "ghost", [], expected_seq=1, epoch=1, payload_puts=[PayloadPut("p", "k", b"x")]
        )
    assert list(store.read("ghost")) == []
    assert store.list_runs() == []
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("ghost", "p")


def test_open_epoch_fences_the_old_epoch(store: EventStore) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 3), expected_seq=1, epoch=1)
    assert store.open_epoch("r1") == 2
    assert store.get_run("r1").current_epoch == 2
    before = _log(store)
    with pytest.raises(EpochFencedError) as info:
        store.append(
            "r1",
            make_batch(4, 2),
            expected_seq=4,
            epoch=1,
            payload_puts=[PayloadPut("late", "tokens", b"zz")],
        )
    err = info.value
    assert (err.run_id, err.writer_epoch, err.current_epoch) == ("r1", 1, 2)
    assert "epoch 1" in str(err) and "epoch 2" in str(err)
    assert store.last_seq("r1") == 3
    assert _log(store) == before
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("r1", "late")
    # A payload-only put is fenced too.
    with pytest.raises(EpochFencedError):
        store.append("r1", [], expected_seq=4, epoch=1, payload_puts=[PayloadPut("x", "k", b"")])
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("r1", "x")
    # The new epoch appends, and its events carry it.
    assert store.append("r1", make_batch(4, 2), expected_seq=4, epoch=2) == 5
    assert [e.epoch for e in store.read("r1")] == [1, 1, 1, 2, 2]


def test_a_future_epoch_is_fenced_too(store: EventStore) -> None:
    store.create_run("r1")
    with pytest.raises(EpochFencedError) as info:
        store.append("r1", make_batch(1, 1), expected_seq=1, epoch=2)
    assert (info.value.writer_epoch, info.value.current_epoch) == (2, 1)
    assert store.last_seq("r1") == 0


def test_fencing_wins_over_conflict_reporting(store: EventStore) -> None:
    """A fenced writer with a stale expected_seq hears that it is fenced (the real cause)."""
    store.create_run("r1")
    store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    store.open_epoch("r1")
    store.append("r1", make_batch(3, 2), expected_seq=3, epoch=2)
    with pytest.raises(EpochFencedError):
        store.append("r1", make_batch(3, 1), expected_seq=3, epoch=1)
    assert store.last_seq("r1") == 4


def test_open_epoch_with_expected_epoch(store: EventStore) -> None:
    store.create_run("r1", epoch=4)
    assert store.open_epoch("r1", expected_epoch=4) == 5
    with pytest.raises(EpochFencedError) as info:
        store.open_epoch("r1", expected_epoch=4)
    assert (info.value.writer_epoch, info.value.current_epoch) == (4, 5)
    assert "epoch 4" in str(info.value) and "epoch 5" in str(info.value)
    assert store.get_run("r1").current_epoch == 5
    assert store.open_epoch("r1", expected_epoch=5) == 6
    with pytest.raises(RunNotFoundError):
        store.open_epoch("ghost")


def test_open_epoch_keeps_the_log(store: EventStore) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 4), expected_seq=1, epoch=1)
    before = _log(store)
    store.open_epoch("r1")
    assert _log(store) == before
    assert store.last_seq("r1") == 4


@pytest.mark.parametrize("contenders", [2, 4])
def test_racing_open_epoch_exactly_one_wins(db_url: str, open_store, contenders: int) -> None:
    setup = open_store(db_url)
    setup.create_run("r1")
    stores = [open_store(db_url) for _ in range(contenders)]
    for round_no in range(5):
        expected = setup.get_run("r1").current_epoch
        barrier = threading.Barrier(contenders)
        results: list[object] = [None] * contenders

        def contend(i: int, expected: int = expected, barrier=barrier, results=results) -> None:
            barrier.wait()
            try:
                results[i] = stores[i].open_epoch("r1", expected_epoch=expected)
            except Exception as exc:  # recorded and checked below
                results[i] = exc

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wins = [r for r in results if isinstance(r, int)]
        losses = [r for r in results if not isinstance(r, int)]
        assert wins == [expected + 1], (round_no, results)
        assert len(losses) == contenders - 1
        assert all(isinstance(r, EpochFencedError) for r in losses), losses
        assert all(r.current_epoch == expected + 1 for r in losses)  # type: ignore[union-attr]
        assert setup.get_run("r1").current_epoch == expected + 1
