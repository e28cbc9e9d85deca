"""The queue between producers and the dispatcher: one home for its protocol.

Protocol
--------
- Slots: a ``deque`` of flat ``name, timestamp, data`` triples, no per-event object the GC
  tracks (a backlog of tracked objects triggers full collections: 80 ms each in a process that
  has imported torch).
- Timestamps: ``EventBus.log`` queues ``time.time()`` as a float, and it stays one on its
  way to the handlers: an ``Event`` makes it a ``datetime`` when its ``timestamp`` is first
  read (``_event``), and the bundled sinks write it from the float (a JSONL line's text, a
  TensorBoard wall time), so no ``datetime`` is made for an event nobody reads the time of.
- Adding: a producer appends a whole event with one ``extend`` (one C call, so events of
  concurrent producers never interleave). That is the whole hot path: ``EventBus.log_event``
  does it inline while ``len(slots) < crowded`` (half the capacity; 1,024 events while the
  dispatcher's linger is grown, see ``_dispatcher.py``); past that it appends and hurries the
  dispatcher out of its linger, and calls ``put_full`` once ``limit`` is reached.
- Removing from the head (the dispatcher's ``take``, ``drop_oldest``'s eviction) happens under
  ``space`` and never re-entrantly on one thread: a finalizer or signal handler that logs while
  its thread is removing never removes (it appends, or, with the queue full, drops its own
  event and counts it), so the slots of one event are never split (which would pair one
  event's name with the next one's data).
- Device values (``_device.py``) travel unread: an event holding some has a ``DeferredData``,
  a window a ``PendingWindow``. The dispatcher reads them as it takes events (``resolve_ready``,
  in order; the events from the first one whose device is not done wait for it), so handlers
  only ever get plain values.
- Events from child processes carry their origin in their data's class: a ``RemoteData`` (or
  a ``WindowData``) has an ``origin`` attribute, which handlers get as ``Event.origin``.
- The relay never waits: it puts with ``put_nowait``. Under ``"block"`` with no room, what it
  read waits in ``parked`` (in order, at most what it read from each child in one round) and
  the relay reads no more from that child; removing from the head calls ``on_room`` while
  anything is parked, and so does ``close`` (parked events then count as dropped).
- A Stat window does not wait for the dispatcher's linger: ``put_window`` calls ``on_window``
  (the dispatcher's ``window_queued``), which ends the linger or wakes the idle dispatcher.
- Stat windows are never dropped under any policy: their data is a ``WindowData``, queued past
  the limit (at most one event per Stat per window) and skipped by eviction. Memory still has
  a bound: at most ``WINDOW_ALLOWANCE`` windows past the limit, in the queue and in each
  handler's backlog; only a consumer that has taken nothing for that long (100,000 windows:
  a day of 1 s windows of one Stat) has windows dropped, counted like any event.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ._device import Deferred
from ._event import DeferredData, resolved
from ._lifecycle import in_bus_thread

# Stat windows kept past the capacity, in the queue and in each handler's backlog (~30 MB).
WINDOW_ALLOWANCE = 100_000

# An event's (name, timestamp, data). Queues and batches hold these slots flat, SLOTS per event.
# A timestamp is a datetime, or ``time.time()`` as a float (``EventBus.log``).
_Item = tuple[str, datetime | float, dict[str, Any]]
SLOTS = 3


def count_events(slots: int) -> int:
    """Events in ``slots`` flat slots."""
    return slots // SLOTS


def first_events(flat: list[Any], n: int) -> list[Any]:
    """The first ``n`` events of a flat slot list."""
    return flat[: SLOTS * n]


def events_after(flat: list[Any], n: int) -> list[Any]:
    """A flat slot list without its first ``n`` events."""
    return flat[SLOTS * n :]


class WindowData(dict):  # type: ignore[type-arg]
    """The data of a Stat window: never dropped. Handlers get a plain ``dict`` copy, in an
    ``Event`` whose ``origin`` is this one's (None: a window of this process)."""

    __slots__ = ("origin",)
    origin: Any


class PendingWindow(WindowData):
    """The data of a Stat window whose device values are not read yet: ``resolve_ready`` makes
    it a ``WindowData``. Pickled (to a parent process) as that data, read then."""

    __slots__ = ("window",)
    window: Any  # the _window.ClosedWindow

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.window.data(),))


# The data classes of Stat windows, which no overflow policy drops.
_WINDOWS = (WindowData, PendingWindow)


