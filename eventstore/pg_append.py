"""PostgreSQL: a whole append in one statement, one round trip.

An append is a compare-and-set on the run's row, the batch's events, their payloads and
the indexers' derived rows. Sent as separate statements inside BEGIN ... COMMIT that is
at least four round trips (psycopg sends BEGIN and COMMIT on their own). Here they are
one statement, run in autocommit mode (a single statement is its own transaction, so it
is all or nothing): data-modifying CTEs fed by ``unnest`` of one array per column, each
guarded by ``EXISTS (SELECT 1 FROM cas)`` so nothing is written unless the
compare-and-set matched. The statement ends with ``pg_notify`` on :data:`CHANNEL`,
delivered when it commits, so readers that tail the log wake on the append instead of
polling.

The event columns go as text where they can: psycopg dumps an array element by element
in Python (about 4 us per event for four columns), while ``string_to_array`` splits one
text parameter in the server's C code. Types and payloads are joined with the ASCII
record separator (U+001E), which JSON text never holds unescaped; a batch where one does
(the store does not parse payloads) goes as arrays instead. Timestamps go as integer
microseconds since the epoch, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from .errors import StoreError

#: The LISTEN/NOTIFY channel of appends; the payload is ``"<last_seq> <run_id>"``.
CHANNEL = "rolloutlog_appends"
#: Joins a batch's types and payloads into one text parameter each (see the docstring).
SEPARATOR = "\x1e"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class DerivedTable:
    """An indexer's table as the append statement writes it: columns and their SQL types."""

    table: str
    columns: tuple[str, ...]
    types: tuple[str, ...]


def notify_payload(run_id: str, last_seq: int) -> str:
    """What an append sends on :data:`CHANNEL` (parsed by :func:`parse_notify`)."""
    return f"{last_seq} {run_id}"


def parse_notify(payload: str) -> tuple[str, int] | None:
    """``(run_id, last_seq)`` of a notification, or None for one this store did not send."""
    seq, _, run_id = payload.partition(" ")
    if not run_id or not seq.isdigit():
        return None
    return run_id, int(seq)


