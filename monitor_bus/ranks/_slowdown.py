"""The slowdown rule: the job's step time watched for a lasting change, named once when it
gets and stays ``slowdown`` (a fraction, default 0.1) slower.

``SlowdownRule`` is a pure object fed one window at a time (its stamp, its mean step time),
so the same code runs live on ``dst``, on recorded windows (a JSONL file read back) and on
synthetic series; ``dst`` feeds it (``_dst``).

Guarantees
----------
- Which series (dst only, ``slowdown`` not None): one per ``StepAnatomy`` family, the merged
  MEAN of ``<prefix>.time_s`` in each merged window that also holds ``<prefix>.wait_s`` (the
  names alone tell a family, as for ``_anatomy``), fed in the order the windows end. Late
  windows, and windows whose mean is not a positive, finite number, are not fed.
- The rule, per series: a CUSUM (Page, 1954) of rank scores, confirmed by the medians.
  The baseline is the median of up to ``baseline`` (30) windows before the candidate ones (the
  first ``first`` (10) windows make the first one). Each window scores where it ranks among the
  baseline's windows once moved back by the reference (``REFERENCE`` x ``slowdown``), less
  a half, in (-0.5, 0.5): whatever the noise's shape (a step time's is skewed), a window
  of an unchanged job scores below 0 on average, so the sum of the scores, never below 0,
  drifts down. The candidate windows are those since the sum last left 0. A slowdown is
  named when the sum reaches ``evidence`` (5; so after ``windows`` (10) windows at the least),
  and the candidates' median is at least ``1 + slowdown`` times the baseline and over the
  reference by ``CONFIDENCE`` standard errors of the two medians (from the noise from one
  window to the next, ``sigma``): a noisy job needs more windows than a steady one (a
  speed-up: the same, mirrored). It began with the first candidate, unless the candidates
  are two levels: split where two levels fit them best, at least ``slowdown`` apart and
  surely so (their medians ``SPLIT_Z`` standard errors apart). Then the earlier part, if it
  is a change of its own (the same test), is the change (a slowdown named at its own
  level) and the later part is scored again against it; else, if the later part is
  further the same way (a slower stretch, the machine's load, that the step's own change
  followed), the change began with it, once it is ``windows`` / 2 long; else a speed-up
  that turned slower again is taken for its earlier part however short, so the slowdown
  after it is weighed from the faster level. Then the baseline is the new level, so a
  slowdown that lasts is named once.
- Not named: noise (its sum drifts down), a single spike (it scores 0.5 at most), a shift of
  half the threshold (under the reference, its sum drifts down too, and it never clears
  the bar), a drift slow enough for the baseline to follow (the windows that are no
  candidates join it; so do the oldest of a change that has not confirmed in ``baseline``
  windows), the first ``first`` windows (a warm-up among them names nothing). A speed-up is
  the same rule mirrored and names nothing: the baseline moves down to the new level,
  silently, so a later slowdown is measured from there.
- The event: ``SLOWDOWN_EVENT`` with ``stat`` (``"<prefix>.time_s"``), ``before`` (the
  baseline, seconds), ``after`` (the named windows' median), ``ratio`` (after / before),
  ``began`` (the first named window's stamp, ISO 8601) and ``windows`` (how many
  windows named), and a warning, rate-limited per Stat.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from datetime import datetime

from .._check import check_int, wrong_type

#: The name of the event ``dst`` logs when the job's step time gets and stays ``slowdown``
#: slower: data ``stat``, ``before``, ``after``, ``ratio``, ``began`` and ``windows``.
SLOWDOWN_EVENT = "monitor_bus.slowdown"

#: How many window-to-window changes the spread is measured over.
NOISE = 60
#: The rule's reference, as a part of the threshold: a shift under it drives the sum down.
REFERENCE = 0.75
#: The least noise (sigma of the log step time, window to window) the confirmation assumes.
SIGMA_FLOOR = 0.01
#: How many standard errors of the two medians a change must clear the reference by: a
#: noisy job needs more windows to confirm one.
CONFIDENCE = 2.0
#: How many standard errors of the two medians a later level must be from the part before
#: for the candidate windows to be two levels.
SPLIT_Z = 3.0
# The standard error of a normal sample's median, in sigmas times the root of its size.
_MEDIAN_ERROR = 1.2533
# The MAD of a normal sample times this estimates its standard deviation.
_MAD_SIGMA = 1.4826


def check_threshold(name: str, value: object) -> float:
    """``value`` as a positive, finite float (a slowdown's threshold, the evidence)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(name, "a number", value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive, finite number, got {value}")
    return float(value)


class Slowdown:
    """A slowdown the rule names: the level before and after, and where it began."""

    __slots__ = ("after", "before", "began", "windows")

    def __init__(self, before: float, after: float, began: datetime, windows: int) -> None:
        #: The baseline: the median step time of the windows before, seconds.
        self.before = before
        #: The median step time of the windows from ``began``, seconds.
        self.after = after
        #: The stamp of the first slower window.
        self.began = began
        #: How many windows ``after`` is the median of.
        self.windows = windows

    @property
    def ratio(self) -> float:
        """``after / before``."""
        return self.after / self.before

    def __repr__(self) -> str:
        return (
            f"Slowdown(before={self.before!r}, after={self.after!r}, "
            f"began={self.began.isoformat()!r}, windows={self.windows})"
        )


class SlowdownRule:
    """The slowdown rule on one series of window means; see the module's guarantees.

    Not thread-safe: one thread feeds it (on ``dst``, the merge's).

    Args:
        slowdown: the part slower the step must get and stay, above 0 (0.1: 10%).
        windows: the fewest windows a change is confirmed after.
        baseline: the most windows the baseline is the median of.
        first: the windows the first baseline is made of (at least ``windows``).
        evidence: the sum of the windows' scores (each under 0.5) that names a change.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``slowdown`` or ``evidence`` is not a positive, finite number, or a count
            of windows is below 1.

    Examples:
        >>> from datetime import datetime, timedelta, timezone
        >>> rule = SlowdownRule(0.1)
        >>> t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
        >>> steps = [1.0] * 20 + [1.25] * 20
        >>> found = [rule.add(t0 + timedelta(seconds=i), s) for i, s in enumerate(steps)]
        >>> [(f.before, f.after, f.began.second) for f in found if f is not None]
        [(1.0, 1.25, 20)]
    """

    def __init__(
        self,
        slowdown: float = 0.1,
        *,
        windows: int = 10,
        baseline: int = 30,
        first: int = 10,
        evidence: float = 5.0,
    ) -> None:
        self.slowdown = check_threshold("slowdown", slowdown)
        self.windows = check_int("windows", windows, 1)
        self.evidence = check_threshold("evidence", evidence)
        self._cap = max(check_int("baseline", baseline, 1), windows)
        self._first = max(check_int("first", first, 1), windows)
        self._warming = True
        # The last ``NOISE`` window-to-window changes of the log step time, for the spread.
        self._steps: deque[float] = deque(maxlen=NOISE)
        self._last: float | None = None
        self._history: deque[float] = deque(maxlen=self._cap)
        # The windows not in the baseline yet: since both sums were last 0.
        self._pending: list[tuple[datetime, float]] = []
        # Per direction (up, down): the sum, and where in ``_pending`` its candidates begin.
        self._sums = [0.0, 0.0]
        self._starts: list[int | None] = [None, None]
        # The reference and the bar, in the log of the step time.
        self._reference = math.log1p(REFERENCE * slowdown)
        self._bar = math.log1p(slowdown)

    def add(self, stamp: datetime, mean: float) -> Slowdown | None:
        """Feed one window's mean step time; the slowdown it confirms, if it does.

        Args:
            stamp: the window's stamp.
            mean: its mean step time (a window whose mean is not positive and finite is
                left out).

        Returns:
            The slowdown named by this window, or None.
        """
        if not (mean > 0 and math.isfinite(mean)):
            return None
        history = self._history
        now = math.log(mean)
        if self._last is not None:
            self._steps.append(abs(now - self._last))
        self._last = now
        if self._warming:  # the first baseline (a later one may be shorter)
            history.append(mean)
            self._warming = len(history) < self._first
            return None
        # The noise from one window to the next: a level shift is one step among many.
        sigma = max(_MAD_SIGMA * statistics.median(self._steps) / math.sqrt(2), SIGMA_FLOOR)
        pending, starts = self._pending, self._starts
        pending.append((stamp, mean))
        self._score(len(pending) - 1)
        for side, sign in enumerate((1.0, -1.0)):
            start = starts[side]
            if (
                start is None
                or self._sums[side] < self.evidence
                or len(pending) - start < self.windows
                or not self._clears(pending[start:], sign, sigma)
            ):
                continue
            # Where the candidates are two levels, the earlier is acted on if it is a change
            # of its own (the later scored again against it), else the later if it is
            # further the same way, once it is long enough; else all of them (but for a
            # speed-up that turned back).
            candidates = pending[start:]
            changed, rest = candidates, []
            cut, gap = self._split(candidates, sigma)
            if cut:
                earlier, later = candidates[:cut], candidates[cut:]
                if self._clears(earlier, sign, sigma):
                    changed, rest = earlier, later
                elif sign * gap > 0:
                    if len(later) < max(self.windows // 2, 1):
                        continue  # too short to tell yet: the next windows will
                    changed = later
                elif sign < 0 and self._clears(earlier, sign, sigma, least=1):
                    # Back to speed, then slower again: the later part is weighed from the
                    # faster level, however short it was.
                    changed, rest = earlier, later
            before = statistics.median(self._history)
            self._reset(changed)
            for i, window in enumerate(rest):  # pending again, against the new baseline
                self._pending.append(window)
                self._score(i)
            if sign < 0:  # a speed-up: the baseline moved down, nothing named
                return None
            after = statistics.median(m for _, m in changed)
            return Slowdown(before, after, changed[0][0], len(changed))
        # The windows before every candidate join the baseline; so do the oldest of a shift
        # that never confirms, which the baseline then follows.
        active = [s for s in starts if s is not None]
        cut = max(min(active, default=len(pending)), len(pending) - self._cap)
        if cut > 0:
            history.extend(m for _, m in pending[:cut])
            del pending[:cut]
            self._starts = [None if s is None else max(s - cut, 0) for s in starts]
        return None

    def _score(self, index: int) -> None:
        """Add the pending window at ``index`` to both sums. Each side's score: where the
        window, moved back by the reference, ranks among the baseline's, less a half. Its mean
        is below 0 when nothing changed, whatever the noise's shape (a skewed one too); a
        change beyond the reference drives it up."""
        history, starts = self._history, self._starts
        mean = self._pending[index][1]
        size = len(history)
        over = mean / (1 + REFERENCE * self.slowdown)
        under = mean * (1 + REFERENCE * self.slowdown)
        ranks = (
            (sum(m < over for m in history) + 0.5 * sum(m == over for m in history)) / size,
            (sum(m > under for m in history) + 0.5 * sum(m == under for m in history)) / size,
        )
        for side in (0, 1):
            total = self._sums[side] = max(self._sums[side] + ranks[side] - 0.5, 0.0)
            if total == 0.0:
                starts[side] = None
            elif starts[side] is None:
                starts[side] = index

    def _clears(
        self,
        windows: list[tuple[datetime, float]],
        sign: float,
        sigma: float,
        least: int | None = None,
    ) -> bool:
        """Whether ``windows`` (``least``, by default ``windows``, of them at the least) are
        a change from the baseline (up, ``sign`` 1, or down, -1): their median at least the
        bar away and past the reference by ``CONFIDENCE`` standard errors of the two medians
        (as for a normal sample's median)."""
        if len(windows) < (self.windows if least is None else least):
            return False
        history = self._history
        error = _MEDIAN_ERROR * sigma * math.sqrt(1 / len(windows) + 1 / len(history))
        level = statistics.median(m for _, m in windows)
        change = sign * (math.log(level) - math.log(statistics.median(history)))
        return change >= self._bar and change >= self._reference + CONFIDENCE * error

    def _split(self, candidates: list[tuple[datetime, float]], sigma: float) -> tuple[int, float]:
        """Where in ``candidates`` a later level begins that is at least ``slowdown`` away
        from the part before (up or down) and surely so, and the log of their medians'
        ratio; or (0, 0.0). The place is the best fit of two levels (the least absolute
        deviation of the log step time from each part's median), so it is where the step
        changed however long either part; sure: the medians ``SPLIT_Z`` standard errors
        apart."""
        logs = [math.log(m) for _, m in candidates]
        best, where, gap = math.inf, 0, 0.0
        for cut in range(1, len(logs)):
            before, after = logs[:cut], logs[cut:]
            low, high = statistics.median(before), statistics.median(after)
            cost = sum(abs(x - low) for x in before) + sum(abs(x - high) for x in after)
            if cost < best:
                best, where, gap = cost, cut, high - low
        if not where:
            return 0, 0.0
        error = _MEDIAN_ERROR * sigma * math.sqrt(1 / where + 1 / (len(logs) - where))
        if abs(gap) >= self._bar and abs(gap) >= SPLIT_Z * error:
            return where, gap
        return 0, 0.0

    def _reset(self, level: list[tuple[datetime, float]]) -> None:
        """A change confirmed: the baseline is the new level; both sums start again."""
        self._history.clear()
        self._history.extend(m for _, m in level)
        self._pending = []
        self._sums = [0.0, 0.0]
        self._starts = [None, None]
