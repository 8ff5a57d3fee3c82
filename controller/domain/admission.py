"""Admission: the dataset cursor, the dispatch cursor, target-step stamps, the spare pool."""

from __future__ import annotations

from .commands import AdmitStep, StartRun
from .errors import (
    DatasetExhaustedError,
    IllegalTransitionError,
    LookaheadExceededError,
    UnknownReferenceError,
)
from .events import (
    GroupAdmitted,
    RolloutEvent,
    RunStarted,
    SpareAssigned,
    SparePulled,
    StepAdmitted,
)
from .state import NEW_SIBLING_ROW, GroupState, Phase, RunState

# ---------------------------------------------------------------- decide


def decide_start(state: RunState, cmd: StartRun) -> list[RolloutEvent]:
    """RunStarted, once."""
    if state.config is not None:
        raise IllegalTransitionError(f"run {state.run_id!r} has already started")
    if cmd.dataset_size < 1:
        raise IllegalTransitionError("the dataset has no prompts (dataset_size < 1)")
    if cmd.passes < 1:
        raise IllegalTransitionError(f"passes {cmd.passes} must be >= 1")
    return [
        RunStarted(
            run_id=cmd.run_id,
            rollout=cmd.rollout.model_dump(),
            config_fingerprint=cmd.config_fingerprint,
            dataset_fingerprint=cmd.dataset_fingerprint,
            dataset_size=cmd.dataset_size,
            passes=cmd.passes,
            shuffle_seed=cmd.shuffle_seed,
        )
    ]


def admission_blocker(state: RunState) -> str | None:
    """Why the step at the dispatch cursor cannot be admitted now (None: it can)."""
    rules = state.rules
    if state.failure is not None:
        return f"the run failed: {state.failure}"
    if state.dispatch_cursor > state.train_step + rules.lookahead:
        return (
            f"dispatch cursor {state.dispatch_cursor} would pass train step {state.train_step} "
            f"+ lookahead {rules.lookahead}"
        )
    if data_exhausted(state):
        return (
            f"the dataset is exhausted ({state.dataset_size} prompts x {state.passes} "
            f"pass(es) pulled)"
        )
    return None


def data_exhausted(state: RunState) -> bool:
    """Every prompt of the walk is pulled and no spare is left to admit: no step can be
    admitted any more (spares left at the walk's end fill a last step: decide_admit)."""
    return state.dataset_cursor >= state.walk_size and not state.spares


def decide_admit(state: RunState, _cmd: AdmitStep) -> list[RolloutEvent]:
    """StepAdmitted, a GroupAdmitted per prompt pulled, then SparePulled to refill the pool;
    at the data's end, SpareAssigned for the spares that fill the last step."""
    blocker = admission_blocker(state)
    if blocker is not None:
        if data_exhausted(state):
            raise DatasetExhaustedError(blocker)
        if state.failure is not None:
            raise IllegalTransitionError(blocker)
        raise LookaheadExceededError(blocker)
    rules = state.rules
    step = state.dispatch_cursor
    count = min(rules.groups_per_step, state.walk_size - state.dataset_cursor)
    # The data's last step: the spares still in the pool were pulled from this walk ahead
    # of it, so they fill what the data cannot (else they would never be trained).
    fills = state.spares[: rules.groups_per_step - count]
    events: list[RolloutEvent] = [StepAdmitted(target_step=step, group_count=count + len(fills))]
    gid, prompt = state.next_group_id, state.dataset_cursor
    for _ in range(count):
        pass_, index = state.prompt_key_at(prompt)
        events.append(
            GroupAdmitted(group_id=gid, prompt_index=index, data_pass=pass_, target_step=step)
        )
        gid, prompt = gid + 1, prompt + 1
    for spare_id in fills:
        spare = state.groups[spare_id]
        events.append(
            SpareAssigned(
                group_id=spare_id,
                prompt_index=spare.prompt_index,
                data_pass=spare.data_pass,
                target_step=step,
            )
        )
    events.extend(
        spare_refill(
            state, next_group_id=gid, next_prompt=prompt, have=len(state.spares) - len(fills)
        )
    )
    return events


def spare_refill(
    state: RunState, *, next_group_id: int, next_prompt: int, have: int
) -> list[RolloutEvent]:
    """SparePulled events that bring the pool from ``have`` up to its configured size
    (``next_prompt`` is a dataset-cursor position)."""
    out: list[RolloutEvent] = []
    while have < state.rules.spare_pool_size and next_prompt < state.walk_size:
        pass_, index = state.prompt_key_at(next_prompt)
        out.append(SparePulled(group_id=next_group_id, prompt_index=index, data_pass=pass_))
        next_group_id, next_prompt, have = next_group_id + 1, next_prompt + 1, have + 1
    return out


# ---------------------------------------------------------------- evolve


