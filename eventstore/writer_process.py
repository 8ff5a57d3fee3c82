"""A writer process: appends run in a child process, off this process's GIL.

On a 2-core machine the group committer's thread spent its append (building rows,
binding parameters, SQLite's B-tree work) competing with the event loop and a trainer
in the same process for the GIL: durable commits cost the loop ~20-30% of its speed,
though fsync itself is cheap. :class:`WriterProcess` moves the whole append into a child
Python process with its own connection to the same database; the parent only pickles
the batch and waits on a pipe (both release the GIL while blocked).

The child is started with ``python -m`` in its own session (process group), so it never
re-runs the parent's main module and a test can kill it whole; it exits when its pipe
closes, so it never outlives the parent. Every wait has a deadline: the start
(``start_timeout_s``) and each append's reply (``reply_timeout_s``, plus the append's
lock timeout). A child that dies or stops answering fails the append with
:class:`WriterProcessError` and is killed; the committer then accepts nothing more, as
after any failed append. Errors raised by the child's store arrive with their type
(:class:`AppendConflictError`, :class:`EpochFencedError`, ...) and attributes.

Frames on both pipes are a little-endian u64 length followed by a pickle.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from .errors import StoreError, WriterProcessError
from .indexing import Indexer
from .records import NewEvent, PayloadPut

_HEADER = struct.Struct("<Q")


# ---------------------------------------------------------------- framing
def _send(pipe: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; EOFError at end of file, TimeoutError past ``deadline``."""
    chunks: list[bytes] = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


# ---------------------------------------------------------------- parent side
class WriterProcess:
    """Appends to the database at ``url`` from a child process (see the module docstring).

    ``indexers`` are registered in the child's store, so derived rows are written in the
    same transaction as their events, exactly as :meth:`EventStore.append` does; they
    must be picklable (module-level classes).
    """

    def __init__(
        self,
        url: str,
        indexers: Sequence[Indexer] = (),
        *,
        start_timeout_s: float = 60.0,
        reply_timeout_s: float = 120.0,
    ) -> None:
        if start_timeout_s <= 0 or reply_timeout_s <= 0:
            raise ValueError("start_timeout_s and reply_timeout_s must be > 0")
        self.url = url
        self.reply_timeout_s = reply_timeout_s
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: killed whole, never orphaned
        )
        try:
            self._call(("open", url, list(indexers)), timeout=start_timeout_s, doing="starting")
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int | None:
        """The child's process id (None once it is gone)."""
        return None if self._proc is None else self._proc.pid

    def append(
        self,
        run_id: str,
        batch: Sequence[NewEvent],
        *,
        expected_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut] = (),
        lock_timeout_s: float | None = None,
    ) -> int:
        """:meth:`EventStore.append`, run by the child; its errors re-raised here."""
        timeout = self.reply_timeout_s + (lock_timeout_s or 0.0)
        message = ("append", run_id, list(batch), expected_seq, epoch, list(payload_puts))
        result: int = self._call((*message, lock_timeout_s), timeout=timeout, doing="appending")
        return result

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to close its store and exit; kill it past ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                self._call(("close",), timeout=timeout_s, doing="closing")
                proc.wait(timeout=timeout_s)
        except (StoreError, subprocess.TimeoutExpired):
            pass  # killed below: closing must not hang or fail the caller's shutdown
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill the child's process group now (idempotent) and reap it."""
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

    def _call(self, message: tuple[Any, ...], *, timeout: float, doing: str) -> Any:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise WriterProcessError(f"the writer process of {self._where()} is closed")
        try:
            _send(proc.stdin, message)
            reply = _receive(proc.stdout.fileno(), time.monotonic() + timeout)
        except TimeoutError:
            self.kill()
            raise WriterProcessError(
                f"the writer process of {self._where()} did not answer within {timeout:g}s "
                f"while {doing}; it was killed"
            ) from None
        except (EOFError, BrokenPipeError, OSError) as exc:
            code = proc.poll()
            self.kill()
            raise WriterProcessError(
                f"the writer process of {self._where()} died while {doing} "
                f"(exit code {code}); see its error output above"
            ) from exc
        status, value = reply
        if status == "error":
            raise value
        return value

    def _where(self) -> str:
        # The URL without its password (it may be a PostgreSQL URL with credentials).
        from sqlalchemy.engine import make_url

        try:
            return make_url(self.url).render_as_string(hide_password=True)
        except Exception:
            return "the database"

    def __enter__(self) -> WriterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- child side
def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The child's loop: one reply per request, until ``close`` or the pipe closes."""
    from .store import EventStore

    store: EventStore | None = None
    try:
        while True:
            try:
                request = _receive(inp.fileno(), None)
            except EOFError:
                return  # the parent is gone: nothing may outlive it
            kind = request[0]
            try:
                if kind == "open":
                    _, url, indexers = request
                    store = EventStore.open(url, create=False)
                    for indexer in indexers:
                        store.add_indexer(indexer)
                    reply: Any = ("ok", os.getpid())
                elif kind == "append":
                    if store is None:
                        raise WriterProcessError("append before open")
                    _, run_id, batch, expected_seq, epoch, puts, lock_timeout_s = request
                    last = store.append(
                        run_id,
                        batch,
                        expected_seq=expected_seq,
                        epoch=epoch,
                        payload_puts=puts,
                        lock_timeout_s=lock_timeout_s,
                    )
                    reply = ("ok", last)
                elif kind == "close":
                    _send(out, ("ok", None))
                    return
                else:
                    raise WriterProcessError(f"unknown request {kind!r}")
            except Exception as exc:
                err = exc if isinstance(exc, StoreError) else StoreError(repr(exc))
                try:
                    pickle.dumps(err)
                except Exception:
                    err = StoreError(str(err))
                reply = ("error", err)
            _send(out, reply)
    finally:
        if store is not None:
            store.close()


if __name__ == "__main__":
    # Frames only on stdout: anything else a library prints goes to stderr instead.
    _out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, _out)
