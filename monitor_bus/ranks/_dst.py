"""dst's role: it logs each merged window, with its spread, and watches it for stragglers and
for a slowdown of the job.

Guarantees
----------
- Two levels: ``dst``
  merges a host record as the windows it holds, so the merged window, its spread and the
  stragglers are those of the flat shape.
- Stragglers: a window is watched by the ``stragglers`` rule as it is logged; StepAnatomy's
  rule (``_anatomy``) reads the windows of a round together, once they are all logged, so it
  sees a window's wait, step, stage and GC Stats at once (they end together, so they are due
  in the same round). The wait's cost keys (``_anatomy.lost_keys``) need only the wait, so
  they go on its merged window as it is logged, once the round's families are known.
- Hangs: each round while it is not closing, after logging the windows due, dst's merge
  thread applies the hang rule (``_hang``) to every rank's last progress; the training
  thread, blocked in a collective or not, has no part in it.
- Slowdowns: the slowdown rule (``_slowdown``) reads a round's StepAnatomy windows as the
  straggler rule does, on their step time.
"""

from __future__ import annotations

import logging
from datetime import datetime

from .._event import Event
from .._window import STAT_EVENT
from ._anatomy import SUFFIXES, TIME, WAIT, AnatomyStragglers, Merged, families, lost_keys
from ._bucket import _data, _stamp
from ._frame import _Record
from ._receiving import Receiving, _Due
from ._slowdown import SLOWDOWN_EVENT, Slowdown, SlowdownRule
from ._stragglers import _MEAN, _means, _spread

logger = logging.getLogger("monitor_bus")


class Dst(Receiving, AnatomyStragglers):
    """dst: it receives and merges, and logs each window merged."""

    def _log_merged(self, due: list[_Due]) -> None:
        """dst: log each window due, merged, with its spread, and watch it for stragglers; one
        merged before is logged on its own, marked late."""
        anatomy: dict[tuple[float, int], dict[str, Merged]] = {}  # StepAnatomy's, by window
        waits = families(
            [(k[0], k[2], k[3]) for k, _, late, _ in due if not late and _MEAN in k[1]]
        )
        for key, bucket, late, behind in due:
            if behind and not late:
                self.missing += 1
                if self._throttle.ready(("missing", tuple(sorted(behind)))):
                    logger.warning(
                        "merge_stats_across_ranks: window %r ending %s merged without rank(s) "
                        "%s (no word from them within timeout=%s s)",
                        key[0],
                        _stamp(key[2] * key[3]).isoformat(),
                        ", ".join(map(str, sorted(behind))),
                        self.timeout,
                    )
            record: _Record = [key[0], list(key[1])]
            data = _data(record, bucket)
            stamp = _stamp(bucket.last[0])
            if late:  # the rank(s) it came from only, after the merged window: marked
                data[f"{key[0]}.late"] = True
                self.bus._log_window((STAT_EVENT, stamp, data))
                continue
            means = _means(bucket)
            if self.spread and _MEAN in key[1]:
                data.update(_spread(key[0], means))
                if (key[0], key[2], key[3]) in waits:
                    data.update(lost_keys(key[0], means))
            self.bus._log_window((STAT_EVENT, stamp, data))
            self.merged += 1
            if key[0] in self.stragglers:
                self._watch(key[0], key[1], means, stamp)
            if (
                (self.exposed_fraction is not None or self.spread or self.slowdown is not None)
                and _MEAN in key[1]
                and key[0].endswith(SUFFIXES)
                and bucket.count
            ):
                counts = {rank: count for rank, (count, _) in bucket.parts.items()}
                merged = (means, bucket.total / bucket.count, stamp, counts)
                anatomy.setdefault((key[2], key[3]), {})[key[0]] = merged
        if anatomy:
            self._watch_anatomy(anatomy)
            self._watch_slowdown(anatomy)

    def _watch_slowdown(self, windows: dict[tuple[float, int], dict[str, Merged]]) -> None:
        """dst: feed each StepAnatomy family's merged step time in ``windows`` ((size, index)
        -> the merged windows by name) to its slowdown rule, oldest window first; log what
        it names."""
        threshold = self.slowdown
        if threshold is None:
            return
        for size, index in sorted(windows, key=lambda k: (k[0] * k[1], k[0])):
            merged = windows[size, index]
            for name in sorted(merged):
                if not (name.endswith(TIME) and name[: -len(TIME)] + WAIT in merged):
                    continue
                _, mean, stamp, _ = merged[name]
                rule = self._slowdown_rules.get(name)
                if rule is None:
                    rule = self._slowdown_rules[name] = SlowdownRule(threshold)
                found = rule.add(stamp, mean)
                if found is not None:
                    self._name_slowdown(name, found, stamp)

    def _name_slowdown(self, name: str, found: Slowdown, stamp: datetime) -> None:
        """dst: log a ``SLOWDOWN_EVENT`` for ``found`` on the Stat ``name``, and warn."""
        data: dict[str, str | float | int | bool] = {
            "stat": name,
            "before": found.before,
            "after": found.after,
            "ratio": found.ratio,
            "began": found.began.isoformat(),
            "windows": found.windows,
        }
        self.bus.log_event(Event(SLOWDOWN_EVENT, stamp, data))
        if self._throttle.ready(("slowdown", name)):
            logger.warning(
                "merge_stats_across_ranks: the job's %r is %.2f times what it was (%.2f ms "
                "per step, from %.2f ms) since the window stamped %s (%d merged windows)",
                name,
                found.ratio,
                found.after * 1e3,
                found.before * 1e3,
                found.began.isoformat(),
                found.windows,
            )
