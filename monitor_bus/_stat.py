"""Windowed summary statistics, cheap to update from a hot loop.

``Stat.add`` takes no lock: it reads the clock, appends the sample to a buffer and, every
``_CHUNK`` samples, folds the buffer into the window's aggregates with C builtins under the
Stat's lock. Folding takes samples from the front of the buffer (``buf[:n]`` then
``del buf[:n]``, each atomic), so a sample appended by another thread while a fold or a close
is running stays in the buffer for the next window instead of being lost. The samples leave
the buffer only once their aggregates are computed, in straight-line code a signal cannot
interrupt, so a Ctrl-C landing in a fold loses nothing.

The numbers' edges (an overflowing sum, a NaN) are handled once per fold, never per add
(``_fold``). The distribution aggregates (percentiles, STDDEV, HISTOGRAM) are folded off the
caller's thread: a folded chunk waits in ``_dist_chunks`` for the dispatcher, which buckets
it under the Stat's lock; the caller folds the waiting chunks itself only once
``_DIST_BACKLOG`` wait (the dispatcher busy or not running), and a window's are all folded
before it is logged, so no sample is left out or counted twice. The chunks are bucketed
into a copy of the window's Histogram, swapped in with the moments and the emptied
``_dist_chunks`` by one statement: a Ctrl-C inside that fold leaves the window as it was
(its chunks still waiting), never a Histogram whose count disagrees with its buckets. A
window's Histogram counts at most 2 x 2048 buckets.

A window's first fold starts a stopped dispatcher that has work, so a forked child's timer
closes the windows of the Stats it inherited; ``_RESOLVING`` is new in a forked child
(``module_lock``).
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
from itertools import chain, repeat
from time import monotonic
from typing import TYPE_CHECKING, Union

from . import _device
from ._buckets import Accumulator
from ._check import check_int, wrong_type
from ._device import ARRAY_CLASSES, Deferred
from ._histogram import Histogram, from_accumulator
from ._lifecycle import module_lock, process

if TYPE_CHECKING:
    from fractions import Fraction

    from ._bus import EventBus

STAT_EVENT = "torch.monitor.Stat"
"""The name of the events a ``Stat`` logs when a window closes (torch.monitor's name)."""

AggregateValue = Union[float, int, Histogram]  # noqa: UP007 - a runtime alias
"""What a window reports per aggregation: a float, COUNT's int or HISTOGRAM's Histogram."""

Moments = tuple[int, float, float, float]
"""``(n, shift, mean, sd)`` of some samples: their mean is ``shift + mean`` (``shift`` is a
sample, so ``mean`` keeps its low digits for samples far from zero; 0.0 for samples spread
wider than the float range) and ``sd`` is their population standard deviation (a root, not a
sum of squares, so it is finite for any finite samples); NaN once a sample is infinite or
NaN."""
_NO_MOMENTS: Moments = (0, 0.0, 0.0, 0.0)

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
    #: The median of the values added, from the window's ``Histogram`` (within 1%).
    P50 = 7
    #: The 90th percentile, from the window's ``Histogram``.
    P90 = 8
    #: The 95th percentile, from the window's ``Histogram``.
    P95 = 9
    #: The 99th percentile, from the window's ``Histogram``.
    P99 = 10
    #: The population standard deviation of the values added, computed stably.
    STDDEV = 11
    #: The window's values as a ``monitor_bus.Histogram``, which merges exactly.
    HISTOGRAM = 12


# The aggregations read from a window's Histogram, with their quantiles.
_QUANTILES = {
    Aggregation.P50: 0.5,
    Aggregation.P90: 0.9,
    Aggregation.P95: 0.95,
    Aggregation.P99: 0.99,
}
_DISTRIBUTION = frozenset((*_QUANTILES, Aggregation.STDDEV, Aggregation.HISTOGRAM))


class Stat:
    """A windowed statistic: values added during a window are logged as one event.

    When a window of ``window_size`` ends with at least one value in it, the Stat logs
    ``Event(STAT_EVENT, now, {"<name>.<aggregation>": value, ...})`` with one key per
    aggregation in lower case (``"step_time.mean"``). Windows are aligned to the monotonic
    clock (to the wall clock once the bus's windows have been merged across processes). A
    window closes on the first ``add`` after its end and, while the bus has handlers, on a
    timer in the dispatcher, so a stalled loop still reports. The add that reaches
    ``max_samples`` logs the window at once; later adds are discarded until the next window.

    P50, P90, P95 and P99 are nearest-rank percentiles of the window's non-NaN values read from
    its ``Histogram`` (within 1% for values spanning up to 32 octaves; see
    ``monitor_bus.Histogram``), HISTOGRAM is that Histogram, and STDDEV the population standard
    deviation, computed stably and to a few roundings for any finite values, huge or tiny
    (NaN with a NaN or infinite value).

    SUM is the float sum in add order (``inf`` once it overflows); MEAN is the mean even then
    (two adds of ``1e308``: SUM ``inf``, MEAN ``1e308``). A NaN among a window's values makes
    MAX and MIN NaN, wherever it was added (as ``numpy.max``; torch.monitor keeps it only when it
    comes first), and SUM and MEAN NaN too.

    A Stat made before ``os.fork()`` starts empty in the child, which logs its own windows: on
    the child's timer (its first value starts it) and at its exit. A Stat of the default bus
    pickles as its definition, without its samples: unpickled (in a spawn or forkserver
    DataLoader worker whose Dataset holds it, or by ``copy.copy`` in the same process) it is a
    new, empty Stat on the default bus of the process that unpickles it.

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
        "_name",
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
        if bus is None:
            bus = process.get_default_bus()
        elif bus not in process.buses:  # every EventBus joins it as it is made
            raise wrong_type("bus", "a monitor_bus.EventBus or None", bus)

        self._name = name
        self._aggregations = tuple(aggs)
        self._keys = tuple(f"{name}.{agg.name.lower()}" for agg in aggs)
        self._want_sum = Aggregation.SUM in aggs or Aggregation.MEAN in aggs
        self._want_max = Aggregation.MAX in aggs
        self._want_min = Aggregation.MIN in aggs
        self._want_hist = any(agg in _QUANTILES or agg is Aggregation.HISTOGRAM for agg in aggs)
        self._want_moments = Aggregation.STDDEV in aggs
        indices = [agg.value - 1 for agg in aggs]
        picker = operator.itemgetter(*indices)
        self._pick: Callable[[tuple[AggregateValue, ...]], tuple[AggregateValue, ...]] = (
            picker if len(indices) > 1 else lambda values: (picker(values),)
        )
        self._window = window_size.total_seconds()
        self._max_samples = max_samples
        self._bus = bus
        self._dirty = bus._dirty_stats(self._window)
        self._lock = threading.Lock()
        self._last: tuple[AggregateValue, ...] = ()  # the last logged window, per aggregation
        # The last closed window while its device values are unread: get() reads them.
        self._last_window: ClosedWindow | None = None
        self._buf: list[float | Deferred] | deque[float] = []
        self._pending: list[Deferred] = []  # device values folded into the open window's count
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

        A torch tensor (any device, any dtype) or an array on a device is not read here: it is
        copied, and the bus reads the copy on a thread of its own, so ``stat.add(loss)`` never
        waits for the device as ``stat.add(loss.item())`` does. Its window is logged once its
        values are read, with the time the window closed.

        Args:
            v: a real number: ``float``, ``int``, a numpy scalar, or an array or tensor
                holding one element.

        Raises:
            TypeError: ``v`` is not a real number, or holds more than one element.
        """
        if v.__class__ is not float:
            v = self._sample(v)  # type: ignore[assignment]  # a Deferred is buffered too
        if _clock() >= self._end:
            self._roll()
        buf = self._buf
        buf.append(v)
        if len(buf) >= self._fold_at:
            self._fold()

    def get(self) -> dict[Aggregation, AggregateValue]:
        """The aggregates of the last logged window (empty before the first): floats, COUNT's
        int and HISTOGRAM's ``Histogram``.

        If that window holds tensor samples the bus has not read yet, they are read here, on
        the caller's thread (waiting for their device), as asked.
        """
        if _clock() >= self._end:
            self._roll()
        with self._lock:
            window = self._last_window
            if window is not None:
                window.data()  # sets _last
            return dict(zip(self._aggregations, self._last, strict=False))  # () before a window

    def __repr__(self) -> str:
        aggs = ", ".join(agg.name for agg in self._aggregations)
        return f"Stat(name={self._name!r}, aggregations=[{aggs}], window={self._window}s)"

    def __reduce__(self) -> tuple[type[Stat], tuple[object, ...]]:
        """Pickle the Stat's definition (name, aggregations, window size, max_samples), not
        its samples: the process that unpickles it (a spawn or forkserver worker given a
        Dataset that holds it) gets a new, empty Stat on its own default bus, which a child
        forwards to its parent; in the same process, a copy on the default bus.

        Raises:
            TypeError: the Stat logs to a bus other than the default bus (a bus does not
                cross processes): make such a Stat in the process that adds to it.
        """
        if self._bus is not process.default_bus:
            raise TypeError(
                f"cannot pickle Stat {self._name!r}: it logs to EventBus {self._bus._name!r}, "
                "not the default bus; make it in the process that adds to it"
            )
        window = timedelta(seconds=self._window)
        return Stat, (self._name, self._aggregations, window, self._max_samples)

    def __del__(self) -> None:
        # Runs at arbitrary allocations; log_event never takes a lock on this path.
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self._close()

    # -- window machinery, all under self._lock except the reads in add --

    def _sample(self, v: object) -> float | Deferred:
        cls = v.__class__
        if cls is not int:
            array = ARRAY_CLASSES.get(cls)
            if array is None:
                array = _device.array_class(cls)
            ndim: object = getattr(v, "ndim", 0)
            if array or ndim:
                # An array or tensor: captured. Scalars (numpy's too) are converted below.
                try:
                    v = _device.capture("v", v)
                except TypeError as exc:
                    raise TypeError(f"{exc} (Stat {self._name!r})") from None
                if v.__class__ is Deferred:
                    return v
                cls = v.__class__
            if getattr(cls, "__float__", None) is None or cls is complex or isinstance(v, str):
                raise wrong_type("v", "a real number", v)
        try:
            return float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"v must be a real number convertible to float: {exc}") from None

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
            waiting = len(self._dist_chunks)
            self._take()
            # The first chunk to wait: the dispatcher folds it (and those after it).
            fold_soon = not waiting and bool(self._dist_chunks)
            first = not self._marked  # the window's first fold
            if first:
                self._marked = True
                self._dirty.add(self)
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
        if (self._want_hist or self._want_moments) and values:
            if len(dist_chunks) >= _DIST_BACKLOG:  # the dispatcher is behind: fold here
                self._fold_distributions()
                dist_chunks = self._dist_chunks
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
        self._dist_chunks = dist_chunks
        self._count += n

    def _fold_distributions(self) -> None:
        """Fold the chunks waiting for the distribution aggregates (under the lock)."""
        chunks = self._dist_chunks
        if not chunks:
            return
        # Folded into a copy of the window's Histogram and swapped in by one statement: a
        # KeyboardInterrupt inside the fold leaves the window as it was, chunks still waiting.
        moments, hist = self._moments, self._hist
        if hist is not None:
            hist = hist.copy()
        for values in chunks:
            moments, hist = _fold_distribution(values, moments, hist, self)
        self._moments, self._hist, self._dist_chunks = moments, hist, []

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
                self,
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

    def _after_fork(self) -> None:
        """In a forked child: the parent logs the windows it had open, so start empty (and
        unmarked: the child's first add marks the Stat and starts the child's timer)."""
        self._lock = threading.Lock()
        self._buf = []
        self._pending = []
        self._dist_chunks = []
        self._dirty.discard(self)
        self._open_window(_clock())


