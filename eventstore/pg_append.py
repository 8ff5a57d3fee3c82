"""PostgreSQL: a whole append in one round trip.

An append (the compare-and-set on the run's row, the events, payloads and derived rows)
of up to ``chunk`` events (:data:`DEFAULT_CHUNK_EVENTS`) is one autocommit statement:
data-modifying CTEs fed by ``unnest`` of one array per column, each guarded by
``EXISTS (SELECT 1 FROM cas)``, ending with ``pg_notify`` on :data:`CHANNEL` so tailing
readers wake on commit. A larger batch goes as a libpq *pipeline* in one transaction
(head with the compare-and-set, which divides by zero when it matched no row; a
statement per further chunk; the tail), still one round trip, so the server inserts one
chunk while the client builds the next. An error makes the server skip the rest,
``COMMIT`` included; the store then drops the connection
(``EventStore._drop_failed_pipeline``). Statements are prepared.

Event columns go as text joined with U+001E (split by ``string_to_array`` in the
server, cheaper than psycopg's per-element array dump) unless a payload holds that
character; timestamps as exact integer microseconds since the epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine.url import URL

from .errors import StoreError
from .url_options import whole_number_option

#: The LISTEN/NOTIFY channel of appends; the payload is ``"<last_seq> <run_id>"``.
CHANNEL = "rolloutlog_appends"
#: Joins a batch's types and payloads into one text parameter each (see the docstring).
SEPARATOR = "\x1e"
#: Events per statement of a pipelined append (the URL's ``append_chunk_events``; 0: a
#: batch of any size is one statement). 250 was the fastest of 125, 250, 500 and 1,000.
DEFAULT_CHUNK_EVENTS = 250
#: The SQLSTATE of the head's refusal (``1 / count(*)`` over a compare-and-set that
#: matched no row): division_by_zero, which nothing else in an append can raise.
REFUSED_SQLSTATE = "22012"
#: rolloutlog's own options in a PostgreSQL URL's query, taken out before the driver sees
#: it: ``append_chunk_events`` (default :data:`DEFAULT_CHUNK_EVENTS`).
PG_URL_OPTIONS = ("append_chunk_events",)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_GUARD = " WHERE EXISTS (SELECT 1 FROM cas)"
_CAS = (
    "cas AS (UPDATE runs SET last_seq = %(last)s WHERE run_id = %(run_id)s "
    "AND last_seq = %(expected_last)s AND current_epoch = %(epoch)s RETURNING run_id)"
)
_NOTIFY = f"SELECT pg_notify('{CHANNEL}', %(notify)s)"
_PACKED_COLUMNS = (
    "string_to_array(%(types)s, chr(30)), "
    "string_to_array(%(versions)s, ',')::integer[], "
    "string_to_array(%(stamps)s, ',')::bigint[], "
    "string_to_array(%(payloads)s, chr(30))"
)
# interval * bigint goes through float8, inexact past 2^53 us: split the seconds from
# the microseconds so each product is exact (/ and % truncate toward zero together, so
# negative offsets add up too).
_PACKED_STAMP = (
    "timestamptz 'epoch' + (u.ts / 1000000) * interval '1 second' "
    "+ (u.ts %% 1000000) * interval '1 microsecond'"
)
_ARRAY_COLUMNS = (
    "%(types)b::text[], %(versions)b::integer[], %(stamps)b::timestamptz[], %(payloads)b::text[]"
)


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


def pg_chunk_events(url: URL) -> int:
    """The ``append_chunk_events`` of a PostgreSQL URL (see :data:`PG_URL_OPTIONS`)."""
    raw = url.query.get("append_chunk_events", DEFAULT_CHUNK_EVENTS)
    return whole_number_option(
        url, raw, "append_chunk_events", "events (0: every append is one statement)"
    )


def pg_connect_url(url: URL) -> URL:
    """A PostgreSQL URL without rolloutlog's own options: what the driver is given."""
    return url.difference_update_query(PG_URL_OPTIONS)


