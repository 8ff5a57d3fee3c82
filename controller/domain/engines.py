"""Engine membership: which generation engines served the run, when each was lost or refit.

Pure decide/evolve like every other concern. Membership does not touch the siblings:
the attempts in flight on a lost engine end as any other abandoned attempt (the runtime
records their retryable failure; a restore re-runs whatever the log still holds in
flight), so an engine's loss never changes what a sample is or who trained it.
"""

from __future__ import annotations

from .commands import RecordEngineJoined, RecordEngineLost, RecordEngineRefit
from .errors import IllegalTransitionError
from .events import EngineJoined, EngineLost, EngineRefit, RolloutEvent
from .state import EngineState, RunState


def decide_joined(state: RunState, cmd: RecordEngineJoined) -> list[RolloutEvent]:
    """EngineJoined (a first join, or a rejoin after a loss)."""
    if not cmd.engine_id:
        raise IllegalTransitionError("an engine needs a non-empty id")
    if cmd.weight_version is not None and cmd.weight_version > state.weight_version:
        raise IllegalTransitionError(
            f"engine {cmd.engine_id} reports weight version {cmd.weight_version}, "
            f"newer than the trainer's {state.weight_version}"
        )
    return [
        EngineJoined(
            engine_id=cmd.engine_id, address=cmd.address, weight_version=cmd.weight_version
        )
    ]


def decide_lost(state: RunState, cmd: RecordEngineLost) -> list[RolloutEvent]:
    """EngineLost for an engine that is up."""
    engine = state.engines.get(cmd.engine_id)
    if engine is None or engine.lost:
        raise IllegalTransitionError(f"engine {cmd.engine_id} is not up, so it cannot be lost")
    return [EngineLost(engine_id=cmd.engine_id, reason=cmd.reason, in_flight=list(cmd.in_flight))]


def decide_refit(state: RunState, cmd: RecordEngineRefit) -> list[RolloutEvent]:
    """EngineRefit of an engine that is up, to a version the trainer has produced."""
    engine = state.engines.get(cmd.engine_id)
    if engine is None or engine.lost:
        raise IllegalTransitionError(f"engine {cmd.engine_id} is not up, so it cannot be refit")
    if cmd.weight_version > state.weight_version:
        raise IllegalTransitionError(
            f"engine {cmd.engine_id} refit to weight version {cmd.weight_version}, "
            f"newer than the trainer's {state.weight_version}"
        )
    return [EngineRefit(engine_id=cmd.engine_id, weight_version=cmd.weight_version)]


def evolve_joined(state: RunState, event: EngineJoined) -> None:
    engine = state.engines.get(event.engine_id)
    if engine is None:
        state.engines[event.engine_id] = EngineState(
            event.engine_id, event.address, event.weight_version
        )
        return
    engine.address = event.address
    engine.weight_version = event.weight_version
    engine.lost = False
    engine.joins += 1


def evolve_lost(state: RunState, event: EngineLost) -> None:
    engine = state.engines[event.engine_id]
    engine.lost = True
    engine.weight_version = None
    engine.losses += 1
    state.counters.engines_lost += 1
    state.counters.engine_lost_attempts += len(event.in_flight)


def evolve_refit(state: RunState, event: EngineRefit) -> None:
    engine = state.engines[event.engine_id]
    engine.weight_version = event.weight_version
    state.counters.engines_refit += 1


EVOLVERS = {
    EngineJoined: evolve_joined,
    EngineLost: evolve_lost,
    EngineRefit: evolve_refit,
}
