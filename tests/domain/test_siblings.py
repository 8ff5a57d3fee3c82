"""Sibling rules of the pure core: dispatch attempts, completion and commit, fencing of
superseded attempts, failure with retry, abort."""

from __future__ import annotations

import json
from dataclasses import fields
from datetime import UTC, datetime

import pytest
from domain_helpers import (
    PureRun,
    abort,
    admit,
    complete,
    dispatch,
    fail,
    finish_step,
    kinds,
    only,
    train,
)

from rolloutlog.controller.backends.base import SiblingResult
from rolloutlog.controller.domain import (
    CODEC,
    AbortSibling,
    CompleteSibling,
    Completion,
    DispatchSiblings,
    FailSibling,
    Phase,
    SiblingStatus,
)
from rolloutlog.controller.domain.errors import (
    IllegalTransitionError,
    StaleAttemptError,
    UnknownGroupError,
)
from rolloutlog.controller.domain.events import SiblingCompleted
from rolloutlog.eventstore import StoredEvent


def _run(**kw: object) -> PureRun:
    kw.setdefault("group_size", 3)
    run = PureRun(**kw)  # type: ignore[arg-type]
    admit(run)
    return run


def test_dispatch_numbers_attempts_per_sibling() -> None:
    run = _run()
    applied = dispatch(run, 0, (0, 2), version=0)
    assert [(e.group_id, e.sibling, e.attempt, e.weight_version) for _, e in applied] == [
        (0, 0, 1, 0),
        (0, 2, 1, 0),
    ]
    g = run.state.groups[0]
    assert [s.status for s in g.siblings] == [
        SiblingStatus.IN_FLIGHT,
        SiblingStatus.PENDING,
        SiblingStatus.IN_FLIGHT,
    ]
    abort(run, 0, 0)
    fail(run, 0, 2, retryable=True)
    applied = dispatch(run, 0, version=0)  # every pending sibling: 0, 1, 2
    assert [(e.sibling, e.attempt) for _, e in applied] == [(0, 2), (1, 1), (2, 2)]
    abort(run, 0, 0)
    assert only(dispatch(run, 0, (0,)), "SiblingDispatched")[0].attempt == 3


def test_completion_commits_the_group_on_its_last_sibling() -> None:
    run = _run(group_size=2, lookahead=1)
    admit(run)  # step 1: groups 3, 4 (2 is the spare)
    finish_step(run, 0, version=0)
    dispatch(run, 3, version=0)  # dispatched before the sync: stays in flight across it
    train(run)  # trainer and generation at version 1
    first = complete(run, 3, 0, version=1, tokens=5)  # a result may carry newer weights
    assert kinds(first) == ["SiblingCompleted"]
    assert run.state.groups[3].phase is Phase.ADMITTED
    last = complete(run, 3, 1, version=0, tokens=7)
    assert kinds(last) == ["SiblingCompleted", "GroupCommitted"]
    commit = only(last, "GroupCommitted")[0]
    assert (commit.group_id, commit.prompt_index, commit.target_step) == (3, 3, 1)
    assert commit.oldest_weight_version == 0
    g = run.state.groups[3]
    assert g.phase is Phase.READY
    assert g.ready_order == run.state.counters.groups_committed == 3
    assert [s.weight_version for s in g.siblings] == [1, 0]
    assert run.state.staleness(g) == 1
    c = run.state.counters
    assert c.siblings_completed == 6
    assert c.tokens_committed == 4 * 4 + 5 + 7


def test_result_of_a_superseded_attempt_is_rejected() -> None:
    run = _run()
    dispatch(run, 0, (0,), version=0)
    abort(run, 0, 0)
    dispatch(run, 0, (0,), version=0)  # attempt 2
    before = run.state.to_snapshot()
    stale = CompleteSibling(Completion(0, 0, 1, 0, 3, 4, 0.5, "late", "stop"))
    with pytest.raises(StaleAttemptError, match="attempt 1 is superseded by attempt 2"):
        run.execute(stale)
    with pytest.raises(StaleAttemptError):
        run.execute(FailSibling(0, 0, 1, True, "late failure"))
    with pytest.raises(StaleAttemptError):
        run.execute(AbortSibling(0, 0, 1, "late abort"))
    assert run.state.to_snapshot() == before
    # The current attempt is accepted.
    assert kinds(complete(run, 0, 0)) == ["SiblingCompleted"]


