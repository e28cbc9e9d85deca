"""The event bus: a bounded queue in front of a dispatcher thread.

Guarantees
----------
- Ordering: each handler sees events in the order they were appended to the queue, so events
  from one producing thread arrive in the order that thread logged them.
- Blocking: ``log_event`` (and ``log``, the same path without an ``Event``) appends to a
  ``deque`` and returns. It takes no lock and makes no
  cross-thread call unless the dispatcher is idle, when it schedules one wake-up. Only the
  ``"block"`` overflow policy makes it wait, for at most ``block_timeout``; a thread of the bus
  itself (a handler, the dispatcher) never waits there: it would be waiting on itself. Nor
  does it raise for want of a thread or a file descriptor (a dispatcher started by an event
  after a fork, a child's connection to its parent): see ``_dispatcher.py`` and ``_relay.py``.
- Threads: one daemon thread per bus runs an asyncio loop under ``anyio.run``; its tasks drain
  the queue in batches, run the async handlers and close Stat windows on time. Each sync
  handler runs on a daemon thread of its own, so a slow one delays nobody else; the bundled
  sinks share one, with a watchdog (``_runner.py``). The loop side
  is a ``Dispatcher`` the bus owns (``_dispatcher.py``, with its own guarantees); the bus
  keeps what callers touch: settings, the queue, the published handlers, the ``_idle`` flag,
  Stat registries and the counters of ``stats()``.
- Overflow: the queue and each handler's backlog hold at most ``capacity`` events; past that
  the policy drops the newest or the oldest or, for ``"block"``, holds the producer back. Every
  drop is counted (per handler and in ``stats()``) and reported on the ``monitor_bus`` logger
  at most once per 10 s per bus and per handler, naming them and the count
  (``_drop_report.py``). A Stat window is never dropped, under any policy
  (``_stat_registry.py``); what child processes send is queued as the bus's own events are
  (``_child_intake.py``). The queue's protocol is in ``_queue.py``.
- Handlers never share data: each gets its own ``Event`` and its own copy of ``data``.
- No handler: what is logged while a bus has none goes nowhere, counted (``unhandled`` in
  ``stats()``) and, once the bus has had a handler, named in a warning at close and exit.
  Unregistering the last handler first logs each Stat's open window to it, as exit does.
- Closing, and the counts a closed bus keeps: see ``_closing.py`` and ``_counters.py``.
- Fork and exit: see ``_lifecycle.py``. Every wait (``register_event_handler``, ``flush``,
  ``close``, leaving a ``with`` block, exit) is bounded by its timeout; ``math.inf`` means no
  limit. ``flush`` also waits for a ``ProcessHandler``'s child to acknowledge what it got.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from time import time as _now
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ._check import check_int, check_timeout, wrong_type
from ._closing import Closing
from ._counters import Counters
from ._dispatcher import Dispatcher, _deadline, _remaining
from ._event import PLAIN, Event, check_name, data_value_t, normalize
from ._handler import EventHandler, EventHandlerHandle, _Handler
from ._lifecycle import WeakRegistry, in_bus_thread, process
from ._portal import _TimedOut
from ._queue import (
    EventQueue,
    _Item,
)
from ._subscription import subscribe

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from ._stat import Stat
    from ._subscription import EventFilter, Subscription
    from ._window import ClosedWindow

logger = logging.getLogger("monitor_bus")

Overflow = Literal["drop_newest", "drop_oldest", "block"]
"""What a full queue does with the next event: ``EventBus(overflow=...)``."""
_OVERFLOWS = ("drop_newest", "drop_oldest", "block")
Children = Literal["forward", "own"]
"""Where a child process's events go: ``EventBus(children=...)``."""
_CHILDREN = ("forward", "own")


