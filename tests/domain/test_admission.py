"""Admission rules of the pure core: cursors, stamps, lookahead, dataset end, spares."""

from __future__ import annotations

import pytest
from domain_helpers import PureRun, admit, finish_step, kinds, only, rules, train

from rolloutlog.controller.domain import (
    AdmitStep,
    DispatchSiblings,
    FailSibling,
    Phase,
    SelectBatch,
    SiblingStatus,
    StartRun,
    decide,
    initial_state,
)
from rolloutlog.controller.domain.errors import (
    BatchNotReadyError,
    DatasetExhaustedError,
    IllegalTransitionError,
    LookaheadExceededError,
)


def test_admit_advances_both_cursors_and_stamps_the_step() -> None:
    run = PureRun(groups_per_step=3, spare_pool_size=2, lookahead=1)
    applied = admit(run)
    assert kinds(applied) == [
        "StepAdmitted",
        "GroupAdmitted",
        "GroupAdmitted",
        "GroupAdmitted",
        "SparePulled",
        "SparePulled",
    ]
    (step,) = only(applied, "StepAdmitted")
    assert (step.target_step, step.group_count) == (0, 3)
    admitted = only(applied, "GroupAdmitted")
    assert [(e.group_id, e.prompt_index, e.target_step) for e in admitted] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 2, 0),
    ]
    assert [(e.group_id, e.prompt_index) for e in only(applied, "SparePulled")] == [(3, 3), (4, 4)]
    s = run.state
    assert (s.dispatch_cursor, s.dataset_cursor, s.next_group_id) == (1, 5, 5)
    assert s.quotas == {0: 3}
    assert s.spares == [3, 4]
    for gid in (0, 1, 2):
        g = s.groups[gid]
        assert (g.phase, g.target_step) == (Phase.ADMITTED, 0)
        assert all(sib.status is SiblingStatus.PENDING and sib.attempt == 0 for sib in g.siblings)
        assert len(g.siblings) == 2
    for gid in (3, 4):
        assert (s.groups[gid].phase, s.groups[gid].target_step) == (Phase.SPARE, None)

    # The next step takes the next prompts; the pool is full, so no spare is pulled.
    applied = admit(run)
    assert kinds(applied) == ["StepAdmitted"] + ["GroupAdmitted"] * 3
    assert [e.prompt_index for e in only(applied, "GroupAdmitted")] == [5, 6, 7]
    assert {e.target_step for e in only(applied, "GroupAdmitted")} == {1}
    assert (s.dispatch_cursor, s.dataset_cursor) == (2, 8)
    # Every stamp handed out is below the cursor.
    assert all(g.target_step < s.dispatch_cursor for g in s.groups.values() if g.target_step)


@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_lookahead_blocks_admission_until_a_step_trains(lookahead: int) -> None:
    run = PureRun(lookahead=lookahead, spare_pool_size=0)
    for _ in range(lookahead + 1):
        admit(run)
    assert run.state.dispatch_cursor == lookahead + 1
    before = run.state.to_snapshot()
    with pytest.raises(LookaheadExceededError, match=f"lookahead {lookahead}"):
        run.execute(AdmitStep())
    assert run.state.to_snapshot() == before
    # Training step 0 frees one more step of lookahead.
    finish_step(run, 0)
    train(run)
    admitted = admit(run)
    assert only(admitted, "StepAdmitted")[0].target_step == lookahead + 1
    with pytest.raises(LookaheadExceededError):
        run.execute(AdmitStep())


def test_dataset_exhaustion_and_a_partial_last_step() -> None:
    run = PureRun(groups_per_step=2, lookahead=5, spare_pool_size=0, dataset_size=5)
    admit(run)
    admit(run)
    last = admit(run)
    (step,) = only(last, "StepAdmitted")
    assert (step.target_step, step.group_count) == (2, 1)
    assert [e.prompt_index for e in only(last, "GroupAdmitted")] == [4]
    assert run.state.quotas[2] == 1
    with pytest.raises(DatasetExhaustedError, match="exhausted"):
        run.execute(AdmitStep())
    # The partial step trains its one group with a recorded shortfall.
    for t in range(3):
        finish_step(run, t)
        applied = train(run)
    (batch,) = only(applied, "BatchSelected")
    assert (batch.train_step, batch.group_ids, batch.shortfall) == (2, [4], 1)
    assert run.state.counters.shortfall == 1
    assert run.state.counters.groups_trained == 5


def test_exhaustion_is_reported_before_lookahead() -> None:
    run = PureRun(groups_per_step=2, lookahead=0, spare_pool_size=0, dataset_size=2)
    admit(run)
    with pytest.raises(DatasetExhaustedError):
        run.execute(AdmitStep())


def test_spare_pool_is_limited_by_the_dataset() -> None:
    run = PureRun(groups_per_step=3, spare_pool_size=2, dataset_size=4)
    applied = admit(run)
    assert kinds(applied) == ["StepAdmitted"] + ["GroupAdmitted"] * 3 + ["SparePulled"]
    assert run.state.spares == [3]


def test_spares_are_refilled_after_a_replacement() -> None:
    run = PureRun(groups_per_step=2, spare_pool_size=2, dataset_size=40)
    admit(run)
    assert run.state.spares == [2, 3]
    run.execute(DispatchSiblings(0, (0, 1), 0))
    applied = run.execute(FailSibling(0, 0, 1, False, "x"))
    assert kinds(applied) == ["SiblingFailed", "PromptDropped", "SpareAssigned", "SparePulled"]
    assert only(applied, "SpareAssigned")[0].group_id == 2
    assert only(applied, "SparePulled")[0].prompt_index == 4
    assert run.state.spares == [3, 4]
    # Admission after the refill continues from the dataset cursor.
    admitted = admit(run)
    assert [e.prompt_index for e in only(admitted, "GroupAdmitted")] == [5, 6]


def test_start_rules() -> None:
    state = initial_state()
    with pytest.raises(IllegalTransitionError, match="has not started"):
        decide(state, AdmitStep())
    with pytest.raises(IllegalTransitionError, match="dataset_size"):
        decide(state, StartRun("r", rules(), "fp", "ds", 0))
    run = PureRun()
    with pytest.raises(IllegalTransitionError, match="already started"):
        run.execute(StartRun("r", rules(), "fp", "ds", 10))
    with pytest.raises(TypeError, match="unknown command"):
        decide(run.state, object())  # type: ignore[arg-type]


def test_select_before_admission_waits_under_in_order() -> None:
    run = PureRun(sampler="in_order")
    with pytest.raises(BatchNotReadyError, match="has not been admitted"):
        run.execute(SelectBatch(0))
