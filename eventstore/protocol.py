"""The store contract: what :class:`EventStore` (SQL) and :class:`MemoryEventStore` share.

Code that only needs the log (the controller, replay, the group committer, metrics)
takes an :class:`EventStoreProtocol`; the contract suite in ``tests/store`` runs against
every implementation. SQL-only operations (compaction, SQL audit) take the concrete
:class:`rolloutlog.eventstore.EventStore`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from .indexing import Indexer
from .records import NewEvent, PayloadPut, RunInfo, Snapshot, StoredEvent


@runtime_checkable
class EventStoreProtocol(Protocol):
    """An append-only, per-run sequenced event log with fencing, snapshots and payloads."""

    #: ``"sqlite"``, ``"postgresql"`` or ``"memory"``.
    dialect: str
    readonly: bool

    def close(self) -> None:
        """Release resources."""
        ...

    # runs and epochs
    def create_run(
        self,
        run_id: str,
        *,
        config_fingerprint: str = "",
        config_json: str = "{}",
        epoch: int = 1,
        first_events: Sequence[NewEvent] = (),
        payload_puts: Sequence[PayloadPut] = (),
    ) -> RunInfo:
        """Register a new run with its first events (offsets ``1..``) in one transaction;
        :class:`RunExistsError` when the id is taken."""
        ...

    def get_run(self, run_id: str) -> RunInfo:
        """The run's row; :class:`RunNotFoundError` when absent."""
        ...

    def list_runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        ...

    def open_epoch(
        self,
        run_id: str,
        *,
        expected_epoch: int | None = None,
        resume_seq: int | None = None,
        lock_timeout_s: float | None = None,
    ) -> int:
        """Raise the run's epoch by one (fencing older writers); return the new epoch."""
        ...

    def history_segments(self, run_id: str, to_seq: int | None = None) -> list[tuple[int, int]]:
        """The run's history as inclusive ``(first, last)`` offset ranges, oldest first."""
        ...

    # append and read
    def add_indexer(self, indexer: Indexer) -> None:
        """Write ``indexer``'s derived rows in every later append's transaction."""
        ...

    def append(
        self,
        run_id: str,
        batch: Sequence[NewEvent],
        *,
        expected_seq: int,
        epoch: int,
        payload_puts: Sequence[PayloadPut] = (),
        lock_timeout_s: float | None = None,
    ) -> int:
        """Append ``batch`` atomically as ``expected_seq ..`` (with payloads and derived
        rows); return the last sequence. Conflicts and fencing write nothing."""
        ...

    def last_seq(self, run_id: str) -> int:
        """Sequence of the newest event (0 when empty)."""
        ...

    def read(
        self, run_id: str, from_seq: int = 1, to_seq: int | None = None, *, page_size: int = 2000
    ) -> Iterator[StoredEvent]:
        """Events ``from_seq..to_seq`` (inclusive), in order."""
        ...

    def read_history(
        self, run_id: str, to_seq: int | None = None, *, from_seq: int = 1
    ) -> Iterator[StoredEvent]:
        """The events of the history (see :meth:`history_segments`), in order."""
        ...

    def check_log(self, run_id: str | None = None) -> None:
        """Check each run's rows are exactly ``base..last_seq`` (:class:`CorruptLogError`)."""
        ...

    def derived_rows(
        self,
        table: str,
        run_id: str,
        from_seq: int = 1,
        to_seq: int | None = None,
        *,
        limit: int | None = None,
        **equals: Any,
    ) -> list[tuple[Any, ...]]:
        """Rows of a registered indexer's table for ``run_id`` in ``from_seq..to_seq``
        whose columns equal ``equals``, in sequence order, as the indexer built them;
        only the first ``limit`` of them when given."""
        ...

    # snapshots and payloads
    def save_snapshot(self, run_id: str, seq: int, schema_version: int, data: bytes) -> None:
        """Store a state blob that covers events ``1..seq``."""
        ...

    def load_snapshot(
        self, run_id: str, at_or_before: int | None = None, *, check: bool = True
    ) -> Snapshot | None:
        """The newest snapshot with ``seq <= at_or_before`` (any, when None), or None;
        the log checked whole up to it unless ``check`` is False."""
        ...

    def check_whole(self, run_id: str, upto: int, *, from_seq: int = 1) -> None:
        """Raise :class:`CorruptLogError` unless the run's rows ``from_seq..upto`` are whole."""
        ...

    def put_payload(self, run_id: str, payload_id: str, kind: str, data: bytes) -> None:
        """Store a binary payload (idempotent by id)."""
        ...

    def get_payload(self, run_id: str, payload_id: str) -> bytes:
        """A payload's bytes; :class:`PayloadNotFoundError` when absent."""
        ...
