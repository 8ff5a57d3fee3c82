"""The exposition format: the fold's values as metric families (what the exporter
renders with prometheus-client) and as one JSON-friendly dict (``rolloutlog metrics``,
``project_history(...).values()``).

A :class:`Family` holds every :class:`Sample` of one metric name; a sample's value is a
number or, for a histogram, a :class:`~rolloutlog.controller.metrics.histogram.BucketCounts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .catalog import (
    METRICS,
    PLAIN_COUNTERS,
    STALENESS_BUCKETS,
    TOOL_SECONDS_BUCKETS,
    TURN_BUCKETS,
    MetricInfo,
)
from .histogram import BucketCounts

if TYPE_CHECKING:
    from .fold import MetricsProjection, WorkTotals


@dataclass(frozen=True, slots=True)
class Sample:
    """One exported value: its labels and a number (or a histogram's counts)."""

    labels: Mapping[str, str]
    value: float | BucketCounts


@dataclass(frozen=True, slots=True)
class Family:
    """All samples of one metric name."""

    name: str
    info: MetricInfo
    samples: tuple[Sample, ...]


def counter_families(
    src: MetricsProjection | WorkTotals, base: MetricsProjection | WorkTotals | None
) -> list[Family]:
    """The counter and histogram families of ``src`` (minus ``base``, an earlier copy)."""

    def labelled(name: str, attr: str) -> Family:
        info = METRICS[name]
        mine: Mapping[Any, int] = getattr(src, attr)
        theirs: Mapping[Any, int] | None = getattr(base, attr) if base is not None else None
        samples = []
        for key, value in sorted(mine.items()):
            parts = key if isinstance(key, tuple) else (key,)
            before = theirs.get(key, 0) if theirs is not None else 0
            samples.append(Sample(dict(zip(info.labels, parts, strict=True)), value - before))
        return Family(name, info, tuple(samples))

    out: list[Family] = []
    for name, key in PLAIN_COUNTERS.items():
        value = src.counts[key] - (base.counts[key] if base is not None else 0)
        out.append(Family(name, METRICS[name], (Sample({}, value),)))
    out.append(labelled("rollout_siblings_failed_total", "failed"))
    out.append(labelled("rollout_groups_evicted_total", "evicted"))
    out.append(labelled("rollout_prompts_dropped_total", "dropped"))
    out.append(labelled("rollout_recovery_groups_total", "recovery_groups"))
    out.append(labelled("rollout_recovery_siblings_total", "recovery_siblings"))
    out.append(labelled("rollout_events_total", "events_by_type"))
    out.append(labelled("rollout_engine_siblings_completed_total", "engine_completed"))
    out.append(labelled("rollout_engine_losses_total", "engine_lost"))
    base_values = base.staleness_values if base is not None else {}
    staleness = BucketCounts.of_values(
        {k: v - base_values.get(k, 0) for k, v in src.staleness_values.items()},
        STALENESS_BUCKETS,
    )
    out.append(
        Family(
            "rollout_selected_group_staleness",
            METRICS["rollout_selected_group_staleness"],
            (Sample({}, staleness),),
        )
    )
    out.append(labelled("rollout_tool_failures_total", "tool_failures"))
    base_turns = base.trajectory_turns if base is not None else {}
    turns = BucketCounts.of_values(
        {k: v - base_turns.get(k, 0) for k, v in src.trajectory_turns.items()}, TURN_BUCKETS
    )
    out.append(
        Family(
            "rollout_trajectory_turns", METRICS["rollout_trajectory_turns"], (Sample({}, turns),)
        )
    )
    base_tool = base.tool_seconds if base is not None else {}
    tool = {k: v - base_tool.get(k, 0) for k, v in src.tool_seconds.items()}
    counts = tuple(tool.get(i, 0) for i in range(len(TOOL_SECONDS_BUCKETS) + 1))
    seconds = BucketCounts(TOOL_SECONDS_BUCKETS, counts, tool.get(-1, 0) / 1e6, sum(counts))
    out.append(
        Family(
            "rollout_tool_call_seconds",
            METRICS["rollout_tool_call_seconds"],
            (Sample({}, seconds),),
        )
    )
    return out


def counter_values(families: list[Family]) -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON-friendly counters and histogram summaries of ``families``."""
    counters: dict[str, Any] = {}
    histograms: dict[str, Any] = {}
    for fam in families:
        if fam.info.kind == "counter":
            if fam.info.labels:
                counters[fam.name] = [{**s.labels, "value": s.value} for s in fam.samples]
            else:
                counters[fam.name] = fam.samples[0].value
        elif fam.info.kind == "histogram":
            hist = fam.samples[0].value
            assert isinstance(hist, BucketCounts)
            histograms[fam.name] = hist.summary()
    return counters, histograms


def projection_families(
    proj: MetricsProjection,
    since: MetricsProjection | None,
    work: WorkTotals | None,
    work_since: WorkTotals | None,
) -> list[Family]:
    """See :meth:`MetricsProjection.families`."""
    out = counter_families(work, work_since) if work is not None else counter_families(proj, since)
    for name, value in proj.gauges().items():
        if value is not None:
            out.append(Family(name, METRICS[name], (Sample({}, float(value)),)))
    for name, history_value in proj.history_gauges().items():
        out.append(Family(name, METRICS[name], (Sample({}, history_value),)))
    return out


def projection_values(
    proj: MetricsProjection,
    since: MetricsProjection | None,
    work: WorkTotals | None,
    work_since: WorkTotals | None,
) -> dict[str, Any]:
    """See :meth:`MetricsProjection.values`."""
    source: MetricsProjection | WorkTotals = proj if work is None else work
    source_base = since if work is None else work_since
    counters, histograms = counter_values(counter_families(source, source_base))
    history_counters, _ = counter_values(counter_families(proj, since))
    base_values = source_base.staleness_values if source_base is not None else {}
    histograms["rollout_selected_group_staleness"]["values"] = {
        str(k): v - base_values.get(k, 0) for k, v in sorted(source.staleness_values.items())
    }
    after = since.offset if since is not None else 0
    steps = [r for r in proj.steps if r.offset > after]
    restores = [r for r in proj.restores if r.offset > after]
    first = since.last_meta if since is not None and since.last_meta else None
    start = first.recorded_at if first is not None else proj.started_at
    end = proj.last_meta.recorded_at if proj.last_meta is not None else None
    span = (end - start).total_seconds() if start is not None and end is not None else 0.0

    def rate(name: str) -> float | None:
        value = counters[name]
        return value / span if span > 0 else None

    meta = proj.last_meta
    return {
        "run_id": proj.run_id,
        "from_offset": after + 1,
        "offset": proj.offset,
        "history": [list(s) for s in proj.applied_segments],
        "started_at": proj.started_at.isoformat() if proj.started_at else None,
        "last_event": (
            {
                "offset": proj.offset,
                "time": meta.recorded_at.isoformat(),
                "train_step": meta.train_step,
                "weight_version": meta.weight_version,
                "epoch": meta.epoch,
            }
            if meta is not None
            else None
        ),
        "last_checkpoint": (
            {"offset": proj.last_checkpoint[0], "time": proj.last_checkpoint[1].isoformat()}
            if proj.last_checkpoint is not None
            else None
        ),
        "wall_seconds": span,
        "counters": counters,
        "history_counters": history_counters,
        "gauges": {**proj.gauges(), **proj.history_gauges()},
        "histograms": histograms,
        "rates": {
            "groups_committed_per_second": rate("rollout_groups_committed_total"),
            "groups_trained_per_second": rate("rollout_groups_trained_total"),
            "tokens_generated_per_second": rate("rollout_tokens_generated_total"),
            "tokens_committed_per_second": rate("rollout_tokens_committed_total"),
        },
        "steps": [r.to_dict() for r in steps],
        "restores": [r.to_dict() for r in restores],
    }
