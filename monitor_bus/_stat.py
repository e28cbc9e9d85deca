"""Windowed summary statistics, cheap to update from a hot loop.

``Stat.add`` takes no lock: it reads the clock, appends the sample to a buffer and, every
``_CHUNK`` samples, folds the buffer into the window's aggregates with C builtins under the
Stat's lock.

A Stat checks its arguments when it is made and its samples when they are added; the window's
fold and its closing are ``_window``'s (``WindowFold``, which Stat mixes in), the aggregates'
arithmetic ``_aggregates``'s. A Stat crosses a pickle as its definition (``Stat.__reduce__``)
and starts empty in a forked child (``Stat._after_fork``).
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterable
from datetime import datetime, timedelta
from time import monotonic
from typing import TYPE_CHECKING

from . import _device
from ._aggregates import _QUANTILES, AggregateValue, Aggregation
from ._check import check_int, wrong_type
from ._device import ARRAY_CLASSES, Deferred
from ._lifecycle import process
from ._window import WindowFold

if TYPE_CHECKING:
    from ._bus import EventBus

# The window clock, a module attribute so tests can step time without sleeping (the
# dispatcher's timer reads it too).
_clock = monotonic


class Stat(WindowFold):
    """A windowed statistic: values added during a window are logged as one event.

    When a window of ``window_size`` ends with at least one value in it, the Stat logs
    ``Event(STAT_EVENT, now, {"<name>.<aggregation>": value, ...})`` with one key per
    aggregation in lower case (``"step_time.mean"``). Windows are aligned to the monotonic
    clock (to the wall clock once the bus's windows have been merged across processes). A
    window closes on the first ``add`` after its end and, while the bus has handlers, on a
    timer in the dispatcher, so a stalled loop still reports. The add that reaches
    ``max_samples`` logs the window at once; later adds are discarded until the next window.

    P50, P90, P95 and P99 are nearest-rank percentiles of the window's non-NaN values read from
    its ``Histogram`` (within 0.54% for values spanning up to 32 octaves; see
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

    __slots__ = ("__weakref__", "_aggregations", "_name")  # the window's are WindowFold's

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
        self._pick = picker if len(indices) > 1 else lambda values: (picker(values),)
        self._window = window_size.total_seconds()
        self._max_samples = max_samples
        self._bus = bus
        self._dirty = bus._dirty_stats(self._window)
        self._lock = threading.Lock()
        self._last = ()
        self._last_window = None
        self._buf = []
        self._pending = []
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

    def _close(self) -> None:
        """Log the open window now (at exit and on collection) if it holds data."""
        with self._lock:
            self._take()
            self._emit()
            self._open_window(_clock())

    def _after_fork(self) -> None:
        """In a forked child: the parent logs the windows it had open, so start empty (and
        unmarked: the child's first add marks the Stat and starts the child's timer)."""
        self._lock = threading.Lock()
        self._buf = []
        self._pending = []
        self._dist_chunks = []
        self._dirty.discard(self)
        self._open_window(_clock())
