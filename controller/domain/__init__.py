"""The pure core: events, state, decide/evolve per concern, samplers, invariants."""

from .commands import (
    AbortSibling,
    AdmitStep,
    CompleteSibling,
    DispatchSiblings,
    EvictDoomed,
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
from .completion import Completion
from .decider import decide, evolve, fold, initial_state
from .events import CODEC
from .invariants import check_invariants, find_violations
from .state import GroupState, Phase, RunState, SiblingState, SiblingStatus

__all__ = [
    "CODEC",
    "AbortSibling",
    "AdmitStep",
    "CompleteSibling",
    "Completion",
    "DispatchSiblings",
    "EvictDoomed",
    "EvictStale",
    "FailSibling",
    "GroupState",
    "MarkCheckpoint",
    "Phase",
    "PublishWeights",
    "RecordEngineJoined",
    "RecordEngineLost",
    "RecordEngineRefit",
    "RecordTrainStep",
    "Restore",
    "Resume",
    "RunState",
    "SelectBatch",
    "SiblingState",
    "SiblingStatus",
    "StartRun",
    "check_invariants",
    "decide",
    "evolve",
    "find_violations",
    "fold",
    "initial_state",
]
