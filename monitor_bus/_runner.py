"""Runners: the threads that call the sync handlers.

Guarantees:

- A user's sync handler has a runner of its own: one daemon thread, so a slow handler delays
  nobody else.
- The bundled sinks of a bus (JSONL, TensorBoard, Prometheus; not ``ProcessHandler``, whose
  flush waits for its child) share one runner: per batch the dispatcher wakes one thread, which serves each sink's inbox
  in turn. Each sink keeps its own inbox, counters, ``flush()``, cut-off and errors (see
  ``_handler.py``): one that raises costs the others nothing.
- Watchdog: a bundled sink whose turn (its calls and its ``flush()``) has lasted
  ``SINK_BUDGET`` seconds is moved off the shared runner: the thread stuck in it becomes the
  sink's own, a new shared runner takes the others, and a warning names the sink and the time.
  The sink keeps that thread for good, healthy again or not: one that overran once (a slow
  mount, a stalled remote) tends to again, and back on the shared runner it would hold the
  others up to ``SINK_BUDGET`` each time, with a warning each time; apart it costs one thread
  and its wake-up per batch, as a user's handler does. A failure to start the new shared
  runner is logged as an error (at most once per 10 s) and the move is tried again at each
  next check.
  Until then the sinks behind it wait: a bundled sink may be late by up to ``SINK_BUDGET``
  (plus the loop's reaction) because of another, so a ``flush`` or ``close`` whose timeout is
  shorter than that may find it unsettled. The dispatcher's loop runs the watchdog while the
  shared runner has work, and sleeps otherwise.
- A runner exits once every handler it serves has stopped and settled its inbox.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ._lifecycle import process
from ._ratelimit import Throttle

if TYPE_CHECKING:
    from ._dispatcher import Dispatcher
    from ._handler import _Handler

logger = logging.getLogger("monitor_bus")

# Seconds a bundled sink may hold the shared runner in one turn before the watchdog gives it
# a thread of its own: far above a healthy turn (a batch's lines and one write, milliseconds),
# well below the 10 s a user waits for a flush before suspecting a hang.
SINK_BUDGET = 1.0


def is_bundled(callback: object) -> bool:
    """Whether ``callback`` is one of the bundled sinks, which share a runner: its own class
    (not a subclass, which may do anything) says so with ``_monitor_bus_bundled``."""
    return type(callback).__dict__.get("_monitor_bus_bundled") is True


def start(handler: _Handler) -> None:
    """Give sync ``handler`` a runner: the bus's shared one for a bundled sink, else its own.

    Raises:
        RuntimeError: no thread could start (the handler stays not running).
    """
    if not handler.bundled:
        runner = Runner(f"monitor_bus-handler-{handler.name}")
        runner.start()
        runner.add(handler)
        return
    dispatcher = handler.bus._dispatcher
    with dispatcher.sinks_lock:
        shared = dispatcher.sinks
        if shared is None or not shared.add(handler):
            shared = Runner(f"monitor_bus-sinks-{handler.bus._name}")
            shared.start()
            shared.add(handler)
            dispatcher.sinks = shared


class Runner:
    """A daemon thread calling the sync handlers it serves, each in turn, when kicked.

    ``handlers``, ``serving`` and ``since`` change under ``cv``; a handler's ``runner`` says
    which runner serves it, and changes (the watchdog) under the old runner's ``cv``.
    """

    def __init__(self, name: str) -> None:
        self.cv = threading.Condition(threading.Lock())
        self.handlers: list[_Handler] = []
        self.kicked = False  # work may wait: serve every handler once more
        self.busy = False  # in a round (between two waits)
        self.done = False  # has ended or is ending: takes no more handlers
        self.serving: _Handler | None = None  # whose turn it is, since ``since`` (monotonic)
        self.since = 0.0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.no_thread = Throttle()  # the watchdog's error when no thread starts for a move

    def start(self) -> None:
        """Start the thread (before any handler is added: a failure leaves none behind)."""
        try:
            self.thread.start()
        except BaseException:
            self.done = True
            raise

    def add(self, handler: _Handler) -> bool:
        """Serve ``handler`` too; False if this runner has ended."""
        with self.cv:
            if self.done:
                return False
            self.handlers.append(handler)
            handler.runner, handler.thread, handler.running = self, self.thread, True
            self.kicked = True  # what its inbox holds already
            self.cv.notify()
        return True

    def kick(self) -> None:
        """Have the runner serve its handlers again (a batch or a stop came)."""
        with self.cv:
            self.kicked = True
            self.cv.notify()

    def _run(self) -> None:
        process.bus_threads.add(threading.get_ident())
        try:
            while self._serve_round():
                pass
        finally:
            process.bus_threads.discard(threading.get_ident())  # idents are reused
            with self.cv:
                self.done = True
                left, self.handlers = self.handlers, []
            for handler in left:  # only if the loop itself failed
                handler._exit()

    def _serve_round(self) -> bool:
        """Wait for a kick, then give each handler a turn; False once none is left."""
        with self.cv:
            self.busy = False
            while not self.kicked:
                self.cv.wait()
            self.kicked, self.busy = False, True
            handlers = tuple(self.handlers)
        for handler in handlers:
            with self.cv:
                if handler.runner is not self:
                    continue  # moved to another runner meanwhile
                self.serving, self.since = handler, time.monotonic()
            left = handler.serve()
            with self.cv:
                self.serving = None
                if left:
                    self.handlers.remove(handler)
            if left:
                handler._exit()
        with self.cv:
            if not self.handlers:
                self.done = True
                return False
        return True

    def watch(self, dispatcher: Dispatcher) -> float | None:
        """The watchdog's check, on the dispatcher's loop: move a sink that has overrun
        ``SINK_BUDGET``; return when to check again (None: nothing in progress)."""
        budget = SINK_BUDGET
        name = dispatcher.bus._name
        # One hold of ``cv`` from the check to the move: the sink cannot return and this
        # thread go on to serve one of the others meanwhile.
        with dispatcher.sinks_lock, self.cv:
            if self.done and dispatcher.sinks is self:
                dispatcher.sinks = None  # its last sink left: the next one starts another
            if self.done or (not self.busy and not self.kicked):
                return None
            stuck = self.serving
            took = time.monotonic() - self.since
            if stuck is None or took < budget or dispatcher.sinks is not self:
                # Between two turns: look again soon, to time the next turn from its start.
                return budget / 4 if stuck is None else max(budget - took, 0.0) + 0.001
            others = [h for h in self.handlers if h is not stuck]
            shared, failed = None, None
            if others:
                shared = Runner(f"monitor_bus-sinks-{name}")
                try:
                    shared.start()
                except RuntimeError as exc:
                    failed = exc
                else:
                    for handler in others:
                        shared.add(handler)
                    self.handlers = [stuck]
            if not others or failed is None:
                dispatcher.sinks = shared
                self.thread.name = f"monitor_bus-handler-{stuck.name}"
        if others and failed is not None:  # tried again at the next check
            if not self.no_thread.ready():
                return budget
            logger.error(
                "EventBus %r: sink %r has run for %.1f s in one batch; no thread to move the "
                "other sinks to (%s)",
                name,
                stuck.name,
                took,
                failed,
            )
            return budget
        logger.warning(
            "EventBus %r: sink %r has run for %.1f s in one batch (budget %g s): it runs on a "
            "thread of its own from now on%s",
            name,
            stuck.name,
            took,
            budget,
            ", the other sinks on a new one" if others else "",
        )
        return budget if others else None