def window_end(now: float, window: float, offset: float) -> float:
    """The end of the window holding ``now`` (Stat clock). Windows are multiples of
    ``window`` on the clock ``now + offset``: 0 aligns them to the monotonic clock, as torch
    does; a merge across processes aligns them to the wall clock."""
    return (math.floor((now + offset) / window) + 1) * window - offset


# The sum scaled by this once it overflows: the scaled sum of 2**63 samples of at most
# sys.float_info.max stays finite, and a power of two scales without rounding.
_SCALE = 2.0**-64

_Aggregates = tuple[float, float, float, float | None]


def _fold(
    values: list[float],
    before: int,
    aggregates: _Aggregates,
    wanted: tuple[bool, bool, bool],
) -> _Aggregates:
    """``(sum, max, min, scaled)`` of ``before`` samples and ``values``, for the aggregates
    wanted.

    SUM is sequential float addition, as torch's. ``scaled`` is None until the sum overflows
    from finite samples; from then on it is the sum times ``_SCALE`` (each chunk added with
    ``math.fsum``), from which MEAN is computed (``_mean``): a window of two 1e308 has SUM inf
    and MEAN 1e308. A NaN makes MAX and MIN NaN, wherever it is among the samples (Python's
    ``max`` keeps a NaN only if it comes first); SUM and MEAN are NaN then too. The checks run
    once per chunk, and their slow paths only for a chunk whose sum is not finite.
    """
    total, high, low, scaled = aggregates
    if not values:
        return aggregates
    want_sum, want_max, want_min = wanted
    probe = 0.0  # a NaN among values makes it NaN
    if want_sum:
        previous = total
        total = reduce(operator.add, values, total)
        if not math.isfinite(total):  # overflow, an infinity or a NaN: rare
            probe = total
            if scaled is not None:
                scaled = _scaled_sum(scaled, values)
            elif math.isfinite(previous) and math.isinf(total) and _all_finite(values):
                # An overflow, not an infinite sample: MEAN goes on from the scaled sum.
                scaled = _scaled_sum(previous * _SCALE, values)
    if not (want_max or want_min):
        return total, high, low, scaled
    if not want_sum:
        probe = sum(values)  # a C loop over floats, cheaper than a NaN test per sample
    if probe != probe and any(map(math.isnan, values)):
        # NaN from now on: with ``before`` samples it comes first below, and max keeps it.
        return total, math.nan, math.nan, scaled
    if want_max:
        high = max(chain((high,), values)) if before else max(values)
    if want_min:
        low = min(chain((low,), values)) if before else min(values)
    return total, high, low, scaled


