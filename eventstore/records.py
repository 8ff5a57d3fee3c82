"""Plain records that cross the store boundary: events to append, events read back, runs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol


class NewEvent(NamedTuple):
    """An event ready to append: its type, schema version, JSON payload and timestamp.

    ``payload`` is already-encoded JSON text (the codec produces it); the store never
    re-serialises it, so what is read back is byte-for-byte what was appended.

    ``derived`` is opaque to the store: values that the store's indexers (see
    :class:`rolloutlog.eventstore.indexing.Indexer`) turn into rows of their own tables, in the
    append's transaction. It is never stored in the ``events`` table nor read back.

    A named tuple (immutable) rather than a frozen dataclass: one is built per event on
    the append path, and a frozen dataclass costs five times as much to build.
    """

    type: str
    schema_version: int
    payload: str
    recorded_at: datetime
    derived: tuple[Any, ...] | None = None


class EventRow(Protocol):
    """What :meth:`EventCodec.decode` reads of a row: a :class:`StoredEvent`, or any row
    with its fields (an application's row joined with its derived keys)."""

    @property
    def seq(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def schema_version(self) -> int: ...
    @property
    def payload(self) -> str: ...


class StoredEvent(NamedTuple):
    """An event as stored: a :class:`NewEvent` plus its run, sequence (offset) and epoch.

    A named tuple rather than a frozen dataclass: equally immutable, and five times
    cheaper to build, which is a fifth of the cost of reading and decoding an event.
    """

    run_id: str
    seq: int
    epoch: int
    type: str
    schema_version: int
    payload: str
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class PayloadPut:
    """A binary payload (token ids, logprobs) to store alongside an append, atomically."""

    payload_id: str
    kind: str
    data: bytes


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One row of the runs table."""

    run_id: str
    created_at: datetime
    config_fingerprint: str
    config_json: str
    current_epoch: int
    last_seq: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A saved state blob covering every event up to and including ``seq``."""

    run_id: str
    seq: int
    schema_version: int
    created_at: datetime
    data: bytes