def test_completing_a_sibling_that_is_not_in_flight_is_illegal() -> None:
    run = _run()
    # Never dispatched (attempt 0, pending).
    with pytest.raises(IllegalTransitionError, match="pending, not in flight") as exc:
        run.execute(CompleteSibling(Completion(0, 1, 0, 0, 3, 4, 0.5, "p", "stop")))
    assert not isinstance(exc.value, StaleAttemptError)
    # Already done: a duplicate delivery of the same attempt is refused, not merged.
    dispatch(run, 0, (1,), version=0)
    complete(run, 0, 1)
    with pytest.raises(IllegalTransitionError, match="done, not in flight"):
        run.execute(CompleteSibling(Completion(0, 1, 1, 0, 3, 4, 0.5, "dup", "stop")))
    # Failed and waiting for a new dispatch.
    dispatch(run, 0, (2,), version=0)
    fail(run, 0, 2, retryable=True)
    with pytest.raises(IllegalTransitionError, match="pending, not in flight"):
        run.execute(CompleteSibling(Completion(0, 2, 1, 0, 3, 4, 0.5, "p", "stop")))
    with pytest.raises(IllegalTransitionError, match=r"siblings 0\.\.2, not 3"):
        run.execute(CompleteSibling(Completion(0, 3, 1, 0, 3, 4, 0.5, "p", "stop")))
    with pytest.raises(UnknownGroupError, match="group 99"):
        run.execute(CompleteSibling(Completion(99, 0, 1, 0, 3, 4, 0.5, "p", "stop")))


def test_completion_version_and_token_rules() -> None:
    run = _run(group_size=2)
    finish_step(run, 0, version=0)
    train(run)
    admit(run)
    step1 = sorted(g.group_id for g in run.state.groups.values() if g.target_step == 1)
    dispatch(run, step1[0], version=1)
    with pytest.raises(IllegalTransitionError, match="dispatched with weight version 1"):
        complete(run, step1[0], 0, version=0)  # older than its dispatch
    with pytest.raises(IllegalTransitionError, match="trainer is at 1"):
        complete(run, step1[0], 0, version=2)  # newer than the trainer
    with pytest.raises(IllegalTransitionError, match="token counts must be positive"):
        complete(run, step1[0], 0, tokens=0)


def test_dispatch_rules() -> None:
    run = _run(group_size=2, spare_pool_size=1)
    with pytest.raises(UnknownGroupError, match="group 42 is not live"):
        run.execute(DispatchSiblings(42, (0,), 0))
    spare = run.state.spares[0]
    with pytest.raises(IllegalTransitionError, match="spare; only admitted groups"):
        run.execute(DispatchSiblings(spare, (0,), 0))
    with pytest.raises(IllegalTransitionError, match="names no siblings"):
        run.execute(DispatchSiblings(0, (), 0))
    with pytest.raises(IllegalTransitionError, match="repeats siblings"):
        run.execute(DispatchSiblings(0, (1, 1), 0))
    with pytest.raises(IllegalTransitionError, match=r"siblings 0\.\.1, not 2"):
        run.execute(DispatchSiblings(0, (2,), 0))
    with pytest.raises(IllegalTransitionError, match="trainer is at 0"):
        run.execute(DispatchSiblings(0, (0,), 1))
    with pytest.raises(IllegalTransitionError, match="trainer is at 0"):
        run.execute(DispatchSiblings(0, (0,), -1))
    dispatch(run, 0, (0,), version=0)
    with pytest.raises(IllegalTransitionError, match="sibling 0 is in_flight"):
        run.execute(DispatchSiblings(0, (0, 1), 0))
    complete(run, 0, 0)
    with pytest.raises(IllegalTransitionError, match="sibling 0 is done"):
        run.execute(DispatchSiblings(0, (0,), 0))  # dispatching a done sibling
    dispatch(run, 0, (1,))
    complete(run, 0, 1)
    assert run.state.groups[0].phase is Phase.READY
    with pytest.raises(IllegalTransitionError, match="group 0 is ready; only admitted"):
        run.execute(DispatchSiblings(0, (0,), 0))


