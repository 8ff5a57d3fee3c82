"""The rollout domain's events: one type per mutation, each a versioned pydantic schema.

Every decision that involved judgement (which groups a sampler picked, which group was
borrowed, which spare repaid it) is a field of an event, so replay never re-runs policy
code. All events are registered with :data:`CODEC`, the mapper to stored rows.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import Field

from rolloutlog.eventstore import EventCodec, EventModel

from .completion import COMPLETION_FIELDS as _COMPLETION_FIELDS
from .completion import Completion

CODEC = EventCodec()


class AuditKeys(NamedTuple):
    """The group / prompt / target step an event is about (kept in the rollout index,
    ``controller/rollout_index.py``, for audit lookups).

    A named tuple: one is built per event on the append path (a frozen dataclass costs
    five times as much)."""

    group_id: int | None = None
    prompt_index: int | None = None
    target_step: int | None = None


NO_AUDIT_KEYS = AuditKeys()


class RolloutEvent(EventModel):
    """Base of the rollout events (registered with :data:`CODEC`)."""

    def audit_keys(self) -> AuditKeys:
        """The group / prompt / target step this event is about (for the rollout index)."""
        return NO_AUDIT_KEYS


@CODEC.register
class RunStarted(RolloutEvent):
    """A run began: its rules, their fingerprint and the dataset it pulls prompts from."""

    event_type = "RunStarted"
    run_id: str
    rollout: dict[str, Any]
    config_fingerprint: str
    dataset_fingerprint: str
    dataset_size: int
    #: Passes over the dataset the dispatch cursor walks (1 for logs written before
    #: passes existed: their defaults decode them unchanged).
    passes: int = 1
    #: Seed of every pass's shuffle (``None``: no shuffle, dataset order); each pass's
    #: order is ``pass_permutation(shuffle_seed, pass, dataset_size)``, a pure function.
    shuffle_seed: int | None = None


@CODEC.register
class StepAdmitted(RolloutEvent):
    """The dispatch cursor advanced: ``target_step`` is handed out as a stamp."""

    event_type = "StepAdmitted"
    target_step: int
    group_count: int

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(target_step=self.target_step)


@CODEC.register
class GroupAdmitted(RolloutEvent):
    """The next prompt was pulled into a new group stamped for ``target_step``."""

    event_type = "GroupAdmitted"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    target_step: int

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.target_step)


@CODEC.register
class SparePulled(RolloutEvent):
    """The next prompt was pulled into the spare pool (a group without a stamp)."""

    event_type = "SparePulled"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index)


@CODEC.register
class SpareAssigned(RolloutEvent):
    """A spare was stamped and admitted: it replaces a vacated group, repays a loan, or
    (neither id set) fills the data's last step, which the data alone cannot fill."""

    event_type = "SpareAssigned"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    target_step: int
    replaces_group_id: int | None = None
    repays_group_id: int | None = None

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.target_step)


@CODEC.register
class SiblingDispatched(RolloutEvent):
    """A sibling was sent to generation as attempt ``attempt`` with ``weight_version``."""

    event_type = "SiblingDispatched"
    group_id: int
    sibling: int
    attempt: int
    weight_version: int
    #: The engine it was routed to, when known at dispatch (None: routed later).
    engine_id: str | None = None

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(group_id=self.group_id)


@CODEC.register
class SiblingCompleted(RolloutEvent):
    """A sibling finished; its token ids and logprobs are the payload ``payload_id``.

    ``salvaged_from`` is set when a restore reused a completion recorded after the
    checkpoint (by weights the restored trainer still has).
    """

    event_type = "SiblingCompleted"
    group_id: int
    sibling: int
    attempt: int
    weight_version: int
    prompt_tokens: int
    completion_tokens: int
    reward: float
    payload_id: str
    finish_reason: str
    salvaged_from: int | None = None
    #: The engine that generated it (None: in-process backend, or an older log).
    engine_id: str | None = None

    # The fields stay flat (not a nested ``completion`` object): the stored JSON is the
    # schema every existing log was written with, and the rollout index's views read
    # these keys from it.

    @classmethod
    def of(cls, completion: Completion, salvaged_from: int | None = None) -> SiblingCompleted:
        """The event that records ``completion`` (``salvaged_from``: see the class)."""
        values = {name: getattr(completion, name) for name in _COMPLETION_FIELDS}
        return cls(**values, salvaged_from=salvaged_from)

    def completion(self) -> Completion:
        """The completion this event records (``salvaged_from`` is the event's own)."""
        return Completion(**{name: getattr(self, name) for name in _COMPLETION_FIELDS})

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(group_id=self.group_id)


#: What failed a sibling attempt: generating it, or scoring it (the reward raised).
FailureCause = Literal["generation", "reward"]


@CODEC.register
class SiblingFailed(RolloutEvent):
    """A sibling attempt failed; ``retryable`` says whether another attempt may follow,
    ``cause`` whether generation or the reward failed (schema 2; schema 1 rows are
    upcast, a reason starting ``reward failed:`` being the runtime's reward failure)."""

    event_type = "SiblingFailed"
    schema_version = 2
    group_id: int
    sibling: int
    attempt: int
    retryable: bool
    reason: str
    cause: FailureCause = "generation"

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(group_id=self.group_id)


