"""Contract of the GroupCommitter: sequences at once, durability at flush, batching, failure."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from storetest_helpers import make_batch, make_event

from rolloutlog.eventstore import (
    AppendConflictError,
    Committer,
    EpochFencedError,
    EventStore,
    GroupCommitClosedError,
    GroupCommitter,
    PayloadNotFoundError,
    PayloadPut,
    open_committer,
)


@pytest.fixture(params=["thread", "process"])
def committers(request: pytest.FixtureRequest):
    """Factory of committers, each closed (without flushing) at teardown.

    Every test runs with appends on the committer's thread and in a writer process
    (writer_process.py); the second skips where the test wraps the store to intercept
    its appends in this process, or runs on the memory store (no other process sees it).
    """
    writer = request.param
    made: list[Committer] = []

    def _make(store: EventStore, run_id: str = "r1", **kw: object) -> Committer:
        if writer == "process" and not isinstance(store, EventStore):
            pytest.skip(f"{type(store).__name__} lives in this process only")
        kw.setdefault("epoch", 1)
        kw.setdefault("next_seq", store.last_seq(run_id) + 1)
        gc = open_committer(store, run_id, writer=writer, **kw)  # type: ignore[arg-type]
        made.append(gc)
        return gc

    yield _make
    for gc in made:
        gc.close(flush=False)


def test_submit_returns_sequences_before_durability(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    other = open_store(db_url)
    # A 30 s window: a loaded machine cannot stall past it between the submits and the
    # checks below (flush does not wait it out).
    gc = committers(store, window_s=30.0)
    assert (gc.next_seq, gc.durable_seq) == (1, 0)
    started = time.monotonic()
    assert gc.submit(make_batch(1, 3)) == 3
    assert gc.submit(make_batch(4, 1)) == 4
    assert gc.submit([]) == 4
    assert time.monotonic() - started < 10  # submit does not wait for the 30 s window
    assert gc.next_seq == 5
    # Inside the commit window nothing is durable yet.
    assert gc.durable_seq == 0
    assert other.last_seq("r1") == 0
    assert gc.flush() == 4
    assert gc.durable_seq == 4
    assert [e.payload for e in other.read("r1")] == [e.payload for e in make_batch(1, 4)]
    assert len(gc.commit_seconds) == 1  # one window, one transaction


def test_flush_returns_only_once_durable(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    gc = committers(store, window_s=0.05)
    assert gc.next_seq == 3
    other = open_store(db_url)  # a second store on the same URL: its own connections
    nxt = 3
    for n in (1, 4, 2, 7):
        last = gc.submit(make_batch(nxt, n))
        assert last == nxt + n - 1
        assert gc.flush() == last
        assert other.last_seq("r1") == last
        got = list(other.read("r1", nxt))
        assert [e.seq for e in got] == list(range(nxt, last + 1))
        assert [e.payload for e in got] == [e.payload for e in make_batch(nxt, n)]
        nxt = last + 1
    assert gc.flush() == nxt - 1  # nothing new: returns at once


def test_close_flushes_and_refuses_more(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.3)
    gc.submit(make_batch(1, 5))
    gc.close()
    assert open_store(db_url).last_seq("r1") == 5
    with pytest.raises(GroupCommitClosedError, match="closed"):
        gc.submit(make_batch(6, 1))
    assert store.last_seq("r1") == 5


class _SlowStore:
    """Delegates to a real store, but each append takes ``delay`` seconds longer."""

    def __init__(self, store: EventStore, delay: float) -> None:
        self.store = store
        self.delay = delay

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def append(self, *args: object, **kwargs: object) -> int:
        time.sleep(self.delay)
        return self.store.append(*args, **kwargs)  # type: ignore[arg-type]


def test_flush_does_not_wait_out_the_commit_window(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=5.0)
    gc.submit(make_batch(1, 1))
    started = time.monotonic()
    assert gc.flush(timeout=30) == 1
    assert time.monotonic() - started < 2.5, "flush waited for the 5 s commit window"


def test_a_full_batch_commits_without_waiting_out_the_window(
    db_url, open_store, committers
) -> None:
    """The writer is woken when a batch fills, not only by a flush: submissions reaching
    ``max_batch`` commit at once although the window is long and nobody flushes."""
    store = open_store(db_url)
    store.create_run("r1")
    other = open_store(db_url)
    gc = committers(store, window_s=30.0, max_batch=40)
    for i in range(9):  # 4 events per command
        gc.submit(make_batch(4 * i + 1, 4))
    time.sleep(0.3)  # the writer now waits out its window
    gc.submit(make_batch(37, 4))  # fills the batch
    deadline = time.monotonic() + 15
    while other.last_seq("r1") < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert other.last_seq("r1") == 40, "the full batch waited for the 30 s window"
    # The committer learns of the commit after the database shows it (a writer process
    # answers once its transaction is committed): a moment later, not at once.
    while gc.durable_seq < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gc.durable_seq == 40


def test_the_first_unit_wakes_an_idle_writer(db_url, open_store, committers) -> None:
    """After a commit the writer sleeps until there is work; one submission wakes it and
    commits after the window, without a flush."""
    store = open_store(db_url)
    store.create_run("r1")
    other = open_store(db_url)
    gc = committers(store, window_s=0.05)
    for first in (1, 3):
        gc.submit(make_batch(first, 2))
        deadline = time.monotonic() + 15
        while other.last_seq("r1") < first + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert other.last_seq("r1") == first + 1
        time.sleep(0.1)  # the writer is idle again


def test_submissions_inside_a_window_do_not_wake_the_writer_each(db_url, open_store) -> None:
    """Waking the writer on every submission costs a GIL hand-off per command; inside
    one window only the first submission and the one filling the batch notify it."""
    store = open_store(db_url)
    store.create_run("r1")
    gc = GroupCommitter(store, "r1", epoch=1, next_seq=1, window_s=30.0, max_batch=100)
    try:
        notified = 0
        real = gc._cv.notify_all
        submitter = threading.get_ident()

        def counting() -> None:
            nonlocal notified
            notified += threading.get_ident() == submitter  # not the writer's own
            real()

        gc._cv.notify_all = counting  # type: ignore[method-assign]
        for i in range(50):  # 2 events each: the 50th fills the batch
            gc.submit(make_batch(2 * i + 1, 2))
        assert notified == 2, notified
        assert gc.flush(timeout=30) == 100
    finally:
        gc.close(flush=False)


def test_aflush_from_asyncio(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    other = open_store(db_url)
    gc = committers(_SlowStore(store, 0.2), window_s=0.0)

    async def main() -> tuple[int, int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        last = gc.submit(make_batch(1, 6))
        durable = await gc.aflush()
        stop.set()
        await task
        again = await gc.aflush()  # nothing pending: immediate
        return last, durable, again if ticks > 5 else -ticks

    last, durable, again = asyncio.run(main())
    assert (last, durable) == (6, 6)
    assert again == 6, "the event loop was blocked while aflush waited"
    assert other.last_seq("r1") == 6


def test_many_submits_share_few_transactions(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.02)
    n = 2000
    for i in range(1, n + 1):
        assert gc.submit([make_event(i)]) == i
    assert gc.flush() == n
    transactions = len(gc.commit_seconds)
    assert 1 <= transactions <= n // 20, transactions
    assert all(s >= 0 for s in gc.commit_seconds)
    got = list(store.read("r1"))
    assert [e.seq for e in got] == list(range(1, n + 1))
    assert [e.payload for e in got] == [make_event(i).payload for i in range(1, n + 1)]


class _GatedStore:
    """Delegates to a real store; records each append's offsets; the first append waits
    for ``release`` (so later submissions queue up behind it)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.entered = threading.Event()
        self.release = threading.Event()
        self.commits: list[tuple[int, int]] = []  # (first, last) offsets per transaction

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def append(self, run_id: str, batch: list, **kwargs: object) -> int:
        self.entered.set()
        assert self.release.wait(30), "the test never released the first append"
        last = self.store.append(run_id, batch, **kwargs)  # type: ignore[arg-type]
        if batch:
            self.commits.append((last - len(batch) + 1, last))
        return last