def _all_finite(values: list[float]) -> bool:
    return all(map(math.isfinite, values))


def _scaled_sum(start: float, values: list[float]) -> float:
    """``start`` plus the scaled ``values``, correctly rounded (a chunk of an overflowed
    window: rare, so the exact sum)."""
    try:
        return math.fsum(chain((start,), map(_SCALE.__mul__, values)))
    except ValueError:  # inf - inf
        return math.nan


def _mean(total: float, scaled: float | None, count: int) -> float:
    """MEAN of a window: from the scaled sum once the sum overflowed."""
    if scaled is None:
        return total / count
    return scaled / count / _SCALE


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


# -- distributions: STDDEV's moments and the percentiles' Histogram --


def merge_moments(a: Moments, b: Moments) -> Moments:
    """The moments of two sets of samples together (Chan et al.'s pairwise update): no
    large sums are subtracted, so samples far from zero (1e9 + noise) keep their precision,
    and the deviations are combined as roots (``math.hypot``), so huge ones do not overflow.

    Args:
        a: the moments of some samples.
        b: the moments of others.

    Returns:
        The moments of both.
    """
    na, shift_a, mean_a, sd_a = a
    nb, shift_b, mean_b, sd_b = b
    if not na:
        return b
    if not nb:
        return a
    n = na + nb
    wa, wb = na / n, nb / n
    delta = (shift_b - shift_a) + (mean_b - mean_a)  # shifts are close samples: exact
    mean = mean_a + delta * wb
    sd = math.hypot(math.sqrt(wa) * sd_a, math.sqrt(wb) * sd_b, math.sqrt(wa * wb) * delta)
    if mean - mean == 0 and sd - sd == 0:  # both finite: the common case
        return (n, shift_a, mean, sd)
    if not all(map(math.isfinite, (shift_a, mean_a, sd_a, shift_b, mean_b, sd_b))):
        return (n, shift_a, mean, math.nan)  # an infinite or NaN sample: its mean stands
    # Finite samples spread near the float range's ends: rare, so exactly.
    from fractions import Fraction

    exact_a = Fraction(shift_a) + Fraction(mean_a)
    exact_b = Fraction(shift_b) + Fraction(mean_b)
    total = (na * exact_a + nb * exact_b) / n
    dev_a, dev_b = Fraction(sd_a), Fraction(sd_b)
    gap_a, gap_b = exact_a - total, exact_b - total
    squares = na * (dev_a * dev_a + gap_a * gap_a) + nb * (dev_b * dev_b + gap_b * gap_b)
    return _exact(n, shift_a, total, squares / n)


