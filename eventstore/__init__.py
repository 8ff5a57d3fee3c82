"""rolloutlog's generic append-only event log. Knows nothing about rollouts.

SQLite (embedded default) and PostgreSQL backends behind one :class:`EventStore` and an
in-memory :class:`MemoryEventStore`, both implementing :class:`EventStoreProtocol`; a
:class:`Committer` for batched durable appends (:func:`open_committer`: on a thread,
:class:`GroupCommitter`, or in a writer process); an :class:`EventCodec` mapping typed
pydantic events to rows; :class:`Indexer` for derived tables an application keeps in step
with the log; and one error hierarchy (:mod:`rolloutlog.eventstore.errors`).
"""

# The public names are imported on first use (PEP 562), so that a process that needs one
# module (the writer process needs the store, not pydantic's codec) pays only for it.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec import EventCodec, EventModel
    from .committer import Committer
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
        RolloutlogError,
        RunExistsError,
        RunNotFoundError,
        SchemaMismatchError,
        StoreError,
        StoreUnavailableError,
        StoreUrlError,
        UnknownEventTypeError,
        WriterProcessError,
    )
    from .groupcommit import GroupCommitter, open_committer
    from .history import history_segments
    from .indexing import Indexer
    from .memory import MemoryEventStore
    from .payloads import decode_arrays, encode_arrays
    from .protocol import EventStoreProtocol
    from .records import NewEvent, PayloadPut, RunInfo, Snapshot, StoredEvent
    from .store import EventStore, normalise_url

# This folder is the package rolloutlog.eventstore (pyproject's package-dir). Imported as a bare
# `eventstore` (the repository root on sys.path, an IDE's auto-import) it would be a second copy
# of every module, whose classes and errors are not rolloutlog's: refuse it.
if __name__ == "eventstore":
    raise ImportError(
        "import rolloutlog.eventstore, not eventstore: this folder is installed as the package "
        "rolloutlog.eventstore, and a bare `eventstore` import would load a second copy of it",
        name=__name__,
    )

# Public name -> the module of this package that defines it.
_PUBLIC: dict[str, str] = {
    "EventCodec": "codec",
    "EventModel": "codec",
    "AppendConflictError": "errors",
    "CorruptEventError": "errors",
    "CorruptLogError": "errors",
    "CorruptPayloadError": "errors",
    "EpochFencedError": "errors",
    "GroupCommitClosedError": "errors",
    "LockTimeoutError": "errors",
    "NewerSchemaVersionError": "errors",
    "PayloadNotFoundError": "errors",
    "ReadOnlyStoreError": "errors",
    "RunExistsError": "errors",
    "RolloutlogError": "errors",
    "RunNotFoundError": "errors",
    "SchemaMismatchError": "errors",
    "StoreError": "errors",
    "StoreUnavailableError": "errors",
    "StoreUrlError": "errors",
    "UnknownEventTypeError": "errors",
    "WriterProcessError": "errors",
    "Committer": "committer",
    "GroupCommitter": "groupcommit",
    "open_committer": "groupcommit",
    "history_segments": "history",
    "Indexer": "indexing",
    "MemoryEventStore": "memory",
    "decode_arrays": "payloads",
    "encode_arrays": "payloads",
    "EventStoreProtocol": "protocol",
    "NewEvent": "records",
    "PayloadPut": "records",
    "RunInfo": "records",
    "Snapshot": "records",
    "StoredEvent": "records",
    "EventStore": "store",
    "normalise_url": "store",
}

__all__ = [
    "AppendConflictError",
    "Committer",
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
    "RolloutlogError",
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
    "open_committer",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
