"""Registered handlers: each with its own inbox, counters and runner.

A sync handler runs on a runner's daemon thread (``_runner``: its own, or the one the bundled
sinks of its bus share); an async handler runs as a task on the dispatcher's event loop. The
dispatcher appends batches to a handler's inbox; the runner takes the whole inbox at once,
calls the handler for each event (or, for a batch handler, once per list of up to
``BATCH_CALL`` events; for a bundled sink, once per queued batch), then records the batch as
settled.

Guarantees:

- Counters follow the calls: ``delivered`` grows as each call returns (each event, each list),
  not when the whole inbox is done, so ``stats()`` of a slow handler shows its progress.
  ``settled`` (what ``flush`` waits for) grows only after the sink's ``flush()``: once
  ``bus.flush()`` returns, what was delivered is written, unless that flush failed (a full
  disk, logged as the handler's error): what a bundled sink keeps to write again counts as
  delivered until it is written, or given up and moved to ``dropped``.
- A cut-off (a timeout of ``close`` or ``unregister_event_handler``) lets the call in progress
  finish and starts no other: the cut-off's warning names both numbers, and what it calls
  undelivered is exactly what is then counted as dropped.
- A bundled sink that loses events it took (a failed write it can no longer retry) says so
  through ``_monitor_bus_lost``: they move from ``delivered`` to ``dropped`` and are reported
  as such, so ``logged == delivered + dropped + pending`` stays true of what reached the sink.
  One whose failures raise nowhere here (a sink in a child process) counts them through
  ``_monitor_bus_errors``, as the handler's errors.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

import anyio

from . import _queue, _runner
from ._event import Event
from ._queue import count_events, drop_events, events_after, first_events
from ._ratelimit import LOG_INTERVAL, Throttle

if sys.version_info < (3, 11):  # anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._runner import Runner

logger = logging.getLogger("monitor_bus")

EventHandler = Callable[[Event], None] | Callable[[Event], Awaitable[None]]
"""A handler: a plain or async callable taking one ``Event``, or a batch handler.

The bus calls it from a thread or task of its own, never the caller's. A handler object may
also have a ``flush()`` method (plain or async), which the bus calls after each delivered batch.