def resolve_ready(
    flat: list[Any], *, wait: bool
) -> tuple[list[Any], list[Any], list[tuple[str, Exception]]]:
    """Read the device values in the events of ``flat``, in order; return the events ready
    for handlers, the rest (from the first one whose device is not done; none if ``wait``:
    then this waits for the devices), and the name and error of each event left out because
    a value could not be read."""
    kinds = flat[2::SLOTS]
    if DeferredData not in map(type, kinds) and PendingWindow not in map(type, kinds):
        return flat, [], []
    failed: list[tuple[str, Exception]] = []
    for i, data in enumerate(kinds):
        cls = data.__class__
        if cls is not DeferredData and cls is not PendingWindow:
            continue
        try:
            if cls is DeferredData:
                if not wait and not all(
                    v.ready() for v in data.values() if v.__class__ is Deferred
                ):
                    return _kept(flat, i), events_after(flat, i), failed
                flat[SLOTS * i + 2] = resolved(data)
            else:
                window = data.window
                if not wait and not window.ready():
                    return _kept(flat, i), events_after(flat, i), failed
                ready = WindowData(window.data())
                ready.origin = data.origin
                flat[SLOTS * i + 2] = ready
        except Exception as exc:  # noqa: BLE001 - a device error must not end delivery
            failed.append((flat[SLOTS * i], exc))
            flat[SLOTS * i + 2] = None  # left out below
    return _kept(flat, count_events(len(flat))), [], failed


def _kept(flat: list[Any], n: int) -> list[Any]:
    """The first ``n`` events of ``flat`` but those whose values could not be read."""
    head = first_events(flat, n)
    if None not in head[2::SLOTS]:
        return head
    return [
        s
        for i in range(n)
        if head[SLOTS * i + 2] is not None
        for s in head[SLOTS * i : SLOTS * (i + 1)]
    ]


def wait_for_devices(flat: list[Any]) -> None:
    """Read every device value in ``flat``, waiting for the devices (a worker thread)."""
    for data in flat[2::SLOTS]:
        # A read that fails here fails again on the loop, which counts it.
        with contextlib.suppress(Exception):
            if data.__class__ is DeferredData:
                for v in data.values():
                    if v.__class__ is Deferred:
                        v.wait()
            elif data.__class__ is PendingWindow:
                data.window.wait()


def device_values(flat: Any) -> int:
    """How many device values the events of ``flat`` hold unread."""
    n = 0
    for data in flat:
        if data.__class__ is DeferredData:
            n += sum(1 for v in data.values() if v.__class__ is Deferred)
        elif data.__class__ is PendingWindow:
            n += len(data.window.pending)
    return n


class RemoteData(dict):  # type: ignore[type-arg]
    """The data of an event a child process sent: it carries the event's ``origin``."""

    __slots__ = ("origin",)
    origin: Any


def has_window(flat: list[Any]) -> bool:
    """Whether a flat slot list holds a Stat window (one C-level scan of its data slots)."""
    kinds = list(map(type, flat[2::SLOTS]))
    return WindowData in kinds or PendingWindow in kinds


def drop_events(flat: list[Any], k: int, *, newest: bool) -> tuple[list[Any], int]:
    """Drop up to ``k`` events from the front (or, if ``newest``, the back) of ``flat``,
    keeping Stat windows; return what is kept and how many were dropped."""
    n = count_events(len(flat))
    k = min(k, n)
    region = events_after(flat, n - k) if newest else first_events(flat, k)
    if not has_window(region):
        return (first_events(flat, n - k) if newest else events_after(flat, k)), k
    order = range(n - 1, -1, -1) if newest else range(n)
    keep = [True] * n
    dropped = 0
    for i in order:
        if dropped == k:
            break
        if flat[SLOTS * i + 2].__class__ not in _WINDOWS:
            keep[i] = False
            dropped += 1
    kept = [slot for i in range(n) if keep[i] for slot in flat[SLOTS * i : SLOTS * (i + 1)]]
    return kept, dropped


