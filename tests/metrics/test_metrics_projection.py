"""The metrics fold on hand-built event sequences: what each metric counts, and when."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.domain.events import (
    BatchSelected,
    CheckpointMarked,
    GroupAdmitted,
    GroupBorrowed,
    GroupCommitted,
    GroupEvicted,
    GroupSelected,
    PromptDropped,
    RolloutEvent,
    RunRestored,
    RunResumed,
    RunStarted,
    SiblingAborted,
    SiblingCompleted,
    SiblingDispatched,
    SiblingFailed,
    SpareAssigned,
    SparePulled,
    StepAdmitted,
    StepTrained,
    WeightsPublished,
)
from rolloutlog.controller.metrics import (
    METRICS,
    BucketCounts,
    EventMeta,
    Histogram,
    MetricsProjection,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)


class Feeder:
    """Applies events at consecutive offsets, one second apart, in epoch ``epoch``."""

    def __init__(self, proj: MetricsProjection | None = None) -> None:
        self.proj = proj or MetricsProjection()
        self.offset = 0
        self.epoch = 1

    def __call__(self, *events: RolloutEvent) -> int:
        for ev in events:
            self.offset += 1
            meta = EventMeta(
                T0 + timedelta(seconds=self.offset),
                self.proj.train_step,
                self.proj.weight_version,
                self.epoch,
            )
            self.proj.apply(self.offset, meta, ev)
        return self.offset


def start(feed: Feeder, *, group_size: int = 2, bound: int = 1) -> None:
    rules = RolloutConfig(group_size=group_size, groups_per_step=2, staleness_bound=bound)
    feed(
        RunStarted(
            run_id="r",
            rollout=rules.model_dump(),
            config_fingerprint="f",
            dataset_fingerprint="d",
            dataset_size=100,
        )
    )


def complete(gid: int, sib: int, tokens: int, reward: float = 0.5, attempt: int = 1) -> list:
    return [
        SiblingDispatched(group_id=gid, sibling=sib, attempt=attempt, weight_version=0),
        SiblingCompleted(
            group_id=gid,
            sibling=sib,
            attempt=attempt,
            weight_version=0,
            prompt_tokens=3,
            completion_tokens=tokens,
            reward=reward,
            payload_id=f"p{gid}-{sib}",
            finish_reason="stop",
        ),
    ]


def counter(proj: MetricsProjection, name: str, **labels: str) -> float:
    for fam in proj.families():
        if fam.name == name:
            for s in fam.samples:
                if dict(s.labels) == labels:
                    assert not isinstance(s.value, BucketCounts)
                    return s.value
    raise AssertionError(f"no sample {name}{labels}")


def test_generated_and_committed_tokens_are_distinct() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=2))
    feed(GroupAdmitted(group_id=0, prompt_index=0, target_step=0))
    feed(GroupAdmitted(group_id=1, prompt_index=1, target_step=0))
    feed(*complete(0, 0, 5), *complete(0, 1, 7))
    feed(GroupCommitted(group_id=0, prompt_index=0, target_step=0, oldest_weight_version=0))
    # Group 1: one sibling finishes (3 tokens), the other fails for good: dropped.
    feed(*complete(1, 0, 3))
    feed(SiblingDispatched(group_id=1, sibling=1, attempt=1, weight_version=0))
    assert feed.proj.gauges()["rollout_siblings_in_flight"] == 1
    feed(SiblingFailed(group_id=1, sibling=1, attempt=1, retryable=False, reason="x"))
    feed(PromptDropped(group_id=1, prompt_index=1, target_step=0, reason="x", outcome="shrunk"))
    p = feed.proj
    assert counter(p, "rollout_tokens_generated_total") == 15
    assert counter(p, "rollout_tokens_committed_total") == 12
    assert counter(p, "rollout_groups_committed_total") == 1
    assert counter(p, "rollout_siblings_failed_total", retryable="false") == 1
    assert counter(p, "rollout_prompts_dropped_total", outcome="shrunk") == 1
    assert counter(p, "rollout_prompts_dropped_total", outcome="replaced") == 0
    gauges = p.gauges()
    assert gauges["rollout_siblings_in_flight"] == 0
    assert gauges["rollout_buffer_groups"] == 1
    assert gauges["rollout_groups_generating"] == 0


def test_selection_training_and_the_step_series() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=2))
    for gid in (0, 1):
        feed(GroupAdmitted(group_id=gid, prompt_index=gid, target_step=0))
        feed(*complete(gid, 0, 4, reward=gid * 1.0), *complete(gid, 1, 4, reward=0.5))
        feed(GroupCommitted(group_id=gid, prompt_index=gid, target_step=0, oldest_weight_version=0))
    feed(GroupSelected(group_id=0, prompt_index=0, target_step=0, train_step=0, staleness=0))
    feed(GroupSelected(group_id=1, prompt_index=1, target_step=0, train_step=0, staleness=3))
    feed(BatchSelected(train_step=0, group_ids=[0, 1], shortfall=0))
    assert feed.proj.gauges()["rollout_buffer_groups"] == 0
    at = feed(StepTrained(train_step=0, weight_version=1))
    feed(WeightsPublished(weight_version=1))
    p = feed.proj
    assert counter(p, "rollout_groups_selected_total") == 2
    assert counter(p, "rollout_groups_trained_total") == 2
    assert p.gauges()["rollout_train_step"] == 1
    assert p.gauges()["rollout_weight_version"] == 1
    assert p.gauges()["rollout_published_weight_version"] == 1
    (row,) = p.steps
    assert row.step == 0 and row.offset == at and row.groups == 2
    assert row.reward_mean == pytest.approx((0.0 + 0.5 + 1.0 + 0.5) / 4)
    assert row.staleness_max == 3 and row.staleness_mean == 1.5
    assert row.tokens_committed == 16
    assert row.time == T0 + timedelta(seconds=at)
    assert row.wall_seconds == at - 1  # since RunStarted at offset 1
    hist = p.values()["histograms"]["rollout_selected_group_staleness"]
    assert hist["values"] == {"0": 1, "3": 1}
    assert hist["buckets"]["0"] == 1 and hist["buckets"]["2"] == 1 and hist["buckets"]["3"] == 2
    assert hist["count"] == 2 and hist["sum"] == 3


def test_evictions_by_reason_and_recovered() -> None:
    feed = Feeder()
    start(feed, bound=1)
    feed(StepAdmitted(target_step=0, group_count=2))
    for gid in range(3):
        feed(GroupAdmitted(group_id=gid, prompt_index=gid, target_step=0))
    feed(
        GroupEvicted(
            group_id=0, prompt_index=0, target_step=0, reason="stale: staleness 2 > bound 1",
            staleness=2, recovered=False, outcome="replaced",
        ),
        GroupEvicted(
            group_id=1, prompt_index=1, target_step=0, reason="recovered group stale",
            staleness=3, recovered=True, outcome="unreplaced",
        ),
        GroupEvicted(
            group_id=2, prompt_index=2, target_step=None, reason="its step is gone",
            staleness=0, recovered=False, outcome="unreplaced",
        ),
    )  # fmt: skip
    p = feed.proj
    assert counter(p, "rollout_groups_evicted_total", reason="stale", recovered="false") == 1
    assert counter(p, "rollout_groups_evicted_total", reason="stale", recovered="true") == 1
    assert counter(p, "rollout_groups_evicted_total", reason="other", recovered="false") == 1
    assert counter(p, "rollout_groups_evicted_total", reason="other", recovered="true") == 0
    assert p.gauges()["rollout_groups_generating"] == 0


def test_spares_replacements_and_borrows() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=1))
    feed(GroupAdmitted(group_id=0, prompt_index=0, target_step=0))
    feed(SparePulled(group_id=1, prompt_index=1), SparePulled(group_id=2, prompt_index=2))
    assert feed.proj.gauges()["rollout_spare_groups"] == 2
    feed(
        SpareAssigned(group_id=1, prompt_index=1, target_step=0, replaces_group_id=0),
        GroupBorrowed(group_id=5, prompt_index=5, from_step=2, to_step=0),
        SpareAssigned(group_id=2, prompt_index=2, target_step=2, repays_group_id=5),
    )
    p = feed.proj
    assert counter(p, "rollout_replacements_total") == 1  # a repayment is not a replacement
    assert counter(p, "rollout_borrows_total") == 1
    assert counter(p, "rollout_prompts_pulled_total") == 3
    assert p.gauges()["rollout_spare_groups"] == 0


def test_restore_counts_and_resets_in_flight() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=2))
    feed(GroupAdmitted(group_id=0, prompt_index=0, target_step=0))
    feed(GroupAdmitted(group_id=1, prompt_index=1, target_step=0))
    feed(*complete(0, 0, 5))
    feed(SiblingDispatched(group_id=0, sibling=1, attempt=1, weight_version=0))
    feed(SiblingDispatched(group_id=1, sibling=0, attempt=1, weight_version=0))
    ckpt = feed(
        CheckpointMarked(train_step=0, weight_version=0, dispatch_cursor=1, dataset_cursor=2)
    )
    assert feed.proj.gauges()["rollout_siblings_in_flight"] == 2
    feed.epoch = 2
    feed(
        RunRestored(
            from_offset=ckpt, epoch=2, mode="salvage", granularity="sibling", forced=False,
            checkpoint_train_step=0, checkpoint_weight_version=0, complete_groups_restored=0,
            unfinished_groups_found=2, siblings_reused=1, siblings_rerun=2, siblings_salvaged=1,
        )
    )  # fmt: skip
    p = feed.proj
    assert p.gauges()["rollout_siblings_in_flight"] == 0
    assert p.gauges()["rollout_epoch"] == 2
    assert counter(p, "rollout_restores_total") == 1
    assert counter(p, "rollout_checkpoints_total") == 1
    assert counter(p, "rollout_recovery_groups_total", kind="unfinished") == 2
    assert counter(p, "rollout_recovery_groups_total", kind="complete") == 0
    assert counter(p, "rollout_recovery_siblings_total", kind="reused") == 1
    assert counter(p, "rollout_recovery_siblings_total", kind="rerun") == 2
    assert counter(p, "rollout_recovery_siblings_total", kind="salvaged") == 1
    (row,) = p.restores
    assert row.from_offset == ckpt and row.rolled_back_seconds == 1.0
    # The finished sibling of group 0 still counts when the group commits.
    feed(*complete(0, 1, 2, attempt=2))
    feed(GroupCommitted(group_id=0, prompt_index=0, target_step=0, oldest_weight_version=0))
    assert counter(p, "rollout_tokens_committed_total") == 7
    feed.epoch = 3
    feed(SiblingDispatched(group_id=1, sibling=0, attempt=2, weight_version=0))
    feed(RunResumed(epoch=3, siblings_rerun=1))
    assert p.gauges()["rollout_siblings_in_flight"] == 0
    assert counter(p, "rollout_resumes_total") == 1


def test_group_granularity_restore_forgets_finished_siblings() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=1))
    feed(GroupAdmitted(group_id=0, prompt_index=0, target_step=0))
    feed(*complete(0, 0, 5))
    feed.epoch = 2
    feed(
        RunRestored(
            from_offset=1, epoch=2, mode="strict", granularity="group", forced=True,
            checkpoint_train_step=0, checkpoint_weight_version=0, complete_groups_restored=0,
            unfinished_groups_found=1, siblings_reused=0, siblings_rerun=2, siblings_salvaged=0,
        )
    )  # fmt: skip
    feed(*complete(0, 0, 1, attempt=2), *complete(0, 1, 1, attempt=2))
    feed(GroupCommitted(group_id=0, prompt_index=0, target_step=0, oldest_weight_version=0))
    assert counter(feed.proj, "rollout_tokens_generated_total") == 7
    assert counter(feed.proj, "rollout_tokens_committed_total") == 2


def test_events_by_type_and_abort() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=1))
    feed(GroupAdmitted(group_id=0, prompt_index=0, target_step=0))
    feed(SiblingDispatched(group_id=0, sibling=0, attempt=1, weight_version=0))
    feed(SiblingAborted(group_id=0, sibling=0, attempt=1, reason="stale weights"))
    p = feed.proj
    assert counter(p, "rollout_siblings_aborted_total") == 1
    assert counter(p, "rollout_events_total", type="SiblingAborted") == 1
    assert counter(p, "rollout_events_total", type="RunStarted") == 1
    assert sum(s["value"] for s in p.values()["counters"]["rollout_events_total"]) == feed.offset


def test_every_event_type_is_exported_at_zero_before_its_first_event() -> None:
    """A counter series that first appears at 1 is never counted by Prometheus's
    ``increase()`` (issue 31.9: RunRestored 0 of 1): every type is there from the start,
    also on a projection read back from a snapshot written without some types."""
    from rolloutlog.controller.domain.events import CODEC
    from rolloutlog.controller.metrics.fold import WorkTotals

    fresh = MetricsProjection()
    assert counter(fresh, "rollout_events_total", type="RunRestored") == 0
    assert counter(fresh, "rollout_events_total", type="SiblingAborted") == 0
    types = {s.labels["type"] for f in fresh.families() if f.name == "rollout_events_total"
             for s in f.samples}  # fmt: skip
    assert types == set(CODEC.types)
    data = WorkTotals().to_snapshot()
    data["events_by_type"] = [["RunStarted", 1]]  # an older snapshot: seen types only
    back = WorkTotals.from_snapshot(data)
    assert back.events_by_type["RunRestored"] == 0 and back.events_by_type["RunStarted"] == 1


def test_a_snapshot_in_the_older_layout_reads_back_to_the_same_values() -> None:
    """Snapshots (metrics bases) hold no ``staleness`` histogram: it is derived from
    ``staleness_values`` when read, which every snapshot layout holds. One in the older
    layout (its histogram with the buckets of the time, no multi-turn counters) reads back
    to the values of the current one (issue 32)."""
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=2))
    for gid in (0, 1):
        feed(GroupAdmitted(group_id=gid, prompt_index=gid, target_step=0))
        feed(*complete(gid, 0, 4), *complete(gid, 1, 4))
        feed(GroupCommitted(group_id=gid, prompt_index=gid, target_step=0, oldest_weight_version=0))
        feed(GroupSelected(group_id=gid, prompt_index=gid, target_step=0, train_step=0,
                           staleness=3 * gid))  # fmt: skip
    p = feed.proj
    assert p.state is not None
    data = p.to_snapshot()
    assert "staleness" not in data and data["staleness_values"] == [[0, 1], [3, 1]]
    multi_turn = ("trajectory_turns", "tool_seconds", "tool_failures")
    old = {k: v for k, v in data.items() if k not in multi_turn}
    old["staleness"] = {"buckets": [0, 1, 2, 4, 8], "counts": [1, 0, 0, 1, 0], "total": 3,
                        "count": 2, "min": 0, "max": 3}  # fmt: skip
    back = MetricsProjection.from_snapshot(old, p.state)
    assert back.values() == p.values()
    hist = back.values()["histograms"]["rollout_selected_group_staleness"]
    assert hist["values"] == {"0": 1, "3": 1} and hist["count"] == 2 and hist["sum"] == 3


def test_offsets_must_increase_and_history_segments_are_tracked() -> None:
    feed = Feeder()
    start(feed)
    with pytest.raises(ValueError, match="after offset 1"):
        feed.proj.apply(1, EventMeta(T0, 0, 0, 1), StepAdmitted(target_step=0, group_count=1))
    feed.proj.apply(10, EventMeta(T0, 0, 0, 2), StepAdmitted(target_step=0, group_count=1))
    feed.proj.apply(11, EventMeta(T0, 0, 0, 2), WeightsPublished(weight_version=0))
    assert feed.proj.applied_segments == [(1, 1), (10, 11)]
    assert feed.proj.consistent_with([(1, 1), (10, 20)])
    assert not feed.proj.consistent_with([(1, 1), (12, 20)])
    assert not feed.proj.consistent_with([(1, 11)])


def test_values_since_counts_only_the_range() -> None:
    feed = Feeder()
    start(feed)
    feed(StepAdmitted(target_step=0, group_count=1))
    feed(GroupAdmitted(group_id=0, prompt_index=0, target_step=0))
    feed(*complete(0, 0, 5))
    base = feed.proj.copy()
    feed(*complete(0, 1, 6))
    feed(GroupCommitted(group_id=0, prompt_index=0, target_step=0, oldest_weight_version=0))
    ranged = feed.proj.values(since=base)
    whole = feed.proj.values()
    assert ranged["counters"]["rollout_tokens_generated_total"] == 6
    assert whole["counters"]["rollout_tokens_generated_total"] == 11
    assert ranged["counters"]["rollout_tokens_committed_total"] == 11
    assert ranged["gauges"] == whole["gauges"]
    assert ranged["from_offset"] == base.offset + 1
    # The copy is independent of what came after it.
    assert base.values()["counters"]["rollout_tokens_generated_total"] == 5


def test_histogram_buckets() -> None:
    h = Histogram((0, 1, 2.5))
    for v in (0, 0, 1, 2, 7):
        h.observe(v)
    assert h.cumulative() == [("0", 2), ("1", 3), ("2.5", 4), ("+Inf", 5)]
    counts = h.copy()
    assert (counts.count, counts.total, counts.min, counts.max) == (5, 10, 0, 7)
    with pytest.raises(ValueError):
        Histogram((1, 1))
    # The fold's histograms come from exact distributions (value -> occurrences).
    exact = BucketCounts.of_values({0: 2, 1: 1, 2: 1, 7: 1}, (0, 1, 2.5))
    assert exact == BucketCounts((0, 1, 2.5), (2, 1, 1, 1), 10, 5, 0, 7)


def test_metric_names_are_user_vocabulary() -> None:
    for name, info in METRICS.items():
        assert name.startswith("rollout_")
        assert "canonical" not in name
        if info.kind == "counter":
            assert name.endswith("_total"), name
        if info.unit == "seconds":
            assert name.endswith("_seconds"), name


def test_every_metric_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name, info in METRICS.items():
        assert f"`{name}" in doc, f"{name} is missing from docs/metrics.md"
        for label in info.labels:
            assert label in doc
    assert "telemetry:" in doc and "enabled: true" in doc
    assert "rolloutlog metrics" in doc and "rolloutlog serve-metrics" in doc


def test_has_step_sinks_follows_add_and_close_of_the_step_sinks() -> None:
    """``LiveMetrics.has_step_sinks``: False until a per-step sink is added, True while
    one is attached, False again once :meth:`close_step_sinks` closed them."""
    from rolloutlog.controller.metrics.live import LiveMetrics

    class Sink:
        closed = False

        def write_step(self, step: int, scalars: Any, wall_time: float) -> None:
            pass

        def purge(self, from_step: int) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    live = LiveMetrics()
    assert not live.has_step_sinks
    sink = Sink()
    live.add_step_sink(sink)
    assert live.has_step_sinks and not sink.closed
    live.close_step_sinks()
    assert not live.has_step_sinks and sink.closed
