"""rolloutlog's generic append-only event log. Knows nothing about rollouts.

SQLite (embedded default) and PostgreSQL backends behind one :class:`EventStore`, a
:class:`GroupCommitter` for batched durable appends, an :class:`EventCodec` mapping
typed pydantic events to rows, and one error hierarchy (:mod:`rolloutlog.eventstore.errors`).
"""

from .codec import NO_AUDIT_KEYS, AuditKeys, EventCodec, EventModel
from .errors import (
    AppendConflictError,
    CorruptEventError,
    CorruptLogError,
    CorruptPayloadError,
    EpochFencedError,
    GroupCommitClosedError,
    LockTimeoutError,
    NewerSchemaVersionError,
    PayloadNotFoundError,
    ReadOnlyStoreError,
    RunExistsError,
    RunNotFoundError,
    SchemaMismatchError,
    StoreError,
    StoreUnavailableError,
    StoreUrlError,
    UnknownEventTypeError,
)
from .groupcommit import GroupCommitter
from .history import history_segments
from .memory import MemoryEventStore
from .payloads import decode_arrays, encode_arrays
from .records import NewEvent, PayloadPut, RunInfo, Snapshot, StoredEvent
from .store import EventStore, normalise_url

__all__ = [
    "NO_AUDIT_KEYS",
    "AppendConflictError",
    "AuditKeys",
    "CorruptEventError",
    "CorruptLogError",
    "CorruptPayloadError",
    "EpochFencedError",
    "EventCodec",
    "EventModel",
    "EventStore",
    "GroupCommitClosedError",
    "GroupCommitter",
    "LockTimeoutError",
    "MemoryEventStore",
    "NewEvent",
    "NewerSchemaVersionError",
    "PayloadNotFoundError",
    "PayloadPut",
    "ReadOnlyStoreError",
    "RunExistsError",
    "RunInfo",
    "RunNotFoundError",
    "SchemaMismatchError",
    "Snapshot",
    "StoreError",
    "StoreUnavailableError",
    "StoreUrlError",
    "StoredEvent",
    "UnknownEventTypeError",
    "decode_arrays",
    "encode_arrays",
    "history_segments",
    "normalise_url",
]
