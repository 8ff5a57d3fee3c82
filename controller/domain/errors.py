"""Domain errors. An illegal transition is an error that names the violated rule."""

from __future__ import annotations

from rolloutlog.eventstore.errors import RolloutlogError


class DomainError(RolloutlogError):
    """Base of every rollout-domain error."""


class IllegalTransitionError(DomainError):
    """A command is not allowed in the current state."""


class UnknownGroupError(IllegalTransitionError):
    """A command or event names a group the state does not hold."""


class StaleAttemptError(IllegalTransitionError):
    """A result arrived from a superseded attempt (fencing: rejected, never merged)."""


class LookaheadExceededError(IllegalTransitionError):
    """Admission would run the dispatch cursor past train step + lookahead."""


class DatasetExhaustedError(IllegalTransitionError):
    """No prompt is left to pull."""


class BatchNotReadyError(IllegalTransitionError):
    """The sampler cannot form the batch yet (the reason says what is missing)."""


class StepOutOfOrderError(IllegalTransitionError):
    """A train step, batch or checkpoint names a step other than the next one."""


class UnknownPayloadError(DomainError):
    """A command names a payload that is neither stored nor stored with the command."""


class RunFailedError(DomainError):
    """The drop policy ``fail`` stopped the run."""


class RestoreError(DomainError):
    """A restore cannot proceed (no checkpoint offset, fingerprint mismatch, ...)."""


class InvariantViolation(DomainError):
    """An invariant (docs/concepts.md) does not hold. ``number`` is the invariant's number."""

    number: int = 0

    def __init__(self, message: str, *, groups: tuple[int, ...] = (), offset: int | None = None):
        super().__init__(message)
        self.groups = groups
        self.offset = offset


class CursorBehindError(InvariantViolation):
    """1: a cursor is behind work stamped in the buffer or ledger."""

    number = 1


class ConservationError(InvariantViolation):
    """2: a prompt is lost or duplicated, or a group is in no/two phases."""

    number = 2


class SelectionError(InvariantViolation):
    """3: a group selected twice, non-consecutive train steps, or an unrecorded shortfall."""

    number = 3


class SiblingAccountingError(InvariantViolation):
    """4: sibling counts, ready-ness or attempt fencing are inconsistent."""

    number = 4


class LoanError(InvariantViolation):
    """5: a borrow without a repayment or a recorded debt."""

    number = 5


class StalenessError(InvariantViolation):
    """6: a selected group exceeds the sampler's staleness bound."""

    number = 6


class MonotonicityError(InvariantViolation):
    """7: sequence, epoch, train step or weight version went backwards."""

    number = 7


class UnknownReferenceError(InvariantViolation):
    """8: an event refers to an unknown group or prompt."""

    number = 8
