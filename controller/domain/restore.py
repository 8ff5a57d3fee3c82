"""Restore and resume: a new epoch, unfinished work made dispatchable again (reusing
finished siblings at ``sibling`` granularity), salvage of valid completions recorded
after the checkpoint, and eviction of recovered groups that are already too stale."""

from __future__ import annotations

from dataclasses import replace

from .buffer import VacancyPlanner
from .commands import Restore, Resume
from .errors import MonotonicityError, RestoreError
from .events import RolloutEvent, RunRestored, RunResumed, SiblingCompleted
from .samplers import stale_groups
from .siblings import commit_if_complete
from .state import GroupState, Phase, RunState, SiblingState, SiblingStatus


def decide_restore(state: RunState, cmd: Restore) -> list[RolloutEvent]:
    """RunRestored with the recovery counts, then the salvaged completions (and commits)."""
    if cmd.epoch <= state.epoch:
        raise RestoreError(f"restore must open a newer epoch than {state.epoch}, not {cmd.epoch}")
    ckpt = state.checkpoint
    at_checkpoint = ckpt is not None and ckpt.offset == cmd.from_offset
    if not at_checkpoint and not cmd.forced:
        raise RestoreError(
            f"offset {cmd.from_offset} is not a checkpoint marker (newest checkpoint in its "
            f"history: {ckpt.offset if ckpt else 'none'}); pass a checkpoint offset, or force"
        )
    rules = state.rules
    by_group = rules.recovery_granularity == "group"
    admitted = [g for g in state.groups.values() if g.phase is Phase.ADMITTED]
    complete = sum(1 for g in state.groups.values() if g.phase in (Phase.READY, Phase.SELECTED))
    reused = 0 if by_group else sum(g.done_count() for g in admitted)
    to_run = sum(g.size if by_group else g.size - g.done_count() for g in admitted)
    salvage_events = [] if by_group or cmd.mode == "strict" else _salvage(state, cmd)
    salvaged = sum(1 for e in salvage_events if isinstance(e, SiblingCompleted))
    head = RunRestored(
        from_offset=cmd.from_offset,
        epoch=cmd.epoch,
        mode=cmd.mode,
        granularity=rules.recovery_granularity,
        forced=cmd.forced and not at_checkpoint,
        checkpoint_train_step=state.train_step,
        checkpoint_weight_version=state.weight_version,
        complete_groups_restored=complete,
        unfinished_groups_found=len(admitted),
        siblings_reused=reused,
        siblings_rerun=to_run - salvaged,
        siblings_salvaged=salvaged,
    )
    return [head, *salvage_events]


def _salvage(state: RunState, cmd: Restore) -> list[RolloutEvent]:
    """Completions after the offset, by weights the restored trainer still has."""
    events: list[RolloutEvent] = []
    taken: dict[int, dict[int, int]] = {}
    for offset, c in sorted(cmd.salvage, key=lambda s: s[0]):
        group = state.groups.get(c.group_id)
        if group is None or group.phase is not Phase.ADMITTED:
            continue
        if not 0 <= c.sibling < group.size:
            continue
        if group.sibling(c.sibling).status is SiblingStatus.DONE:
            continue
        if c.weight_version > state.weight_version or c.completion_tokens < 1:
            continue
        done = taken.setdefault(c.group_id, {})
        if c.sibling in done:
            continue
        done[c.sibling] = c.weight_version
        # A salvaged event keeps the engine that generated the sample (in the abandoned
        # branch): engine_id is null only where no engine is known (an in-process
        # backend, an older log), and the metrics count a salvage as no new work. The
        # prompt count is raised to 1, the least a live completion may report.
        salvaged = replace(c, prompt_tokens=max(c.prompt_tokens, 1))
        events.append(SiblingCompleted.of(salvaged, salvaged_from=offset))
    for gid, done in taken.items():
        events.extend(commit_if_complete(state, gid, extra_done=done))
    return events


def decide_resume(state: RunState, cmd: Resume) -> list[RolloutEvent]:
    """RunResumed: in-flight siblings of the old epoch will be dispatched again."""
    if cmd.epoch <= state.epoch:
        raise RestoreError(f"resume must open a newer epoch than {state.epoch}, not {cmd.epoch}")
    rerun = sum(
        g.count(SiblingStatus.IN_FLIGHT) for g in state.groups.values() if g.phase is Phase.ADMITTED
    )
    return [RunResumed(epoch=cmd.epoch, siblings_rerun=rerun)]


def decide_evict_stale(state: RunState, reason: str) -> list[RolloutEvent]:
    """Evict every live group beyond the staleness bound (gated samplers), with refills."""
    stale = stale_groups(state, (Phase.ADMITTED, Phase.READY))
    if not stale:
        return []
    return VacancyPlanner.evict_stale(state, stale, reason)


# ---------------------------------------------------------------- evolve


def _reset_in_flight(group: GroupState, *, all_siblings: bool) -> None:
    if not all_siblings and not group.count(SiblingStatus.IN_FLIGHT):
        return  # most groups of a large buffer: nothing to replace, no view to make
    for i, s in enumerate(group.siblings):
        if all_siblings or s.status is SiblingStatus.IN_FLIGHT:
            # Keep attempt and failure counts: fencing and retry limits carry over.
            group.set_sibling(i, SiblingState(attempt=s.attempt, failures=s.failures))


def _new_epoch(state: RunState, epoch: int) -> None:
    if epoch <= state.epoch:
        raise MonotonicityError(f"epoch {epoch} opened after epoch {state.epoch}")
    state.epoch = epoch


def evolve_run_restored(state: RunState, ev: RunRestored) -> None:
    """New epoch; every live group is recovered; unfinished work becomes dispatchable."""
    _new_epoch(state, ev.epoch)
    by_group = ev.granularity == "group"
    for group in state.groups.values():
        if group.phase is Phase.SPARE:
            continue
        group.recovered = True
        if group.phase is Phase.ADMITTED:
            _reset_in_flight(group, all_siblings=by_group)


def evolve_run_resumed(state: RunState, ev: RunResumed) -> None:
    """New epoch; the old epoch's in-flight siblings become dispatchable again."""
    _new_epoch(state, ev.epoch)
    for group in state.groups.values():
        if group.phase is Phase.ADMITTED:
            _reset_in_flight(group, all_siblings=False)


EVOLVERS = {RunRestored: evolve_run_restored, RunResumed: evolve_run_resumed}