class EventBus(Closing, Counters):
    """A bounded queue of events and the dispatcher that fans them out to handlers.

    The module-level functions (``log_event``, ``register_event_handler``, ...) use a default
    bus; make your own for isolation (tests, several trainers in one process). A bus starts
    its thread when its first handler is registered and stops it in ``close()``.

    Args:
        capacity: most events held in the queue, and in each handler's backlog.
        overflow: what ``log_event`` does when the queue is full: ``"drop_newest"`` (the
            default), ``"drop_oldest"`` or ``"block"`` (wait up to ``block_timeout`` seconds,
            then drop the newest).
        block_timeout: seconds ``log_event`` may wait under ``"block"``; None (or
            ``math.inf``) waits as long as it takes.
        exit_timeout: seconds the bus may take to deliver what is queued at interpreter exit
            and when a ``with`` / ``async with`` block using it ends; ``math.inf`` waits as
            long as it takes. Handlers still busy then are cut off, and named in a warning.
        name: shown in thread names, logs and ``repr``; a child process started by
            ``spawn`` or ``forkserver`` reports a bus's events to the parent's bus of the
            same name.
        children: what the child processes of this process do with the events they log on
            this bus: ``"forward"`` (the default) sends them to this process, whose handlers
            get them (with ``Event.origin`` saying which child), while a forked child runs
            none of the handlers it inherited; ``"own"``: a forked child keeps copies of the
            handlers and runs them itself, as torch.monitor does, and a spawned one reports
            nowhere. Handlers a child registers itself get its events in either case.
        linger: seconds the dispatcher lets events accumulate into one batch, once woken,
            and again after each batch while events keep coming, so a steady producer never
            pays a cross-thread wake-up; a queue half full ends it early. The default, 20 ms,
            bounds the dispatcher to 50 wake-ups a second at a delivery delay users do not
            see. While batches stay under 1,024 events it doubles after each, up to 100 ms
            (a trickle then makes 10 wake-ups a second); 1,024 queued events end it, so such
            a burst waits no longer than this. 0 hands each burst over at once. ``flush()``
            and Stat windows do not wait for it.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).

    Examples:
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
        children: Children = "forward",
        linger: float = 0.02,
    ) -> None:
        self._capacity: int = check_setting("capacity", capacity)
        self._overflow: Overflow = check_setting("overflow", overflow)
        self._block_timeout: float | None = check_setting("block_timeout", block_timeout)
        self._exit_timeout: float | None = check_setting("exit_timeout", exit_timeout)
        self._linger: float = check_setting("linger", linger)
        if not isinstance(name, str):
            raise wrong_type("name", "a str", name)
        self._name = name
        self._children: Children = check_setting("children", children)
        self._creator = (os.getpid(), next(process.serials))  # names this bus to the relay
        self._uplink = process.uplink if children == "forward" else None
        self._stat_groups: dict[float, WeakRegistry[Stat]] = {}
        self._dirty: dict[float, WeakRegistry[Stat]] = {}
        # Stat windows are multiples of their size on the monotonic clock plus this offset
        # (a merge across processes sets it so they are on the wall clock).
        self._clock_offset = 0.0
        # Takes each closed Stat window first when set (a merge across processes); returns
        # True for a window it took.
        self._window_tap: Callable[[ClosedWindow], bool] | None = None
        self._had_handler = False  # a handler was registered once: see _say_unhandled
        self._init_runtime()
        process.buses.add(self)

    def _init_runtime(self) -> None:
        """State that a forked child starts afresh, its dispatcher included."""
        self._queue = EventQueue(self._capacity, self._overflow, self._block_timeout)
        self._handlers: tuple[_Handler, ...] = ()  # published snapshot; replaced, never mutated
        # Detached handlers whose runner has not exited yet (unregistered or replaced): close()
        # waits for them too. A runner leaves this set as it exits.
        self._leaving: set[_Handler] = set()
        self._idle = True  # True: the next log_event schedules a wake-up (or a start)
        self._closed = False
        self._closing = False  # close() began: see _begin_closing
        self._restarts = 0  # times the dispatcher failed and was started again
        self._errors = 0
        self._errors_lock = threading.Lock()
        self._from_children = 0  # events the relay queued here
        self._to_parent = 0  # events sent to the parent process
        self._late_dropped = self._late_said = 0  # from children after the close (_drop_late)
        # Events (Stat windows included) logged while no handler was registered, and of those
        # the count a warning named (_say_unhandled). Counted without a lock: under the GIL an
        # int's += runs between two checks for a thread switch, a signal or a collection.
        self._unhandled = self._unhandled_said = 0
        # The handlers' counts when close() detached them: a closed bus reports its totals.
        self._final_handlers: list[dict[str, Any]] | None = None
        self._detached: list[tuple[_Handler, int]] = []  # and what each was to settle first
        self._relay_index = 0  # how this process's relay connection names this bus (0: not yet)
        self._dispatcher = Dispatcher(self)

    # -- the caller's side --

    def log_event(self, event: Event) -> None:
        """Queue ``event`` for every registered handler and return at once.

        A no-op when no handler is registered. Never raises because of a handler. Safe from
        any thread, from a garbage-collection finalizer and from a signal handler.

        Raises:
            TypeError: ``event`` is not an ``Event``.
        """
        if event.__class__ is not Event and not isinstance(event, Event):
            raise wrong_type("event", "a monitor_bus.Event", event)
        self._put((event.name, event.timestamp, event.data))

    def log(self, name: str, /, **data: data_value_t) -> None:
        """Queue an event named ``name`` holding ``data`` for every registered handler, as
        ``log_event(Event(name, datetime.now(), data))`` does, at a fraction of its cost.

        For code that logs many events per step: no ``Event`` is made on the caller's thread,
        and the timestamp is taken as ``time.time()``; a handler's ``Event.timestamp`` makes it
        the naive local ``datetime`` of that instant (``datetime.now()``'s) when first read. The
        checks and conversions are ``Event``'s, so handlers get the same events. A no-op when
        no handler is registered (the arguments are still checked). Safe from any thread, from
        a garbage-collection finalizer and from a signal handler.

        Args:
            name: what happened, for example ``"train.step"``.
            **data: the event's values, as ``Event``'s ``data`` takes them; the keys are the
                keyword names (a ``str`` subclass among keys unpacked with ``**`` is kept).

        Raises:
            TypeError: ``name`` is not a str, or a value is of none of the types ``Event``
                takes (the message names its key).
            ValueError: ``name`` is empty.

        Examples:
            >>> with EventBus() as bus:
            ...     seen = []
            ...     handle = bus.register_event_handler(seen.append)
            ...     bus.log("train.step", loss=0.5, step=1)
            ...     bus.flush()
            ...     seen[0].data
            True
            {'loss': 0.5, 'step': 1}
        """
        if name.__class__ is not str:
            name = check_name(name)
        if not name:  # ``Event("")`` stays accepted, as torch.monitor's is
            raise ValueError("name must not be empty")
        # ``plain`` for keyword arguments, whose keys Python made str: the values only, inline
        # (the caller's hot path: half of what ``Event`` pays for its checks).
        for value in data.values():
            if type(value) not in PLAIN:
                data = normalize(data)
                break
        # ``_put``'s common case inline (its frame was a sixth of this call's cost): this process
        # logs for itself, a handler is registered and the queue is not crowded.
        queue = self._queue
        slots = queue.slots
        if self._uplink is None and self._handlers and len(slots) < queue.crowded:
            slots.extend((name, _now(), data))  # one C call, as in _put
            if self._idle:
                self._dispatcher.wake()
        else:
            self._put((name, _now(), data))

    def _put(self, item: _Item) -> None:
        """Send ``item`` to the parent process (a child's) and queue it for the handlers."""
        uplink = self._uplink  # read once: the relay may unset it meanwhile
        if uplink is not None:  # a child process: to the parent, before returning
            uplink.send(self, item, window=False)
        if not self._handlers:
            if self._uplink is None:  # sent to no one: counted
                self._unhandled += 1
            return
        # Queued flat, as three slots (see _queue for the protocol). Each handler gets an Event
        # rebuilt from the slots, as torch.monitor builds one per handler call.
        queue = self._queue
        if len(queue.slots) < queue.crowded:
            queue.slots.extend(item)  # one C call: atomic with respect to other producers
            if self._idle:
                self._dispatcher.wake()
        else:
            self._put_crowded(item)

    def _put_crowded(self, item: _Item) -> None:
        """``log_event``'s slow path, past half the capacity: append and end the dispatcher's
        linger, or, with the queue full, apply the overflow policy."""
        queue = self._queue
        if len(queue.slots) < queue.limit:
            queue.slots.extend(item)
            self._dispatcher.hurry()
            return
        # Before waiting for room: a lingering or stopped dispatcher makes none.
        self._dispatcher.hurry()
        queue.put_full(item)

    # -- registration --

    def register_event_handler(
        self, callback: EventHandler, *, name: str | None = None, timeout: float | None = None
    ) -> EventHandlerHandle:
        """Deliver every event logged from now on to ``callback``.

        ``callback`` may be a plain callable, run on a thread of its own, or an async one
        (a coroutine function, or an object whose ``__call__`` is one), run on the bus's
        event loop. It receives each event logged after this call returns, once, in order.
        Safe to call from any thread, including from inside a handler.

        Handlers registered with an explicit ``name`` are keyed by it: registering another
        handler under the same name replaces the first, which still gets every event logged
        before the call (this call does not wait for that). Re-running a notebook cell
        therefore does not double every event.

        The handler is added on the bus's loop, so that it gets exactly the events logged after
        this call returns; the call waits for the loop, which an async handler that blocks it
        (``time.sleep`` in an ``async def``) holds up. Past ``timeout`` it raises instead, with
        nothing registered: a handler added later would miss events with none counted.

        Args:
            callback: the handler.
            name: key and display name (``stats()``, logs, thread names); defaults to the
                callback's qualified name, without keying.
            timeout: seconds to wait for the bus's loop; None or ``math.inf`` waits as long
                as it takes.

        Raises:
            TypeError: ``callback`` is not callable, or ``name`` is not a str.
            RuntimeError: the bus is closed.
            TimeoutError: the loop did not take the handler within ``timeout`` seconds; it is
                not registered (the message names it).
        """
        if not callable(callback) and not callable(getattr(callback, "handle_batch", None)):
            raise wrong_type("callback", "callable (or a batch handler)", callback)
        keyed = name is not None
        if name is None:
            name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
        elif not isinstance(name, str):
            raise wrong_type("name", "a str", name)
        timeout = check_timeout("timeout", timeout)
        handler = _Handler(self, callback, name, keyed=keyed)
        dispatcher = self._dispatcher
        with dispatcher.lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            self._had_handler = True
            if dispatcher.loop is None:
                dispatcher.start_locked()
        process.ensure_listener()
        if not handler.is_async:
            handler.start_thread()
        added = dispatcher.submit(dispatcher.publish_add, handler)
        try:
            replaced = added.result(timeout)
        except FutureTimeout:
            if added.cancel():  # it will never run: nothing was published
                handler.stop()
                raise TimeoutError(
                    f"EventBus {self._name!r}: the loop did not take handler {name!r} within "
                    f"{timeout} s (an async handler blocks it?); the handler is not registered"
                ) from None
            replaced = added.result()  # it is running on the loop right now: a short step
        if replaced is not None:
            self._leaving.add(replaced)
            replaced.stop()  # it delivers its backlog, then exits; no wait on a stuck one
        if process.default_bus is self:
            process.handle_sigterm()  # SIGTERM delivers what it holds (see _lifecycle)
        return EventHandlerHandle._new(handler)

    def unregister_event_handler(
        self, handle: EventHandlerHandle, timeout: float | None = None
    ) -> bool:
        """Deliver to the handler everything logged before this call, then detach it.

        If it is the bus's last handler, each of the bus's Stats first logs its open window
        (partial, as at exit), which the handler gets too: with no handler left, a window
        closed later would go nowhere.

        Once this returns, True or False, no further call of the handler starts (bar one its
        thread was starting at that very moment). From inside a handler (its own handle
        included) this does not wait: the handler still gets the events logged before the
        call, then is detached. The handle of a keyed handler that a later registration
        replaced is waited for in the same way (it still delivers what it had); any other
        already-removed handle is a no-op.

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
            raise wrong_type("handle", "a monitor_bus.EventHandlerHandle", handle)
        handler = handle._handler
        if handler.bus is not self:
            raise ValueError("handle was returned by another bus")
        timeout = check_timeout("timeout", timeout)
        deadline = _deadline(timeout)
        if not handler.registered:
            # Replaced by a keyed registration and still delivering: waited for like any other.
            if handler in self._leaving and not in_bus_thread():
                return self._let_go(handler, handler.offered, deadline)
            return True
        dispatcher = self._dispatcher
        queue = self._queue
        logged, turned_away = queue.consumed + len(queue), queue.dropped
        try:
            target = dispatcher.in_loop(dispatcher.publish_remove, handler, timeout=timeout)
        except _TimedOut:
            # The loop did not answer (busy or blocked): no call starts from now on, and the
            # loop detaches the handler when it gets there; what it misses counts as dropped.
            handler.cut_off(logged)
            self._leaving.add(handler)
            dispatcher.submit(dispatcher.remove_cut, handler, logged, turned_away)
            return False
        if target is None:  # removed meanwhile by another caller
            return True
        if in_bus_thread():
            self._leaving.add(handler)
            handler.stop()
            return True
        return self._let_go(handler, target, deadline)

    def _let_go(self, handler: _Handler, target: int, deadline: float | None) -> bool:
        """Wait until detached ``handler`` has settled ``target`` events, cut it off past
        ``deadline``, and stop it; True if it got them all and stopped in time."""
        self._leaving.add(handler)
        done = handler.wait_settled(target, _remaining(deadline))
        if not done:
            handler.cut_off(target)
        handler.stop()
        return handler.wait_stopped(_remaining(deadline)) and done

    # -- delivery control --

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event logged before the call has reached every handler (for a
        ``ProcessHandler``: has been handled in its child process).

        Args:
            timeout: seconds to wait; None or ``math.inf`` waits as long as it takes.

        Returns:
            True when done, False if ``timeout`` seconds passed first.

        Raises:
            RuntimeError: called from inside a handler (it would wait on itself).
        """
        timeout = check_timeout("timeout", timeout)
        if in_bus_thread():
            raise RuntimeError("flush() cannot be called from inside an event handler")
        deadline = _deadline(timeout)
        if not self._sweep_children(timeout):
            return False
        dispatcher = self._dispatcher
        if not dispatcher.ensure_running():
            return not self._queue.slots and not dispatcher.broken
        try:
            targets = dispatcher.in_loop(dispatcher.drain_targets, timeout=_remaining(deadline))
        except _TimedOut:
            return False
        if not all(h.wait_settled(target, _remaining(deadline)) for h, target in targets):
            return False
        return all(_caught_up(h.callback, deadline) for h, _ in targets)

    async def aflush(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - mirrors flush
        """``flush`` for async callers: waits on a worker thread, not the caller's loop."""
        timeout = check_timeout("timeout", timeout)
        if in_bus_thread():
            raise RuntimeError("aflush() cannot be called from inside an event handler")
        return await anyio.to_thread.run_sync(self.flush, timeout, abandon_on_cancel=True)

    def __enter__(self) -> EventBus:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the bus within ``exit_timeout``, as at interpreter exit."""
        self._close_at_exit()

    async def __aenter__(self) -> EventBus:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the bus within ``exit_timeout``, on a worker thread."""
        await anyio.to_thread.run_sync(self._close_at_exit, abandon_on_cancel=True)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def __repr__(self) -> str:
        running = self._dispatcher.loop is not None
        state = "closed" if self._closed else "running" if running else "idle"
        return f"<EventBus {self._name!r} {state}, {len(self._handlers)} handlers>"

    # -- Stat registries, and what Stats and handlers ask of the bus --

    def _after_fork_in_child(self) -> None:
        handlers = self._handlers
        for handler in handlers:
            if handler.cut:  # unregistered (timed out) before the loop detached it
                handler.registered = False
        handlers = tuple(h for h in handlers if h.registered)
        self._init_runtime()
        self._uplink = process.uplink if self._children == "forward" else None
        if self._uplink is not None:
            return  # the parent runs the handlers: the child sends it its events instead
        for handler in handlers:
            handler.after_fork()
        self._handlers = handlers

    # -- subscriptions --

    def subscribe(self, name: EventFilter = None, *, buffer: int = 1024) -> Subscription:
        """The events logged from now on, as an async iterator in the caller's event loop.

        Use it in a task of an asyncio or trio loop (directly or through anyio). The
        subscription is an ordinary handler, registered when the block is entered and
        unregistered when it is left; it sees the matching events logged in between, in order.
        When its buffer is full the newest events are dropped and counted
        (``Subscription.dropped`` and the handler's ``dropped`` in ``stats()``), Stat windows
        included: the buffer is the subscriber's own bound, sized by ``buffer``. Safe to call
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

        Examples:
            ```python
            async with bus.subscribe("train.step", buffer=256) as events:
                async for event in events:
                    print(event.data["loss"])
            ```
        """
        return subscribe(self, name, buffer)


def _caught_up(callback: object, deadline: float | None) -> bool:
    """Whether a sink that hands its events on (``ProcessHandler``, to a child process) has
    had them handled there, waiting until ``deadline``; any other handler has, once settled."""
    wait = getattr(callback, "_monitor_bus_wait_done", None)
    return wait is None or bool(wait(_remaining(deadline)))


def check_setting(argument: str, value: object) -> Any:
    """One of ``EventBus``'s settings, checked (a timeout of ``math.inf`` becomes None)."""
    if argument == "capacity":
        return check_int(argument, value, 1)
    if argument in ("overflow", "children"):
        choices = _OVERFLOWS if argument == "overflow" else _CHILDREN
        if value not in choices:
            raise ValueError(f"{argument} must be one of {', '.join(choices)}; got {value!r}")
        return value
    if argument == "linger":
        linger = check_timeout(argument, value, allow_none=False)
        if linger is None or linger > 1.0:
            raise ValueError(f"linger must be at most 1 second; got {value!r}")
        return linger
    return check_timeout(argument, value, allow_none=argument == "block_timeout")