@pytest.mark.parametrize("attempts", [1, 2, 3])
def test_retryable_failures_retry_up_to_attempts_per_sibling(attempts: int) -> None:
    run = _run(group_size=2, attempts_per_sibling=attempts, spare_pool_size=0)
    for n in range(1, attempts):
        dispatch(run, 0, (1,))
        applied = fail(run, 0, 1, retryable=True, reason=f"timeout {n}")
        assert kinds(applied) == ["SiblingFailed"]
        sib = run.state.groups[0].siblings[1]
        assert (sib.status, sib.failures, sib.attempt) == (SiblingStatus.PENDING, n, n)
    dispatch(run, 0, (1,))
    applied = fail(run, 0, 1, retryable=True, reason="timeout last")
    assert kinds(applied)[:2] == ["SiblingFailed", "PromptDropped"]
    dropped = only(applied, "PromptDropped")[0]
    assert (dropped.group_id, dropped.prompt_index, dropped.target_step) == (0, 0, 0)
    assert f"failed {attempts} times (attempts_per_sibling={attempts})" in dropped.reason
    assert "timeout last" in dropped.reason
    assert 0 not in run.state.groups
    assert run.state.counters.prompts_dropped == 1
    assert run.state.counters.siblings_failed == attempts


def test_failures_are_counted_per_sibling() -> None:
    run = _run(group_size=2, attempts_per_sibling=2)
    dispatch(run, 0)
    fail(run, 0, 0, retryable=True)
    fail(run, 0, 1, retryable=True)
    dispatch(run, 0, (0,))
    complete(run, 0, 0)
    dispatch(run, 0, (1,))
    applied = fail(run, 0, 1, retryable=True)  # sibling 1's second failure: dropped
    assert "PromptDropped" in kinds(applied)


def test_non_retryable_failure_drops_the_prompt_at_once() -> None:
    run = _run(group_size=2, attempts_per_sibling=5)
    dispatch(run, 1)
    complete(run, 1, 0)
    applied = fail(run, 1, 1, retryable=False, reason="prompt too long")
    assert kinds(applied)[:2] == ["SiblingFailed", "PromptDropped"]
    dropped = only(applied, "PromptDropped")[0]
    assert dropped.reason == "sibling 1 failed without retry: prompt too long"
    assert dropped.prompt_index == 1
    assert 1 not in run.state.groups


def test_abort_returns_the_sibling_to_pending() -> None:
    run = _run(group_size=2)
    with pytest.raises(IllegalTransitionError, match="pending, not in flight"):
        run.execute(AbortSibling(0, 0, 0, "nothing to abort"))
    dispatch(run, 0, version=0)
    applied = abort(run, 0, 1, reason="shutdown")
    (ev,) = only(applied, "SiblingAborted")
    assert (ev.group_id, ev.sibling, ev.attempt, ev.reason) == (0, 1, 1, "shutdown")
    sib = run.state.groups[0].siblings[1]
    assert (sib.status, sib.attempt, sib.weight_version, sib.failures) == (
        SiblingStatus.PENDING,
        1,
        None,
        0,
    )
    assert run.state.counters.siblings_aborted == 1
    complete(run, 0, 0)
    with pytest.raises(IllegalTransitionError, match="done, not in flight"):
        run.execute(AbortSibling(0, 0, 1, "too late"))


# ---------------------------------------------------------------- one Completion record

