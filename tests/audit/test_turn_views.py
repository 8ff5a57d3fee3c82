"""The multi-turn views (``turns``, ``trajectories``, ``tool_calls``) on a real
multi-turn run with a restore agree with the trajectory events read back in Python and
with the backend's own fold; abandoned turns are there, flagged; a regenerated model
call is counted by the cookbook's recipe."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mt_audit_helpers import BuiltMtRun
from test_cookbook import recipes

from rolloutlog.controller.domain.trajectory import fold_trajectories
from rolloutlog.controller.replay_tool import TURN_KINDS
from rolloutlog.controller.rollout_index import attach, read_indexed
from rolloutlog.controller.sql_audit import SqlAudit, param_names
from rolloutlog.eventstore import EventStore, NewEvent


def rows(b: BuiltMtRun, sql: str) -> list[dict[str, Any]]:
    return b.audit.select(sql, {"run_id": b.run_id}, limit=None).rows


def test_turns_are_every_trajectory_event_in_order(mt_run: BuiltMtRun) -> None:
    b = mt_run
    got = rows(b, "SELECT * FROM turns WHERE run_id = :run_id ORDER BY seq")
    assert [r["seq"] for r in got] == [seq for seq, _, _ in b.turn_events]
    starts: dict[tuple[int, int], int] = {}
    for r, (seq, epoch, e) in zip(got, b.turn_events, strict=True):
        key = (e.group_id, e.sibling)
        if e.event_type == "TrajectoryStarted":
            starts[key] = seq
        assert (r["group_id"], r["sibling"], r["epoch"], r["attempt"]) == (*key, epoch, e.attempt)
        assert r["kind"] == TURN_KINDS[e.event_type]
        assert r["trajectory_seq"] == starts[key]
        assert bool(r["in_history"]) == (seq in b.history)
        assert r["turn"] == getattr(e, "turn", None)
        if e.event_type == "ModelCallCompleted":
            assert (r["tokens"], r["weight_version"]) == (e.output_tokens, e.weight_version)  # type: ignore[attr-defined]
        elif e.event_type in ("ToolCallCompleted", "ToolCallFailed"):
            assert r["tokens"] == e.observation_tokens  # type: ignore[attr-defined]
            assert r["seconds"] == e.seconds  # type: ignore[attr-defined]
    # The restore abandoned turns, and the views still show them.
    flags = Counter((r["kind"], bool(r["in_history"])) for r in got)
    assert flags[("model_call", False)] > 0 and flags[("model_call", True)] > 0
    assert flags[("resumed", True)] > 0


def test_trajectories_are_the_backends_fold(mt_run: BuiltMtRun) -> None:
    b = mt_run
    book = fold_trajectories((epoch, e) for _, epoch, e in b.turn_events)
    got = rows(b, "SELECT * FROM trajectories WHERE run_id = :run_id ORDER BY trajectory_seq")
    newest = {}
    for r in got:
        newest[(r["group_id"], r["sibling"])] = r  # ordered by start: the last one wins
    assert set(newest) == set(book)
    for key, traj in book.items():
        r = newest[key]
        assert (r["data_pass"], r["prompt_index"]) == traj.prompt
        assert r["prompt_tokens"] == traj.prompt_tokens
        assert r["turns"] == traj.turns
        assert r["tool_calls"] == len(traj.tool_calls)
        assert r["tool_failures"] == sum(c.status == "failed" for c in traj.tool_calls)
        assert r["resumes"] == traj.resumes and r["late_refused"] == traj.late_refused
        assert bool(r["completed"]) == traj.completed
        assert r["final_reward"] == traj.final_reward
        model = sum(s.tokens for s in traj.segments if s.kind == "model")
        assert (r["model_tokens"], r["observation_tokens"]) == (
            model,
            sum(s.tokens for s in traj.segments) - model,
        )
        assert (r["last_epoch"], r["last_attempt"]) == traj.owner
        versions = [s.weight_version for s in traj.segments if s.weight_version is not None]
        if versions:
            assert (r["oldest_weight_version"], r["newest_weight_version"]) == (
                min(versions),
                max(versions),
            )
    assert any(r["resumes"] for r in got) and any(r["completed"] for r in got)
    assert any(r["tool_failures"] for r in got)


def test_tool_calls_pair_each_request_with_its_result(mt_run: BuiltMtRun) -> None:
    b = mt_run
    got = rows(b, "SELECT * FROM tool_calls WHERE run_id = :run_id ORDER BY requested_seq")
    requests = [(seq, e) for seq, _, e in b.turn_events if e.event_type == "ToolCallRequested"]
    assert [r["requested_seq"] for r in got] == [seq for seq, _ in requests]
    answers = {
        e.idempotency_key: (seq, epoch, e)  # type: ignore[attr-defined]
        for seq, epoch, e in b.turn_events
        if e.event_type in ("ToolCallCompleted", "ToolCallFailed")
    }
    for r, (_, req) in zip(got, requests, strict=True):
        assert r["idempotency_key"] == req.idempotency_key  # type: ignore[attr-defined]
        assert bool(r["idempotent"]) == req.idempotent  # type: ignore[attr-defined]
        assert bool(r["status_check"]) == req.status_check  # type: ignore[attr-defined]
        answer = answers.get(req.idempotency_key)  # type: ignore[attr-defined]
        if answer is None:
            assert r["status"] == "open" and r["result_seq"] is None
        else:
            seq, epoch, ev = answer
            assert (r["result_seq"], r["result_epoch"], r["result_attempt"]) == (
                seq,
                epoch,
                ev.attempt,
            )
            done = ev.event_type == "ToolCallCompleted"
            assert r["status"] == ("completed" if done else "failed")
    assert {r["tool"] for r in got} == {"add", "submit"}
    assert {r["status"] for r in got} >= {"completed", "failed"}


def test_a_regenerated_model_call_is_counted(mt_run: BuiltMtRun, db_url: str) -> None:
    """Mutation: the run's events again (one epoch), plus one model call of a turn that
    already had one: the recipe reports exactly it."""
    with EventStore.open(mt_run.url) as source:
        rows_ = list(read_indexed(source, mt_run.run_id))
    with EventStore.open(db_url) as store:
        attach(store)
        store.create_run("mut")
        events = [
            NewEvent(
                r.type,
                r.schema_version,
                r.payload,
                r.recorded_at,
                (r.group_id, r.prompt_index, r.target_step, r.train_step, r.weight_version),
            )
            for r in rows_
        ]
        dup = next(e for e in events if e.type == "ModelCallCompleted")
        store.append("mut", [*events, dup], expected_seq=1, epoch=1)
    sql = recipes()["turns-regenerated-after-restore"]
    with SqlAudit(db_url, allow_privileged_role=True) as audit:
        got = audit.select(sql, {k: "mut" for k in param_names(sql)}, limit=None).rows
    assert sum(r["model_calls"] for r in got) == 1 + sum(
        e.event_type == "ModelCallCompleted" for _, _, e in mt_run.turn_events
    )
    assert sum(r["turns_regenerated"] for r in got) == 1
    assert {r["epoch"] for r in got} == {1}
