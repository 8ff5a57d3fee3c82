"""Multi-row INSERT statements: a batch of rows in a few statements instead of one per row.

``executemany`` steps the statement once per row and gives the GIL back between rows, so
a commit thread competing with a busy event loop pays a thread switch per row. One
``INSERT ... VALUES (...), (...), ...`` per chunk binds the whole chunk in C and holds
the database for one step. Statement sizes are powers of two (plus one full size), so a
connection's statement cache holds a bounded number of prepared statements whatever the
batch sizes are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .errors import StoreError

#: SQLite's default limit on bound parameters per statement (SQLITE_MAX_VARIABLE_NUMBER
#: since 3.32); older builds allow 999.
SQLITE_MAX_VARIABLES = 32766


class MultiRowInsert:
    """Builds the multi-row ``INSERT`` statements of one table (``?`` placeholders)."""

    def __init__(
        self,
        table: str,
        columns: Sequence[str],
        *,
        max_variables: int = SQLITE_MAX_VARIABLES,
        suffix: str = "",
    ) -> None:
        if not columns:
            raise ValueError("a multi-row insert needs at least one column")
        self.table = table
        self.columns = tuple(columns)
        self.suffix = suffix
        self._tuple = "(" + ", ".join("?" * len(self.columns)) + ")"
        width = len(self.columns)
        # The largest power of two rows whose parameters fit in one statement.
        rows = max(1, max_variables // width)
        self.max_rows = 1 << (rows.bit_length() - 1)
        self._sql: dict[int, str] = {}

    def sql(self, rows: int) -> str:
        """The statement inserting ``rows`` rows (cached)."""
        text = self._sql.get(rows)
        if text is None:
            values = ", ".join([self._tuple] * rows)
            text = self._sql[rows] = (
                f"INSERT INTO {self.table} ({', '.join(self.columns)}) VALUES {values}"
                + (f" {self.suffix}" if self.suffix else "")
            )
        return text

    def chunks(self, flat: list[Any], rows: int) -> Iterator[tuple[str, list[Any]]]:
        """``(sql, parameters)`` pairs inserting ``rows`` rows whose values, row after row,
        are ``flat``: full chunks of :attr:`max_rows`, then the rest in power-of-two pieces."""
        width = len(self.columns)
        if len(flat) != rows * width:
            raise StoreError(
                f"{self.table}: {len(flat)} values for {rows} rows of {width} columns "
                f"({', '.join(self.columns)})"
            )
        start = 0
        left = rows
        while left:
            size = min(self.max_rows, 1 << (left.bit_length() - 1))
            end = start + size * width
            yield self.sql(size), flat if (start == 0 and end == len(flat)) else flat[start:end]
            start = end
            left -= size