def stddev(moments: Moments) -> float:
    """The population standard deviation of samples with these moments (NaN for none, and
    when a sample was NaN or infinite)."""
    n, _, _, sd = moments
    return sd if n else math.nan


def _chunk_moments(values: list[float], shift: float) -> Moments:
    """The moments of a chunk about ``shift``, with C builtins: the samples' distances from
    ``shift`` (exact for samples within a factor 2 of it), their mean correctly rounded
    (``math.fsum``), then the root of their squared deviations from it (``math.dist``,
    without overflow or cancellation) over the root of their number."""
    n = len(values)
    offsets = list(map(operator.sub, values, repeat(shift)))
    try:
        mean = math.fsum(offsets) / n
    except OverflowError:  # an intermediate sum past the float range
        mean = _scaled_sum(0.0, offsets) / n / _SCALE
    except ValueError:  # inf - inf
        mean = math.nan
    if mean - mean != 0:  # an infinite or NaN sample, or an offset past the float range
        if not _all_finite(values):
            return (n, shift, mean, math.nan)
        return _exact_moments(values, shift)
    sd = math.dist(offsets, [mean] * n) / math.sqrt(n)
    if sd == math.inf:  # a deviation past the float range, of finite samples
        return _exact_moments(values, shift)
    return (n, shift, mean, sd)


