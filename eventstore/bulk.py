"""Multi-row INSERT statements: a batch of rows in a few statements instead of one per row.

``executemany`` steps the statement once per row and gives the GIL back between rows, so
a commit thread competing with a busy event loop pays a thread switch per row. One
``INSERT ... VALUES (...), (...), ...`` binds the whole batch in C and steps once. Each
statement is one more GIL hand-off (when the event loop is busy, getting the GIL back
costs the commit thread up to the interpreter's switch interval, 5 ms), so a batch goes
in as few statements as the parameter limit allows: one, up to :attr:`max_rows` rows.
Preparing a statement of a new size costs far less than a hand-off; the texts of the
most recent sizes are kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .errors import StoreError

#: SQLite's default limit on bound parameters per statement (SQLITE_MAX_VARIABLE_NUMBER
#: since 3.32); older builds allow 999.
SQLITE_MAX_VARIABLES = 32766
#: Statement texts kept per table (one per distinct row count).
_KEPT_SIZES = 256


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
        #: The most rows whose parameters fit in one statement.
        self.max_rows = max(1, max_variables // width)
        self._sql: dict[int, str] = {}

    def sql(self, rows: int) -> str:
        """The statement inserting ``rows`` rows (the texts of recent sizes are kept)."""
        text = self._sql.get(rows)
        if text is None:
            if len(self._sql) >= _KEPT_SIZES:
                self._sql.clear()
            values = ", ".join([self._tuple] * rows)
            text = self._sql[rows] = (
                f"INSERT INTO {self.table} ({', '.join(self.columns)}) VALUES {values}"
                + (f" {self.suffix}" if self.suffix else "")
            )
        return text

    def chunks(self, flat: list[Any], rows: int) -> Iterator[tuple[str, list[Any]]]:
        """``(sql, parameters)`` pairs inserting ``rows`` rows whose values, row after row,
        are ``flat``: as few statements as the parameter limit allows."""
        width = len(self.columns)
        if len(flat) != rows * width:
            raise StoreError(
                f"{self.table}: {len(flat)} values for {rows} rows of {width} columns "
                f"({', '.join(self.columns)})"
            )
        pieces = -(-rows // self.max_rows)  # ceil: equal pieces, so sizes repeat
        start = 0
        for i in range(pieces):
            size = rows // pieces + (1 if i < rows % pieces else 0)
            end = start + size * width
            yield self.sql(size), flat if (start == 0 and end == len(flat)) else flat[start:end]
            start = end
