"""A Stat's windows: the open window its samples fold into, and the closed window it logs.

Folding takes samples from the front of the buffer (``buf[:n]`` then ``del buf[:n]``, each
atomic), so a sample appended by another thread while a fold or a close is running stays in
the buffer for the next window instead of being lost. The samples leave the buffer only once
their aggregates are computed, in straight-line code a signal cannot interrupt, so a Ctrl-C
landing in a fold loses nothing.

The distribution aggregates (percentiles, STDDEV, HISTOGRAM) of a chunk numpy takes
(``_vectorized``: where it is installed, a chunk of finite samples) are folded by the caller,
with the chunks waiting before it: in numpy that costs less than handing the chunk over (its
calls release the interpreter lock, so two threads would trade it back and forth). Any other
chunk is folded off the caller's thread: it waits in ``_dist_chunks`` for the dispatcher,
which buckets it under the Stat's lock; the caller folds the waiting chunks itself only once
``_DIST_BACKLOG`` wait (the dispatcher busy or not running), and a window's are all folded
before it is logged, so no sample is left out or counted twice. The chunks are bucketed into
a copy of the window's Histogram, swapped in with the moments and the emptied
``_dist_chunks`` by one statement: a Ctrl-C inside that fold leaves the window as it was (its
chunks still waiting), never a Histogram whose count disagrees with its buckets.

A window's first fold starts a stopped dispatcher that has work, so a forked child's timer
closes the windows of the Stats it inherited; ``_RESOLVING`` is new in a forked child
(``module_lock``).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, cast

from . import _device, _vectorized
from ._aggregates import (
    _NO_MOMENTS,
    AggregateValue,
    Moments,
    _Aggregates,
    _fold,
    _fold_distribution,
    _histogram_of,
    _mean,
    distribution,
)
from ._buckets import Accumulator
from ._device import Deferred
from ._histogram import Histogram
from ._lifecycle import module_lock

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._lifecycle import WeakRegistry
    from ._stat import Stat

STAT_EVENT = "torch.monitor.Stat"
"""The name of the events a ``Stat`` logs when a window closes (torch.monitor's name)."""

# Samples buffered before they are folded: bounds a window's memory whatever the add rate.
_CHUNK = 4096

# Chunks waiting for the dispatcher to fold their distribution aggregates before the
# caller's thread folds them itself: bounds an open window's memory if the dispatcher is busy
# or not running.
_DIST_BACKLOG = 8


def window_end(now: float, window: float, offset: float) -> float:
    """The end of the window holding ``now`` (Stat clock). Windows are multiples of
    ``window`` on the clock ``now + offset``: 0 aligns them to the monotonic clock, as torch
    does; a merge across processes aligns them to the wall clock."""
    return (math.floor((now + offset) / window) + 1) * window - offset


class WindowFold:
    """The open window of a ``Stat``: its samples folded into its aggregates, and the window
    logged (or handed to the bus as a ``ClosedWindow``) when it closes. A mixin of ``Stat``,
    whose slots hold its state, all changed under the Stat's lock except the reads in
    ``Stat.add``."""

    __slots__ = (
        "_buf",
        "_bus",
        "_count",
        "_dirty",
        "_dist_chunks",
        "_end",
        "_fold_at",
        "_hist",
        "_keys",
        "_last",
        "_last_window",
        "_lock",
        "_marked",
        "_max",
        "_max_samples",
        "_min",
        "_moments",
        "_pending",
        "_sum",
        "_value",
        "_pick",
        "_scaled",
        "_want_hist",
        "_want_max",
        "_want_min",
        "_want_moments",
        "_want_sum",
        "_window",
    )

    # Set by Stat.__init__: what the window folds and where it logs.
    _bus: EventBus
    _window: float  # a window's length, in seconds
    _max_samples: int
    _want_sum: bool
    _want_max: bool
    _want_min: bool
    _want_hist: bool
    _want_moments: bool
    _keys: tuple[str, ...]
    _pick: Callable[[tuple[AggregateValue, ...]], tuple[AggregateValue, ...]]
    _dirty: WeakRegistry[Stat]
    _lock: threading.Lock
    _last: tuple[AggregateValue, ...]  # the last logged window, per aggregation
    # The last closed window while its device values are unread: get() reads them.
    _last_window: ClosedWindow | None
    _buf: list[float | Deferred] | deque[float]
    _pending: list[Deferred]  # device values folded into the open window's count

    def _open_window(self, now: float) -> None:
        self._end = window_end(now, self._window, self._bus._clock_offset)
        self._count = 0
        self._sum = 0.0
        self._scaled: float | None = None  # see _fold
        self._max = self._min = math.nan
        self._value: float | Deferred = math.nan
        self._moments: Moments = _NO_MOMENTS
        self._hist: Accumulator | None = None  # the percentiles' and HISTOGRAM's
        # Chunks the distribution aggregates have still to fold (on the dispatcher's thread).
        self._dist_chunks: list[list[float]] = []
        if self._buf.__class__ is deque:
            self._buf = []
        # The window's first add folds at once and marks the Stat for the timer: an idle Stat
        # is never visited.
        self._fold_at = 1
        self._marked = False

    def _fold(self) -> None:
        with self._lock:
            waiting = len(self._dist_chunks)
            self._take()
            # The first chunk to wait: the dispatcher folds it (and those after it).
            fold_soon = not waiting and bool(self._dist_chunks)
            first = not self._marked  # the window's first fold
            if first:
                self._marked = True
                self._dirty.add(cast("Stat", self))
            if self._count >= self._max_samples:
                self._emit()
                # Once full, adds go nowhere until the next window opens.
                self._buf = deque(maxlen=0)
            else:
                self._fold_at = min(_CHUNK, self._max_samples - self._count)
        if len(self._pending) >= _CHUNK:
            # Device values hold memory until read: the dispatcher reads those that are ready
            # now rather than at the window's end.
            self._bus._dispatcher.call_soon(self._read_pending)
        if fold_soon:  # not under the lock: on the dispatcher's thread this runs it now
            self._bus._dispatcher.call_soon(self._fold_distributions_soon)
        uplink = self._bus._uplink
        if first and uplink is not None and not self._bus._relay_index:
            # Known to the parent from now: it asks for the open windows before it closes.
            uplink.announce(self._bus)
        if first and self._bus._dispatcher.loop is None:
            # Stopped: a forked child's, which nothing else starts for a Stat it inherited.
            self._bus._dispatcher.start_for_stats()

    def _read_pending(self) -> None:
        """Fold the open window's device values that are ready into its aggregates (on the
        dispatcher's thread)."""
        with self._lock:
            pending = self._pending
            n = 0
            for v in pending:  # the oldest first: stop at the first the device is not done with
                if not v.ready():
                    break
                n += 1
            if not n:
                return
            ready = pending[:n]
            total, high, low, scaled = _fold(
                [float(v.value()) for v in ready],
                self._count - len(pending),
                (self._sum, self._max, self._min, self._scaled),
                (self._want_sum, self._want_max, self._want_min),
            )
            if self._want_hist or self._want_moments:
                self._moments, self._hist = _fold_distribution(
                    [float(v.value()) for v in ready], self._moments, self._hist, self
                )
            self._pending = pending[n:]
            self._sum, self._max, self._min, self._scaled = total, high, low, scaled
            value = self._value
            if value.__class__ is Deferred and value._value is not _device.UNREAD:
                self._value = float(value._value)

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
        pending = self._pending
        if _device.used and Deferred in map(type, chunk):  # read later, on a thread of the bus
            pending = pending + [v for v in chunk if v.__class__ is Deferred]
            values: list[float] = [v for v in chunk if v.__class__ is not Deferred]  # type: ignore[misc]
        else:
            values = chunk  # type: ignore[assignment]
        total, high, low, scaled = _fold(
            values,
            self._count - len(self._pending),
            (self._sum, self._max, self._min, self._scaled),
            (self._want_sum, self._want_max, self._want_min),
        )
        dist_chunks = self._dist_chunks
        moments, hist = self._moments, self._hist
        if (self._want_hist or self._want_moments) and values:
            array = _vectorized.array(values)
            if array is not None:
                # numpy buckets a chunk for less than handing it over costs (its calls
                # release the interpreter lock, so the two threads trade it back and forth):
                # folded here, after the chunks waiting.
                moments, hist = self._folded(dist_chunks)
                moments, hist = _fold_distribution(values, moments, hist, self, array)
                dist_chunks = []
            elif len(dist_chunks) >= _DIST_BACKLOG:  # the dispatcher is behind: fold here
                moments, hist = self._folded(dist_chunks)
                dist_chunks = [values]
            else:
                dist_chunks = dist_chunks + [values]
        last = chunk[-1]
        # Committed without a call or a backward jump in between, the only points where
        # CPython runs a signal handler: the samples move from the buffer to the aggregates
        # at once.
        del buf[:taken]
        self._pending = pending
        self._sum = total
        self._scaled = scaled
        self._max = high
        self._min = low
        self._value = last
        self._moments, self._hist, self._dist_chunks = moments, hist, dist_chunks
        self._count += n

    def _fold_distributions(self) -> None:
        """Fold the chunks waiting for the distribution aggregates (under the lock)."""
        if self._dist_chunks:
            # Swapped in by one statement: a KeyboardInterrupt inside the fold leaves the
            # window as it was, chunks still waiting.
            self._moments, self._hist, self._dist_chunks = (*self._folded(self._dist_chunks), [])

    def _folded(self, chunks: list[list[float]]) -> tuple[Moments, Accumulator | None]:
        """The window's moments and Histogram with ``chunks`` folded in, the window's own
        left as they were: the Histogram is a copy, to swap in."""
        moments, hist = self._moments, self._hist
        if hist is not None:
            hist = hist.copy()
        for values in chunks:
            moments, hist = _fold_distribution(values, moments, hist, self)
        return moments, hist

    def _fold_distributions_soon(self) -> None:
        """The dispatcher's side of the distribution aggregates: bucketing off the caller's
        thread."""
        with self._lock:
            self._fold_distributions()

    def _emit(self, stamp: datetime | None = None) -> None:
        count = self._count
        if not count:
            return
        self._fold_distributions()
        bus = self._bus
        if self._pending or bus._window_tap is not None:
            closed = ClosedWindow(
                cast("Stat", self),
                stamp or datetime.now(timezone.utc),
                self._end + bus._clock_offset,
                count,
                (self._sum, self._max, self._min, self._scaled),
                self._value,
                self._pending,
                (self._moments, self._hist),
            )
            if self._pending:
                self._last_window = closed
            else:
                self._last, self._last_window = closed.picked(), None
            bus._window_closed(closed)
            self._pending = []
            self._count = 0
            return
        # Every aggregate in Aggregation order, then the requested ones picked by position:
        # the timer closes thousands of windows per pass, so no per-window enum hashing.
        total = self._sum
        mean = _mean(total, self._scaled, count)
        values: tuple[AggregateValue | Deferred, ...] = (
            self._value,
            mean,
            count,
            total,
            self._max,
            self._min,
        )
        if self._want_hist or self._want_moments:
            values += distribution(self._moments, _histogram_of(self._hist))
        last = self._pick(values)  # type: ignore[arg-type]  # no device value pending: a float
        data = dict(zip(self._keys, last, strict=True))
        # Queued before the window is emptied: a Ctrl-C in between can log it twice at worst,
        # never lose it.
        self._bus._log_window((STAT_EVENT, stamp or datetime.now(timezone.utc), data))
        self._last, self._last_window = last, None
        self._count = 0


# Held while a closed window's device values are folded in (see ClosedWindow.resolve); new
# in a forked child.
_RESOLVING = module_lock(__name__, "_RESOLVING")


class ClosedWindow:
    """A closed window of a Stat, with every aggregate (a merge across processes needs those
    the Stat does not report) and the device values it still has to read."""

    __slots__ = (
        "count",
        "end",
        "high",
        "_accumulator",
        "low",
        "moments",
        "pending",
        "scaled",
        "stamp",
        "stat",
        "total",
        "value",
    )

    def __init__(
        self,
        stat: Stat,
        stamp: datetime,
        end: float,
        count: int,
        aggregates: _Aggregates,
        value: float | Deferred,
        pending: list[Deferred],
        distribution: tuple[Moments, Accumulator | None] = (_NO_MOMENTS, None),
    ) -> None:
        self.stat = stat
        self.stamp = stamp  # when it closed: the event's timestamp
        self.end = end  # its end, in seconds on the clock its windows are aligned to
        self.count = count
        self.total, self.high, self.low, self.scaled = aggregates
        self.value = value
        self.pending = pending
        #: ``Moments`` of the window's samples, for STDDEV: ``merge_moments`` combines two
        #: windows' (Chan et al.), ``stddev`` reads them. ``(0, 0.0, 0.0, 0.0)`` unless the
        #: Stat reports STDDEV.
        self.moments: Moments = distribution[0]
        self._accumulator = distribution[1]

    def ready(self) -> bool:
        """Whether its device values can be read without waiting for a device."""
        return all(v.ready() for v in self.pending)

    def wait(self) -> None:
        """Read its device values, waiting for their devices (a worker thread of the bus)."""
        for v in self.pending:
            v.wait()

    def resolve(self) -> None:
        """Fold its device values into the aggregates (a thread of the bus, once ready)."""
        if not self.pending:
            return
        # A window a merge keeps locally too is resolved by the bus and by the merge: once.
        with _RESOLVING:
            pending = self.pending
            if not pending:
                return
            stat = self.stat
            values = [float(v.value()) for v in pending]
            self.total, self.high, self.low, self.scaled = _fold(
                values,
                self.count - len(pending),
                (self.total, self.high, self.low, self.scaled),
                (stat._want_sum, stat._want_max, stat._want_min),
            )
            if stat._want_hist or stat._want_moments:
                self.moments, self._accumulator = _fold_distribution(
                    values, self.moments, self._accumulator, stat
                )
            if self.value.__class__ is Deferred:
                self.value = float(self.value.value())
            self.pending = []

    @property
    def histogram(self) -> Histogram | None:
        """The window's samples as a Histogram (after ``resolve``), for the percentiles and
        HISTOGRAM; None unless the Stat reports one of them. ``Histogram.merge`` combines two
        windows' exactly."""
        return _histogram_of(self._accumulator)

    def aggregates(self) -> tuple[AggregateValue, ...]:
        """Every aggregate, in ``Aggregation`` order (after ``resolve``); the distribution's
        only if the Stat reports one."""
        count = self.count
        mean = _mean(self.total, self.scaled, count)
        values: tuple[AggregateValue | Deferred, ...] = (
            self.value,
            mean,
            count,
            self.total,
            self.high,
            self.low,
        )
        if self.stat._want_hist or self.stat._want_moments:
            values += distribution(self.moments, self.histogram)
        return values  # type: ignore[return-value]

    def picked(self) -> tuple[AggregateValue, ...]:
        """The Stat's aggregates, in its order."""
        return self.stat._pick(self.aggregates())

    def data(self) -> dict[str, AggregateValue]:
        """The event data of the window (reading its device values first); the Stat's
        ``get()`` returns these aggregates from now on."""
        self.wait()
        self.resolve()
        last = self.picked()
        stat = self.stat
        if stat._last_window is self:  # not an older window read late
            stat._last, stat._last_window = last, None
        return dict(zip(stat._keys, last, strict=True))
