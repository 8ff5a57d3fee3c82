"""The replay tool: the state at any offset, invariant checks at every decision, diffs of
two offsets, one group's or prompt's full history, and re-running the recorded decisions.

Events are grouped into *decisions*: the events one command produced (a leader event
and its followers, e.g. SiblingCompleted + GroupCommitted). Invariants are checked
between decisions — inside one, a state may be half-way (a sibling done, its group not
yet committed) — and ``verify_decisions`` re-runs ``decide`` for each decision and
compares the result with what the log recorded, as Temporal's replayer does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rolloutlog.eventstore import EventStoreProtocol

from .domain import commands, decide, evolve, find_violations
from .domain.errors import DomainError
from .domain.events import (
    CheckpointMarked,
    EngineJoined,
    EngineLost,
    EngineRefit,
    GroupEvicted,
    GroupSelected,
    RolloutEvent,
    SiblingAborted,
    SiblingCompleted,
    SiblingDispatched,
    SiblingFailed,
    StepTrained,
    WeightsPublished,
)
from .domain.samplers import DOOMED_EVICTION
from .domain.state import Phase, RunState
from .rollout_history import check_cursors, iter_history, replay
from .rollout_index import IndexedEvent, read_where

_ALWAYS_LEADS = {
    "RunStarted",
    "StepAdmitted",
    "SiblingFailed",
    "StepTrained",
    "WeightsPublished",
    "CheckpointMarked",
    "RunRestored",
    "RunResumed",
}
_NEVER_LEADS = {
    "GroupAdmitted",
    "SparePulled",
    "SpareAssigned",
    "GroupBorrowed",
    "GroupCommitted",
    "PromptDropped",
    "BatchSelected",
}


@dataclass
class Decision:
    """The events one command produced, in log order."""

    rows: list[IndexedEvent] = field(default_factory=list)
    events: list[RolloutEvent] = field(default_factory=list)

    @property
    def leader(self) -> RolloutEvent:
        """The first event (the one that names the command)."""
        return self.events[0]

    @property
    def offset(self) -> int:
        """Offset of the leader."""
        return self.rows[0].seq


def _leads(event: RolloutEvent, current: Decision | None) -> bool:
    kind = event.event_type
    if current is None or kind in _ALWAYS_LEADS:
        return True
    if kind in _NEVER_LEADS:
        return False
    lead = current.leader
    if isinstance(event, SiblingCompleted):
        return event.salvaged_from is None
    if isinstance(event, SiblingDispatched):
        return not (isinstance(lead, SiblingDispatched) and lead.group_id == event.group_id)
    if isinstance(event, SiblingAborted):
        # A publish aborts the siblings its new version makes stale (decide_publish's
        # reason); any other abort right after it (the runtime closing, a restore) is a
        # decision of its own.
        return not (
            isinstance(lead, WeightsPublished) and event.reason.startswith("stale weights:")
        )
    if isinstance(event, GroupEvicted):
        # EvictDoomed's evictions are a decision of their own (none other evicts so).
        doomed = event.reason.startswith(DOOMED_EVICTION)
        if doomed or (isinstance(lead, GroupEvicted) and lead.reason.startswith(DOOMED_EVICTION)):
            return not (
                doomed
                and isinstance(lead, GroupEvicted)
                and lead.reason.startswith(DOOMED_EVICTION)
            )
        return lead.event_type not in ("WeightsPublished", "GroupEvicted", "RunRestored")
    if isinstance(event, GroupSelected):
        return not isinstance(lead, GroupSelected)
    return True


def split_decisions(pairs: Iterable[tuple[IndexedEvent, RolloutEvent]]) -> Iterator[Decision]:
    """Group a history into decisions."""
    current: Decision | None = None
    for row, event in pairs:
        if _leads(event, current):
            if current is not None:
                yield current
            current = Decision()
        assert current is not None
        current.rows.append(row)
        current.events.append(event)
    if current is not None:
        yield current


# ---------------------------------------------------------------- summaries


def state_summary(state: RunState) -> dict[str, Any]:
    """A JSON-friendly overview of a state."""
    phases: dict[str, int] = {}
    for g in state.groups.values():
        phases[g.phase.value] = phases.get(g.phase.value, 0) + 1
    in_flight = sum(
        1 for g in state.groups.values() for s in g.siblings if s.status.value == "in_flight"
    )
    return {
        "run_id": state.run_id,
        "offset": state.last_seq,
        "epoch": state.epoch,
        "dataset_cursor": state.dataset_cursor,
        "dispatch_cursor": state.dispatch_cursor,
        "train_step": state.train_step,
        "weight_version": state.weight_version,
        "published_version": state.published_version,
        "groups_by_phase": phases,
        "siblings_in_flight": in_flight,
        "spares": list(state.spares),
        "batches": {str(k): v for k, v in state.batches.items()},
        "loans": [
            {
                "group_id": loan.group_id,
                "lender_step": loan.lender_step,
                "borrower_step": loan.borrower_step,
                "repaid_by": loan.repaid_by,
            }
            for loan in state.loans.values()
        ],
        "counters": {k: getattr(state.counters, k) for k in state.counters.__slots__},
        "checkpoint": None
        if state.checkpoint is None
        else {
            "offset": state.checkpoint.offset,
            "train_step": state.checkpoint.train_step,
            "weight_version": state.checkpoint.weight_version,
        },
        "failure": state.failure,
        "invariant_violations": [str(v) for v in find_violations(state)],
    }


def state_at(store: EventStoreProtocol, run_id: str, offset: int | None) -> RunState:
    """The state at ``offset`` of the history (default: its end), from snapshot + tail."""
    return replay(store, run_id, offset).state


def diff_states(a: RunState, b: RunState) -> dict[str, Any]:
    """What changed from ``a`` to ``b``: scalar fields, counters and groups."""
    sa, sb = state_summary(a), state_summary(b)
    scalars = {
        k: {"from": sa[k], "to": sb[k]}
        for k in (
            "offset",
            "epoch",
            "dataset_cursor",
            "dispatch_cursor",
            "train_step",
            "weight_version",
            "published_version",
        )
        if sa[k] != sb[k]
    }
    counters = {
        k: {"from": sa["counters"][k], "to": sb["counters"][k]}
        for k in sa["counters"]
        if sa["counters"][k] != sb["counters"][k]
    }
    added = sorted(set(b.groups) - set(a.groups))
    removed = sorted(set(a.groups) - set(b.groups))
    changed = {
        gid: {"from": a.groups[gid].phase.value, "to": b.groups[gid].phase.value}
        for gid in sorted(set(a.groups) & set(b.groups))
        if a.groups[gid].phase is not b.groups[gid].phase
        or a.groups[gid].target_step != b.groups[gid].target_step
    }
    return {
        "from_offset": a.last_seq,
        "to_offset": b.last_seq,
        "fields": scalars,
        "counters": counters,
        "groups_added": added,
        "groups_removed": removed,
        "groups_changed": {str(k): v for k, v in changed.items()},
    }


# ---------------------------------------------------------------- explain


def explain(
    store: EventStoreProtocol,
    run_id: str,
    *,
    group_id: int | None = None,
    prompt: int | None = None,
) -> list[dict[str, Any]]:
    """Every stored event about a group (or a prompt and its groups), oldest first.

    Events a restore abandoned are included and marked ``in_history: false``.
    """
    if (group_id is None) == (prompt is None):
        raise ValueError("explain needs exactly one of group_id or prompt")
    rows: dict[int, IndexedEvent] = {}
    if prompt is not None:
        for row in read_where(store, run_id, prompt_index=prompt):
            rows[row.seq] = row
        groups = {r.group_id for r in rows.values() if r.group_id is not None}
    else:
        groups = {group_id} if group_id is not None else set()
    for gid in groups:
        for row in read_where(store, run_id, group_id=gid):
            rows[row.seq] = row
    from .domain.events import CODEC

    # An engine's loss is about every attempt it held: show it with those groups.
    for row in read_where(store, run_id, event_type="EngineLost"):
        lost = CODEC.decode(row)
        assert isinstance(lost, EngineLost)
        if any(_group_of_request(rid) in groups for rid in lost.in_flight):
            rows[row.seq] = row
    segments = store.history_segments(run_id)

    out = []
    for seq in sorted(rows):
        row = rows[seq]
        event = CODEC.decode(row)
        out.append(
            {
                "offset": seq,
                "epoch": row.epoch,
                "recorded_at": row.recorded_at.isoformat(),
                "type": row.type,
                "in_history": any(a <= seq <= b for a, b in segments),
                "train_step": row.train_step,
                "weight_version": row.weight_version,
                "event": event.model_dump(),
            }
        )
    return out


#: A trajectory event's kind in ``explain_trajectory`` (as in the SQL view ``turns``).
TURN_KINDS: dict[str, str] = {
    "TrajectoryStarted": "start",
    "ModelCallCompleted": "model_call",
    "ToolCallRequested": "tool_request",
    "ToolCallCompleted": "tool_result",
    "ToolCallFailed": "tool_failure",
    "EnvironmentStepped": "environment_step",
    "TrajectoryCompleted": "completed",
    "TrajectoryResumed": "resumed",
    "LateResultRefused": "late_refused",
    "TrajectoryTooStale": "too_stale",
}

#: Fields of a trajectory event shown in a step (the rest: ``"event"``).
_STEP_FIELDS = (
    "output_tokens",
    "context_tokens",
    "weight_version",
    "engine_id",
    "finish_reason",
    "tool",
    "call",
    "arguments",
    "idempotency_key",
    "result",
    "reason",
    "outcome",
    "source",
    "seconds",
    "observation",
    "observation_tokens",
    "reward",
    "done",
    "model_calls_reused",
    "tool_results_reused",
    "tool_calls_open",
    "from_epoch",
    "from_attempt",
    "kind",
    "current_attempt",
    "finish",
    "final_reward",
    "model_tokens",
    "versions",
    "next_version",
    "max_weight_versions",
    "policy",
    "restart_after_turn",
    "turns_kept",
    "turns_abandoned",
    "tool_calls_abandoned",
)


def explain_trajectory(
    store: EventStoreProtocol, run_id: str, group_id: int, sibling: int | None = None
) -> list[dict[str, Any]]:
    """The trajectories of a group (or of one of its siblings), turn by turn.

    Every stored trajectory event counts, abandoned ones included (marked
    ``in_history: false``): a restore reuses the turns an abandoned branch recorded. A
    sibling's events belong to the trajectory whose ``TrajectoryStarted`` is the newest
    before them (as the trajectory backend folds them). Each trajectory: its key, prompt,
    the fold's summary (turns, tool calls, resumes, loss-mask token counts, completion)
    and ``turns``: one entry per turn (``turn`` -1: before the first model call, i.e.
    the start; None: resumes and the completion, which belong to no turn) with its
    steps in log order.
    """
    from .domain.events import CODEC
    from .domain.trajectory import (
        TURN_EVENT_TYPES,
        TrajectoryStarted,
        TurnEvent,
        evolve_trajectory,
    )

    segments = store.history_segments(run_id)
    found: list[dict[str, Any]] = []
    current: dict[int, dict[str, Any]] = {}  # sibling -> its trajectory in effect
    books: dict[int, dict[Any, Any]] = {}
    for row in read_where(store, run_id, group_id=group_id):
        if row.type not in TURN_EVENT_TYPES:
            continue
        event = CODEC.decode(row)
        assert isinstance(event, TurnEvent)
        if sibling is not None and event.sibling != sibling:
            continue
        if isinstance(event, TrajectoryStarted):
            traj: dict[str, Any] = {
                "group_id": event.group_id,
                "sibling": event.sibling,
                "trajectory_offset": row.seq,
                "prompt_index": event.prompt_index,
                "data_pass": event.data_pass,
                "prompt_tokens": event.prompt_tokens,
                "turns": [],
            }
            current[event.sibling] = traj
            books[row.seq] = {}
            found.append(traj)
        traj_or_none = current.get(event.sibling)
        if traj_or_none is None:
            continue  # a late refusal before any start: nothing to attach it to
        traj = traj_or_none
        evolve_trajectory(books[traj["trajectory_offset"]], event, row.epoch)
        data = event.model_dump()
        turn = data.get("turn")
        if isinstance(event, TrajectoryStarted):
            turn = -1
        step = {
            "offset": row.seq,
            "epoch": row.epoch,
            "attempt": event.attempt,
            "in_history": any(a <= row.seq <= b for a, b in segments),
            "kind": TURN_KINDS[row.type],
            **{k: data[k] for k in _STEP_FIELDS if k in data and data[k] is not None},
        }
        turns: list[dict[str, Any]] = traj["turns"]
        if not turns or turns[-1]["turn"] != turn:
            turns.append({"turn": turn, "steps": []})
        turns[-1]["steps"].append(step)
    for traj in found:
        (state,) = books[traj["trajectory_offset"]].values()
        mask = state.loss_mask()
        traj.update(
            model_calls=state.turns,
            tool_calls=len(state.tool_calls),
            tool_failures=sum(c.status == "failed" for c in state.tool_calls),
            tool_calls_open=len(state.open_tool_calls()),
            resumes=state.resumes,
            late_refused=state.late_refused,
            model_tokens=sum(mask),
            observation_tokens=len(mask) - sum(mask),
            weight_versions=sorted(
                {s.weight_version for s in state.segments if s.weight_version is not None}
            ),
            owner={"epoch": state.owner[0], "attempt": state.owner[1]},
            completed=state.completed,
            final_reward=state.final_reward,
        )
    return found


def _group_of_request(request_id: str) -> int | None:
    """The group of a sibling request id ``g{group}-s{sibling}-a{attempt}`` (None: other)."""
    head = request_id.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "g" and head[1:].isdigit() else None


# ---------------------------------------------------------------- check


@dataclass
class CheckResult:
    """The first invariant violation in a history, if any."""

    events_checked: int
    decisions_checked: int
    violation: dict[str, Any] | None


def check_history(store: EventStoreProtocol, run_id: str, to_seq: int | None = None) -> CheckResult:
    """Replay from the start, checking every invariant after every decision, and at
    every checkpoint marker the recorded cursors that a restore to it would check."""
    state = RunState()
    events = decisions = 0
    for decision in split_decisions(iter_history(store, run_id, to_seq)):
        for row, event in zip(decision.rows, decision.events, strict=True):
            try:
                evolve(state, event, row.seq)
            except DomainError as exc:
                return CheckResult(events, decisions, _violation(store, run_id, row, event, exc))
            events += 1
        decisions += 1
        found: list[DomainError] = list(find_violations(state))
        if not found and isinstance(decision.leader, CheckpointMarked):
            # What restore checks before restoring to this checkpoint, checked here too.
            try:
                check_cursors(state, decision.leader, decision.offset)
            except DomainError as exc:
                found = [exc]
        if found:
            return CheckResult(
                events,
                decisions,
                _violation(store, run_id, decision.rows[-1], decision.events[-1], found[0]),
            )
    return CheckResult(events, decisions, None)


def _violation(
    store: EventStoreProtocol, run_id: str, row: IndexedEvent, event: RolloutEvent, exc: DomainError
) -> dict[str, Any]:
    groups = tuple(getattr(exc, "groups", ()) or ())
    if not groups and row.group_id is not None:
        groups = (row.group_id,)
    return {
        "offset": row.seq,
        "event_type": row.type,
        "event": event.model_dump(),
        "error": type(exc).__name__,
        "invariant": getattr(exc, "number", None),
        "message": str(exc),
        "groups": list(groups),
        "group_histories": {
            str(g): [e for e in explain(store, run_id, group_id=g) if e["offset"] <= row.seq]
            for g in groups
        },
    }


# ---------------------------------------------------------------- verify decisions


def command_for(decision: Decision, state: RunState) -> commands.Command | None:
    """The command that should reproduce ``decision`` (None: not re-decidable here)."""
    lead = decision.leader
    kind = lead.event_type
    if kind == "StepAdmitted":
        return commands.AdmitStep()
    if isinstance(lead, SiblingDispatched):
        sibs = tuple(e.sibling for e in decision.events if isinstance(e, SiblingDispatched))
        return commands.DispatchSiblings(lead.group_id, sibs, lead.weight_version)
    if isinstance(lead, SiblingCompleted):
        return commands.CompleteSibling(lead.completion())
    if isinstance(lead, EngineJoined):
        return commands.RecordEngineJoined(lead.engine_id, lead.address, lead.weight_version)
    if isinstance(lead, EngineLost):
        return commands.RecordEngineLost(lead.engine_id, lead.reason, tuple(lead.in_flight))
    if isinstance(lead, EngineRefit):
        return commands.RecordEngineRefit(lead.engine_id, lead.weight_version)
    if isinstance(lead, SiblingFailed):
        return commands.FailSibling(
            lead.group_id, lead.sibling, lead.attempt, lead.retryable, lead.reason
        )
    if isinstance(lead, SiblingAborted):
        return commands.AbortSibling(lead.group_id, lead.sibling, lead.attempt, lead.reason)
    if isinstance(lead, GroupSelected):
        return commands.SelectBatch(lead.train_step)
    if isinstance(lead, GroupEvicted):
        if lead.reason.startswith(DOOMED_EVICTION):
            return commands.EvictDoomed()
        return commands.SelectBatch(state.train_step)
    if isinstance(lead, StepTrained):
        return commands.RecordTrainStep(lead.train_step, lead.weight_version)
    if isinstance(lead, WeightsPublished):
        return commands.PublishWeights(lead.weight_version)
    if isinstance(lead, CheckpointMarked):
        return commands.MarkCheckpoint(lead.train_step)
    return None  # RunStarted / RunRestored / RunResumed carry inputs from outside


@dataclass
class VerifyResult:
    """The first decision whose re-run differs from the log, if any."""

    decisions_verified: int
    decisions_skipped: int
    mismatch: dict[str, Any] | None


def verify_decisions(
    store: EventStoreProtocol, run_id: str, to_seq: int | None = None
) -> VerifyResult:
    """Re-run ``decide`` for every recorded decision and compare with the log."""
    state = RunState()
    verified = skipped = 0
    for decision in split_decisions(iter_history(store, run_id, to_seq)):
        cmd = command_for(decision, state) if state.config is not None else None
        if cmd is None:
            skipped += 1
        else:
            try:
                expected = decide(state, cmd)
            except DomainError as exc:
                return VerifyResult(
                    verified,
                    skipped,
                    {
                        "offset": decision.offset,
                        "command": type(cmd).__name__,
                        "error": f"{type(exc).__name__}: {exc}",
                        "recorded": [
                            e.model_dump() | {"type": e.event_type} for e in decision.events
                        ],
                    },
                )
            recorded = decision.events
            mismatch = _first_difference(expected, recorded)
            if mismatch is not None:
                index, exp, rec = mismatch
                return VerifyResult(
                    verified,
                    skipped,
                    {
                        "offset": decision.offset + index,
                        "decision_offset": decision.offset,
                        "command": type(cmd).__name__,
                        "expected": exp,
                        "recorded": rec,
                    },
                )
            verified += 1
        for row, event in zip(decision.rows, decision.events, strict=True):
            evolve(state, event, row.seq)
    return VerifyResult(verified, skipped, None)


def _first_difference(
    expected: list[RolloutEvent], recorded: list[RolloutEvent]
) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None] | None:
    for i in range(max(len(expected), len(recorded))):
        exp = expected[i] if i < len(expected) else None
        rec = recorded[i] if i < len(recorded) else None
        e = None if exp is None else exp.model_dump() | {"type": exp.event_type}
        r = None if rec is None else rec.model_dump() | {"type": rec.event_type}
        if e != r:
            return i, e, r
    return None


__all__ = [
    "CheckResult",
    "Decision",
    "Phase",
    "VerifyResult",
    "check_history",
    "diff_states",
    "explain",
    "explain_trajectory",
    "split_decisions",
    "state_at",
    "state_summary",
    "verify_decisions",
]
