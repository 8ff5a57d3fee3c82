"""Siblings: dispatch with attempt numbers, completion, failure and retry, abort; fencing
of superseded attempts; the group's commit when its last sibling finishes."""

from __future__ import annotations

from .buffer import VacancyPlanner
from .commands import AbortSibling, CompleteSibling, DispatchSiblings, FailSibling
from .errors import (
    IllegalTransitionError,
    SiblingAccountingError,
    StaleAttemptError,
    UnknownGroupError,
    UnknownReferenceError,
)
from .events import (
    GroupCommitted,
    RolloutEvent,
    SiblingAborted,
    SiblingCompleted,
    SiblingDispatched,
    SiblingFailed,
)
from .state import GroupState, Phase, RunState, SiblingState, SiblingStatus

# ---------------------------------------------------------------- decide


def _group(state: RunState, group_id: int) -> GroupState:
    group = state.groups.get(group_id)
    if group is None:
        raise UnknownGroupError(f"group {group_id} is not live in run {state.run_id!r}")
    return group


def _sibling(state: RunState, group: GroupState, sibling: int) -> SiblingState:
    rows = group.sibling_rows  # one read of the group's row for the check and the view
    if not 0 <= sibling < len(rows):
        raise IllegalTransitionError(
            f"group {group.group_id} has siblings 0..{len(rows) - 1}, not {sibling}"
        )
    return SiblingState.from_row(rows[sibling])


def _in_flight(state: RunState, group_id: int, sibling: int, attempt: int) -> SiblingState:
    group = _group(state, group_id)
    sib = _sibling(state, group, sibling)
    if attempt != sib.attempt:
        raise StaleAttemptError(
            f"group {group_id} sibling {sibling}: attempt {attempt} is superseded by attempt "
            f"{sib.attempt}; its result is rejected"
        )
    if sib.status is not SiblingStatus.IN_FLIGHT:
        raise IllegalTransitionError(
            f"group {group_id} sibling {sibling} attempt {attempt} is {sib.status.value}, "
            "not in flight"
        )
    return sib


def decide_dispatch(state: RunState, cmd: DispatchSiblings) -> list[RolloutEvent]:
    """A SiblingDispatched per sibling, each with the next attempt number."""
    group = _group(state, cmd.group_id)
    if group.phase is not Phase.ADMITTED:
        raise IllegalTransitionError(
            f"group {cmd.group_id} is {group.phase.value}; only admitted groups are dispatched"
        )
    if not cmd.siblings:
        raise IllegalTransitionError(f"dispatch of group {cmd.group_id} names no siblings")
    if len(set(cmd.siblings)) != len(cmd.siblings):
        raise IllegalTransitionError(f"dispatch of group {cmd.group_id} repeats siblings")
    if not 0 <= cmd.weight_version <= state.weight_version:
        raise IllegalTransitionError(
            f"dispatch with weight version {cmd.weight_version}, but the trainer is at "
            f"{state.weight_version}"
        )
    if cmd.weight_version < state.published_version:
        raise IllegalTransitionError(
            f"dispatch of group {cmd.group_id} with weight version {cmd.weight_version}, older "
            f"than the published version {state.published_version}: the generation backend "
            "has not loaded the published weights"
        )
    events: list[RolloutEvent] = []
    for index in cmd.siblings:
        sib = _sibling(state, group, index)
        if sib.status is not SiblingStatus.PENDING:
            raise IllegalTransitionError(
                f"group {cmd.group_id} sibling {index} is {sib.status.value}; "
                "only pending siblings are dispatched"
            )
        events.append(
            SiblingDispatched(
                group_id=cmd.group_id,
                sibling=index,
                attempt=sib.attempt + 1,
                weight_version=cmd.weight_version,
            )
        )
    return events


def decide_complete(state: RunState, cmd: CompleteSibling) -> list[RolloutEvent]:
    """SiblingCompleted, plus GroupCommitted when it was the group's last sibling."""
    c = cmd.completion
    sib = _in_flight(state, c.group_id, c.sibling, c.attempt)
    dispatched = sib.weight_version if sib.weight_version is not None else 0
    if not dispatched <= c.weight_version <= state.weight_version:
        raise IllegalTransitionError(
            f"group {c.group_id} sibling {c.sibling} was dispatched with weight version "
            f"{dispatched} and the trainer is at {state.weight_version}, but the result "
            f"reports version {c.weight_version}"
        )
    if c.completion_tokens < 1 or c.prompt_tokens < 1:
        raise IllegalTransitionError(
            f"group {c.group_id} sibling {c.sibling}: token counts must be positive"
        )
    events: list[RolloutEvent] = [SiblingCompleted.of(c)]
    events.extend(commit_if_complete(state, c.group_id, extra_done={c.sibling: c.weight_version}))
    return events


def commit_if_complete(
    state: RunState, group_id: int, extra_done: dict[int, int]
) -> list[RolloutEvent]:
    """GroupCommitted if every sibling is done once ``extra_done`` (sibling -> version) are."""
    group = state.groups[group_id]
    versions: list[int] = []
    for i, s in enumerate(group.sibling_rows):
        if i in extra_done:
            versions.append(extra_done[i])
        elif s[1] == SiblingStatus.DONE.value and s[2] is not None:
            versions.append(s[2])
        else:
            return []
    assert group.target_step is not None
    return [
        GroupCommitted(
            group_id=group_id,
            prompt_index=group.prompt_index,
            data_pass=group.data_pass,
            target_step=group.target_step,
            oldest_weight_version=min(versions),
        )
    ]


