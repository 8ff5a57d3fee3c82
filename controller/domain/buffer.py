"""The replay buffer: commit, drop and eviction, and what a vacated slot turns into
(replacement by a spare, a borrow repaid by a spare, a shrunk step, or a failed run)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import IllegalTransitionError, UnknownReferenceError
from .events import (
    GroupBorrowed,
    GroupCommitted,
    GroupEvicted,
    PromptDropped,
    RolloutEvent,
    SpareAssigned,
    SparePulled,
    VacateOutcome,
)
from .state import GroupState, Loan, Phase, RunState

# ---------------------------------------------------------------- planning (decide side)


@dataclass
class VacancyPlanner:
    """Tracks spares, lenders and quotas used by earlier vacancies of the same decision,
    so several drops or evictions decided at once never hand out one spare twice."""

    state: RunState
    spares: list[int] = field(default_factory=list)
    next_group_id: int = 0
    next_prompt: int = 0
    gone: set[int] = field(default_factory=set)
    lenders_used: set[int] = field(default_factory=set)
    quota_delta: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_state(cls, state: RunState) -> VacancyPlanner:
        """A planner starting from ``state``'s pool and cursors."""
        return cls(
            state=state,
            spares=list(state.spares),
            next_group_id=state.next_group_id,
            next_prompt=state.dataset_cursor,
        )

    @classmethod
    def evict_stale(
        cls, state: RunState, stale: Sequence[tuple[GroupState, int]], why: str
    ) -> list[RolloutEvent]:
        """Evict each ``(group, staleness)`` of ``stale`` (the reason: ``why`` and the
        staleness against the bound), then refill the slots they leave."""
        planner = cls.for_state(state).leaving({g.group_id for g, _ in stale})
        events: list[RolloutEvent] = []
        for group, staleness in stale:
            events.extend(
                planner.vacate(
                    group,
                    kind="evict",
                    reason=f"{why}: staleness {staleness} > bound {state.rules.staleness_bound}",
                    staleness=staleness,
                )
            )
        events.extend(planner.refill())
        return events

    def leaving(self, group_ids: set[int]) -> VacancyPlanner:
        """Mark groups this decision will remove, so none is picked as a lender."""
        self.gone.update(group_ids)
        return self

    def vacate(
        self,
        group: GroupState,
        *,
        kind: Literal["drop", "evict"],
        reason: str,
        staleness: int = 0,
    ) -> list[RolloutEvent]:
        """The events that remove ``group`` and deal with the slot it leaves in its step."""
        state, rules = self.state, self.state.rules
        self.gone.add(group.group_id)
        t = group.target_step
        policy = rules.drop_policy
        if kind == "evict" and policy == "fail":
            policy = "replace"  # eviction is the sampler's rule, not a failure
        slot_open = t is not None and t >= state.train_step and t not in state.batches
        tail: list[RolloutEvent] = []
        outcome: VacateOutcome
        if not slot_open or t is None:
            outcome = "unreplaced"
        elif policy == "fail":
            outcome = "run_failed"
        elif policy == "shrink":
            self.quota_delta[t] = self.quota_delta.get(t, 0) - 1
            floor = math.ceil(rules.min_step_fraction * rules.groups_per_step)
            remaining = state.quotas.get(t, 0) + self.quota_delta[t]
            outcome = "shrunk" if remaining >= floor else "run_failed"
        else:
            outcome, tail = self._replace(group, t)
        slot: dict[str, Any] = {
            "group_id": group.group_id,
            "prompt_index": group.prompt_index,
            "data_pass": group.data_pass,
            "target_step": t,
            "reason": reason,
            "outcome": outcome,
        }
        head: RolloutEvent
        if kind == "drop":
            head = PromptDropped(**slot)
        else:
            head = GroupEvicted(**slot, staleness=staleness, recovered=group.recovered)
        return [head, *tail]

    def _replace(self, group: GroupState, step: int) -> tuple[VacateOutcome, list[RolloutEvent]]:
        taken = self._take_spare()
        if taken is None:
            self.quota_delta[step] = self.quota_delta.get(step, 0) - 1
            return "unreplaced", []
        pulled, spare_id, (spare_pass, spare_prompt) = taken
        lender = self._find_lender(step)
        if lender is not None and lender.target_step is not None:
            self.lenders_used.add(lender.group_id)
            return "borrowed", [
                *pulled,
                GroupBorrowed(
                    group_id=lender.group_id,
                    prompt_index=lender.prompt_index,
                    data_pass=lender.data_pass,
                    from_step=lender.target_step,
                    to_step=step,
                ),
                SpareAssigned(
                    group_id=spare_id,
                    prompt_index=spare_prompt,
                    data_pass=spare_pass,
                    target_step=lender.target_step,
                    repays_group_id=lender.group_id,
                ),
            ]
        return "replaced", [
            *pulled,
            SpareAssigned(
                group_id=spare_id,
                prompt_index=spare_prompt,
                data_pass=spare_pass,
                target_step=step,
                replaces_group_id=group.group_id,
            ),
        ]

    def _take_spare(self) -> tuple[list[RolloutEvent], int, tuple[int, int]] | None:
        """A spare (pulled now when the pool is empty): its events, id and (pass, index)."""
        state = self.state
        if self.spares:
            gid = self.spares.pop(0)
            spare = state.groups[gid]
            return [], gid, (spare.data_pass, spare.prompt_index)
        if self.next_prompt < state.walk_size:
            gid, (pass_, index) = self.next_group_id, state.prompt_key_at(self.next_prompt)
            self.next_group_id += 1
            self.next_prompt += 1
            pulled = SparePulled(group_id=gid, prompt_index=index, data_pass=pass_)
            return [pulled], gid, (pass_, index)
        return None

    def _find_lender(self, step: int) -> GroupState | None:
        """in_order only: a ready group from the furthest later step."""
        state = self.state
        if state.rules.sampler != "in_order":
            return None
        bound = state.rules.staleness_bound
        candidates = [
            g
            for g in state.groups.values()
            if g.phase is Phase.READY
            and g.target_step is not None
            and g.target_step > step
            and g.group_id not in self.gone
            and g.group_id not in self.lenders_used
            and state.staleness(g) <= bound  # a stale lender would be evicted next
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda g: (g.target_step, g.group_id))

    def refill(self) -> list[RolloutEvent]:
        """SparePulled events that top the pool up after this decision's vacancies."""
        from .admission import spare_refill

        return spare_refill(
            self.state,
            next_group_id=self.next_group_id,
            next_prompt=self.next_prompt,
            have=len(self.spares),
        )


