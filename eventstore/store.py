"""The append-only event log on SQLite (embedded default) or PostgreSQL.

Ordering and fencing come from one compare-and-set per batch on the ``runs`` row:
``UPDATE runs SET last_seq = new WHERE run_id = r AND last_seq = expected - 1 AND
current_epoch = epoch``. Zero rows updated means a conflict or a fenced writer, and the
transaction is rolled back, so no partial batch is ever written. On PostgreSQL that row
lock also serialises writers of one run, so commits happen in sequence order and a
reader paging by sequence never skips an event.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from itertools import chain
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.url import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError

from . import schema_head
from .bulk import MultiRowInsert
from .driver_errors import DriverFault, driver_fault
from .errors import (
    AppendConflictError,
    CorruptLogError,
    EpochFencedError,
    LockTimeoutError,
    PayloadNotFoundError,
    ReadOnlyStoreError,
    RunExistsError,
    RunNotFoundError,
    StoreError,
    StoreUnavailableError,
    StoreUrlError,
)
from .history import history_segments, read_history
from .indexing import Indexer, check_indexer
from .pg_append import (
    REFUSED_SQLSTATE,
    DerivedTable,
    PgAppendStatement,
    pg_chunk_events,
    pg_connect_url,
)
from .records import NewEvent, PayloadPut, RunInfo, Snapshot, StoredEvent
from .schema import compactions, epochs, events, payloads, runs, snapshots
from .sqlite_writer import Execute, SqliteWriter
from .url_options import whole_number_option

#: SQLite ``synchronous`` levels accepted in the URL query (``?synchronous=NORMAL``).
SQLITE_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: Default: FULL. In WAL mode FULL syncs the WAL at every commit, so an acknowledged
#: ``flush()`` survives power loss, not only a process kill. Group commit amortises the
#: fsync over a batch, which is why the default can afford it. NORMAL is faster and is
#: still safe against process crashes; it may lose the last commits on power loss.
DEFAULT_SQLITE_SYNCHRONOUS = "FULL"
DEFAULT_BUSY_TIMEOUT_MS = 30_000

_COLS = "run_id, seq, epoch, type, schema_version, recorded_at, payload"
# Read in the field order of StoredEvent, so a page's tuples unpack straight into it.
#: StoredEvent's fields after ``run_id`` (which :meth:`EventStore.read` already holds: not
#: fetched, one string object less per row).
_READ_COLS = "seq, epoch, type, schema_version, payload, recorded_at"


def normalise_url(url: str | URL) -> URL:
    """Parse a database URL, defaulting PostgreSQL to the psycopg 3 driver.

    Raises :class:`StoreUrlError` for a malformed URL or an unsupported dialect.
    """
    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except ArgumentError as exc:
        raise StoreUrlError(
            f"malformed database URL {url!r}: expected sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST:PORT/DB"
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            parsed = parsed.set(drivername="postgresql+psycopg")
        pg_chunk_events(parsed)  # a bad value fails the open, naming it
    elif backend == "sqlite":
        if parsed.get_driver_name() != "pysqlite":
            parsed = parsed.set(drivername="sqlite")
        if not parsed.database or parsed.database == ":memory:":
            raise StoreUrlError(
                f"SQLite URL {url!s} names no file: rolloutlog needs a file (sqlite:///PATH) "
                "so the log outlives the process"
            )
    else:
        raise StoreUrlError(
            f"unsupported database {backend!r} in URL {url!s}: use sqlite:///PATH or "
            "postgresql+psycopg://..."
        )
    return parsed


def _iso(ts: datetime) -> str:
    # SQLAlchemy's SQLite DateTime storage format (UTC, no offset), so Core reads agree.
    if ts.tzinfo is UTC and ts.year >= 1000:
        # Hot path (events are stamped with datetime.now(UTC)): isoformat is ~3x faster
        # than strftime and yields the same "YYYY-MM-DD HH:MM:SS.ffffff" + "+00:00".
        return ts.isoformat(" ", "microseconds")[:26]
    return ts.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


#: Stamps whose second :func:`sqlite_event_values` may cache: :func:`_iso` writes them in
#: the fixed-width hot-path form, and the next second exists (9999-12-31 23:59:59 has none).
SECOND_CACHE_YEARS = range(1000, 9999)
_SECOND = timedelta(seconds=1)
_NO_SECOND = datetime.min.replace(tzinfo=UTC)


def sqlite_event_values(batch: Sequence[NewEvent], expected_seq: int) -> list[Any]:
    """The per-row values of ``batch``'s ``events`` rows (offsets ``expected_seq ..``), row
    after row, in the order of :func:`events_insert`'s per-row columns (seq, type, schema
    version, recorded_at, payload; the run id and epoch are bound once), timestamps as
    SQLite stores them (:func:`_iso`).

    The append hot path: columns are laid in by slice assignment; a timestamp is formatted
    once per distinct object, its seconds part once per distinct second (a stamp is in the
    cached second when it compares within ``[low, high)``).
    """
    n = len(batch)
    out: list[Any] = [None] * (5 * n)
    if not n:
        return out
    types, versions, payloads, stamps, _derived = zip(*batch, strict=True)
    out[0::5] = range(expected_seq, expected_seq + n)
    out[1::5] = types
    out[2::5] = versions
    out[4::5] = payloads
    texts: list[str] = []
    append = texts.append
    last: datetime | None = None
    text = ""
    # [low, high): the stamps that `pattern` (a second's text) is right for; none yet.
    low = high = _NO_SECOND
    pattern = ""
    for stamp in stamps:
        if stamp is not last:
            last = stamp
            if stamp.tzinfo is not UTC:
                text = _iso(stamp)
            elif low <= stamp < high:
                text = pattern % stamp.microsecond
            elif stamp.year not in SECOND_CACHE_YEARS:
                text = _iso(stamp)
            else:
                low = stamp.replace(microsecond=0)
                high = low + _SECOND
                pattern = _iso(stamp)[:19] + ".%06d"
                text = pattern % stamp.microsecond
        append(text)
    out[3::5] = texts
    return out


def events_insert() -> MultiRowInsert:
    """SQLite's multi-row insert of ``events`` rows: the run id and epoch once."""
    return MultiRowInsert("events", _COLS.split(", "), shared=("run_id", "epoch"))


def derived_insert(table: str, columns: Sequence[str]) -> MultiRowInsert:
    """SQLite's multi-row insert of an indexer's rows: the run id (first) once."""
    return MultiRowInsert(table, columns, shared=(columns[0],))


