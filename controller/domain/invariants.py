"""The invariants over a state (docs/concepts.md, "Invariants"). Each violation is a
typed error naming what is wrong.

Invariants 7 (monotonic sequence/epoch/step/version) and 8 (no unknown references) are
enforced event by event in ``evolve``; the checks here cover what a state can show.
"""

from __future__ import annotations

from .errors import (
    ConservationError,
    CursorBehindError,
    InvariantViolation,
    LoanError,
    MonotonicityError,
    SelectionError,
    SiblingAccountingError,
    StalenessError,
)
from .state import Phase, RunState, SiblingStatus, ready_index


def find_violations(state: RunState) -> list[InvariantViolation]:
    """Every invariant violation in ``state`` (empty when all hold)."""
    if state.config is None:
        return []
    out: list[InvariantViolation] = []
    for check in (_cursor, _conservation, _selection, _siblings, _loans, _staleness, _monotonic):
        out.extend(check(state))
    return out


def check_invariants(state: RunState) -> None:
    """Raise the first violation, if any."""
    violations = find_violations(state)
    if violations:
        raise violations[0]


def _cursor(state: RunState) -> list[InvariantViolation]:
    out: list[InvariantViolation] = []
    for g in state.groups.values():
        if g.target_step is not None and g.target_step >= state.dispatch_cursor:
            out.append(
                CursorBehindError(
                    f"dispatch cursor {state.dispatch_cursor} is behind group {g.group_id} "
                    f"(prompt {g.prompt_index}) stamped for step {g.target_step}",
                    groups=(g.group_id,),
                )
            )
    if state.dispatch_cursor > state.train_step + state.rules.lookahead + 1:
        out.append(
            CursorBehindError(
                f"dispatch cursor {state.dispatch_cursor} ran past train step "
                f"{state.train_step} + lookahead {state.rules.lookahead}"
            )
        )
    return out


def _conservation(state: RunState) -> list[InvariantViolation]:
    out: list[InvariantViolation] = []
    c = state.counters
    live = len(state.groups)
    pulled = state.dataset_cursor
    accounted = live + c.groups_trained + c.groups_evicted + c.prompts_dropped
    if accounted != pulled:
        out.append(
            ConservationError(
                f"{pulled} prompts pulled but {accounted} accounted for ({live} live, "
                f"{c.groups_trained} trained, {c.groups_evicted} evicted, "
                f"{c.prompts_dropped} dropped)"
            )
        )
    if state.next_group_id != pulled:
        out.append(ConservationError(f"{state.next_group_id} groups for {pulled} pulled prompts"))
    # A prompt's identity is (pass, index): the same index in two passes is two prompts.
    prompts: dict[tuple[int, int], int] = {}
    for g in state.groups.values():
        key = (g.data_pass, g.prompt_index)
        if key in prompts:
            out.append(
                ConservationError(
                    f"prompt {g.prompt_index} is in groups {prompts[key]} and {g.group_id} "
                    f"(pass {g.data_pass})",
                    groups=(prompts[key], g.group_id),
                )
            )
        prompts[key] = g.group_id
        if g.phase in (Phase.TRAINED, Phase.EVICTED, Phase.DROPPED):
            out.append(
                ConservationError(
                    f"group {g.group_id} is live in terminal phase {g.phase.value}",
                    groups=(g.group_id,),
                )
            )
        if (g.phase is Phase.SPARE) != (g.group_id in state.spares):
            out.append(
                ConservationError(
                    f"group {g.group_id} is {g.phase.value} but "
                    f"{'not ' if g.group_id not in state.spares else ''}in the spare pool",
                    groups=(g.group_id,),
                )
            )
    if len(set(state.spares)) != len(state.spares):
        out.append(ConservationError("a spare is in the pool twice"))
    if state.rules.sampler == "in_order":
        for step, quota in state.quotas.items():
            if step < state.train_step or step in state.batches:
                continue
            count = sum(
                1
                for g in state.groups.values()
                if g.target_step == step and g.phase in (Phase.ADMITTED, Phase.READY)
            )
            # Checked between decisions (inside one, a vacancy may await its replacement):
            # a step holds exactly its quota, the rest being recorded drops.
            if count != quota:
                out.append(
                    ConservationError(
                        f"step {step} should train {quota} groups but {count} are stamped for "
                        "it (a group left without a recorded drop or replacement)"
                    )
                )
    return out


