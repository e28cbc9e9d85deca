"""A window's ``Histogram`` through the OpenTelemetry SDK unchanged, as one exponential
histogram point.

Guarantees:

- The point a reader collects has the window's own ``scale``, ``zero_count``, offsets and
  bucket counts, ``count``, ``sum``, ``min`` and ``max``: the windows recorded since the last
  collection (delta temporality) or since the start (cumulative) merged with
  ``Histogram.merge``, which is exact at equal scales and otherwise downscales to the coarser
  one, as the SDK's own aggregation does. Nothing is re-bucketed one sample at a time.
- The histogram travels as a measurement of a synchronous ``Histogram`` instrument: a float
  (0.0, which the SDK's checks of finite, non-negative amounts let through) carrying it. Only
  ``WindowHistogramAggregation``, chosen by a ``View`` (``otel.histogram_view``), reads it; the
  handler records one only on a provider that has that view.
- It leans on the SDK's private aggregation base (``_ExponentialBucketHistogramAggregation``),
  which is how the SDK's collection knows to make an ``ExponentialHistogram`` of the points;
  tested against the installed SDK with its ``InMemoryMetricReader``.

Imported by ``monitor_bus.exporters.otel`` only when it makes a view or records a histogram.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.sdk.metrics._internal.aggregation import (
    AggregationTemporality,
    _ExponentialBucketHistogramAggregation,
)
from opentelemetry.sdk.metrics.export import Buckets, ExponentialHistogramDataPoint
from opentelemetry.sdk.metrics.view import Aggregation

from .._histogram import Histogram

__all__ = ["HistogramMeasurement", "WindowHistogramAggregation"]


class HistogramMeasurement(float):
    """The amount recorded for a window's histogram: 0.0, carrying ``histogram``."""

    __slots__ = ("histogram",)
    histogram: Histogram

    def __new__(cls, histogram: Histogram) -> HistogramMeasurement:
        self = super().__new__(cls, 0.0)
        self.histogram = histogram
        return self


class WindowHistogramAggregation(Aggregation):
    """The ``View`` aggregation that passes recorded ``Histogram``s through (module docs)."""

    def _create_aggregation(
        self, instrument: Any, attributes: Any, reservoir_factory: Any, start_time_unix_nano: int
    ) -> Any:
        return _PassThrough(
            attributes,
            reservoir_factory(_ExponentialBucketHistogramAggregation),
            AggregationTemporality.DELTA,
            start_time_unix_nano,
        )


class _PassThrough(_ExponentialBucketHistogramAggregation):
    """Merges the histograms measured; collects them as one point (module docs)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._window_lock = threading.Lock()
        self._since_collect: Histogram | None = None  # merged since the last collection
        self._total: Histogram | None = None  # merged since the start (cumulative)
        self._last_collect = self._start_time_unix_nano

    def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
        histogram = getattr(measurement.value, "histogram", None)
        if not isinstance(histogram, Histogram):
            return  # not the handler's: a plain number has no buckets to pass through
        with self._window_lock:
            held = self._since_collect
            self._since_collect = histogram if held is None else held.merge(histogram)

    def collect(self, collection_aggregation_temporality: Any, collection_start_nano: int) -> Any:
        with self._window_lock:
            new, self._since_collect = self._since_collect, None
            start, self._last_collect = self._last_collect, collection_start_nano
            if collection_aggregation_temporality is AggregationTemporality.DELTA:
                histogram = new
            else:
                if new is not None:
                    self._total = new if self._total is None else self._total.merge(new)
                histogram, start = self._total, self._start_time_unix_nano
        if histogram is None:
            return None
        return point(histogram, self._attributes, start, collection_start_nano)


def point(
    histogram: Histogram, attributes: Any, start: int, end: int
) -> ExponentialHistogramDataPoint:
    """``histogram`` as the SDK's exponential histogram point. Its NaN and infinite samples,
    which no bucket holds, are not in ``count`` (OTLP's count is the buckets' total, and the
    SDK drops such measurements); ``sum``, ``min`` and ``max`` are the histogram's."""
    finite = histogram.count - histogram.nan_count - histogram.inf_count - histogram.neg_inf_count
    return ExponentialHistogramDataPoint(
        attributes=attributes,
        start_time_unix_nano=start,
        time_unix_nano=end,
        count=finite,
        sum=histogram.sum,
        scale=histogram.scale,
        zero_count=histogram.zero_count,
        positive=Buckets(histogram.positive_offset, list(histogram.positive_counts)),
        negative=Buckets(histogram.negative_offset, list(histogram.negative_counts)),
        flags=0,
        min=histogram.min,
        max=histogram.max,
    )
