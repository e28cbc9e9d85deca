"""Windowed summary statistics, cheap to update from a hot loop.

``Stat.add`` takes no lock: it reads the clock, appends the sample to a buffer and, every
``_CHUNK`` samples, folds the buffer into the window's aggregates with C builtins under the
Stat's lock. Folding takes samples from the front of the buffer (``buf[:n]`` then
``del buf[:n]``, each atomic), so a sample appended by another thread while a fold or a close
is running stays in the buffer for the next window instead of being lost. The samples leave
the buffer only once their aggregates are computed, in straight-line code a signal cannot
interrupt, so a Ctrl-C landing in a fold loses nothing.
"""

from __future__ import annotations

import contextlib
import enum
import math
import operator
import threading
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from functools import reduce
from itertools import chain
from time import monotonic
from typing import TYPE_CHECKING

from ._check import check_int, wrong_type
from ._event import one_value
from ._lifecycle import process

if TYPE_CHECKING:
    from ._bus import EventBus

STAT_EVENT = "torch.monitor.Stat"
"""The name of the events a ``Stat`` logs when a window closes (torch.monitor's name)."""

# Samples buffered before they are folded: bounds a window's memory whatever the add rate.
_CHUNK = 4096

# The window clock, a module attribute so tests can step time without sleeping (the
# dispatcher's timer reads it too).
_clock = monotonic


class Aggregation(enum.Enum):
    """What a ``Stat`` reports for each window."""

    #: The last value added.
    VALUE = 1
    #: The arithmetic mean of the values added.
    MEAN = 2
    #: How many values were added (an ``int``).
    COUNT = 3
    #: The sum of the values added.
    SUM = 4
    #: The largest value added.
    MAX = 5
    #: The smallest value added.
    MIN = 6


