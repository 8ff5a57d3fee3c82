"""SQLite: the connection that a store's appends use, driven without SQLAlchemy.

An append is one transaction of a few statements, and SQLAlchemy's per-statement and
per-transaction overhead was a visible share of it (docs/benchmarks.md). So appends use
one connection of their own, opened by the store's engine (same pragmas) and then taken
out of its pool; every other write still goes through SQLAlchemy. The rules SQLAlchemy
kept, kept here:

- **One thread at a time**: a lock, waited for at most ``busy_timeout_ms``, then
  :class:`StoreUnavailableError`.
- **Errors as SQLAlchemy words them**: driver errors are wrapped by
  ``DBAPIError.instance``, so the store translates them as on every other path.
- **Nothing half done stays**: a failure rolls back; after a driver error or an
  interrupt the connection is closed and the next append opens a fresh one.
- **Not across a fork**: a connection opened by another process is dropped, never used.
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
