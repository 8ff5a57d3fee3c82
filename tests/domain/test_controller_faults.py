"""The controller's state never runs ahead of its log (issue 9, items 5 and 11).

A failed append or a failed apply marks the controller failed: every later command
raises :class:`ControllerFailedError` (chained to the original error), nothing of a
half-applied command reaches the log, and listeners (live metrics) only ever see events
that became durable. A completion naming a payload that is not stored is refused before
anything is decided into the log.
"""

from __future__ import annotations

from typing import Any

import pytest
from domain_helpers import admit, admit_all, dispatch, finish_group, rules, start, step_groups

from rolloutlog.controller import rollout_controller as rollout_module
from rolloutlog.controller.domain import AdmitStep, CompleteSibling, Completion, SelectBatch
from rolloutlog.controller.domain.errors import UnknownPayloadError
from rolloutlog.controller.metrics.live import LiveMetrics
from rolloutlog.controller.rollout_controller import ControllerFailedError, RolloutController
from rolloutlog.eventstore import (
    EventStore,
    GroupCommitClosedError,
    MemoryEventStore,
    PayloadPut,
    StoreError,
)


class FailingAppends:
    """A store whose ``append`` raises from the ``fail_at``-th call on (1-based)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.appends = 0

    def append(self, *args: Any, **kwargs: Any) -> int:
        self.appends += 1
        if self.appends >= self.fail_at:
            raise StoreError(f"injected write failure (append #{self.appends})")
        return self.inner.append(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _completion(ctl: RolloutController, gid: int, sibling: int, payload_id: str) -> CompleteSibling:
    s = ctl.state.groups[gid].siblings[sibling]
    return CompleteSibling(
        Completion(gid, sibling, s.attempt, s.weight_version or 0, 3, 4, 0.5, payload_id, "stop")
    )


def test_a_failed_append_fails_the_controller_and_metrics_never_count_it() -> None:
    inner = MemoryEventStore()
    start(inner, rules()).close()
    store = FailingAppends(inner, fail_at=2)
    ctl = RolloutController.open(store, "run")  # append #1: RunResumed
    live = LiveMetrics()
    live.attach(ctl)
    durable = inner.last_seq("run")
    admit(ctl)  # applied live, but its append (#2) fails
    with pytest.raises(GroupCommitClosedError) as first:
        ctl.flush()
    original = first.value.__cause__
    assert isinstance(original, StoreError) and "injected write failure" in str(original)
    assert inner.last_seq("run") == durable
    # The live projection counts only what the log holds.
    assert live.projection.offset == durable
    assert live.projection.values() == _offline_values(inner)
    # Every later command raises, typed and chained to the original error.
    with pytest.raises(ControllerFailedError, match="failed earlier") as later:
        ctl.execute(AdmitStep())
    assert isinstance(later.value, GroupCommitClosedError)
    assert later.value.__cause__ is ctl.failure
    cause: BaseException | None = later.value
    while cause is not None and cause is not original:
        cause = cause.__cause__
    assert cause is original
    with pytest.raises(ControllerFailedError):
        ctl.checkpoint(0)
    assert live.projection.offset == durable
    live.detach()
    ctl.close()
    # The log still opens where it stood.
    again = RolloutController.open(inner, "run")
    assert again.state.last_seq == durable + 1  # its own RunResumed
    again.close()


def _offline_values(store: Any) -> dict[str, Any]:
    from rolloutlog.controller.metrics.projection import project_history

    return project_history(store, "run").values()  # type: ignore[no-any-return]


def test_an_evolve_error_part_way_through_a_command_queues_nothing(
    monkeypatch: pytest.MonkeyPatch, sqlite_store: EventStore
) -> None:
    ctl = start(sqlite_store, rules(group_size=2, groups_per_step=2))
    ctl.flush()
    before = sqlite_store.last_seq("run")
    real = rollout_module.evolve
    calls = {"n": 0}

    def flaky(state: Any, event: Any, seq: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second event of AdmitStep (after StepAdmitted)
            raise RuntimeError("injected evolve failure")
        real(state, event, seq)

    monkeypatch.setattr(rollout_module, "evolve", flaky)
    with pytest.raises(RuntimeError, match="injected evolve failure"):
        ctl.execute(AdmitStep())
    monkeypatch.setattr(rollout_module, "evolve", real)
    with pytest.raises(ControllerFailedError) as later:
        ctl.execute(AdmitStep())
    assert isinstance(later.value.__cause__, RuntimeError)
    ctl.close()
    # Nothing of the half-applied command was queued: the log ends where it was.
    assert sqlite_store.last_seq("run") == before
    reopened = RolloutController.open(sqlite_store, "run")
    assert reopened.state.dispatch_cursor == 0  # no step was admitted
    reopened.close()


def test_a_completion_with_an_unknown_payload_is_refused_at_execute(
    sqlite_store: EventStore,
) -> None:
    ctl = start(sqlite_store, rules(group_size=2, groups_per_step=1, lookahead=0))
    admit_all(ctl)
    (gid,) = step_groups(ctl, 0)
    dispatch(ctl, gid)
    ctl.flush()
    before = (sqlite_store.last_seq("run"), ctl.state.to_snapshot())
    with pytest.raises(UnknownPayloadError, match="payload 'never-stored' is not stored"):
        ctl.execute(_completion(ctl, gid, 0, "never-stored"))
    ctl.flush()
    assert (sqlite_store.last_seq("run"), ctl.state.to_snapshot()) == before
    # The controller goes on: a refusal is not a failure.
    put = PayloadPut("p0", "sibling", b"tokens")
    ctl.execute(_completion(ctl, gid, 0, "p0"), payload_puts=(put,))
    # A payload stored with an earlier command (durable or not yet) may be named again.
    ctl.execute(_completion(ctl, gid, 1, "p0"))
    assert ctl.failure is None
    ctl.execute(SelectBatch(0))
    ctl.close()


def test_a_finished_group_still_trains_after_a_refused_completion(
    sqlite_store: EventStore,
) -> None:
    """Regression guard: the refusal happens before anything is queued, so the run's
    batches only ever name stored payloads."""
    ctl = start(sqlite_store, rules(group_size=1, groups_per_step=1, lookahead=0))
    admit_all(ctl)
    (gid,) = step_groups(ctl, 0)
    dispatch(ctl, gid)
    with pytest.raises(UnknownPayloadError):
        ctl.execute(_completion(ctl, gid, 0, "missing"))
    finish_group(ctl, gid)
    ctl.execute(SelectBatch(0))
    ctl.flush()
    for group in ctl.state.groups.values():
        for sib in group.siblings:
            if sib.payload_id is not None:
                assert sqlite_store.get_payload("run", sib.payload_id)
    ctl.close()
