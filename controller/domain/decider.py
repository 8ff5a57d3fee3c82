"""The decider: ``decide(state, command) -> events`` and ``evolve(state, event, offset)``.

Both are pure of I/O, clock and randomness. Each concern (admission, siblings, buffer,
training, restore) owns its decide functions and its evolvers; this module only routes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from . import admission, buffer, commands, engines, restore, siblings, training, trajectory
from .errors import IllegalTransitionError, MonotonicityError, RunFailedError
from .events import RolloutEvent
from .state import RunState

_DECIDERS: dict[type, Callable[[RunState, Any], list[RolloutEvent]]] = {
    commands.StartRun: admission.decide_start,
    commands.AdmitStep: admission.decide_admit,
    commands.DispatchSiblings: siblings.decide_dispatch,
    commands.CompleteSibling: siblings.decide_complete,
    commands.FailSibling: siblings.decide_fail,
    commands.AbortSibling: siblings.decide_abort,
    commands.SelectBatch: training.decide_select,
    commands.RecordTrainStep: training.decide_train,
    commands.PublishWeights: training.decide_publish,
    commands.MarkCheckpoint: training.decide_checkpoint,
    commands.Restore: restore.decide_restore,
    commands.Resume: restore.decide_resume,
    commands.EvictStale: lambda state, cmd: restore.decide_evict_stale(state, cmd.reason),
    commands.EvictDoomed: training.decide_evict_doomed,
    commands.RecordEngineJoined: engines.decide_joined,
    commands.RecordEngineLost: engines.decide_lost,
    commands.RecordEngineRefit: engines.decide_refit,
    trajectory.RecordTurn: trajectory.decide_turn,
}

# Each concern's EVOLVERS is inferred as dict[ModelMetaclass, function] (the join of
# evolvers typed by their own event classes), which this annotation does not accept.
_EVOLVERS: dict[type, Callable[[RunState, Any], None]] = {
    **admission.EVOLVERS,  # type: ignore[dict-item]
    **siblings.EVOLVERS,  # type: ignore[dict-item]
    **buffer.EVOLVERS,  # type: ignore[dict-item]
    **training.EVOLVERS,  # type: ignore[dict-item]
    **restore.EVOLVERS,  # type: ignore[dict-item]
    **engines.EVOLVERS,  # type: ignore[dict-item]
    **trajectory.EVOLVERS,
}


_ALLOWED_AFTER_FAILURE = (
    commands.Restore,
    commands.Resume,
    commands.MarkCheckpoint,
    commands.RecordEngineJoined,
    commands.RecordEngineLost,
    commands.RecordEngineRefit,
)


def initial_state() -> RunState:
    """The state before any event."""
    return RunState()


def decide(state: RunState, command: commands.Command) -> list[RolloutEvent]:
    """The events ``command`` causes, or a domain error naming the violated rule.

    Never mutates ``state``.
    """
    handler = _DECIDERS.get(type(command))
    if handler is None:
        raise TypeError(f"unknown command {type(command).__name__}")
    if state.config is None and not isinstance(command, commands.StartRun):
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
