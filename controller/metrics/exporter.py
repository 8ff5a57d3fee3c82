"""Prometheus export of the metrics projection (prometheus-client).

The exporter has its own :class:`~prometheus_client.CollectorRegistry` (never the
process-global one, so two exporters, or a host application's own metrics, never
collide) holding one custom collector that renders the projection's families on each
scrape. Nothing is computed twice: the values are the fold's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .live import MetricsSource
from .projection import Family, Histogram

log = logging.getLogger(__name__)


def render_family(fam: Family) -> Metric:
    """One projection family as a prometheus-client metric family."""
    info = fam.info
    labels = list(info.labels)
    metric: CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily
    if info.kind == "counter":
        # prometheus-client appends "_total" to counter samples itself.
        metric = CounterMetricFamily(fam.name.removesuffix("_total"), info.help, labels=labels)
    elif info.kind == "gauge":
        metric = GaugeMetricFamily(fam.name, info.help, labels=labels)
    else:
        metric = HistogramMetricFamily(fam.name, info.help, labels=labels)
    for sample in fam.samples:
        values = [sample.labels[name] for name in labels]
        if isinstance(sample.value, Histogram):
            assert isinstance(metric, HistogramMetricFamily)
            metric.add_metric(
                values,
                buckets=[(le, float(n)) for le, n in sample.value.cumulative()],
                sum_value=sample.value.total,
            )
        else:
            metric.add_metric(values, float(sample.value))  # type: ignore[union-attr]
    return metric


class ProjectionCollector(Collector):
    """Renders a :class:`MetricsSource` (a projection, live metrics, a log tailer)."""

    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        """Called by prometheus-client on each scrape."""
        try:
            families = self.source.families()
        except Exception:
            log.exception("rendering the rollout metrics failed")
            raise
        for fam in families:
            yield render_family(fam)

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: families are known only when rendered."""
        return iter(())


@dataclass
class ExporterHandle:
    """A running exporter: its port (the real one when 0 was asked) and ``close()``."""

    server: WSGIServer
    thread: threading.Thread
    registry: CollectorRegistry
    addr: str

    @property
    def port(self) -> int:
        """The TCP port the exporter listens on."""
        return int(self.server.server_port)

    @property
    def url(self) -> str:
        """The scrape URL (with a concrete host when bound to all interfaces)."""
        host = "127.0.0.1" if self.addr in ("0.0.0.0", "") else self.addr
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_exporter(source: MetricsSource, port: int, *, addr: str = "0.0.0.0") -> ExporterHandle:
    """Serve ``source`` (e.g. a
    :class:`~rolloutlog.controller.metrics.projection.MetricsProjection`,
    :class:`~rolloutlog.controller.metrics.live.LiveMetrics` or
    :class:`~rolloutlog.controller.metrics.live.LogTailer`) at ``http://addr:port/metrics``.

    ``port=0`` picks a free port (read it from the handle). Raises :class:`OSError`
    when the port cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProjectionCollector(source))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return ExporterHandle(server, thread, registry, addr)
