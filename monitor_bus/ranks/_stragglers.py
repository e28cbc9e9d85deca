"""The spread across ranks of a merged window, and the rule that names a straggler.

Guarantees
----------
- Spread (``spread=True``): a merged window of a Stat with MEAN also holds
  ``<name>.rank_min``, ``.rank_p50``, ``.rank_max`` over the window means of the ranks that
  contributed (NaN means left out) and ``<name>.slowest_rank``, the rank of the highest
  mean (on a tie, the lower rank). ``hosts[rank]`` names its host.
- Stragglers (dst only): a rank whose window mean of a watched Stat exceeds the median of the
  other ranks' means (never its own: two ranks compare with each other) by its factor for
  ``straggler_windows`` merged windows in a row is named once by a ``STRAGGLER_EVENT`` (and
  a warning, rate-limited per Stat), and once more with ``recovered: True`` in its first
  merged window back under the factor. A Stat without MEAN or SUM gives each rank's mean
  from its Histogram's sum or its moments; one with neither (only VALUE, COUNT, MAX, MIN)
  is warned about and names nobody. Windows it has no samples in (or no other rank has),
  and late windows, leave its count as it was.
- Episodes: every straggler rule (this one, ``_anatomy``'s) counts windows over it with
  ``_count`` and names a rank with ``_announce``: once per episode, once more recovered.
"""

from __future__ import annotations

import logging
import math
import statistics
from datetime import datetime

from .. import _aggregates
from .._event import Event
from ._bucket import _AGG_NAMES, _Bucket
from ._state import MergeState

logger = logging.getLogger("monitor_bus")

#: The name of the event ``dst`` logs when it names a straggler, or one recovers: data
#: ``stat``, ``rank``, ``ratio`` (the rank's window mean over the median of the other ranks' means), ``windows``
#: (how many merged windows in a row it was over), ``host`` and ``recovered``; from
#: ``StepAnatomy``'s Stats, ``stage``, ``exposed_s`` and ``cause`` in place of ``ratio``.
STRAGGLER_EVENT = "monitor_bus.straggler"

_MEAN = _aggregates.Aggregation.MEAN.value
# The aggregations whose windows carry a sum (``_window_sum``), so a rank's mean.
_MEAN_SOURCES = frozenset(
    agg.value for agg in _aggregates.Aggregation if agg.name not in ("VALUE", "COUNT", "MAX", "MIN")
)


def _means(bucket: _Bucket) -> dict[int, float]:
    """Each contributing rank's window mean, but for empty windows and NaN means."""
    means = {}
    for rank, (count, total) in bucket.parts.items():
        if count:
            mean = total / count
            if not math.isnan(mean):
                means[rank] = mean
    return means


def _median_without(ordered: list[float], place: int) -> float:
    """The median of ``ordered`` (sorted) without its item at ``place``; NaN if none is left."""
    n = len(ordered) - 1
    if n < 1:
        return math.nan
    half = n // 2

    def at(i: int) -> float:
        return ordered[i + (i >= place)]

    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2


def _spread(name: str, means: dict[int, float]) -> dict[str, float | int]:
    """The spread keys of a merged window: the ranks' means' min, median, max, slowest."""
    if not means:
        return {}
    ordered = sorted(means.values())
    return {
        f"{name}.rank_min": ordered[0],
        f"{name}.rank_p50": statistics.median(ordered),
        f"{name}.rank_max": ordered[-1],
        # The highest mean; on a tie, the lower rank.
        f"{name}.slowest_rank": min(means, key=lambda rank: (-means[rank], rank)),
    }


class Stragglers(MergeState):
    """dst's straggler watch: each rank's windows over the factor, counted per Stat."""

    def _watch(
        self, name: str, aggs: tuple[int, ...], means: dict[int, float], stamp: datetime
    ) -> None:
        """dst: count each rank's windows over the factor; name a straggler, or its recovery."""
        if _MEAN_SOURCES.isdisjoint(aggs):  # no sum, moments or Histogram travels: no mean
            if self._throttle.ready(("no mean", name)):
                logger.warning(
                    "merge_stats_across_ranks: stragglers[%r] watches a Stat whose windows "
                    "hold no mean (aggregations %s): add MEAN, SUM, STDDEV, a percentile or "
                    "HISTOGRAM to it to have its stragglers named",
                    name,
                    ", ".join(_AGG_NAMES[agg].upper() for agg in aggs),
                )
            return
        # Each rank against the median of the others' means: one that held its own mean
        # would hide a slow rank among two, and move as ranks die.
        ordered = sorted((mean, rank) for rank, mean in means.items())
        place = {rank: i for i, (_, rank) in enumerate(ordered)}
        values = [mean for mean, _ in ordered]
        factor = self.stragglers[name]
        for rank, mean in sorted(means.items()):
            median = _median_without(values, place[rank])
            if not median > 0:  # no other rank, or no ratio to speak of: its count stays
                continue
            ratio = mean / median
            turn = self._count((name, rank), ratio > factor)
            if turn is None:
                continue
            windows, recovered = turn
            data: dict[str, str | float | int | bool] = {
                "stat": name,
                "rank": rank,
                "ratio": ratio,
                "windows": windows,
                "host": self.hosts[rank],
                "recovered": recovered,
            }
            detail = f"its {name!r} mean is {ratio:.2f} times the other ranks' median"
            self._announce(name, data, stamp, detail, f"over {factor}")

    def _count(self, key: tuple[str, int], over: bool) -> tuple[int, bool] | None:
        """Count one merged window of ``key`` (what a rule watches, a rank): over its rule or
        not. The one episode bookkeeping of every straggler rule.

        Returns:
            (windows, recovered) when the rank is named now (``straggler_windows`` windows in
            a row over) or recovers now (its first window back under, after it was named);
            ``windows`` is how many windows in a row it was over. None otherwise.
        """
        if over:
            streak = self._streaks[key] = self._streaks.get(key, 0) + 1
            if streak != self.straggler_windows:
                return None
            self.straggling.add(key)
            return streak, False
        streak = self._streaks.pop(key, 0)
        if key not in self.straggling:
            return None
        self.straggling.discard(key)
        return streak, True

    def _announce(
        self,
        name: str,
        data: dict[str, str | float | int | bool],
        stamp: datetime,
        detail: str,
        rule: str,
    ) -> None:
        """Log a ``STRAGGLER_EVENT`` of ``data`` (which holds ``rank``, ``host``, ``windows``
        and ``recovered``), and say it in a warning, rate-limited per ``name`` and way."""
        self.bus.log_event(Event(STRAGGLER_EVENT, stamp, data))
        recovered = bool(data["recovered"])
        if self._throttle.ready(("straggler", name, recovered)):
            logger.warning(
                "merge_stats_across_ranks: rank %d (%s) %s: %s (%d merged windows%s)",
                data["rank"],
                data["host"],
                "has recovered" if recovered else "is a straggler",
                detail,
                data["windows"],
                "" if recovered else f" in a row {rule}",
            )
