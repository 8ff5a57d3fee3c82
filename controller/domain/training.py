"""The trainer's side: batch selection, train steps and weight versions, weight sync
(with eviction and abort of stale work), and the checkpoint marker."""

from __future__ import annotations

from .buffer import VacancyPlanner
from .commands import EvictDoomed, MarkCheckpoint, PublishWeights, RecordTrainStep, SelectBatch
from .errors import (
    BatchNotReadyError,
    IllegalTransitionError,
    MonotonicityError,
    SelectionError,
    StepOutOfOrderError,
)
from .events import (
    BatchSelected,
    CheckpointMarked,
    GroupSelected,
    RolloutEvent,
    SiblingAborted,
    StepTrained,
    WeightsPublished,
)
from .samplers import DOOMED_EVICTION, doomed_groups, plan_batch, stale_groups
from .state import CheckpointRef, Phase, RunState, SiblingStatus

# ---------------------------------------------------------------- decide


def _next_step(state: RunState, step: int, what: str) -> None:
    if step != state.train_step:
        raise StepOutOfOrderError(
            f"{what} for step {step}, but the next train step is {state.train_step}"
        )


def decide_select(state: RunState, cmd: SelectBatch) -> list[RolloutEvent]:
    """Evictions of stale groups (then the caller asks again), or the batch."""
    _next_step(state, cmd.train_step, "batch selection")
    if cmd.train_step in state.batches:
        raise IllegalTransitionError(f"the batch of step {cmd.train_step} is already selected")
    plan = plan_batch(state, cmd.train_step)
    if plan.evict:
        return VacancyPlanner.evict_stale(state, plan.evict, "stale")
    if plan.select is None:
        raise BatchNotReadyError(f"batch of step {cmd.train_step} not ready: {plan.waiting_for}")
    events: list[RolloutEvent] = [
        GroupSelected(
            group_id=g.group_id,
            prompt_index=g.prompt_index,
            data_pass=g.data_pass,
            target_step=g.target_step if g.target_step is not None else cmd.train_step,
            train_step=cmd.train_step,
            staleness=state.staleness(g),
        )
        for g in plan.select
    ]
    events.append(
        BatchSelected(
            train_step=cmd.train_step,
            group_ids=[g.group_id for g in plan.select],
            shortfall=plan.shortfall,
        )
    )
    return events


def decide_evict_doomed(state: RunState, _cmd: EvictDoomed) -> list[RolloutEvent]:
    """Evictions (with refills) of the groups ``doomed_groups`` names; none: no events."""
    doomed = doomed_groups(state)
    return VacancyPlanner.evict_stale(state, doomed, DOOMED_EVICTION) if doomed else []


def decide_train(state: RunState, cmd: RecordTrainStep) -> list[RolloutEvent]:
    """StepTrained: the selected batch is trained, the weight version moves on by one."""
    _next_step(state, cmd.train_step, "train step")
    if cmd.train_step not in state.batches:
        raise IllegalTransitionError(
            f"step {cmd.train_step} cannot train: its batch has not been selected"
        )
    if cmd.weight_version != state.weight_version + 1:
        raise IllegalTransitionError(
            f"step {cmd.train_step} must produce weight version {state.weight_version + 1}, "
            f"not {cmd.weight_version}"
        )
    return [StepTrained(train_step=cmd.train_step, weight_version=cmd.weight_version)]


def decide_publish(state: RunState, cmd: PublishWeights) -> list[RolloutEvent]:
    """WeightsPublished; gated samplers evict groups that are already too stale and abort
    in-flight siblings whose weights would make them stale."""
    if not state.published_version <= cmd.weight_version <= state.weight_version:
        raise IllegalTransitionError(
            f"cannot publish weight version {cmd.weight_version}: generation serves "
            f"{state.published_version} and the trainer is at {state.weight_version}"
        )
    events: list[RolloutEvent] = [WeightsPublished(weight_version=cmd.weight_version)]
    stale = stale_groups(state, (Phase.ADMITTED, Phase.READY))
    planner = VacancyPlanner.for_state(state).leaving({g.group_id for g, _ in stale})
    for group, staleness in stale:
        events.extend(
            planner.vacate(
                group,
                kind="evict",
                reason=f"stale at weight sync: staleness {staleness} > bound "
                f"{state.rules.staleness_bound}",
                staleness=staleness,
            )
        )
    events.extend(planner.refill())
    rules = state.rules
    if rules.abort_stale_at_weight_sync and rules.sampler != "ready_first":
        evicted = {g.group_id for g, _ in stale}
        for group in sorted(state.groups.values(), key=lambda g: g.group_id):
            if group.phase is not Phase.ADMITTED or group.group_id in evicted:
                continue
            for index, sib in enumerate(group.siblings):
                if sib.status is not SiblingStatus.IN_FLIGHT or sib.weight_version is None:
                    continue
                lag = state.weight_version - sib.weight_version
                if lag > rules.staleness_bound:
                    events.append(
                        SiblingAborted(
                            group_id=group.group_id,
                            sibling=index,
                            attempt=sib.attempt,
                            reason=f"stale weights: dispatched with version "
                            f"{sib.weight_version}, trainer at {state.weight_version}",
                        )
                    )
    return events


