"""A bus's counters: the snapshot ``stats()`` returns, and the counts it adds up.

Guarantees
----------
- Every event accounted for: for each handler, ``logged == delivered + dropped + pending``.
- A closed bus keeps reporting the counts it closed with, the handlers it detached included.
- Cheap when unused: device values are counted by a scan only once one was ever logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _device
from ._device import Deferred
from ._queue import SLOTS, count_events, device_values
from ._stat_registry import StatRegistry

if TYPE_CHECKING:
    import threading


class Counters(StatRegistry):
    """The counters of an ``EventBus``, which mixes this in and sets the state they read."""

    # Set by EventBus: its counts, and the handlers' counts when close() detached them.
    _errors: int
    _errors_lock: threading.Lock
    _restarts: int
    _from_children: int
    _to_parent: int
    _final_handlers: list[dict[str, Any]] | None

    def stats(self) -> dict[str, Any]:
        """A snapshot of the bus's counters.

        Keys: ``logged``, ``dropped`` (turned away by the full queue), ``queued``,
        ``handler_errors``, ``handler_dropped`` (sum over handlers, queue drops included),
        ``dispatcher_restarts`` (times the dispatcher failed, was logged and started again),
        ``from_children`` (events child processes sent here, included in ``logged``),
        ``to_parent`` (in a child process: events sent to the parent), ``unhandled`` (events
        and Stat windows logged while the bus had no handler, which went nowhere; named in a
        warning at close and exit if the bus ever had a handler), ``device_values``
        (tensors and device arrays logged but not read yet: in Stats' open windows, and in
        events and windows queued) and ``handlers``: one
        mapping per registered handler with ``name``, ``async``, ``logged`` (events logged
        while it was registered), ``delivered``, ``errors``, ``dropped`` and ``pending``. For
        each handler, ``logged == delivered + dropped + pending``. After ``close()``, the
        counts it closed with, the handlers it detached included.
        """
        queue = self._queue
        held = self._dispatcher.held  # taken from the queue, waiting for a device: still queued
        queued = len(queue) + count_events(len(held))
        dropped = queue.dropped
        final = self._final_handlers
        if final is not None and not self._handlers:  # closed: the counts it closed with
            handlers = [dict(h) for h in final]
        else:
            handlers = [h.snapshot(queued, dropped) for h in self._handlers]
        return {
            "logged": queue.consumed + len(queue) + dropped,
            "dropped": dropped,
            "queued": queued,
            "device_values": self._device_values(),
            "handler_errors": self._errors,
            "handler_dropped": sum(h["dropped"] for h in handlers),
            "dispatcher_restarts": self._restarts,
            "from_children": self._from_children,
            "to_parent": self._to_parent,
            "unhandled": self._unhandled,
            "handlers": handlers,
        }

    def _device_values(self) -> int:
        """Device values logged on this bus and not read yet."""
        if not _device.used:
            return 0  # none was ever captured: no scan of the queue
        stats = self._stats()
        return (
            sum(len(stat._pending) for stat in stats)
            + sum([v.__class__ for v in list(stat._buf)].count(Deferred) for stat in stats)
            + device_values(list(self._queue.slots)[2::SLOTS])
            + device_values(self._dispatcher.held[2::SLOTS])
        )

    def _count_error(self) -> None:
        """A handler call failed (a runner counts it here for ``stats()``)."""
        with self._errors_lock:
            self._errors += 1
