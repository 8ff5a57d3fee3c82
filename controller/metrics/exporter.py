"""Prometheus export of the metrics projection (prometheus-client).

The exporter has its own :class:`~prometheus_client.CollectorRegistry` (never the
process-global one, so two exporters, or a host application's own metrics, never
collide) holding one custom collector that renders the projection's families on each
scrape. Nothing is computed twice: the values are the fold's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .exposition import Family
from .histogram import BucketCounts

log = logging.getLogger(__name__)


def render_families(name: str, parts: Sequence[tuple[Family, dict[str, str]]]) -> Metric:
    """The families of one metric name from several sources (one per run) as one
    prometheus-client family; each part's extra labels are added to its samples."""
    info = parts[0][0].info
    extra_names = sorted({k for _, extra in parts for k in extra})
    labels = extra_names + list(info.labels)
    metric: CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily
    if info.kind == "counter":
        # prometheus-client appends "_total" to counter samples itself.
        metric = CounterMetricFamily(name.removesuffix("_total"), info.help, labels=labels)
    elif info.kind == "gauge":
        metric = GaugeMetricFamily(name, info.help, labels=labels)
    else:
        metric = HistogramMetricFamily(name, info.help, labels=labels)
    for fam, extra in parts:
        for sample in fam.samples:
            values = [extra.get(k, "") for k in extra_names]
            values += [sample.labels[k] for k in info.labels]
            if isinstance(sample.value, BucketCounts):
                assert isinstance(metric, HistogramMetricFamily)
                metric.add_metric(
                    values,
                    buckets=[(le, float(n)) for le, n in sample.value.cumulative()],
                    sum_value=sample.value.total,
                )
            else:
                assert not isinstance(metric, HistogramMetricFamily)
                metric.add_metric(values, float(sample.value))
    return metric


class MetricsSource(Protocol):
    """Anything the exporter can render: a list of metric families, read on each scrape,
    and the run they belong to (the ``run_id`` label of every series)."""

    @property
    def run_id(self) -> str | None:
        """The run the families describe (None until known)."""
        ...

    def families(self) -> list[Family]:
        """The metric families now."""
        ...


Sources = Callable[[], Sequence[MetricsSource]]


class ProjectionCollector(Collector):
    """Renders one or more :class:`MetricsSource` (a projection, live metrics, a log
    tailer; several runs), every series labelled with its source's ``run_id``."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        """Called by prometheus-client on each scrape."""
        by_name: dict[str, list[tuple[Family, dict[str, str]]]] = {}
        try:
            for source in self.sources():
                extra = {"run_id": source.run_id or ""}
                for fam in source.families():
                    by_name.setdefault(fam.name, []).append((fam, extra))
        except Exception:
            log.exception("rendering the rollout metrics failed")
            raise
        for name, parts in by_name.items():
            yield render_families(name, parts)

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


def start_exporter(
    source: MetricsSource | Sequence[MetricsSource] | Sources,
    port: int,
    *,
    addr: str = "127.0.0.1",
) -> ExporterHandle:
    """Serve ``source`` (e.g. a
    :class:`~rolloutlog.controller.metrics.projection.MetricsProjection`,
    :class:`~rolloutlog.controller.metrics.live.LiveMetrics` or
    :class:`~rolloutlog.controller.metrics.live.LogTailer`; a list of them, or a callable returning
    the list now, for several runs) at ``http://addr:port/metrics``. Every series carries a
    ``run_id`` label.

    ``port=0`` picks a free port (read it from the handle). Raises :class:`OSError`
    when the port cannot be bound.
    """
    if callable(source):
        sources: Sources = source
    elif isinstance(source, Sequence):
        fixed = list(source)
        sources = lambda: fixed  # noqa: E731
    else:
        single = [source]
        sources = lambda: single  # noqa: E731
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProjectionCollector(sources))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return ExporterHandle(server, thread, registry, addr)
