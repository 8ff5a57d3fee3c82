"""The four samplers (choice, order, staleness window), staleness eviction at selection and
at weight sync, abort of stale in-flight work, train steps, weight versions, checkpoints."""

from __future__ import annotations

import pytest
from domain_helpers import (
    PureRun,
    admit,
    admit_all,
    complete,
    dispatch,
    finish_group,
    finish_step,
    kinds,
    only,
    train,
)

from rolloutlog.controller.domain import (
    EvictDoomed,
    MarkCheckpoint,
    Phase,
    PublishWeights,
    RecordTrainStep,
    SelectBatch,
    check_invariants,
)
from rolloutlog.controller.domain.errors import (
    BatchNotReadyError,
    IllegalTransitionError,
    StepOutOfOrderError,
)
from rolloutlog.controller.domain.state import CheckpointRef

# ---------------------------------------------------------------- in_order


def test_in_order_selects_exactly_the_step_and_waits_for_all_its_groups() -> None:
    run = PureRun(groups_per_step=2, lookahead=1, spare_pool_size=0, sampler="in_order")
    admit_all(run)  # step 0: 0, 1; step 1: 2, 3
    finish_group(run, 2)
    finish_group(run, 3)
    finish_group(run, 0)
    dispatch(run, 1, (0,))
    with pytest.raises(BatchNotReadyError, match="1 groups of step 0 are still generating"):
        run.execute(SelectBatch(0))
    dispatch(run, 1)
    complete(run, 1, 0)
    complete(run, 1, 1)
    applied = run.execute(SelectBatch(0))
    assert kinds(applied) == ["GroupSelected", "GroupSelected", "BatchSelected"]
    assert [(e.group_id, e.target_step, e.train_step) for e in only(applied, "GroupSelected")] == [
        (0, 0, 0),
        (1, 0, 0),
    ]
    batch = only(applied, "BatchSelected")[0]
    assert (batch.group_ids, batch.shortfall) == ([0, 1], 0)
    assert run.state.groups[2].phase is Phase.READY  # the later step is not taken early
    assert {run.state.groups[g].phase for g in (0, 1)} == {Phase.SELECTED}


# ---------------------------------------------------------------- pooled samplers


def _five_ready(sampler: str, **kw: object) -> PureRun:
    """Steps 0..2 admitted (groups 0..5); every group but 0 ready, in reverse id order."""
    run = PureRun(groups_per_step=2, lookahead=2, spare_pool_size=0, sampler=sampler, **kw)
    admit_all(run)
    for gid in (5, 4, 3, 2, 1):
        finish_group(run, gid)
    return run


def test_windowed_orders_by_target_step() -> None:
    run = _five_ready("windowed")
    batch = only(run.execute(SelectBatch(0)), "BatchSelected")[0]
    assert batch.group_ids == [1, 2]


def test_ready_first_orders_by_commit_order() -> None:
    run = _five_ready("ready_first")
    batch = only(run.execute(SelectBatch(0)), "BatchSelected")[0]
    assert batch.group_ids == [5, 4]


def test_weight_fifo_takes_the_oldest_weights_first() -> None:
    run = PureRun(groups_per_step=2, lookahead=3, spare_pool_size=0, sampler="weight_fifo")
    run_w = PureRun(groups_per_step=2, lookahead=3, spare_pool_size=0, sampler="windowed")
    picks = {}
    for name, r in (("weight_fifo", run), ("windowed", run_w)):
        admit_all(r)  # steps 0..3: groups 0..7
        finish_group(r, 6, version=0)  # step 3, weights 0
        finish_step(r, 0, version=0)
        first = only(train(r), "BatchSelected")[0]
        assert first.group_ids == [0, 1]
        finish_step(r, 1, version=1)  # weights 1
        picks[name] = only(r.execute(SelectBatch(1)), "GroupSelected")
    assert [e.group_id for e in picks["weight_fifo"]] == [6, 2]
    assert [e.staleness for e in picks["weight_fifo"]] == [1, 0]
    assert [e.group_id for e in picks["windowed"]] == [2, 3]


def test_pooled_sampler_waits_while_more_groups_can_come_then_takes_a_short_batch() -> None:
    run = PureRun(groups_per_step=2, lookahead=1, spare_pool_size=0, sampler="windowed")
    run_end = PureRun(
        groups_per_step=2, lookahead=1, spare_pool_size=0, sampler="windowed", dataset_size=3
    )
    for r in (run, run_end):
        admit_all(r)
        finish_step(r, 0)
        train(r)
        finish_group(r, 2)
    # Admission is still possible (or groups generating): wait.
    with pytest.raises(BatchNotReadyError, match="1 of 2 groups ready"):
        run.execute(SelectBatch(1))
    # Dataset exhausted and nothing generating: a short batch with a recorded shortfall.
    batch = only(run_end.execute(SelectBatch(1)), "BatchSelected")[0]
    assert (batch.group_ids, batch.shortfall) == ([2], 1)
    finish_step(run_end, 1)
    run_end.execute(RecordTrainStep(1, 2))
    with pytest.raises(BatchNotReadyError, match="no groups are left"):
        run_end.execute(SelectBatch(2))


