"""Subscriptions: a bus's events as an async iterator in the caller's own event loop.

Guarantees
----------
- A subscription is an ordinary sync handler of the bus (``register_event_handler``), so it
  runs on a thread of its own and sees the events logged after ``__aenter__`` returns, in order.
- The handler never waits on the subscriber: it filters on its thread, collects a batch and, at
  the end of the batch (the handler ``flush()`` hook), schedules one non-blocking call on the
  subscriber's loop (asyncio's ``call_soon_threadsafe`` or trio's ``TrioToken.run_sync_soon``,
  found through anyio's loop token). A stalled subscriber loop, or one that calls the blocking
  ``bus.flush()``, cannot deadlock the bus.
- Only a finished subscriber loop detaches the subscription (its later events are counted as
  dropped). Any other failure to hand a batch over counts that batch as dropped and is raised
  to the bus, which logs it and counts it in ``handler_errors``; the subscription stays.
- Overflow: the buffer is an anyio memory object stream of ``buffer`` events. When it is full
  the newest events are dropped, as under the bus's default policy. Drops are counted at
  once in ``Subscription.dropped``, and in the handler's ``dropped`` in ``bus.stats()`` by the
  time the subscriber asks for its next event (the bus counts a batch as delivered only after
  the handler's ``flush()`` returned, which can be after the drop).
- Timing: the loop runs the scheduled calls in order, so once ``await bus.aflush()`` returns
  in the subscriber's loop, every matching event logged before it is in the buffer or counted
  as dropped.
- Leaving the ``async with`` block unregisters the handler (shielded from cancellation) and
  closes the stream; events still on their way are counted as dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import anyio
from anyio.lowlevel import EventLoopToken, current_token

from ._check import check_int
from ._event import Event

if TYPE_CHECKING:
    from types import TracebackType

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from ._bus import EventBus
    from ._handler import EventHandlerHandle

EventFilter = Union[None, str, Callable[[Event], bool]]  # noqa: UP007 - a runtime alias
"""Which events a subscription gets: None (all), an event name, or a predicate on the ``Event``."""

DEFAULT_BUFFER = 1024
"""Events a subscription holds unread by default; past that the newest are dropped, counted."""


def _check_filter(name: object) -> Callable[[Event], bool] | None:
    if name is None:
        return None
    if isinstance(name, str):
        wanted = name
        return lambda event: event.name == wanted
    if callable(name):
        return name
    raise TypeError(
        f"name must be None, an event name (str) or a callable filter, not {type(name).__name__}"
    )


_Put = Callable[[list[Event]], None]


class _LoopFinished(Exception):
    """The subscriber's event loop has finished: nobody will read what is scheduled on it."""


def _scheduler(token: EventLoopToken) -> Callable[[_Put, list[Event]], None]:
    """A thread-safe, non-blocking "call soon" into the loop behind ``token``.

    Written against the native loops rather than ``AsyncBackend.run_sync_soon`` (new in anyio
    4.16), so anyio 4.11, the first with loop tokens, is enough. The returned callable raises
    ``_LoopFinished`` when the loop has finished and lets any other error through.
    """
    native = token.native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        loop = native

        def call_soon_asyncio(put: _Put, batch: list[Event]) -> None:
            try:
                loop.call_soon_threadsafe(put, batch)
            except RuntimeError:
                if loop.is_closed():
                    raise _LoopFinished from None
                raise

        return call_soon_asyncio
    import trio  # anyio's only other backend; already imported when it runs

    if not isinstance(native, trio.lowlevel.TrioToken):
        raise RuntimeError(f"subscribe() supports asyncio and trio loops, not {native!r}")
    trio_token = native

    def call_soon_trio(put: _Put, batch: list[Event]) -> None:
        try:
            trio_token.run_sync_soon(put, batch)
        except trio.RunFinishedError:
            raise _LoopFinished from None

    return call_soon_trio


def _label(name: object) -> str:
    if name is None:
        return "subscription"
    if isinstance(name, str):
        return f"subscription({name!r})"
    return f"subscription({getattr(name, '__qualname__', type(name).__qualname__)})"


