"""A writer process: a child that appends a run's commands as they are submitted.

An opt-in (``store.commit_writer: process``; the default is the committer's thread): the
child commits on another core, so commits do not wait for the GIL behind a busy event
loop or trainer. ``submit`` frames the command and writes it to the child's stdin; the
child appends in group-committed transactions and answers on its stdout (offset durable,
seconds taken). A flush sends its target offset on a control pipe, the only pipe the
child watches while it waits out a commit window (a wake-up per command would cost the
writer). The :class:`Committer` contract holds; every wait has a deadline, and a child
that dies or stops answering fails the committer with :class:`WriterProcessError`.

Lifecycle: constructing starts the child (:meth:`ProcessCommitter.wait_started` waits for
it), :meth:`ProcessCommitter.health` reports on it, :meth:`ProcessCommitter.close` flushes,
ends the command pipe and reaps it. POSIX only (:data:`PLATFORMS`: ``pass_fds``, sessions,
``select`` on pipes). The child runs ``python -m`` in its own session, so it never
re-runs the parent's main module, Ctrl-C does not reach it, and it exits when its
command pipe closes or its parent is gone.

Frames: a little-endian u64 length, a codec byte (``m``: marshal, ``p``: pickle), the
body. Commands go as marshal (timestamps as UTC epoch microseconds) when they can, else
as pickle, so the child's store judges the same objects this process's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import marshal
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from .committer import Committer, CommitWriter, check_committer_args, record_commit_seconds
from .errors import GroupCommitClosedError, StoreError, WriterProcessError
from .protocol import EventStoreProtocol
from .records import NewEvent, PayloadPut

_HEADER = struct.Struct("<Q")
#: A flush request on the control pipe: the offset the flush waits for.
_FLUSH = struct.Struct("<Q")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
#: Linux's fcntl to resize a pipe: a larger pipe lets the child fall further behind
#: before ``submit`` has to keep bytes in this process.
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
#: Bytes asked for per read (below malloc's mmap threshold: a larger request costs a
#: mapping per call even when a few bytes arrive).
_READ_BYTES = 1 << 16
#: Most unparsed bytes the child holds before it commits what it has.
_CHILD_BUFFER = 64 << 20
#: Longest ``submit`` and ``durable_seq`` go without reading the child's answers.
_POLL_INTERVAL_S = 0.005


#: Where the writer process runs (see the module docstring); elsewhere it is refused.
PLATFORMS = ("linux", "darwin")


@dataclass(frozen=True)
class WriterHealth:
    """What :meth:`ProcessCommitter.health` says about the child."""

    pid: int | None  #: the child's process id (None once it is gone)
    started: bool  #: the child opened the database
    alive: bool  #: the child is running and has not failed
    error: str | None  #: why the committer stopped accepting commands, if it did
    seconds_since_answer: float  #: since the child last answered (or work began)


def _grow_pipe(fd: int) -> None:
    """Linux: a larger pipe lets the child fall further behind before ``submit`` keeps
    bytes in this process. Elsewhere (or capped) the default size serves."""
    if not sys.platform.startswith("linux"):
        return
    import fcntl  # POSIX-only: imported where it is used

    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)


# ---------------------------------------------------------------- framing
def _frame(message: Any) -> bytes:
    """``message`` as one frame: marshal when it can carry it, else pickle."""
    try:
        body = b"m" + marshal.dumps(message)
    except ValueError:
        return _pickle_frame(message)
    return _HEADER.pack(len(body)) + body


def _pickle_frame(message: Any) -> bytes:
    body = b"p" + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _frame_end(buf: bytearray) -> int:
    """Where the first frame of ``buf`` ends, or 0 while it is not whole."""
    if len(buf) < _HEADER.size:
        return 0
    end: int = _HEADER.size + _HEADER.unpack_from(buf)[0]
    return end if len(buf) >= end else 0


def _parse_frames(buf: bytearray) -> list[Any]:
    """Remove every whole frame from the front of ``buf``; return their messages."""
    out: list[Any] = []
    pos = 0
    size = len(buf)
    while size - pos >= _HEADER.size:
        (length,) = _HEADER.unpack_from(buf, pos)
        start = pos + _HEADER.size
        if size - start < length:
            break
        body = bytes(buf[start + 1 : start + length])
        out.append(marshal.loads(body) if buf[start] == ord("m") else pickle.loads(body))
        pos = start + length
    if pos:
        del buf[:pos]
    return out


class _NotMarshallable(Exception):
    """A command holds a value marshal cannot carry exactly: it goes as pickle."""


def _unit_frame(batch: Sequence[NewEvent], puts: Sequence[PayloadPut]) -> bytes:
    """One command (``submit`` call) as a frame: ``u`` with timestamps in microseconds,
    or ``U`` with the objects themselves."""
    put_rows = [(p.payload_id, p.kind, p.data) for p in puts]
    try:
        rows = []
        last_ts: datetime | None = None
        last_us = 0
        for ev in batch:
            ts = ev[3]
            if ts is not last_ts:  # a command's events share one timestamp object
                if ts.tzinfo is None:
                    raise _NotMarshallable  # its meaning depends on the database
                last_us = (ts - _EPOCH) // _MICROSECOND
                last_ts = ts
            rows.append((ev[0], ev[1], ev[2], last_us, ev[4]))
        body = b"m" + marshal.dumps(("u", rows, put_rows))
    except (_NotMarshallable, ValueError, TypeError, AttributeError):
        # A naive timestamp, a value marshal cannot carry, or not a datetime at all.
        return _pickle_frame(("U", [tuple(ev) for ev in batch], put_rows))
    return _HEADER.pack(len(body)) + body


def _unit_events(kind: str, rows: list[Any]) -> list[NewEvent]:
    """The child's side of :func:`_unit_frame`."""
    if kind == "U":
        return [NewEvent(*row) for row in rows]
    out = []
    last_us: int | None = None
    ts = _EPOCH
    for type_, version, payload, us, derived in rows:
        if us != last_us:
            ts = _EPOCH + timedelta(microseconds=us)
            last_us = us
        out.append(NewEvent(type_, version, payload, ts, derived))
    return out


