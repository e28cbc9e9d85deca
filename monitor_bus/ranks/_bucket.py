"""The one merge rule for a window's values, which dst, a leader, a rank logging its own windows and a late window all follow.

A ``_Bucket`` holds the windows of one (Stat, window) from the ranks that reported it so
far (a rank's record, or a host record holding several ranks'); ``_data`` makes the merged
window's event data of it.

Guarantees
----------
- Exact and once (either shape): counts and sums add, max of maxes, min of mins (NaN if any
  rank's is, as a Stat's MAX and MIN over its samples; here, locally and late), mean is sum
  over count, value is the one of the rank whose window closed last (on a tie, the higher
  rank); STDDEV from the ranks' moments (Chan et al.'s pairwise update: in the two-level
  shape in another order, so equal to rounding), the percentiles read from, and HISTOGRAM
  is, the ranks' Histograms merged (``Histogram.merge``: exact).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from .. import _aggregates
from .._aggregates import AggregateValue, merge_moments
from .._histogram import Histogram
from ._frame import _Record


class _Bucket:
    """The windows of one (stat, window) from the ranks that reported it so far."""

    __slots__ = (
        "behind",
        "count",
        "high",
        "histogram",
        "last",
        "low",
        "moments",
        "parts",
        "total",
        "value",
    )

    # ``last``: (close time, rank) of the window whose value is kept: two ranks' timers can
    # close a window in the same microsecond, and the higher rank wins that tie.

    def __init__(self) -> None:
        self.parts: dict[int, tuple[int, float]] = {}  # rank -> its count and sum
        self.count = 0
        self.total = 0.0
        self.high = -math.inf
        self.low = math.inf
        self.value: float = math.nan
        self.last: tuple[float, int] = (-math.inf, -1)
        self.moments: _aggregates.Moments = (0, 0.0, 0.0, 0.0)
        self.histogram: Histogram | None = None
        self.behind: set[int] = set()  # the ranks host records were merged without

    def add(self, rank: int, record: _Record) -> None:
        """Add ``rank``'s window, or the ranks' windows a host record from ``rank`` holds."""
        count, total, high, low, value, closed = record[4:10]
        if len(record) > 12:  # a host record: its ranks' parts, the rank of its value
            host = record[12]
            for part_rank, part_count, part_total in host["parts"]:
                self.parts[part_rank] = (part_count, part_total)
            self.behind.update(host["behind"])
            rank = host["rank"]
        else:
            self.parts[rank] = (count, total)
        self.count += count
        self.total += total
        # A NaN MAX or MIN of any rank's makes the merged one NaN, as a Stat's over samples.
        if high > self.high or math.isnan(high):
            self.high = high
        if low < self.low or math.isnan(low):
            self.low = low
        if (closed, rank) > self.last:
            self.last, self.value = (closed, rank), value
        moments, histogram = record[10:12]
        self.moments = merge_moments(self.moments, tuple(moments))
        if histogram is not None:
            theirs = Histogram.from_dict(histogram)
            self.histogram = theirs if self.histogram is None else self.histogram.merge(theirs)


_AGG_NAMES = {agg.value: agg.name.lower() for agg in _aggregates.Aggregation}


def _data(record: _Record, bucket: _Bucket) -> dict[str, AggregateValue]:
    """The merged window's event data: ``bucket``'s values of the record's aggregations, and
    ``"<name>.ranks"``, how many ranks it holds."""
    name, aggs = record[0], record[1]
    count = bucket.count
    values = (
        bucket.value,
        bucket.total / count,
        count,
        bucket.total,
        bucket.high,
        bucket.low,
        *_aggregates.distribution(bucket.moments, bucket.histogram),
    )
    data: dict[str, AggregateValue] = {}
    for agg in aggs:
        data[f"{name}.{_AGG_NAMES[agg]}"] = values[agg - 1]
    data[f"{name}.ranks"] = len(bucket.parts)
    return data


def _stamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)
