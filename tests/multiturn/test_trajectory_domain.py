"""The pure trajectory core: decide/evolve of turn events, fencing, loss mask, versions."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.domain import commands, decide, evolve, fold
from rolloutlog.controller.domain.errors import IllegalTransitionError, StaleAttemptError
from rolloutlog.controller.domain.state import RunState
from rolloutlog.controller.domain.trajectory import (
    EnvironmentStepped,
    LateResultRefused,
    ModelCallCompleted,
    RecordTurn,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryBook,
    TrajectoryCompleted,
    TrajectoryResumed,
    TrajectoryStarted,
    TurnEvent,
    evolve_trajectory,
    fold_trajectories,
)

RULES = RolloutConfig(group_size=2, groups_per_step=1, lookahead=0, staleness_bound=4)


class Run:
    """A run state with group 0 admitted and sibling 0 dispatched, plus its book."""

    def __init__(self) -> None:
        self.state = RunState()
        self.seq = 0
        self.book: TrajectoryBook = {}
        self.log: list[tuple[int, Any]] = []  # (epoch, event) of every event decided
        self.exec(
            commands.StartRun(
                run_id="t",
                rollout=RULES,
                config_fingerprint="f",
                dataset_fingerprint="d",
                dataset_size=100,
            )
        )
        self.exec(commands.AdmitStep())
        self.dispatch()

    def exec(self, cmd: Any) -> list[Any]:
        events = decide(self.state, cmd)
        for ev in events:
            self.seq += 1
            evolve(self.state, ev, self.seq)
            evolve_trajectory(self.book, ev, self.state.epoch)
            self.log.append((self.state.epoch, ev))
        return events

    def dispatch(self) -> int:
        (ev,) = self.exec(commands.DispatchSiblings(0, (0,), self.state.published_version))
        return int(ev.attempt)

    @property
    def attempt(self) -> int:
        return self.state.groups[0].sibling(0).attempt

    def record(self, event: TurnEvent) -> None:
        self.exec(RecordTurn(event, self.book.get((0, 0))))

    def ids(self) -> dict[str, int]:
        return {"group_id": 0, "sibling": 0, "attempt": self.attempt}


def _start(run: Run, obs: int = 3) -> None:
    run.record(
        TrajectoryStarted(
            **run.ids(),
            prompt_index=run.state.groups[0].prompt_index,
            prompt_tokens=5,
            observation="obs" if obs else None,
            observation_tokens=obs,
            payload_id="p-start" if obs else None,
        )
    )


def _model(run: Run, tokens: int, version: int = 0) -> None:
    traj = run.book[(0, 0)]
    run.record(
        ModelCallCompleted(
            **run.ids(),
            turn=traj.turns,
            context_tokens=traj.context_tokens,
            output_tokens=tokens,
            weight_version=version,
            payload_id=f"m{traj.turns}",
            finish_reason="stop",
        )
    )


def _request(run: Run, call: int = 0) -> str:
    traj = run.book[(0, 0)]
    key = f"k{traj.turns - 1}-{call}"
    run.record(
        ToolCallRequested(
            **run.ids(),
            turn=traj.turns - 1,
            call=call,
            tool="add",
            arguments={"a": 1},
            idempotency_key=key,
            idempotent=False,
            status_check=True,
        )
    )
    return key


def _result(run: Run, key: str, tokens: int, *, failed: bool = False) -> None:
    turn = run.book[(0, 0)].tool_call(key).turn  # type: ignore[union-attr]
    if failed:
        run.record(
            ToolCallFailed(
                **run.ids(),
                turn=turn,
                idempotency_key=key,
                reason="boom",
                outcome="error",
                seconds=0.1,
                observation_tokens=tokens,
                payload_id=f"f-{key}",
            )
        )
    else:
        run.record(
            ToolCallCompleted(
                **run.ids(),
                turn=turn,
                idempotency_key=key,
                result="2",
                seconds=0.1,
                observation_tokens=tokens,
                payload_id=f"r-{key}",
            )
        )


def _complete(run: Run) -> TrajectoryCompleted:
    traj = run.book[(0, 0)]
    mask = traj.loss_mask()
    versions = [v for v in traj.token_versions() if v >= 0]
    ev = TrajectoryCompleted(
        **run.ids(),
        turns=traj.turns,
        final_reward=1.0,
        model_tokens=sum(mask),
        observation_tokens=len(mask) - sum(mask),
        payload_id="traj",
        oldest_weight_version=min(versions),
        newest_weight_version=max(versions),
        finish="no_tool_call",
    )
    run.record(ev)
    return ev


# A turn plan: (model tokens, [tool result tokens or -n for a failure], env step tokens or None)
turn_plans = st.lists(
    st.tuples(
        st.integers(1, 6),
        st.lists(st.integers(-4, 4).filter(lambda n: n != 0), max_size=3),
        st.none() | st.integers(0, 3),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(plan=turn_plans, obs=st.integers(0, 4), versions=st.lists(st.integers(0, 0), min_size=6))
def test_the_mask_and_versions_follow_the_turns(
    plan: list[tuple[int, list[int], int | None]], obs: int, versions: list[int]
) -> None:
    run = Run()
    _start(run, obs)
    expected_mask = [0] * obs
    for i, (model, tools, env) in enumerate(plan):
        _model(run, model, versions[i])
        expected_mask += [1] * model
        if tools:
            for call, n in enumerate(tools):
                key = _request(run, call)
                _result(run, key, abs(n), failed=n < 0)
                expected_mask += [0] * abs(n)
        elif env is not None:
            run.record(
                EnvironmentStepped(
                    **run.ids(),
                    turn=i,
                    observation="o" if env else None,
                    observation_tokens=env,
                    payload_id="e" if env else None,
                    reward=0.5,
                    done=False,
                )
            )
            expected_mask += [0] * env
    ev = _complete(run)
    traj = run.book[(0, 0)]
    assert traj.loss_mask() == expected_mask
    assert [v >= 0 for v in traj.token_versions()] == [m == 1 for m in expected_mask]
    assert ev.model_tokens == sum(p[0] for p in plan)
    assert traj.turns == len(plan) and traj.completed
    # The book is a fold of the log: folding the recorded events again gives it back.
    assert fold_trajectories(run.log) == {(0, 0): traj}


def test_a_turn_out_of_order_is_refused() -> None:
    run = Run()
    _start(run)
    _model(run, 3)
    key = _request(run)
    with pytest.raises(IllegalTransitionError, match="tool calls still open"):
        _model(run, 2)  # the tool call has no result yet
    _result(run, key, 2)
    with pytest.raises(IllegalTransitionError, match="is completed already"):
        _result(run, key, 2)  # one result per call
    with pytest.raises(IllegalTransitionError, match="requested already"):
        run.record(
            ToolCallRequested(
                **run.ids(),
                turn=0,
                call=1,
                tool="add",
                arguments={},
                idempotency_key=key,
                idempotent=True,
                status_check=False,
            )
        )
    traj = run.book[(0, 0)]
    with pytest.raises(IllegalTransitionError, match="context tokens"):
        run.record(
            ModelCallCompleted(
                **run.ids(),
                turn=1,
                context_tokens=traj.context_tokens - 1,  # a context other than the recorded one
                output_tokens=2,
                weight_version=0,
                payload_id="x",
                finish_reason="stop",
            )
        )
    _complete(run)
    with pytest.raises(IllegalTransitionError, match="nothing follows"):
        _model(run, 1)
    # A new attempt may take a completed trajectory over whole, and add nothing to it.
    old = run.attempt
    run.exec(commands.AbortSibling(0, 0, old, "restore"))
    new = run.dispatch()
    traj = run.book[(0, 0)]
    run.record(
        TrajectoryResumed(
            group_id=0, sibling=0, attempt=new, from_epoch=traj.owner[0], from_attempt=old,
            model_calls_reused=traj.turns, tool_results_reused=1, tool_calls_open=0,
        )
    )  # fmt: skip
    assert run.book[(0, 0)].owner == (run.state.epoch, new) and run.book[(0, 0)].completed
    with pytest.raises(IllegalTransitionError, match="nothing follows"):
        _model(run, 1)


def test_a_late_result_of_a_superseded_attempt_is_refused_and_recorded() -> None:
    run = Run()
    _start(run)
    _model(run, 3)
    old = run.attempt
    key = _request(run)
    run.exec(commands.AbortSibling(0, 0, old, "engine lost"))
    new = run.dispatch()
    assert new == old + 1
    late = ToolCallCompleted(
        group_id=0,
        sibling=0,
        attempt=old,
        turn=0,
        idempotency_key=key,
        result="2",
        seconds=1.0,
        observation_tokens=1,
        payload_id="late",
    )
    with pytest.raises(StaleAttemptError):
        run.record(late)
    # The new attempt must take the trajectory over before it extends it.
    with pytest.raises(StaleAttemptError, match="resume it first"):
        run.record(late.model_copy(update={"attempt": new}))
    refusal = LateResultRefused(
        group_id=0, sibling=0, attempt=old, turn=0, kind="tool_call", current_attempt=new,
        reason="late",
    )  # fmt: skip
    run.record(refusal)
    with pytest.raises(IllegalTransitionError, match="not late"):
        run.record(refusal.model_copy(update={"attempt": new}))
    traj = run.book[(0, 0)]
    run.record(
        TrajectoryResumed(
            group_id=0, sibling=0, attempt=new, from_epoch=traj.owner[0], from_attempt=old,
            model_calls_reused=1, tool_results_reused=0, tool_calls_open=1,
        )
    )  # fmt: skip
    assert run.book[(0, 0)].owner == (run.state.epoch, new)
    assert run.book[(0, 0)].late_refused == 1
    _result(run, key, 1)  # the new attempt resolves the open call
    with pytest.raises(IllegalTransitionError, match="cannot take over"):
        run.record(
            TrajectoryResumed(
                group_id=0, sibling=0, attempt=new, from_epoch=run.state.epoch,
                from_attempt=new, model_calls_reused=1, tool_results_reused=1, tool_calls_open=0,
            )
        )  # fmt: skip


def test_turn_events_leave_the_run_state_as_it_was() -> None:
    """Old logs have no turn events and replay unchanged; a log with them folds to the
    same run state as without them (their evolvers on the run state are no-ops)."""
    run = Run()
    before = run.state.copy()
    _start(run)
    _model(run, 3)
    after = run.state.copy()
    after.last_seq = before.last_seq
    assert after == before
    assert fold([]).groups == {}
