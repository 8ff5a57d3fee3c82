"""Engine membership in the pure core: joins, losses, refits, the engine table, and
attempts in flight on a lost engine ending like any other abandoned attempt."""

from __future__ import annotations

import pytest
from domain_helpers import PureRun, admit, complete, dispatch, kinds, only

from rolloutlog.controller.domain import (
    CODEC,
    RecordEngineJoined,
    RecordEngineLost,
    RecordEngineRefit,
    Resume,
    RunState,
    SiblingStatus,
)
from rolloutlog.controller.domain.errors import IllegalTransitionError
from rolloutlog.controller.domain.events import SiblingCompleted, SiblingDispatched


def _run() -> PureRun:
    run = PureRun(group_size=2)
    admit(run)
    return run


def test_join_lose_rejoin_refit_keep_the_engine_table() -> None:
    run = _run()
    run.execute(RecordEngineJoined("e0", "http://a:1", 0))
    run.execute(RecordEngineJoined("e1", "http://b:1", 0))
    lost = run.execute(RecordEngineLost("e1", "probes failed", ("g0-s0-a1",)))
    assert only(lost, "EngineLost")[0].in_flight == ["g0-s0-a1"]
    assert run.state.engines["e1"].lost and run.state.engines["e1"].weight_version is None
    with pytest.raises(IllegalTransitionError, match="not up"):
        run.execute(RecordEngineLost("e1", "again", ()))
    with pytest.raises(IllegalTransitionError, match="not up"):
        run.execute(RecordEngineRefit("e1", 0))
    run.execute(RecordEngineJoined("e1", "http://b:2", None))  # restarted: weights unknown
    run.execute(RecordEngineRefit("e1", 0))
    e1 = run.state.engines["e1"]
    assert (e1.address, e1.weight_version, e1.lost, e1.joins, e1.losses) == (
        "http://b:2",
        0,
        False,
        2,
        1,
    )
    assert run.state.counters.engines_lost == 1 and run.state.counters.engines_refit == 1
    # The engine table survives a snapshot.
    assert RunState.from_snapshot(run.state.to_snapshot()).engines == run.state.engines


def test_refit_or_join_beyond_the_trainer_is_refused() -> None:
    run = _run()
    with pytest.raises(IllegalTransitionError, match="newer than the trainer"):
        run.execute(RecordEngineJoined("e0", "http://a:1", 3))
    run.execute(RecordEngineJoined("e0", "http://a:1", 0))
    with pytest.raises(IllegalTransitionError, match="newer than the trainer"):
        run.execute(RecordEngineRefit("e0", 1))
    with pytest.raises(IllegalTransitionError, match="not up"):
        run.execute(RecordEngineLost("e9", "never joined", ()))


def test_attempts_on_a_lost_engine_are_rerun_on_resume_like_any_abandoned_one() -> None:
    run = _run()
    run.execute(RecordEngineJoined("e0", "http://a:1", 0))
    dispatch(run, 0, version=0)
    run.execute(RecordEngineLost("e0", "killed", ("g0-s0-a1", "g0-s1-a1")))
    # The loss alone does not touch the siblings: they are still in flight in the log.
    assert [s.status for s in run.state.groups[0].siblings] == [SiblingStatus.IN_FLIGHT] * 2
    applied = run.execute(Resume(epoch=2))
    assert kinds(applied) == ["RunResumed"]
    assert only(applied, "RunResumed")[0].siblings_rerun == 2
    assert [s.status for s in run.state.groups[0].siblings] == [SiblingStatus.PENDING] * 2
    again = dispatch(run, 0, version=0)
    assert [e.attempt for e in only(again, "SiblingDispatched")] == [2, 2]


def test_completion_carries_the_engine_and_old_events_decode() -> None:
    run = _run()
    dispatch(run, 0, version=0)
    complete(run, 0, 0)  # the in-process path: no engine
    assert run.state.groups[0].siblings[0].status is SiblingStatus.DONE
    old = SiblingCompleted.model_validate(
        {
            "group_id": 0,
            "sibling": 0,
            "attempt": 1,
            "weight_version": 0,
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "reward": 0.0,
            "payload_id": "p",
            "finish_reason": "stop",
        }
    )
    assert old.engine_id is None
    assert SiblingDispatched(group_id=0, sibling=0, attempt=1, weight_version=0).engine_id is None
    for name in ("EngineJoined", "EngineLost", "EngineRefit"):
        assert name in CODEC.types
