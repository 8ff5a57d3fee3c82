"""The four samplers: which ready groups form the batch of a train step, and which
groups are too stale to keep.

- ``in_order``: exactly the groups stamped for the step; the batch waits for all of them.
- ``windowed``: any ready group whose weights lie in [train - S, train], by target step.
- ``weight_fifo``: the same window, oldest weights first.
- ``ready_first``: the first groups to become ready; never evicts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from .admission import admission_blocker
from .state import GroupState, Phase, RunState


@dataclass(frozen=True)
class BatchPlan:
    """What the sampler wants for a step: evictions first, then (when ready) a batch."""

    evict: list[tuple[GroupState, int]] = field(default_factory=list)
    select: list[GroupState] | None = None
    shortfall: int = 0
    waiting_for: str = ""


def is_gated(state: RunState) -> bool:
    """Gated samplers enforce the staleness bound (all but ready_first)."""
    return state.rules.sampler != "ready_first"


def stale_groups(state: RunState, phases: tuple[Phase, ...]) -> list[tuple[GroupState, int]]:
    """Live groups in ``phases`` whose staleness exceeds the bound (gated samplers only)."""
    if not is_gated(state):
        return []
    bound = state.rules.staleness_bound
    out = []
    # Only the ready groups when only they are asked for (the index, not a scan).
    pool = (
        (state.groups[gid] for gid in state.ready)
        if phases == (Phase.READY,)
        else state.live_groups(*phases)  # a view only per group in ``phases``
    )
    for g in pool:
        if g.phase in phases:
            s = state.staleness(g)
            if s > bound:
                out.append((g, s))
    return sorted(out, key=lambda item: item[0].group_id)


#: The reason of an eviction by ``EvictDoomed`` (the replay tool tells such a decision
#: from a batch selection's evictions by it).
DOOMED_EVICTION = "stale at its train step"


def doomed_groups(state: RunState) -> list[tuple[GroupState, int]]:
    """``in_order`` groups that will exceed the staleness bound at their target step,
    each with that staleness, once a replacement generated now would not.

    An ``in_order`` group trains at its stamped step ``t``, at weight version
    ``weight_version + (t - train_step)`` (one version per train step), so its staleness
    there is known as soon as one sibling finished. Evicting it only when it is stale
    (the publish of ``t``'s version) leaves its slot empty when the trainer reaches
    ``t``; evicting it before its replacement could be in bound would only waste one.
    """
    rules = state.rules
    if rules.sampler != "in_order":
        return []
    bound = rules.staleness_bound
    out = []
    for g in state.live_groups(Phase.ADMITTED, Phase.READY):
        t = g.target_step
        if t is None or t < state.train_step or t in state.batches:
            continue
        oldest = g.oldest_version()
        if oldest is None:
            continue
        at = state.weight_version + (t - state.train_step)
        if at - oldest > bound and at - state.published_version <= bound:
            out.append((g, at - oldest))
    return sorted(out, key=lambda item: item[0].group_id)


def _order_windowed(g: GroupState) -> tuple[int, int]:
    return (g.target_step if g.target_step is not None else -1, g.group_id)


def _order_weight_fifo(g: GroupState) -> tuple[int, int]:
    oldest = g.oldest_version()
    return (oldest if oldest is not None else -1, g.group_id)


def _order_ready_first(g: GroupState) -> tuple[int, int]:
    return (g.ready_order if g.ready_order is not None else -1, g.group_id)


_ORDERS: dict[str, Callable[[GroupState], tuple[int, int]]] = {
    "windowed": _order_windowed,
    "weight_fifo": _order_weight_fifo,
    "ready_first": _order_ready_first,
}


def plan_batch(state: RunState, train_step: int) -> BatchPlan:
    """The sampler's plan for ``train_step`` (the caller checked it is the next step)."""
    stale = stale_groups(state, (Phase.READY,))
    if stale:
        return BatchPlan(evict=stale, waiting_for="stale groups to be evicted")
    if state.rules.sampler == "in_order":
        return _plan_in_order(state, train_step)
    return _plan_pooled(state)


def _plan_in_order(state: RunState, t: int) -> BatchPlan:
    rules = state.rules
    if t >= state.dispatch_cursor:
        return BatchPlan(waiting_for=f"step {t} has not been admitted")
    stamped = [g for g in state.live_groups(Phase.ADMITTED, Phase.READY) if g.target_step == t]
    generating = [g for g in stamped if g.phase is Phase.ADMITTED]
    if generating:
        return BatchPlan(waiting_for=f"{len(generating)} groups of step {t} are still generating")
    chosen = sorted(stamped, key=lambda g: g.group_id)
    # Every group of the step left without a replacement (all recorded drops): the step
    # trains an empty batch with its whole size as the recorded shortfall, so later
    # steps are not stuck behind it.
    return BatchPlan(select=chosen, shortfall=rules.groups_per_step - len(chosen))


def _plan_pooled(state: RunState) -> BatchPlan:
    rules = state.rules
    want = rules.groups_per_step
    if rules.sampler == "ready_first":
        # The ready index is in commit order, which is this sampler's order: its head.
        eligible = [state.groups[gid] for gid in itertools.islice(state.ready, want)]
    else:
        # The first groups_per_step in the sampler's order: a heap of that size, not a
        # sort of the whole buffer. Keys are unique (they end in the group id), so this is
        # exactly sorted(...)[:groups_per_step].
        eligible = heapq.nsmallest(
            want, (state.groups[gid] for gid in state.ready), key=_ORDERS[rules.sampler]
        )
    if len(eligible) >= rules.groups_per_step:
        return BatchPlan(select=eligible)
    generating = bool(state.live_groups(Phase.ADMITTED))
    if generating or admission_blocker(state) is None:
        return BatchPlan(waiting_for=f"{len(eligible)} of {rules.groups_per_step} groups ready")
    if not eligible:
        return BatchPlan(waiting_for="no groups are left to train")
    return BatchPlan(select=eligible, shortfall=rules.groups_per_step - len(eligible))
