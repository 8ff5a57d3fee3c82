"""The decider: ``decide(state, command) -> events`` and ``evolve(state, event, offset)``.

Both are pure of I/O, clock and randomness. Each concern (admission, siblings, buffer,
training, restore) owns its decide functions and its evolvers; this module only routes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from . import admission, buffer, engines, restore, siblings, training
from .commands import (
    AbortSibling,
    AdmitStep,
    Command,
    CompleteSibling,
    DispatchSiblings,
    EvictStale,
    FailSibling,
    MarkCheckpoint,
    PublishWeights,
    RecordEngineJoined,
    RecordEngineLost,
    RecordEngineRefit,
    RecordTrainStep,
    Restore,
    Resume,
    SelectBatch,
    StartRun,
)
from .errors import IllegalTransitionError, MonotonicityError, RunFailedError
from .events import RolloutEvent
from .state import RunState

_DECIDERS: dict[type, Callable[[RunState, Any], list[RolloutEvent]]] = {
    StartRun: admission.decide_start,
    AdmitStep: admission.decide_admit,
    DispatchSiblings: siblings.decide_dispatch,
    CompleteSibling: siblings.decide_complete,
    FailSibling: siblings.decide_fail,
    AbortSibling: siblings.decide_abort,
    SelectBatch: training.decide_select,
    RecordTrainStep: training.decide_train,
    PublishWeights: training.decide_publish,
    MarkCheckpoint: training.decide_checkpoint,
    Restore: restore.decide_restore,
    Resume: restore.decide_resume,
    EvictStale: lambda state, cmd: restore.decide_evict_stale(state, cmd.reason),
    RecordEngineJoined: engines.decide_joined,
    RecordEngineLost: engines.decide_lost,
    RecordEngineRefit: engines.decide_refit,
}

_EVOLVERS: dict[type, Callable[[RunState, Any], None]] = {
    **admission.EVOLVERS,
    **siblings.EVOLVERS,
    **buffer.EVOLVERS,
    **training.EVOLVERS,
    **restore.EVOLVERS,
    **engines.EVOLVERS,
}


_ALLOWED_AFTER_FAILURE = (
    Restore,
    Resume,
    MarkCheckpoint,
    RecordEngineJoined,
    RecordEngineLost,
    RecordEngineRefit,
)


def initial_state() -> RunState:
    """The state before any event."""
    return RunState()


def decide(state: RunState, command: Command) -> list[RolloutEvent]:
    """The events ``command`` causes, or a domain error naming the violated rule.

    Never mutates ``state``.
    """
    handler = _DECIDERS.get(type(command))
    if handler is None:
        raise TypeError(f"unknown command {type(command).__name__}")
    if state.config is None and not isinstance(command, StartRun):
        raise IllegalTransitionError("the run has not started")
    # A failed run can still be taken over (Resume fences the old writer), checkpointed
    # and restored, and engine membership (a fact about the world) is still recorded;
    # everything else is refused with the failure.
    if state.failure is not None and not isinstance(command, _ALLOWED_AFTER_FAILURE):
        raise RunFailedError(state.failure)
    return handler(state, command)


def evolve(state: RunState, event: RolloutEvent, offset: int) -> RunState:
    """Apply the event stored at ``offset``; updates ``state`` in place and returns it."""
    if offset <= state.last_seq:
        raise MonotonicityError(
            f"event at offset {offset} applied after offset {state.last_seq}", offset=offset
        )
    handler = _EVOLVERS.get(type(event))
    if handler is None:
        raise TypeError(f"no evolver for event type {type(event).__name__}")
    state.last_seq = offset
    handler(state, event)
    return state


def fold(events: Iterable[tuple[int, RolloutEvent]], state: RunState | None = None) -> RunState:
    """Apply ``(offset, event)`` pairs in order, starting from ``state`` or the initial one."""
    current = state if state is not None else initial_state()
    for offset, event in events:
        evolve(current, event, offset)
    return current