# ---------------------------------------------------------------- staleness


@pytest.mark.parametrize("sampler", ["in_order", "windowed", "weight_fifo"])
def test_gated_samplers_evict_stale_groups_at_selection(sampler: str) -> None:
    run = PureRun(
        groups_per_step=1, lookahead=3, spare_pool_size=1, staleness_bound=1, sampler=sampler
    )
    admit_all(run)  # step 0: 0; spare 1; steps 1..3: 2, 3, 4
    dispatch(run, 4, version=0)  # step 3, generating with weights 0
    for _ in range(2):
        finish_step(run, run.state.train_step, version=run.state.weight_version)
        train(run, publish=False)  # no weight sync: only the selection can evict
    complete(run, 4, 0, version=0)
    complete(run, 4, 1, version=0)  # ready, two versions behind
    assert run.state.staleness(run.state.groups[4]) == 2
    applied = run.execute(SelectBatch(2))
    assert "BatchSelected" not in kinds(applied)  # evictions first, then ask again
    (ev,) = only(applied, "GroupEvicted")
    assert (ev.group_id, ev.target_step, ev.staleness, ev.recovered) == (4, 3, 2, False)
    assert ev.reason == "stale: staleness 2 > bound 1"
    assert 4 not in run.state.groups
    assert run.state.counters.groups_evicted == 1
    check_invariants(run.state)
    finish_step(run, 2, version=2)
    assert "BatchSelected" in kinds(run.execute(SelectBatch(2)))


def test_ready_first_never_evicts_and_may_select_stale_groups() -> None:
    run = PureRun(
        groups_per_step=1, lookahead=3, spare_pool_size=0, staleness_bound=0, sampler="ready_first"
    )
    admit_all(run)  # groups 0..3 at steps 0..3
    finish_group(run, 0, version=0)
    dispatch(run, 1, version=0)  # in flight with old weights across the next sync
    train(run)
    finish_group(run, 3, version=1)
    complete(run, 1, 0, version=0)
    complete(run, 1, 1, version=0)
    picked = only(train(run, publish=False), "BatchSelected")[0]
    assert picked.group_ids == [3]  # committed before group 1
    applied = run.execute(PublishWeights(2))
    assert kinds(applied) == ["WeightsPublished"]
    selected = only(run.execute(SelectBatch(2)), "GroupSelected")
    assert [(e.group_id, e.staleness) for e in selected] == [(1, 2)]
    check_invariants(run.state)  # the bound does not apply to ready_first


def test_weight_sync_evicts_stale_groups_and_aborts_stale_in_flight_siblings() -> None:
    run = PureRun(
        group_size=2,
        groups_per_step=1,
        lookahead=3,
        spare_pool_size=1,
        staleness_bound=1,
        sampler="windowed",
    )
    admit_all(run)  # step 0: 0; spare 1; steps 1..3: 2, 3, 4
    dispatch(run, 3, version=0)
    complete(run, 3, 0, version=0)  # partly generated with weights 0
    dispatch(run, 4, version=0)  # in flight with weights 0, nothing finished
    for _ in range(2):
        finish_step(run, run.state.train_step, version=run.state.weight_version)
        train(run, publish=False)
    # trainer at 2; generation still serves 0
    applied = run.execute(PublishWeights(2))
    assert kinds(applied) == [
        "WeightsPublished",
        "GroupEvicted",
        "SpareAssigned",
        "SparePulled",
        "SiblingAborted",
        "SiblingAborted",
    ]
    evicted = only(applied, "GroupEvicted")[0]
    assert (evicted.group_id, evicted.staleness, evicted.outcome) == (3, 2, "replaced")
    assert "stale at weight sync" in evicted.reason
    aborted = only(applied, "SiblingAborted")
    assert [(e.group_id, e.sibling, e.attempt) for e in aborted] == [(4, 0, 1), (4, 1, 1)]
    assert aborted[0].reason == "stale weights: dispatched with version 0, trainer at 2"
    assert run.state.published_version == 2
    assert run.state.groups[4].phase is Phase.ADMITTED  # re-dispatchable, not evicted
    check_invariants(run.state)


@pytest.mark.parametrize(("sampler", "flag"), [("windowed", False), ("ready_first", True)])
def test_no_abort_at_weight_sync_when_disabled_or_ungated(sampler: str, flag: bool) -> None:
    run = PureRun(
        groups_per_step=1,
        lookahead=3,
        staleness_bound=0,
        sampler=sampler,
        abort_stale_at_weight_sync=flag,
    )
    admit_all(run)
    dispatch(run, 4, version=0)
    finish_step(run, 0, version=0)
    train(run, publish=False)
    assert kinds(run.execute(PublishWeights(1))) == ["WeightsPublished"]


# ---------------------------------------------------------------- training and versions