def decide_fail(state: RunState, cmd: FailSibling) -> list[RolloutEvent]:
    """SiblingFailed; when attempts are exhausted (or it cannot be retried) the prompt is
    dropped and the drop policy decides what fills its slot."""
    sib = _in_flight(state, cmd.group_id, cmd.sibling, cmd.attempt)
    events: list[RolloutEvent] = [
        SiblingFailed(
            group_id=cmd.group_id,
            sibling=cmd.sibling,
            attempt=cmd.attempt,
            retryable=cmd.retryable,
            reason=cmd.reason,
            cause=cmd.cause,
        )
    ]
    failures = sib.failures + 1
    if cmd.retryable and failures < state.rules.attempts_per_sibling:
        return events
    why = (
        f"sibling {cmd.sibling} failed without retry: {cmd.reason}"
        if not cmd.retryable
        else f"sibling {cmd.sibling} failed {failures} times (attempts_per_sibling="
        f"{state.rules.attempts_per_sibling}): {cmd.reason}"
    )
    planner = VacancyPlanner.for_state(state)
    events.extend(planner.vacate(state.groups[cmd.group_id], kind="drop", reason=why))
    events.extend(planner.refill())
    return events


def decide_abort(state: RunState, cmd: AbortSibling) -> list[RolloutEvent]:
    """SiblingAborted: the attempt is abandoned, the sibling waits for a new dispatch."""
    _in_flight(state, cmd.group_id, cmd.sibling, cmd.attempt)
    return [
        SiblingAborted(
            group_id=cmd.group_id, sibling=cmd.sibling, attempt=cmd.attempt, reason=cmd.reason
        )
    ]


# ---------------------------------------------------------------- evolve


def _evolve_target(
    state: RunState, group_id: int, sibling: int, what: str
) -> tuple[GroupState, SiblingState]:
    group = state.groups.get(group_id)
    rows = () if group is None else group.sibling_rows
    if group is None or not 0 <= sibling < len(rows):
        raise UnknownReferenceError(
            f"{what} names unknown group {group_id} sibling {sibling}", groups=(group_id,)
        )
    return group, SiblingState.from_row(rows[sibling])


def evolve_dispatched(state: RunState, ev: SiblingDispatched) -> None:
    """The sibling is in flight with a new attempt number."""
    group, sib = _evolve_target(state, ev.group_id, ev.sibling, "SiblingDispatched")
    if ev.attempt <= sib.attempt or sib.status is not SiblingStatus.PENDING:
        raise IllegalTransitionError(
            f"group {ev.group_id} sibling {ev.sibling}: dispatch of attempt {ev.attempt} while "
            f"attempt {sib.attempt} is {sib.status.value}"
        )
    group.set_sibling(
        ev.sibling,
        sib._replace(
            attempt=ev.attempt,
            status=SiblingStatus.IN_FLIGHT,
            weight_version=ev.weight_version,
        ),
    )


def evolve_completed(state: RunState, ev: SiblingCompleted) -> None:
    """The sibling is done (a salvaged completion may come from a later attempt)."""
    group, sib = _evolve_target(state, ev.group_id, ev.sibling, "SiblingCompleted")
    if ev.salvaged_from is None:
        if ev.attempt != sib.attempt or sib.status is not SiblingStatus.IN_FLIGHT:
            raise SiblingAccountingError(
                f"group {ev.group_id} sibling {ev.sibling}: completion of attempt {ev.attempt} "
                f"accepted while attempt {sib.attempt} is {sib.status.value}",
                groups=(ev.group_id,),
            )
    elif sib.status is SiblingStatus.DONE:
        raise SiblingAccountingError(
            f"group {ev.group_id} sibling {ev.sibling} salvaged but already done",
            groups=(ev.group_id,),
        )
    salvaged = ev.salvaged_from is not None
    group.set_sibling(
        ev.sibling,
        sib._replace(
            attempt=max(sib.attempt, ev.attempt),
            status=SiblingStatus.DONE,
            weight_version=ev.weight_version,
            completion_tokens=ev.completion_tokens,
            reward=ev.reward,
            payload_id=ev.payload_id,
            salvaged=salvaged,
        ),
    )
    state.counters.siblings_completed += 1
    state.counters.tokens_generated += ev.completion_tokens
    if salvaged:
        state.counters.siblings_salvaged += 1


def _back_to_pending(
    state: RunState, group_id: int, sibling: int, attempt: int, what: str, *, failed: bool
) -> None:
    group, sib = _evolve_target(state, group_id, sibling, what)
    if attempt != sib.attempt or sib.status is not SiblingStatus.IN_FLIGHT:
        raise IllegalTransitionError(
            f"group {group_id} sibling {sibling}: {what} of attempt {attempt} while attempt "
            f"{sib.attempt} is {sib.status.value}"
        )
    group.set_sibling(
        sibling,
        sib._replace(
            status=SiblingStatus.PENDING,
            weight_version=None,
            failures=sib.failures + 1 if failed else sib.failures,
        ),
    )


def evolve_failed(state: RunState, ev: SiblingFailed) -> None:
    """The attempt failed; the sibling may be dispatched again."""
    _back_to_pending(state, ev.group_id, ev.sibling, ev.attempt, "SiblingFailed", failed=True)
    state.counters.siblings_failed += 1


def evolve_aborted(state: RunState, ev: SiblingAborted) -> None:
    """The attempt was abandoned; the sibling waits for a new dispatch."""
    _back_to_pending(state, ev.group_id, ev.sibling, ev.attempt, "SiblingAborted", failed=False)
    state.counters.siblings_aborted += 1


EVOLVERS = {
    SiblingDispatched: evolve_dispatched,
    SiblingCompleted: evolve_completed,
    SiblingFailed: evolve_failed,
    SiblingAborted: evolve_aborted,
}