# ---------------------------------------------------------------- evolve


def _live(state: RunState, group_id: int, what: str) -> GroupState:
    group = state.groups.get(group_id)
    if group is None:
        raise UnknownReferenceError(f"{what} names unknown group {group_id}", groups=(group_id,))
    return group


def evolve_group_committed(state: RunState, ev: GroupCommitted) -> None:
    """All siblings done: the group enters the buffer."""
    group = _live(state, ev.group_id, "GroupCommitted")
    if group.phase is not Phase.ADMITTED:
        raise IllegalTransitionError(
            f"group {ev.group_id} committed from phase {group.phase.value}, not admitted"
        )
    if group.done_count() != group.size:
        raise IllegalTransitionError(
            f"group {ev.group_id} committed with {group.done_count()} of {group.size} siblings done"
        )
    group.phase = Phase.READY
    state.counters.groups_committed += 1
    group.ready_order = state.counters.groups_committed
    state.ready[group.group_id] = None
    state.counters.tokens_committed += sum(row[4] for row in group.sibling_rows)


def _remove(state: RunState, group: GroupState, outcome: VacateOutcome, reason: str) -> None:
    group = state.groups.pop(group.group_id)  # the group as it leaves (a view of its row)
    state.ready.pop(group.group_id, None)
    state.loans.pop(group.group_id, None)
    t = group.target_step
    if outcome in ("shrunk", "unreplaced", "run_failed") and t is not None and t in state.quotas:
        state.quotas[t] -= 1
    if outcome == "run_failed":
        state.failure = (
            f"prompt {group.prompt_index} (group {group.group_id}, step {t}) left the run "
            f"under drop_policy={state.rules.drop_policy}: {reason}"
        )


def evolve_prompt_dropped(state: RunState, ev: PromptDropped) -> None:
    """The prompt leaves the run unfinished."""
    group = _live(state, ev.group_id, "PromptDropped")
    if group.phase is not Phase.ADMITTED:
        raise IllegalTransitionError(
            f"group {ev.group_id} dropped from phase {group.phase.value}, not admitted"
        )
    _remove(state, group, ev.outcome, ev.reason)
    state.counters.prompts_dropped += 1


def evolve_group_evicted(state: RunState, ev: GroupEvicted) -> None:
    """The group leaves the buffer (or generation) unused."""
    group = _live(state, ev.group_id, "GroupEvicted")
    if group.phase not in (Phase.ADMITTED, Phase.READY):
        raise IllegalTransitionError(f"group {ev.group_id} evicted from phase {group.phase.value}")
    _remove(state, group, ev.outcome, ev.reason)
    state.counters.groups_evicted += 1
    if ev.recovered:
        state.counters.groups_evicted_recovered += 1


def evolve_group_borrowed(state: RunState, ev: GroupBorrowed) -> None:
    """A ready group moves from the lender step to the borrower step."""
    group = _live(state, ev.group_id, "GroupBorrowed")
    if group.phase is not Phase.READY or group.target_step != ev.from_step:
        raise IllegalTransitionError(
            f"group {ev.group_id} borrowed from step {ev.from_step} but it is "
            f"{group.phase.value} at step {group.target_step}"
        )
    if ev.to_step >= ev.from_step:
        raise IllegalTransitionError(
            f"borrow must move a group to an earlier step ({ev.from_step} -> {ev.to_step})"
        )
    group.target_step = ev.to_step
    group.borrowed_from = ev.from_step
    state.loans[group.group_id] = Loan(group.group_id, ev.from_step, ev.to_step, None)
    state.counters.borrows += 1


EVOLVERS = {
    GroupCommitted: evolve_group_committed,
    PromptDropped: evolve_prompt_dropped,
    GroupEvicted: evolve_group_evicted,
    GroupBorrowed: evolve_group_borrowed,
}
