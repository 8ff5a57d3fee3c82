"""Driver errors are classified by their class (psycopg) or result code (SQLite), never by
the wording of their message."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from rolloutlog.eventstore.driver_errors import DriverFault, postgres_fault, sqlite_fault


def _raised(db: sqlite3.Connection, sql: str) -> sqlite3.Error:
    with pytest.raises(sqlite3.Error) as info:
        db.execute(sql)
    return info.value


def test_sqlite_faults_come_from_the_result_code(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (a)")
    db.close()
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert sqlite_fault(_raised(ro, "INSERT INTO t VALUES (1)")) is DriverFault.READ_ONLY
    finally:
        ro.close()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database file, not at all" * 200)
    bad = sqlite3.connect(junk)
    try:
        assert sqlite_fault(_raised(bad, "SELECT * FROM t")) is DriverFault.NOT_A_DATABASE
    finally:
        bad.close()
    # The words of a message decide nothing.
    worded = sqlite3.OperationalError("attempt to write a readonly database: not a database")
    assert sqlite_fault(worded) is DriverFault.OTHER
    assert sqlite_fault(None) is DriverFault.OTHER


def test_postgres_faults_come_from_the_class() -> None:
    errors = pytest.importorskip("psycopg.errors")
    assert postgres_fault(errors.ReadOnlySqlTransaction("x")) is DriverFault.READ_ONLY
    assert postgres_fault(errors.LockNotAvailable("x")) is DriverFault.LOCK_TIMEOUT
    assert postgres_fault(errors.CharacterNotInRepertoire("x")) is DriverFault.BAD_TEXT
    assert postgres_fault(errors.InsufficientPrivilege("x")) is DriverFault.PERMISSION
    assert postgres_fault(errors.QueryCanceled("x")) is DriverFault.TIMEOUT
    assert postgres_fault(errors.SyntaxError("x")) is DriverFault.NOT_ONE_STATEMENT
    worded = errors.UndefinedColumn("cannot execute INSERT in a read-only transaction")
    assert postgres_fault(worded) is DriverFault.OTHER
    assert postgres_fault(RuntimeError("read-only")) is DriverFault.OTHER
