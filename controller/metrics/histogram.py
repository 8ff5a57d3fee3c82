"""Histograms: what a histogram sample holds (:class:`BucketCounts`) and the counting of
observed durations (:class:`Histogram`, prometheus-client's histogram).

The fold needs no bucket counting of its own: it keeps the exact distribution of each
integer quantity it histograms (staleness -> groups), and :meth:`BucketCounts.of_values`
derives the buckets from it when the families are read. Durations measured live (append
latency, checkpoint time) are counted by :class:`prometheus_client.Histogram`, unregistered
(the exporter's collector renders it with the rest).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import prometheus_client


def _check_bounds(bounds: Sequence[float]) -> tuple[float, ...]:
    if not bounds or list(bounds) != sorted(set(bounds)):
        raise ValueError(f"histogram buckets must be strictly increasing, got {tuple(bounds)}")
    return tuple(float(b) for b in bounds)


def _le(bound: float) -> str:
    if bound == float("inf"):
        return "+Inf"
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


@dataclass(frozen=True, slots=True)
class BucketCounts:
    """A histogram at one moment: per-bucket counts (the last one is ``+Inf``), sum,
    count, and the smallest and largest value (None when unknown or empty)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int
    min: float | None = None
    max: float | None = None

    @classmethod
    def of_values(cls, values: Mapping[int, int], bounds: Sequence[float]) -> BucketCounts:
        """The buckets of an exact distribution (value -> how many times it occurred)."""
        bounds = _check_bounds(bounds)
        counts = [0] * (len(bounds) + 1)
        total, count = 0.0, 0
        seen = [v for v, n in values.items() if n]
        for value, n in values.items():
            index = next((i for i, b in enumerate(bounds) if value <= b), len(bounds))
            counts[index] += n
            total += value * n
            count += n
        return cls(
            bounds,
            tuple(counts),
            total,
            count,
            min(seen) if seen else None,
            max(seen) if seen else None,
        )

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, Prometheus style, ending with ``+Inf``."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((_le(bound), running))
        return out

    def summary(self) -> dict[str, Any]:
        """Count, sum, mean, min, max and the cumulative buckets."""
        return {
            "count": self.count,
            "sum": self.total,
            "mean": self.total / self.count if self.count else None,
            "min": self.min,
            "max": self.max,
            "buckets": dict(self.cumulative()),
        }


class Histogram:
    """Observed values (durations) counted by an unregistered
    :class:`prometheus_client.Histogram`, plus the smallest and largest value (which
    prometheus-client does not keep; ``rolloutlog metrics`` shows them)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = _check_bounds(buckets)
        self._hist = prometheus_client.Histogram(
            "observed", "observed values", buckets=self.bounds, registry=None
        )
        self._lock = threading.Lock()
        self.min: float | None = None
        self.max: float | None = None

    def observe(self, value: float) -> None:
        """Count one observation."""
        self._hist.observe(value)
        with self._lock:
            self.min = value if self.min is None else min(self.min, value)
            self.max = value if self.max is None else max(self.max, value)

    def copy(self) -> BucketCounts:
        """The counts now."""
        cumulative: list[int] = []
        total, count = 0.0, 0
        for metric in self._hist.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    cumulative.append(int(sample.value))
                elif sample.name.endswith("_sum"):
                    total = float(sample.value)
                elif sample.name.endswith("_count"):
                    count = int(sample.value)
        counts = [b - a for a, b in zip([0, *cumulative[:-1]], cumulative, strict=True)]
        with self._lock:
            low, high = self.min, self.max
        return BucketCounts(self.bounds, tuple(counts), total, count, low, high)

    def cumulative(self) -> list[tuple[str, int]]:
        """See :meth:`BucketCounts.cumulative`."""
        return self.copy().cumulative()

    def summary(self) -> dict[str, Any]:
        """See :meth:`BucketCounts.summary`."""
        return self.copy().summary()
