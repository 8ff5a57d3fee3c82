"""Metrics as projections of the log: one fold, served live or recomputed offline.

- :class:`MetricsProjection` (``fold``): the fold over events; the only code that turns
  events into metric values, named by the catalog (``catalog``: :data:`METRICS`) and
  rendered by ``exposition``. :func:`project_history` (``ranges``) recomputes it for any
  stored run and offset range. ``projection`` re-exports these.
- :class:`LiveMetrics` / :class:`LogTailer` (``live``): keep a projection current beside
  a controller (listener) or by polling the log; both roll back when a restore changes
  the history.
- :func:`start_exporter` (``exporter``): serve any of them to Prometheus.
- :func:`compact_with_metrics` / :func:`load_metrics_base` (``retention``): the metrics
  base a compaction saves, where every reader of a compacted run starts.

See ``docs/metrics.md`` for every metric's meaning, unit and caveats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .live import (
    EmbeddedTelemetry,
    LiveMetrics,
    LiveTimings,
    LogTailer,
    ProjectionFollower,
    RunsTailer,
    start_embedded_telemetry,
)
from .projection import (
    EVENT_TYPES,
    METRICS,
    BucketCounts,
    EventMeta,
    Family,
    Histogram,
    MetricInfo,
    MetricsProjection,
    RangeReport,
    RestoreRow,
    Sample,
    StepRow,
    WorkTotals,
    fold_rows,
    project_history,
)
from .retention import (
    MetricsBase,
    compact_with_metrics,
    load_metrics_base,
    save_metrics_base,
)

if TYPE_CHECKING:
    from .exporter import ExporterHandle, start_exporter

__all__ = [
    "EVENT_TYPES",
    "METRICS",
    "BucketCounts",
    "EmbeddedTelemetry",
    "EventMeta",
    "ExporterHandle",
    "Family",
    "Histogram",
    "LiveMetrics",
    "LiveTimings",
    "LogTailer",
    "MetricInfo",
    "MetricsBase",
    "MetricsProjection",
    "ProjectionFollower",
    "RangeReport",
    "RestoreRow",
    "RunsTailer",
    "Sample",
    "StepRow",
    "WorkTotals",
    "compact_with_metrics",
    "fold_rows",
    "load_metrics_base",
    "project_history",
    "save_metrics_base",
    "start_embedded_telemetry",
    "start_exporter",
]


def __getattr__(name: str) -> Any:
    # The exporter imports prometheus-client; load it only when asked for.
    if name in ("start_exporter", "ExporterHandle"):
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
