"""What a bus says about the events it lost: each drop in one warning, the log never flooded.

Guarantees
----------
- Once: the distributor after each drain, the bus's ``close`` and a handler that exits all
  report through one lock, so each drop is said once, whoever sees it first.
- Rate-limited: each kind of loss (the queue's, children's, each handler's backlog, each
  handler's sink) is said at most once per ``LOG_INTERVAL``, with the count since its last
  warning and the total; ``final`` says it now (a bus or handler that is going away).
- Told apart: drops that child processes reported are said as theirs, not as a full queue;
  drops already warned about where they happened (``dropped_said``: a child's uplink) are not
  said again; events whose device values could not be read are an error of their own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._ratelimit import Throttle

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._handler import _Handler

logger = logging.getLogger("monitor_bus")


class DropReport:
    """The drop warnings of one bus's dispatcher (a forked child's bus gets a new one).

    Thread-safe: the dispatcher's loop, ``close`` and runner threads report here."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self._dropped_reported = 0  # the part of the queue's drops already in a warning
        self._said_reported = 0  # queue.dropped_said already taken into that
        self._children_reported = 0  # queue.dropped_by_children already in a warning
        self._drop_throttle = Throttle()
        self._read_throttle = Throttle()
        self._report_lock = threading.Lock()

    def unreadable(self, failed: list[tuple[str, Exception]]) -> None:
        """Events whose device values could not be read: dropped, counted and reported."""
        with self._report_lock:
            self.bus._queue.count_unreadable(len(failed))
            self._dropped_reported += len(failed)  # reported here, not as a full queue
        if self._read_throttle.ready():
            name, exc = failed[0]
            logger.error(
                "EventBus %r: %d events dropped: a device value could not be read (event %r: %r)",
                self.bus._name,
                len(failed),
                name,
                exc,
            )

    def report(self, handlers: Iterable[_Handler], *, final: bool = False) -> None:
        """Warn about new drops, queue-side and per handler, at most once per interval each
        (``final``: now, whatever the interval; for a bus or handler that is going away).

        Called by the dispatcher after each drain, by ``close`` and by a runner that exits:
        the lock makes each drop reported once.
        """
        with self._report_lock:
            self._report_locked(handlers, final)

    def _report_locked(self, handlers: Iterable[_Handler], final: bool) -> None:
        bus = self.bus
        queue = bus._queue
        dropped, said, by_children = queue.dropped, queue.dropped_said, queue.dropped_by_children
        # Drops warned about where they happened are not reported again.
        self._dropped_reported += said - self._said_reported
        self._said_reported = said
        if dropped != self._dropped_reported and (final or self._drop_throttle.ready()):
            new = dropped - self._dropped_reported
            children = min(new, by_children - self._children_reported)
            full = new - children
            if children:
                logger.warning(
                    "EventBus %r: child processes reported %d events they could not send since "
                    "the last report, %d in all",
                    bus._name,
                    children,
                    by_children,
                )
            if full:
                logger.warning(
                    "EventBus %r: queue full (capacity %d, policy %s): %d events dropped since "
                    "the last report, %d in all",
                    bus._name,
                    bus._capacity,
                    bus._overflow,
                    full,
                    dropped,
                )
            self._dropped_reported = dropped
            self._children_reported = by_children
        for handler in handlers:
            with handler.cv:  # the sink's own losses, in dropped too, are reported below
                lost, sink_lost = handler.dropped - handler.lost, handler.lost
            if lost != handler.dropped_reported and (final or handler.throttle.ready("drops")):
                logger.warning(
                    "EventBus %r: handler %r fell behind (backlog capacity %d, policy %s): %d "
                    "events dropped since the last report, %d in all",
                    bus._name,
                    handler.name,
                    bus._capacity,
                    bus._overflow,
                    lost - handler.dropped_reported,
                    lost,
                )
                handler.dropped_reported = lost
            lost = sink_lost
            if lost != handler.lost_reported and (final or handler.throttle.ready("lost")):
                logger.warning(
                    "EventBus %r: handler %r could not write %d events it was given (see its "
                    "errors), dropped since the last report, %d in all",
                    bus._name,
                    handler.name,
                    lost - handler.lost_reported,
                    lost,
                )
                handler.lost_reported = lost
