"""What a dropped prompt does to its step: replace (with a spare, or a borrow repaid by a
spare under in_order), shrink down to min_step_fraction, or fail the run."""

from __future__ import annotations

import pytest
from domain_helpers import (
    PureRun,
    admit,
    admit_all,
    dispatch,
    fail,
    finish_group,
    finish_step,
    kinds,
    only,
    step_groups,
    train,
)

from rolloutlog.controller.domain import (
    AdmitStep,
    DispatchSiblings,
    MarkCheckpoint,
    Phase,
    PublishWeights,
    RecordTrainStep,
    SelectBatch,
    check_invariants,
)
from rolloutlog.controller.domain.errors import RunFailedError
from rolloutlog.controller.domain.state import Loan


def _drop(run: PureRun, gid: int, reason: str = "boom") -> list:
    dispatch(run, gid, (0,))
    return fail(run, gid, 0, retryable=False, reason=reason)


# ---------------------------------------------------------------- replace


def test_replace_assigns_a_spare_the_dropped_groups_stamp() -> None:
    run = PureRun(groups_per_step=2, spare_pool_size=1, drop_policy="replace")
    admit(run)  # groups 0, 1 at step 0; spare 2
    applied = _drop(run, 0)
    assert kinds(applied) == ["SiblingFailed", "PromptDropped", "SpareAssigned", "SparePulled"]
    dropped = only(applied, "PromptDropped")[0]
    assert dropped.outcome == "replaced"
    spare = only(applied, "SpareAssigned")[0]
    assert (spare.group_id, spare.prompt_index, spare.target_step) == (2, 2, 0)
    assert (spare.replaces_group_id, spare.repays_group_id) == (0, None)
    assert only(applied, "SparePulled")[0].prompt_index == 3  # the pool is refilled
    s = run.state
    assert s.groups[2].phase is Phase.ADMITTED and s.groups[2].target_step == 0
    assert s.spares == [3]
    assert s.quotas[0] == 2
    assert s.counters.replacements == 1
    assert step_groups(run, 0) == [1, 2]
    check_invariants(s)


def test_replace_pulls_a_new_spare_when_the_pool_is_empty() -> None:
    run = PureRun(groups_per_step=2, spare_pool_size=0)
    admit(run)
    applied = _drop(run, 1)
    assert kinds(applied) == ["SiblingFailed", "PromptDropped", "SparePulled", "SpareAssigned"]
    assert only(applied, "SpareAssigned")[0].group_id == 2
    assert run.state.groups[2].target_step == 0
    assert run.state.spares == []


def test_replace_without_any_spare_leaves_the_slot_unreplaced() -> None:
    run = PureRun(groups_per_step=2, spare_pool_size=0, dataset_size=2)
    admit(run)
    applied = _drop(run, 1)
    assert kinds(applied) == ["SiblingFailed", "PromptDropped"]
    assert only(applied, "PromptDropped")[0].outcome == "unreplaced"
    assert run.state.quotas[0] == 1
    finish_step(run, 0)
    batch = only(train(run), "BatchSelected")[0]
    assert (batch.group_ids, batch.shortfall) == ([0], 1)


def test_in_order_borrows_from_the_furthest_later_step_and_the_spare_repays_it() -> None:
    run = PureRun(groups_per_step=2, lookahead=2, spare_pool_size=1, sampler="in_order")
    admit_all(run)
    # step 0: 0, 1; spare 2; step 1: 3, 4; step 2: 5, 6
    assert (step_groups(run, 0), step_groups(run, 1), step_groups(run, 2)) == (
        [0, 1],
        [3, 4],
        [5, 6],
    )
    finish_group(run, 3)
    finish_group(run, 5)
    applied = _drop(run, 0, reason="bad prompt")
    assert kinds(applied) == [
        "SiblingFailed",
        "PromptDropped",
        "GroupBorrowed",
        "SpareAssigned",
        "SparePulled",
    ]
    assert only(applied, "PromptDropped")[0].outcome == "borrowed"
    borrow = only(applied, "GroupBorrowed")[0]
    assert (borrow.group_id, borrow.from_step, borrow.to_step) == (5, 2, 0)
    repay = only(applied, "SpareAssigned")[0]
    assert (repay.group_id, repay.target_step, repay.repays_group_id) == (2, 2, 5)
    assert repay.replaces_group_id is None
    s = run.state
    assert s.loans == {5: Loan(group_id=5, lender_step=2, borrower_step=0, repaid_by=2)}
    assert s.groups[5].target_step == 0 and s.groups[5].borrowed_from == 2
    assert (s.counters.borrows, s.counters.replacements) == (1, 0)
    assert step_groups(run, 0) == [1, 5]
    assert step_groups(run, 2) == [2, 6]
    check_invariants(s)
    # Every step still trains its full quota; the loan leaves with the trained group.
    trained = []
    for t in range(3):
        finish_step(run, t)
        trained.append(only(train(run), "BatchSelected")[0].group_ids)
        if t < 2:
            admit(run)
    assert trained[0] == [1, 5]
    assert trained[2] == [2, 6]
    assert s.loans == {}


