"""SQLite: the connection that a store's appends use, driven without SQLAlchemy.

An append is one transaction of five to seven statements: ``BEGIN IMMEDIATE``, the
compare-and-set, the events, one statement per indexer, ``COMMIT``. Through SQLAlchemy,
each statement costs 10-15 us of Python (execution context, event dispatch, result
object), and each transaction another 40-50 us (pool checkout, the ``begin`` event,
commit, the reset on return). That was about 9% of a 1,000-event typed append
(docs/benchmarks.md). So a store's appends go through one connection of their own. The
store's engine opens it, so it gets the same pragmas (WAL, ``synchronous``,
``busy_timeout``); then it leaves the engine's pool, and the store's statements run on
it directly. Every other write (creating a run, a new epoch, snapshots, compaction)
still goes through SQLAlchemy: those are not on the hot path.

The rules that SQLAlchemy kept for us, kept here:

- **One thread at a time.** A lock guards the connection. A thread waits for it at most
  the store's ``busy_timeout_ms`` (the wait that SQLite's own lock would have given
  it), then gets :class:`StoreUnavailableError`.
- **Errors as SQLAlchemy words them.** A driver error is wrapped by
  ``DBAPIError.instance`` (the same class mapping: ``sqlite3.OperationalError`` becomes
  ``sqlalchemy.exc.OperationalError``...), so the store turns it into its own error
  hierarchy exactly as on every other path.
- **Nothing half done stays.** Any failure inside the transaction rolls it back. After
  a driver error or an interrupt (anything not an ``Exception``), the connection is also
  closed, and the next append opens a fresh one. A refusal (a conflict, a fenced epoch)
  or a bad row found in Python keeps it.
- **Not across a fork.** A connection opened by another process is dropped, never used
  or closed: SQLite allows neither in a child process.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from .errors import StoreUnavailableError

#: Runs one statement on the writer's connection and returns its cursor.
Execute = Callable[[str, Sequence[Any]], Any]
#: How much of a statement's text a wrapped driver error keeps (a multi-row insert's
#: text runs to tens of kilobytes; the store's messages quote the driver's words).
_QUOTED_SQL = 120


class SqliteWriter:
    """The appends' own SQLite connection: one thread at a time, each append one
    transaction (see the module docstring)."""

    def __init__(self, engine: Engine, *, wait_s: float) -> None:
        self._engine = engine
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._close_when_idle = False
        #: Connections opened so far (one, unless failures or ``close`` dropped some).
        self.connections_opened = 0

    @contextlib.contextmanager
    def transaction(self, doing: str) -> Iterator[Execute]:
        """``BEGIN IMMEDIATE`` on the writer's connection; yield a function that runs a
        statement; ``COMMIT`` when the block ends, ``ROLLBACK`` when it raises."""
        if not self._lock.acquire(timeout=self._wait_s):
            raise StoreUnavailableError(
                f"waited {self._wait_s:g} s (busy_timeout_ms) for this store's writer "
                f"connection while {doing}: another thread's append held it all that time"
            )
        try:
            db = self._connection()
            execute = self._executor(db)
            execute("BEGIN IMMEDIATE", ())
            try:
                yield execute
                execute("COMMIT", ())
            except BaseException as exc:
                self._after_failure(db, exc)
                raise
        finally:
            if self._close_when_idle:
                self._drop()
            self._lock.release()

    def close(self) -> None:
        """Close the connection now, or when the append using it ends."""
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()
        else:
            self._close_when_idle = True

    def _connection(self) -> sqlite3.Connection:
        if self._db is not None and self._pid != os.getpid():
            self._db = None  # the parent's (a fork): neither used nor closed here
        if self._db is None:
            proxied = self._engine.raw_connection()
            proxied.detach()  # out of the pool: this writer alone uses and closes it
            db = proxied.dbapi_connection
            if not isinstance(db, sqlite3.Connection):  # pragma: no cover - engine misuse
                raise TypeError(f"a SQLite writer needs a sqlite3 connection, not {db!r}")
            self._db, self._pid = db, os.getpid()
            self.connections_opened += 1
        return self._db

    def _executor(self, db: sqlite3.Connection) -> Execute:
        run = db.execute
        dialect = self._engine.dialect

        def execute(sql: str, params: Sequence[Any]) -> Any:
            try:
                return run(sql, params)
            except sqlite3.Error as exc:
                raise DBAPIError.instance(
                    sql[:_QUOTED_SQL],
                    None,
                    exc,
                    sqlite3.Error,
                    # sqlite3's own error and connection: SQLAlchemy's stubs type them
                    # as its DBAPI protocols, which the stdlib classes do not declare.
                    connection_invalidated=dialect.is_disconnect(exc, db, None),  # type: ignore[arg-type]
                    dialect=dialect,
                ) from exc

        return execute

    def _after_failure(self, db: sqlite3.Connection, exc: BaseException) -> None:
        """Roll back; close the connection unless the failure was the caller's own
        (a refusal, a bad row found before SQLite saw it)."""
        keep = isinstance(exc, Exception) and not isinstance(exc, (sqlite3.Error, DBAPIError))
        try:
            if db.in_transaction:
                db.execute("ROLLBACK")
        except sqlite3.Error:
            keep = False
        if not keep:
            self._drop()

    def _drop(self) -> None:
        db, self._db = self._db, None
        self._close_when_idle = False
        if db is not None and self._pid == os.getpid():
            with contextlib.suppress(sqlite3.Error):
                db.close()
