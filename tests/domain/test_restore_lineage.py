"""Salvage survives an interrupted restore (issue 9, item 9).

A restore from checkpoint C salvages the completions of every branch that continues
from C's history: the branch that wrote C, and every epoch that resumed at C (or
continued a branch that did), even when a later restore from C died after opening its
epoch. Branches that do not continue from C (another checkpoint's restore) stay out:
their weights of the same version number are other weights.
"""

from __future__ import annotations

from domain_helpers import (
    PromptLedger,
    admit_all,
    assert_replay_equals_live,
    complete,
    dispatch,
    drive_to_end,
    finish_group,
    restore,
    rules,
    start,
)
from test_scenarios import _salvage_history

from rolloutlog.controller.domain import PublishWeights, RecordTrainStep, SelectBatch
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore


def _interrupted_restore(store: EventStore, offset: int) -> None:
    """A restore from ``offset`` that died right after opening its epoch."""
    info = store.get_run("run")
    store.open_epoch("run", expected_epoch=info.current_epoch, resume_seq=offset)


def test_a_restore_after_an_interrupted_restore_still_salvages(store: EventStore) -> None:
    ckpt, cfg, _groups = _salvage_history(store)
    _interrupted_restore(store, ckpt)
    ctl, report = restore(store, cfg, ckpt, mode="salvage")
    assert report.siblings_salvaged == 7  # as a first restore would (A: 3, B: 3, C: 1)
    assert report.siblings_rerun == 12 - 1 - 7
    assert_replay_equals_live(ctl)
    drive_to_end(ctl)
    ctl.close()
    PromptLedger.from_history(store, "run").check_against(ctl.state)


def test_two_interrupted_restores_and_a_partial_one(store: EventStore) -> None:
    """Every abandoned branch from the checkpoint counts, whichever came last."""
    ckpt, cfg, _groups = _salvage_history(store)
    _interrupted_restore(store, ckpt)
    # A restore that got as far as its RunRestored + salvage events, then died.
    ctl, first = restore(store, cfg, ckpt, mode="salvage")
    ctl.close()
    assert first.siblings_salvaged == 7
    _interrupted_restore(store, ckpt)
    ctl, report = restore(store, cfg, ckpt, mode="salvage")
    assert report.siblings_salvaged == 7
    # The first of each sibling's completions wins: the original, not a salvaged copy.
    originals = {
        row.seq
        for row in store.read("run", ckpt + 1)
        if row.type == "SiblingCompleted" and row.epoch == 1
    }
    salvaged_from = {
        ev.salvaged_from  # type: ignore[attr-defined]
        for row, ev in iter_history(store, "run")
        if row.seq > ckpt and ev.event_type == "SiblingCompleted"
    }
    assert salvaged_from <= originals
    assert_replay_equals_live(ctl)
    ctl.close()


def test_salvage_after_an_interrupted_restore_ignores_other_lineages(
    sqlite_store: EventStore,
) -> None:
    """Branch 1 wrote checkpoint B; branch 2 restored to the earlier checkpoint A (other
    weights 1). A restore to B that died, then another: only branch 1's completion."""
    store = sqlite_store
    cfg = rules(group_size=1, groups_per_step=1, sampler="windowed", lookahead=2)
    ctl = start(store, cfg)
    admit_all(ctl)
    finish_group(ctl, 0)
    ckpt_a = ctl.checkpoint(0)
    ctl.execute(SelectBatch(0))
    ctl.execute(RecordTrainStep(0, 1))
    ctl.execute(PublishWeights(1))
    dispatch(ctl, 2)
    ckpt_b = ctl.checkpoint(1)
    complete(ctl, 2, 0)  # branch 1, after B
    ctl.close()
    ctl, _ = restore(store, cfg, ckpt_a)  # branch 2, from A
    ctl.execute(SelectBatch(0))
    ctl.execute(RecordTrainStep(0, 1))
    ctl.execute(PublishWeights(1))
    finish_group(ctl, 2)
    ctl.close()
    _interrupted_restore(store, ckpt_b)
    ctl, report = restore(store, cfg, ckpt_b)
    assert report.siblings_salvaged == 1
    (ev,) = [
        e
        for row, e in iter_history(store, "run")
        if row.seq > ckpt_b and e.event_type == "SiblingCompleted"
    ]
    assert ev.salvaged_from == ckpt_b + 1  # type: ignore[attr-defined]
    assert_replay_equals_live(ctl)
    ctl.close()
