"""A step whose every group is dropped without replacement trains an empty batch with
its whole size recorded as shortfall, so the steps behind it are not stuck."""

from __future__ import annotations

from domain_helpers import PureRun, admit_all, dispatch, fail, finish_step, kinds, only, train

from rolloutlog.controller.domain import check_invariants


def test_a_step_left_without_groups_trains_empty_with_recorded_shortfall() -> None:
    run = PureRun(groups_per_step=1, lookahead=1, spare_pool_size=0, dataset_size=2)
    admit_all(run)  # step 0: group 0, step 1: group 1; nothing left to replace with
    dispatch(run, 0, version=0)
    dropped = fail(run, 0, 0, retryable=False)
    assert only(dropped, "PromptDropped")[0].outcome == "unreplaced"
    assert run.state.quotas[0] == 0
    applied = train(run)
    batch = only(applied, "BatchSelected")[0]
    assert (batch.group_ids, batch.shortfall) == ([], 1)
    assert "StepTrained" in kinds(applied)
    # Step 1 is not stuck behind the empty step.
    finish_step(run, 1, version=1)
    second = only(train(run), "BatchSelected")[0]
    assert (second.group_ids, second.shortfall) == ([1], 0)
    check_invariants(run.state)
    assert run.state.counters.shortfall == 1
