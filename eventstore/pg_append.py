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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import StoreError

#: The LISTEN/NOTIFY channel of appends; the payload is ``"<last_seq> <run_id>"``.
CHANNEL = "rolloutlog_appends"


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

    def sql(self, derived: Sequence[DerivedTable], *, payloads: bool) -> str:
        """The statement for a batch with these derived tables (cached per shape)."""
        key = (tuple(derived), payloads)
        text = self._sql.get(key)
        if text is None:
            text = self._sql[key] = self._build(derived, payloads=payloads)
        return text

    @staticmethod
    def _build(derived: Sequence[DerivedTable], *, payloads: bool) -> str:
        guard = "WHERE EXISTS (SELECT 1 FROM cas)"
        parts = [
            "cas AS (UPDATE runs SET last_seq = %(last)s WHERE run_id = %(run_id)s "
            "AND last_seq = %(prev)s AND current_epoch = %(epoch)s RETURNING run_id)",
            "ev AS (INSERT INTO events "
            "(run_id, seq, epoch, type, schema_version, recorded_at, payload) "
            "SELECT %(run_id)s, %(prev)s + u.n, %(epoch)s, u.t, u.v, u.ts, u.p "
            "FROM unnest(%(types)b::text[], %(versions)b::integer[], "
            "%(stamps)b::timestamptz[], %(payloads)b::text[]) "
            f"WITH ORDINALITY AS u(t, v, ts, p, n) {guard})",
        ]
        if payloads:
            parts.append(
                "pl AS (INSERT INTO payloads (run_id, payload_id, kind, data) "
                "SELECT %(run_id)s, u.i, u.k, u.d FROM unnest(%(put_ids)b::text[], "
                f"%(put_kinds)b::text[], %(put_data)b::bytea[]) AS u(i, k, d) {guard} "
                "ON CONFLICT DO NOTHING)"
            )
        for n, table in enumerate(derived):
            arrays = ", ".join(
                f"%(d{n}_{i})b::{sql_type}[]" for i, sql_type in enumerate(table.types)
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
        """The statement's parameters: one list per column."""
        last = expected_seq + len(batch) - 1
        params: dict[str, Any] = {
            "run_id": run_id,
            "prev": expected_seq - 1,
            "last": last,
            "epoch": epoch,
            "types": [ev.type for ev in batch],
            "versions": [ev.schema_version for ev in batch],
            "stamps": [ev.recorded_at for ev in batch],
            "payloads": [ev.payload for ev in batch],
            "notify": notify_payload(run_id, last),
        }
        if payload_puts:
            params["put_ids"] = [p.payload_id for p in payload_puts]
            params["put_kinds"] = [p.kind for p in payload_puts]
            params["put_data"] = [p.data for p in payload_puts]
        for n, (table, rows) in enumerate(zip(derived, derived_rows, strict=True)):
            width = len(table.columns)
            if any(len(row) != width for row in rows):
                raise StoreError(
                    f"{table.table}: a derived row does not have one value per column "
                    f"({', '.join(table.columns)})"
                )
            columns = list(zip(*rows, strict=True)) if rows else [()] * width
            for i, values in enumerate(columns):
                params[f"d{n}_{i}"] = list(values)
        return params
