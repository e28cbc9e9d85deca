"""The dispatcher a bus owns: its thread, its loop's tasks, Stat timers, restarts.

Guarantees
----------
- Threads: one daemon thread per bus runs an asyncio loop under ``anyio.run``, started with the
  bus's first handler (never at import), with a handshake so a failure to start reaches the
  caller. Its task group runs the distributor, the Stat timer, the watchdog of the bundled
  sinks' shared thread and one task per async handler; each sync handler runs on a runner's
  daemon thread (``_runner.py``), woken once per batch. A start caused by ``log_event`` or
  ``Stat.add`` (after a fork, or a failed restart) never raises: if no thread or descriptor is
  to be had, what they logged waits in the queue (a full one drops as its policy says, and
  ``"block"`` does not wait for room nothing would make), a warning says so (at most once per
  10 s), and the next event tries again.
- Other threads reach the loop through its portal (``_portal.py``), in time bounded by their
  own timeout.
- Registration changes run on the loop: the distributor drains what is queued to the current
  handlers, then publishes a new immutable tuple of handlers, which dispatch reads lock-free.
- Linger: once woken, the distributor hands over one batch per linger while events keep
  coming. The linger is the bus's, doubled after each batch under ``BURST`` events up to
  ``LINGER_MAX``; while it is grown a producer ends it once ``BURST`` events are queued, so a
  burst of ``BURST`` events or more is never held past the bus's linger (a smaller one may
  wait the grown linger). ``flush``, ``close`` and Stat windows never wait for it: a queued
  window ends the linger (``window_queued``).
- Stat windows: the Stat timer (``_stat_timer.py``) closes each at its end.
- Failure: a dispatcher whose loop ends with an exception is logged at CRITICAL and replaced
  at once; after three failures within 10 s it stays down, and ``flush``/``close`` say so.
- Fork: the child's bus gets an empty queue and a new, stopped dispatcher (fresh locks). A
  bus whose children report to the parent (``children="forward"``) keeps no handler in the
  child; its dispatcher starts for its Stats' timers. Otherwise the child keeps the same
  handlers and the dispatcher starts again on the first event the child logs. Either way the
  first value added to a Stat's window starts it too (``start_for_stats``), so the timer closes
  the windows of Stats the child inherited.
- Exit: ``EventBus._close_at_exit`` (from ``atexit``, or a multiprocessing finalizer) closes
  the bus within ``exit_timeout``. It starts a dispatcher only where one was stopped with
  events or windows to deliver (a forked child that logged nothing since the fork).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import anyio

from . import _device
from ._drop_report import DropReport
from ._lifecycle import process
from ._portal import Portal
from ._queue import SLOTS, resolve_ready, wait_for_devices
from ._ratelimit import LOG_INTERVAL, Throttle
from ._stat_timer import StatTimer

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._handler import _Handler
    from ._runner import Runner

logger = logging.getLogger("monitor_bus")

# Adaptive linger: while batches stay under BURST events, each linger doubles, up to
# LINGER_MAX seconds (or the bus's own linger, if longer), so a steady trickle makes few
# wake-ups (docs/performance.md's linger table: 20 ms -> 100 ms took K=1 from 1.124x to
# 1.087x of no logging); meanwhile a producer that has queued BURST events ends it, so a
# burst that large is not held past the bus's linger.
BURST = 1024
LINGER_MAX = 0.1
# A dispatcher failing this many times within LOG_INTERVAL is not started again: a failure that
# repeats at once would only fill the log and burn a core.
_MAX_FAILURES = 3


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Dispatcher(Portal, StatTimer):
    """The loop side of an ``EventBus``: its thread, its loop's tasks and everything that talks
    to them. A bus owns one (a forked child gets a new one).

    The bus keeps what its callers touch: its settings, the queue, the published handler tuple,
    the ``_idle`` flag, its Stat registries and the counters of ``stats()``. The dispatcher
    reads them, and on its loop publishes the handlers and sets ``_idle``.
    """

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.lock = threading.Lock()  # start, stop and registration changes
        self.thread: threading.Thread | None = None
        self.loop: Any = None
        self.loop_context: contextvars.Context | None = None
        self.task_group: anyio.abc.TaskGroup | None = None
        self.stopping = False
        self.broken = False  # failed too often: no more restarts
        self.unrun: set[Callable[[], None]] = set()  # in_loop calls the loop has not run
        # Events taken from the queue whose device values are not ready (flat slots): they go
        # to the handlers first, once read.
        self.held: list[Any] = []
        self._wakeup: anyio.Event | None = None
        self._hurried: anyio.Event | None = None  # ends a linger early
        self._hurrying = False
        # A Stat window was queued since the distributor last drained: it does not linger.
        self._window_queued = False
        bus._queue.on_window = self.window_queued
        self._linger = 0.0  # the linger in use (``_grow_linger``)
        self._timers_changed: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._waiting_for_room = False
        self._room: anyio.Event | None = None
        self._start_throttle = Throttle()
        self.drops = DropReport(bus)  # its drop warnings
        self._failures: deque[float] = deque(maxlen=_MAX_FAILURES)  # when, monotonic
        # The runner the bundled sinks share (``_runner``), and the lock of its changes.
        self.sinks: Runner | None = None
        self.sinks_lock = threading.Lock()
        self._sinks_busy: anyio.Event | None = None  # wakes the watchdog

    def active(self) -> bool:
        """Whether the dispatcher has work: handlers, or Stat timers of a child that reports
        its windows to its parent."""
        bus = self.bus
        return bool(bus._handlers) or bus._uplink is not None

    def wake(self) -> None:
        """Wake the idle distributor (a producer found ``_idle`` set), or start the dispatcher."""
        self.bus._idle = False
        loop = self.loop
        if loop is None:
            # After a fork (or a failed restart): the dispatcher starts on the next event. A
            # finalizer or signal handler that lands while another start is under way leaves it
            # be.
            if self.lock.acquire(blocking=False):
                try:
                    if self.active() and not self.bus._closed and not self.broken:
                        self.start_locked()
                except Exception as exc:  # noqa: BLE001 - log_event and Stat.add never raise
                    self._start_failed(exc)
                finally:
                    self.lock.release()
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: the bus is shutting down
            loop.call_soon_threadsafe(self._set_wakeup)

    def ensure_running(self) -> bool:
        """Start the dispatcher if handlers wait for it (after a fork, or a failed restart);
        return whether it runs. A failure to start is logged, never raised."""
        if self.loop is None and self.active():
            with self.lock:
                if self.loop is None and self.active() and not self.bus._closed and not self.broken:
                    try:
                        self.start_locked()
                    except Exception as exc:  # noqa: BLE001 - said (throttled), tried again later
                        self._start_failed(exc)
        return self.loop is not None

    def start_for_stats(self) -> None:
        """A Stat's window got its first value while the dispatcher is stopped (a forked child,
        whose Stats are the parent's): start it, so its timer closes the window on time.

        Never waits for the lock: the caller may be a signal handler that interrupted a thread
        holding it; a start under way then does the job.
        """
        if self.loop is not None or not self.active() or not self.lock.acquire(blocking=False):
            return
        try:
            if self.loop is None and self.active() and not self.bus._closed and not self.broken:
                self.start_locked()
        except Exception as exc:  # noqa: BLE001 - Stat.add never raises
            self._start_failed(exc)
        finally:
            self.lock.release()

    def hurry(self) -> None:
        """End the dispatcher's linger now (the queue is filling up), or wake it if idle."""
        if self.bus._idle:
            self.wake()
        elif not self._hurrying:
            self._hurrying = True  # one call per linger, however many producers
            self.call_soon(self._set_hurried)

    def window_queued(self) -> None:
        """A Stat window was queued (any thread, the loop's timer included): hand it over
        without waiting out the linger. Windows are few (one per Stat and window), so this
        costs a wake-up of the loop per window at most."""
        self._window_queued = True  # seen before the distributor lingers
        if self.bus._idle:
            self.wake()
        elif not self._hurrying:  # end a linger under way, once per linger
            self._hurrying = True
            loop = self.loop
            if loop is not None:
                # Thread-safe even on the loop's thread: a window may be logged by a finalizer
                # or a signal handler that interrupted the loop.
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(self._set_hurried, context=self.loop_context)

    def _set_hurried(self) -> None:
        if self._hurried is not None:
            self._hurried.set()

    def _set_wakeup(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def stop(self, deadline: float | None) -> bool:
        """Have the loop deliver what is queued and end; False if its thread outlived
        ``deadline``."""
        with self.lock:
            loop, thread = self.loop, self.thread
            if loop is None or thread is None:
                return True
            self.stopping = True
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._set_stopped)
        # Joined without the lock: a failing dispatcher takes it on its way out.
        thread.join(_remaining(deadline))
        if thread.is_alive():
            return False
        with self.lock:
            if self.thread is thread:
                self.loop = self.thread = None
        return True

    def loop_cancelled(self) -> bool:
        """Whether the loop's tasks are being cancelled (the bus stops, or its loop failed)."""
        tg = self.task_group
        return self.stopping or tg is None or tg.cancel_scope.cancel_called

    def _set_stopped(self) -> None:
        assert self._stopped is not None
        self._stopped.set()

    # -- the dispatcher thread --

    def start_locked(self) -> None:
        """Start the dispatcher and wait until it runs (``self.lock`` held).

        Raises what failed (no thread could start, no descriptor for the loop): then nothing
        runs that did not before, bar runners of sync handlers, which wait for the next start,
        and the queue is marked stalled (a producer under "block" does not wait for room).
        """
        queue = self.bus._queue
        try:
            # After a fork or a failure: runners that are gone. The sync ones first, so that
            # a failure leaves no running loop with a handler nobody runs.
            for handler in self.bus._handlers:
                if not handler.running and not handler.is_async:
                    handler.start_thread()
            ready: Future[None] = Future()
            thread = threading.Thread(
                target=self._thread_main,
                args=(ready,),
                name=f"monitor_bus-{self.bus._name}",
                daemon=True,
            )
            thread.start()
            ready.result()  # re-raises a failure to start
        except BaseException:
            queue.stall(True)
            raise
        queue.stall(False)
        self.thread = thread
        self.stopping = False
        for handler in self.bus._handlers:
            if not handler.running and handler.is_async:
                # Not waited for: this thread may hold a Stat's lock (a window logged in a
                # forked child starts the dispatcher), which the loop's timer may need.
                handler.running = True  # from now: flush() waits for it
                self._schedule(self.loop, self._start_async, handler)
        if "multiprocessing" in sys.modules:
            process.finalize_with_multiprocessing()

    def _start_failed(self, exc: Exception) -> None:
        """A producer's start failed: the next event tries again; say so (throttled)."""
        self.bus._idle = True
        if self._start_throttle.ready():
            logger.warning(
                "EventBus %r: the dispatcher could not start (%s: %s); %d events wait in the "
                "queue, the next event tries again (a full queue drops as its policy says)",
                self.bus._name,
                type(exc).__name__,
                exc,
                len(self.bus._queue),
            )

    def _thread_main(self, ready: Future[None]) -> None:
        process.bus_threads.add(threading.get_ident())
        failure: BaseException | None = None
        try:
            anyio.run(self._main, ready, backend="asyncio")
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:
                failure = exc
        finally:
            process.bus_threads.discard(threading.get_ident())
        ended = self.loop
        if failure is not None:
            self._restart_after_failure(failure)
        # Calls scheduled on the loop that it never ran: on the new loop if a failure started
        # one (so they meet the restarted handlers), else here, as nothing else runs them now.
        loop = self.loop
        for run in list(self.unrun):
            if loop is not None and loop is not ended:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(run, context=self.loop_context)
                    continue
            run()

    def _restart_after_failure(self, failure: BaseException) -> None:
        """Start a new dispatcher thread in place of this failed one, then log the failure:
        delivery never ends quietly.

        Events queued meanwhile wait in the queue; a handler whose task died with the loop has
        its backlog counted as dropped (and reported). After ``_MAX_FAILURES`` failures within
        ``LOG_INTERVAL``, no new thread starts. Should a start itself fail, the next
        ``log_event``, ``flush`` or ``close`` tries again.
        """
        bus = self.bus
        now = time.monotonic()
        with self.lock:
            if self.thread is not threading.current_thread():
                return  # close() already gave up on this thread
            self.loop = self.thread = None
            bus._idle = True
            self._failures.append(now)
            self.broken = (
                len(self._failures) == _MAX_FAILURES and now - self._failures[0] < LOG_INTERVAL
            )
            if self.broken:
                bus._queue.close()  # producers blocked for room drop instead of waiting
            else:
                bus._restarts += 1
                if not (bus._closed or self.stopping or not self.active()):
                    try:
                        self.start_locked()
                    except Exception:
                        logger.exception(
                            "EventBus %r: the dispatcher could not start again", bus._name
                        )
            # Logged once the new dispatcher runs, so what a reader of the log does next
            # meets the bus in its new state.
            logger.critical(
                "EventBus %r: the dispatcher failed (failure %d); %s",
                bus._name,
                bus._restarts + self.broken,  # every failure so far
                f"{_MAX_FAILURES} failures within {LOG_INTERVAL:g} s: it is not started "
                "again; events wait in the queue for close(), and flush() and close() return "
                "False"
                if self.broken
                else "a new one runs",
                exc_info=failure,
            )

    async def _main(self, ready: Future[None]) -> None:
        import asyncio

        self._wakeup = anyio.Event()
        self._sinks_busy = None  # the watchdog makes its own (one of a failed loop is dead)
        self._timers_changed = anyio.Event()
        self._stopped = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self.task_group = tg
                # Callbacks from other threads run in the loop's context, where anyio knows
                # its backend.
                self.loop_context = contextvars.copy_context()
                self.loop = asyncio.get_running_loop()
                tg.start_soon(self._distribute)
                tg.start_soon(self._run_timers)
                tg.start_soon(self._watch_sinks)
                ready.set_result(None)
                await self._stopped.wait()
                self._drain(force=True)
                for handler in self.bus._handlers:
                    handler.stop()
                tg.cancel_scope.cancel()
        finally:
            self.task_group = None  # a failed loop too: nothing may start on it

    def _start_async(self, handler: _Handler) -> None:
        tg = self.task_group
        if tg is None:  # the loop ended first: its backlog is lost, the next start runs it
            handler._exit()
            return
        handler.running = True
        tg.start_soon(handler.run_async, name=f"monitor_bus-handler-{handler.name}")

    # -- handler publication, on the loop (through in_loop) --

    def publish_add(self, handler: _Handler) -> _Handler | None:
        """Add ``handler`` (replacing a keyed one of the same name); return what it replaced."""
        bus = self.bus
        self._drain(force=True)  # what is queued was logged before the registration returned
        replaced = None
        if handler.keyed:
            for old in bus._handlers:
                if old.keyed and old.name == handler.name:
                    self._retire(old)
                    replaced = old
        handler.bus_dropped_base = bus._queue.dropped
        if handler.is_async and self.task_group is not None:
            self._start_async(handler)
        bus._handlers = (*(h for h in bus._handlers if h.registered), handler)
        return replaced

    def _retire(self, handler: _Handler) -> int:
        """Mark ``handler`` unregistered (the caller republishes); return its delivery target."""
        handler.registered = False
        handler.bus_dropped_end = self.bus._queue.dropped
        return handler.offered

    def publish_remove(self, handler: _Handler) -> int | None:
        """Remove ``handler``; return its delivery target (None: it was removed already)."""
        if not handler.registered:
            return None
        bus = self.bus
        handlers = bus._handlers
        if len(handlers) == 1 and handlers[0] is handler:
            # The last one: the Stats' open windows go to it (partial, as at exit), since no
            # handler would be left to take them when they close.
            for stat in bus._stats():
                stat._close()
        self._drain(force=True)
        target = self._retire(handler)
        bus._handlers = tuple(h for h in bus._handlers if h is not handler)
        return target

    def remove_cut(self, handler: _Handler, logged: int, turned_away: int) -> None:
        """Remove ``handler``, cut off by an unregister that gave up waiting for the loop, and
        stop it. ``logged`` (events taken or queued) and ``turned_away`` (events the queue
        dropped) are the queue's counts at that call: what was logged before it and is still
        queued counts as dropped for the handler, and nothing logged after it does."""
        if handler.registered:
            bus = self.bus
            handler.miss(max(0, logged - bus._queue.consumed))
            self._retire(handler)
            handler.bus_dropped_end = turned_away
            bus._handlers = tuple(h for h in bus._handlers if h is not handler)
        handler.stop()

    def detach_all(self) -> list[tuple[_Handler, int]]:
        """Remove every handler; return each with its delivery target."""
        bus = self.bus
        self._drain(force=True)
        handlers, bus._handlers = bus._handlers, ()
        targets = [(h, self._retire(h)) for h in handlers]
        if targets:  # here, not in close(): a SIGTERM's close can run before close() returns
            bus._detached = targets
        return targets

    def drain_targets(self) -> list[tuple[_Handler, int]]:
        """Hand everything queued over; return each handler with its delivery target, those
        still delivering after being replaced or unregistered included."""
        bus = self.bus
        self._drain(force=True)
        leaving = [h for h in tuple(bus._leaving) if not h.registered]
        return [(h, h.offered) for h in (*bus._handlers, *leaving)]

    # -- distribution --

    def _drain(self, *, force: bool = False) -> bool:
        """Move queued events to the handlers' inboxes; False if ``block`` left some queued."""
        bus = self.bus
        queue = bus._queue
        n = len(queue)
        handlers = bus._handlers
        if n or self.held:
            capacity = bus._capacity
            overflow: str = bus._overflow
            if overflow == "block":
                if not force and handlers:
                    n = min(n, min(capacity - h.backlog for h in handlers))
                overflow = "force"  # room was made above, or a flush asks for everything
            batch = queue.take(n) if n > 0 else []
            if _device.used:
                # Device values are read here, a thread of the bus; a flush or a close waits
                # for the device, the distributor waits on a worker thread instead.
                held, self.held = self.held, []
                batch, self.held, failed = resolve_ready(
                    held + batch if held else batch, wait=force
                )
                if failed:
                    self.drops.unreadable(failed)
            if batch:
                for handler in handlers:
                    handler.push(batch, capacity, overflow)
                # One wake-up per runner, once every inbox has its batch.
                for runner in {h.runner: None for h in handlers if h.runner is not None}:
                    runner.kick()
                busy = self._sinks_busy  # None while the watchdog waits on a timer
                if (
                    self.sinks is not None
                    and busy is not None
                    and self.thread is threading.current_thread()
                ):
                    busy.set()
        self.drops.report(handlers)
        return not queue.slots

    async def _distribute(self) -> None:
        bus = self.bus
        queue = bus._queue.slots
        while True:
            # Reset before the drain: a window queued from here on either is in it, or keeps
            # the linger below from starting, or ends it (``window_queued``).
            self._window_queued = False
            moved = len(queue)
            if not self._drain():
                # "block": every handler's backlog is full; wait until one makes progress.
                room = self._room = anyio.Event()
                self._waiting_for_room = True
                # Drain again now the flag is up: a runner that made room before it was up
                # did not signal, and would never signal again.
                if not self._drain():
                    await room.wait()
                self._waiting_for_room = False
                continue
            if self.held:  # a device is not done with values logged: wait off the loop
                await anyio.to_thread.run_sync(wait_for_devices, self.held, abandon_on_cancel=True)
                continue
            if not moved and not queue:
                # A whole linger passed with nothing logged: sleep until an event wakes us.
                self._wakeup = anyio.Event()
                bus._idle = True
                if not queue:  # checked again: an append may have seen _idle still False
                    await self._wakeup.wait()
                bus._idle = False
            # Let events accumulate: one batch per linger while they keep coming, and no
            # cross-thread wake-up for the producers meanwhile (``_idle`` stays False). A
            # producer that finds the queue half full ends the linger early.
            self._hurried = anyio.Event()
            self._hurrying = False
            # Checked after the reset: a producer that crowds the queue from now on hurries
            # this linger; one that did before is seen here.
            linger = self._grow_linger(moved)
            if len(queue) < bus._queue.crowded and not self._window_queued:
                with anyio.move_on_after(linger):
                    await self._hurried.wait()

    def _grow_linger(self, moved: int) -> float:
        """The linger after a batch of ``moved`` slots: twice the last (up to ``LINGER_MAX``)
        after a batch under ``BURST`` events, else the bus's. While it is grown, a producer
        hurries it once ``BURST`` events are queued (``crowded``)."""
        bus = self.bus
        base = bus._linger
        if moved < SLOTS * BURST:
            self._linger = min(max(self._linger * 2, base), max(base, LINGER_MAX))
        else:
            self._linger = base
        queue = bus._queue
        grown = self._linger > base
        queue.crowded = min(queue.half, SLOTS * BURST) if grown else queue.half
        return self._linger

    async def _watch_sinks(self) -> None:
        """The watchdog of the bundled sinks' runner (see ``_runner``): while a turn goes on
        it looks on a timer, and otherwise waits for the next batch."""
        while True:
            runner = self.sinks
            wait = None if runner is None else runner.watch(self)
            if wait is None:
                busy = self._sinks_busy = anyio.Event()
                await busy.wait()
                self._sinks_busy = None  # a timed wait needs no wake-up per batch
            else:
                await anyio.sleep(wait)

    def handler_progressed(self) -> None:
        """Called by a runner after a batch: wake the distributor if it waits for room."""
        if self._waiting_for_room:
            self._waiting_for_room = False
            loop = self.loop
            if loop is not None and self._room is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._room.set)