class EventQueue:
    """Producers' side of a bus: the slots, the overflow policy and its counters."""

    def __init__(self, capacity: int, overflow: str, block_timeout: float | None) -> None:
        self.slots: deque[Any] = deque()
        self.limit = SLOTS * capacity
        # Past half the capacity a producer hurries the dispatcher out of its linger (past
        # fewer while the linger is grown: see ``Dispatcher._grow_linger``).
        self.half = self.crowded = SLOTS * max(1, capacity // 2)
        self.overflow = overflow
        self.block_timeout = block_timeout
        # Guards removal from the head and the counters; producers blocked on a full queue
        # wait on it. Reentrant: a finalizer may count a drop while its thread holds it.
        self.space = threading.Condition(threading.RLock())
        # Set while a thread removes from the head (under ``space``, so only that thread can
        # see it set: a finalizer or signal handler re-entering on it).
        self._removing = False
        # How many events at the head are known to be windows: eviction starts past them. Only
        # removal from the head (under ``space``) shortens that run; appends never do.
        self._head_windows = 0
        self.dropped = 0  # events the queue turned away (no handler got them)
        self.dropped_said = 0  # of those, warned about where they were dropped
        self.dropped_by_children = 0  # of those, reported by child processes
        self.consumed = 0  # events the dispatcher took
        self.blocked = 0  # producers waiting for room
        self.closed = False
        self.stalled = False  # no dispatcher could start: nothing makes room
        # Events the relay read under "block" with no room: (item, origin, window), in order.
        # Only the relay's thread adds or removes them.
        self.parked: deque[tuple[_Item, Any, bool]] = deque()
        # Wakes the relay when room appears (or the queue closes) while events are parked.
        self.on_room: Callable[[], None] | None = None
        # Called once a Stat window is queued: the dispatcher hands it over without lingering.
        self.on_window: Callable[[], None] | None = None

    def __len__(self) -> int:
        """Events queued."""
        return count_events(len(self.slots))

    def put_full(self, item: _Item) -> None:
        """``log_event``'s slow path: the queue is full."""
        if self.overflow == "block" and not in_bus_thread() and not self.stalled:
            slots, limit = self.slots, self.limit
            with self.space:
                self.blocked += 1
                try:
                    if (
                        self.space.wait_for(
                            lambda: len(slots) < limit or self.closed or self.stalled,
                            self.block_timeout,
                        )
                        and not self.closed
                        and not self.stalled
                    ):
                        slots.extend(item)
                        return
                finally:
                    self.blocked -= 1
        self._drop(item)

    def put_nowait(self, item: _Item) -> bool:
        """The relay's put: never waits. False (nothing queued) when ``"block"`` finds no room;
        otherwise queued or dropped as the policy says."""
        if len(self.slots) < self.limit:
            self.slots.extend(item)
            return True
        if self.overflow == "block" and not self.closed:
            return False
        self._drop(item)
        return True

    def put_window(self, item: _Item, origin: Any = None) -> None:
        """Queue a Stat window past the limit: it may summarize millions of samples."""
        data = item[2]
        if data.__class__ is not PendingWindow:
            data = WindowData(data)
        data.origin = origin
        window = (item[0], item[1], data)
        if len(self.slots) < self.limit + SLOTS * WINDOW_ALLOWANCE:  # read here: tests lower it
            self.slots.extend(window)
        else:
            self._drop(window)
        on_window = self.on_window
        if on_window is not None:
            on_window()

    def _drop(self, item: _Item) -> None:
        with self.space:
            if self.overflow == "drop_oldest" and not self._removing:
                self._removing = True
                try:
                    evicted = self._evict_oldest()
                finally:
                    self._removing = False
                if evicted:
                    self.slots.extend(item)
            self.dropped += 1

    def _evict_oldest(self) -> bool:
        """Remove the oldest event that is not a Stat window (under ``space``, removing)."""
        slots = self.slots
        start = SLOTS * self._head_windows
        if not start and slots and slots[2].__class__ not in _WINDOWS:
            pop = slots.popleft
            pop()
            pop()
            pop()
            return True
        for i in range(start, len(slots), SLOTS):
            if slots[i + 2].__class__ not in _WINDOWS:
                for _ in range(SLOTS):
                    del slots[i]  # one C call each; appends happen at the other end
                return True
            self._head_windows += 1
        return False

    def take(self, n: int) -> list[Any]:
        """Remove the ``n`` oldest events (the dispatcher's side), as flat slots."""
        with self.space:
            self._removing = True
            try:
                n = min(n, count_events(len(self.slots)))
                pop = self.slots.popleft
                batch = [pop() for _ in range(SLOTS * n)]
            finally:
                self._removing = False
            self._head_windows = max(0, self._head_windows - n)
            self.consumed += n
            if self.blocked:
                self.space.notify_all()
        if self.parked:
            self._room()
        return batch

    def _room(self) -> None:
        on_room = self.on_room
        if on_room is not None:
            on_room()

    def count_dropped(self, n: int, *, said: bool = False, by_children: bool = False) -> None:
        """Count ``n`` events dropped on their way here: ``said`` if a warning was given where
        they were dropped, ``by_children`` if child processes reported them (neither: the
        queue was full)."""
        with self.space:
            self.dropped += n
            if said:
                self.dropped_said += n
            if by_children:
                self.dropped_by_children += n

    def count_unreadable(self, n: int) -> None:
        """Count ``n`` events taken whose device values could not be read as dropped."""
        with self.space:
            self.consumed -= n
            self.dropped += n

    def discard(self) -> int:
        """Count everything queued as dropped and clear it; return how many events."""
        with self.space:
            lost = count_events(len(self.slots))
            self.slots.clear()
            self._head_windows = 0
            self.dropped += lost
        return lost

    def stall(self, stalled: bool) -> None:
        """Mark whether no dispatcher could start: producers under ``"block"`` then drop
        instead of waiting for room that nothing makes."""
        if stalled != self.stalled:
            with self.space:
                self.stalled = stalled
                self.space.notify_all()

    def close(self) -> None:
        """Wake blocked producers: they drop their event instead of waiting."""
        with self.space:
            self.closed = True
            self.space.notify_all()
        self._room()  # the relay drops what it parked