A **batch handler** is an object with a ``handle_batch(events)`` method (plain or async): the
bus calls it with a ``list`` of events, in order, instead of calling the object once per event,
so a sink pays its per-call cost once per list. A list holds up to 128 of the events the
dispatcher collected since the last batch. The events, and the list, are the handler's own, as
a plain handler's are. An exception from
``handle_batch`` counts as one error, an ``ExceptionGroup`` as one per exception it holds;
the batch's events count as delivered. A sink that fails on some events goes on with the
others and raises their failures together at the end, as an ``ExceptionGroup``.
"""


# Events per handle_batch call. Each lives until its call returns: a bound keeps few of them
# alive, so they die young (with torch imported, a drain of 100,000 Events built at once
# brought full collections: 1 no-op batch handler took 257,000 events/s against 450,000 for a
# plain one; in lists of 128 it takes 330,000-370,000).
BATCH_CALL = 128


def call_each(events: Sequence[Event], call: Callable[[Event], object]) -> None:
    """Call ``call`` on every event, then raise the failures together (an ``ExceptionGroup``),
    so one bad event costs a batch handler no other event and the bus counts each failure."""
    errors = []
    for event in events:
        try:
            call(event)
        except Exception as exc:  # noqa: BLE001 - raised together below
            errors.append(exc)
    if errors:
        raise ExceptionGroup(f"{len(errors)} of {len(events)} events failed", errors)


def handler_calls(
    callback: object,
) -> tuple[Callable[[list[Any]], Any] | None, Callable[[list[Event]], Any] | None]:
    """How the bus calls ``callback``: its slots call and its batch call, None for each it
    does not take (then it calls ``callback`` once per event).

    The batch call is ``handle_batch``, unless a ``__call__`` comes before it in the class's
    MRO (a subclass redefined ``__call__``): that ``handle_batch`` would not know of it. The
    slots call (``_monitor_bus_take_slots``, a bundled sink's, not public) takes a batch as it
    was queued (see ``_queue``), building no ``Event`` and copying no ``data`` for the events
    the sink only reads; likewise taken only where no ``__call__`` or ``handle_batch`` comes
    before it, nor a ``handle_batch`` set on the instance.
    """
    mro = type(callback).__mro__
    call = _position(mro, "__call__")
    batch = getattr(callback, "handle_batch", None)
    own_batch = "handle_batch" in getattr(callback, "__dict__", ())
    batch_at = -1 if own_batch else _position(mro, "handle_batch")
    if not callable(batch) or call < batch_at:
        batch = None
    slots_at = _position(mro, "_monitor_bus_take_slots")
    if slots_at == len(mro) or slots_at > min(call, batch_at):
        return None, batch
    return callback._monitor_bus_take_slots, batch  # type: ignore[attr-defined]


def _position(mro: tuple[type, ...], name: str) -> int:
    """Where in ``mro`` the class defining ``name`` is (``len(mro)``: none does)."""
    return next((i for i, c in enumerate(mro) if name in c.__dict__), len(mro))


def _count(batches: list[list[Any]]) -> int:
    """Events in a list of batches."""
    return count_events(sum(map(len, batches)))


def is_async_callable(callback: object) -> bool:
    if inspect.iscoroutinefunction(callback):
        return True
    call = getattr(type(callback), "__call__", None)  # noqa: B004 - the method, not callability
    return call is not None and inspect.iscoroutinefunction(call)


class EventHandlerHandle:
    """What ``register_event_handler`` returns; pass it to ``unregister_event_handler``.

    Handles cannot be constructed directly.
    """

    __slots__ = ("_handler",)

    _handler: _Handler

    def __init__(self) -> None:
        raise TypeError(
            "EventHandlerHandle cannot be constructed; register_event_handler returns one"
        )

    @classmethod
    def _new(cls, handler: _Handler) -> EventHandlerHandle:
        handle = object.__new__(cls)
        handle._handler = handler
        return handle

    def __repr__(self) -> str:
        state = "registered" if self._handler.registered else "unregistered"
        return f"<EventHandlerHandle {self._handler.name!r} ({state})>"


class _Handler:
    """Bookkeeping and runner of one registered handler.

    Counters: ``offered`` events were handed to it by the dispatcher; ``settled`` of them are
    done with (``delivered`` to the callback, or ``dropped`` by the overflow policy).
    ``offered - settled`` is its backlog plus the batch in flight.
    """

    def __init__(self, bus: EventBus, callback: EventHandler, name: str, *, keyed: bool) -> None:
        self.bus = bus
        self.callback = callback
        self.name = name
        self.keyed = keyed
        self.slots_call, self.batch_call = handler_calls(callback)
        lost = getattr(callback, "_monitor_bus_lost", None)
        self.sink_lost: Callable[[bool], int] | None = lost if callable(lost) else None
        errors = getattr(callback, "_monitor_bus_errors", None)
        self.sink_errors: Callable[[], int] | None = errors if callable(errors) else None
        self.is_async = is_async_callable(self.batch_call or callback)
        self.bundled = not self.is_async and _runner.is_bundled(callback)
        # A sink that buffers writes exposes flush(); it runs after each delivered batch.
        flush = getattr(callback, "flush", None)
        self.batch_end: Callable[[], Any] | None = flush if callable(flush) else None
        self.registered = True
        self._reset()

    def _reset(self) -> None:
        self.cv = threading.Condition(threading.Lock())
        self.inbox: list[list[Any]] = []
        self.backlog = 0
        self.offered = 0
        self.settled = 0
        self.delivered = 0
        self.dropped = 0
        self.errors = 0
        self.bus_dropped_base = 0
        self.bus_dropped_end: int | None = None
        self.stopping = False  # no more batches will come: exit once the inbox is empty
        self.cut = False  # stop calling the callback; what is left counts as dropped
        self.running = False
        self.runner: Runner | None = None  # a sync handler's (see ``_runner``)
        self.thread: threading.Thread | None = None  # its runner's
        self.wakeup: anyio.Event | None = None
        self.throttle = Throttle()  # its error and drop reports, keyed by exception type or "drops"
        self.dropped_reported = 0  # the part of ``dropped`` already in a warning
        # Progress of the take in hand, written by the runner alone (read under ``cv``):
        # ``progress`` events returned from their calls, not settled yet; ``handed`` counts
        # every event ever handed to a call, and ``cut_handed`` is its value when cut off.
        self.progress = 0
        self.handed = 0
        self.cut_handed = 0
        # Events the sink took and lost (``_monitor_bus_lost``), in ``dropped`` too.
        self.lost = 0
        self.lost_reported = 0

    def after_fork(self) -> None:
        self._reset()

    # -- called by the dispatcher, on its loop thread --

    def push(self, batch: list[Any], capacity: int, overflow: str) -> None:
        """Hand a batch over, applying the overflow policy to this handler's backlog.

        Stat windows are kept whatever the policy, up to ``WINDOW_ALLOWANCE`` past
        ``capacity`` (see ``_queue``): past that the handler has taken nothing for a long while.
        """
        n = count_events(len(batch))
        hard_limit = capacity + _queue.WINDOW_ALLOWANCE
        with self.cv:
            self.offered += n
            if overflow == "drop_oldest":
                self.inbox.append(batch)
                self.backlog += n
                self._trim(capacity, keep_windows=True)
                self._trim(hard_limit, keep_windows=False)
            else:
                if overflow != "force":
                    room = capacity - self.backlog
                    if n > room:
                        batch, lost = drop_events(batch, n - max(room, 0), newest=True)
                        self._lose(lost)
                        n -= lost
                    hard_room = max(hard_limit - self.backlog, 0)
                    if n > hard_room:
                        self._lose(n - hard_room)
                        batch, n = first_events(batch, hard_room), hard_room
                if n:
                    self.inbox.append(batch)
                    self.backlog += n
            self.cv.notify_all()
        if self.is_async and self.wakeup is not None:
            self.wakeup.set()

    def _trim(self, limit: int, *, keep_windows: bool) -> None:
        """Drop the oldest events past ``limit`` (sparing windows if ``keep_windows``)."""
        if self.backlog <= limit:
            return
        inbox = self.inbox
        for i, batch in enumerate(inbox):
            excess = self.backlog - limit
            if excess <= 0:
                break
            if keep_windows:
                inbox[i], lost = drop_events(batch, excess, newest=False)
            else:
                lost = min(excess, count_events(len(batch)))
                inbox[i] = events_after(batch, lost)
            self.backlog -= lost
            self._lose(lost)
        self.inbox = [batch for batch in inbox if batch]

    def miss(self, n: int) -> None:
        """Count ``n`` events it was owed and will never be handed (cut off) as dropped."""
        with self.cv:
            self.offered += n
            self._lose(n)
            self.cv.notify_all()

    def _lose(self, n: int) -> None:
        """Count ``n`` events dropped by the policy (under ``cv``)."""
        self.dropped += n
        self.settled += n

    def stop(self) -> None:
        """No more batches will come; the runner exits once it has settled its inbox."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        runner = self.runner
        if runner is not None:
            runner.kick()
        if self.is_async:
            self.bus._dispatcher.call_soon(self._wake_task)

    def _wake_task(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    def wait_stopped(self, timeout: float | None) -> bool:
        """Wait until the runner has exited (it holds the callback until then)."""
        with self.cv:
            return self.cv.wait_for(lambda: not self.running, timeout)

    # -- waiting, from any thread --

    def wait_settled(self, target: int, timeout: float | None) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.settled >= target or not self.running, timeout)

    def pending(self) -> int:
        return self.offered - self.settled

    # -- runners --

    def start_thread(self) -> None:
        """Have a runner call it (see ``_runner``); raises if no thread could start (the next
        start of the bus tries again)."""
        _runner.start(self)

    def _take(self) -> list[list[Any]] | None:
        """Under ``cv``: the whole inbox, or None when stopping with nothing left."""
        batches = self.inbox
        if batches:
            self.inbox = []
            self.backlog = 0
            return batches
        return None

    def _settle(self, delivered: int, skipped: int, *, final: bool = False) -> None:
        """Record a take as done: ``delivered`` events went through their calls, ``skipped``
        were cut off; and what the sink says it lost (``final``: the handler is leaving, the
        sink gives up on what it still holds)."""
        lost = self._sink_lost(final)
        self._count_sink_errors()
        with self.cv:
            self.progress = 0
            self.delivered += delivered - lost
            self.dropped += skipped + lost
            self.lost += lost
            self.settled += delivered + skipped
            self.cv.notify_all()
        self.bus._dispatcher.handler_progressed()

    def _sink_lost(self, final: bool) -> int:
        """Events the sink took and has lost since it was last asked (see the module doc)."""
        if self.sink_lost is None:
            return 0
        try:
            return self.sink_lost(final)
        except BaseException as exc:  # noqa: BLE001 - a handler never kills its runner
            self._failed(exc)
            return 0

    def _count_sink_errors(self) -> None:
        """Count the errors the sink reports of its own (``_monitor_bus_errors``: a sink in
        another process, whose calls there do not raise here); it logs them itself."""
        if self.sink_errors is None:
            return
        try:
            n = self.sink_errors()
        except BaseException as exc:  # noqa: BLE001 - a handler never kills its runner
            self._failed(exc)
            return
        self.errors += n
        for _ in range(n):
            self.bus._count_error()

    def cut_off(self, target: int) -> str:
        """Start no further call of the handler (the one in progress may finish): what it has
        not been handed of the first ``target`` events counts as dropped. Returns what a
        warning says of it: its name and those numbers."""
        with self.cv:
            self.cut = True
            self.cut_handed = handed = self.handed
            in_call = handed - self.returned()
            undelivered = max(target - self.settled - self.progress - in_call, 0)
        calls = f", {in_call} in its current call" if in_call else ""
        return f"{self.name!r} ({undelivered} undelivered{calls})"

    def returned(self) -> int:
        """Under ``cv``: events ever handed to a call that has returned."""
        return self.delivered + self.lost + self.progress

    def _refused(self, handed: int, n: int) -> bool:
        """Whether a call handing over ``n`` events, up to ``handed`` (already published in
        ``self.handed``), may not start: the handler was cut off, and not while this call was
        counted as in progress. The runner publishes ``handed`` before it reads ``cut``, and
        ``cut_off`` sets ``cut`` before it reads ``handed``: so a call it did not count never
        starts, and one it counted does."""
        with self.cv:  # cut_off has finished: cut_handed is what it counted
            if handed <= self.cut_handed:
                return False
            self.handed = handed - n
            return True

    def _events(self, batches: list[list[Any]]) -> Iterator[Event]:
        """The events of ``batches``, each with its own copy of ``data``.

        A copy per handler, as torch.monitor makes: what one handler does to ``data`` is
        seen by no other handler and not by the producer's ``Event``. (``dict.copy`` makes a
        plain ``dict`` of a window's ``WindowData`` too.)
        """
        new_event = Event.__new__
        for batch in batches:
            slots = iter(batch)
            for name, timestamp, data in zip(slots, slots, slots, strict=True):
                event = new_event(Event)
                event.name, event._timestamp, event.data = name, timestamp, data.copy()
                # A window's data, or an event's from a child process, carries its origin.
                event._origin = None if data.__class__ is dict else data.origin
                yield event

    def _calls(self, batches: list[list[Any]]) -> Iterator[tuple[Callable[[Any], Any], Any, int]]:
        """The calls that deliver ``batches``: (function, argument, events it carries)."""
        if self.slots_call is not None:
            for batch in batches:
                yield self.slots_call, batch, count_events(len(batch))
        elif self.batch_call is not None:
            events = self._events(batches)
            while chunk := list(islice(events, BATCH_CALL)):
                yield self.batch_call, chunk, len(chunk)
        else:
            for event in self._events(batches):
                yield self.callback, event, 1

    def _deliver_sync(self, batches: list[list[Any]]) -> int:
        """Call the handler with the events of ``batches``, publishing its progress after each
        call (see ``cut_off``); return how many it got."""
        done = 0
        base = self.handed
        if self.slots_call is None and self.batch_call is None:
            # One call per event: the same steps as below, inline (the hot path).
            callback = self.callback
            for event in self._events(batches):
                self.handed = handed = base + done + 1
                if self.cut and self._refused(handed, 1):
                    break
                try:
                    callback(event)
                except BaseException as exc:  # noqa: BLE001 - a handler never kills its runner
                    self._failed(exc)
                done += 1
                self.progress = done
            return done
        for call, arg, n in self._calls(batches):
            self.handed = handed = base + done + n
            if self.cut and self._refused(handed, n):
                break
            try:
                call(arg)
            except BaseException as exc:  # noqa: BLE001 - a handler never kills its runner
                self._batch_failed(exc)
            done += n
            self.progress = done
        return done

    async def _deliver_async(self, batches: list[list[Any]]) -> int:
        """``_deliver_sync`` for an async handler, on the loop."""
        cancelled = anyio.get_cancelled_exc_class()
        done = 0
        base = self.handed
        for call, arg, n in self._calls(batches):
            self.handed = handed = base + done + n
            if self.cut and self._refused(handed, n):
                break
            try:
                await call(arg)
            except cancelled as exc:
                if self.bus._dispatcher.loop_cancelled():
                    raise  # the bus stops or its loop failed: not the handler's doing
                self._failed(exc)
            except BaseException as exc:  # noqa: BLE001 - a handler never kills its runner
                self._batch_failed(exc)
            done += n
            self.progress = done
        return done

    def serve(self) -> bool:
        """One turn of a sync handler on its runner (``_runner``): deliver the whole inbox,
        flush the sink, settle. Returns True once it has stopped with nothing left (settled
        for good: the runner lets it go)."""
        while True:
            with self.cv:
                batches = self._take()
                stopping = self.stopping
            if batches is None:
                if stopping:
                    self._settle(0, 0, final=True)
                return stopping
            done = self._deliver_sync(batches)
            # Settled only after the sink's flush(): bus.flush() then means "written".
            if self.batch_end is not None:
                try:
                    self.batch_end()
                except BaseException as exc:  # noqa: BLE001 - a handler never kills its runner
                    self._failed(exc)
            self._settle(done, _count(batches) - done)
            # Stopping, no batch comes and no kick may follow: drain to the end in this turn.
            if not stopping:
                return False

    async def run_async(self) -> None:
        cancelled = anyio.get_cancelled_exc_class()
        try:
            while True:
                while not self.inbox and not self.stopping:
                    self.wakeup = anyio.Event()
                    await self.wakeup.wait()
                with self.cv:
                    batches = self._take()
                if batches is None:
                    self._settle(0, 0, final=True)
                    return
                done = await self._deliver_async(batches)
                if self.batch_end is not None:
                    try:
                        result = self.batch_end()
                        if inspect.isawaitable(result):
                            await result
                    except cancelled:
                        raise
                    except BaseException as exc:  # noqa: BLE001
                        self._failed(exc)
                self._settle(done, _count(batches) - done)
        finally:
            self._exit()

    def _exit(self) -> None:
        with self.cv:
            self.running = False
            # Whatever is still queued for it will never be delivered: count it.
            self._lose(self.offered - self.settled)
            self.inbox = []
            self.backlog = 0
            self.cv.notify_all()
        self.bus._leaving.discard(self)
        # Its last drops (cut off by a timeout, or its task ended with a failed loop): the
        # dispatcher no longer sees it, so it reports them itself.
        self.bus._dispatcher.drops.report([self], final=True)

    def _batch_failed(self, exc: BaseException) -> None:
        """A failure of a call: each exception of a group counts (see ``call_each``)."""
        if isinstance(exc, BaseExceptionGroup):
            for each in exc.exceptions:
                self._failed(each)
        else:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.bus._count_error()
        if self.throttle.ready(type(exc)):
            logger.error(
                "event handler %r raised %s (error %d of this handler; the same error is logged "
                "at most once per %g s)",
                self.name,
                type(exc).__name__,
                self.errors,
                LOG_INTERVAL,
                exc_info=exc,
            )

    def snapshot(self, queued: int, bus_dropped: int) -> dict[str, Any]:
        end = self.bus_dropped_end if self.bus_dropped_end is not None else bus_dropped
        upstream = end - self.bus_dropped_base
        with self.cv:  # one consistent reading: logged == delivered + dropped + pending
            progress = self.progress  # the take in hand: returned from their calls so far
            offered, delivered, dropped, pending = (
                self.offered,
                self.delivered + progress,
                self.dropped,
                self.pending() - progress,
            )
        return {
            "name": self.name,
            "async": self.is_async,
            "logged": offered + upstream + (queued if self.registered else 0),
            "delivered": delivered,
            "errors": self.errors,
            "dropped": dropped + upstream,
            "pending": pending + (queued if self.registered else 0),
        }
