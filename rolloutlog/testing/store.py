"""The event store contract as importable tests: subclass :class:`EventStoreContract`
and say how to make an empty store, and your store runs the suite rolloutlog's own
stores (SQLite, PostgreSQL, memory) run::

    from rolloutlog.testing import EventStoreContract

    class TestMyStore(EventStoreContract):
        def create_store(self, tmp_path):
            return MyStore(tmp_path / "log")

The tests use only :class:`~rolloutlog.eventstore.EventStoreProtocol` (no SQL):
appends with their sequence and epoch checks, conflicts that write nothing, fencing,
group commit, snapshots and payloads, the history after random restores (hypothesis),
and a run's first events written with the run. Needs pytest and hypothesis (the
``testing`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStoreProtocol,
    GroupCommitter,
    NewEvent,
    PayloadNotFoundError,
    PayloadPut,
    RunExistsError,
    RunNotFoundError,
    StoreError,
    history_segments,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ev(i: int, **kw: Any) -> NewEvent:
    """A small event whose payload names its index."""
    return NewEvent("E", 1, f'{{"i":{i}}}', T0, **kw)


def _payloads(rows: list[Any]) -> list[str]:
    return [r.payload for r in rows]


# ---------------------------------------------------------------- history segments
@st.composite
def restore_patterns(draw: st.DrawFn) -> list[tuple[int, int | None]]:
    """Steps: (events to append, then a restore to a fraction of the log or None)."""
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 4))
        restore = draw(st.one_of(st.none(), st.integers(0, 1000)))
        steps.append((n, restore))
    return steps


def _reference_history(epochs: list[tuple[int, int]], last: int) -> list[int]:
    """Offsets of the current history, walked event by event (an independent rule)."""
    writer = {}
    for i, (first, _resume) in enumerate(epochs):
        end = epochs[i + 1][0] - 1 if i + 1 < len(epochs) else last
        for s in range(first, end + 1):
            writer[s] = i
    out: list[int] = []
    # The newest epoch's own writes, then back from its resume offset.
    first, resume = epochs[-1]
    out.extend(range(last, first - 1, -1))
    upto = resume
    while upto > 0:
        e = writer[upto]
        out.append(upto)
        upto = epochs[e][1] if upto == epochs[e][0] else upto - 1
    return sorted(out)


class EventStoreContract:
    """The store contract; subclass it as ``Test...`` and implement :meth:`create_store`.

    Every test gets the ``make_store`` fixture: a factory of stores from
    :meth:`create_store`, each closed after the test.
    """

    def create_store(self, tmp_path: Path) -> EventStoreProtocol:
        """An empty store (called once per test; ``tmp_path``: the test's own folder)."""
        raise NotImplementedError(f"{type(self).__name__} must implement create_store")

    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Iterator[Callable[[], Any]]:
        """A factory of the stores under test, closed at teardown."""
        opened: list[Any] = []

        def make() -> Any:
            store = self.create_store(tmp_path)
            opened.append(store)
            return store

        yield make
        for store in opened:
            store.close()

    def test_implements_the_protocol(self, make_store: Callable[[], Any]) -> None:
        assert isinstance(make_store(), EventStoreProtocol)

    def test_append_read_round_trip(self, make_store: Callable[[], Any]) -> None:
        store = make_store()
        store.create_run("r")
        assert store.append("r", [ev(i) for i in range(1, 6)], expected_seq=1, epoch=1) == 5
        rows = list(store.read("r"))
        assert [r.seq for r in rows] == [1, 2, 3, 4, 5]
        assert _payloads(rows) == [f'{{"i":{i}}}' for i in range(1, 6)]
        assert all(r.recorded_at == T0 and r.epoch == 1 for r in rows)
        assert [r.seq for r in store.read("r", 2, 3)] == [2, 3]
        assert store.last_seq("r") == 5 and store.get_run("r").last_seq == 5
        with pytest.raises(RunExistsError):
            store.create_run("r")
        with pytest.raises(RunNotFoundError):
            store.get_run("nope")
        with pytest.raises(StoreError):
            store.create_run("")

    @pytest.mark.parametrize("expected", [1, 2, 5])
    def test_conflicts_write_nothing(self, make_store: Callable[[], Any], expected: int) -> None:
        store = make_store()
        store.create_run("r")
        store.append("r", [ev(1), ev(2)], expected_seq=1, epoch=1)
        with pytest.raises(AppendConflictError):
            store.append(
                "r",
                [ev(9)],
                expected_seq=expected,
                epoch=1,
                payload_puts=[PayloadPut("p", "k", b"x")],
            )
        assert [r.seq for r in store.read("r")] == [1, 2]
        with pytest.raises(PayloadNotFoundError):
            store.get_payload("r", "p")

    def test_fencing(self, make_store: Callable[[], Any]) -> None:
        store = make_store()
        store.create_run("r")
        store.append("r", [ev(1)], expected_seq=1, epoch=1)
        assert store.open_epoch("r", expected_epoch=1) == 2
        with pytest.raises(EpochFencedError):
            store.append("r", [ev(2)], expected_seq=2, epoch=1)
        with pytest.raises(EpochFencedError):
            store.append("r", [], expected_seq=2, epoch=1, payload_puts=[PayloadPut("p", "k", b"")])
        with pytest.raises(EpochFencedError):
            store.open_epoch("r", expected_epoch=1)
        assert store.append("r", [ev(2)], expected_seq=2, epoch=2) == 2
        with pytest.raises(StoreError):
            store.open_epoch("r", resume_seq=3)

    def test_group_commit(self, make_store: Callable[[], Any]) -> None:
        store = make_store()
        store.create_run("r")
        gc = GroupCommitter(store, "r", epoch=1, next_seq=1, max_batch=7, window_s=0.001)
        try:
            for i in range(1, 51):
                assert gc.submit([ev(i)], [PayloadPut(f"p{i}", "k", bytes([i]))]) == i
            assert gc.flush() == 50
        finally:
            gc.close()
        assert [r.seq for r in store.read("r")] == list(range(1, 51))
        assert store.get_payload("r", "p50") == bytes([50])

    def test_snapshots_and_payloads(self, make_store: Callable[[], Any]) -> None:
        store = make_store()
        store.create_run("r")
        store.append("r", [ev(i) for i in range(1, 11)], expected_seq=1, epoch=1,
                     payload_puts=[PayloadPut("a", "k", b"one")])  # fmt: skip
        assert store.load_snapshot("r") is None
        store.save_snapshot("r", 4, 1, b"four")
        store.save_snapshot("r", 8, 1, b"eight")
        store.save_snapshot("r", 8, 2, b"EIGHT")  # replaces
        assert store.load_snapshot("r").data == b"EIGHT"
        assert store.load_snapshot("r", at_or_before=7).seq == 4
        assert store.load_snapshot("r", at_or_before=3) is None
        store.put_payload("r", "a", "k", b"two")  # idempotent by id: first write wins
        assert store.get_payload("r", "a") == b"one"
        with pytest.raises(PayloadNotFoundError):
            store.get_payload("r", "missing")

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[
            # One store per test; each subclass (another store) is another executor.
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ],
    )
    @given(pattern=restore_patterns())
    # Resume to an offset a previous restore abandoned, then keep writing.
    @example(pattern=[(3, 1), (3, 2), (2, None)])
    # A restore that has written nothing yet: its resume offset is the current history's end.
    @example(pattern=[(4, None), (0, 2)])
    @example(pattern=[(3, 1), (2, 3), (0, 5)])
    def test_history_segments_random_restores(
        self, make_store: Callable[[], Any], pattern: list[tuple[int, int | None]]
    ) -> None:
        store = make_store()
        run = f"h{abs(hash(str(pattern))) % 10**12}-{id(pattern)}"
        store.create_run(run)
        epochs = [(1, 0)]
        epoch, last = 1, 0
        for n, restore in pattern:
            if n:
                last = store.append(run, [ev(last + i + 1) for i in range(n)],
                                    expected_seq=last + 1, epoch=epoch)  # fmt: skip
            if restore is not None:
                # Any offset of the log, abandoned ones included (restore % (last + 1)).
                resume = restore % (last + 1)
                epoch = store.open_epoch(run, expected_epoch=epoch, resume_seq=resume)
                epochs.append((last + 1, resume))
        want = _reference_history(epochs, last)
        segs = store.history_segments(run)
        assert segs == history_segments(run, epochs, last)
        assert [s for f, e in segs for s in range(f, e + 1)] == want
        assert [r.seq for r in store.read_history(run)] == want
        # An epoch that has written nothing yet: its resume offset defines the history.
        if epochs[-1][0] == last + 1:
            assert (want[-1] if want else 0) == epochs[-1][1]
        # The history that led to any offset k ends at k and is a chain through k's writers.
        for k in range(0, last + 1):
            to_k = [s for f, e in store.history_segments(run, k) for s in range(f, e + 1)]
            assert (to_k[-1] if to_k else 0) == k
            assert to_k == sorted(set(to_k))
            assert [r.seq for r in store.read_history(run, k)] == to_k
            if k and k in want:
                assert to_k == [s for s in want if s <= k]

    def test_create_run_writes_its_first_events_in_the_same_transaction(
        self,
        make_store: Callable[[], Any],
    ) -> None:
        """Issue 9 item 7: the run's row and its first events commit together."""
        store = make_store()
        info = store.create_run(
            "r",
            config_fingerprint="fp",
            first_events=[ev(1), ev(2)],
            payload_puts=[PayloadPut("p1", "k", b"\x01")],
        )
        assert (info.last_seq, info.current_epoch) == (2, 1)
        assert [r.seq for r in store.read("r")] == [1, 2]
        assert store.get_payload("r", "p1") == b"\x01"
        assert store.history_segments("r") == [(1, 2)]
        # The next append continues after them; a second create writes nothing.
        assert store.append("r", [ev(3)], expected_seq=3, epoch=1) == 3
        with pytest.raises(RunExistsError):
            store.create_run("r", first_events=[ev(9)], payload_puts=[PayloadPut("p9", "k", b"")])
        assert [r.payload for r in store.read("r")] == [f'{{"i":{i}}}' for i in (1, 2, 3)]
        with pytest.raises(PayloadNotFoundError):
            store.get_payload("r", "p9")
        with pytest.raises(StoreError, match="together"):
            store.create_run("r2", payload_puts=[PayloadPut("p", "k", b"")])
        with pytest.raises(RunNotFoundError):
            store.get_run("r2")
        store.check_log()