def test_max_batch_cuts_between_submissions_only(db_url, open_store, committers) -> None:
    """A batch boundary never falls inside one submission (one command's events); a
    submission larger than max_batch commits alone, whole."""
    store = open_store(db_url)
    store.create_run("r1")
    gated = _GatedStore(store)
    gc = committers(gated, max_batch=10, window_s=0.0)
    gc.submit(make_batch(1, 1))
    assert gated.entered.wait(30)
    # Queued behind the blocked first commit: 4+4+4 would cut at 10 inside the third.
    sizes = [4, 4, 4, 7, 25, 1, 3, 9, 2]
    units = []
    nxt = 2
    for n in sizes:
        assert gc.submit(make_batch(nxt, n)) == nxt + n - 1
        units.append((nxt, nxt + n - 1))
        nxt += n
    gated.release.set()
    assert gc.flush(timeout=30) == nxt - 1
    starts = {1} | {first for first, _ in units}
    ends = {1} | {last for _, last in units}
    for first, last in gated.commits:
        assert first in starts and last in ends, f"commit {first}..{last} splits a submission"
        if last - first + 1 > 10:
            assert (first, last) in units, f"an oversized commit {first}..{last} is not one unit"
    assert (21, 45) in gated.commits  # the 25-event submission, alone and whole
    assert [e.seq for e in store.read("r1")] == list(range(1, nxt))


