"""The event bus: a bounded queue in front of a dispatcher thread.

Guarantees
----------
- Ordering: each handler sees events in the order they were appended to the queue, so events
  from one producing thread arrive in the order that thread logged them.
- Blocking: ``log_event`` appends to a ``deque`` and returns. It takes no lock and makes no
  cross-thread call unless the dispatcher is idle, when it schedules one wake-up. Only the
  ``"block"`` overflow policy makes it wait, for at most ``block_timeout``; a thread of the bus
  itself (a handler, the dispatcher) never waits there: it would be waiting on itself.
- Threads: one daemon thread per bus runs an asyncio loop under ``anyio.run``. Its tasks drain the queue in batches, run the async handlers and close Stat windows on time.
  Each sync handler runs on a daemon thread of its own, so a slow one delays nobody else.
- Overflow: the queue and each handler's backlog hold at most ``capacity`` events; past that
  the policy drops the newest or the oldest (counted per handler and in ``stats()``) or, for
  ``"block"``, holds the producer back. Memory stays bounded by the capacity.
- Fork: the child gets a fresh, stopped dispatcher, an empty queue and the same handlers; the
  dispatcher starts again on the first event the child logs. Open Stat windows are left to the
  parent.
- Exit: at interpreter exit (``atexit``) and at the end of a ``multiprocessing`` child (its
  finalizers), open Stat windows are logged and every bus is closed within its
  ``exit_timeout``. Nothing starts a thread there.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio

from . import _stat
from ._event import Event
from ._handler import EventHandler, EventHandlerHandle, _bus_threads, _Handler, _Item, in_bus_thread

if TYPE_CHECKING:
    from types import TracebackType

    from ._stat import Stat
    from ._subscription import EventFilter, Subscription

logger = logging.getLogger("monitor_bus")

Overflow = Literal["drop_newest", "drop_oldest", "block"]
_OVERFLOWS = ("drop_newest", "drop_oldest", "block")
_T = TypeVar("_T")

# Drops are reported by a warning at most once per this many seconds.
_DROP_WARNING_INTERVAL = 10.0
# After a wake-up the dispatcher waits this long before draining, so producers logging at a
# high rate append to the queue without waking it again.
_LINGER = 0.001
# Wake a timer this long after a window's end, so the window is surely over by its clock.
_TIMER_SLACK = 0.0005

_all_buses: weakref.WeakSet[EventBus] = weakref.WeakSet()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _TimedOut(Exception):
    pass


class EventBus:
    """A bounded queue of events and the dispatcher that fans them out to handlers.

    The module-level functions (``log_event``, ``register_event_handler``, ...) use a default
    bus; make your own for isolation (tests, several trainers in one process). A bus starts
    its thread when its first handler is registered and stops it in ``close()``.

    Args:
        capacity: most events held in the queue, and in each handler's backlog.
        overflow: what ``log_event`` does when the queue is full: ``"drop_newest"`` (the
            default), ``"drop_oldest"`` or ``"block"`` (wait up to ``block_timeout`` seconds,
            then drop the newest).
        block_timeout: seconds ``log_event`` may wait under ``"block"``; None waits as long
            as it takes.
        exit_timeout: seconds the bus may take at interpreter exit to deliver what is queued.
        name: shown in thread names and ``repr``.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).

    Example:
        >>> with EventBus() as bus:
        ...     seen = []
        ...     handle = bus.register_event_handler(seen.append)
        ...     bus.log_event(Event("hello", datetime.now(), {"x": 1}))
        ...     bus.flush()
        ...     len(seen)
        True
        1
    """

    def __init__(
        self,
        capacity: int = 65536,
        overflow: Overflow = "drop_newest",
        block_timeout: float | None = None,
        exit_timeout: float = 5.0,
        *,
        name: str = "bus",
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if overflow not in _OVERFLOWS:
            raise ValueError(f"overflow must be one of {', '.join(_OVERFLOWS)}; got {overflow!r}")
        _check_timeout("block_timeout", block_timeout)
        _check_timeout("exit_timeout", exit_timeout, allow_none=False)
        self._capacity = capacity
        self._limit = 3 * capacity  # the queue holds three slots per event
        self._overflow = overflow
        self._block_timeout = block_timeout
        self._exit_timeout = exit_timeout
        self._name = name
        self._stat_groups: dict[float, weakref.WeakSet[Stat]] = {}
        self._init_runtime()
        _all_buses.add(self)

    def _init_runtime(self) -> None:
        """State that a forked child starts afresh."""
        self._lock = threading.Lock()  # start, stop and registration changes
        self._space = threading.Condition(threading.RLock())  # producers blocked on a full queue
        self._queue: deque[Any] = deque()  # name, timestamp, data, name, ...
        self._handlers: tuple[_Handler, ...] = ()  # published snapshot; replaced, never mutated
        self._idle = True  # True: the next log_event schedules a wake-up (or a start)
        self._thread: threading.Thread | None = None
        self._loop: Any = None
        self._loop_context: contextvars.Context | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._wakeup: anyio.Event | None = None
        self._timers_changed: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._stopping = False
        self._closed = False
        self._waiting_for_room = False
        self._consumed = 0  # events taken off the queue by the dispatcher
        self._dropped = 0  # events the queue turned away (no handler got them)
        self._dropped_reported = 0
        self._last_drop_warning = -math.inf
        self._blocked = 0  # producers waiting for room
        self._errors = 0
        self._errors_lock = threading.Lock()
        self._room: anyio.Event | None = None

    # -- the caller's side --

    def log_event(self, event: Event) -> None:
        """Queue ``event`` for every registered handler and return at once.

        A no-op when no handler is registered. Never raises because of a handler. Safe from
        any thread, from a garbage-collection finalizer and from a signal handler.

        Raises:
            TypeError: ``event`` is not an ``Event``.
        """
        if event.__class__ is not Event and not isinstance(event, Event):
            raise TypeError(f"event must be an Event, not {type(event).__name__}")
        if not self._handlers:
            return
        # Queued flat, as three slots, so no per-event object the GC tracks is kept: a
        # backlog of tracked objects triggers full collections, which rescan the whole heap
        # (80 ms each in a process that has imported torch). Each handler gets an Event
        # rebuilt from the slots, as torch.monitor builds one per handler call.
        item = (event.name, event.timestamp, event.data)
        queue = self._queue
        if len(queue) < self._limit:
            queue.extend(item)  # one C call: atomic with respect to other producers
        else:
            self._overflowed(item)
        if self._idle:
            self._wake()

    def _log_nowait(self, item: _Item) -> None:
        """``log_event`` for the bus's own callers (Stat windows): never blocks."""
        if not self._handlers:
            return
        if len(self._queue) < self._limit:
            self._queue.extend(item)
        else:
            self._drop_one(item)
        if self._idle:
            self._wake()

    def _overflowed(self, event: _Item) -> None:
        if self._overflow == "block" and not in_bus_thread():
            with self._space:
                self._blocked += 1
                try:
                    if self._space.wait_for(
                        lambda: len(self._queue) < self._limit or self._closed,
                        self._block_timeout,
                    ) and not self._closed:
                        self._queue.extend(event)
                        return
                finally:
                    self._blocked -= 1
        self._drop_one(event)

    def _drop_one(self, event: _Item) -> None:
        with self._space:
            if self._overflow == "drop_oldest" and self._queue:
                # Under _space, as the dispatcher's pops are: the slots of one event stay together.
                pop = self._queue.popleft
                pop(), pop(), pop()
                self._queue.extend(event)
            self._dropped += 1

    def _wake(self) -> None:
        self._idle = False
        loop = self._loop
        if loop is None:
            # Only after a fork: the child's dispatcher starts on its first event. A finalizer
            # or signal handler that lands while another start is under way leaves it be.
            if self._lock.acquire(blocking=False):
                try:
                    if self._handlers and not self._closed:
                        self._start_locked()
                finally:
                    self._lock.release()
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: the bus is shutting down
            loop.call_soon_threadsafe(self._set_wakeup)

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

    # -- registration --

    def register_event_handler(
        self, callback: EventHandler, *, name: str | None = None
    ) -> EventHandlerHandle:
        """Deliver every event logged from now on to ``callback``.

        ``callback`` may be a plain callable, run on a thread of its own, or an async one
        (a coroutine function, or an object whose ``__call__`` is one), run on the bus's
        event loop. It receives each event logged after this call returns, once, in order.
        Safe to call from any thread, including from inside a handler.

        Handlers registered with an explicit ``name`` are keyed by it: registering another
        handler under the same name replaces the first, which still gets every event logged
        before the call. Re-running a notebook cell therefore does not double every event.

        Args:
            callback: the handler.
            name: key and display name (``stats()``, logs, thread names); defaults to the
                callback's qualified name, without keying.

        Raises:
            TypeError: ``callback`` is not callable, or ``name`` is not a str.
            RuntimeError: the bus is closed.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        keyed = name is not None
        if name is None:
            name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
        elif not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        handler = _Handler(self, callback, name, keyed=keyed)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._loop is None:
                self._start_locked()
        if not handler.is_async:
            handler.start_thread()
        replaced = self._in_loop(self._publish_add, handler)
        if replaced is not None:
            old, target = replaced
            if not in_bus_thread():
                old.wait_settled(target, None)
            old.stop()
        return EventHandlerHandle._new(handler)

    def unregister_event_handler(self, handle: EventHandlerHandle, timeout: float | None = None) -> bool:
        """Deliver to the handler everything logged before this call, then detach it.

        Once this returns, no call of the handler starts. From inside a handler (its own
        handle included) this does not wait: the handler still gets the events logged before
        the call, then is detached. An already-removed handle is a no-op.

        Args:
            handle: what ``register_event_handler`` returned.
            timeout: seconds to wait for delivery; None waits as long as it takes. Events
                not delivered in time are counted as dropped for that handler.

        Returns:
            True if everything was delivered in time.

        Raises:
            TypeError: ``handle`` is not an ``EventHandlerHandle``.
            ValueError: ``handle`` belongs to another bus.
        """
        if not isinstance(handle, EventHandlerHandle):
            raise TypeError(f"handle must be an EventHandlerHandle, not {type(handle).__name__}")
        handler = handle._handler
        if handler.bus is not self:
            raise ValueError("handle was returned by another bus")
        _check_timeout("timeout", timeout)
        if not handler.registered:
            return True
        deadline = _deadline(timeout)
        try:
            target = self._in_loop(self._publish_remove, handler, timeout=timeout)
        except _TimedOut:
            return False
        if target is None:  # removed meanwhile by another caller
            return True
        if in_bus_thread():
            handler.stop()
            return True
        done = handler.wait_settled(target, _remaining(deadline))
        if not done:
            handler.cut = True
        handler.stop()
        return handler.wait_stopped(_remaining(deadline)) and done

    # -- delivery control --

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event logged before the call has reached every handler.

        Returns:
            True when done, False if ``timeout`` seconds passed first.

        Raises:
            RuntimeError: called from inside a handler (it would wait on itself).
        """
        _check_timeout("timeout", timeout)
        if in_bus_thread():
            raise RuntimeError("flush() cannot be called from inside an event handler")
        if self._loop is None:
            return not self._queue
        deadline = _deadline(timeout)
        try:
            targets = self._in_loop(self._drain_targets, timeout=timeout)
        except _TimedOut:
            return False
        return all(h.wait_settled(target, _remaining(deadline)) for h, target in targets)

    async def aflush(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - mirrors flush
        """``flush`` for async callers: waits on a worker thread, not the caller's loop."""
        _check_timeout("timeout", timeout)
        if in_bus_thread():
            raise RuntimeError("aflush() cannot be called from inside an event handler")
        return await anyio.to_thread.run_sync(self.flush, timeout, abandon_on_cancel=True)

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what is queued, detach every handler and stop the dispatcher thread.

        Idempotent; later ``log_event`` calls are no-ops and registration raises.

        Returns:
            True if everything was delivered and every thread stopped within ``timeout``.
        """
        _check_timeout("timeout", timeout)
        if in_bus_thread():
            raise RuntimeError("close() cannot be called from inside an event handler")
        deadline = _deadline(timeout)
        with self._lock:
            self._closed = True
        with self._space:
            self._space.notify_all()
        try:
            targets = self._in_loop(self._detach_all, timeout=timeout)
        except _TimedOut:
            return False
        # The handlers settle concurrently: one stuck handler does not eat the others' time.
        settled = [h.wait_settled(target, _remaining(deadline)) for h, target in targets]
        for (handler, _), done in zip(targets, settled, strict=True):
            if not done:
                handler.cut = True
            handler.stop()
        stopped = [h.wait_stopped(_remaining(deadline)) for h, _ in targets]
        if self._queue and self._loop is None:
            lost = len(self._queue) // 3
            self._queue.clear()
            self._dropped += lost
            logger.warning("%r closed with %d undelivered events (dispatcher not running)", self, lost)
        return self._stop(deadline) and all(settled) and all(stopped)

    def _stop(self, deadline: float | None) -> bool:
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return True
            self._stopping = True
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._set_stopped)
            thread.join(_remaining(deadline))
            if thread.is_alive():
                return False
            self._loop = self._thread = None
            return True

    def _set_stopped(self) -> None:
        assert self._stopped is not None
        self._stopped.set()

    def __enter__(self) -> EventBus:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> EventBus:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await anyio.to_thread.run_sync(self.close)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def stats(self) -> dict[str, Any]:
        """A snapshot of the bus's counters.

        Keys: ``logged``, ``dropped`` (turned away by the full queue), ``queued``,
        ``handler_errors``, ``handler_dropped`` (sum over handlers, queue drops included) and
        ``handlers``: one mapping per registered handler with ``name``, ``async``, ``logged``
        (events logged while it was registered), ``delivered``, ``errors``, ``dropped`` and
        ``pending``. For each handler, ``logged == delivered + dropped + pending``.
        """
        queued = len(self._queue) // 3
        dropped = self._dropped
        handlers = [h.snapshot(queued, dropped) for h in self._handlers]
        return {
            "logged": self._consumed + queued + dropped,
            "dropped": dropped,
            "queued": queued,
            "handler_errors": self._errors,
            "handler_dropped": sum(h["dropped"] for h in handlers),
            "handlers": handlers,
        }

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._loop is not None else "idle"
        return f"<EventBus {self._name!r} {state}, {len(self._handlers)} handlers>"

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
        for handler in self._handlers:  # after a fork: the handlers' runners are gone
            if handler.is_async:
                self._in_loop(self._start_async, handler)
            else:
                handler.start_thread()
        if "multiprocessing" in sys.modules:
            from ._default import _finalize_with_multiprocessing

            _finalize_with_multiprocessing()

    def _thread_main(self, ready: Future[None]) -> None:
        _bus_threads.add(threading.get_ident())
        try:
            anyio.run(self._main, ready, backend="asyncio")
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:
                logger.exception("%r: dispatcher stopped with an error", self)
        finally:
            _bus_threads.discard(threading.get_ident())

    async def _main(self, ready: Future[None]) -> None:
        import asyncio

        self._wakeup = anyio.Event()
        self._timers_changed = anyio.Event()
        self._stopped = anyio.Event()
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            # Callbacks from other threads run in the loop's context, where anyio knows its backend.
            self._loop_context = contextvars.copy_context()
            self._loop = asyncio.get_running_loop()
            tg.start_soon(self._distribute)
            tg.start_soon(self._run_timers)
            ready.set_result(None)
            await self._stopped.wait()
            self._drain(force=True)
            self._report_drops(final=True)
            for handler in self._handlers:
                handler.stop()
            tg.cancel_scope.cancel()
        self._task_group = None

    def _in_loop(self, func: Callable[..., _T], *args: Any, timeout: float | None = None) -> _T:
        """Run ``func`` on the dispatcher's loop and return its result.

        Scheduled with ``call_soon_threadsafe`` and awaited on a concurrent future, so the
        timeout holds even when the loop is blocked (a handler calling ``time.sleep`` in an
        ``async def``): anyio's portal waits on the loop before it honours any timeout.
        """
        loop = self._loop
        if loop is None or self._thread is threading.current_thread():
            return func(*args)  # no loop to race with, or we are on it
        future: Future[_T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(func(*args))
                except BaseException as exc:
                    future.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run, context=self._loop_context)
        except RuntimeError:  # the loop has closed: nothing else runs these steps now
            return func(*args)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise _TimedOut from None

    def _start_async(self, handler: _Handler) -> None:
        assert self._task_group is not None
        handler.running = True
        self._task_group.start_soon(handler.run_async, name=f"monitor_bus-handler-{handler.name}")

    def _publish_add(self, handler: _Handler) -> tuple[_Handler, int] | None:
        """Add ``handler`` (replacing a keyed one of the same name); return what it replaced."""
        self._drain(force=True)  # what is queued was logged before the registration returned
        replaced = None
        if handler.keyed:
            for old in self._handlers:
                if old.keyed and old.name == handler.name:
                    replaced = (old, self._retire(old))
        handler.bus_dropped_base = self._dropped
        if handler.is_async and self._task_group is not None:
            self._start_async(handler)
        self._handlers = (*(h for h in self._handlers if h.registered), handler)
        return replaced

    def _retire(self, handler: _Handler) -> int:
        """Mark ``handler`` unregistered (the caller republishes); return its delivery target."""
        handler.registered = False
        handler.bus_dropped_end = self._dropped
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
        n = len(queue) // 3
        if not n:
            self._report_drops()
            return True
        handlers = self._handlers
        overflow: str = self._overflow
        if overflow == "block":
            if not force and handlers:
                n = min(n, min(self._capacity - h.backlog for h in handlers))
            overflow = "force"  # room was made above, or a flush asks for everything
        if n > 0:
            with self._space:
                pop = queue.popleft
                batch = [pop() for _ in range(3 * n)]
            self._consumed += n
            for handler in handlers:
                handler.push(batch, self._capacity, overflow)
            if self._blocked:
                with self._space:
                    self._space.notify_all()
        self._report_drops()
        return not queue

    async def _distribute(self) -> None:
        queue = self._queue
        while True:
            if not self._drain():
                # "block": every handler's backlog is full; wait until one makes progress.
                room = self._room = anyio.Event()
                self._waiting_for_room = True
                await room.wait()
                continue
            if not queue:
                self._wakeup = anyio.Event()
                self._idle = True
                if not queue:  # checked again: an append may have seen _idle still False
                    await self._wakeup.wait()
                self._idle = False
            # Let a burst accumulate: one wake-up and one batch per burst, not per event.
            await anyio.sleep(_LINGER)

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

    def _report_drops(self, *, final: bool = False) -> None:
        dropped = self._dropped
        if dropped == self._dropped_reported:
            return
        now = time.monotonic()
        if now - self._last_drop_warning < _DROP_WARNING_INTERVAL and not final:
            return
        logger.warning(
            "%r: queue full (capacity %d, policy %s): %d events dropped since the last report, "
            "%d in all",
            self,
            self._capacity,
            self._overflow,
            dropped - self._dropped_reported,
            dropped,
        )
        self._dropped_reported = dropped
        self._last_drop_warning = now

    # -- Stat windows on a timer --

    def _watch_stat(self, stat: Stat) -> None:
        window = stat._window
        with self._lock:
            group = self._stat_groups.get(window)
            if group is None:
                group = self._stat_groups[window] = weakref.WeakSet()
                new = True
            else:
                new = False
            group.add(stat)
            loop = self._loop
        if new and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._timers_changed_set)

    def _timers_changed_set(self) -> None:
        assert self._timers_changed is not None
        self._timers_changed.set()

    async def _run_timers(self) -> None:
        """Close every Stat window at its end, so a stalled producer still reports."""
        next_end: dict[float, float] = {}
        while True:
            assert self._timers_changed is not None
            self._timers_changed = anyio.Event()
            now = anyio.current_time()
            for window, group in list(self._stat_groups.items()):
                end = next_end.get(window)
                if end is None or now >= end:
                    if end is not None:
                        stamp, stamp_clock = datetime.now(timezone.utc), _stat._clock()
                        for stat in list(group):
                            if stat._clock_due():
                                stat._roll(stamp, stamp_clock)
                    next_end[window] = (math.floor(now / window) + 1) * window + _TIMER_SLACK
            if not next_end:
                await self._timers_changed.wait()
                continue
            delay = min(next_end.values()) - anyio.current_time()
            with anyio.move_on_after(max(delay, 0.0)):
                await self._timers_changed.wait()

    # -- fork and exit --

    def _after_fork_in_child(self) -> None:
        handlers = self._handlers
        self._init_runtime()
        for handler in handlers:
            handler.after_fork()
        self._handlers = handlers

    def _close_at_exit(self) -> None:
        if self._loop is None and not self._queue:
            self._closed = True
            return
        if not self.close(self._exit_timeout):
            logger.warning("%r: not every event was delivered within exit_timeout=%gs", self, self._exit_timeout)

    # -- subscriptions --

    def subscribe(self, name: EventFilter = None, *, buffer: int = 1024) -> Subscription:
        """The events logged from now on, as an async iterator in the caller's event loop.

        Use it in a task of an asyncio or trio loop (directly or through anyio). The
        subscription is an ordinary handler, registered when the block is entered and
        unregistered when it is left; it sees the matching events logged in between, in order.
        When its buffer is full the newest events are dropped and counted
        (``Subscription.dropped`` and the handler's ``dropped`` in ``stats()``). Safe to call
        from any thread that runs an event loop.

        Args:
            name: which events: None for all, a str for the events of that name, or a
                callable ``(Event) -> bool`` run on the handler's thread.
            buffer: most events held for the subscriber (at least 1).

        Returns:
            A ``Subscription``: an async context manager and async iterator of ``Event``.

        Raises:
            TypeError: ``name`` is neither None, a str nor callable; ``buffer`` is not an int.
            ValueError: ``buffer`` is below 1.
            RuntimeError: the calling thread runs no event loop (use it from async code).

        Example:
            ```python
            async with bus.subscribe("train.step", buffer=256) as events:
                async for event in events:
                    print(event.data["loss"])
            ```
        """
        from ._subscription import subscribe

        return subscribe(self, name, buffer)


def _check_timeout(name: str, value: float | None, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds{' or None' if allow_none else ''}, not {type(value).__name__}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")

