"""Metrics as projections of the log: one fold, served live or recomputed offline.

- :class:`MetricsProjection` (``projection``): the fold over events; the only code that
  turns events into metric values. :func:`project_history` recomputes it for any stored
  run and offset range.
- :class:`LiveMetrics` / :class:`LogTailer` (``live``): keep a projection current beside
  a controller (listener) or by polling the log; both roll back when a restore changes
  the history.
- :func:`start_exporter` (``exporter``): serve any of them to Prometheus.

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
    METRICS,
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

if TYPE_CHECKING:
    from .exporter import ExporterHandle, start_exporter

__all__ = [
    "METRICS",
    "EmbeddedTelemetry",
    "EventMeta",
    "ExporterHandle",
    "Family",
    "Histogram",
    "LiveMetrics",
    "LiveTimings",
    "LogTailer",
    "MetricInfo",
    "MetricsProjection",
    "ProjectionFollower",
    "RangeReport",
    "RestoreRow",
    "RunsTailer",
    "Sample",
    "StepRow",
    "WorkTotals",
    "fold_rows",
    "project_history",
    "start_embedded_telemetry",
    "start_exporter",
]


def __getattr__(name: str) -> Any:
    # The exporter imports prometheus-client; load it only when asked for.
    if name in ("start_exporter", "ExporterHandle"):
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