def test_submitted_payloads_are_durable_with_their_events(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.01)
    gc.submit(make_batch(1, 2), [PayloadPut("tok-1", "tokens", b"\x01\x02\x03")])
    gc.submit(make_batch(3, 1), [PayloadPut("tok-2", "tokens", b"")])
    gc.flush()
    other = open_store(db_url)
    assert other.get_payload("r1", "tok-1") == b"\x01\x02\x03"
    assert other.get_payload("r1", "tok-2") == b""
    with pytest.raises(ValueError, match="together"):
        gc.submit([], [PayloadPut("orphan", "tokens", b"x")])
    with pytest.raises(PayloadNotFoundError):
        other.get_payload("r1", "orphan")


def test_fenced_writer_fails_flush_and_later_submits(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.01)
    gc.submit(make_batch(1, 3))
    assert gc.flush() == 3
    # A restore elsewhere opens epoch 2: this committer (epoch 1) is fenced.
    rival = open_store(db_url)
    assert rival.open_epoch("r1") == 2
    gc.submit(make_batch(4, 2), [PayloadPut("lost", "tokens", b"x")])
    with pytest.raises(GroupCommitClosedError) as info:
        gc.flush(timeout=30)
    cause = info.value.__cause__
    assert isinstance(cause, EpochFencedError)
    assert (cause.writer_epoch, cause.current_epoch) == (1, 2)
    assert "fenced" in str(info.value)
    with pytest.raises(GroupCommitClosedError) as later:
        gc.submit(make_batch(6, 1))
    assert isinstance(later.value.__cause__, EpochFencedError)
    with pytest.raises(GroupCommitClosedError):
        gc.flush()
    with pytest.raises(GroupCommitClosedError):
        asyncio.run(gc.aflush())
    assert gc.durable_seq == 3
    gc.close()  # does not hang or raise after a failure
    assert rival.last_seq("r1") == 3
    assert [e.seq for e in rival.read("r1")] == [1, 2, 3]
    with pytest.raises(PayloadNotFoundError):
        rival.get_payload("r1", "lost")


def test_conflicting_writer_fails_the_committer(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.3)
    gc.submit(make_batch(1, 2))
    # Someone else appends sequence 1 first (a second controller without fencing).
    open_store(db_url).append("r1", make_batch(100, 1), expected_seq=1, epoch=1)
    with pytest.raises(GroupCommitClosedError) as info:
        gc.flush(timeout=30)
    assert isinstance(info.value.__cause__, AppendConflictError)
    assert [e.payload for e in store.read("r1")] == [make_event(100).payload]