def _read_into(fd: int, buf: bytearray, limit: int) -> bool:
    """Append what ``fd`` (non-blocking) has to ``buf``, up to ``limit`` bytes held;
    return False at end of file."""
    while len(buf) < limit:
        try:
            chunk = os.read(fd, _READ_BYTES)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        buf += chunk
    return True


# ---------------------------------------------------------------- parent side
class ProcessCommitter(Committer):
    """:class:`Committer` whose appends run in a child process (see the module docstring).

    The store's indexers are registered in the child's store, so derived rows are
    written in the same transaction as their events, exactly as :meth:`EventStore.append`
    does; they must be picklable (module-level classes). Thread-safe: one lock guards the
    pipes and the state.
    """

    writer: CommitWriter = "process"

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
        start_timeout_s: float = 60.0,
        reply_timeout_s: float = 120.0,
    ) -> None:
        check_committer_args(max_batch, window_s)
        if start_timeout_s <= 0 or reply_timeout_s <= 0:
            raise ValueError("start_timeout_s and reply_timeout_s must be > 0")
        if not sys.platform.startswith(PLATFORMS):
            raise WriterProcessError(
                f"the writer process runs on {', '.join(PLATFORMS)}, not {sys.platform}; "
                "use store.commit_writer: thread"
            )
        url = _writable_url(store)
        self.store = store
        self.run_id = run_id
        self.epoch = epoch
        self.max_batch = max_batch
        self.window_s = window_s
        self.lock_timeout_s = lock_timeout_s
        self.start_timeout_s = start_timeout_s
        #: Longest the child may go without answering while work is outstanding.
        self.reply_timeout_s = reply_timeout_s + (lock_timeout_s or 0.0)
        self._where = _safe_url(url)
        self._lock = threading.RLock()
        self._next_seq = next_seq
        self._durable = next_seq - 1
        self._flush_sent = next_seq - 1  # highest offset a flush request was sent for
        self._commit_seconds: list[float] = []
        self._error: StoreError | None = None
        self._closed = False  # close() was called: nothing more is accepted
        self._child_done = False  # the child's answers ended (it exited or was killed)
        self._ready = False  # the child opened the database
        self._out = bytearray()  # frames not yet written to the command pipe
        self._in = bytearray()  # bytes the child sent, not yet a whole frame
        self._started = time.monotonic()
        self._last_progress = self._started  # when the child last answered, or work began
        self._polled_at = 0.0
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[int]]] = []
        self._reading: set[asyncio.AbstractEventLoop] = set()
        self._writing: set[asyncio.AbstractEventLoop] = set()
        control_r, self._control = os.pipe()
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", __name__, str(control_r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(control_r,),
                start_new_session=True,  # its own process group: killed whole, not by Ctrl-C
            )
        except BaseException:
            os.close(self._control)
            raise
        finally:
            os.close(control_r)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._w = self._proc.stdin.fileno()
        self._r = self._proc.stdout.fileno()
        for fd in (self._w, self._r):
            _grow_pipe(fd)
            os.set_blocking(fd, False)
        os.set_blocking(self._control, False)
        opening = (
            os.getpid(),
            url,
            run_id,
            epoch,
            next_seq,
            list(getattr(store, "indexers", ())),
            max_batch,
            window_s,
            lock_timeout_s,
        )
        with self._lock:
            # The child opens the database while this process goes on: commands queue in
            # the pipe meanwhile, and a child that cannot open says why at the next look.
            self._write(_pickle_frame(("open", *opening)))

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        """The child's process id (None once it is gone)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def health(self) -> WriterHealth:
        """The child's state now (reads its pending answers first)."""
        with self._lock:
            if not self._child_done:
                self._poll()
            proc = self._proc
            alive = proc is not None and proc.poll() is None and self._error is None
            return WriterHealth(
                pid=None if proc is None else proc.pid,
                started=self._ready,
                alive=alive and not self._child_done,
                error=None if self._error is None else str(self._error),
                seconds_since_answer=time.monotonic() - self._last_progress,
            )

    def wait_started(self, timeout: float | None = None) -> None:
        """Block until the child has opened the database (it starts in the background).

        Raises what a flush would: :class:`GroupCommitClosedError` if the child failed or
        missed its start deadline; ``TimeoutError`` past ``timeout``.
        """

        def started() -> bool:
            if self._ready:
                return True
            if self._child_done:
                raise GroupCommitClosedError(f"the committer of run {self.run_id!r} is closed")
            return False

        self._wait(started, timeout, "the writer process did not start within {}s")

    @property
    def durable_seq(self) -> int:
        """Newest sequence known to be durable (the child's answers of the last few ms)."""
        with self._lock:
            self._poll(force=False)
            return self._durable

    @property
    def commit_seconds(self) -> list[float]:
        """Seconds each of the child's transactions took (for the append-latency metric)."""
        with self._lock:
            self._poll()
            return self._commit_seconds

    # ------------------------------------------------------------------ producer side
    def submit(self, batch: Sequence[NewEvent], payload_puts: Sequence[PayloadPut] = ()) -> int:
        """Send one command's events (and payloads) to the child; return the last offset.

        Never waits for the child: what its pipe cannot take now stays in this process
        until the next call (or the event loop's writer callback) hands it over.
        """
        if payload_puts and not batch:
            raise ValueError("payloads must be submitted together with the events that use them")
        with self._lock:
            self._poll(force=False)
            self._raise_if_unusable()
            if not batch:
                return self._next_seq - 1
            frame = _unit_frame(batch, payload_puts)
            if self._durable == self._next_seq - 1:
                self._last_progress = time.monotonic()  # the child has work again
            self._next_seq += len(batch)
            self._write(frame)
            last = self._next_seq - 1
            if last - max(self._flush_sent, self._durable) >= self.max_batch:
                # A batch's worth is waiting: wake the child as a flush would (it sleeps
                # out its window without watching the command pipe).
                self._request_flush(last)
            return last

    def flush(self, timeout: float | None = None) -> int:
        """Block until every event submitted so far is durable; return the durable sequence."""
        with self._lock:
            target = self._next_seq - 1
            self._request_flush(target)
        self._wait(
            lambda: self._durable >= target,
            timeout,
            f"flush of run {self.run_id!r} timed out after {{}}s",
        )
        return self._durable

    def _wait(self, done: Callable[[], bool], timeout: float | None, late: str) -> None:
        """Poll the child (and hand it what is kept) until ``done()``, a failure (raised as
        a flush raises it) or ``timeout`` (``TimeoutError(late.format(timeout))``); the
        child's own deadlines bound every wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._poll()
                self._raise_if_failed()
                if done():
                    return
                writable = [self._w] if self._out else []
                wait = self._seconds_to_deadline()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(late.format(timeout))
                wait = min(wait, left)
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: the poll says why
                select.select([self._r], writable, [], min(wait, 1.0))

    async def aflush(self) -> int:
        """Await durability of everything submitted so far without blocking the event loop
        (a suspension point even when all is durable: see :meth:`Committer.aflush`)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._poll()
            self._raise_if_failed()
            target = self._next_seq - 1
            durable = self._durable if self._durable >= target else None
            if durable is None:
                fut: asyncio.Future[int] = loop.create_future()
                self._waiters.append((target, loop, fut))
                self._request_flush(target)
                self._watch(loop)
        if durable is not None:
            await asyncio.sleep(0)  # a suspension point even when nothing is left to wait for
            return durable
        tick = loop.call_later(1.0, self._tick, loop)
        try:
            return await fut
        finally:
            tick.cancel()
            with self._lock:
                self._waiters = [w for w in self._waiters if w[2] is not fut]
                if not any(w[1] is loop for w in self._waiters):
                    self._unwatch(loop)

    def close(self, *, flush: bool = True) -> None:
        """Let the child commit what it was sent and exit (after a flush, by default),
        then reap it; a child that has not exited within ``reply_timeout_s`` is killed.
        A failed flush still stops the child, then raises."""
        try:
            if flush:
                with self._lock:
                    usable = self._error is None and not self._closed
                if usable:
                    self.flush()
        finally:
            self._shut_down()

    # ------------------------------------------------------------------ pipes
    def _write(self, frame: bytes) -> None:
        """Hand ``frame`` to the command pipe, keeping what does not fit (lock held)."""
        if self._child_done:
            return  # the committer has failed, or the next look at the child says why
        if not self._out:
            try:
                n = os.write(self._w, frame)
            except BlockingIOError:
                n = 0
            except OSError:
                self._child_gone()
                return
            if n == len(frame):
                return
            frame = frame[n:]
        self._out += frame
        self._pump_out()
        if self._out:
            with contextlib.suppress(RuntimeError):  # no loop here: a later call pumps
                self._want_writable(asyncio.get_running_loop())

    def _pump_out(self) -> None:
        """Write as much of the kept bytes as the pipe takes now (lock held)."""
        while self._out and not self._child_done:
            try:
                n = os.write(self._w, self._out)
            except BlockingIOError:
                return
            except OSError:
                self._child_gone()
                return
            del self._out[:n]

    def _request_flush(self, target: int) -> None:
        """Ask the child to commit up to ``target`` without waiting out its window."""
        if target <= max(self._flush_sent, self._durable) or self._child_done:
            return
        try:
            os.write(self._control, _FLUSH.pack(target))
        except BlockingIOError:
            return  # thousands of requests unread: the child is not asleep
        except OSError:
            self._child_gone()
            return
        self._flush_sent = target

    def _poll(self, *, force: bool = True) -> None:
        """Read and apply whatever the child has said; check its deadlines (lock held).

        ``force=False`` skips the read if the last one was under 5 ms ago (``submit`` and
        ``durable_seq`` run once per command: a read per command would cost a system
        call each)."""
        now = time.monotonic()
        if not force and now - self._polled_at < _POLL_INTERVAL_S:
            return
        self._polled_at = now
        if self._out:
            self._pump_out()
        ended = False
        if not self._child_done:
            try:
                ended = not _read_into(self._r, self._in, 1 << 30)
            except OSError:
                ended = True
        if self._in:
            try:
                messages = _parse_frames(self._in)
            except Exception as exc:  # a garbled answer: nothing it says can be trusted
                self._in.clear()
                self._hung(f"sent an answer that cannot be read ({exc!r})")
                messages = []
            for message in messages:
                self._apply(message)
        if ended:
            self._child_gone()
        elif self._error is None and not self._child_done:
            self._check_deadlines(now)
        if self._waiters:
            self._wake_waiters()

    def _apply(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "durable":
            _, last, seconds = message
            self._durable = max(self._durable, last)
            self._last_progress = time.monotonic()
            record_commit_seconds(self._commit_seconds, seconds)
        elif kind == "ready":
            self._ready = True
            self._last_progress = time.monotonic()
        elif kind == "error":
            err = message[1]
            self._fail(err if isinstance(err, StoreError) else StoreError(repr(err)))
        # "closed": the child is done; the end of its pipe follows.

    def _child_gone(self) -> None:
        """The child's pipes ended: expected after close, else it died (lock held)."""
        if self._child_done:
            return
        self._child_done = True
        outstanding = self._durable < self._next_seq - 1
        if self._error is None and (outstanding or not self._closed):
            proc = self._proc
            code = None
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(timeout=2)  # its pipe closed as it exited: reap it
            when = f"before offset {self._next_seq - 1} was durable" if outstanding else "idle"
            self._fail(
                WriterProcessError(
                    f"the writer process of {self._where} died {when} (exit code {code}); "
                    "see its error output above"
                )
            )
        self._kill()

    def _check_deadlines(self, now: float) -> None:
        if not self._ready and now - self._started > self.start_timeout_s:
            self._hung(f"did not open the database within {self.start_timeout_s:g}s")
        elif (
            self._ready
            and self._durable < self._next_seq - 1
            and now - self._last_progress > self.reply_timeout_s
        ):
            self._hung(f"did not answer within {self.reply_timeout_s:g}s")

    def _hung(self, what: str) -> None:
        """Kill a child that broke its protocol (silent past a deadline, garbled)."""
        self._fail(
            WriterProcessError(
                f"the writer process of {self._where} {what} while appending; it was killed"
            )
        )
        self._kill()

    def _seconds_to_deadline(self) -> float:
        limit = self.reply_timeout_s if self._ready else self.start_timeout_s
        since = self._last_progress if self._ready else self._started
        return max(0.0, since + limit - time.monotonic()) + 0.01

    # ------------------------------------------------------------------ event loops
    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop not in self._reading and not self._child_done:
            loop.add_reader(self._r, self._on_readable, loop)
            self._reading.add(loop)
        if self._out:
            self._want_writable(loop)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop in self._reading:
            self._reading.discard(loop)
            _on_loop(loop, loop.remove_reader, self._r)

    def _want_writable(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop not in self._writing and not loop.is_closed() and not self._child_done:
            loop.add_writer(self._w, self._on_writable, loop)
            self._writing.add(loop)

    def _on_writable(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._pump_out()
            if not self._out or self._child_done:
                self._writing.discard(loop)
                loop.remove_writer(self._w)

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._poll()
            if self._child_done:
                self._unwatch(loop)  # an ended pipe stays readable: stop being called

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """While an aflush waits: check the child's deadlines once a second."""
        with self._lock:
            self._poll()
            if any(w[1] is loop for w in self._waiters):
                loop.call_later(1.0, self._tick, loop)

    def _wake_waiters(self) -> None:
        """Resolve the waiters whose offset is durable; reject them all after a failure."""
        if self._error is not None:
            ready, self._waiters = self._waiters, []
        else:
            ready = [w for w in self._waiters if w[0] <= self._durable]
            if not ready:
                return
            self._waiters = [w for w in self._waiters if w[0] > self._durable]
        value: int | BaseException = self._durable if self._error is None else self._closed_error()
        for _, loop, fut in ready:
            _hand_over(loop, fut, value)

    # ------------------------------------------------------------------ failure
    def _fail(self, exc: StoreError) -> None:
        if self._error is None:
            self._error = exc
        if self._waiters:
            self._wake_waiters()

    def _closed_error(self) -> GroupCommitClosedError:
        err = GroupCommitClosedError(f"appending to run {self.run_id!r} failed: {self._error}")
        err.__cause__ = self._error
        return err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._closed_error()

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            err = GroupCommitClosedError(
                f"appending to run {self.run_id!r} failed earlier: {self._error}"
            )
            raise err from self._error
        if self._closed:
            raise GroupCommitClosedError(f"the committer of run {self.run_id!r} is closed")

    # ------------------------------------------------------------------ shutdown
    def _shut_down(self) -> None:
        """Hand over what is kept, close the command pipe, wait for the child to end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # A child waiting out its commit window watches only the control pipe.
            self._request_flush(self._next_seq - 1)
        deadline = time.monotonic() + self.reply_timeout_s
        while True:
            with self._lock:
                self._pump_out()
                if not self._out or self._child_done:
                    break
            if time.monotonic() >= deadline:
                break
            with contextlib.suppress(OSError, ValueError):
                select.select([], [self._w], [], 0.5)
        proc = self._proc
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # end of file: the child commits what it has and exits
        while time.monotonic() < deadline:
            with self._lock:
                self._poll()
                if self._child_done:
                    break
            with contextlib.suppress(OSError, ValueError):
                select.select([self._r], [], [], 0.5)
        with self._lock:
            if self._error is None and self._durable < self._next_seq - 1:
                self._error = WriterProcessError(
                    f"the writer process of {self._where} stopped before offset "
                    f"{self._next_seq - 1} was durable"
                )
            self._wake_waiters()
            self._kill()

    def _kill(self) -> None:
        """Kill the child's process group (idempotent), reap it, close the pipes."""
        self._child_done = True
        for loop in list(self._reading):
            self._unwatch(loop)
        for loop in list(self._writing):
            self._writing.discard(loop)
            _on_loop(loop, loop.remove_writer, self._w)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        control, self._control = self._control, -1
        if control >= 0:
            with contextlib.suppress(OSError):
                os.close(control)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Call ``fn(*args)`` (a selector change) on ``loop``'s thread: now when that is this
    thread or the loop is not running, else as a callback; never on a closed loop."""
    if loop.is_closed():
        return
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here or not loop.is_running():
        with contextlib.suppress(Exception):  # the pipe may be closed already
            fn(*args)
    else:
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(fn, *args)


def _hand_over(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[int], value: Any) -> None:
    """Resolve (or reject, for an exception) ``fut`` on its own loop, from any thread.

    A loop that has closed has no one left awaiting (an ``aflush`` whose ``asyncio.run``
    ended): its waiter is dropped."""

    def settle() -> None:
        if fut.done():
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        settle()
    elif not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(settle)


def _writable_url(store: EventStoreProtocol) -> str:
    """The URL a child can open ``store``'s database at, or a StoreError saying why not."""
    from .store import EventStore

    if not isinstance(store, EventStore):
        raise StoreError(
            f"a writer process needs a database another process can open, not {store!r}: "
            "use writer='thread' with an in-memory store"
        )
    if store.readonly:
        raise StoreError("a writer process cannot append to a store opened read-only")
    # (EventStore refuses in-memory SQLite URLs: every store URL names a file or server.)
    return store.url.render_as_string(hide_password=False)


def _safe_url(url: str) -> str:
    """The URL without its password (it may be a PostgreSQL URL with credentials)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "the database"


# ---------------------------------------------------------------- child side
class _Child:
    """The child's side: bytes of commands not yet committed, flush requests, its pipes.

    Commands stay raw bytes until a batch takes them (``take_batch``), so a backlog
    costs a bytearray, not millions of objects for the garbage collector to walk.
    """

    def __init__(
        self, commands: int, control: int, answers: int, buffer_limit: int = _CHILD_BUFFER
    ) -> None:
        self.commands = commands
        self.control = control
        self.answers = answers
        self.buf = bytearray()
        #: Most unparsed bytes held (always enough for the next whole frame).
        self.buffer_limit = buffer_limit
        #: A command read but left out of the last batch (it would have overfilled it).
        self.carry: tuple[list[NewEvent], list[PayloadPut]] | None = None
        self.pending_since: float | None = None  # when the oldest uncommitted bytes came
        self.flush_upto = 0  # highest offset a flush waits for
        self.eof = False  # the command pipe ended: commit what is left and exit
        self.failed = False

    def send(self, message: tuple[Any, ...]) -> None:
        frame = _pickle_frame(message) if message[0] == "error" else _frame(message)
        view = memoryview(frame)
        while view:
            view = view[os.write(self.answers, view) :]

    def wait(self, timeout: float, *, commands: bool) -> bool:
        """Sleep until a flush request (or, with ``commands``, a command) arrives or
        ``timeout`` passes; then read all there is. False if nothing was ready."""
        watched = [self.control, self.commands] if commands and not self.eof else [self.control]
        ready = bool(select.select(watched, [], [], timeout)[0])
        self.read()
        return ready

    def read(self) -> None:
        """Take every flush request and the command bytes the pipes hold now."""
        requests = bytearray()
        if not _read_into(self.control, requests, 1 << 20):
            self.eof = True  # the parent is gone with its end of the control pipe
        for (target,) in _FLUSH.iter_unpack(requests[: len(requests) // 8 * 8]):
            self.flush_upto = max(self.flush_upto, target)
        # Hold at most buffer_limit bytes, but always enough for the next whole frame.
        limit = self.buffer_limit
        if len(self.buf) >= _HEADER.size:
            limit = max(limit, _HEADER.size + _HEADER.unpack_from(self.buf)[0])
        held = len(self.buf)
        if not self.eof and not _read_into(self.commands, self.buf, limit):
            self.eof = True
        if self.failed:
            _parse_frames(self.buf)  # after a failed append nothing may follow it
        elif len(self.buf) > held and self.pending_since is None:
            self.pending_since = time.monotonic()

    def next_message(self) -> tuple[Any, ...] | None:
        """The first whole frame's message, removed from the buffer (None: none yet)."""
        end = _frame_end(self.buf)
        if not end:
            return None
        body = bytes(self.buf[_HEADER.size + 1 : end])
        message = marshal.loads(body) if self.buf[_HEADER.size] == ord("m") else pickle.loads(body)
        del self.buf[:end]
        return message  # type: ignore[no-any-return]

    def pending(self) -> bool:
        """Whether a whole command waits to be committed."""
        return self.carry is not None or _frame_end(self.buf) > 0

    def due(self, next_seq: int, window_s: float) -> bool:
        """Whether the waiting commands commit now rather than wait for more."""
        return (
            self.flush_upto >= next_seq  # a flush waits (or the parent saw a full batch)
            or self.eof
            or self.carry is not None  # the last batch was full: more is waiting
            or self.pending_since is None
            or time.monotonic() >= self.pending_since + window_s
        )

    def until_due(self, window_s: float) -> float:
        since = time.monotonic() if self.pending_since is None else self.pending_since
        return max(0.0, since + window_s - time.monotonic())

    def take_batch(self, max_batch: int) -> tuple[list[NewEvent], list[PayloadPut]]:
        """Whole commands from the front, up to ``max_batch`` events (at least one)."""
        batch: list[NewEvent] = []
        puts: list[PayloadPut] = []
        while True:
            unit = self.carry
            self.carry = None
            if unit is None:
                message = self.next_message()
                if message is None:
                    break
                kind, rows, unit_puts = message
                unit = (_unit_events(kind, rows), [PayloadPut(*p) for p in unit_puts])
            if batch and len(batch) + len(unit[0]) > max_batch:
                self.carry = unit  # cut between commands, never inside one
                break
            batch += unit[0]
            puts += unit[1]
        self.pending_since = time.monotonic() if self.pending() else None
        return batch, puts

    def fail(self) -> None:
        """After a failed append: drop what is waiting, and everything that follows."""
        self.failed = True
        self.carry = None
        _parse_frames(self.buf)
        self.pending_since = None


def _storable(exc: BaseException) -> StoreError:
    """``exc`` as a StoreError that survives pickling with its type and fields."""
    err = exc if isinstance(exc, StoreError) else StoreError(repr(exc))
    try:
        pickle.dumps(err)
    except Exception:
        err = StoreError(str(err))
    return err


def _serve(commands: int, control: int, answers: int) -> None:
    """The child's loop: read commands as they come, commit them in batches, answer."""
    from .store import EventStore

    for fd in (commands, control):
        os.set_blocking(fd, False)
    child = _Child(commands, control, answers)
    opening: tuple[Any, ...] | None = None
    while opening is None:
        child.wait(60.0, commands=True)
        message = child.next_message()
        if message is not None:
            opening = tuple(message[1:])
        elif child.eof:
            return
    parent, url, run_id, epoch, next_seq, indexers, max_batch, window_s, lock_timeout_s = opening
    try:
        # The parent opened (and checked the schema of) this database already.
        store = EventStore.open(url, create=False, check_schema=False)
        for indexer in indexers:
            store.add_indexer(indexer)
    except Exception as exc:
        with contextlib.suppress(BrokenPipeError):
            child.send(("error", _storable(exc)))
        return
    # What is alive now (modules, the engine) lives as long as this process: keep it out
    # of the collector's walks, which then see only a batch's worth of objects.
    gc.freeze()
    try:
        child.send(("ready", os.getpid()))
        while True:
            if child.failed or not child.pending():
                if child.eof:
                    break
                if not child.wait(1.0, commands=True) and os.getppid() != parent:
                    child.eof = True  # the parent is gone (someone else holds its pipe)
                continue
            if not child.due(next_seq, window_s):
                # Sleep on the control pipe only: a command written meanwhile does not
                # wake this process (which would cost the writer a wake-up per command).
                child.wait(child.until_due(window_s), commands=False)
                continue
            child.read()  # everything that has arrived joins this transaction
            batch, puts = child.take_batch(max_batch)
            started = time.perf_counter()
            try:
                last = store.append(
                    run_id,
                    batch,
                    expected_seq=next_seq,
                    epoch=epoch,
                    payload_puts=puts,
                    lock_timeout_s=lock_timeout_s,
                )
            except Exception as exc:
                child.fail()
                child.send(("error", _storable(exc)))
                continue
            next_seq = last + 1
            child.send(("durable", last, time.perf_counter() - started))
        child.send(("closed",))
    except BrokenPipeError:
        pass  # the parent is gone: nobody to answer
    finally:
        store.close()


def main() -> None:
    """The child's entry point: ``python -m rolloutlog.eventstore.writer_process FD``."""
    # Frames only on stdout: anything else a library prints goes to stderr instead.
    answers = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.fileno(), int(sys.argv[1]), answers)


if __name__ == "__main__":
    main()
