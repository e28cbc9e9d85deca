"""What child processes send a bus: queued as its own events are, never holding up the relay.

Guarantees
----------
- Same queue: an event from a child is queued with the bus's policy and counters, with the
  child's ``origin`` on it. The relay's thread never waits: under ``"block"`` with no room an
  event is parked, and the relay reads no more from that child until it is queued, in order.
- Closing: from ``close()`` on, what child processes send is queued even past the capacity
  under ``"block"``, rather than held in the relay (``close()`` bounds the wait for it).
- Late: what children send a closed bus is counted as dropped and said in a warning (at most
  once per 10 s per bus, and once more as the relay closes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from ._lifecycle import process
from ._queue import RemoteData
from ._ratelimit import Throttle

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._dispatcher import Dispatcher
    from ._event import EventOrigin
    from ._handler import _Handler
    from ._queue import EventQueue, _Item

logger = logging.getLogger("monitor_bus")

# Reports events child processes sent to a bus after it closed (per bus).
_LATE = Throttle()


class ChildIntake:
    """The side of an ``EventBus`` that the relay feeds; the bus mixes it in and sets the
    state it reads."""

    # Set by EventBus: its name and identity, its queue and dispatcher, and the counts and
    # flags of what children sent.
    _name: str
    _creator: tuple[int, int]
    _queue: EventQueue
    _dispatcher: Dispatcher
    _handlers: tuple[_Handler, ...]
    _idle: bool
    _closed: bool
    _closing: bool
    _unhandled: int
    _from_children: int
    _late_dropped: int
    _late_said: int

    def _relay_in(self, item: _Item, origin: EventOrigin | None, window: bool) -> None:
        """``log_event`` for what a child process sent (the relay's thread): the same queue,
        policy and counters, with the child's ``origin`` on the event. Never waits: under
        ``"block"`` with no room the event is parked (``EventQueue.parked``), and the relay
        reads no more from that child until ``_relay_unpark`` has queued it."""
        if self._closed:  # sent before the child knew: counted, not delivered
            self._drop_late(1)
            return
        if not self._handlers:
            self._unhandled += 1
            return
        queue = self._queue
        if queue.parked or not self._relay_put(item, origin, window):
            queue.parked.append((item, origin, window))  # behind the parked ones: in order

    def _begin_closing(self) -> None:
        """From now on, queue what children send past the limit instead of parking it: a
        handler stuck under ``"block"`` must not hold up the relay while the bus closes (nor,
        behind it, what the same children sent other buses). ``close()`` bounds the wait for
        what is queued, and counts what its handlers miss."""
        self._closing = True
        queue = self._queue
        if queue.parked:
            queue._room()  # the relay queues what it parked

    def _drop_late(self, n: int, *, final: bool = False) -> None:
        """Count ``n`` events from child processes that found this bus closed, and say so (at
        most once per 10 s; ``final``: now, as the relay closes)."""
        if n:
            self._queue.count_dropped(n, said=True)
            self._late_dropped += n
        if self._late_dropped != self._late_said and (final or _LATE.ready(self._creator)):
            self._late_said = self._late_dropped
            logger.warning(
                "EventBus %r is closed: %d events child processes sent it were dropped (%d "
                "dropped in all)",
                self._name,
                self._late_dropped,
                self._queue.dropped,
            )

    def _relay_put(self, item: _Item, origin: EventOrigin | None, window: bool) -> bool:
        """Queue one event from a child; False (nothing queued) under ``"block"`` with no room."""
        queue = self._queue
        if window:
            queue.put_window(item, origin)
        else:
            data = RemoteData(item[2])
            data.origin = origin
            slots = (item[0], item[1], data)
            if len(queue.slots) < queue.crowded:
                queue.slots.extend(slots)
            else:
                self._dispatcher.hurry()  # a lingering or stopped dispatcher makes no room
                if not queue.put_nowait(slots):
                    if not self._closing:
                        return False
                    queue.slots.extend(slots)  # closing: past the limit (see _begin_closing)
        self._from_children += 1
        if self._idle:
            self._dispatcher.wake()
        return True

    def _relay_unpark(self) -> bool:
        """Queue the events the relay parked while there is room (the relay's thread); True
        once none is left. A closed queue counts them as dropped."""
        queue = self._queue
        parked = queue.parked
        while parked:
            if queue.closed or self._closed:
                self._drop_late(len(parked))
                parked.clear()
                break
            item, origin, window = parked[0]
            if not self._relay_put(item, origin, window):
                break
            parked.popleft()
        return not parked

    def _sweep_children(self, timeout: float | None, *, windows: bool = False) -> bool:
        """Queue what child processes had sent when this was called, and with ``windows``
        (closing) their open Stat windows of this bus too (False: timed out)."""
        listener = process.listener
        if listener is None or not self._handlers:
            return True
        return (
            listener.collect_windows(cast("EventBus", self), timeout)
            if windows
            else listener.sweep(timeout)
        )
