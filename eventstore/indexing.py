"""Indexers: derived rows that a store writes in the same transaction as their events.

The store knows nothing about what an index means. An application (rolloutlog's
controller keeps its audit keys this way) registers an :class:`Indexer` with
:meth:`EventStore.add_indexer`; every append then asks each indexer for the rows of
the new events and inserts them into the indexer's table inside the append
transaction, so an index row exists exactly when its event does. The table belongs to
the application, which creates it (with its own migrations) and queries it.

The contract of an index table: its first two columns are ``run_id`` and ``seq``, the
key of the event a row derives from. That is all the store relies on: a compaction that
removes events ``1..k`` of a run removes their derived rows too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import StoreError
from .records import NewEvent

#: The store's own tables: an indexer may not write to them.
STORE_TABLES = frozenset({"runs", "events", "epochs", "payloads", "snapshots", "compactions"})
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@runtime_checkable
class Indexer(Protocol):
    """Turns appended events into rows of one derived table (see the module docstring)."""

    # Read-only members, so a class attribute of a narrower type (a fixed-length tuple)
    # satisfies them.
    @property
    def table(self) -> str:
        """The derived table's name (lower-case SQL identifier, not one of the store's)."""
        ...

    @property
    def columns(self) -> tuple[str, ...]:
        """Its columns, in the order of the tuples :meth:`rows` returns; ``("run_id", "seq",
        ...)``."""
        ...

    def rows(self, run_id: str, first_seq: int, batch: Sequence[NewEvent]) -> list[tuple[Any, ...]]:
        """The derived rows of ``batch``, whose events get sequences ``first_seq ..``.

        Called inside the append transaction, after the sequence compare-and-set; an
        exception aborts the append (nothing of it is written).
        """
        ...


def check_table_name(table: str) -> None:
    """Refuse a derived-table name that is not a plain identifier or is the store's own."""
    if not isinstance(table, str) or not _IDENTIFIER.match(table):
        raise StoreError(f"{table!r} is not a plain lower-case SQL identifier")
    if table in STORE_TABLES:
        raise StoreError(f"{table!r} is one of the store's own tables, not a derived table")


def check_indexer(indexer: Indexer, registered: Sequence[Indexer]) -> None:
    """Refuse an indexer whose table or columns the store cannot safely write."""
    if not isinstance(indexer, Indexer):
        raise StoreError(f"{indexer!r} is not an Indexer (needs table, columns and rows())")
    names = (indexer.table, *indexer.columns)
    bad = [n for n in names if not isinstance(n, str) or not _IDENTIFIER.match(n)]
    if bad:
        raise StoreError(f"indexer {indexer!r}: {bad} are not plain lower-case SQL identifiers")
    if indexer.table in STORE_TABLES:
        raise StoreError(
            f"indexer {indexer!r} may not write the store's own table {indexer.table!r}"
        )
    if tuple(indexer.columns[:2]) != ("run_id", "seq"):
        raise StoreError(
            f"indexer table {indexer.table!r} must start with columns run_id, seq "
            f"(the key of the event a row derives from), got {indexer.columns!r}"
        )
    if any(other.table == indexer.table and other is not indexer for other in registered):
        raise StoreError(f"another indexer already writes table {indexer.table!r}")