def test_aflush_waiting_when_the_writer_fails(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.3)
    open_store(db_url).open_epoch("r1")

    async def main() -> BaseException:
        gc.submit(make_batch(1, 2))
        try:
            await asyncio.wait_for(gc.aflush(), timeout=30)
        except GroupCommitClosedError as exc:
            return exc
        raise AssertionError("aflush succeeded for a fenced writer")

    err = asyncio.run(main())
    assert isinstance(err.__cause__, EpochFencedError)
    assert store.last_seq("r1") == 0


def test_flush_timeout(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(_SlowStore(store, 1.0), window_s=0.0)
    gc.submit(make_batch(1, 1))
    with pytest.raises(TimeoutError):
        gc.flush(timeout=0.05)
    assert gc.flush(timeout=30) == 1


def test_constructor_validation(db_url, open_store) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommitter(store, "r1", epoch=1, next_seq=1, max_batch=0)
    with pytest.raises(ValueError, match="window_s"):
        GroupCommitter(store, "r1", epoch=1, next_seq=1, window_s=-1)


def test_aflush_cancelled_on_a_closed_loop_does_not_kill_the_writer(
    db_url, open_store, committers
) -> None:
    """An aflush cancelled (its asyncio.run over, its loop closed) while the commit is in
    progress: the writer drops that waiter and goes on; a later flush does not hang."""
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(_SlowStore(store, 0.3), window_s=0.0)

    async def main() -> bool:
        gc.submit(make_batch(1, 1))
        try:
            await asyncio.wait_for(gc.aflush(), timeout=0.01)
        except TimeoutError:
            return True
        return False

    assert asyncio.run(main()), "the commit was expected to outlast the aflush"
    assert gc.submit(make_batch(2, 1)) == 2
    assert gc.flush(timeout=10) == 2
    assert [e.seq for e in store.read("r1")] == [1, 2]


def test_an_error_in_the_notify_path_is_stored_and_raised(db_url, open_store, committers) -> None:
    """The writer never dies silently: an error while notifying an awaiting loop fails the
    committer, and flush, aflush and submit raise it instead of hanging."""
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(_SlowStore(store, 0.1), window_s=0.0)

    def broken(*_args: object) -> None:
        raise ValueError("notify boom")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe = broken  # type: ignore[method-assign]
        gc.submit(make_batch(1, 1))
        # This waiter cannot be woken (its loop refuses callbacks): bounded by wait_for.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(gc.aflush(), timeout=2)

    asyncio.run(main())
    with pytest.raises(GroupCommitClosedError, match="notify boom"):
        gc.flush(timeout=10)
    with pytest.raises(GroupCommitClosedError, match="notify boom"):
        gc.submit(make_batch(2, 1))
    with pytest.raises(GroupCommitClosedError, match="notify boom"):
        asyncio.run(gc.aflush())
    gc.close()  # does not hang after the failure


class _DyingStore(_SlowStore):
    """Its append ends the writer thread with a BaseException that is not an Exception."""

    def append(self, *args: object, **kwargs: object) -> int:
        raise SystemExit("writer thread killed")


def test_flush_never_hangs_when_the_writer_thread_ends(db_url, open_store, committers) -> None:
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(_DyingStore(store, 0.0), window_s=0.0)
    gc.submit(make_batch(1, 1))
    with pytest.raises(GroupCommitClosedError, match="writer thread killed"):
        gc.flush(timeout=10)


def test_aflush_yields_to_the_loop_even_when_all_is_durable(db_url, open_store, committers) -> None:
    """A caller's commands on either side of an output commit must not run back to back
    when the commit is already done (a writer process is often done before it is asked)."""
    store = open_store(db_url)
    store.create_run("r1")
    gc = committers(store, window_s=0.0)
    gc.submit(make_batch(1, 2))
    assert gc.flush(timeout=30) == 2

    async def main() -> tuple[int, bool]:
        ran = False

        async def other() -> None:
            nonlocal ran
            ran = True

        task = asyncio.get_running_loop().create_task(other())
        durable = await gc.aflush()
        seen = ran
        await task
        return durable, seen

    assert asyncio.run(main()) == (2, True)
