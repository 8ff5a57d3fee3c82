"""Per-engine metrics: completions and losses by engine, with a bounded engine label."""

from __future__ import annotations

from datetime import UTC, datetime

from rolloutlog.controller.domain.events import EngineLost, SiblingCompleted
from rolloutlog.controller.metrics import EventMeta, MetricsProjection

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _completed(group: int, engine: str | None) -> SiblingCompleted:
    return SiblingCompleted(
        group_id=group,
        sibling=0,
        attempt=1,
        weight_version=0,
        prompt_tokens=2,
        completion_tokens=3,
        reward=1.0,
        payload_id=f"p{group}",
        finish_reason="stop",
        engine_id=engine,
    )


def _by_engine(proj: MetricsProjection, name: str) -> dict[str, int]:
    return {row["engine"]: row["value"] for row in proj.values()["counters"][name]}


def test_engine_label_is_bounded_and_counts_completions_and_losses() -> None:
    proj = MetricsProjection(max_engine_labels=2)
    engines = ["e0", "e1", "e2", "e3", "e0", None]
    for offset, engine in enumerate(engines, start=1):
        proj.apply(offset, EventMeta(T0, 0, 0, 1), _completed(offset, engine))
    proj.apply(10, EventMeta(T0, 0, 0, 1), EngineLost(engine_id="e1", reason="killed"))
    proj.apply(11, EventMeta(T0, 0, 0, 1), EngineLost(engine_id="e9", reason="killed"))
    completed = _by_engine(proj, "rollout_engine_siblings_completed_total")
    assert completed == {"e0": 2, "e1": 1, "other": 2}  # e2, e3 past the cap; None uncounted
    assert _by_engine(proj, "rollout_engine_losses_total") == {"e1": 1, "other": 1}
    # A copy keeps the label assignment (a later e2 still counts as other).
    later = proj.copy()
    later.apply(12, EventMeta(T0, 0, 0, 1), _completed(12, "e2"))
    assert _by_engine(later, "rollout_engine_siblings_completed_total")["other"] == 3
    assert _by_engine(later.copy(), "rollout_engine_siblings_completed_total") == {
        "e0": 2,
        "e1": 1,
        "other": 3,
    }


def test_no_engine_no_per_engine_series_beyond_other() -> None:
    proj = MetricsProjection()
    proj.apply(1, EventMeta(T0, 0, 0, 1), _completed(1, None))
    assert _by_engine(proj, "rollout_engine_siblings_completed_total") == {"other": 0}