class Subscription:
    """The events of a bus as an async iterator; made by ``EventBus.subscribe``.

    Use it as ``async with bus.subscribe(...) as events: async for event in events: ...`` in
    a task of the caller's event loop (asyncio or trio). The handler is registered when the
    block is entered and unregistered when it is left, so the iterator yields the matching
    events logged in between, in the order they were logged. Iteration ends when the block
    is left; to stop waiting, leave the loop (``break``) or cancel the task.

    A subscription is used by one task at a time and cannot be entered twice.

    Attributes:
        received: events put into the buffer so far.
        dropped: matching events turned away because the buffer was full (or the
            subscription was already closed when they arrived).
    """

    def __init__(
        self, bus: EventBus, name: EventFilter = None, buffer: int = DEFAULT_BUFFER
    ) -> None:
        self._accept = _check_filter(name)
        self._buffer = check_int("buffer", buffer, 1)
        self._label = _label(name)
        try:
            self._token: EventLoopToken = current_token()
        except RuntimeError:
            raise RuntimeError(
                "subscribe() needs a running event loop (asyncio or trio) in the calling thread, "
                "and is used as `async with bus.subscribe(...) as events:`; this thread has none"
            ) from None
        self._bus = bus
        self._handle: EventHandlerHandle | None = None
        self._send: MemoryObjectSendStream[Event] | None = None
        self._receive: MemoryObjectReceiveStream[Event] | None = None
        self._state = "new"  # new -> open -> closed
        self.received = 0
        self.dropped = 0
        self._owed = 0  # drops not yet moved into the handler's counters
        self._owed_lock = threading.Lock()

    # -- the subscriber's side --

    async def __aenter__(self) -> Subscription:
        if self._state != "new":
            raise RuntimeError(f"{self!r} was already entered; call subscribe() again")
        if current_token() != self._token:
            raise RuntimeError("a subscription must be entered in the event loop that made it")
        self._send, self._receive = anyio.create_memory_object_stream[Event](self._buffer)
        self._state = "open"
        try:
            handler = _Deliver(self)
            # The name stats() shows; passing name= instead would key it and replace another.
            handler.__qualname__ = self._label  # type: ignore[attr-defined]
            self._handle = self._bus.register_event_handler(handler)
        except BaseException:
            self._state = "closed"
            self._close_streams()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "closed"
        if self._owed:
            self._settle_owed()
        handle, self._handle = self._handle, None
        if handle is not None:
            # The handler never waits on this loop, so this returns once its thread caught up.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._bus.unregister_event_handler, handle)
        self._close_streams()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        if self._receive is None:
            raise RuntimeError("iterate a subscription inside its `async with` block")
        if self._owed:
            self._settle_owed()
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    def __enter__(self) -> None:
        raise TypeError("subscribe() is asynchronous: use `async with bus.subscribe(...)`")

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover - __enter__ raises
        pass

    def __repr__(self) -> str:
        return f"<Subscription {self._label} {self._state}, buffer={self._buffer}>"

    def _close_streams(self) -> None:
        if self._send is not None:
            self._send.close()
        if self._receive is not None:
            self._receive.close()

    # -- runs on the subscriber's loop, scheduled by the handler thread --

    def _put(self, batch: list[Event]) -> None:
        send = self._send
        dropped = 0
        for event in batch:
            if self._state != "open" or send is None:
                dropped += 1
                continue
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                dropped += 1
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                dropped += 1
        self.received += len(batch) - dropped
        if dropped:
            self._owe(dropped)

    # -- drop accounting in the bus's handler counters --

    def _owe(self, n: int) -> None:
        with self._owed_lock:
            self.dropped += n
            self._owed += n
        self._settle_owed()

    def _settle_owed(self) -> None:
        """Move counted drops from the handler's ``delivered`` to its ``dropped``.

        The bus counts an event as delivered once the handler returns; a drop in the buffer
        happens later, on the subscriber's loop. Only what the bus already counted as
        delivered is moved, so the counters never go negative; the rest waits for the next call.
        """
        handle = self._handle
        if handle is None:
            return
        handler = handle._handler
        with self._owed_lock, handler.cv:
            n = min(self._owed, handler.delivered)
            if n:
                handler.delivered -= n
                handler.dropped += n
                self._owed -= n


class _Deliver:
    """The sync handler behind a subscription: filter on the bus's thread, hand batches over."""

    def __init__(self, subscription: Subscription) -> None:
        self._sub = subscription
        self._accept = subscription._accept
        self._call_soon = _scheduler(subscription._token)
        self._batch: list[Event] = []

    def __call__(self, event: Event) -> None:
        accept = self._accept
        if accept is None or accept(event):
            self._batch.append(event)

    def handle_batch(self, events: list[Event]) -> None:
        """The bus's batch call: keep the matching events for ``flush``."""
        accept = self._accept
        if accept is None:
            self._batch += events
            return
        for event in events:
            try:
                if accept(event):
                    self._batch.append(event)
            except Exception as exc:  # noqa: BLE001 - as a handler's: logged, counted, skipped
                handle = self._sub._handle
                if handle is not None:
                    handle._handler._failed(exc)

    def flush(self) -> None:
        """End of a bus batch: hand the matching events to the subscriber's loop at once."""
        sub = self._sub
        sub._settle_owed()
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._call_soon(sub._put, batch)
        except _LoopFinished:
            sub._owe(len(batch))
            handle, sub._handle = sub._handle, None
            if handle is not None:
                sub._state = "closed"
                sub._close_streams()  # no loop runs them any more: nothing else touches them
                sub._bus.unregister_event_handler(handle)  # from inside a handler: no wait
        except BaseException:
            sub._owe(len(batch))  # lost with the error, which the bus logs and counts
            raise


def subscribe(
    bus: EventBus, name: EventFilter = None, buffer: int = DEFAULT_BUFFER
) -> Subscription:
    """Make a subscription to ``bus``; see ``EventBus.subscribe``."""
    return Subscription(bus, name, buffer)