@CODEC.upcaster("SiblingFailed", 1)
def _sibling_failed_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # Before schema 2 the runtime told a reward failure only by its reason's prefix.
    reward = str(payload.get("reason", "")).startswith("reward failed:")
    return {**payload, "cause": "reward" if reward else "generation"}


@CODEC.register
class SiblingAborted(RolloutEvent):
    """An in-flight sibling attempt was abandoned (stale weights, restore, shutdown)."""

    event_type = "SiblingAborted"
    group_id: int
    sibling: int
    attempt: int
    reason: str

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(group_id=self.group_id)


@CODEC.register
class GroupCommitted(RolloutEvent):
    """Every sibling is done: the group enters the replay buffer (phase ready)."""

    event_type = "GroupCommitted"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    target_step: int
    oldest_weight_version: int

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.target_step)


VacateOutcome = Literal["replaced", "borrowed", "shrunk", "unreplaced", "run_failed"]


@CODEC.register
class PromptDropped(RolloutEvent):
    """A prompt left the run unfinished (failures exhausted its attempts).

    ``outcome`` records what the drop policy did about its step's slot.
    """

    event_type = "PromptDropped"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    target_step: int | None
    reason: str
    outcome: VacateOutcome

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.target_step)


@CODEC.register
class GroupBorrowed(RolloutEvent):
    """A ready group was re-stamped from a later step (the lender) to a short step."""

    event_type = "GroupBorrowed"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    from_step: int
    to_step: int

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.to_step)


@CODEC.register
class GroupEvicted(RolloutEvent):
    """A group left the buffer unused: too stale for the sampler (or its step is gone).

    ``recovered`` marks a group that came back in a restore, so recovery counts are
    never read as "trained".
    """

    event_type = "GroupEvicted"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    target_step: int | None
    reason: str
    staleness: int
    recovered: bool
    outcome: VacateOutcome

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.target_step)


@CODEC.register
class GroupSelected(RolloutEvent):
    """The sampler put a ready group into the batch of ``train_step``."""

    event_type = "GroupSelected"
    group_id: int
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    target_step: int
    train_step: int
    staleness: int

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(self.group_id, self.prompt_index, self.target_step)


@CODEC.register
class BatchSelected(RolloutEvent):
    """The batch of ``train_step`` is complete: these groups, and this many short."""

    event_type = "BatchSelected"
    train_step: int
    group_ids: list[int]
    shortfall: int


@CODEC.register
class StepTrained(RolloutEvent):
    """The trainer finished ``train_step``; its weights are now ``weight_version``."""

    event_type = "StepTrained"
    train_step: int
    weight_version: int


@CODEC.register
class WeightsPublished(RolloutEvent):
    """Generation now serves ``weight_version``."""

    event_type = "WeightsPublished"
    weight_version: int


@CODEC.register
class CheckpointMarked(RolloutEvent):
    """A checkpoint: the caller stores this event's offset with its model checkpoint.

    The cursors are recorded so a restore can tell a stale checkpoint from a good one.
    """

    event_type = "CheckpointMarked"
    train_step: int
    weight_version: int
    dispatch_cursor: int
    dataset_cursor: int


@CODEC.register
class RunRestored(RolloutEvent):
    """A new epoch resumed the run from the checkpoint at ``from_offset``."""

    event_type = "RunRestored"
    from_offset: int
    epoch: int
    mode: Literal["salvage", "strict"]
    granularity: Literal["sibling", "group"]
    forced: bool
    checkpoint_train_step: int
    checkpoint_weight_version: int
    complete_groups_restored: int
    unfinished_groups_found: int
    siblings_reused: int
    siblings_rerun: int
    siblings_salvaged: int


@CODEC.register
class RunResumed(RolloutEvent):
    """A controller reopened the run where it stood (no rollback) in a new epoch."""

    event_type = "RunResumed"
    epoch: int
    siblings_rerun: int


@CODEC.register
class EngineJoined(RolloutEvent):
    """A generation engine answers at ``address`` (at start, or again after a loss).

    ``weight_version`` is the version it holds, ``None`` when unknown (a restarted
    engine is stale until an :class:`EngineRefit`).
    """

    event_type = "EngineJoined"
    engine_id: str
    address: str
    weight_version: int | None = None


@CODEC.register
class EngineLost(RolloutEvent):
    """An engine was declared dead; ``in_flight`` are the sibling attempts it held.

    Each entry is a request id ``g{group}-s{sibling}-a{attempt}``. Those attempts end
    as any other abandoned attempt (a retryable failure, or an abort on restore).
    """

    event_type = "EngineLost"
    engine_id: str
    reason: str
    in_flight: list[str] = Field(default_factory=list)


@CODEC.register
class EngineRefit(RolloutEvent):
    """An engine now holds ``weight_version`` (a refit, or a fleet-wide update)."""

    event_type = "EngineRefit"
    engine_id: str
    weight_version: int
