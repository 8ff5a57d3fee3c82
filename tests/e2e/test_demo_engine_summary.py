"""The demo's engine summary reads the whole log: an engine lost after the last
checkpoint (a range the resumed worker's restore abandons) still counts as lost.

CI once saw ``engines_lost == 0`` from a real vLLM fleet demo: under load the health
probes declared the killed engine dead only after the step-5 checkpoint, the worker
crash came after that, and the restore to step 5 left the loss out of the history.
"""

from __future__ import annotations

from pathlib import Path

from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.domain import RecordEngineJoined, RecordEngineLost
from rolloutlog.controller.rollout_controller import RolloutController, iter_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.demo import _whole_log, engine_summary

ROLLOUT = RolloutConfig(group_size=2, groups_per_step=2, sampler="in_order", lookahead=1)


def test_a_loss_in_an_abandoned_range_still_counts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with EventStore.open(url) as store:
        ctl = RolloutController.start(
            store, "r", ROLLOUT, dataset_fingerprint="toy", dataset_size=8
        )
        ctl.execute(RecordEngineJoined("engine-0", "http://127.0.0.1:1", 0))
        ctl.execute(RecordEngineJoined("engine-1", "http://127.0.0.1:2", 0))
        offset = ctl.checkpoint(0)
        ctl.execute(RecordEngineLost("engine-1", "3 health probes failed", ()))
        ctl.flush()
        ctl.close()  # the worker "dies" after the loss, before the next checkpoint
        restored, _report = RolloutController.restore(store, "r", offset, rollout=ROLLOUT)
        restored.close()

        history = [ev.event_type for _row, ev in iter_history(store, "r")]
        assert "EngineLost" not in history  # the restore abandoned it
        log = _whole_log(store, "r")
        assert [ev.event_type for in_history, ev in log if not in_history] == ["EngineLost"]
        summary = engine_summary(log)
    assert summary["engines"] == 2
    assert summary["engines_lost"] == 1
    assert summary["engine_losses_abandoned"] == 1


def test_redispatch_after_a_loss_is_counted_across_the_log() -> None:
    from rolloutlog.controller.domain.events import EngineJoined, EngineLost, SiblingDispatched

    log = [
        (True, EngineJoined(engine_id="engine-1", address="http://h:2", weight_version=0)),
        (True, SiblingDispatched(group_id=3, sibling=1, attempt=1, weight_version=0)),
        (True, SiblingDispatched(group_id=3, sibling=0, attempt=1, weight_version=0)),
        (False, EngineLost(engine_id="engine-1", reason="killed", in_flight=["g3-s1-a1"])),
        (True, SiblingDispatched(group_id=3, sibling=1, attempt=2, weight_version=0)),
    ]
    summary = engine_summary(log)
    assert summary["siblings_redispatched_after_engine_loss"] == 1
    assert (summary["engines_lost"], summary["engine_losses_abandoned"]) == (1, 1)
    # Only the lost attempt's sibling counts: sibling 0 was never redispatched.
    log.append((True, SiblingDispatched(group_id=3, sibling=0, attempt=1, weight_version=0)))
    assert engine_summary(log)["siblings_redispatched_after_engine_loss"] == 1
