"""The reading of a run's JSONL file for ``monitor-bus summary`` and ``plot``: its events one
at a time, the numbers of its Stat windows and metrics events, and what was skipped.

Guarantees: the run is read one event at a time, and a line at most ``MAX_LINE_BYTES`` at a
time (a longer one is read through in pieces), so what is held does not grow with the file.
What a read skips is reported on stderr and does not fail the command: torn lines, lines
longer than ``MAX_LINE_BYTES``, lines of JSON that are not events, and values this Python
cannot read or a float cannot hold (``1e999``) (the first five as they came, each with its
file, line and why, then a total); Stat values that are not numbers, and ints beyond a float
(a Stat's or a metric's value, a metrics ``step``, a run's ``duration_s``, a straggler's
``ratio``) (a count per key). A window's ``Histogram`` is no single number and is left out
without a word (its percentiles are numbers of their own). A file with no event at all is an
error.

The numbers read are those of Stat windows (over time) and of ``METRICS_EVENT`` events, the
numbers a framework (Lightning, Hugging Face) logged, over their ``"step"`` (or their order
where they have none; ``epoch`` is a counter, not drawn). A Stat's last window cut short by
the run's end is told from the windows' times (``_partial_last``).

Below ``_cli_summary`` and ``_cli_plot``, which import it; it imports neither.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Iterator, Sequence

from ._event import Event
from ._histogram import Histogram
from ._jsonl_read import iter_jsonl
from ._run import METRICS_EVENT
from ._window import STAT_EVENT

PROG = "monitor-bus"


class CliError(Exception):
    """A problem to report in one line."""


_SHOWN_SKIPS = 5


class _Skips:
    """What reading a run skipped: the first few reported as they came, then one total."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines = 0
        self.values = 0
        self.shown: list[str] = []

    def __call__(self, lineno: int, kind: str, message: str) -> None:
        if kind == "value":
            self.values += 1
        else:
            self.lines += 1
        if kind == "event":  # JSON, but not an event: named and skipped like a torn line
            message = f"skipped a line that is not an event ({message})"
        if len(self.shown) < _SHOWN_SKIPS:
            self.shown.append(f"{self.path}, line {lineno}: {message}")

    def report(self) -> None:
        for message in self.shown:
            _warn(message)
        more = self.lines + self.values - len(self.shown)
        if more:
            _warn(
                f"{self.path}: {more} more skipped "
                f"({_plural(self.lines, 'line')}, {_plural(self.values, 'value')} in all)"
            )


class _StatSkips:
    """Values the command cannot use, counted per key."""

    def __init__(self) -> None:
        self.too_large: Counter[str] = Counter()
        self.not_numbers: Counter[str] = Counter()

    def report(self) -> None:
        for counts, noun, one, many in (
            (self.too_large, "value", "too large for a float", "too large for a float"),
            (self.not_numbers, "Stat value", "that is not a number", "that are not numbers"),
        ):
            if not counts:
                continue
            total = sum(counts.values())
            keys = ", ".join(f"{key} ({n})" for key, n in sorted(counts.items())[:_SHOWN_SKIPS])
            if len(counts) > _SHOWN_SKIPS:
                keys += f" and {len(counts) - _SHOWN_SKIPS} more keys"
            what = one if total == 1 else many
            _warn(f"skipped {_plural(total, noun)} {what}: {keys}")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _events(path: str, skips: _Skips) -> Iterator[Event]:
    """The run's events, read one at a time; what is skipped goes to ``skips``."""
    return iter_jsonl(path, skips)


def _stat_values(event: Event, skips: _StatSkips) -> Iterator[tuple[str, float]]:
    """Each (key, value) of a Stat event as a float; other events give none."""
    if event.name != STAT_EVENT:
        return
    for key, value in event.data.items():
        if isinstance(value, Histogram):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            skips.not_numbers[key] += 1
            continue
        try:
            yield key, float(value)
        except OverflowError:  # an int past 1.8e308, as a Stat's sum can be
            skips.too_large[key] += 1


def _metric_values(event: Event, skips: _StatSkips) -> Iterator[tuple[str, float]]:
    """Each (name, value) of a metrics event as a float, ``step`` and ``epoch`` left out; other
    events give none. Strings (a framework's notes) are not metrics and are not counted."""
    if event.name != METRICS_EVENT:
        return
    for key, value in event.data.items():
        if key in _COUNTERS or isinstance(value, (bool, str)):
            continue
        if not isinstance(value, (int, float)):
            skips.not_numbers[key] += 1
            continue
        try:
            yield key, float(value)
        except OverflowError:
            skips.too_large[key] += 1


# A metrics event's counters: the x axis (step), and the epoch a framework adds to each.
_COUNTERS = ("step", "epoch")


def _step(event: Event, order: int, skips: _StatSkips) -> float | None:
    """A metrics event's x: its int ``"step"``, else its place among the metrics events; None
    (counted in ``skips``) for a step beyond a float, which has no place on the axis."""
    step = event.data.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return _float(step, "step", skips)
    return float(order)


def _float(value: float, key: str, skips: _StatSkips) -> float | None:
    """``value`` as a float, or None (counted in ``skips`` under ``key``) for an int beyond one."""
    try:
        return float(value)
    except OverflowError:
        skips.too_large[key] += 1
        return None


# A last window this much shorter than the usual gap between windows was cut off by the end
# of the run (Stat windows are logged at their end; a run's end logs the open one early).
_PARTIAL = 0.9


def _partial_last(stamps: Sequence[float]) -> float | None:
    """How much of a usual window the last one covered, if it was cut short; else None.

    The usual length is the median gap between the earlier windows' timestamps; a run needs
    three windows for it. Gaps longer than usual (windows with no values are not logged) do
    not mark anything.
    """
    if len(stamps) < 3:
        return None
    usual = statistics.median(b - a for a, b in zip(stamps[:-2], stamps[1:-1], strict=True))
    last = stamps[-1] - stamps[-2]
    if usual <= 0 or last >= _PARTIAL * usual:
        return None
    return last / usual
