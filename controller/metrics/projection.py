"""Metrics as a projection: one fold over the log's events, live or offline.

The parts, one module each:

- :mod:`~rolloutlog.controller.metrics.catalog`: every exported metric (kind, unit,
  labels, meaning) and the label values the fold uses;
- :mod:`~rolloutlog.controller.metrics.fold`: :class:`MetricsProjection`, the only code
  that turns events into metric values (and :class:`WorkTotals`, the work done by every
  stored event);
- :mod:`~rolloutlog.controller.metrics.histogram`: histogram counts (prometheus-client
  counts observed durations; the fold derives its buckets from exact distributions);
- :mod:`~rolloutlog.controller.metrics.exposition`: the values as metric families and as
  one JSON-friendly dict;
- :mod:`~rolloutlog.controller.metrics.ranges`: :func:`project_history`, the metrics of any
  stored run and offset range.

This module re-exports their public names (``from rolloutlog.controller.metrics.projection
import project_history`` keeps working).
"""

from __future__ import annotations

from .catalog import (
    DROP_OUTCOMES,
    EVENT_TYPES,
    METRICS,
    OTHER_ENGINE,
    STALENESS_BUCKETS,
    MetricInfo,
    MetricKind,
)
from .exposition import Family, Sample
from .fold import (
    EventMeta,
    MetricsProjection,
    RestoreRow,
    StepRow,
    WorkTotals,
    fold_rows,
)
from .histogram import BucketCounts, Histogram
from .ranges import RangeReport, project_history

__all__ = [
    "DROP_OUTCOMES",
    "EVENT_TYPES",
    "METRICS",
    "OTHER_ENGINE",
    "STALENESS_BUCKETS",
    "BucketCounts",
    "EventMeta",
    "Family",
    "Histogram",
    "MetricInfo",
    "MetricKind",
    "MetricsProjection",
    "RangeReport",
    "RestoreRow",
    "Sample",
    "StepRow",
    "WorkTotals",
    "fold_rows",
    "project_history",
]
