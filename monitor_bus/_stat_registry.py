"""A bus's Stats: the registries its timer reads, and the windows they close and log.

Guarantees
----------
- Windows are never dropped: a closed Stat window is offered to the bus's tap (a merge across
  ranks) first, then queued under any overflow policy, past the capacity if need be (at most
  one per Stat per window); logging it never blocks, as the timer runs on the loop.
- Lock-free reads: the timer and ``close`` read the registries with single C calls (a
  ``list`` of a dict, a registry's snapshot), never taking the dispatcher's lock.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

from ._lifecycle import WeakRegistry
from ._queue import PendingWindow
from ._window import STAT_EVENT

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._bus import EventBus
    from ._dispatcher import Dispatcher
    from ._handler import _Handler
    from ._queue import EventQueue, _Item
    from ._relay_uplink import Uplink
    from ._stat import Stat
    from ._window import ClosedWindow


class StatRegistry:
    """The Stats of an ``EventBus``, which mixes this in and sets the state it reads."""

    # Set by EventBus: its Stats by window size (all, and those holding data), the tap, and
    # the queue and dispatcher its windows go through.
    _stat_groups: dict[float, WeakRegistry[Stat]]
    _dirty: dict[float, WeakRegistry[Stat]]
    _window_tap: Callable[[ClosedWindow], bool] | None
    _uplink: Uplink | None
    _handlers: tuple[_Handler, ...]
    _unhandled: int
    _queue: EventQueue
    _idle: bool
    _dispatcher: Dispatcher

    def _window_closed(self, window: ClosedWindow) -> None:
        """A Stat's window closed: offer it to the tap, then log it (its device values are
        read on the dispatcher's side, or, for a parent process, when it is sent)."""
        tap = self._window_tap
        if tap is not None and tap(window):
            return
        if window.pending:
            data = PendingWindow()
            data.window = window
            self._log_window((STAT_EVENT, window.stamp, data))
        else:
            self._log_window((STAT_EVENT, window.stamp, window.data()))

    def _log_window(self, item: _Item) -> None:
        """``log_event`` for Stat windows: never blocks (the timer runs on the loop) and never
        drops, whatever the policy: a window may summarize millions of samples."""
        uplink = self._uplink  # read once: the relay may unset it meanwhile
        if uplink is not None:
            uplink.send(cast("EventBus", self), item, window=True)
        if not self._handlers:
            if self._uplink is None:  # sent to no one: counted
                self._unhandled += 1
            return
        self._queue.put_window(item)
        if self._idle:
            self._dispatcher.wake()

    def _watch_stat(self, stat: Stat) -> None:
        """Have the timer close ``stat``'s windows on time."""
        window = stat._window
        dispatcher = self._dispatcher
        with dispatcher.lock:
            group = self._stat_groups.get(window)
            new = group is None
            if group is None:
                group = self._stat_groups[window] = WeakRegistry()
            group.add(stat)
            loop = dispatcher.loop
        if new and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(dispatcher.timers_changed_set)
        elif loop is None and self._uplink is not None:
            dispatcher.ensure_running()  # a child's windows close on time too

    def _dirty_stats(self, window: float) -> WeakRegistry[Stat]:
        """The Stats of this window size whose open window holds data (the timer's round)."""
        registry = self._dirty.get(window)
        if registry is None:
            registry = self._dirty.setdefault(window, WeakRegistry())  # one C call: atomic
        return registry

    def _stats(self) -> list[Stat]:
        """This bus's live Stats."""
        groups = list(self._stat_groups.values())  # one C call: atomic, no lock needed
        return [stat for group in groups for stat in group.snapshot()]