def test_train_step_order_and_weight_version_rules() -> None:
    run = PureRun(groups_per_step=1, lookahead=1, spare_pool_size=0)
    admit_all(run)
    finish_step(run, 0)
    with pytest.raises(StepOutOfOrderError, match="batch selection for step 1"):
        run.execute(SelectBatch(1))
    with pytest.raises(IllegalTransitionError, match="its batch has not been selected"):
        run.execute(RecordTrainStep(0, 1))
    run.execute(SelectBatch(0))
    with pytest.raises(IllegalTransitionError, match="already selected"):
        run.execute(SelectBatch(0))
    with pytest.raises(StepOutOfOrderError, match="train step for step 1"):
        run.execute(RecordTrainStep(1, 1))
    with pytest.raises(IllegalTransitionError, match="must produce weight version 1, not 2"):
        run.execute(RecordTrainStep(0, 2))
    with pytest.raises(IllegalTransitionError, match="must produce weight version 1, not 0"):
        run.execute(RecordTrainStep(0, 0))
    applied = run.execute(RecordTrainStep(0, 1))
    (ev,) = only(applied, "StepTrained")
    assert (ev.train_step, ev.weight_version) == (0, 1)
    s = run.state
    assert (s.train_step, s.weight_version, s.published_version) == (1, 1, 0)
    assert 0 not in s.groups and 0 not in s.quotas and s.batches == {}
    assert s.counters.groups_trained == 1
    with pytest.raises(StepOutOfOrderError, match="train step for step 0"):
        run.execute(RecordTrainStep(0, 1))


def test_publish_rules() -> None:
    run = PureRun(groups_per_step=1)
    admit(run)
    with pytest.raises(IllegalTransitionError, match="trainer is at 0"):
        run.execute(PublishWeights(1))  # a version ahead of the trainer
    finish_step(run, 0)
    train(run, publish=False)
    train_ok = run.execute(PublishWeights(1))
    assert kinds(train_ok) == ["WeightsPublished"]
    with pytest.raises(IllegalTransitionError, match="generation serves 1"):
        run.execute(PublishWeights(0))  # backwards
    assert kinds(run.execute(PublishWeights(1))) == ["WeightsPublished"]  # re-publish


def test_checkpoint_marker_records_the_cursors() -> None:
    run = PureRun(groups_per_step=2, lookahead=1, spare_pool_size=1)
    admit_all(run)
    finish_step(run, 0)
    train(run)
    with pytest.raises(StepOutOfOrderError, match="checkpoint for 0 trained steps"):
        run.execute(MarkCheckpoint(0))
    applied = run.execute(MarkCheckpoint(1))
    ((offset, ev),) = applied
    assert (ev.train_step, ev.weight_version, ev.dispatch_cursor, ev.dataset_cursor) == (
        1,
        1,
        2,
        5,
    )
    assert run.state.checkpoint == CheckpointRef(offset=offset, train_step=1, weight_version=1)


def test_in_order_group_doomed_at_its_step_is_evicted_one_version_ahead() -> None:
    """lookahead 2 > bound 1: step 2's group, generated with weights 0, will be two
    versions behind when step 2 trains. EvictDoomed leaves it while a replacement would
    be stale too, evicts it once one generated now is in bound (after the publish of 1,
    a version before it is stale itself), and the slot is refilled at once."""
    run = PureRun(
        groups_per_step=1, lookahead=2, spare_pool_size=1, staleness_bound=1, sampler="in_order"
    )
    admit_all(run)  # step 0: 0; spare 1; steps 1, 2: 2, 3
    for step in range(3):
        finish_step(run, step, version=0)
    assert run.execute(EvictDoomed()) == []  # a replacement now would be as stale
    train(run)  # step 0 trained, weights 1 published
    assert run.state.staleness(run.state.groups[3]) == 1  # not stale yet: the publish kept it
    applied = run.execute(EvictDoomed())
    (ev,) = only(applied, "GroupEvicted")
    assert (ev.group_id, ev.target_step, ev.staleness, ev.outcome) == (3, 2, 2, "replaced")
    assert ev.reason == "stale at its train step: staleness 2 > bound 1"
    assert [e.group_id for e in only(applied, "SpareAssigned")] == [1]
    assert run.state.counters.groups_evicted == 1
    check_invariants(run.state)
    assert run.execute(EvictDoomed()) == []  # step 1's group (weights 0) trains in bound
    finish_step(run, 2, version=1)  # the spare, generated with weights 1
    train(run)  # step 1: its group, weights 0, one version behind
    selected = only(train(run), "GroupSelected")  # step 2: the spare
    assert [(e.group_id, e.staleness) for e in selected] == [(1, 1)]


@pytest.mark.parametrize("sampler", ["windowed", "weight_fifo", "ready_first"])
def test_evict_doomed_is_in_order_only(sampler: str) -> None:
    run = PureRun(
        groups_per_step=1, lookahead=2, spare_pool_size=1, staleness_bound=1, sampler=sampler
    )
    admit_all(run)
    for step in range(3):
        finish_step(run, step, version=0)
    train(run)
    assert run.execute(EvictDoomed()) == []
