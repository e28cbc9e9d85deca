"""The Stat timer: a task of the dispatcher's loop that closes each Stat window at its end.

Guarantees
----------
- Stat windows: at each boundary of each window size, the timer closes the windows that are
  due, so a stalled producer still reports.
- Cheap when idle: a pass visits only the Stats whose open window holds data, and never takes
  the dispatcher's lock (a thread starting the dispatcher holds it while it waits on the loop).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING

import anyio

from . import _stat
from ._window import window_end

if TYPE_CHECKING:
    from ._bus import EventBus

# Wake a timer this long after a window's end, so the window is surely over by its clock.
_TIMER_SLACK = 0.0005


class StatTimer:
    """The Stat timer of a ``Dispatcher``, which mixes it in, starts ``_run_timers`` in its task
    group and makes ``_timers_changed`` with each loop."""

    # Set by Dispatcher: the bus whose Stats it closes, and what wakes the timer.
    bus: EventBus
    _timers_changed: anyio.Event | None

    def timers_changed_set(self) -> None:
        """Have the timer look at the window sizes again (a new one was added)."""
        assert self._timers_changed is not None
        self._timers_changed.set()

    async def _run_timers(self) -> None:
        """Close every Stat window at its end, so a stalled producer still reports."""
        next_end: dict[float, float] = {}
        while True:
            assert self._timers_changed is not None
            self._timers_changed = anyio.Event()
            wake_at = self._timer_pass(next_end)
            if wake_at is None:
                await self._timers_changed.wait()
                continue
            with anyio.move_on_after(max(wake_at - _stat._clock(), 0.0)):
                await self._timers_changed.wait()

    def _timer_pass(self, next_end: dict[float, float]) -> float | None:
        """Close the windows that are due by the Stat clock; return when the next one ends.

        ``next_end`` maps each window size to the end of its current window (plus a slack, so
        the window is surely over by its Stat's clock); a size seen for the first time is only
        scheduled.
        """
        bus = self.bus
        now = _stat._clock()
        # One C call, atomic with respect to _watch_stat; never the lock, which a thread
        # starting the dispatcher holds while it waits on this loop.
        for window in list(bus._stat_groups):
            end = next_end.get(window)
            if end is None or now >= end:
                if end is not None:
                    stamp, clock = datetime.now(timezone.utc), _stat._clock()
                    # Only the Stats holding data: thousands of idle ones cost nothing.
                    for stat in bus._dirty_stats(window).snapshot():  # never takes a lock
                        stat._close_on_timer(clock, stamp)
                next_end[window] = window_end(now, window, bus._clock_offset) + _TIMER_SLACK
        return min(next_end.values()) if next_end else None