@pytest.mark.parametrize("sampler", ["windowed", "weight_fifo", "ready_first"])
def test_pooled_samplers_replace_instead_of_borrowing(sampler: str) -> None:
    run = PureRun(groups_per_step=2, lookahead=2, spare_pool_size=1, sampler=sampler)
    admit_all(run)
    finish_group(run, 5)
    applied = _drop(run, 0)
    assert "GroupBorrowed" not in kinds(applied)
    assert only(applied, "PromptDropped")[0].outcome == "replaced"
    assert run.state.groups[5].target_step == 2


def test_no_borrow_without_a_spare_in_hand() -> None:
    run = PureRun(groups_per_step=2, lookahead=2, spare_pool_size=0, dataset_size=6)
    admit_all(run)
    finish_group(run, 4)  # step 2 is 4, 5
    applied = _drop(run, 0)
    assert kinds(applied) == ["SiblingFailed", "PromptDropped"]
    assert only(applied, "PromptDropped")[0].outcome == "unreplaced"
    assert run.state.groups[4].target_step == 2
    assert run.state.loans == {}


def test_a_drop_in_an_already_selected_step_is_not_replaced() -> None:
    # windowed trains any ready group, so step 0's slow group outlives step 0's batch.
    run = PureRun(groups_per_step=1, lookahead=1, spare_pool_size=1, sampler="windowed")
    admit_all(run)  # step 0: group 0, spare 1, step 1: group 2
    finish_group(run, 2)
    batch = only(train(run), "BatchSelected")[0]
    assert batch.group_ids == [2]
    applied = _drop(run, 0)
    assert kinds(applied) == ["SiblingFailed", "PromptDropped"]
    assert only(applied, "PromptDropped")[0].outcome == "unreplaced"
    assert run.state.spares == [1]


# ---------------------------------------------------------------- shrink


def test_shrink_down_to_min_step_fraction_then_the_run_fails() -> None:
    run = PureRun(groups_per_step=4, min_step_fraction=0.5, spare_pool_size=2, drop_policy="shrink")
    admit(run)  # groups 0..3, spares 4, 5
    first = _drop(run, 0)
    assert kinds(first) == ["SiblingFailed", "PromptDropped"]  # no spare is used
    assert only(first, "PromptDropped")[0].outcome == "shrunk"
    assert run.state.quotas[0] == 3
    assert only(_drop(run, 1), "PromptDropped")[0].outcome == "shrunk"
    assert run.state.quotas[0] == 2  # = ceil(0.5 * 4): the floor
    assert run.state.failure is None
    check_invariants(run.state)
    last = _drop(run, 2, reason="oom")
    assert only(last, "PromptDropped")[0].outcome == "run_failed"
    failure = run.state.failure
    assert failure is not None
    assert "prompt 2 (group 2, step 0)" in failure and "drop_policy=shrink" in failure
    assert "oom" in failure
    assert run.state.spares == [4, 5]
    with pytest.raises(RunFailedError, match="prompt 2"):
        run.execute(AdmitStep())


def test_a_shrunk_step_trains_with_a_recorded_shortfall() -> None:
    run = PureRun(groups_per_step=4, min_step_fraction=0.5, drop_policy="shrink")
    admit(run)
    _drop(run, 3)
    finish_step(run, 0)
    batch = only(train(run), "BatchSelected")[0]
    assert (batch.group_ids, batch.shortfall) == ([0, 1, 2], 1)


# ---------------------------------------------------------------- fail


def test_fail_policy_stops_the_run() -> None:
    run = PureRun(groups_per_step=2, spare_pool_size=1, drop_policy="fail")
    admit(run)
    dispatch(run, 0)
    applied = fail(run, 0, 1, retryable=False, reason="no retry")
    assert kinds(applied) == ["SiblingFailed", "PromptDropped"]
    assert only(applied, "PromptDropped")[0].outcome == "run_failed"
    assert run.state.failure is not None and "drop_policy=fail" in run.state.failure
    check_invariants(run.state)
    for command in (
        AdmitStep(),
        DispatchSiblings(1, (0,), 0),
        SelectBatch(0),
        RecordTrainStep(0, 1),
        PublishWeights(0),
    ):
        with pytest.raises(RunFailedError, match="prompt 0"):
            run.execute(command)
    # A checkpoint marker is still allowed (so the run can be restored before the failure).
    assert kinds(run.execute(MarkCheckpoint(0))) == ["CheckpointMarked"]


def test_eviction_under_fail_policy_replaces_instead_of_failing() -> None:
    run = PureRun(
        groups_per_step=1, lookahead=3, staleness_bound=0, sampler="windowed", drop_policy="fail"
    )
    admit_all(run)  # step 0: 0, spare 1, step 1: 2, step 2: 3, step 3: 4
    finish_group(run, 3, version=0)  # ready with weights 0
    finish_group(run, 0, version=0)
    train(run, publish=False)  # group 0 trained: trainer at 1, group 3 now stale
    applied = run.execute(SelectBatch(1))
    evicted = only(applied, "GroupEvicted")
    assert [(e.group_id, e.outcome) for e in evicted] == [(3, "replaced")]
    assert run.state.failure is None
