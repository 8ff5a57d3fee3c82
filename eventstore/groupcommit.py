"""Group commit: batch many small appends into few transactions, off the event loop.

The caller submits events and gets their sequence numbers at once (so the controller
can apply them immediately); a writer thread appends what has queued up, in one
transaction per batch, when the batch is full or the commit window has passed.
``flush()`` (or ``await aflush()``) returns once everything submitted before it is
durable, and re-raises the writer's error if an append failed: after a failure the
committer accepts nothing more, because later events would depend on lost ones.

:class:`GroupCommitter` appends on a thread of this process; :class:`ProcessCommitter`
(writer_process.py) streams each command to a child process that appends there, so
commits cost this process's GIL nothing but serialising the command. Both implement
:class:`Committer`; :func:`open_committer` picks one.

One ``submit`` call is one unit: a batch is cut only between units, never inside one,
so the events of one command always commit in the same transaction (a crash can never
leave half a command in the log). A unit larger than ``max_batch`` commits alone, whole.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

# The contract and its helpers live in committer.py (writer_process.py shares them
# without importing this module); re-exported here, where callers found them first.
from .committer import COMMIT_HISTORY as COMMIT_HISTORY
from .committer import Committer, CommitWriter, check_committer_args, record_commit_seconds
from .errors import GroupCommitClosedError, StoreError
from .protocol import EventStoreProtocol
from .records import NewEvent, PayloadPut

#: What a caller may ask for (default ``"thread"``): ``"auto"`` is a process where the
#: store allows one.
WriterChoice = Literal["auto", "thread", "process"]
WRITERS: tuple[WriterChoice, ...] = ("auto", "thread", "process")


def takes_writer_process(store: EventStoreProtocol) -> bool:
    """Whether a child process can append to ``store``'s database (a SQL store opened
    for writing; not the in-memory store, which lives in this process only)."""
    from .store import EventStore

    return isinstance(store, EventStore) and not store.readonly


def open_committer(
    store: EventStoreProtocol,
    run_id: str,
    *,
    writer: WriterChoice = "thread",
    epoch: int,
    next_seq: int,
    max_batch: int = 2000,
    window_s: float = 0.005,
    lock_timeout_s: float | None = None,
    start_timeout_s: float = 60.0,
    reply_timeout_s: float = 120.0,
) -> Committer:
    """A committer of ``run_id`` whose appends run where ``writer`` says.

    ``"thread"`` (the default): the committer's thread in this process. ``"process"``:
    a writer process (an opt-in, POSIX only; see writer_process.py for its lifecycle),
    which needs a database another process can open (a SQLite file or a PostgreSQL
    server, opened for writing), not a :class:`MemoryEventStore`; ``"auto"`` takes a
    process there and the committer's thread elsewhere.
    ``start_timeout_s`` / ``reply_timeout_s``: the writer process's deadlines (see
    :class:`~rolloutlog.eventstore.writer_process.ProcessCommitter`).
    """
    if writer not in WRITERS:
        raise ValueError(f"writer must be 'auto', 'thread' or 'process', got {writer!r}")
    if writer == "auto":
        writer = "process" if takes_writer_process(store) else "thread"
    common: dict[str, Any] = {
        "epoch": epoch,
        "next_seq": next_seq,
        "max_batch": max_batch,
        "window_s": window_s,
        "lock_timeout_s": lock_timeout_s,
    }
    if writer == "process":
        from .writer_process import ProcessCommitter

        return ProcessCommitter(
            store,
            run_id,
            **common,
            start_timeout_s=start_timeout_s,
            reply_timeout_s=reply_timeout_s,
        )
    return GroupCommitter(store, run_id, **common)


class GroupCommitter(Committer):
    """Batches appends to one run of a store on a background thread of this process."""

    writer: CommitWriter = "thread"

    def __init__(
        self,
        store: EventStoreProtocol,
        run_id: str,
        *,
        epoch: int,
        next_seq: int,
        max_batch: int = 2000,
        window_s: float = 0.005,
        lock_timeout_s: float | None = None,
    ) -> None:
        check_committer_args(max_batch, window_s)
        self.store = store
        self.run_id = run_id
        self.epoch = epoch
        self.max_batch = max_batch
        self.window_s = window_s
        #: Passed to every append (PostgreSQL: how long a commit may wait for the run's
        #: row lock before it fails instead of hanging; None: no limit).
        self.lock_timeout_s = lock_timeout_s
        self._cv = threading.Condition()
        # One entry per submit call (one command): batches are cut between entries only.
        self._units: collections.deque[tuple[Sequence[NewEvent], Sequence[PayloadPut]]] = (
            collections.deque()
        )
        self._queued = 0  # events in _units
        self._next_seq = next_seq  # next sequence to hand out
        self._queued_from = next_seq  # sequence of the first queued event
        self._durable = next_seq - 1
        self._error: BaseException | None = None
        self._closed = False
        self._stopped = False  # the writer thread has ended (for whatever reason)
        # Highest sequence someone is blocked on: the writer commits at once up to it
        # instead of waiting out the commit window (a flush should cost one fsync).
        self._wanted = next_seq - 1
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[int]]] = []
        self._commit_seconds: list[float] = []
        self._thread = threading.Thread(
            target=self._run, name=f"rolloutlog-commit-{run_id}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    @property
    def durable_seq(self) -> int:
        """Newest sequence known to be durable."""
        return self._durable

    @property
    def commit_seconds(self) -> list[float]:
        """Seconds spent in each committed transaction (for the append-latency metric)."""
        return self._commit_seconds

    def submit(self, batch: Sequence[NewEvent], payload_puts: Sequence[PayloadPut] = ()) -> int:
        """Queue events (and their payloads) for appending; return the last sequence assigned.

        Payloads are written in the same transaction as the events submitted with them,
        so an event never refers to a payload that is not durable. The events of one call
        always share a transaction, even a call larger than ``max_batch`` (it commits
        alone): call ``submit`` once per command.
        """
        if payload_puts and not batch:
            raise ValueError("payloads must be submitted together with the events that use them")
        if not batch:
            with self._cv:
                self._raise_if_unusable()
                return self._next_seq - 1
        with self._cv:
            self._raise_if_unusable()
            was_idle = not self._units
            self._units.append((list(batch), list(payload_puts)))
            self._queued += len(batch)
            self._next_seq += len(batch)
            # Wake the writer only when it has something new to decide: its first unit
            # (it sleeps until there is one) or a batch just filled (it stops waiting out
            # the window). A wake per command costs a GIL hand-off per command.
            if was_idle or self._queued - len(batch) < self.max_batch <= self._queued:
                self._cv.notify_all()
            return self._next_seq - 1

    def flush(self, timeout: float | None = None) -> int:
        """Block until every event submitted so far is durable; return the durable sequence."""
        with self._cv:
            target = self._next_seq - 1
            self._wanted = max(self._wanted, target)
            self._cv.notify_all()
            ok = self._cv.wait_for(
                lambda: self._error is not None or self._stopped or self._durable >= target,
                timeout=timeout,
            )
            if self._error is not None:
                raise GroupCommitClosedError(
                    f"appending to run {self.run_id!r} failed: {self._error}"
                ) from self._error
            if self._durable < target and self._stopped:
                raise GroupCommitClosedError(
                    f"the commit thread of run {self.run_id!r} stopped before offset {target} "
                    "was durable"
                )
            if not ok:
                raise TimeoutError(f"flush of run {self.run_id!r} timed out after {timeout}s")
            return self._durable

    async def aflush(self) -> int:
        """Await durability of everything submitted so far without blocking the event loop
        (a suspension point even when all is durable: see :meth:`Committer.aflush`)."""
        loop = asyncio.get_running_loop()
        durable: int | None = None
        with self._cv:
            target = self._next_seq - 1
            if self._error is None and self._durable >= target:
                durable = self._durable
            elif self._error is None and self._stopped:
                raise GroupCommitClosedError(
                    f"the commit thread of run {self.run_id!r} stopped before offset {target} "
                    "was durable"
                )
            elif self._error is None:
                fut: asyncio.Future[int] = loop.create_future()
                self._waiters.append((target, loop, fut))
                self._wanted = max(self._wanted, target)
                self._cv.notify_all()
        if durable is not None:
            await asyncio.sleep(0)  # a suspension point even when nothing is left to wait for
            return durable
        if self._error is not None:
            raise GroupCommitClosedError(
                f"appending to run {self.run_id!r} failed: {self._error}"
            ) from self._error
        return await fut

    def close(self, *, flush: bool = True) -> None:
        """Stop the writer thread, first making everything submitted durable (by
        default); a failed flush still stops it, then raises."""
        try:
            if flush and self._error is None and not self._closed:
                self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise GroupCommitClosedError(
                f"appending to run {self.run_id!r} failed earlier: {self._error}"
            ) from self._error
        if self._closed:
            raise GroupCommitClosedError(f"the committer of run {self.run_id!r} is closed")

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        try:
            self._commit_loop()
        except BaseException as exc:  # the writer must report every failure, never die silently
            self._fail(exc)
        finally:
            with self._cv:
                self._stopped = True
                waiters, self._waiters = self._waiters, []
                self._cv.notify_all()
            # Whoever still waits would wait forever: wake them (normally none are left).
            err = GroupCommitClosedError(
                f"the commit thread of run {self.run_id!r} stopped"
                + (f": {self._error}" if self._error is not None else "")
            )
            for _, loop, fut in waiters:
                with contextlib.suppress(Exception):  # the thread is ending: wake all we can
                    _notify(loop, _reject, fut, err)

    def _take_batch(self) -> tuple[list[NewEvent], list[PayloadPut]]:
        """Whole units from the queue's head, up to ``max_batch`` events (at least one unit).

        Called with the lock held.
        """
        batch: list[NewEvent] = []
        puts: list[PayloadPut] = []
        while self._units:
            events, unit_puts = self._units[0]
            if batch and len(batch) + len(events) > self.max_batch:
                break  # cut between commands, never inside one
            self._units.popleft()
            batch.extend(events)
            puts.extend(unit_puts)
        self._queued -= len(batch)
        return batch, puts

    def _commit_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._units or self._closed)
                if not self._units and self._closed:
                    return
                # Let the batch fill for up to one commit window, unless it is full or
                # someone is blocked on an event already queued.
                deadline = time.monotonic() + self.window_s
                while (
                    self._queued < self.max_batch
                    and not self._closed
                    and self._wanted < self._queued_from
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch, puts = self._take_batch()
                first = self._queued_from
                self._queued_from += len(batch)
            started = time.perf_counter()
            last = self.store.append(
                self.run_id,
                batch,
                expected_seq=first,
                epoch=self.epoch,
                payload_puts=puts,
                lock_timeout_s=self.lock_timeout_s,
            )
            record_commit_seconds(self._commit_seconds, time.perf_counter() - started)
            with self._cv:
                self._durable = durable = max(self._durable, last)
                # One pass, and one hand-off per event loop for all of its waiters: a
                # hand-off per waiter wakes the loop (a self-pipe write) once per waiter.
                ready: dict[asyncio.AbstractEventLoop, list[asyncio.Future[int]]] = {}
                waiting: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[int]]] = []
                for w in self._waiters:
                    if w[0] <= durable:
                        ready.setdefault(w[1], []).append(w[2])
                    else:
                        waiting.append(w)
                self._waiters = waiting
                self._cv.notify_all()
            for loop, futs in ready.items():
                _notify(loop, _resolve_all, futs, last)

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc if isinstance(exc, StoreError) else StoreError(repr(exc))
            if self._error is not exc:
                self._error.__cause__ = exc
            waiters, self._waiters = self._waiters, []
            self._cv.notify_all()
        err = GroupCommitClosedError(f"appending to run {self.run_id!r} failed: {self._error}")
        err.__cause__ = self._error
        for _, loop, fut in waiters:
            with contextlib.suppress(BaseException):  # already failing: wake all we can
                _notify(loop, _reject, fut, err)


def _notify(
    loop: asyncio.AbstractEventLoop,
    callback: Callable[[Any, Any], None],
    fut: Any,
    value: Any,
) -> None:
    """Hand a result to a waiter on its event loop.

    A loop that has closed has no one left awaiting (an ``aflush`` whose ``asyncio.run``
    ended, e.g. after a cancellation): its waiter is dropped. Any other error propagates
    and fails the committer, so it is stored and raised, never lost with the thread.
    """
    try:
        loop.call_soon_threadsafe(callback, fut, value)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _resolve_all(futs: list[asyncio.Future[int]], value: int) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(value)


def _reject(fut: asyncio.Future[int], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