def decide_checkpoint(state: RunState, cmd: MarkCheckpoint) -> list[RolloutEvent]:
    """CheckpointMarked after ``train_step`` steps, recording the cursors."""
    if cmd.train_step != state.train_step:
        raise StepOutOfOrderError(
            f"checkpoint for {cmd.train_step} trained steps, but {state.train_step} have trained"
        )
    return [
        CheckpointMarked(
            train_step=cmd.train_step,
            weight_version=state.weight_version,
            dispatch_cursor=state.dispatch_cursor,
            dataset_cursor=state.dataset_cursor,
        )
    ]


# ---------------------------------------------------------------- evolve


def evolve_group_selected(state: RunState, ev: GroupSelected) -> None:
    """The group is in the batch of ``train_step``."""
    group = state.groups.get(ev.group_id)
    if group is None or group.phase is not Phase.READY:
        raise SelectionError(
            f"group {ev.group_id} selected for step {ev.train_step} but it is "
            f"{'unknown' if group is None else group.phase.value}, not ready "
            "(selected twice, or never committed)",
            groups=(ev.group_id,),
        )
    if ev.train_step != state.train_step:
        raise SelectionError(
            f"group {ev.group_id} selected for step {ev.train_step}; the next step is "
            f"{state.train_step}",
            groups=(ev.group_id,),
        )
    group.phase = Phase.SELECTED
    del state.ready[group.group_id]
    group.selected_for = ev.train_step
    group.selected_staleness = ev.staleness


def evolve_batch_selected(state: RunState, ev: BatchSelected) -> None:
    """The batch is complete."""
    for gid in ev.group_ids:
        g = state.groups.get(gid)
        if g is None or g.phase is not Phase.SELECTED or g.selected_for != ev.train_step:
            raise SelectionError(
                f"batch of step {ev.train_step} lists group {gid}, which was not selected for it",
                groups=(gid,),
            )
    rules = state.rules
    if len(ev.group_ids) + ev.shortfall != rules.groups_per_step:
        raise SelectionError(
            f"batch of step {ev.train_step} has {len(ev.group_ids)} groups and shortfall "
            f"{ev.shortfall}; they must add up to groups_per_step {rules.groups_per_step}"
        )
    quota = state.quotas.get(ev.train_step)
    if rules.sampler == "in_order" and quota is not None and len(ev.group_ids) != quota:
        raise SelectionError(
            f"batch of step {ev.train_step} has {len(ev.group_ids)} groups but the step "
            f"should train {quota} (the rest are recorded drops)"
        )
    state.batches[ev.train_step] = list(ev.group_ids)
    state.batch_shortfall[ev.train_step] = ev.shortfall
    state.counters.shortfall += ev.shortfall


def evolve_step_trained(state: RunState, ev: StepTrained) -> None:
    """The batch's groups are trained and leave the state."""
    if ev.train_step != state.train_step:
        raise MonotonicityError(
            f"step {ev.train_step} trained, but the next train step is {state.train_step}"
        )
    if ev.weight_version != state.weight_version + 1:
        raise MonotonicityError(
            f"step {ev.train_step} produced weight version {ev.weight_version} after "
            f"{state.weight_version}"
        )
    batch = state.batches.pop(ev.train_step, None)
    if batch is None:
        raise SelectionError(f"step {ev.train_step} trained without a selected batch")
    for gid in batch:
        del state.groups[gid]
        state.loans.pop(gid, None)
    state.batch_shortfall.pop(ev.train_step, None)
    state.quotas.pop(ev.train_step, None)
    state.counters.groups_trained += len(batch)
    state.train_step = ev.train_step + 1
    state.weight_version = ev.weight_version


def evolve_weights_published(state: RunState, ev: WeightsPublished) -> None:
    """Generation serves a new version."""
    if ev.weight_version < state.published_version:
        raise MonotonicityError(
            f"published weight version {ev.weight_version} after {state.published_version}"
        )
    state.published_version = ev.weight_version


def evolve_checkpoint_marked(state: RunState, ev: CheckpointMarked) -> None:
    """Remember the newest checkpoint (its offset is the event's own)."""
    state.checkpoint = CheckpointRef(state.last_seq, ev.train_step, ev.weight_version)


EVOLVERS = {
    GroupSelected: evolve_group_selected,
    BatchSelected: evolve_batch_selected,
    StepTrained: evolve_step_trained,
    WeightsPublished: evolve_weights_published,
    CheckpointMarked: evolve_checkpoint_marked,
}