def derived_values(table: str, run_id: str, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The per-row values of an indexer's ``rows`` for :func:`derived_insert` (their first
    column, the run id, dropped: each row must name ``run_id``)."""
    flat = list(chain.from_iterable(rows))
    width = len(rows[0]) if rows else 1
    if flat[::width].count(run_id) != len(rows) or len(flat) != width * len(rows):
        raise StoreError(
            f"indexer rows for {table!r} must all be {width} values starting with the "
            f"appended run id {run_id!r}"
        )
    del flat[::width]
    return flat


def _parse_ts(value: Any) -> datetime:
    if isinstance(value, str):
        try:
            # Hot path for what _iso writes: parsing with the offset attached is ~8x
            # faster than parsing and then replace(tzinfo=UTC), and gives the same value.
            return datetime.fromisoformat(value + "+00:00")
        except ValueError:
            return datetime.fromisoformat(value).replace(tzinfo=UTC)
    if isinstance(value, datetime):
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


class EventStore:
    """An append-only, per-run sequenced event log.

    Open with :meth:`open`. All methods are synchronous and thread-safe (each call takes a
    pooled connection); the asyncio controller reaches the disk through
    :class:`rolloutlog.eventstore.groupcommit.Committer`, which runs appends on its own thread
    or in a writer process.
    """

    def __init__(self, engine: Engine, url: URL, *, readonly: bool = False) -> None:
        self.engine = engine
        self.url = url
        self.readonly = readonly
        self.dialect: str = url.get_backend_name()
        self._is_sqlite = self.dialect == "sqlite"
        # The driver's base exception class (sqlite3.Error, psycopg.Error).
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        # Write transactions carry this option; on SQLite it selects BEGIN IMMEDIATE.
        self._writer = engine.execution_options(rolloutlog_write=True)
        mark = "?" if self._is_sqlite else "%s"
        marks = ", ".join([mark] * 7)
        self._insert_sql = f"INSERT INTO events ({_COLS}) VALUES ({marks})"
        # SQLite: a batch's rows go in a few multi-row INSERTs (see bulk.py).
        self._events_bulk = events_insert()
        self._payloads_bulk = MultiRowInsert(
            "payloads", ("run_id", "payload_id", "kind", "data"), suffix="ON CONFLICT DO NOTHING"
        )
        # Indexers whose derived rows each append writes (see add_indexer), with the
        # INSERT statement of each (SQLite: its multi-row builder).
        self._indexers: list[tuple[Indexer, str]] = []
        self._indexers_bulk: dict[str, MultiRowInsert] = {}
        # PostgreSQL: the one-statement append (pg_append.py), its engine and the column
        # types of the derived tables it writes.
        self._pg_append = PgAppendStatement()
        self._pg_append_engine: Engine | None = None
        self._pg_chunk = 0 if self._is_sqlite else pg_chunk_events(url)
        self._derived_types: dict[str, DerivedTable] = {}
        # SQLite: the connection appends use, without SQLAlchemy (sqlite_writer.py).
        self._sqlite_writer = (
            SqliteWriter(engine, wait_s=sqlite_busy_timeout_ms(url) / 1000)
            if self._is_sqlite
            else None
        )
        self._cas_sql = (
            f"UPDATE runs SET last_seq = {mark} "
            f"WHERE run_id = {mark} AND last_seq = {mark} AND current_epoch = {mark}"
        )
        # The run's epoch and newest offset: what a refused append reports.
        self._run_position_sql = f"SELECT current_epoch, last_seq FROM runs WHERE run_id = {mark}"
        self._read_sql = (
            f"SELECT {_READ_COLS} FROM events WHERE run_id = {mark} AND seq >= {mark} "
            f"AND seq <= {mark} ORDER BY seq LIMIT {mark}"
        )
        # ON CONFLICT DO NOTHING (SQLite >= 3.24) on both: only an existing id is skipped.
        # SQLite's INSERT OR IGNORE would also silently drop a row violating NOT NULL.
        self._payload_sql = (
            "INSERT INTO payloads (run_id, payload_id, kind, data) "
            f"VALUES ({mark}, {mark}, {mark}, {mark}) ON CONFLICT DO NOTHING"
        )

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        url: str | URL,
        *,
        create: bool = True,
        readonly: bool = False,
        check_schema: bool = True,
    ) -> EventStore:
        """Open the log at ``url``.

        ``create``: an empty database gets the schema (alembic upgrade to head).
        ``check_schema``: a database at another migration head is refused with
        :class:`SchemaMismatchError`, which names the command that fixes it.
        ``readonly``: open without write access (SQLite opens the file read-only).
        """
        parsed = normalise_url(url)
        engine = _make_engine(parsed, readonly=readonly)
        store = cls(engine, parsed, readonly=readonly)
        try:
            with store._translate_errors("opening the database"):
                with engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
                    # An existing log at head (the usual open) is checked without
                    # importing alembic into the host process (see schema_head).
                    current = check_schema and schema_head.at_head(conn)
            if check_schema and not current:
                from . import migrate  # alembic: imported only where a schema is checked

                if create and not readonly:
                    with store._translate_errors("creating the schema"):
                        migrate.ensure_schema(engine)
                else:
                    with store._translate_errors("checking the schema"):
                        migrate.check(engine)
        except BaseException:
            engine.dispose()
            raise
        return store

    def close(self) -> None:
        """Release every pooled connection (and the appends' own, on SQLite)."""
        if self._sqlite_writer is not None:
            self._sqlite_writer.close()
        self.engine.dispose()
        if self._pg_append_engine is not None:
            self._pg_append_engine.dispose()

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ runs
    def create_run(
        self,
        run_id: str,
        *,
        config_fingerprint: str = "",
        config_json: str = "{}",
        epoch: int = 1,
        first_events: Sequence[NewEvent] = (),
        payload_puts: Sequence[PayloadPut] = (),
    ) -> RunInfo:
        """Register a new run at ``epoch``. An existing id raises :class:`RunExistsError`.

        ``first_events`` (offsets ``1..``) and ``payload_puts`` are written in the same
        transaction as the run's row: a crash leaves either no run or a run that has
        started, never a run without its first event.
        """
        if not run_id or len(run_id) > 128:
            raise StoreError(f"run id must be 1..128 characters, got {run_id!r}")
        if payload_puts and not first_events:
            raise StoreError("payloads must be written together with the events that use them")
        now = datetime.now(UTC)
        try:
            with (
                self._translate_errors(f"creating run {run_id!r}", keep_integrity=True),
                self._writer.begin() as conn,
            ):
                conn.execute(
                    runs.insert().values(
                        run_id=run_id,
                        created_at=now,
                        config_fingerprint=config_fingerprint,
                        config_json=config_json,
                        current_epoch=epoch,
                        last_seq=len(first_events),
                    )
                )
                conn.execute(
                    epochs.insert().values(
                        run_id=run_id, epoch=epoch, opened_at=now, resume_seq=0, first_seq=1
                    )
                )
                if self._is_sqlite:
                    execute = _sa_execute(conn)
                    self._write_rows(execute, run_id, first_events, 1, epoch, payload_puts)
                else:
                    self._insert_payloads_pg(conn, run_id, payload_puts)
                    self._insert_events_pg(conn, run_id, first_events, 1, epoch)
                    self._insert_derived_pg(conn, run_id, first_events)
        except IntegrityError as exc:
            raise RunExistsError(f"run {run_id!r} already exists") from exc
        return self.get_run(run_id)

    def get_run(self, run_id: str) -> RunInfo:
        """The run's row; :class:`RunNotFoundError` when absent."""
        with self._translate_errors(f"reading run {run_id!r}"), self.engine.connect() as conn:
            row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).first()
        if row is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.url.render_as_string()}")
        return RunInfo(
            run_id=row.run_id,
            created_at=_parse_ts(row.created_at),
            config_fingerprint=row.config_fingerprint,
            config_json=row.config_json,
            current_epoch=row.current_epoch,
            last_seq=row.last_seq,
        )

    def list_runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        with self._translate_errors("listing runs"), self.engine.connect() as conn:
            rows = conn.execute(sa.select(runs.c.run_id).order_by(runs.c.created_at)).all()
        return [self.get_run(r.run_id) for r in rows]

    def open_epoch(
        self,
        run_id: str,
        *,
        expected_epoch: int | None = None,
        resume_seq: int | None = None,
        lock_timeout_s: float | None = None,
    ) -> int:
        """Raise the run's epoch by one and return it; every writer of an older epoch is fenced.

        ``resume_seq`` (default: the newest event) is the offset the new epoch's history
        continues from: events after it written by older epochs stay in the log for audit
        and salvage but leave the history (see :meth:`history_segments`).
        With ``expected_epoch``, fail with :class:`EpochFencedError` if someone else already
        moved the epoch (two restores racing: exactly one wins).
        ``lock_timeout_s`` (PostgreSQL): wait at most this long for the run's row lock,
        which a hung writer may hold; then raise :class:`LockTimeoutError` naming the
        database session that holds it. None waits without limit.
        """
        doing = f"opening a new epoch of run {run_id!r}"
        with self._translate_errors(doing), self._lock_timeouts(run_id, doing, lock_timeout_s):
            with self._writer.begin() as conn:
                self._set_lock_timeout(conn, lock_timeout_s)
                row = conn.execute(
                    sa.select(runs.c.current_epoch, runs.c.last_seq)
                    .where(runs.c.run_id == run_id)
                    .with_for_update()
                ).first()
                if row is None:
                    raise RunNotFoundError(f"no run {run_id!r}")
                current: int = row.current_epoch
                last: int = row.last_seq
                if expected_epoch is not None and current != expected_epoch:
                    raise EpochFencedError(run_id, expected_epoch, current)
                resume = last if resume_seq is None else resume_seq
                if not 0 <= resume <= last:
                    raise StoreError(
                        f"cannot resume run {run_id!r} from offset {resume}: "
                        f"the log holds offsets 1..{last}"
                    )
                res = conn.execute(
                    runs.update()
                    .where(runs.c.run_id == run_id, runs.c.current_epoch == current)
                    .values(current_epoch=current + 1)
                )
                if res.rowcount != 1:
                    raise EpochFencedError(run_id, current, self.get_run(run_id).current_epoch)
                conn.execute(
                    epochs.insert().values(
                        run_id=run_id,
                        epoch=current + 1,
                        opened_at=datetime.now(UTC),
                        resume_seq=resume,
                        first_seq=last + 1,
                    )
                )
        return current + 1

    def history_segments(self, run_id: str, to_seq: int | None = None) -> list[tuple[int, int]]:
        """The run's history as inclusive ``(first, last)`` offset ranges, oldest first.

        Without ``to_seq``: the history of the current epoch, up to the newest event.
        With ``to_seq``: the history that led to offset ``to_seq`` (the prefix a restore
        to that offset replays). Ranges written by epochs that a restore abandoned are
        left out.
        """
        with self._translate_errors(f"reading the epochs of run {run_id!r}"):
            with self.engine.connect() as conn:
                rows = conn.execute(
                    sa.select(epochs.c.epoch, epochs.c.resume_seq, epochs.c.first_seq)
                    .where(epochs.c.run_id == run_id)
                    .order_by(epochs.c.epoch)
                ).all()
                last = conn.execute(
                    sa.select(runs.c.last_seq).where(runs.c.run_id == run_id)
                ).scalar_one_or_none()
        if last is None:
            raise RunNotFoundError(f"no run {run_id!r}")
        return history_segments(run_id, [(r.first_seq, r.resume_seq) for r in rows], last, to_seq)

    def read_history(
        self, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
    ) -> Iterator[StoredEvent]:
        """Stream the history (see :meth:`history_segments`) from ``from_seq`` on, in order."""
        return read_history(self, run_id, to_seq, from_seq=from_seq)

    # ------------------------------------------------------------------ append
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
        """Append ``batch`` atomically as sequences ``expected_seq ..``; return the last one.

        Raises :class:`AppendConflictError` when ``expected_seq`` is not the log's next
        sequence and :class:`EpochFencedError` when ``epoch`` is not the run's current
        epoch. Either way nothing is written. ``payload_puts`` are stored in the same
        transaction (idempotently, by payload id). ``lock_timeout_s`` (PostgreSQL): fail
        with :class:`LockTimeoutError` instead of waiting longer for the run's row lock.
        """
        if not batch and not payload_puts:
            return expected_seq - 1
        if expected_seq < 1:
            raise StoreError(f"expected_seq must be >= 1, got {expected_seq}")
        last = expected_seq + len(batch) - 1
        doing = f"appending to run {run_id!r}"
        if batch and not self._is_sqlite:
            with self._translate_errors(doing), self._lock_timeouts(run_id, doing, lock_timeout_s):
                self._append_pg(run_id, batch, expected_seq, epoch, payload_puts, lock_timeout_s)
            return last
        if not self._is_sqlite:  # a payload-only put on PostgreSQL
            with self._translate_errors(doing), self._lock_timeouts(run_id, doing, lock_timeout_s):
                with self._writer.begin() as conn:
                    self._set_lock_timeout(conn, lock_timeout_s)
                    self._check_epoch(_sa_execute(conn), run_id, epoch)
                    self._insert_payloads_pg(conn, run_id, payload_puts)
            return last
        assert self._sqlite_writer is not None
        with self._translate_errors(doing), self._sqlite_writer.transaction(doing) as execute:
            if batch:
                cur = execute(self._cas_sql, (last, run_id, expected_seq - 1, epoch))
                if cur.rowcount != 1:
                    row = execute(self._run_position_sql, (run_id,)).fetchone()
                    raise _append_refusal(row, run_id, expected_seq, epoch)
            else:
                # A payload-only put still has to respect fencing.
                self._check_epoch(execute, run_id, epoch)
            self._write_rows(execute, run_id, batch, expected_seq, epoch, payload_puts)
        return last

    def _append_pg(
        self,
        run_id: str,
        batch: Sequence[NewEvent],
        expected_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut],
        lock_timeout_s: float | None,
    ) -> None:
        """The append in one round trip: one statement, or a pipeline of statements of
        ``append_chunk_events`` events each for a larger batch (see pg_append.py)."""
        with self._pg_appender().connect() as conn:
            tables = self._derived_tables(conn)
            # Autocommit: a session setting, kept per pooled connection of this engine
            # (which only appends use), so set only when it changes.
            wanted = "0" if lock_timeout_s is None else f"{max(1, round(lock_timeout_s * 1000))}ms"
            if conn.info.get("rolloutlog_lock_timeout") != wanted:
                conn.exec_driver_sql(f"SET lock_timeout = '{wanted}'")
                conn.info["rolloutlog_lock_timeout"] = wanted
            if self._pg_chunk and len(batch) > self._pg_chunk:
                self._append_pg_pipeline(
                    conn, run_id, batch, expected_seq, epoch, payload_puts, tables
                )
                return
            derived_rows = [ix.rows(run_id, expected_seq, batch) for ix, _ in self._indexers]
            sql, params = self._pg_append.statement(
                run_id, expected_seq, epoch, batch, payload_puts, derived_rows, tables
            )
            if conn.exec_driver_sql(sql, params).first() is None:
                self._raise_append_refusal(conn, run_id, expected_seq, epoch)

    def _append_pg_pipeline(
        self,
        conn: Connection,
        run_id: str,
        batch: Sequence[NewEvent],
        expected_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut],
        tables: Sequence[DerivedTable],
    ) -> None:
        """BEGIN, head, chunks, tail, COMMIT in one pipeline: each chunk's parameters are
        built while the server inserts the one before (pg_append.py says why)."""
        import psycopg

        chunk = self._pg_chunk
        build = self._pg_append
        last = expected_seq + len(batch) - 1
        driver: Any = conn.connection.driver_connection
        failed: psycopg.Error | None = None
        try:
            with driver.pipeline():
                try:
                    driver.execute("BEGIN")
                    sql, params = build.head(
                        run_id, expected_seq, epoch, last, batch[:chunk], payload_puts
                    )
                    driver.execute(sql, params)
                    for start in range(chunk, len(batch), chunk):
                        part = batch[start : start + chunk]
                        driver.execute(*build.chunk(run_id, expected_seq + start, epoch, part))
                    rows = [ix.rows(run_id, expected_seq, batch) for ix, _ in self._indexers]
                    driver.execute(*build.tail(run_id, last, rows, tables))
                    driver.execute("COMMIT")
                except psycopg.Error as exc:
                    # An earlier statement's error, already read back: send nothing more
                    # and let the pipeline end (its sync then reports it aborted).
                    failed = exc
        except psycopg.Error as exc:
            failed = failed or exc
        except BaseException:
            # Not the database's error (a bad derived row, an interrupt): nothing of the
            # batch may stay in an open transaction on a pooled connection.
            self._drop_failed_pipeline(conn)
            raise
        if failed is None:
            return
        invalidated = self._drop_failed_pipeline(conn)
        if failed.sqlstate == REFUSED_SQLSTATE:
            with self.engine.connect() as check:
                self._raise_append_refusal(check, run_id, expected_seq, epoch)
        # As SQLAlchemy would have wrapped it, for _translate_errors and _lock_timeouts.
        raise DBAPIError.instance(
            f"the pipelined append of offsets {expected_seq}..{last}",
            None,
            failed,
            psycopg.Error,
            connection_invalidated=invalidated,
            dialect=conn.dialect,
        ) from failed

    @staticmethod
    def _drop_failed_pipeline(conn: Connection) -> bool:
        """Close the connection of a pipeline that failed, and return whether it was
        broken already (the server was lost).

        Not a ROLLBACK and back to the pool: psycopg prepares a statement it has run a few
        times by sending its Parse in the pipeline, and when the pipeline aborts before
        the server reaches that Parse, psycopg still counts it as prepared (the next use
        fails with "prepared statement _pg3_N does not exist"). Closing forgets both; the
        server rolls back the open transaction when the session ends. A failed append is
        rare (a fenced or conflicting writer, a lost server), a new connection cheap.
        """
        driver: Any = conn.connection.driver_connection
        broken = bool(driver is None or driver.broken or driver.closed)
        conn.invalidate()
        return broken

    def _pg_appender(self) -> Engine:
        """PostgreSQL: the engine appends use: autocommit, no ping before each checkout
        (that would be a second round trip; a dead connection fails the append, as a
        dead server does)."""
        if self._pg_append_engine is None:
            self._pg_append_engine = _make_engine(
                self.url, readonly=self.readonly, append_only=True
            )
        return self._pg_append_engine

    def _derived_tables(self, conn: Connection) -> list[DerivedTable]:
        """The registered indexers' tables with their column types (looked up once)."""
        out = []
        for indexer, _ in self._indexers:
            table = self._derived_types.get(indexer.table)
            if table is None or table.columns != tuple(indexer.columns):
                found: dict[str, str] = dict(
                    conn.exec_driver_sql(
                        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) "
                        "FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) "
                        "AND a.attnum > 0 AND NOT a.attisdropped",
                        (indexer.table,),
                    ).all()
                )
                missing = [c for c in indexer.columns if c not in found]
                if missing:
                    raise StoreError(
                        f"indexer table {indexer.table!r} has no columns {missing} "
                        "(is its migration applied?)"
                    )
                table = DerivedTable(
                    indexer.table,
                    tuple(indexer.columns),
                    tuple(found[c] for c in indexer.columns),
                )
                self._derived_types[indexer.table] = table
            out.append(table)
        return out

    def _write_rows(
        self,
        execute: Execute,
        run_id: str,
        batch: Sequence[NewEvent],
        first_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut],
    ) -> None:
        """SQLite: the payloads, the ``events`` rows of ``batch`` as offsets ``first_seq ..``
        and the indexers' derived rows (in the same transaction: one exists iff the
        other), each table's rows in as few multi-row statements as the limit allows."""
        if payload_puts:
            flat: list[Any] = []
            for p in payload_puts:
                flat += (run_id, p.payload_id, p.kind, p.data)
            _insert_chunks(execute, self._payloads_bulk, flat, len(payload_puts))
        if not batch:
            return
        values = sqlite_event_values(batch, first_seq)
        _insert_chunks(execute, self._events_bulk, values, len(batch), (run_id, epoch))
        for indexer, _sql in self._indexers:
            index_rows = indexer.rows(run_id, first_seq, batch)
            if index_rows:
                flat = derived_values(indexer.table, run_id, index_rows)
                bulk = self._indexers_bulk[indexer.table]
                _insert_chunks(execute, bulk, flat, len(index_rows), (run_id,))

    def _insert_payloads_pg(
        self, conn: Connection, run_id: str, payload_puts: Sequence[PayloadPut]
    ) -> None:
        if payload_puts:
            conn.exec_driver_sql(
                self._payload_sql, [(run_id, p.payload_id, p.kind, p.data) for p in payload_puts]
            )

    def _insert_events_pg(
        self,
        conn: Connection,
        run_id: str,
        batch: Sequence[NewEvent],
        first_seq: int,
        epoch: int,
    ) -> None:
        """PostgreSQL: the ``events`` rows of ``batch`` as offsets ``first_seq ..``."""
        if batch:
            rows = [
                (run_id, seq, epoch, type_, version, stamp, payload)
                for seq, (type_, version, payload, stamp, _derived) in enumerate(batch, first_seq)
            ]
            conn.exec_driver_sql(self._insert_sql, rows)

    def _insert_derived_pg(self, conn: Connection, run_id: str, batch: Sequence[NewEvent]) -> None:
        """PostgreSQL: the derived rows of a run's first events (offsets 1 ..)."""
        if not batch:
            return
        for indexer, index_sql in self._indexers:
            index_rows = indexer.rows(run_id, 1, batch)
            if index_rows:
                conn.exec_driver_sql(index_sql, index_rows)

    # ------------------------------------------------------------------ lock timeouts
    def _set_lock_timeout(self, conn: Connection, lock_timeout_s: float | None) -> None:
        """PostgreSQL: bound this transaction's lock waits (SQLite has its busy_timeout)."""
        if lock_timeout_s is None or self._is_sqlite:
            return
        # 0 would mean "no limit" to PostgreSQL: the shortest real limit is 1 ms.
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, round(lock_timeout_s * 1000))}ms'")

    @contextlib.contextmanager
    def _lock_timeouts(
        self, run_id: str, doing: str, lock_timeout_s: float | None
    ) -> Iterator[None]:
        """Turn PostgreSQL's lock_timeout (SQLSTATE 55P03) into :class:`LockTimeoutError`."""
        try:
            yield
        except DBAPIError as exc:
            if driver_fault(self.dialect, exc.orig) is not DriverFault.LOCK_TIMEOUT:
                raise
            holders = self._lock_holders(run_id)
            held_by = "; ".join(holders) if holders else "no holder found (it may have let go)"
            raise LockTimeoutError(
                f"gave up {doing} after waiting {lock_timeout_s}s for the lock on run "
                f"{run_id!r}: held by {held_by}. If that writer is hung, end it "
                "(SELECT pg_terminate_backend(pid)) and retry",
                tuple(holders),
            ) from exc

    def _lock_holders(self, run_id: str) -> list[str]:
        """Describe the PostgreSQL sessions holding run ``run_id``'s row (best effort).

        A row lock is not listed in pg_locks: the row's ``xmax`` names the transaction that
        locked (or updated) it, and that transaction holds a lock on its own id. When
        several sessions share the lock (a multixact), fall back to the sessions holding
        a row-level lock mode on the ``runs`` table.
        """
        by_xmax = (
            "SELECT a.pid, a.application_name, a.state, a.xact_start, a.query "
            "FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "WHERE l.granted AND l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' "
            "AND l.transactionid = (SELECT xmax FROM runs WHERE run_id = %s) "
            "AND a.pid <> pg_backend_pid()"
        )
        by_table = (
            "SELECT DISTINCT a.pid, a.application_name, a.state, a.xact_start, a.query "
            "FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "WHERE l.granted AND l.locktype = 'relation' AND l.relation = 'runs'::regclass "
            "AND l.mode IN ('RowShareLock', 'RowExclusiveLock') AND a.pid <> pg_backend_pid()"
        )
        try:
            with self.engine.connect() as conn:
                rows = conn.exec_driver_sql(by_xmax, (run_id,)).all()
                if not rows:
                    rows = conn.exec_driver_sql(by_table).all()
        except Exception:  # naming the holder is a courtesy: never hide the timeout
            return []
        out = []
        for pid, app, state, xact_start, query in rows:
            since = (
                f", transaction open since {xact_start:%Y-%m-%d %H:%M:%S %Z}" if xact_start else ""
            )
            out.append(
                f"pid {pid} (application_name {app!r}, state {state!r}{since}, "
                f"last query {' '.join(str(query or '').split())[:120]!r})"
            )
        return out

    def add_indexer(self, indexer: Indexer) -> None:
        """Write ``indexer``'s derived rows in the transaction of every later append.

        The indexer's table belongs to the caller (who creates it by a migration); the
        store only inserts the rows the indexer builds, and removes them with their
        events when a run is compacted. Registering the same indexer again is a no-op.
        """
        if any(ix is indexer for ix, _ in self._indexers):
            return
        check_indexer(indexer, [ix for ix, _ in self._indexers])
        mark = "?" if self._is_sqlite else "%s"
        sql = (
            f"INSERT INTO {indexer.table} ({', '.join(indexer.columns)}) "
            f"VALUES ({', '.join([mark] * len(indexer.columns))})"
        )
        self._indexers.append((indexer, sql))
        self._indexers_bulk[indexer.table] = derived_insert(indexer.table, indexer.columns)

    @property
    def indexers(self) -> tuple[Indexer, ...]:
        """The registered indexers, in registration order."""
        return tuple(ix for ix, _ in self._indexers)

    def _check_epoch(self, execute: Execute, run_id: str, epoch: int) -> None:
        row = execute(self._run_position_sql, (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(f"no run {run_id!r}")
        if row[0] != epoch:
            raise EpochFencedError(run_id, epoch, row[0])

    def _raise_append_refusal(
        self, conn: Connection, run_id: str, expected_seq: int, epoch: int
    ) -> None:
        row = conn.exec_driver_sql(self._run_position_sql, (run_id,)).fetchone()
        raise _append_refusal(row, run_id, expected_seq, epoch)

    # ------------------------------------------------------------------ read
    def last_seq(self, run_id: str) -> int:
        """Sequence of the newest event of the run (0 when empty)."""
        return self.get_run(run_id).last_seq

    def read(
        self,
        run_id: str,
        from_seq: int = 1,
        to_seq: int | None = None,
        *,
        page_size: int = 2000,
    ) -> Iterator[StoredEvent]:
        """Stream events ``from_seq..to_seq`` (inclusive) in order, ``page_size`` rows at a time.

        Memory stays bounded by the page size; each page is a short read, so a long
        replay never holds a transaction open against the writer.

        The log proves it is whole while it streams: the stored offsets must run exactly
        from the run's base (1, or the newest compaction's base) to ``runs.last_seq``, so
        a missing, duplicated or extra row raises :class:`CorruptLogError` naming its
        offset (no row after a gap is ever yielded). The read covers the log as it stood
        when it began (up to ``last_seq`` then); an unknown run has no events.
        """
        doing = f"reading run {run_id!r}"
        with self._translate_errors(doing), self.engine.connect() as conn:
            bounds = self._checked_bounds(conn, run_id)
        if bounds is None:
            return
        base, last = bounds
        mark = "?" if self._is_sqlite else "%s"
        last_sql = f"SELECT last_seq FROM runs WHERE run_id = {mark}"
        nxt = expected = max(base, from_seq)
        upper = last if to_seq is None else min(to_seq, last)
        parse_ts = _parse_ts
        fromiso = datetime.fromisoformat
        # StoredEvent's fields without its Python-level __new__ (the same named tuple,
        # built by tuple's C constructor: ~0.25 us less per row; docs/benchmarks.md).
        new_row = tuple.__new__
        first_page = True
        while True:
            with self._translate_errors(doing), self.engine.connect() as conn:
                if not first_page:
                    # Each page sees what was appended since the previous one. last_seq is
                    # read before the page: every row up to it is committed, so visible.
                    last = conn.exec_driver_sql(last_sql, (run_id,)).scalar_one()
                    upper = last if to_seq is None else min(to_seq, last)
                first_page = False
                if nxt > upper:
                    break
                rows = self._fetch_tuples(conn, self._read_sql, (run_id, nxt, upper, page_size))
            # Columns come in StoredEvent's field order, after run_id (see _READ_COLS).
            for seq, epoch, type_, version, payload, ts in rows:
                if seq != expected:
                    self._raise_gap(run_id, expected, seq, last)
                expected += 1
                if type(ts) is str:
                    # _parse_ts's hot path inlined (SQLite's text as _iso writes it).
                    try:
                        stamp = fromiso(ts + "+00:00")
                    except ValueError:
                        stamp = parse_ts(ts)
                else:
                    stamp = parse_ts(ts)
                yield new_row(StoredEvent, (run_id, seq, epoch, type_, version, payload, stamp))
            if len(rows) < page_size:
                break
            nxt = rows[-1][0] + 1
        if expected <= upper:
            self._raise_gap(run_id, expected, None, last)

    # ------------------------------------------------------------------ wholeness
    def _bounds_sql(self) -> str:
        mark = "?" if self._is_sqlite else "%s"
        # Index lookups only (primary keys): cheap enough to run at every read.
        return (
            "SELECT r.last_seq, "
            "(SELECT MAX(c.upto_seq) FROM compactions c WHERE c.run_id = r.run_id), "
            "(SELECT MIN(e.seq) FROM events e WHERE e.run_id = r.run_id), "
            "(SELECT MAX(e.seq) FROM events e WHERE e.run_id = r.run_id) "
            f"FROM runs r WHERE r.run_id = {mark}"
        )

    def _checked_bounds(self, conn: Connection, run_id: str) -> tuple[int, int] | None:
        """``(base, last_seq)`` of the run, after checking the stored rows' ends match them.

        One statement, so one snapshot on both dialects. Interior gaps are found by the
        streaming check of :meth:`read` (or the count of :meth:`check_log`). None for an
        unknown run.
        """
        row = conn.exec_driver_sql(self._bounds_sql(), (run_id,)).first()
        if row is None:
            return None
        last, upto, lo, hi = row
        base = 1 if upto is None else upto + 1
        if lo is not None and lo < base:
            raise CorruptLogError(
                run_id,
                lo,
                "extra",
                f"the log starts at base offset {base}"
                + (" (after a compaction)" if upto is not None else ""),
            )
        if hi is not None and hi > last:
            first_extra = conn.execute(
                sa.select(sa.func.min(events.c.seq)).where(
                    events.c.run_id == run_id, events.c.seq > last
                )
            ).scalar_one()
            raise CorruptLogError(run_id, first_extra, "extra", f"beyond runs.last_seq = {last}")
        if last >= base and (hi is None or hi < last or lo != base):
            gap = self._first_gap(conn, run_id, base, last)
            raise CorruptLogError(
                run_id, gap, "missing", f"offsets must run from {base} to runs.last_seq = {last}"
            )
        return base, last

    def _first_gap(self, conn: Connection, run_id: str, base: int, last: int) -> int:
        """The first offset in ``base..last`` with no row (only called once one is known)."""
        mark = "?" if self._is_sqlite else "%s"
        at_base = conn.exec_driver_sql(
            f"SELECT 1 FROM events WHERE run_id = {mark} AND seq = {mark}", (run_id, base)
        ).first()
        if at_base is None:
            return base
        gap = conn.exec_driver_sql(
            f"SELECT MIN(e.seq) + 1 FROM events e WHERE e.run_id = {mark} AND e.seq >= {mark} "
            f"AND e.seq < {mark} AND NOT EXISTS (SELECT 1 FROM events f "
            "WHERE f.run_id = e.run_id AND f.seq = e.seq + 1)",
            (run_id, base, last),
        ).scalar()
        return int(gap) if gap is not None else last

    def _compaction_base(self, run_id: str) -> int:
        with self.engine.connect() as conn:
            upto = conn.execute(
                sa.select(sa.func.max(compactions.c.upto_seq)).where(compactions.c.run_id == run_id)
            ).scalar()
        return 1 if upto is None else int(upto) + 1

    def _raise_gap(self, run_id: str, expected: int, got: int | None, last: int) -> None:
        """Raise the :class:`CorruptLogError` for a read that found ``got`` at ``expected``."""
        base = self._compaction_base(run_id)
        if expected < base:
            # Not corruption: a compaction removed these rows while the read went on.
            raise StoreError(
                f"events of run {run_id!r} up to offset {base - 1} were removed by a "
                "compaction while they were being read; read again from the new base"
            )
        if got is not None and got < expected:
            raise CorruptLogError(run_id, got, "duplicate", "the offset is stored twice")
        raise CorruptLogError(
            run_id, expected, "missing", f"offsets must run from {base} to runs.last_seq = {last}"
        )

    def _check_whole_upto(
        self, conn: Connection, run_id: str, upto: int, from_seq: int = 1
    ) -> None:
        """Rows ``max(base, from_seq)..upto`` are all stored (the ends are checked by the
        bounds check)."""
        bounds = self._checked_bounds(conn, run_id)
        if bounds is None:
            return
        base, last = bounds
        lo = max(base, from_seq)
        upto = min(upto, last)
        if upto < lo:
            return
        count = conn.execute(
            sa.select(sa.func.count())
            .select_from(events)
            .where(events.c.run_id == run_id, events.c.seq >= lo, events.c.seq <= upto)
        ).scalar_one()
        if count != upto - lo + 1:
            gap = self._first_gap(conn, run_id, lo, upto)
            raise CorruptLogError(
                run_id, gap, "missing", f"offsets must run from {base} to runs.last_seq = {last}"
            )

    def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None:
        """Check that the run's rows ``from_seq..upto`` are all stored (``from_seq`` raised
        to the base: 1, or the newest compaction's; ``upto`` capped at ``runs.last_seq``),
        and that the rows' ends match the run's bounds: with ``from_seq=1``, the check
        :meth:`load_snapshot` makes. One count over the run's primary key range, in the
        database (no Python per row, so other threads run meanwhile; disjoint ranges can
        be counted on several threads at once). :class:`CorruptLogError` names the first
        missing offset; an unknown run is not checked.
        """
        with self._translate_errors(f"checking run {run_id!r} whole up to offset {upto}"):
            with self.engine.connect() as conn:
                self._check_whole_upto(conn, run_id, upto, from_seq)

    def check_log(self, run_id: str | None = None) -> None:
        """Check that each run's (or only ``run_id``'s) rows are exactly ``base..last_seq``.

        A count, a minimum and a maximum per run (index scans): the cheap whole-log check
        for paths that read through SQL views instead of :meth:`read` (``audit``).
        Raises :class:`CorruptLogError` naming the first wrong offset. An unknown
        ``run_id`` is not checked (the caller reports it).
        """
        mark = "?" if self._is_sqlite else "%s"
        sql = (
            "SELECT r.run_id, r.last_seq, "
            "(SELECT MAX(c.upto_seq) FROM compactions c WHERE c.run_id = r.run_id), "
            "(SELECT COUNT(*) FROM events e WHERE e.run_id = r.run_id) FROM runs r"
            + ("" if run_id is None else f" WHERE r.run_id = {mark}")
        )
        with self._translate_errors("checking the log is whole"), self.engine.connect() as conn:
            found = conn.exec_driver_sql(sql, () if run_id is None else (run_id,)).all()
            for rid, last, upto, count in found:
                base = 1 if upto is None else upto + 1
                # The ends first (they name extra rows); then the count finds interior gaps.
                self._checked_bounds(conn, rid)
                if count != max(0, last - base + 1):
                    gap = self._first_gap(conn, rid, base, last)
                    raise CorruptLogError(
                        rid,
                        gap,
                        "missing",
                        f"offsets must run from {base} to runs.last_seq = {last}",
                    )

    def _fetch_tuples(
        self, conn: Connection, sql: str, params: tuple[Any, ...]
    ) -> list[tuple[Any, ...]]:
        """Execute through SQLAlchemy, fetch the driver's plain tuples (the read hot path).

        Skips building a SQLAlchemy Row per row (half of the cost of a page); a driver error
        raised while fetching is wrapped as SQLAlchemy would, for :class:`_ErrorTranslator`.
        """
        result = conn.exec_driver_sql(sql, params)
        try:
            # The DBAPI cursor's rows: a list of tuples on both drivers (stubs: a Sequence).
            return result.cursor.fetchall()  # type: ignore[return-value]
        except self._dbapi_error as exc:
            raise sa.exc.DBAPIError.instance(
                sql, params, exc, self._dbapi_error, dialect=self.engine.dialect
            ) from exc
        finally:
            result.close()

    def derived_rows(
        self,
        table: str,
        run_id: str,
        from_seq: int = 1,
        to_seq: int | None = None,
        *,
        limit: int | None = None,
        **equals: Any,
    ) -> list[tuple[Any, ...]]:
        """Rows of a registered indexer's ``table`` for ``run_id`` in ``from_seq..to_seq``
        whose columns equal ``equals`` (through the table's indexes), in sequence order;
        only the first ``limit`` of them when given."""
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise StoreError(f"limit must be an int >= 0, got {limit!r}")
        indexer = next((ix for ix, _ in self._indexers if ix.table == table), None)
        if indexer is None:
            raise StoreError(f"no indexer writes table {table!r}: add_indexer() it first")
        unknown = sorted(set(equals) - set(indexer.columns))
        if unknown:
            raise StoreError(f"table {table!r} has no columns {unknown}")
        mark = "?" if self._is_sqlite else "%s"
        conds = [f"run_id = {mark}", f"seq >= {mark}", f"seq <= {mark}"]
        params: list[Any] = [run_id, from_seq, to_seq if to_seq is not None else 2**62]
        for col, val in equals.items():
            conds.append(f"{col} = {mark}")
            params.append(val)
        # No ORDER BY: SQLite's planner (no statistics) would walk the primary key to skip
        # the sort instead of seeking the index of an equality column; sorted here instead.
        # (With a limit the order is the answer: the (run_id, seq) key gives it.)
        sql = f"SELECT {', '.join(indexer.columns)} FROM {table} WHERE {' AND '.join(conds)}"
        if limit is not None:
            sql += f" ORDER BY seq LIMIT {limit:d}"
        with self._translate_errors(f"querying {table} of run {run_id!r}"):
            with self.engine.connect() as conn:
                rows = self._fetch_tuples(conn, sql, tuple(params))
        rows.sort(key=lambda r: r[1])
        return [tuple(r) for r in rows]

    # ------------------------------------------------------------------ snapshots
    def save_snapshot(self, run_id: str, seq: int, schema_version: int, data: bytes) -> None:
        """Store a state blob that covers events ``1..seq`` (replaces one at the same seq)."""
        with self._translate_errors(f"saving a snapshot of run {run_id!r}"):
            with self._writer.begin() as conn:
                conn.execute(
                    snapshots.delete().where(snapshots.c.run_id == run_id, snapshots.c.seq == seq)
                )
                conn.execute(
                    snapshots.insert().values(
                        run_id=run_id,
                        seq=seq,
                        schema_version=schema_version,
                        created_at=datetime.now(UTC),
                        data=data,
                    )
                )

    def load_snapshot(
        self, run_id: str, at_or_before: int | None = None, *, check: bool = True
    ) -> Snapshot | None:
        """The newest snapshot with ``seq <= at_or_before`` (any, when None), or None.

        A snapshot stands for the events before it, which a replay from it never reads:
        so the log is checked whole up to it here (one count over the run's primary key),
        :class:`CorruptLogError` naming the first missing offset otherwise. ``check=False``
        leaves that to the caller, who must then call :meth:`check_whole` up to the
        snapshot (a restore runs it beside the replay: the count is O(log size)).
        """
        q = sa.select(snapshots).where(snapshots.c.run_id == run_id)
        if at_or_before is not None:
            q = q.where(snapshots.c.seq <= at_or_before)
        q = q.order_by(snapshots.c.seq.desc()).limit(1)
        with self._translate_errors(f"loading a snapshot of run {run_id!r}"):
            with self.engine.connect() as conn:
                row = conn.execute(q).first()
                if row is not None and check:
                    self._check_whole_upto(conn, run_id, row.seq)
        if row is None:
            return None
        return Snapshot(
            row.run_id, row.seq, row.schema_version, _parse_ts(row.created_at), bytes(row.data)
        )

    # ------------------------------------------------------------------ payloads
    def put_payload(self, run_id: str, payload_id: str, kind: str, data: bytes) -> None:
        """Store a binary payload outside any event batch (idempotent by id)."""
        with self._translate_errors(f"storing payload {payload_id!r}"):
            with self._writer.begin() as conn:
                conn.exec_driver_sql(self._payload_sql, [(run_id, payload_id, kind, data)])

    def get_payload(self, run_id: str, payload_id: str) -> bytes:
        """A payload's bytes; :class:`PayloadNotFoundError` when absent."""
        with self._translate_errors(f"reading payload {payload_id!r}"):
            with self.engine.connect() as conn:
                row = conn.execute(
                    sa.select(payloads.c.data).where(
                        payloads.c.run_id == run_id, payloads.c.payload_id == payload_id
                    )
                ).first()
        if row is None:
            raise PayloadNotFoundError(f"no payload {payload_id!r} in run {run_id!r}")
        return bytes(row.data)

    # ------------------------------------------------------------------ errors
    def _translate_errors(self, doing: str, *, keep_integrity: bool = False) -> _ErrorTranslator:
        return _ErrorTranslator(self, doing, keep_integrity=keep_integrity)


def _sa_execute(conn: Connection) -> Execute:
    """:data:`Execute` on a SQLAlchemy connection (a tuple: a list would be executemany)."""
    return lambda sql, params: conn.exec_driver_sql(sql, tuple(params))


def _insert_chunks(
    execute: Execute, bulk: MultiRowInsert, flat: list[Any], n: int, shared: Sequence[Any] = ()
) -> None:
    for sql, params in bulk.chunks(flat, n, shared):
        execute(sql, params)


def _append_refusal(
    row: Sequence[Any] | None, run_id: str, expected_seq: int, epoch: int
) -> StoreError:
    """Why an append's compare-and-set matched no row, from the run's ``(current_epoch,
    last_seq)`` read in the same transaction (None: no such run)."""
    if row is None:
        return RunNotFoundError(f"no run {run_id!r}: create it before appending")
    current_epoch, last_seq = row
    if current_epoch != epoch:
        return EpochFencedError(run_id, epoch, current_epoch)
    return AppendConflictError(run_id, expected_seq, last_seq + 1)


class _ErrorTranslator:
    """Turns driver errors into the store's error hierarchy, naming what was being done."""

    def __init__(self, store: EventStore, doing: str, *, keep_integrity: bool = False) -> None:
        self.store = store
        self.doing = doing
        # Only create_run interprets an IntegrityError (as RunExistsError); anywhere else it
        # is translated like every other driver error.
        self.keep_integrity = keep_integrity

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type | None, exc: BaseException | None, tb: object
    ) -> Literal[False]:
        if exc is None or isinstance(exc, StoreError):
            return False
        if self.keep_integrity and isinstance(exc, IntegrityError):
            return False
        where = self.store.url.render_as_string(hide_password=True)
        if isinstance(exc, DBAPIError):
            msg = str(exc.orig) if exc.orig is not None else str(exc)
            fault = driver_fault(self.store.dialect, exc.orig)
            if fault is DriverFault.BAD_TEXT:
                msg = f"PostgreSQL text cannot hold this value (a NUL, 0x00, character?): {msg}"
            if fault is DriverFault.READ_ONLY:
                raise ReadOnlyStoreError(
                    f"{where} is read-only while {self.doing}: {msg.strip()}"
                ) from exc
            if fault is DriverFault.NOT_A_DATABASE:
                raise StoreUnavailableError(
                    f"{where} is not a valid SQLite database (corrupt or truncated file) "
                    f"while {self.doing}: {msg.strip()}"
                ) from exc
            if exc.connection_invalidated or isinstance(exc, sa.exc.OperationalError):
                raise StoreUnavailableError(
                    f"cannot reach {where} while {self.doing}: {msg.strip()}"
                ) from exc
            raise StoreError(
                f"database error on {where} while {self.doing}: {msg.strip()}"
            ) from exc
        return False


def _make_engine(url: URL, *, readonly: bool, append_only: bool = False) -> Engine:
    if url.get_backend_name() == "sqlite":
        return _make_sqlite_engine(url, readonly=readonly)
    try:
        connect_args: dict[str, Any] = {"connect_timeout": 10}
        if "application_name" not in url.query:
            # Names this process in pg_stat_activity, so a blocked takeover can say which
            # writer holds the run's lock.
            name = f"rolloutlog pid {os.getpid()} on {socket.gethostname()}"
            connect_args["application_name"] = name[:63]
        if readonly:
            connect_args["options"] = "-c default_transaction_read_only=on"
        url = pg_connect_url(url)
        if append_only:
            # One writer thread per run appends: a small pool, autocommit (each append is
            # one statement or one pipeline), and no ping round trip before each append.
            return sa.create_engine(
                url,
                pool_pre_ping=False,
                pool_recycle=1800,
                isolation_level="AUTOCOMMIT",
                connect_args=connect_args,
                pool_size=2,
                max_overflow=4,
            )
        return sa.create_engine(
            url, pool_pre_ping=True, connect_args=connect_args, pool_size=8, max_overflow=8
        )
    except (NoSuchModuleError, ImportError) as exc:
        raise StoreUrlError(
            f"the PostgreSQL driver is missing for {url.render_as_string()}: "
            "pip install 'rolloutlog[postgres]' (psycopg 3)"
        ) from exc


def sqlite_busy_timeout_ms(url: URL) -> int:
    """The URL's ``busy_timeout_ms`` (default :data:`DEFAULT_BUSY_TIMEOUT_MS`): how long a
    SQLite writer waits for the write lock."""
    raw = url.query.get("busy_timeout_ms", DEFAULT_BUSY_TIMEOUT_MS)
    return whole_number_option(url, raw, "busy_timeout_ms", "milliseconds")


def _make_sqlite_engine(url: URL, *, readonly: bool) -> Engine:
    query = dict(url.query)
    sync = str(query.pop("synchronous", DEFAULT_SQLITE_SYNCHRONOUS)).upper()
    if sync not in SQLITE_SYNCHRONOUS:
        raise StoreUrlError(
            f"synchronous={sync!r} in {url!s}: choose one of {', '.join(SQLITE_SYNCHRONOUS)}"
        )
    query.pop("busy_timeout_ms", None)
    busy_ms = sqlite_busy_timeout_ms(url)
    if query:
        raise StoreUrlError(f"unknown SQLite URL options {sorted(query)} in {url!s}")
    path = Path(url.database or "")
    if not path.parent.exists():
        raise StoreUnavailableError(f"cannot open {path}: directory {path.parent} does not exist")
    if path.exists() and not readonly and not os.access(path, os.W_OK):
        raise ReadOnlyStoreError(
            f"{path} is read-only: make it writable, or open it read-only "
            "(readonly=True / --readonly) to read and audit"
        )
    if readonly and not path.exists():
        raise StoreUnavailableError(f"cannot open {path} read-only: the file does not exist")
    db_arg = f"file:{path}?mode=ro" if readonly else str(path)

    def creator() -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN ourselves (via SQLAlchemy's events below),
        # so BEGIN IMMEDIATE takes the write lock up front and busy_timeout applies.
        return sqlite3.connect(
            db_arg,
            uri=readonly,
            check_same_thread=False,
            isolation_level=None,
            timeout=busy_ms / 1000,
        )

    engine = sa.create_engine(f"sqlite:///{path}", creator=creator)

    @sa_event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _rec: object) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {busy_ms}")
        if not readonly:
            mode = cur.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode and str(mode[0]).lower() != "wal":
                raise StoreUnavailableError(f"cannot switch {path} to WAL mode (got {mode[0]})")
        cur.execute(f"PRAGMA synchronous = {sync}")
        cur.close()

    @sa_event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the write lock up front (BEGIN IMMEDIATE), so busy_timeout applies
        # and a read-then-write transaction can never fail with a stale-snapshot BUSY.
        immediate = conn.get_execution_options().get("rolloutlog_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine
