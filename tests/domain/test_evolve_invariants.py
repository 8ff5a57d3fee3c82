"""Evolve-level rejections (events that cannot apply), and ``check_invariants`` catching
hand-corrupted states: one test per invariant 1-7 of docs/concepts.md."""

from __future__ import annotations

import pytest
from domain_helpers import PureRun, admit_all, dispatch, fail, finish_group, finish_step, train

from rolloutlog.controller.domain import (
    Completion,
    MarkCheckpoint,
    Phase,
    Restore,
    Resume,
    SelectBatch,
    SiblingStatus,
    check_invariants,
    evolve,
    find_violations,
)
from rolloutlog.controller.domain.errors import (
    ConservationError,
    CursorBehindError,
    IllegalTransitionError,
    InvariantViolation,
    LoanError,
    MonotonicityError,
    RestoreError,
    SelectionError,
    SiblingAccountingError,
    StalenessError,
    UnknownReferenceError,
)
from rolloutlog.controller.domain.events import (
    GroupAdmitted,
    GroupBorrowed,
    GroupCommitted,
    GroupEvicted,
    GroupSelected,
    PromptDropped,
    SiblingAborted,
    SiblingCompleted,
    SiblingDispatched,
    SiblingFailed,
    SpareAssigned,
    SparePulled,
    StepAdmitted,
    StepTrained,
    WeightsPublished,
)
from rolloutlog.controller.domain.state import RunState

# ---------------------------------------------------------------- evolve rejections


def _apply(run: PureRun, event: object) -> None:
    evolve(run.state, event, run.state.last_seq + 1)  # type: ignore[arg-type]


def _admitted() -> PureRun:
    run = PureRun(groups_per_step=2, lookahead=1, spare_pool_size=1)
    admit_all(run)  # step 0: 0, 1; spare 2; step 1: 3, 4
    return run