def _exact_moments(values: list[float], shift: float) -> Moments:
    """The moments of finite samples whose deviations pass the float range (samples near its
    ends, of both signs), in fractions: rare, so exact rather than fast."""
    from fractions import Fraction

    exact = list(map(Fraction, values))
    n = len(exact)
    mean = sum(exact, Fraction(0)) / n
    return _exact(n, shift, mean, sum(((v - mean) * (v - mean) for v in exact), Fraction(0)) / n)


def _exact(n: int, shift: float, mean: Fraction, variance: Fraction) -> Moments:
    """Moments from an exact mean and variance: the mean about ``shift`` if a float holds
    that offset, otherwise about 0.0; the root of the variance to within an ulp."""
    from fractions import Fraction

    try:
        offset = float(mean - Fraction(shift))  # a Fraction minus a float is a float
    except OverflowError:  # the samples span more than the float range
        shift, offset = 0.0, float(mean)
    p, q = variance.numerator, variance.denominator
    # The root of p / q scaled by 2**k to at least 60 bits, by integer square root.
    k = max(0, (121 - p.bit_length() + q.bit_length()) // 2)
    return (n, shift, offset, math.ldexp(float(math.isqrt((p << 2 * k) // q)), -k))


def _fold_distribution(
    values: list[float], moments: Moments, hist: Accumulator | None, stat: Stat
) -> tuple[Moments, Accumulator | None]:
    """A window's moments and Histogram with ``values`` added, for those ``stat`` wants
    (the Histogram's counts grow in place)."""
    if not values:
        return moments, hist
    if stat._want_moments:
        # One shift per window (its first sample), so its chunks' means differ exactly.
        shift = moments[1] if moments[0] else values[0]
        moments = merge_moments(moments, _chunk_moments(values, shift))
    if stat._want_hist:
        if hist is None:
            hist = Accumulator(_MAX_BUCKETS)
        hist.add(values)
    return moments, hist


# Chunks waiting for the dispatcher to fold their distribution aggregates before the
# caller's thread folds them itself: bounds an open window's memory if the dispatcher is busy
# or not running.
_DIST_BACKLOG = 8

# Buckets per sign of a window's Histogram: scale 6 (percentiles within 0.54%) for values
# spanning up to 32 octaves; the open window's Histogram holds at most twice this many counts.
_MAX_BUCKETS = 2048


def distribution(moments: Moments, hist: Histogram | None) -> tuple[AggregateValue, ...]:
    """P50, P90, P95, P99, STDDEV and HISTOGRAM of a window (or of merged windows) from its
    moments and Histogram, in ``Aggregation`` order (``picked`` positions 6 to 11).

    Args:
        moments: the samples' ``Moments`` (``_NO_MOMENTS`` if STDDEV is not reported).
        hist: the samples' Histogram, or None if no percentile or HISTOGRAM is reported.

    Returns:
        The six values; NaN percentiles and an empty Histogram without ``hist``.
    """
    if hist is None:
        quantiles = (math.nan,) * len(_QUANTILES)
    else:
        quantiles = tuple(hist.quantile(q) for q in _QUANTILES.values())
    return (*quantiles, stddev(moments), hist if hist is not None else Histogram())


def _histogram_of(accumulator: Accumulator | None) -> Histogram | None:
    return None if accumulator is None else from_accumulator(accumulator)
