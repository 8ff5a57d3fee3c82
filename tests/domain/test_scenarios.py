"""Field scenarios of the rollout state machine, through a RolloutController on a real log.

(a) a borrow repaid by a spare that is still in flight at the checkpoint survives restore;
(b) a checkpoint whose cursor is behind the restored buffer is refused, not "repaired";
(c) a partly generated group seven versions behind at the checkpoint: ready_first keeps and
    finishes it, the gated samplers evict it as *recovered*;
plus salvage, strict mode, group granularity, restore refusals and epoch fencing.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from domain_helpers import (
    PromptLedger,
    admit_all,
    assert_replay_equals_live,
    complete,
    dispatch,
    drive_to_end,
    fail,
    finish_group,
    restore,
    rules,
    start,
    step_groups,
    store_config,
)

from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.domain import (
    AdmitStep,
    Phase,
    PublishWeights,
    RecordTrainStep,
    SelectBatch,
    SiblingStatus,
    check_invariants,
)
from rolloutlog.controller.domain.errors import CursorBehindError, RestoreError, RunFailedError
from rolloutlog.controller.domain.events import CheckpointMarked
from rolloutlog.controller.domain.state import Loan
from rolloutlog.controller.rollout_controller import RolloutController, iter_history
from rolloutlog.controller.rollout_index import encode
from rolloutlog.eventstore import EpochFencedError, EventStore, GroupCommitClosedError


def _after(store: EventStore, offset: int, run_id: str = "run") -> list:
    """(row, event) pairs of the current history after ``offset``."""
    return [(row, ev) for row, ev in iter_history(store, run_id) if row.seq > offset]


def _selected_prompts(store: EventStore, run_id: str = "run") -> list[int]:
    return [
        ev.prompt_index  # type: ignore[attr-defined]
        for _row, ev in iter_history(store, run_id)
        if ev.event_type == "GroupSelected"
    ]


# ---------------------------------------------------------------- (a)


@pytest.mark.parametrize("mode", ["salvage", "strict"])
def test_a_borrow_repaid_by_an_in_flight_spare_survives_restore(
    sqlite_store: EventStore, mode: str
) -> None:
    store = sqlite_store
    cfg = rules(
        group_size=2,
        groups_per_step=3,
        sampler="in_order",
        lookahead=2,
        spare_pool_size=3,
        staleness_bound=3,
        drop_policy="replace",
    )
    ctl = start(store, cfg, dataset_size=24)
    admit_all(ctl)
    # step 0: groups 0, 1, 2; spares 3, 4, 5; step 1: 6, 7, 8; step 2: 9, 10, 11
    assert [step_groups(ctl, t) for t in range(3)] == [[0, 1, 2], [6, 7, 8], [9, 10, 11]]
    assert ctl.state.spares == [3, 4, 5]
    for gid in (0, 1, 2, 6, 7, 8, 9, 10, 11):
        dispatch(ctl, gid)
    for gid in (9, 6, 0):  # a step-2 group, a step-1 group and a step-0 group are ready
        complete(ctl, gid, 0)
        complete(ctl, gid, 1)
    assert ctl.state.groups[9].phase is Phase.READY

    # Prompt 1 (step 0) fails for good: step 0 borrows the ready group of the furthest
    # later step (9, step 2), and spare 3 takes step 2's stamp to repay it.
    applied = fail(ctl, 1, 0, retryable=False, reason="prompt too long")
    kinds = [e.event_type for _, e in applied]
    assert kinds == [
        "SiblingFailed",
        "PromptDropped",
        "GroupBorrowed",
        "SpareAssigned",
        "SparePulled",
    ]
    drop_reason = applied[1][1].reason  # type: ignore[attr-defined]
    assert drop_reason == "sibling 0 failed without retry: prompt too long"
    assert ctl.state.loans == {9: Loan(9, lender_step=2, borrower_step=0, repaid_by=3)}
    assert step_groups(ctl, 0) == [0, 2, 9]
    assert step_groups(ctl, 2) == [3, 10, 11]

    # The repaying spare is in flight (one sibling done) when the checkpoint is taken.
    dispatch(ctl, 3)
    complete(ctl, 3, 0)
    ckpt = ctl.checkpoint(0)
    at_checkpoint = ctl.state.copy()
    assert at_checkpoint.groups[3].siblings[1].status is SiblingStatus.IN_FLIGHT
    pulled = at_checkpoint.dataset_cursor  # 13: prompts 0..12
    # After the checkpoint (abandoned by the restore): the spare finishes with the
    # checkpoint's weights, and prompt 2 is dropped.
    complete(ctl, 3, 1)
    fail(ctl, 2, 0, retryable=False, reason="lost after the checkpoint")
    ctl.close()

    ctl, report = restore(store, cfg, ckpt, mode=mode)
    s = ctl.state
    check_invariants(s)
    # Every prompt comes back: all pulled ones but prompt 1, each exactly once.
    assert sorted(g.prompt_index for g in s.groups.values()) == [p for p in range(pulled) if p != 1]
    assert s.counters.prompts_dropped == 1
    assert all(g.recovered for g in s.groups.values() if g.phase is not Phase.SPARE)
    assert s.groups[2].phase is Phase.ADMITTED  # the abandoned drop is gone
    assert s.loans == {9: Loan(9, lender_step=2, borrower_step=0, repaid_by=3)}
    assert s.groups[3].target_step == 2 and s.groups[9].target_step == 0
    assert report.complete_groups_restored == 3  # 0, 6, 9
    assert report.unfinished_groups_found == 6  # 2, 3, 7, 8, 10, 11
    assert report.siblings_reused == 1  # the repaying spare's sibling 0
    assert report.siblings_rerun + report.siblings_salvaged == 11
    if mode == "salvage":
        assert report.siblings_salvaged == 1
        assert s.groups[3].phase is Phase.READY
        assert s.groups[3].siblings[1].salvaged
    else:
        assert report.siblings_salvaged == 0
        assert s.groups[3].phase is Phase.ADMITTED
        assert s.groups[3].siblings[1].status is SiblingStatus.PENDING
    assert_replay_equals_live(ctl)

    # Drive the run to the end of the dataset.
    trained_steps = drive_to_end(ctl)
    ctl.close()
    ledger = PromptLedger.from_history(store, "run")
    ledger.check_against(ctl.state)
    assert ledger.drop_reasons == {(0, 1): drop_reason}
    selected = _selected_prompts(store)
    assert len(selected) == len(set(selected)), "a prompt trained twice"
    leftover_spares = sorted(s.groups[g].prompt_index for g in s.spares)
    assert sorted(selected) == [
        p for p in range(s.dataset_cursor) if p != 1 and p not in leftover_spares
    ]
    assert all(s.groups[g].phase is Phase.SPARE for g in s.spares)
    assert set(ledger.trained_at) == {(0, p) for p in selected}
    steps = [
        ev.train_step  # type: ignore[attr-defined]
        for _, ev in iter_history(store, "run")
        if ev.event_type == "StepTrained"
    ]
    assert steps == list(range(len(steps))) == trained_steps
    assert ledger.trained_at[0, 9] == 0 and ledger.trained_at[0, 3] == 2  # borrowed / repaid


# ---------------------------------------------------------------- (b)


@pytest.mark.parametrize("field", ["dispatch_cursor", "dataset_cursor"])
def test_b_a_checkpoint_with_a_stale_cursor_is_refused(store: EventStore, field: str) -> None:
    cfg = rules(group_size=2, groups_per_step=2, lookahead=2, spare_pool_size=1)
    ctl = start(store, cfg)
    admit_all(ctl)  # steps 0..2: groups 0, 1; spare 2; 3, 4; 5, 6
    finish_group(ctl, 5)
    ctl.flush()
    state = ctl.state.copy()
    ctl.close()
    # Forge a CheckpointMarked whose cursor is stale, appended where a checkpoint would be.
    info = store.get_run("run")
    cursors = {"dispatch_cursor": state.dispatch_cursor, "dataset_cursor": state.dataset_cursor}
    cursors[field] = 1 if field == "dispatch_cursor" else 3
    forged = CheckpointMarked(train_step=0, weight_version=0, **cursors)
    row = encode(forged, recorded_at=datetime.now(UTC), train_step=0, weight_version=0)
    offset = store.append("run", [row], expected_seq=info.last_seq + 1, epoch=info.current_epoch)
    before = store.get_run("run")
    with pytest.raises(CursorBehindError) as exc:
        restore(store, cfg, offset)
    message = str(exc.value)
    assert f"checkpoint at offset {offset}" in message
    assert f"field {field}={cursors[field]}" in message
    if field == "dispatch_cursor":
        assert "group 5 (prompt 5) stamped for step 2" in message
        assert "refusing to restore rather than drop prompts" in message
        assert exc.value.groups == (5,)
    else:
        assert f"behind the {state.dataset_cursor} prompts" in message
    assert exc.value.offset == offset
    after = store.get_run("run")
    assert (after.last_seq, after.current_epoch) == (before.last_seq, before.current_epoch)


# ---------------------------------------------------------------- (c)


@pytest.mark.parametrize("sampler", ["in_order", "windowed", "weight_fifo", "ready_first"])
def test_c_a_partial_group_seven_versions_behind_at_restore(
    sqlite_store: EventStore, sampler: str
) -> None:
    """One sibling of a step-7 group generates across seven weight syncs (in-flight work
    is not aborted at sync: abort_stale_at_weight_sync=False) and finishes with the
    weights it started with, 0, right before a checkpoint at trainer version 7; its other
    sibling is in flight. The run's config is frozen, so each sampler builds its own
    history the same way."""
    store = sqlite_store
    cfg = rules(
        group_size=2,
        groups_per_step=2,
        sampler=sampler,
        lookahead=8,
        spare_pool_size=1,
        staleness_bound=2,
        recovery_granularity="sibling",
        abort_stale_at_weight_sync=False,
    )
    ctl = start(store, cfg)
    admit_all(ctl)  # steps 0..8; step k > 0 holds groups 2k+1, 2k+2; spare 2
    old = step_groups(ctl, 7)[0]
    dispatch(ctl, old, (0,))  # weights 0: a long generation
    for k in range(7):
        for gid in step_groups(ctl, k):
            finish_group(ctl, gid)  # with the published weights, k
        ctl.execute(SelectBatch(k))
        ctl.execute(RecordTrainStep(k, k + 1))
        ctl.execute(PublishWeights(k + 1))
    assert ctl.state.counters.groups_evicted == 0
    complete(ctl, old, 0)  # finishes with weights 0
    dispatch(ctl, old, (1,))  # weights 7, in flight
    assert (ctl.state.weight_version, ctl.state.published_version) == (7, 7)
    assert ctl.state.staleness(ctl.state.groups[old]) == 7
    ckpt = ctl.checkpoint(7)
    ctl.close()

    ctl, report = restore(store, cfg, ckpt)
    assert report.unfinished_groups_found == 4  # the old group and 3 untouched ones
    assert report.siblings_reused == 1
    tail = _after(store, ckpt)
    evictions = [ev for _, ev in tail if ev.event_type == "GroupEvicted"]
    if sampler == "ready_first":
        assert evictions == []
        assert report.groups_evicted_stale == 0
        g = ctl.state.groups[old]
        assert g.recovered and g.phase is Phase.ADMITTED
        assert [s.status for s in g.siblings] == [SiblingStatus.DONE, SiblingStatus.PENDING]
        rerun = dispatch(ctl, old)
        assert [(e.sibling, e.attempt) for _, e in rerun] == [(1, 2)]  # only the unfinished
        complete(ctl, old, 1)
        finish_group(ctl, step_groups(ctl, 7)[1])
        picked = [e for _, e in ctl.execute(SelectBatch(7)) if e.event_type == "GroupSelected"]
        assert picked[0].group_id == old  # type: ignore[attr-defined]
        assert picked[0].staleness == 7  # type: ignore[attr-defined]
        check_invariants(ctl.state)
    else:
        (ev,) = evictions
        assert (ev.group_id, ev.staleness, ev.recovered) == (old, 7, True)
        assert ev.reason == "recovered group stale after restore: staleness 7 > bound 2"
        assert report.groups_evicted_stale == 1
        c = ctl.state.counters
        assert (c.groups_evicted, c.groups_evicted_recovered) == (1, 1)
        assert old not in ctl.state.groups
        drive_to_end(ctl)
        assert ctl.state.groups.get(old) is None
        assert old not in _selected_prompts(store)  # evicted, never trained
    assert_replay_equals_live(ctl)
    ctl.close()
    ledger = PromptLedger.from_history(store, "run")
    ledger.check_against(ctl.state)
    assert ledger.fate.get((0, old)) == (None if sampler == "ready_first" else "evicted")


# ---------------------------------------------------------------- salvage


def _salvage_history(
    store: EventStore, granularity: str = "sibling"
) -> tuple[int, RolloutConfig, tuple[int, int, int, int]]:
    """Checkpoint with step-1 groups A, B and step-2 groups C, D in flight (weights 1;
    D's sibling 0 done before the checkpoint), then record completions after it."""
    cfg = rules(
        group_size=3,
        groups_per_step=2,
        lookahead=1,
        spare_pool_size=0,
        staleness_bound=3,
        recovery_granularity=granularity,
    )
    ctl = start(store, cfg)
    admit_all(ctl)
    for gid in step_groups(ctl, 0):
        finish_group(ctl, gid)
    ctl.execute(SelectBatch(0))
    ctl.execute(RecordTrainStep(0, 1))
    ctl.execute(PublishWeights(1))
    ctl.execute(AdmitStep())
    a, b = step_groups(ctl, 1)
    c, d = step_groups(ctl, 2)
    for gid in (a, b, c, d):
        dispatch(ctl, gid)  # weights 1
    complete(ctl, d, 0)
    ckpt = ctl.checkpoint(1)
    # After the checkpoint:
    for i in range(3):
        complete(ctl, a, i)  # A: all three with weights 1
    complete(ctl, b, 0)
    fail(ctl, b, 1, retryable=True)
    dispatch(ctl, b, (1,))
    complete(ctl, b, 1)  # attempt 2
    complete(ctl, b, 2)  # B: all three with weights 1
    ctl.execute(SelectBatch(1))
    ctl.execute(RecordTrainStep(1, 2))
    ctl.execute(PublishWeights(2))
    complete(ctl, c, 0, version=2)  # newer than the checkpoint's weights: not reusable
    complete(ctl, c, 1, version=1)  # reusable
    ctl.close()
    return ckpt, cfg, (a, b, c, d)


def test_salvage_reuses_completions_by_weights_the_restored_trainer_has(
    store: EventStore,
) -> None:
    ckpt, cfg, (a, b, c, d) = _salvage_history(store)
    originals = {
        (ev.group_id, ev.sibling): (row.seq, ev)  # type: ignore[attr-defined]
        for row, ev in iter_history(store, "run")
        if ev.event_type == "SiblingCompleted" and row.seq > ckpt
    }
    ctl, report = restore(store, cfg, ckpt, mode="salvage")
    assert report.mode == "salvage"
    assert report.unfinished_groups_found == 4
    assert report.siblings_reused == 1  # D's sibling 0, done before the checkpoint
    assert report.siblings_salvaged == 7  # A: 3, B: 3, C: 1
    assert report.siblings_rerun == 12 - 1 - 7
    salvaged = [
        (row.seq, ev) for row, ev in _after(store, ckpt) if ev.event_type == "SiblingCompleted"
    ]
    assert len(salvaged) == 7
    for _seq, ev in salvaged:
        seq0, orig = originals[(ev.group_id, ev.sibling)]  # type: ignore[attr-defined]
        assert ev.salvaged_from == seq0  # type: ignore[attr-defined]
        assert ev.payload_id == orig.payload_id  # type: ignore[attr-defined]
        assert ev.weight_version == 1  # type: ignore[attr-defined]
    committed = [ev.group_id for _, ev in _after(store, ckpt) if ev.event_type == "GroupCommitted"]
    assert committed == [a, b]
    s = ctl.state
    assert s.counters.siblings_salvaged == 7
    assert s.groups[b].siblings[1].attempt == 2
    assert [x.status for x in s.groups[c].siblings] == [
        SiblingStatus.PENDING,  # the weights-2 completion is not reused
        SiblingStatus.DONE,
        SiblingStatus.PENDING,
    ]
    assert [x.salvaged for x in s.groups[c].siblings] == [False, True, False]
    assert s.groups[d].siblings[0].status is SiblingStatus.DONE
    assert not s.groups[d].siblings[0].salvaged
    assert (s.train_step, s.weight_version) == (1, 1)
    check_invariants(s)
    assert_replay_equals_live(ctl)
    drive_to_end(ctl)
    ctl.close()
    PromptLedger.from_history(store, "run").check_against(ctl.state)


def test_strict_mode_salvages_nothing(store: EventStore) -> None:
    ckpt, cfg, groups = _salvage_history(store)
    ctl, report = restore(store, cfg, ckpt, mode="strict")
    assert (report.mode, report.siblings_salvaged, report.siblings_reused) == ("strict", 0, 1)
    assert report.siblings_rerun == 11
    assert [ev.event_type for _, ev in _after(store, ckpt)] == ["RunRestored"]
    assert ctl.state.counters.siblings_salvaged == 0
    assert all(ctl.state.groups[g].phase is Phase.ADMITTED for g in groups)
    assert_replay_equals_live(ctl)
    ctl.close()


def test_group_granularity_reruns_whole_groups(store: EventStore) -> None:
    ckpt, cfg, (_a, _b, _c, gid_d) = _salvage_history(store, granularity="group")
    ctl, report = restore(store, cfg, ckpt, mode="salvage")
    assert report.granularity == "group"
    assert (report.siblings_reused, report.siblings_salvaged, report.siblings_rerun) == (0, 0, 12)
    d = ctl.state.groups[gid_d]
    assert [x.status for x in d.siblings] == [SiblingStatus.PENDING] * 3  # done one too
    assert d.siblings[0].attempt == 1  # attempts carry over (fencing)
    rerun = dispatch(ctl, gid_d)
    assert [e.attempt for _, e in rerun] == [2, 2, 2]
    assert_replay_equals_live(ctl)
    ctl.close()


def test_salvage_ignores_completions_of_an_abandoned_branch(sqlite_store: EventStore) -> None:
    """Restoring to a checkpoint on a branch that an earlier restore abandoned must not
    reuse completions of the other branch: its weights of the same version number are
    different weights (regression: salvage scanned the current history)."""
    store = sqlite_store
    cfg = rules(group_size=1, groups_per_step=1, sampler="windowed", lookahead=2)
    ctl = start(store, cfg)
    admit_all(ctl)  # group 0 at step 0, spare 1, group 2 at step 1, group 3 at step 2
    finish_group(ctl, 0)
    ckpt_a = ctl.checkpoint(0)
    # Branch 1: train weights 1, dispatch group 2 with them, checkpoint B.
    ctl.execute(SelectBatch(0))
    ctl.execute(RecordTrainStep(0, 1))
    ctl.execute(PublishWeights(1))
    dispatch(ctl, 2)
    ckpt_b = ctl.checkpoint(1)
    complete(ctl, 2, 0)  # branch 1's own completion after B (weights 1 of branch 1)
    ctl.close()
    # Branch 2 (from A): other weights 1; group 2 completes with them.
    ctl, _ = restore(store, cfg, ckpt_a)
    ctl.execute(SelectBatch(0))
    ctl.execute(RecordTrainStep(0, 1))
    ctl.execute(PublishWeights(1))
    finish_group(ctl, 2)
    ctl.close()
    ctl, report = restore(store, cfg, ckpt_b)
    assert report.siblings_salvaged == 1  # branch 1's completion, not branch 2's
    (ev,) = [e for _, e in _after(store, ckpt_b) if e.event_type == "SiblingCompleted"]
    assert ev.salvaged_from == ckpt_b + 1  # type: ignore[attr-defined]
    assert_replay_equals_live(ctl)
    ctl.close()


# ---------------------------------------------------------------- refusals and fencing


def test_restore_refusals_append_nothing(store: EventStore) -> None:
    cfg = rules()
    ctl = start(store, cfg)
    admit_all(ctl)
    ckpt = ctl.checkpoint(0)
    finish_group(ctl, 0)
    ctl.close()
    before = store.get_run("run")
    with pytest.raises(RestoreError, match="needs the checkpoint offset"):
        restore(store, cfg, None)
    with pytest.raises(RestoreError, match=r"outside run 'run', whose log holds 1\.\."):
        restore(store, cfg, before.last_seq + 5)
    with pytest.raises(RestoreError, match=f"offset {ckpt - 1} of run 'run' is not a Checkp"):
        restore(store, cfg, ckpt - 1)
    other = rules(staleness_bound=5, sampler="windowed")
    with pytest.raises(RestoreError, match="fields that differ: sampler, staleness_bound"):
        restore(store, other, ckpt)
    with pytest.raises(RestoreError, match="the dataset differs"):
        restore(store, cfg, ckpt, dataset_fingerprint="another-dataset")
    after = store.get_run("run")
    assert (after.last_seq, after.current_epoch) == (before.last_seq, before.current_epoch)
    # Forced: a non-checkpoint offset is accepted and recorded as forced.
    ctl, report = restore(store, cfg, ckpt - 1, force=True)
    head = _after(store, before.last_seq)[0][1]
    assert head.event_type == "RunRestored"
    assert (head.forced, head.from_offset) == (True, ckpt - 1)  # type: ignore[attr-defined]
    assert report.epoch == 2
    check_invariants(ctl.state)
    ctl.close()


def test_epoch_fencing_after_a_restore(store: EventStore) -> None:
    cfg = rules()
    old = start(store, cfg)
    admit_all(old)
    ckpt = old.checkpoint(0)
    dispatch(old, 0)
    old.flush()
    new, _ = restore(store, cfg, ckpt)  # the old controller is still running
    last = store.get_run("run").last_seq
    dispatch(old, 1)  # applied to its own (now stale) state, but never durable
    with pytest.raises(GroupCommitClosedError) as exc:
        old.flush()
    assert isinstance(exc.value.__cause__, EpochFencedError)
    assert exc.value.__cause__.writer_epoch == 1
    assert exc.value.__cause__.current_epoch == 2
    with pytest.raises(GroupCommitClosedError):
        old.checkpoint(0)
    old.close()
    assert store.get_run("run").last_seq == last
    # The new epoch writes on; its history holds no event of the fenced writer.
    dispatch(new, 0)
    new.flush()
    epochs = {row.epoch for row, _ in iter_history(store, "run") if row.seq > ckpt}
    assert epochs == {2}
    assert_replay_equals_live(new)
    new.close()


def test_a_failed_run_can_be_reopened_checkpointed_and_restored(store: EventStore) -> None:
    """drop_policy=fail stops the run, but a takeover (open), a checkpoint and a restore
    still work (regressions: open raised RunFailedError after moving the epoch, and a
    restore at a checkpoint taken after the failure raised after appending RunRestored)."""
    cfg = rules(drop_policy="fail")
    ctl = start(store, cfg)
    admit_all(ctl)
    before_failure = ctl.checkpoint(0)
    dispatch(ctl, 0)
    fail(ctl, 0, 0, retryable=False, reason="fatal")
    failure = ctl.state.failure
    assert failure is not None and "fatal" in failure
    after_failure = ctl.checkpoint(0)
    ctl.close()

    ctl = RolloutController.open(store, "run", store_config=store_config())
    assert ctl.state.failure == failure
    assert ctl.epoch == 2 == ctl.state.epoch
    with pytest.raises(RunFailedError, match="fatal"):
        ctl.execute(AdmitStep())
    ctl.close()

    ctl, report = restore(store, cfg, after_failure)
    assert ctl.state.failure == failure  # still failed; nothing evicted or assigned
    assert report.groups_evicted_stale == 0
    assert [ev.event_type for _, ev in _after(store, after_failure)] == ["RunRestored"]
    assert_replay_equals_live(ctl)
    ctl.close()

    ctl, _ = restore(store, cfg, before_failure)  # before the failure: the run goes on
    assert ctl.state.failure is None
    assert 0 in ctl.state.groups
    drive_to_end(ctl)
    ctl.close()
    PromptLedger.from_history(store, "run").check_against(ctl.state)
