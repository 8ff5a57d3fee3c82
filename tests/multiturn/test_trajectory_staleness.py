"""The per-trajectory staleness policy, pure: keep, abort, restart after turn k."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_trajectory_domain import Run, _complete, _model, _request, _result, _start

from rolloutlog.controller.domain import commands
from rolloutlog.controller.domain.errors import IllegalTransitionError
from rolloutlog.controller.domain.trajectory import (
    EnvironmentStepped,
    StalenessPolicy,
    TrajectoryResumed,
    TrajectoryTooStale,
    decide_staleness,
    fold_trajectories,
)
from rolloutlog.controller.multiturn import MultiTurnConfig


def _run() -> Run:
    run = Run()
    run.state.weight_version = 9  # the trainer is ahead: calls may use versions up to 9
    _start(run)
    return run


def _turn(run: Run, version: int, *, tool: bool = True) -> None:
    _model(run, 2, version)
    if tool:
        _result(run, _request(run), 3)


def _decide(
    run: Run, policy: StalenessPolicy, next_version: int | None
) -> TrajectoryTooStale | None:
    ev = decide_staleness(run.book[(0, 0)], policy, run.attempt, next_version)
    if ev is not None:
        run.record(ev)
    return ev


def test_unbounded_and_within_bound_record_nothing() -> None:
    run = _run()
    for v in (0, 1, 2):
        _turn(run, v)
    traj = run.book[(0, 0)]
    assert decide_staleness(traj, StalenessPolicy(), run.attempt, 7) is None  # default: keep all
    # Exactly K versions (with the next call's) is within the bound.
    assert decide_staleness(traj, StalenessPolicy(3, "abort"), run.attempt, 2) is None
    assert decide_staleness(traj, StalenessPolicy(3, "abort"), run.attempt, None) is None
    # One more is not.
    ev = decide_staleness(traj, StalenessPolicy(3, "abort"), run.attempt, 3)
    assert ev is not None and ev.versions == [0, 1, 2, 3] and ev.next_version == 3
    assert decide_staleness(traj, StalenessPolicy(2, "abort"), run.attempt, None) is not None


def test_keep_is_recorded_once_on_the_versions_the_calls_used() -> None:
    run = _run()
    _turn(run, 0)
    policy = StalenessPolicy(1, "keep")
    assert _decide(run, policy, 1) is None  # before the call: keep records nothing
    _turn(run, 1)
    ev = _decide(run, policy, None)
    assert ev is not None and ev.outcome == "kept" and ev.turns_kept == 2
    assert ev.turns_abandoned == 0 and ev.tool_calls_abandoned == 0 and "policy keep" in ev.reason
    assert run.book[(0, 0)].stale_kept and run.book[(0, 0)].turns == 2
    _turn(run, 2, tool=False)
    assert _decide(run, policy, None) is None  # once per trajectory
    _complete(run)
    assert fold_trajectories(run.log) == run.book


def test_abort_abandons_every_turn_and_the_next_attempt_starts_anew() -> None:
    run = _run()
    _turn(run, 0)
    _turn(run, 1)
    ev = _decide(run, StalenessPolicy(2, "abort"), 2)
    assert ev is not None and (ev.outcome, ev.turns_kept, ev.turns_abandoned) == ("aborted", 0, 2)
    assert ev.tool_calls_abandoned == 2 and "policy abort" in ev.reason
    traj = run.book[(0, 0)]
    assert traj.abandoned and traj.restarts == 1
    with pytest.raises(IllegalTransitionError, match="abandoned"):
        _model(run, 2, 2)  # nothing follows an abandoned trajectory in this attempt
    old = run.attempt
    run.exec(commands.AbortSibling(0, 0, old, f"too stale: {ev.reason}"))
    run.dispatch()
    resumed = TrajectoryResumed(
        **run.ids(),
        from_epoch=0,
        from_attempt=old,
        model_calls_reused=2,
        tool_results_reused=2,
        tool_calls_open=0,
    )
    with pytest.raises(IllegalTransitionError, match="abandoned"):
        run.record(resumed)  # its turns are never reused
    _start(run)
    traj = run.book[(0, 0)]
    assert (traj.turns, traj.restarts, traj.abandoned, traj.tool_calls) == (0, 1, False, ())
    _turn(run, 2)
    _complete(run)
    assert run.book[(0, 0)].token_versions().count(2) == 2
    assert fold_trajectories(run.log) == run.book


def test_restart_keeps_turns_up_to_k_and_goes_on_from_there() -> None:
    run = _run()
    _turn(run, 0)
    run.record(
        EnvironmentStepped(
            **run.ids(),
            turn=0,
            observation=None,
            observation_tokens=0,
            payload_id=None,
            reward=0.25,
            done=False,
        )
    )
    before = run.book[(0, 0)]
    _turn(run, 1)
    _turn(run, 1)
    ev = _decide(run, StalenessPolicy(2, "restart", restart_after_turn=0), 2)
    assert ev is not None and ev.outcome == "restarted"
    assert (ev.turns_kept, ev.turns_abandoned, ev.tool_calls_abandoned) == (1, 2, 2)
    assert ev.restart_after_turn == 0 and "policy restart" in ev.reason
    traj = run.book[(0, 0)]
    # The context is turn 0's end again: its model call, tool result and step.
    assert traj.turns == 1 and traj.restarts == 1 and traj.stepped
    assert traj.last_reward == 0.25 and len(traj.tool_calls) == 1
    assert traj.segments == before.segments and traj.context_tokens == before.context_tokens
    _turn(run, 2, tool=False)  # turn 1 again, read from turn 0's end
    assert run.book[(0, 0)].weight_versions() == {0, 2}
    _complete(run)
    assert fold_trajectories(run.log) == run.book


def test_restart_that_cannot_bound_the_trajectory_aborts_it() -> None:
    run = _run()
    _turn(run, 0)
    _turn(run, 1)
    _turn(run, 1)
    traj = run.book[(0, 0)]
    # Turns 0..1 with version 2 still span 3 > 2 versions.
    ev = decide_staleness(traj, StalenessPolicy(2, "restart", 1), run.attempt, 2)
    assert ev is not None and ev.outcome == "aborted" and "would still span" in ev.reason
    assert (ev.turns_kept, ev.turns_abandoned) == (0, 3)
    # Past the newest turn: nothing to abandon.
    ev = decide_staleness(traj, StalenessPolicy(1, "restart", 5), run.attempt, None)
    assert ev is not None and ev.outcome == "aborted" and "no turns after it" in ev.reason


def test_restart_after_the_call_that_made_it_too_stale_abandons_that_call_too() -> None:
    run = _run()
    for v in (0, 1, 2):
        _turn(run, v)
    ev = _decide(run, StalenessPolicy(2, "restart", 0), None)
    assert ev is not None and ev.next_version is None
    assert (ev.outcome, ev.turns_kept, ev.turns_abandoned) == ("restarted", 1, 2)
    assert run.book[(0, 0)].weight_versions() == {0}


def test_a_decision_the_policy_would_not_make_is_refused() -> None:
    run = _run()
    _turn(run, 0)
    _turn(run, 1, tool=False)
    ev = decide_staleness(run.book[(0, 0)], StalenessPolicy(2, "restart", 0), run.attempt, 2)
    assert ev is not None
    with pytest.raises(IllegalTransitionError, match="differs from policy"):
        run.record(ev.model_copy(update={"turns_kept": 2, "turns_abandoned": 0}))
    with pytest.raises(IllegalTransitionError, match="within 3 versions"):
        run.record(ev.model_copy(update={"max_weight_versions": 3}))
    _request(run)
    with pytest.raises(IllegalTransitionError, match="still open"):
        run.record(ev)


def test_the_config_needs_a_bound_for_abort_or_restart() -> None:
    assert MultiTurnConfig().staleness == StalenessPolicy(None, "keep", 0)
    with pytest.raises(ValidationError, match="needs max_weight_versions"):
        MultiTurnConfig(on_too_many_versions="abort")
    with pytest.raises(ValidationError):
        MultiTurnConfig(max_weight_versions=0)
    with pytest.raises(ValidationError):
        MultiTurnConfig(
            max_weight_versions=1, on_too_many_versions="restart", restart_after_turn=-1
        )


@settings(max_examples=120, deadline=None)
@given(
    steps=st.lists(st.integers(0, 2), min_size=1, max_size=8),
    bound=st.integers(1, 3),
    action=st.sampled_from(["keep", "abort", "restart"]),
    k=st.integers(0, 3),
    tools=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_a_trajectory_run_under_the_policy_stays_within_it(
    steps: list[int], bound: int, action: str, k: int, tools: list[bool]
) -> None:
    """Weights advance between turns by ``steps``; before each model call the policy is
    applied with the engine's version. Under abort and restart no trajectory completes
    spanning more than ``bound`` versions; under keep each one that does is recorded once.
    The book is always the fold of the log, and the token versions match the turns."""
    run = _run()
    policy = StalenessPolicy(bound, action, k)  # type: ignore[arg-type]
    version, calls = 0, 0
    for step, tool in zip(steps, tools, strict=False):
        version = min(9, version + step)
        ev = _decide(run, policy, version)
        if ev is not None and ev.outcome == "aborted":
            run.exec(commands.AbortSibling(0, 0, run.attempt, f"too stale: {ev.reason}"))
            run.dispatch()
            _start(run)
        _turn(run, version, tool=tool)
        calls += 1
        assert _decide(run, policy, None) is None or action == "keep"
    _complete(run)
    traj = run.book[(0, 0)]
    kept = [e for _, e in run.log if isinstance(e, TrajectoryTooStale)]
    if action == "keep":
        assert len(kept) == (len(traj.weight_versions()) > bound)
        assert traj.turns == calls
    else:
        assert len(traj.weight_versions()) <= bound
        abandoned = sum(e.turns_abandoned for e in kept)
        assert traj.turns + abandoned == calls  # every call is kept or recorded abandoned
    versions = [v for v in traj.token_versions() if v >= 0]
    model = [s for s in traj.segments if s.kind == "model"]
    assert versions == [s.weight_version for s in model for _ in range(s.tokens)]
    assert [s.turn for s in model] == list(range(traj.turns))
    assert fold_trajectories(run.log) == run.book
