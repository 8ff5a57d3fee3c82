"""Commands: what a caller asks of the state machine. ``decide`` turns one into events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import RolloutConfig
from .completion import Completion
from .events import FailureCause
from .trajectory import RecordTurn


@dataclass(frozen=True, slots=True)
class StartRun:
    """Begin a run with these rules over a dataset of ``dataset_size`` prompts."""

    run_id: str
    rollout: RolloutConfig
    config_fingerprint: str
    dataset_fingerprint: str
    dataset_size: int
    passes: int = 1  # passes over the dataset
    shuffle_seed: int | None = None  # None: every pass in dataset order


@dataclass(frozen=True, slots=True)
class AdmitStep:
    """Admit prompts for the step at the dispatch cursor (and top up the spare pool)."""


@dataclass(frozen=True, slots=True)
class DispatchSiblings:
    """Send these siblings of a group to generation with ``weight_version``."""

    group_id: int
    siblings: tuple[int, ...]
    weight_version: int


@dataclass(frozen=True, slots=True)
class CompleteSibling:
    """A sibling attempt finished generating: ``completion`` is what it produced."""

    completion: Completion


@dataclass(frozen=True, slots=True)
class FailSibling:
    """A sibling attempt failed (``cause``: generation, or the reward)."""

    group_id: int
    sibling: int
    attempt: int
    retryable: bool
    reason: str
    cause: FailureCause = "generation"


@dataclass(frozen=True, slots=True)
class AbortSibling:
    """Abandon an in-flight sibling attempt (it will be dispatched again)."""

    group_id: int
    sibling: int
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class SelectBatch:
    """Form the batch of ``train_step`` with the configured sampler (evicting stale groups)."""

    train_step: int


@dataclass(frozen=True, slots=True)
class RecordTrainStep:
    """The trainer finished ``train_step``, producing ``weight_version``."""

    train_step: int
    weight_version: int


@dataclass(frozen=True, slots=True)
class PublishWeights:
    """Generation switched to ``weight_version`` (gated samplers abort stale work)."""

    weight_version: int


@dataclass(frozen=True, slots=True)
class MarkCheckpoint:
    """Mark a checkpoint after ``train_step`` steps have trained."""

    train_step: int


@dataclass(frozen=True, slots=True)
class Restore:
    """Resume the run, in a new epoch, from the checkpoint at ``from_offset``.

    The state this is decided against is the state at ``from_offset``. ``salvage`` holds
    the completions found in the abandoned part of the log after it, each with the log
    offset of the ``SiblingCompleted`` that recorded it (the salvaged event's
    ``salvaged_from``).
    """

    from_offset: int
    epoch: int
    mode: Literal["salvage", "strict"]
    forced: bool
    salvage: tuple[tuple[int, Completion], ...] = ()


@dataclass(frozen=True, slots=True)
class Resume:
    """Reopen the run where it stands in a new epoch (takeover, or continuing after exit)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class EvictStale:
    """Evict every live group beyond the staleness bound (after a restore, for example)."""

    reason: str


@dataclass(frozen=True, slots=True)
class EvictDoomed:
    """Evict the ``in_order`` groups that will be stale at their target step, once a
    replacement generated at the published weights would not be (``doomed_groups``)."""


@dataclass(frozen=True, slots=True)
class RecordEngineJoined:
    """A generation engine answers at ``address`` holding ``weight_version`` (None: unknown)."""

    engine_id: str
    address: str
    weight_version: int | None = None


@dataclass(frozen=True, slots=True)
class RecordEngineLost:
    """An engine was declared dead with these sibling attempts (request ids) in flight."""

    engine_id: str
    reason: str
    in_flight: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RecordEngineRefit:
    """An engine now holds ``weight_version``."""

    engine_id: str
    weight_version: int


Command = (
    StartRun
    | AdmitStep
    | DispatchSiblings
    | CompleteSibling
    | FailSibling
    | AbortSibling
    | SelectBatch
    | RecordTrainStep
    | PublishWeights
    | MarkCheckpoint
    | Restore
    | Resume
    | EvictStale
    | EvictDoomed
    | RecordEngineJoined
    | RecordEngineLost
    | RecordEngineRefit
    | RecordTurn
)
