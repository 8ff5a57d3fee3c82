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
    """Builds the multi-row ``INSERT`` statements of one table (``?`` placeholders).

    ``shared``: columns whose value is the same for every row of a batch (the run id, the
    writer's epoch), bound once per statement instead of once per row: the statement is
    ``INSERT INTO t (...) SELECT ?1, column1, ... FROM (VALUES (...), ...)``, and its
    parameters are the shared values, then the other columns' values row after row.
    """

    def __init__(
        self,
        table: str,
        columns: Sequence[str],
        *,
        max_variables: int = SQLITE_MAX_VARIABLES,
        suffix: str = "",
        shared: Sequence[str] = (),
    ) -> None:
        if not columns:
            raise ValueError("a multi-row insert needs at least one column")
        unknown = [c for c in shared if c not in columns]
        if unknown:
            raise ValueError(f"shared columns {unknown} are not columns of {table}")
        if shared and suffix:
            # INSERT ... SELECT before ON CONFLICT needs a WHERE clause to parse: not needed.
            raise ValueError("shared columns and a suffix cannot be combined")
        self.table = table
        self.columns = tuple(columns)
        self.shared = tuple(shared)
        #: The columns given row by row (in ``chunks``' flat values).
        self.per_row = tuple(c for c in self.columns if c not in self.shared)
        if not self.per_row:
            raise ValueError("a multi-row insert needs at least one column per row")
        self.suffix = suffix
        self._tuple = "(" + ", ".join("?" * len(self.per_row)) + ")"
        width = len(self.per_row)
        #: The most rows whose parameters fit in one statement.
        self.max_rows = max(1, (max_variables - len(self.shared)) // width)
        if self.shared:
            select = ", ".join(
                f"?{self.shared.index(c) + 1}"
                if c in self.shared
                else f"column{self.per_row.index(c) + 1}"
                for c in self.columns
            )
            self._head = f"INSERT INTO {table} ({', '.join(self.columns)}) SELECT {select} FROM ("
        self._sql: dict[int, str] = {}

    def sql(self, rows: int) -> str:
        """The statement inserting ``rows`` rows (the texts of recent sizes are kept)."""
        text = self._sql.get(rows)
        if text is None:
            if len(self._sql) >= _KEPT_SIZES:
                self._sql.clear()
            values = ", ".join([self._tuple] * rows)
            if self.shared:
                text = f"{self._head}VALUES {values})"
            else:
                text = f"INSERT INTO {self.table} ({', '.join(self.columns)}) VALUES {values}" + (
                    f" {self.suffix}" if self.suffix else ""
                )
            self._sql[rows] = text
        return text

    def chunks(
        self, flat: list[Any], rows: int, shared: Sequence[Any] = ()
    ) -> Iterator[tuple[str, list[Any]]]:
        """``(sql, parameters)`` pairs inserting ``rows`` rows whose values of the
        :attr:`per_row` columns, row after row, are ``flat`` (and of the shared columns,
        ``shared``): as few statements as the parameter limit allows."""
        width = len(self.per_row)
        if len(flat) != rows * width or len(shared) != len(self.shared):
            raise StoreError(
                f"{self.table}: {len(flat)} values for {rows} rows of {width} columns "
                f"({', '.join(self.per_row)}) and {len(shared)} for the shared "
                f"({', '.join(self.shared)})"
            )
        pieces = -(-rows // self.max_rows)  # ceil: equal pieces, so sizes repeat
        start = 0
        for i in range(pieces):
            size = rows // pieces + (1 if i < rows % pieces else 0)
            end = start + size * width
            part = flat if (start == 0 and end == len(flat)) else flat[start:end]
            yield self.sql(size), [*shared, *part] if shared else part
            start = end
