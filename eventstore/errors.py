"""The base of every error rolloutlog raises, and the event store's errors.

:class:`RolloutlogError` is the one base under every exception class of the library
(store, domain, backends, runtime, configuration, audit...), defined here, in the lowest
layer, so that every layer can derive from it; ``rolloutlog.RolloutlogError`` is the
same class. Callers catch :class:`StoreError` (or one of its subclasses) whatever the
dialect; backend-specific driver exceptions never escape the store unwrapped.
"""

from __future__ import annotations

from typing import Any


class RolloutlogError(Exception):
    """Base class of every error rolloutlog raises (``except RolloutlogError`` catches
    them all). Subclasses keep the builtin bases callers catch them by (``ValueError``,
    ``KeyError``, ``RuntimeError``) as second bases.

    Every subclass pickles whole (type, message and attributes), whatever its
    constructor takes: an error raised in a child process arrives as it was raised.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take structured constructor arguments (AppendConflictError(run_id,
        # expected, actual)) while ``args`` holds the message, so the default pickling
        # would call them wrongly. Rebuild from args and attributes instead: an error
        # raised in the writer process arrives whole, type included (writer_process.py).
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def _rebuild_error(cls: type[RolloutlogError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    err = cls.__new__(cls)
    BaseException.__init__(err, *args)
    err.__dict__.update(state)
    return err


class StoreError(RolloutlogError):
    """Base class of every error raised by the event store."""


class StoreUrlError(StoreError, ValueError):
    """The database URL is malformed or names an unsupported dialect."""


class StoreUnavailableError(StoreError):
    """The database cannot be reached or opened (server down, missing directory, bad file)."""


class ReadOnlyStoreError(StoreError):
    """The database refuses writes (read-only file or read-only connection)."""


class SchemaMismatchError(StoreError):
    """The database schema is not at the migration head this code expects."""


class RunNotFoundError(StoreError, KeyError):
    """No run with this id exists in the log."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else "run not found"


class RunExistsError(StoreError):
    """A run with this id already exists."""


class AppendConflictError(StoreError):
    """The expected next sequence number did not match the log: another writer got there first.

    Nothing of the batch was written.
    """

    def __init__(self, run_id: str, expected_seq: int, actual_next_seq: int) -> None:
        self.run_id = run_id
        self.expected_seq = expected_seq
        self.actual_next_seq = actual_next_seq
        super().__init__(
            f"append conflict on run {run_id!r}: expected next sequence {expected_seq}, "
            f"but the log's next sequence is {actual_next_seq} (another writer appended); "
            "nothing of this batch was written"
        )


class EpochFencedError(StoreError):
    """The writer's epoch is older than the run's current epoch: a restore or a second
    controller has taken the run over. Nothing of the batch was written."""

    def __init__(self, run_id: str, writer_epoch: int, current_epoch: int) -> None:
        self.run_id = run_id
        self.writer_epoch = writer_epoch
        self.current_epoch = current_epoch
        super().__init__(
            f"run {run_id!r} is fenced: this writer holds epoch {writer_epoch} but the run is "
            f"at epoch {current_epoch} (a restore or another controller took over); "
            "nothing of this batch was written"
        )


class CorruptEventError(StoreError):
    """A stored event row cannot be decoded (bad JSON, fields that fail validation)."""

    def __init__(self, offset: int, event_type: str, reason: str) -> None:
        self.offset = offset
        self.event_type = event_type
        super().__init__(f"corrupt event at offset {offset} (type {event_type!r}): {reason}")


class UnknownEventTypeError(StoreError):
    """A stored event has a type that no registered schema knows."""

    def __init__(self, offset: int, event_type: str, version: int) -> None:
        self.offset = offset
        self.event_type = event_type
        self.version = version
        super().__init__(
            f"unknown event type {event_type!r} (schema version {version}) at offset {offset}: "
            "no schema is registered for it (is this log from a newer rolloutlog?)"
        )


class NewerSchemaVersionError(StoreError):
    """A stored event was written with a newer schema version than this code knows."""

    def __init__(self, offset: int, event_type: str, version: int, known: int) -> None:
        self.offset = offset
        self.event_type = event_type
        self.version = version
        self.known = known
        super().__init__(
            f"event {event_type!r} at offset {offset} has schema version {version}, newer than "
            f"the newest this code knows ({known}); upgrade rolloutlog to read this log"
        )


class CorruptPayloadError(StoreError):
    """A payload blob is truncated or not in the rolloutlog array format."""


class PayloadNotFoundError(StoreError, KeyError):
    """No payload with this id is stored for the run."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "payload not found"


class GroupCommitClosedError(StoreError):
    """The group committer was closed, or its writer failed; no more events are accepted."""


class WriterProcessError(StoreError):
    """The writer process (eventstore/writer_process.py) could not be started, died, or
    did not answer in time."""


class CorruptLogError(StoreError):
    """The run's stored rows are not exactly the offsets ``base..runs.last_seq``.

    ``kind`` is ``"missing"`` (a row of that range is absent), ``"duplicate"`` (an offset
    stored twice) or ``"extra"`` (a row below the base or beyond ``runs.last_seq``).
    ``offset`` is the first offset found wrong. Nothing read after it can be trusted, so
    every read path stops here instead of computing from an incomplete log.
    """

    def __init__(self, run_id: str, offset: int, kind: str, detail: str) -> None:
        self.run_id = run_id
        self.offset = offset
        self.kind = kind
        super().__init__(f"corrupt log of run {run_id!r} at offset {offset}: {kind} row ({detail})")


class LockTimeoutError(StoreError):
    """Waiting for a lock on the run's row took longer than the configured limit.

    ``holders`` describes the database sessions found holding it (pid, application name,
    state), when they could be found.
    """

    def __init__(self, message: str, holders: tuple[str, ...] = ()) -> None:
        self.holders = holders
        super().__init__(message)