_COMPLETION = Completion(
    group_id=3,
    sibling=1,
    attempt=2,
    weight_version=5,
    prompt_tokens=7,
    completion_tokens=11,
    reward=0.75,
    payload_id="e1-g3-s1-a2",
    finish_reason="length",
    engine_id="engine-0",
)

# The stored JSON keys of SiblingCompleted, in order, as every existing log has them.
_STORED_KEYS = [
    "group_id",
    "sibling",
    "attempt",
    "weight_version",
    "prompt_tokens",
    "completion_tokens",
    "reward",
    "payload_id",
    "finish_reason",
    "salvaged_from",
    "engine_id",
]


@pytest.mark.parametrize("salvaged_from", [None, 41])
def test_sibling_completed_of_and_completion_round_trip(salvaged_from: int | None) -> None:
    ev = SiblingCompleted.of(_COMPLETION, salvaged_from=salvaged_from)
    assert ev.completion() == _COMPLETION
    assert ev.salvaged_from == salvaged_from
    # Decoded from its stored row, it is still the same completion.
    row = CODEC.encode(ev, recorded_at=datetime(2026, 1, 1, tzinfo=UTC))
    stored = StoredEvent("run", 1, 1, row.type, row.schema_version, row.payload, row.recorded_at)
    decoded = CODEC.decode(stored)
    assert isinstance(decoded, SiblingCompleted)
    assert decoded == ev and decoded.completion() == _COMPLETION


def test_sibling_completed_built_with_of_stores_the_old_flat_json() -> None:
    """Existing logs must still decode: the event stays flat, key for key."""
    flat = SiblingCompleted(
        group_id=3,
        sibling=1,
        attempt=2,
        weight_version=5,
        prompt_tokens=7,
        completion_tokens=11,
        reward=0.75,
        payload_id="e1-g3-s1-a2",
        finish_reason="length",
        salvaged_from=None,
        engine_id="engine-0",
    )
    now = datetime(2026, 1, 1, tzinfo=UTC)
    via_of = CODEC.encode(SiblingCompleted.of(_COMPLETION), recorded_at=now)
    assert via_of == CODEC.encode(flat, recorded_at=now)
    assert list(json.loads(via_of.payload)) == _STORED_KEYS
    # Completion is exactly the event's fields less salvaged_from (no field forgotten).
    assert [f.name for f in fields(Completion)] == [k for k in _STORED_KEYS if k != "salvaged_from"]


def test_a_row_of_an_older_log_decodes_to_its_completion() -> None:
    """A row written before engines were recorded (no engine_id key) still decodes."""
    payload = (
        '{"group_id":3,"sibling":1,"attempt":2,"weight_version":5,"prompt_tokens":7,'
        '"completion_tokens":11,"reward":0.75,"payload_id":"e1-g3-s1-a2",'
        '"finish_reason":"length","salvaged_from":null}'
    )
    row = StoredEvent("run", 9, 1, "SiblingCompleted", 1, payload, datetime(2026, 1, 1, tzinfo=UTC))
    ev = CODEC.decode(row)
    assert isinstance(ev, SiblingCompleted)
    assert ev.completion() == Completion(3, 1, 2, 5, 7, 11, 0.75, "e1-g3-s1-a2", "length")


def test_complete_sibling_records_its_completion_unchanged() -> None:
    run = _run()
    dispatch(run, 0, (1,), version=0)
    c = Completion(0, 1, 1, 0, 3, 4, 0.5, "p", "stop", engine_id="engine-2")
    (ev,) = only(run.execute(CompleteSibling(c)), "SiblingCompleted")
    assert ev == SiblingCompleted.of(c) and ev.completion() == c


def test_a_backend_result_becomes_a_completion() -> None:
    """The runtime adds what the backend does not know: prompt size, reward, payload."""
    res = SiblingResult(3, 1, 2, 5, (4, 5, 6), (-0.1, -0.2, -0.3), "stop", engine_id="engine-0")
    c = res.completion(prompt_tokens=7, reward=0.75, payload_id="pl")
    assert c == Completion(3, 1, 2, 5, 7, 3, 0.75, "pl", "stop", "engine-0")
