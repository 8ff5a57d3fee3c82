"""How the replay tool groups a history into decisions (the unit verify_decisions re-decides)."""

from __future__ import annotations

from types import SimpleNamespace

from rolloutlog.controller.domain.events import SiblingAborted, WeightsPublished
from rolloutlog.controller.replay_tool import split_decisions


def _split(events: list) -> list[list[str]]:
    pairs = [(SimpleNamespace(seq=i + 1), e) for i, e in enumerate(events)]
    return [
        [f"{type(e).__name__}:{getattr(e, 'reason', '')}" for e in d.events]
        for d in split_decisions(pairs)
    ]  # type: ignore[arg-type]


def test_a_publish_keeps_the_stale_aborts_it_decided() -> None:
    stale = SiblingAborted(
        group_id=1,
        sibling=0,
        attempt=1,
        reason="stale weights: dispatched with version 0, trainer at 2",
    )
    assert _split([WeightsPublished(weight_version=2), stale]) == [
        ["WeightsPublished:", f"SiblingAborted:{stale.reason}"]
    ]


def test_an_abort_for_another_reason_right_after_a_publish_is_its_own_decision() -> None:
    """The runtime closing just after a publish: its aborts are AbortSibling commands, not
    part of the publish (verify_decisions once re-decided them as the publish's: a mismatch
    on a sound log, seen in the multi-turn SIGKILL test)."""
    closed = SiblingAborted(group_id=1, sibling=0, attempt=1, reason="the runtime was closed")
    closed2 = SiblingAborted(group_id=1, sibling=1, attempt=1, reason="the runtime was closed")
    assert _split([WeightsPublished(weight_version=2), closed, closed2]) == [
        ["WeightsPublished:"],
        ["SiblingAborted:the runtime was closed"],
        ["SiblingAborted:the runtime was closed"],
    ]