class Stat:
    """A windowed statistic: values added during a window are logged as one event.

    When a window of ``window_size`` ends with at least one value in it, the Stat logs
    ``Event(STAT_EVENT, now, {"<name>.<aggregation>": value, ...})`` with one key per
    aggregation in lower case (``"step_time.mean"``). Windows are aligned to the monotonic
    clock. A window closes on the first ``add`` after its end and, while the bus has handlers,
    on a timer in the dispatcher, so a stalled loop still reports. The add that reaches
    ``max_samples`` logs the window at once; later adds are discarded until the next window.

    ``add`` is safe to call from many threads at once; no value is lost or counted twice.

    Args:
        name: prefix of the logged keys.
        aggregations: the aggregations to report (at least one).
        window_size: length of a window, at least one millisecond.
        max_samples: values per window after which the window is logged early.
        bus: the bus to log to; the default bus if omitted.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``aggregations`` is empty, ``window_size`` is under a millisecond or
            ``max_samples`` is below 1.

    Examples:
        >>> from datetime import timedelta
        >>> stat = Stat("step_time", [Aggregation.MEAN, Aggregation.MAX], timedelta(seconds=1))
        >>> stat.add(0.25)
        >>> stat.count
        1
    """

    __slots__ = (
        "__weakref__",
        "_aggregations",
        "_buf",
        "_bus",
        "_count",
        "_dirty",
        "_end",
        "_fold_at",
        "_keys",
        "_last",
        "_lock",
        "_marked",
        "_max",
        "_max_samples",
        "_min",
        "_name",
        "_sum",
        "_value",
        "_pick",
        "_want_max",
        "_want_min",
        "_want_sum",
        "_window",
    )

    def __init__(
        self,
        name: str,
        aggregations: Iterable[Aggregation],
        window_size: timedelta,
        max_samples: int = 2**63 - 1,
        *,
        bus: EventBus | None = None,
    ) -> None:
        if not isinstance(name, str):
            raise wrong_type("name", "a str", name)
        try:
            aggs = list(dict.fromkeys(aggregations))
        except TypeError:
            raise TypeError(
                f"aggregations must be an iterable of Aggregation, not {type(aggregations).__name__}"
            ) from None
        if not aggs:
            raise ValueError("aggregations must name at least one Aggregation")
        for agg in aggs:
            if not isinstance(agg, Aggregation):
                raise wrong_type("aggregations", "monitor_bus.Aggregation members", agg)
        if not isinstance(window_size, timedelta):
            raise wrong_type("window_size", "a timedelta", window_size)
        if window_size < timedelta(milliseconds=1):
            raise ValueError(f"window_size must be at least 1 millisecond, got {window_size!r}")
        check_int("max_samples", max_samples, 1)
        from ._bus import EventBus

        if bus is None:
            from ._default import get_default_bus

            bus = get_default_bus()
        elif not isinstance(bus, EventBus):
            raise wrong_type("bus", "a monitor_bus.EventBus or None", bus)

        self._name = name
        self._aggregations = tuple(aggs)
        self._keys = tuple(f"{name}.{agg.name.lower()}" for agg in aggs)
        self._want_sum = Aggregation.SUM in aggs or Aggregation.MEAN in aggs
        self._want_max = Aggregation.MAX in aggs
        self._want_min = Aggregation.MIN in aggs
        indices = [agg.value - 1 for agg in aggs]
        picker = operator.itemgetter(*indices)
        self._pick: Callable[[tuple[float | int, ...]], tuple[float | int, ...]] = (
            picker if len(indices) > 1 else lambda values: (picker(values),)
        )
        self._window = window_size.total_seconds()
        self._max_samples = max_samples
        self._bus = bus
        self._dirty = bus._dirty_stats(self._window)
        self._lock = threading.Lock()
        self._last: tuple[float | int, ...] = ()  # the last logged window, per aggregation
        self._buf: list[float] | deque[float] = []
        self._open_window(_clock())
        process.stats.add(self)
        bus._watch_stat(self)

    @property
    def name(self) -> str:
        """The name given at construction."""
        return self._name

    @property
    def count(self) -> int:
        """How many values the open window holds (0 right after a window was logged)."""
        if _clock() >= self._end:
            self._roll()
        return self._count + len(self._buf)

    def add(self, v: float) -> None:
        """Add a value to the open window. Thread-safe and lock-free unless a window closes.

        Args:
            v: a real number: ``float``, ``int``, a numpy scalar, or an array or tensor
                holding one element.

        Raises:
            TypeError: ``v`` is not a real number, or holds more than one element.
        """
        if v.__class__ is not float:
            v = _as_float(v)
        if _clock() >= self._end:
            self._roll()
        buf = self._buf
        buf.append(v)
        if len(buf) >= self._fold_at:
            self._fold()

    def get(self) -> dict[Aggregation, float | int]:
        """The aggregates of the last logged window (empty before the first)."""
        if _clock() >= self._end:
            self._roll()
        with self._lock:
            return dict(zip(self._aggregations, self._last, strict=False))  # () before a window

    def __repr__(self) -> str:
        aggs = ", ".join(agg.name for agg in self._aggregations)
        return f"Stat(name={self._name!r}, aggregations=[{aggs}], window={self._window}s)"

    def __del__(self) -> None:
        # Runs at arbitrary allocations; log_event never takes a lock on this path.
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self._close()

    # -- window machinery, all under self._lock except the reads in add --

    def _open_window(self, now: float) -> None:
        window = self._window
        self._end = (math.floor(now / window) + 1) * window
        self._count = 0
        self._sum = 0.0
        self._max = self._min = self._value = math.nan
        if self._buf.__class__ is deque:
            self._buf = []
        # The window's first add folds at once and marks the Stat for the timer: an idle Stat
        # is never visited.
        self._fold_at = 1
        self._marked = False

    def _roll(self) -> None:
        """Close the window if its time is up (called by ``add``, ``get`` and ``count``)."""
        with self._lock:
            now = _clock()
            if now >= self._end:
                self._take()
                self._emit()
                self._open_window(now)

    def _close_on_timer(self, now: float, stamp: datetime) -> None:
        """The dispatcher's timer, for a Stat marked as holding data: close the window if it
        is over and holds data, and unmark the Stat unless its open window holds data.

        An empty window is left for the next ``add`` to roll: nothing to log. ``stamp`` is the
        wall time of the timer pass at clock time ``now``; a window that ended after that (a
        long pass reached it late) is stamped when it closes instead.
        """
        with self._lock:  # marking happens under it too: the mark and the registry agree
            clock = _clock()
            holds_data = bool(self._count or len(self._buf))
            if clock >= self._end and holds_data:
                self._take()
                self._emit(stamp if now >= self._end else None)
                self._open_window(clock)
            elif holds_data:
                return  # its window is still open: the next pass
            self._marked = False
            self._dirty.discard(self)

    def _fold(self) -> None:
        with self._lock:
            self._take()
            if not self._marked:
                self._marked = True
                self._dirty.add(self)
            if self._count >= self._max_samples:
                self._emit()
                # Once full, adds go nowhere until the next window opens.
                self._buf = deque(maxlen=0)
            else:
                self._fold_at = min(_CHUNK, self._max_samples - self._count)

    def _close(self) -> None:
        """Log the open window now (at exit and on collection) if it holds data."""
        with self._lock:
            self._take()
            self._emit()
            self._open_window(_clock())

    def _take(self) -> None:
        """Fold the buffered samples into the window's aggregates."""
        buf = self._buf
        n = len(buf)
        if not n:
            return
        assert isinstance(buf, list)
        taken = n
        chunk = buf[:n]
        room = self._max_samples - self._count
        if n > room:
            chunk = chunk[:room]
            n = room
        # Computed before anything changes: an exception here (a KeyboardInterrupt) leaves
        # the samples in the buffer.
        first = self._count == 0
        total = reduce(operator.add, chunk, self._sum) if self._want_sum else self._sum
        if self._want_max:
            high = max(chunk) if first else max(chain((self._max,), chunk))
        else:
            high = self._max
        if self._want_min:
            low = min(chunk) if first else min(chain((self._min,), chunk))
        else:
            low = self._min
        last = chunk[-1]
        # Committed without a call or a backward jump in between, the only points where
        # CPython runs a signal handler: the samples move from the buffer to the aggregates
        # at once.
        del buf[:taken]
        self._sum = total
        self._max = high
        self._min = low
        self._value = last
        self._count += n

    def _emit(self, stamp: datetime | None = None) -> None:
        count = self._count
        if not count:
            return
        # Every aggregate in Aggregation order, then the requested ones picked by position:
        # the timer closes thousands of windows per pass, so no per-window enum hashing.
        last = self._pick((self._value, self._sum / count, count, self._sum, self._max, self._min))
        data = dict(zip(self._keys, last, strict=True))
        # Queued before the window is emptied: a Ctrl-C in between can log it twice at worst,
        # never lose it.
        self._bus._log_window((STAT_EVENT, stamp or datetime.now(timezone.utc), data))
        self._last = last
        self._count = 0

    def _after_fork(self) -> None:
        """In a forked child: the parent logs the windows it had open, so start empty."""
        self._lock = threading.Lock()
        self._buf = []
        self._open_window(_clock())


def _as_float(v: object) -> float:
    if getattr(v, "ndim", 0):  # an array or tensor: one element only
        v = one_value("v", v)
    cls = v.__class__
    if getattr(cls, "__float__", None) is None or cls is complex or isinstance(v, str):
        raise wrong_type("v", "a real number", v)
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"v must be a real number convertible to float: {exc}") from None