@pytest.mark.parametrize(
    "event",
    [
        SiblingDispatched(group_id=77, sibling=0, attempt=1, weight_version=0),
        SiblingCompleted(
            group_id=77,
            sibling=0,
            attempt=1,
            weight_version=0,
            prompt_tokens=1,
            completion_tokens=1,
            reward=0.0,
            payload_id="p",
            finish_reason="stop",
        ),
        SiblingFailed(group_id=77, sibling=0, attempt=1, retryable=True, reason="x"),
        SiblingAborted(group_id=77, sibling=0, attempt=1, reason="x"),
        SiblingDispatched(group_id=0, sibling=5, attempt=1, weight_version=0),
        GroupCommitted(group_id=77, prompt_index=77, target_step=0, oldest_weight_version=0),
        PromptDropped(
            group_id=77, prompt_index=77, target_step=0, reason="x", outcome="unreplaced"
        ),
        GroupEvicted(
            group_id=77,
            prompt_index=77,
            target_step=0,
            reason="x",
            staleness=3,
            recovered=False,
            outcome="unreplaced",
        ),
        GroupBorrowed(group_id=77, prompt_index=77, from_step=1, to_step=0),
        SpareAssigned(group_id=77, prompt_index=77, target_step=0, replaces_group_id=0),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_event_naming_an_unknown_group_is_rejected(event: object) -> None:
    run = _admitted()
    with pytest.raises(UnknownReferenceError) as exc:
        _apply(run, event)
    assert exc.value.number == 8
    assert exc.value.groups and exc.value.groups[0] in (77, 0)


def test_prompts_and_groups_must_be_pulled_in_order() -> None:
    run = _admitted()  # dataset cursor 5
    with pytest.raises(UnknownReferenceError, match="prompt 7 pulled out of order"):
        _apply(run, SparePulled(group_id=5, prompt_index=7))
    with pytest.raises(UnknownReferenceError, match="prompt 3 pulled out of order"):
        _apply(run, SparePulled(group_id=5, prompt_index=3))  # pulled twice
    with pytest.raises(UnknownReferenceError, match="group 9 out of order"):
        _apply(run, SparePulled(group_id=9, prompt_index=5))
    with pytest.raises(UnknownReferenceError, match="not handed out"):
        _apply(run, GroupAdmitted(group_id=5, prompt_index=5, target_step=2))
    with pytest.raises(UnknownReferenceError, match="dispatch cursor is at 2"):
        _apply(run, StepAdmitted(target_step=3, group_count=2))
    small = PureRun(dataset_size=1, spare_pool_size=0, groups_per_step=1)
    admit_all(small)
    with pytest.raises(UnknownReferenceError, match="beyond the dataset"):
        _apply(small, SparePulled(group_id=1, prompt_index=1))
    assert run.state.dataset_cursor == 5


def test_spare_assignment_must_name_a_spare_and_a_real_loan() -> None:
    run = _admitted()
    with pytest.raises(UnknownReferenceError, match="not in the spare pool"):
        _apply(run, SpareAssigned(group_id=0, prompt_index=0, target_step=0))
    with pytest.raises(UnknownReferenceError, match="which was not borrowed"):
        _apply(run, SpareAssigned(group_id=2, prompt_index=2, target_step=1, repays_group_id=3))
    run = _admitted()
    with pytest.raises(UnknownReferenceError, match="beyond the dispatch cursor"):
        _apply(run, SpareAssigned(group_id=2, prompt_index=2, target_step=2))


def test_evolve_rejects_impossible_transitions() -> None:
    run = _admitted()
    with pytest.raises(MonotonicityError, match="applied after offset"):
        evolve(run.state, WeightsPublished(weight_version=0), run.state.last_seq)
    with pytest.raises(IllegalTransitionError, match="committed with 0 of 2"):
        _apply(
            run, GroupCommitted(group_id=0, prompt_index=0, target_step=0, oldest_weight_version=0)
        )
    with pytest.raises(SiblingAccountingError, match="accepted while attempt 0 is pending"):
        _apply(
            run,
            SiblingCompleted(
                group_id=0,
                sibling=0,
                attempt=1,
                weight_version=0,
                prompt_tokens=1,
                completion_tokens=1,
                reward=0.0,
                payload_id="p",
                finish_reason="stop",
            ),
        )
    with pytest.raises(SelectionError, match="selected twice, or never committed"):
        _apply(
            run, GroupSelected(group_id=0, prompt_index=0, target_step=0, train_step=0, staleness=0)
        )
    with pytest.raises(MonotonicityError, match="next train step is 0"):
        _apply(run, StepTrained(train_step=1, weight_version=1))
    with pytest.raises(MonotonicityError, match="weight version 3 after 0"):
        _apply(run, StepTrained(train_step=0, weight_version=3))
    with pytest.raises(IllegalTransitionError, match="borrowed from step 1 but it is admitted"):
        _apply(run, GroupBorrowed(group_id=3, prompt_index=3, from_step=1, to_step=0))
    finish_group(run, 3)
    with pytest.raises(IllegalTransitionError, match="earlier step"):
        _apply(run, GroupBorrowed(group_id=3, prompt_index=3, from_step=1, to_step=1))
    with pytest.raises(IllegalTransitionError, match="dropped from phase ready"):
        _apply(
            run,
            PromptDropped(
                group_id=3, prompt_index=3, target_step=1, reason="x", outcome="unreplaced"
            ),
        )
    dispatch(run, 0, (0,))
    with pytest.raises(IllegalTransitionError, match="dispatch of attempt 1 while attempt 1"):
        _apply(run, SiblingDispatched(group_id=0, sibling=0, attempt=1, weight_version=0))
    finish_step(run, 0)
    train(run)
    with pytest.raises(MonotonicityError, match="published weight version 0 after 1"):
        _apply(run, WeightsPublished(weight_version=0))


def test_restore_and_resume_must_open_a_newer_epoch() -> None:
    run = _admitted()
    ckpt = run.execute(MarkCheckpoint(0))[0][0]
    with pytest.raises(RestoreError, match="newer epoch than 1"):
        run.execute(Restore(from_offset=ckpt, epoch=1, mode="salvage", forced=False))
    with pytest.raises(RestoreError, match="newer epoch than 1"):
        run.execute(Resume(epoch=1))
    with pytest.raises(RestoreError, match="not a checkpoint marker"):
        run.execute(Restore(from_offset=ckpt - 1, epoch=2, mode="salvage", forced=False))
    forced = run.execute(Restore(from_offset=ckpt - 1, epoch=2, mode="strict", forced=True))
    assert forced[0][1].forced is True  # type: ignore[attr-defined]
    assert run.state.epoch == 2
    from rolloutlog.controller.domain.events import RunResumed

    with pytest.raises(MonotonicityError, match="epoch 2 opened after epoch 2"):
        _apply(run, RunResumed(epoch=2, siblings_rerun=0))


def test_restore_salvages_only_valid_completions() -> None:
    """Pure decide_restore: salvage filters by group phase, sibling state and version."""
    run = PureRun(group_size=2, groups_per_step=2, lookahead=1, spare_pool_size=1)
    admit_all(run)  # step 0: 0, 1; spare 2; step 1: 3, 4
    dispatch(run, 0, version=0)
    dispatch(run, 1, version=0)
    finish_group(run, 4)
    ckpt = run.execute(MarkCheckpoint(0))[0][0]

    def c(offset: int, gid: int, sib: int, version: int = 0) -> tuple[int, Completion]:
        # Salvage pairs a completion with the offset of the event that recorded it.
        return offset, Completion(gid, sib, 1, version, 3, 4, 1.0, f"s{offset}", "stop", "e-0")

    salvage = (
        c(101, 0, 0),  # valid
        c(102, 0, 0),  # the same sibling again: the first wins
        c(103, 0, 1),  # valid: completes group 0
        c(104, 1, 0, version=1),  # newer weights than the checkpoint's: not reused
        c(105, 4, 0),  # group 4 is ready already
        c(106, 2, 0),  # a spare at the checkpoint
        c(107, 99, 0),  # unknown group
    )
    applied = run.execute(
        Restore(from_offset=ckpt, epoch=2, mode="salvage", forced=False, salvage=salvage)
    )
    assert [e.event_type for _, e in applied] == [
        "RunRestored",
        "SiblingCompleted",
        "SiblingCompleted",
        "GroupCommitted",
    ]
    head = applied[0][1]
    assert head.siblings_salvaged == 2  # type: ignore[attr-defined]
    assert head.unfinished_groups_found == 3  # type: ignore[attr-defined]
    assert head.siblings_rerun == 4  # type: ignore[attr-defined]
    assert head.complete_groups_restored == 1  # type: ignore[attr-defined]
    assert [e.salvaged_from for _, e in applied[1:3]] == [101, 103]  # type: ignore[attr-defined]
    # The salvaged events are the salvaged completions, the engine that generated them
    # included (issue 31: only an in-process backend leaves it null).
    assert [e.completion() for _, e in applied[1:3]] == [  # type: ignore[attr-defined]
        salvage[i][1] for i in (0, 2)
    ]
    assert [e.engine_id for _, e in applied[1:3]] == ["e-0", "e-0"]  # type: ignore[attr-defined]
    g0 = run.state.groups[0]
    assert g0.phase is Phase.READY and g0.recovered
    assert all(s.salvaged for s in g0.siblings)
    assert run.state.groups[1].siblings[0].status is SiblingStatus.PENDING
    assert run.state.counters.siblings_salvaged == 2
    check_invariants(run.state)


# ---------------------------------------------------------------- invariants 1-7


def _healthy() -> RunState:
    """A state with every structure populated: a borrow, a selected batch, spares."""
    run = PureRun(group_size=2, groups_per_step=2, lookahead=2, spare_pool_size=1)
    admit_all(run)  # step 0: 0, 1; spare 2; step 1: 3, 4; step 2: 5, 6
    finish_group(run, 5)
    dispatch(run, 0, (0,))
    fail(run, 0, 0, retryable=False)  # borrows 5 for step 0; spare 2 repays step 2
    finish_step(run, 0)
    run.execute(SelectBatch(0))
    run.execute(MarkCheckpoint(0))
    state = run.state
    check_invariants(state)
    assert find_violations(state) == []
    assert state.loans and state.batches and state.spares
    return state


def _first(state: RunState, kind: type[InvariantViolation]) -> InvariantViolation:
    found = [v for v in find_violations(state) if isinstance(v, kind)]
    assert found, f"no {kind.__name__} in {find_violations(state)}"
    with pytest.raises(InvariantViolation):
        check_invariants(state)
    return found[0]


def test_invariant_1_cursor_behind_a_stamp() -> None:
    state = _healthy()
    state.groups[3].target_step = state.dispatch_cursor  # stamped beyond the cursor
    v = _first(state, CursorBehindError)
    assert v.number == 1 and v.groups == (3,)
    assert str(v) == (
        f"dispatch cursor {state.dispatch_cursor} is behind group 3 (prompt 3) stamped for "
        f"step {state.dispatch_cursor}"
    )
    with pytest.raises(CursorBehindError, match="group 3"):
        check_invariants(state)
    state = _healthy()
    state.dispatch_cursor += 2
    v = _first(state, CursorBehindError)
    assert "ran past train step 0 + lookahead 2" in str(v)


def test_invariant_2_conservation() -> None:
    state = _healthy()
    state.groups[4].prompt_index = 3  # prompt 3 in two groups
    v = _first(state, ConservationError)
    assert v.number == 2
    assert "prompt 3 is in groups 3 and 4" in str(v) and v.groups == (3, 4)

    state = _healthy()
    del state.groups[6]  # a prompt lost
    v = _first(state, ConservationError)
    assert "prompts pulled but" in str(v) and "accounted for" in str(v)

    state = _healthy()
    state.groups[3].phase = Phase.SPARE  # in a phase that disagrees with the pool
    v = _first(state, ConservationError)
    assert "group 3 is spare but not in the spare pool" in str(v)

    state = _healthy()
    state.groups[3].phase = Phase.TRAINED
    v = _first(state, ConservationError)
    assert "group 3 is live in terminal phase trained" in str(v)


def test_invariant_3_selection() -> None:
    state = _healthy()
    step = next(iter(state.batches))
    state.batch_shortfall[step] = 1
    v = _first(state, SelectionError)
    assert v.number == 3
    assert f"batch of step {step} has 2 groups and a recorded shortfall of 1, not 2" in str(v)

    state = _healthy()
    gid = state.batches[0][0]
    state.batches[0].append(gid)
    state.batch_shortfall[0] = -1
    v = _first(state, SelectionError)
    assert f"group {gid} is in the batches of steps 0 and 0" in str(v)

    state = _healthy()
    state.batches[1] = state.batches.pop(0)
    state.batch_shortfall[1] = state.batch_shortfall.pop(0)
    v = _first(state, SelectionError)
    assert "batch of step 1 is pending while step 0 is next" in str(v)


def test_invariant_4_sibling_accounting() -> None:
    state = _healthy()
    ready = next(g for g in state.groups.values() if g.phase is Phase.SELECTED)
    ready.set_sibling(1, ready.sibling(1)._replace(status=SiblingStatus.PENDING))
    v = _first(state, SiblingAccountingError)
    assert v.number == 4 and v.groups == (ready.group_id,)
    assert f"group {ready.group_id} is selected with 1 of 2 siblings done" in str(v)

    state = _healthy()
    state.groups[6].sibling_rows += state.groups[6].sibling_rows[:1]
    v = _first(state, SiblingAccountingError)
    assert "group 6 has 3 siblings, not 2" in str(v)

    state = _healthy()
    g3 = state.groups[3]
    g3.set_sibling(0, g3.sibling(0)._replace(status=SiblingStatus.IN_FLIGHT))  # attempt 0
    v = _first(state, SiblingAccountingError)
    assert "group 3 sibling 0 is in_flight without an attempt" in str(v)


def test_invariant_5_loans() -> None:
    state = _healthy()
    (loan,) = state.loans.values()
    loan.repaid_by = None
    v = _first(state, LoanError)
    assert v.number == 5 and v.groups == (loan.group_id,)
    assert (
        f"group {loan.group_id} was borrowed from step {loan.lender_step} for step "
        f"{loan.borrower_step} without a repayment or a recorded debt"
    ) in str(v)


def test_invariant_6_staleness_of_selected_groups() -> None:
    state = _healthy()
    gid = state.batches[0][0]
    state.groups[gid].selected_staleness = state.rules.staleness_bound + 1
    v = _first(state, StalenessError)
    assert v.number == 6 and v.groups == (gid,)
    assert f"group {gid} selected for step 0 with staleness 3 > bound 2" in str(v)


def test_invariant_7_monotonicity() -> None:
    state = _healthy()
    state.published_version = state.weight_version + 1
    v = _first(state, MonotonicityError)
    assert v.number == 7
    assert "generation serves weight version 1, ahead of the trainer's 0" in str(v)

    state = _healthy()
    assert state.checkpoint is not None
    state.checkpoint.train_step = 3
    v = _first(state, MonotonicityError)
    assert "checkpoint at train step 3 is ahead of train step 0" in str(v)
