"""How a bus closes: open windows logged, what is queued delivered, every handler detached.

Guarantees
----------
- Bounded: ``close`` (and the close at exit, or at the end of a ``with`` block, within
  ``exit_timeout``) returns within its timeout; ``math.inf`` means no limit. The children's
  open windows get at most half of it. Handlers still busy then are cut off: what they did not
  get is counted as dropped for them and named in a warning.
- Idempotent: a later ``close`` finds nothing left to detach; one that runs while another
  still waits for the handlers it detached (SIGTERM during ``close()``) waits for them too,
  within its own timeout.
- No handler: what was logged while the bus had none is named in a warning at close and exit,
  once the bus has had a handler.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._check import check_timeout
from ._child_intake import ChildIntake
from ._dispatcher import _deadline, _remaining
from ._lifecycle import in_bus_thread
from ._portal import _TimedOut
from ._stat_registry import StatRegistry

if TYPE_CHECKING:
    from ._handler import _Handler

logger = logging.getLogger("monitor_bus")


class Closing(ChildIntake, StatRegistry):
    """The closing of an ``EventBus``, which mixes this in and sets the state it reads."""

    # Set by EventBus: its exit timeout, the handlers it detached or that still leave, and
    # the counts a closed bus keeps.
    _exit_timeout: float | None
    _leaving: set[_Handler]
    _detached: list[tuple[_Handler, int]]
    _final_handlers: list[dict[str, Any]] | None
    _had_handler: bool
    _unhandled_said: int

    def _say_unhandled(self) -> None:
        """Name what was logged while no handler was registered (at close and exit), unless
        the bus never had a handler: logging nobody listens to is torch.monitor's no-op, and
        instrumented code runs in programs that never register one."""
        n = self._unhandled
        if n != self._unhandled_said and self._had_handler:
            self._unhandled_said = n
            logger.warning(
                "EventBus %r: %d events (Stat windows included) were logged while it had no "
                "handler and went nowhere: unregister the last handler only once the run is over",
                self._name,
                n,
            )

    def close(self, timeout: float | None = None) -> bool:
        """Log the open windows of this bus's Stats, deliver what is queued, detach every
        handler and stop the dispatcher thread.

        Live child processes that report to this bus (DataLoader workers, say) are asked for
        their Stats' open windows first, within half of ``timeout``; one that has not sent
        them by then is named in a warning, and what it sends later is counted as dropped.
        Idempotent; later ``log_event`` calls are no-ops and registration raises. Handlers
        that have not finished within ``timeout`` are cut off: what they did not get is
        counted as dropped for them and named in a warning. From the call on, what child
        processes send is queued even past the capacity under ``"block"``, rather than held
        in the relay. ``stats()`` keeps the final counts. A close that runs while another
        still waits for the handlers it detached (SIGTERM during ``close()``) waits for them
        too, within its own ``timeout``.

        Args:
            timeout: seconds to wait; None or ``math.inf`` waits as long as it takes.

        Returns:
            True if everything was delivered (the children's windows included) and every
            thread stopped within ``timeout``.
        """
        timeout = check_timeout("timeout", timeout)
        if in_bus_thread():
            raise RuntimeError("close() cannot be called from inside an event handler")
        deadline = _deadline(timeout)
        dispatcher = self._dispatcher
        collected = True  # the children's open windows of this bus
        if not self._closed:
            self._begin_closing()
            for stat in self._stats():
                stat._close()
            # At most half the time: a sweep that cannot settle (a stuck sink under "block")
            # must leave time to detach the handlers. The children's open windows too.
            collected = self._sweep_children(None if timeout is None else timeout / 2, windows=True)
            dispatcher.ensure_running()
            self._say_unhandled()
        with dispatcher.lock:
            self._closed = True
        self._queue.close()
        try:
            targets = dispatcher.in_loop(dispatcher.detach_all, timeout=_remaining(deadline))
        except _TimedOut:
            logger.warning(
                "EventBus %r: close() gave up after %s s: the dispatcher did not respond",
                self._name,
                timeout,
            )
            return False
        targets += [(h, h.offered) for h in tuple(self._leaving) if not h.registered]
        if targets:
            self._detached = targets
        else:  # another close detached them and may still wait (SIGTERM during that close)
            targets = [(h, target) for h, target in self._detached if h.running]
        # The handlers settle concurrently: one stuck handler does not eat the others' time.
        settled = [h.wait_settled(target, _remaining(deadline)) for h, target in targets]
        unfinished = []
        for (handler, target), done in zip(targets, settled, strict=True):
            if not done:
                unfinished.append(handler.cut_off(target))
            handler.stop()
        stopped = [h.wait_stopped(_remaining(deadline)) for h, _ in targets]
        for handler, _ in targets:
            if not handler.running:  # its runner is gone: what it holds now is lost, counted
                handler._exit()
        if unfinished:
            logger.warning(
                "EventBus %r: %d handler(s) still busy after %s s, cut off: %s",
                self._name,
                len(unfinished),
                timeout,
                ", ".join(unfinished),
            )
        if self._queue.slots and dispatcher.loop is None:
            lost = self._queue.discard()
            logger.warning(
                "EventBus %r closed with %d undelivered events (dispatcher not running)",
                self._name,
                lost,
            )
        # Each handler also reports its own as it exits; the lock has each drop reported once.
        dispatcher.drops.report([h for h, _ in targets], final=True)
        if targets and self._final_handlers is None:  # the close that detached them
            self._final_handlers = [h.snapshot(0, self._queue.dropped) for h, _ in targets]
        if not dispatcher.stop(deadline):
            # After a cut-off, the handlers' wait used the time and that warning says so;
            # the loop is free and ends on its own.
            if not unfinished:
                logger.warning(
                    "EventBus %r: the dispatcher did not stop within %s s (an async handler "
                    "blocks its loop?)",
                    self._name,
                    timeout,
                )
            return False
        return all(settled) and all(stopped) and not dispatcher.broken and collected

    def _close_at_exit(self) -> None:
        """Close within ``exit_timeout`` (interpreter exit, a ``with`` block's end)."""
        if self._dispatcher.loop is None and not self._queue.slots:
            self._closed = True
            self._say_unhandled()
            return
        self.close(self._exit_timeout)  # what it could not deliver, it names in a warning
