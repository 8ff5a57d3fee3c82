"""rolloutlog's generic append-only event log. Knows nothing about rollouts.

SQLite (embedded default) and PostgreSQL backends behind one :class:`EventStore` and an
in-memory :class:`MemoryEventStore`, both implementing :class:`EventStoreProtocol`; a
:class:`GroupCommitter` for batched durable appends; an :class:`EventCodec` mapping typed
pydantic events to rows; :class:`Indexer` for derived tables an application keeps in step
with the log; and one error hierarchy (:mod:`rolloutlog.eventstore.errors`).
"""

from .codec import EventCodec, EventModel
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
    WriterProcessError,
)
from .groupcommit import GroupCommitter
from .history import history_segments
from .indexing import Indexer
from .memory import MemoryEventStore
from .payloads import decode_arrays, encode_arrays
from .protocol import EventStoreProtocol
from .records import NewEvent, PayloadPut, RunInfo, Snapshot, StoredEvent
from .store import EventStore, normalise_url

__all__ = [
    "AppendConflictError",
    "CorruptEventError",
    "CorruptLogError",
    "CorruptPayloadError",
    "EpochFencedError",
    "EventCodec",
    "EventModel",
    "EventStore",
    "EventStoreProtocol",
    "GroupCommitClosedError",
    "GroupCommitter",
    "Indexer",
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
    "WriterProcessError",
    "decode_arrays",
    "encode_arrays",
    "history_segments",
    "normalise_url",
]