class PgAppendStatement:
    """Builds the one-statement append and its parameters (``%(name)s`` placeholders)."""

    def __init__(self) -> None:
        self._sql: dict[tuple[Any, ...], str] = {}

    def sql(
        self,
        derived: Sequence[DerivedTable],
        *,
        payloads: bool,
        packed: bool,
        packed_derived: tuple[tuple[bool, ...], ...] | None = None,
    ) -> str:
        """The statement for a batch with these derived tables (cached per shape).

        ``packed``: the event columns go as text; ``packed_derived``: which derived
        columns do, per table (:meth:`params` says which can; None: none).
        """
        if packed_derived is None:
            packed_derived = tuple((False,) * len(t.columns) for t in derived)
        key = (tuple(derived), payloads, packed, packed_derived)
        text = self._sql.get(key)
        if text is None:
            text = self._sql[key] = self._build(
                derived, payloads=payloads, packed=packed, packed_derived=packed_derived
            )
        return text

    @staticmethod
    def _build(
        derived: Sequence[DerivedTable],
        *,
        payloads: bool,
        packed: bool,
        packed_derived: tuple[tuple[bool, ...], ...],
    ) -> str:
        guard = "WHERE EXISTS (SELECT 1 FROM cas)"
        if packed:
            columns = (
                "string_to_array(%(types)s, chr(30)), "
                "string_to_array(%(versions)s, ',')::integer[], "
                "string_to_array(%(stamps)s, ',')::bigint[], "
                "string_to_array(%(payloads)s, chr(30))"
            )
            # interval * bigint goes through float8, inexact past 2^53 us: split the
            # seconds from the microseconds so each product is exact (/ and % truncate
            # toward zero together, so negative offsets add up too).
            stamp = (
                "timestamptz 'epoch' + (u.ts / 1000000) * interval '1 second' "
                "+ (u.ts %% 1000000) * interval '1 microsecond'"
            )
        else:
            columns = (
                "%(types)b::text[], %(versions)b::integer[], "
                "%(stamps)b::timestamptz[], %(payloads)b::text[]"
            )
            stamp = "u.ts"
        parts = [
            "cas AS (UPDATE runs SET last_seq = %(last)s WHERE run_id = %(run_id)s "
            "AND last_seq = %(prev)s AND current_epoch = %(epoch)s RETURNING run_id)",
            "ev AS (INSERT INTO events "
            "(run_id, seq, epoch, type, schema_version, recorded_at, payload) "
            f"SELECT %(run_id)s, %(prev)s + u.n, %(epoch)s, u.t, u.v, {stamp}, u.p "
            f"FROM unnest({columns}) "
            f"WITH ORDINALITY AS u(t, v, ts, p, n) {guard})",
        ]
        if payloads:
            parts.append(
                "pl AS (INSERT INTO payloads (run_id, payload_id, kind, data) "
                "SELECT %(run_id)s, u.i, u.k, u.d FROM unnest(%(put_ids)b::text[], "
                f"%(put_kinds)b::text[], %(put_data)b::bytea[]) AS u(i, k, d) {guard} "
                "ON CONFLICT DO NOTHING)"
            )
        for n, (table, flags) in enumerate(zip(derived, packed_derived, strict=True)):
            arrays = ", ".join(
                _unpack_sql(f"d{n}_{i}", sql_type) if flag else f"%(d{n}_{i})b::{sql_type}[]"
                for i, (sql_type, flag) in enumerate(zip(table.types, flags, strict=True))
            )
            parts.append(
                f"d{n} AS (INSERT INTO {table.table} ({', '.join(table.columns)}) "
                f"SELECT * FROM unnest({arrays}) {guard})"
            )
        return "WITH " + ",\n".join(parts) + f"\nSELECT pg_notify('{CHANNEL}', %(notify)s) FROM cas"

    @staticmethod
    def params(
        run_id: str,
        expected_seq: int,
        epoch: int,
        batch: Sequence[Any],
        payload_puts: Sequence[Any],
        derived_rows: Sequence[Sequence[tuple[Any, ...]]],
        derived: Sequence[DerivedTable],
    ) -> dict[str, Any]:
        """The statement's parameters: one list (or packed text) per column.

        ``params["packed"]`` says which: pass it to :meth:`sql` (and leave it out of the
        execution's parameters; :meth:`statement` does both).
        """
        last = expected_seq + len(batch) - 1
        params: dict[str, Any] = {
            "run_id": run_id,
            "prev": expected_seq - 1,
            "last": last,
            "epoch": epoch,
            "notify": notify_payload(run_id, last),
        }
        try:
            types = SEPARATOR.join([ev.type for ev in batch])
            payloads = SEPARATOR.join([ev.payload for ev in batch])
            # One separator between each two events and none inside one: else as arrays.
            # An empty text splits into no element at all (not one empty one): arrays too.
            packed = (
                types.count(SEPARATOR) == payloads.count(SEPARATOR) == len(batch) - 1
                and types != ""
                and payloads != ""
            )
            stamps = [str((ev.recorded_at - _EPOCH) // _MICROSECOND) for ev in batch]
        except TypeError:
            # A value that is not text (None), or a naive datetime: as arrays, where the
            # database refuses or converts it exactly as it always did.
            packed = False
        if packed:
            params["types"] = types
            params["payloads"] = payloads
            params["versions"] = ",".join([str(ev.schema_version) for ev in batch])
            params["stamps"] = ",".join(stamps)
        else:
            params["types"] = [ev.type for ev in batch]
            params["versions"] = [ev.schema_version for ev in batch]
            params["stamps"] = [ev.recorded_at for ev in batch]
            params["payloads"] = [ev.payload for ev in batch]
        params["packed"] = packed
        if payload_puts:
            params["put_ids"] = [p.payload_id for p in payload_puts]
            params["put_kinds"] = [p.kind for p in payload_puts]
            params["put_data"] = [p.data for p in payload_puts]
        packed_derived: list[tuple[bool, ...]] = []
        for n, (table, rows) in enumerate(zip(derived, derived_rows, strict=True)):
            width = len(table.columns)
            if any(len(row) != width for row in rows):
                raise StoreError(
                    f"{table.table}: a derived row does not have one value per column "
                    f"({', '.join(table.columns)})"
                )
            columns = list(zip(*rows, strict=True)) if rows else [()] * width
            flags = []
            for i, (values, sql_type) in enumerate(zip(columns, table.types, strict=True)):
                text = _pack_column(values, sql_type)
                params[f"d{n}_{i}"] = list(values) if text is None else text
                flags.append(text is not None)
            packed_derived.append(tuple(flags))
        params["packed_derived"] = tuple(packed_derived)
        return params

    def statement(
        self,
        run_id: str,
        expected_seq: int,
        epoch: int,
        batch: Sequence[Any],
        payload_puts: Sequence[Any],
        derived_rows: Sequence[Sequence[tuple[Any, ...]]],
        derived: Sequence[DerivedTable],
    ) -> tuple[str, dict[str, Any]]:
        """The append's SQL and its parameters, in the shape the batch allows."""
        params = self.params(
            run_id, expected_seq, epoch, batch, payload_puts, derived_rows, derived
        )
        packed = params.pop("packed")
        packed_derived = params.pop("packed_derived")
        sql = self.sql(
            derived, payloads=bool(payload_puts), packed=packed, packed_derived=packed_derived
        )
        return sql, params


#: Derived column types sent as comma-joined integers ('' for NULL) when packed.
_INTEGER_TYPES = frozenset({"bigint", "integer", "smallint"})


def _pack_column(values: Sequence[Any], sql_type: str) -> str | None:
    """A derived column as one text parameter, or None where it must go as an array.

    Integers (exactly ``int``, or None) are joined with commas, NULL as an empty element;
    text (exactly ``str``, no NULL, no separator) with U+001E. A text that would be empty
    while the column has a value (one NULL, one empty string) goes as an array:
    ``string_to_array('')`` is an empty array, not one element.
    """
    if sql_type in _INTEGER_TYPES:
        if not all(type(v) is int or v is None for v in values):
            return None
        text = ",".join(["" if v is None else str(v) for v in values])
    elif sql_type == "text" or sql_type.startswith("character varying"):
        if not all(type(v) is str for v in values):
            return None
        text = SEPARATOR.join(values)
        if text.count(SEPARATOR) != max(len(values) - 1, 0):
            return None
    else:
        return None
    if text == "" and values:
        return None
    return text


def _unpack_sql(name: str, sql_type: str) -> str:
    """The SQL that splits :func:`_pack_column`'s text back into a ``sql_type`` array."""
    if sql_type in _INTEGER_TYPES:
        return f"string_to_array(%({name})s, ',', '')::{sql_type}[]"
    return f"string_to_array(%({name})s, chr(30))::{sql_type}[]"