class PgAppendStatement:
    """Builds the append's statements and their parameters (``%(name)s`` placeholders).

    :meth:`statement`: the whole batch in one statement. :meth:`head`, :meth:`chunk` and
    :meth:`tail`: the statements of a pipelined append, in that order (the module
    docstring says how they fit together).
    """

    def __init__(self) -> None:
        self._sql: dict[tuple[Any, ...], str] = {}

    def _cached(self, key: tuple[Any, ...], build: Any) -> str:
        text = self._sql.get(key)
        if text is None:
            text = self._sql[key] = build()
        return text

    def sql(
        self,
        derived: Sequence[DerivedTable],
        *,
        payloads: bool,
        packed: bool,
        packed_derived: tuple[tuple[bool, ...], ...] | None = None,
    ) -> str:
        """The one-statement append for a batch with these derived tables (cached per shape).

        ``packed``: the event columns go as text; ``packed_derived``: which derived
        columns do, per table (:meth:`params` says which can; None: none).
        """
        if packed_derived is None:
            packed_derived = tuple((False,) * len(t.columns) for t in derived)

        def build() -> str:
            parts = [_CAS, f"ev AS ({_events_sql(packed)}{_GUARD})"]
            if payloads:
                parts.append(_payloads_cte(_GUARD))
            parts += _derived_ctes(derived, packed_derived, _GUARD)
            return "WITH " + ",\n".join(parts) + f"\n{_NOTIFY} FROM cas"

        return self._cached(("one", tuple(derived), payloads, packed, packed_derived), build)

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
        """The one statement's parameters: one list (or packed text) per column.

        ``params["packed"]`` and ``params["packed_derived"]`` say which: pass them to
        :meth:`sql` (and leave them out of the execution's parameters; :meth:`statement`
        does both).
        """
        last = expected_seq + len(batch) - 1
        params = _event_params(batch, run_id, expected_seq, epoch)
        params.update(
            last=last, expected_last=expected_seq - 1, notify=notify_payload(run_id, last)
        )
        params.update(_payload_params(payload_puts))
        params.update(_derived_params(derived_rows, derived))
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
        """The append as one statement and its parameters, in the shape the batch allows."""
        params = self.params(
            run_id, expected_seq, epoch, batch, payload_puts, derived_rows, derived
        )
        packed = params.pop("packed")
        packed_derived = params.pop("packed_derived")
        sql = self.sql(
            derived, payloads=bool(payload_puts), packed=packed, packed_derived=packed_derived
        )
        return sql, params

    def head(
        self,
        run_id: str,
        expected_seq: int,
        epoch: int,
        last: int,
        first_events: Sequence[Any],
        payload_puts: Sequence[Any],
    ) -> tuple[str, dict[str, Any]]:
        """A pipelined append's first statement: the compare-and-set (``expected_seq - 1``
        to ``last``), ``first_events`` and the payloads. When the compare-and-set matches
        no row it fails with SQLSTATE :data:`REFUSED_SQLSTATE`, which aborts the rest."""
        params = _event_params(first_events, run_id, expected_seq, epoch)
        packed = params.pop("packed")
        params.update(last=last, expected_last=expected_seq - 1)
        params.update(_payload_params(payload_puts))

        def build() -> str:
            parts = [_CAS, f"ev AS ({_events_sql(packed)}{_GUARD})"]
            if payload_puts:
                parts.append(_payloads_cte(_GUARD))
            return "WITH " + ",\n".join(parts) + "\nSELECT 1 / count(*) FROM cas"

        return self._cached(("head", packed, bool(payload_puts)), build), params

    def chunk(
        self, run_id: str, first_seq: int, epoch: int, events: Sequence[Any]
    ) -> tuple[str, dict[str, Any]]:
        """A pipelined append's statement of ``events`` as offsets ``first_seq ..`` (after
        the head, in its transaction: unguarded, the head has checked)."""
        params = _event_params(events, run_id, first_seq, epoch)
        packed = params.pop("packed")
        return self._cached(("chunk", packed), lambda: _events_sql(packed)), params

    def tail(
        self,
        run_id: str,
        last: int,
        derived_rows: Sequence[Sequence[tuple[Any, ...]]],
        derived: Sequence[DerivedTable],
    ) -> tuple[str, dict[str, Any]]:
        """A pipelined append's last statement: the whole batch's derived rows and the
        notification of ``last``."""
        params: dict[str, Any] = {"notify": notify_payload(run_id, last)}
        params.update(_derived_params(derived_rows, derived))
        packed_derived = params.pop("packed_derived")

        def build() -> str:
            ctes = _derived_ctes(derived, packed_derived, "")
            return ("WITH " + ",\n".join(ctes) + "\n" if ctes else "") + _NOTIFY

        return self._cached(("tail", tuple(derived), packed_derived), build), params


