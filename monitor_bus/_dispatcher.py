"""The dispatcher side of a bus: its thread, its loop's tasks, Stat timers, fork and exit.

Guarantees
----------
- Threads: one daemon thread per bus runs an asyncio loop under ``anyio.run``, started with the
  bus's first handler (never at import), with a handshake so a failure to start reaches the
  caller. Its task group runs the distributor, the Stat timer and one task per async handler;
  each sync handler runs on a daemon thread of its own.
- Other threads reach the loop with ``call_soon_threadsafe`` and wait on a future with their
  own timeout, so ``flush``/``close`` stay bounded even if a handler blocks the loop.
- Registration changes run on the loop: the distributor drains what is queued to the current
  handlers, then publishes a new immutable tuple of handlers, which dispatch reads lock-free.
- Stat windows: at each boundary of each window size, the timer closes the windows that are
  due, so a stalled producer still reports.
- Failure: a dispatcher whose loop ends with an exception is logged at CRITICAL and replaced
  at once; after three failures within 10 s it stays down, and ``flush``/``close`` say so.
- Fork: the child gets fresh locks, an empty queue and a stopped dispatcher. A bus whose
  children report to the parent (``children="forward"``) keeps no handler in the child; its
  dispatcher starts for its Stats' timers. Otherwise the child keeps the same handlers and the
  dispatcher starts again on the first event the child logs.
- Exit: ``_close_at_exit`` (from ``atexit``, or a multiprocessing finalizer) closes the bus
  within ``exit_timeout``. It starts a dispatcher only where one was stopped with events or
  windows to deliver (a forked child that logged nothing since the fork).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from . import _device, _stat
from ._handler import _Handler
from ._lifecycle import WeakRegistry, process
from ._queue import EventQueue, resolve_ready, wait_for_devices
from ._ratelimit import LOG_INTERVAL, Throttle

if TYPE_CHECKING:
    from ._relay import Uplink
    from ._stat import Stat

logger = logging.getLogger("monitor_bus")

_T = TypeVar("_T")

# Wake a timer this long after a window's end, so the window is surely over by its clock.
_TIMER_SLACK = 0.0005
# A dispatcher failing this many times within LOG_INTERVAL is not started again: a failure that
# repeats at once would only fill the log and burn a core.
_MAX_FAILURES = 3


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _TimedOut(Exception):
    pass


class Dispatcher:
    """The loop-side half of ``EventBus``: what runs on, or talks to, the dispatcher thread."""

    _capacity: int
    _overflow: str
    _block_timeout: float | None
    _name: str
    _exit_timeout: float | None
    _linger: float
    _stat_groups: dict[float, WeakRegistry[Stat]]
    _dirty: dict[float, WeakRegistry[Stat]]
    _children: str
    _uplink: Uplink | None
    _clock_offset: float

    def _init_runtime(self) -> None:
        """State that a forked child starts afresh."""
        self._lock = threading.Lock()  # start, stop and registration changes
        self._queue = EventQueue(self._capacity, self._overflow, self._block_timeout)
        self._handlers: tuple[_Handler, ...] = ()  # published snapshot; replaced, never mutated
        self._idle = True  # True: the next log_event schedules a wake-up (or a start)
        self._thread: threading.Thread | None = None
        self._loop: Any = None
        self._loop_context: contextvars.Context | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._wakeup: anyio.Event | None = None
        self._hurried: anyio.Event | None = None  # ends a linger early
        self._hurrying = False
        self._timers_changed: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._stopping = False
        self._closed = False
        self._waiting_for_room = False
        self._dropped_reported = 0  # the part of the queue's drops already in a warning
        self._drop_throttle = Throttle()
        self._read_throttle = Throttle()
        self._report_lock = threading.Lock()
        self._restarts = 0  # times the dispatcher failed and was started again
        self._failures: deque[float] = deque(maxlen=_MAX_FAILURES)  # when, monotonic
        self._broken = False  # failed too often: no more restarts
        self._unrun: set[Callable[[], None]] = set()  # _in_loop calls the loop has not run
        self._errors = 0
        self._errors_lock = threading.Lock()
        self._room: anyio.Event | None = None
        # Events taken from the queue whose device values are not ready (flat slots): they go
        # to the handlers first, once read.
        self._held: list[Any] = []
        self._from_children = 0  # events the relay queued here
        self._to_parent = 0  # events sent to the parent process
        self._relay_index = 0  # how this process's relay connection names this bus (0: not yet)

    def _active(self) -> bool:
        """Whether the dispatcher has work: handlers, or Stat timers of a child that reports
        its windows to its parent."""
        return bool(self._handlers) or self._uplink is not None

    def _wake(self) -> None:
        self._idle = False
        loop = self._loop
        if loop is None:
            # After a fork (or a failed restart): the dispatcher starts on the next event. A
            # finalizer or signal handler that lands while another start is under way leaves it
            # be.
            if self._lock.acquire(blocking=False):
                try:
                    if self._active() and not self._closed and not self._broken:
                        self._start_locked()
                finally:
                    self._lock.release()
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: the bus is shutting down
            loop.call_soon_threadsafe(self._set_wakeup)

    def _ensure_running(self) -> bool:
        """Start the dispatcher if handlers wait for it (after a fork, or a failed restart);
        return whether it runs. A failure to start is logged, never raised."""
        if self._loop is None and self._active():
            with self._lock:
                if self._loop is None and self._active() and not self._closed and not self._broken:
                    try:
                        self._start_locked()
                    except Exception:
                        logger.exception("EventBus %r: the dispatcher could not start", self._name)
        return self._loop is not None

    def _hurry(self) -> None:
        """End the dispatcher's linger now (the queue is filling up), or wake it if idle."""
        if self._idle:
            self._wake()
        elif not self._hurrying:
            self._hurrying = True  # one call per linger, however many producers
            self._call_soon(self._set_hurried)

    def _set_hurried(self) -> None:
        if self._hurried is not None:
            self._hurried.set()

    def _call_soon(self, func: Callable[[], object]) -> None:
        """Run ``func`` on the loop thread soon, without waiting (a no-op once it is gone)."""
        loop = self._loop
        if loop is None:
            return
        if self._thread is threading.current_thread():
            func()
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(func, context=self._loop_context)

    def _set_wakeup(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _stop(self, deadline: float | None) -> bool:
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return True
            self._stopping = True
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._set_stopped)
        # Joined without the lock: a failing dispatcher takes it on its way out.
        thread.join(_remaining(deadline))
        if thread.is_alive():
            return False
        with self._lock:
            if self._thread is thread:
                self._loop = self._thread = None
        return True

    def _loop_cancelled(self) -> bool:
        """Whether the loop's tasks are being cancelled (the bus stops, or its loop failed)."""
        tg = self._task_group
        return self._stopping or tg is None or tg.cancel_scope.cancel_called

    def _set_stopped(self) -> None:
        assert self._stopped is not None
        self._stopped.set()

    # -- the dispatcher thread --

    def _start_locked(self) -> None:
        """Start the dispatcher and wait until it runs (``self._lock`` held)."""
        ready: Future[None] = Future()
        thread = threading.Thread(
            target=self._thread_main, args=(ready,), name=f"monitor_bus-{self._name}", daemon=True
        )
        thread.start()
        ready.result()  # re-raises a failure to start
        self._thread = thread
        self._stopping = False
        for handler in self._handlers:  # after a fork or a failure: runners that are gone
            if handler.running:
                continue
            if handler.is_async:
                # Not waited for: this thread may hold a Stat's lock (a window logged in a
                # forked child starts the dispatcher), which the loop's timer may need.
                handler.running = True  # from now: flush() waits for it
                self._schedule(self._loop, self._start_async, handler)
            else:
                handler.start_thread()
        if "multiprocessing" in sys.modules:
            process.finalize_with_multiprocessing()

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
        ended = self._loop
        if failure is not None:
            self._restart_after_failure(failure)
        # Calls scheduled on the loop that it never ran: on the new loop if a failure started
        # one (so they meet the restarted handlers), else here, as nothing else runs them now.
        loop = self._loop
        for run in list(self._unrun):
            if loop is not None and loop is not ended:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(run, context=self._loop_context)
                    continue
            run()

    def _restart_after_failure(self, failure: BaseException) -> None:
        """Start a new dispatcher in place of this failed one, then log the failure: delivery
        never ends quietly.

        Events queued meanwhile wait in the queue; a handler whose task died with the loop has
        its backlog counted as dropped (and reported). After ``_MAX_FAILURES`` failures within
        ``LOG_INTERVAL``, no new dispatcher starts. Should a start itself fail, the next
        ``log_event``, ``flush`` or ``close`` tries again.
        """
        now = time.monotonic()
        with self._lock:
            if self._thread is not threading.current_thread():
                return  # close() already gave up on this thread
            self._loop = self._thread = None
            self._idle = True
            self._failures.append(now)
            self._broken = (
                len(self._failures) == _MAX_FAILURES and now - self._failures[0] < LOG_INTERVAL
            )
            if self._broken:
                self._queue.close()  # producers blocked for room drop instead of waiting
            else:
                self._restarts += 1
                if not (self._closed or self._stopping or not self._active()):
                    try:
                        self._start_locked()
                    except Exception:
                        logger.exception(
                            "EventBus %r: the dispatcher could not start again", self._name
                        )
            # Logged once the new dispatcher runs, so what a reader of the log does next
            # meets the bus in its new state.
            logger.critical(
                "EventBus %r: the dispatcher failed (failure %d); %s",
                self._name,
                self._restarts + self._broken,  # every failure so far
                f"{_MAX_FAILURES} failures within {LOG_INTERVAL:g} s: it is not started "
                "again; events wait in the queue for close(), and flush() and close() return "
                "False"
                if self._broken
                else "a new one runs",
                exc_info=failure,
            )

    async def _main(self, ready: Future[None]) -> None:
        import asyncio

        self._wakeup = anyio.Event()
        self._timers_changed = anyio.Event()
        self._stopped = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                # Callbacks from other threads run in the loop's context, where anyio knows
                # its backend.
                self._loop_context = contextvars.copy_context()
                self._loop = asyncio.get_running_loop()
                tg.start_soon(self._distribute)
                tg.start_soon(self._run_timers)
                ready.set_result(None)
                await self._stopped.wait()
                self._drain(force=True)
                for handler in self._handlers:
                    handler.stop()
                tg.cancel_scope.cancel()
        finally:
            self._task_group = None  # a failed loop too: nothing may start on it

    def _in_loop(self, func: Callable[..., _T], *args: Any, timeout: float | None = None) -> _T:
        """Run ``func`` on the dispatcher's loop and return its result.

        Scheduled with ``call_soon_threadsafe`` and awaited on a concurrent future, so the
        timeout holds even when the loop is blocked (a handler calling ``time.sleep`` in an
        ``async def``): anyio's portal waits on the loop before it honours any timeout.
        """
        loop = self._loop
        if self._thread is threading.current_thread():
            return func(*args)  # we are on the loop
        if loop is None:
            with self._lock:  # no dispatcher: nothing else runs these steps while we hold it
                if self._loop is None:
                    return func(*args)
                loop = self._loop
        future = self._schedule(loop, func, *args)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise _TimedOut from None

    def _schedule(self, loop: Any, func: Callable[..., _T], *args: Any) -> Future[_T]:
        """Have ``func`` run on ``loop`` soon, or by the loop's thread as it ends, or here if
        the loop has closed: exactly once, whichever comes first."""
        future: Future[_T] = Future()

        def run() -> None:
            try:
                self._unrun.remove(run)  # claimed once: by the loop, its end, or the caller
            except KeyError:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(func(*args))
                except BaseException as exc:
                    future.set_exception(exc)

        self._unrun.add(run)
        try:
            loop.call_soon_threadsafe(run, context=self._loop_context)
        except RuntimeError:  # the loop has closed: nothing else runs these steps now
            run()
        return future

    def _start_async(self, handler: _Handler) -> None:
        tg = self._task_group
        if tg is None:  # the loop ended first: its backlog is lost, the next start runs it
            handler._exit()
            return
        handler.running = True
        tg.start_soon(handler.run_async, name=f"monitor_bus-handler-{handler.name}")

    def _publish_add(self, handler: _Handler) -> _Handler | None:
        """Add ``handler`` (replacing a keyed one of the same name); return what it replaced."""
        self._drain(force=True)  # what is queued was logged before the registration returned
        replaced = None
        if handler.keyed:
            for old in self._handlers:
                if old.keyed and old.name == handler.name:
                    self._retire(old)
                    replaced = old
        handler.bus_dropped_base = self._queue.dropped
        if handler.is_async and self._task_group is not None:
            self._start_async(handler)
        self._handlers = (*(h for h in self._handlers if h.registered), handler)
        return replaced

    def _retire(self, handler: _Handler) -> int:
        """Mark ``handler`` unregistered (the caller republishes); return its delivery target."""
        handler.registered = False
        handler.bus_dropped_end = self._queue.dropped
        return handler.offered

    def _publish_remove(self, handler: _Handler) -> int | None:
        if not handler.registered:
            return None
        self._drain(force=True)
        target = self._retire(handler)
        self._handlers = tuple(h for h in self._handlers if h is not handler)
        return target

    def _detach_all(self) -> list[tuple[_Handler, int]]:
        self._drain(force=True)
        handlers, self._handlers = self._handlers, ()
        return [(h, self._retire(h)) for h in handlers]

    def _drain_targets(self) -> list[tuple[_Handler, int]]:
        self._drain(force=True)
        return [(h, h.offered) for h in self._handlers]

    def _drain(self, *, force: bool = False) -> bool:
        """Move queued events to the handlers' inboxes; False if ``block`` left some queued."""
        queue = self._queue
        n = len(queue)
        handlers = self._handlers
        if n or self._held:
            overflow: str = self._overflow
            if overflow == "block":
                if not force and handlers:
                    n = min(n, min(self._capacity - h.backlog for h in handlers))
                overflow = "force"  # room was made above, or a flush asks for everything
            batch = queue.take(n) if n > 0 else []
            if _device.used:
                # Device values are read here, a thread of the bus; a flush or a close waits
                # for the device, the distributor waits on a worker thread instead.
                held, self._held = self._held, []
                batch, self._held, failed = resolve_ready(
                    held + batch if held else batch, wait=force
                )
                if failed:
                    self._unreadable(failed)
            if batch:
                for handler in handlers:
                    handler.push(batch, self._capacity, overflow)
        self._report_drops(handlers)
        return not queue.slots

    async def _distribute(self) -> None:
        queue = self._queue.slots
        while True:
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
            if self._held:  # a device is not done with values logged: wait off the loop
                await anyio.to_thread.run_sync(wait_for_devices, self._held, abandon_on_cancel=True)
                continue
            if not moved and not queue:
                # A whole linger passed with nothing logged: sleep until an event wakes us.
                self._wakeup = anyio.Event()
                self._idle = True
                if not queue:  # checked again: an append may have seen _idle still False
                    await self._wakeup.wait()
                self._idle = False
            # Let events accumulate: one batch per linger while they keep coming, and no
            # cross-thread wake-up for the producers meanwhile (``_idle`` stays False). A
            # producer that finds the queue half full ends the linger early.
            self._hurried = anyio.Event()
            self._hurrying = False
            # Checked after the reset: a producer that crowds the queue from now on hurries
            # this linger; one that did before is seen here.
            if len(queue) < self._queue.crowded:
                with anyio.move_on_after(self._linger):
                    await self._hurried.wait()

    def _unreadable(self, failed: list[tuple[str, Exception]]) -> None:
        """Events whose device values could not be read: dropped, counted and reported."""
        self._queue.count_unreadable(len(failed))
        if self._read_throttle.ready():
            name, exc = failed[0]
            logger.error(
                "EventBus %r: %d events dropped: a device value could not be read (event %r: %r)",
                self._name,
                len(failed),
                name,
                exc,
            )

    def _handler_progressed(self) -> None:
        """Called by a runner after a batch: wake the distributor if it waits for room."""
        if self._waiting_for_room:
            self._waiting_for_room = False
            loop = self._loop
            if loop is not None and self._room is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._room.set)

    def _count_error(self) -> None:
        with self._errors_lock:
            self._errors += 1

    def _report_drops(self, handlers: Iterable[_Handler], *, final: bool = False) -> None:
        """Warn about new drops, queue-side and per handler, at most once per interval each
        (``final``: now, whatever the interval; for a bus or handler that is going away).

        Called by the dispatcher after each drain, by ``close`` and by a runner that exits:
        the lock makes each drop reported once.
        """
        with self._report_lock:
            self._report_drops_locked(handlers, final)

    def _report_drops_locked(self, handlers: Iterable[_Handler], final: bool) -> None:
        queue = self._queue
        dropped = queue.dropped
        if dropped != self._dropped_reported and (final or self._drop_throttle.ready()):
            logger.warning(
                "EventBus %r: queue full (capacity %d, policy %s): %d events dropped since the "
                "last report, %d in all",
                self._name,
                self._capacity,
                self._overflow,
                dropped - self._dropped_reported,
                dropped,
            )
            self._dropped_reported = dropped
        for handler in handlers:
            lost = handler.dropped
            if lost != handler.dropped_reported and (final or handler.throttle.ready("drops")):
                logger.warning(
                    "EventBus %r: handler %r fell behind (backlog capacity %d, policy %s): %d "
                    "events dropped since the last report, %d in all",
                    self._name,
                    handler.name,
                    self._capacity,
                    self._overflow,
                    lost - handler.dropped_reported,
                    lost,
                )
                handler.dropped_reported = lost

    # -- Stat windows on a timer --

    def _watch_stat(self, stat: Stat) -> None:
        window = stat._window
        with self._lock:
            group = self._stat_groups.get(window)
            new = group is None
            if group is None:
                group = self._stat_groups[window] = WeakRegistry()
            group.add(stat)
            loop = self._loop
        if new and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._timers_changed_set)
        elif loop is None and self._uplink is not None:
            self._ensure_running()  # a child's windows close on time too

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

    def _timers_changed_set(self) -> None:
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
        now = _stat._clock()
        # One C call, atomic with respect to _watch_stat; never _lock, which a thread starting
        # the dispatcher holds while it waits on this loop.
        for window in list(self._stat_groups):
            end = next_end.get(window)
            if end is None or now >= end:
                if end is not None:
                    stamp, clock = datetime.now(timezone.utc), _stat._clock()
                    # Only the Stats holding data: thousands of idle ones cost nothing.
                    for stat in self._dirty_stats(window).snapshot():  # never takes a lock
                        stat._close_on_timer(clock, stamp)
                next_end[window] = _stat.window_end(now, window, self._clock_offset) + _TIMER_SLACK
        return min(next_end.values()) if next_end else None

    # -- fork and exit --

    def _after_fork_in_child(self) -> None:
        handlers = self._handlers
        self._init_runtime()
        self._uplink = process.uplink if self._children == "forward" else None
        if self._uplink is not None:
            return  # the parent runs the handlers: the child sends it its events instead
        for handler in handlers:
            handler.after_fork()
        self._handlers = handlers