def _selection(state: RunState) -> list[InvariantViolation]:
    out: list[InvariantViolation] = []
    seen: dict[int, int] = {}
    for step, gids in state.batches.items():
        if step != state.train_step:
            out.append(
                SelectionError(
                    f"batch of step {step} is pending while step {state.train_step} is next"
                )
            )
        short = state.batch_shortfall.get(step, 0)
        if len(gids) + short != state.rules.groups_per_step:
            out.append(
                SelectionError(
                    f"batch of step {step} has {len(gids)} groups and a recorded shortfall of "
                    f"{short}, not {state.rules.groups_per_step}"
                )
            )
        for gid in gids:
            if gid in seen:
                out.append(
                    SelectionError(
                        f"group {gid} is in the batches of steps {seen[gid]} and {step}",
                        groups=(gid,),
                    )
                )
            seen[gid] = step
            g = state.groups.get(gid)
            if g is None or g.phase is not Phase.SELECTED:
                out.append(
                    SelectionError(
                        f"batch of step {step} holds group {gid}, not selected", groups=(gid,)
                    )
                )
    for g in state.groups.values():
        if (
            g.phase is Phase.SELECTED
            and g.group_id not in seen
            and g.selected_for not in (state.train_step,)
        ):
            out.append(
                SelectionError(
                    f"group {g.group_id} is selected but in no batch", groups=(g.group_id,)
                )
            )
    # The ready index the samplers read must be exactly the READY groups, in commit order.
    if list(state.ready) != list(ready_index(state.groups)):
        out.append(
            SelectionError(
                f"the ready index lists {len(state.ready)} groups, not the "
                f"{sum(1 for g in state.groups.values() if g.phase is Phase.READY)} ready "
                "groups in commit order"
            )
        )
    return out


def _siblings(state: RunState) -> list[InvariantViolation]:
    out: list[InvariantViolation] = []
    size = state.rules.group_size
    for g in state.groups.values():
        if g.size != size:
            out.append(
                SiblingAccountingError(
                    f"group {g.group_id} has {g.size} siblings, not {size}",
                    groups=(g.group_id,),
                )
            )
        done = g.done_count()
        all_done = done == g.size
        if g.phase in (Phase.READY, Phase.SELECTED) and not all_done:
            out.append(
                SiblingAccountingError(
                    f"group {g.group_id} is {g.phase.value} with {done} of {size} siblings done",
                    groups=(g.group_id,),
                )
            )
        if g.phase is Phase.ADMITTED and all_done:
            out.append(
                SiblingAccountingError(
                    f"group {g.group_id} has every sibling done but was not committed",
                    groups=(g.group_id,),
                )
            )
        if g.phase is Phase.SPARE and any(
            s.status is not SiblingStatus.PENDING for s in g.siblings
        ):
            out.append(
                SiblingAccountingError(
                    f"spare group {g.group_id} has dispatched siblings", groups=(g.group_id,)
                )
            )
        for i, s in enumerate(g.siblings):
            if s.status is not SiblingStatus.PENDING and s.attempt < 1 and not s.salvaged:
                out.append(
                    SiblingAccountingError(
                        f"group {g.group_id} sibling {i} is {s.status.value} without an attempt",
                        groups=(g.group_id,),
                    )
                )
    return out


def _loans(state: RunState) -> list[InvariantViolation]:
    out: list[InvariantViolation] = []
    repayers: dict[int, int] = {}
    for loan in state.loans.values():
        if loan.repaid_by is None:
            out.append(
                LoanError(
                    f"group {loan.group_id} was borrowed from step {loan.lender_step} for step "
                    f"{loan.borrower_step} without a repayment or a recorded debt",
                    groups=(loan.group_id,),
                )
            )
        elif loan.repaid_by in repayers:
            out.append(
                LoanError(
                    f"spare {loan.repaid_by} repays both group {repayers[loan.repaid_by]} and "
                    f"group {loan.group_id}",
                    groups=(loan.group_id, repayers[loan.repaid_by]),
                )
            )
        else:
            repayers[loan.repaid_by] = loan.group_id
    return out


def _staleness(state: RunState) -> list[InvariantViolation]:
    if state.rules.sampler == "ready_first":
        return []
    bound = state.rules.staleness_bound
    return [
        StalenessError(
            f"group {g.group_id} selected for step {g.selected_for} with staleness "
            f"{g.selected_staleness} > bound {bound}",
            groups=(g.group_id,),
        )
        for g in state.groups.values()
        if g.phase is Phase.SELECTED and (g.selected_staleness or 0) > bound
    ]


def _monotonic(state: RunState) -> list[InvariantViolation]:
    out: list[InvariantViolation] = []
    if state.weight_version < state.published_version:
        out.append(
            MonotonicityError(
                f"generation serves weight version {state.published_version}, ahead of the "
                f"trainer's {state.weight_version}"
            )
        )
    if state.checkpoint is not None and state.checkpoint.train_step > state.train_step:
        out.append(
            MonotonicityError(
                f"checkpoint at train step {state.checkpoint.train_step} is ahead of train step "
                f"{state.train_step}"
            )
        )
    return out