def _events_sql(packed: bool) -> str:
    """The INSERT of a batch's events (offsets ``%(first_prev)s + 1 ..``), unguarded."""
    columns, stamp = (_PACKED_COLUMNS, _PACKED_STAMP) if packed else (_ARRAY_COLUMNS, "u.ts")
    return (
        "INSERT INTO events (run_id, seq, epoch, type, schema_version, recorded_at, payload) "
        f"SELECT %(run_id)s, %(first_prev)s + u.n, %(epoch)s, u.t, u.v, {stamp}, u.p "
        f"FROM unnest({columns}) WITH ORDINALITY AS u(t, v, ts, p, n)"
    )


def _payloads_cte(guard: str) -> str:
    return (
        "pl AS (INSERT INTO payloads (run_id, payload_id, kind, data) "
        "SELECT %(run_id)s, u.i, u.k, u.d FROM unnest(%(put_ids)b::text[], "
        f"%(put_kinds)b::text[], %(put_data)b::bytea[]) AS u(i, k, d){guard} "
        "ON CONFLICT DO NOTHING)"
    )


def _derived_ctes(
    derived: Sequence[DerivedTable], packed_derived: tuple[tuple[bool, ...], ...], guard: str
) -> list[str]:
    parts = []
    for n, (table, flags) in enumerate(zip(derived, packed_derived, strict=True)):
        arrays = ", ".join(
            _unpack_sql(f"d{n}_{i}", sql_type) if flag else f"%(d{n}_{i})b::{sql_type}[]"
            for i, (sql_type, flag) in enumerate(zip(table.types, flags, strict=True))
        )
        parts.append(
            f"d{n} AS (INSERT INTO {table.table} ({', '.join(table.columns)}) "
            f"SELECT * FROM unnest({arrays}){guard})"
        )
    return parts


def _event_params(batch: Sequence[Any], run_id: str, first_seq: int, epoch: int) -> dict[str, Any]:
    """The event columns of ``batch`` (offsets ``first_seq ..``): packed text where the
    batch allows it, else one list per column; ``"packed"`` says which."""
    params: dict[str, Any] = {"run_id": run_id, "first_prev": first_seq - 1, "epoch": epoch}
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
    return params


def _payload_params(payload_puts: Sequence[Any]) -> dict[str, Any]:
    if not payload_puts:
        return {}
    return {
        "put_ids": [p.payload_id for p in payload_puts],
        "put_kinds": [p.kind for p in payload_puts],
        "put_data": [p.data for p in payload_puts],
    }


def _derived_params(
    derived_rows: Sequence[Sequence[tuple[Any, ...]]], derived: Sequence[DerivedTable]
) -> dict[str, Any]:
    """One list (or packed text) per derived column, ``d<table>_<column>``, and
    ``"packed_derived"``: which are packed, per table."""
    params: dict[str, Any] = {}
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