def _new_group(state: RunState, group_id: int, prompt_index: int, data_pass: int) -> GroupState:
    if group_id != state.next_group_id:
        raise UnknownReferenceError(
            f"group {group_id} out of order: the next group id is {state.next_group_id}",
            groups=(group_id,),
        )
    if state.dataset_cursor >= state.walk_size:
        raise UnknownReferenceError(
            f"prompt {prompt_index} (pass {data_pass}) is beyond the dataset "
            f"({state.dataset_size} prompts x {state.passes} pass(es))",
            groups=(group_id,),
        )
    expected = state.prompt_key_at(state.dataset_cursor)
    if (data_pass, prompt_index) != expected:
        raise UnknownReferenceError(
            f"prompt {prompt_index} pulled out of order (pass {data_pass}): the dataset "
            f"cursor {state.dataset_cursor} is at prompt {expected[1]} (pass {expected[0]})",
            groups=(group_id,),
        )
    state.next_group_id += 1
    state.dataset_cursor += 1
    return GroupState(
        group_id=group_id,
        prompt_index=prompt_index,
        data_pass=data_pass,
        target_step=None,
        phase=Phase.SPARE,
        sibling_rows=(NEW_SIBLING_ROW,) * state.rules.group_size,
    )


def evolve_run_started(state: RunState, ev: RunStarted) -> None:
    """The run's identity and rules."""
    from ..config import RolloutConfig

    if state.config is not None:
        raise IllegalTransitionError("RunStarted applied twice")
    state.run_id = ev.run_id
    state.config = RolloutConfig.model_validate(ev.rollout)
    state.config_fingerprint = ev.config_fingerprint
    state.dataset_fingerprint = ev.dataset_fingerprint
    state.dataset_size = ev.dataset_size
    state.passes = ev.passes
    state.shuffle_seed = ev.shuffle_seed


def evolve_step_admitted(state: RunState, ev: StepAdmitted) -> None:
    """Advance the dispatch cursor past ``target_step``; the step's quota is its groups."""
    if ev.target_step != state.dispatch_cursor:
        raise UnknownReferenceError(
            f"StepAdmitted for step {ev.target_step} but the dispatch cursor is at "
            f"{state.dispatch_cursor}"
        )
    state.dispatch_cursor = ev.target_step + 1
    state.quotas[ev.target_step] = ev.group_count


def evolve_group_admitted(state: RunState, ev: GroupAdmitted) -> None:
    """A new group, stamped and waiting for dispatch."""
    if ev.target_step >= state.dispatch_cursor:
        raise UnknownReferenceError(
            f"group {ev.group_id} stamped for step {ev.target_step}, which the dispatch cursor "
            f"({state.dispatch_cursor}) has not handed out",
            groups=(ev.group_id,),
        )
    group = _new_group(state, ev.group_id, ev.prompt_index, ev.data_pass)
    group.target_step = ev.target_step
    group.phase = Phase.ADMITTED
    state.groups[group.group_id] = group


def evolve_spare_pulled(state: RunState, ev: SparePulled) -> None:
    """A new group in the spare pool."""
    group = _new_group(state, ev.group_id, ev.prompt_index, ev.data_pass)
    state.groups[group.group_id] = group
    state.spares.append(group.group_id)


def evolve_spare_assigned(state: RunState, ev: SpareAssigned) -> None:
    """A spare takes a stamp and becomes admitted (a replacement or a repayment)."""
    group = state.groups.get(ev.group_id)
    if group is None or group.phase is not Phase.SPARE:
        raise UnknownReferenceError(
            f"SpareAssigned names group {ev.group_id}, which is not in the spare pool",
            groups=(ev.group_id,),
        )
    if ev.target_step >= state.dispatch_cursor:
        raise UnknownReferenceError(
            f"spare {ev.group_id} stamped for step {ev.target_step}, beyond the dispatch "
            f"cursor {state.dispatch_cursor}",
            groups=(ev.group_id,),
        )
    state.spares.remove(ev.group_id)
    group.phase = Phase.ADMITTED
    group.target_step = ev.target_step
    if ev.repays_group_id is not None:
        loan = state.loans.get(ev.repays_group_id)
        if loan is None:
            raise UnknownReferenceError(
                f"spare {ev.group_id} repays group {ev.repays_group_id}, which was not borrowed",
                groups=(ev.group_id, ev.repays_group_id),
            )
        loan.repaid_by = ev.group_id
    elif ev.replaces_group_id is not None:
        state.counters.replacements += 1
    # Neither: a leftover spare filling the data's last step (decide_admit).


EVOLVERS = {
    RunStarted: evolve_run_started,
    StepAdmitted: evolve_step_admitted,
    GroupAdmitted: evolve_group_admitted,
    SparePulled: evolve_spare_pulled,
    SpareAssigned: evolve_spare_assigned,
}
