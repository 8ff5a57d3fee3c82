"""What a database driver's error means to the store, decided by its class (PostgreSQL:
psycopg's class per SQLSTATE) or its result code (SQLite: ``sqlite_errorcode``), never by
the wording of its message: one function per database, both used by the store's error
translation (``store.py``), which turns them into :mod:`rolloutlog.eventstore.errors`.
"""

from __future__ import annotations

import enum
import sqlite3


class DriverFault(enum.Enum):
    """The kinds of driver error the store reports as errors of their own."""

    READ_ONLY = "read-only"  # the database or the connection refuses writes
    NOT_A_DATABASE = "not a database"  # a corrupt or foreign SQLite file
    LOCK_TIMEOUT = "lock timeout"  # PostgreSQL's lock_timeout ran out
    BAD_TEXT = "bad text"  # PostgreSQL text cannot hold the value (a NUL character)
    PERMISSION = "permission"  # the role may not do it (PostgreSQL)
    TIMEOUT = "timeout"  # a statement timeout or an interrupt
    NOT_ONE_STATEMENT = "not one statement"  # more than one statement, or not parsed
    OTHER = "other"


def sqlite_fault(exc: BaseException | None) -> DriverFault:
    """The kind of a ``sqlite3`` error, from its primary result code."""
    if isinstance(exc, (sqlite3.ProgrammingError, sqlite3.Warning)):
        return DriverFault.NOT_ONE_STATEMENT  # "You can only execute one statement at a time."
    code = getattr(exc, "sqlite_errorcode", None) if isinstance(exc, sqlite3.Error) else None
    if code is None:
        return DriverFault.OTHER
    primary = code & 0xFF  # extended codes keep the primary one in their low byte
    if primary == sqlite3.SQLITE_READONLY:
        return DriverFault.READ_ONLY
    if primary in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return DriverFault.NOT_A_DATABASE
    if primary == sqlite3.SQLITE_INTERRUPT:
        return DriverFault.TIMEOUT
    return DriverFault.OTHER


def postgres_fault(exc: BaseException | None) -> DriverFault:
    """The kind of a psycopg error, from its class (one per SQLSTATE)."""
    if exc is None or not type(exc).__module__.startswith("psycopg"):
        return DriverFault.OTHER
    # psycopg is the [postgres] extra: imported only once one of its errors is at hand.
    from psycopg import errors

    # ActiveSqlTransaction: setting read-write mode inside a read-only transaction.
    if isinstance(exc, (errors.ReadOnlySqlTransaction, errors.ActiveSqlTransaction)):
        return DriverFault.READ_ONLY
    if isinstance(exc, errors.LockNotAvailable):
        return DriverFault.LOCK_TIMEOUT
    if isinstance(exc, (errors.CharacterNotInRepertoire, errors.UntranslatableCharacter)):
        return DriverFault.BAD_TEXT
    if isinstance(exc, errors.InsufficientPrivilege):
        return DriverFault.PERMISSION
    if isinstance(exc, errors.QueryCanceled):
        return DriverFault.TIMEOUT
    if isinstance(exc, errors.SyntaxError):  # also "multiple commands into a prepared statement"
        return DriverFault.NOT_ONE_STATEMENT
    return DriverFault.OTHER


def driver_fault(dialect: str, exc: BaseException | None) -> DriverFault:
    """The kind of ``exc`` (a driver's error, or None) raised by a ``dialect`` database."""
    return sqlite_fault(exc) if dialect == "sqlite" else postgres_fault(exc)
