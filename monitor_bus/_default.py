"""The default bus behind the module-level functions, and the process-wide hooks."""

from __future__ import annotations

import atexit
import logging
import os
import threading

from . import _bus, _handler, _stat
from ._bus import EventBus
from ._event import Event
from ._handler import EventHandler, EventHandlerHandle
from ._subscription import EventFilter, Subscription

logger = logging.getLogger("monitor_bus")

_default_bus: EventBus | None = None
_default_lock = threading.Lock()


def get_default_bus() -> EventBus:
    """The bus the module-level functions use, made on first use (its thread starts later,
    with its first handler)."""
    global _default_bus
    bus = _default_bus
    if bus is None:
        with _default_lock:
            if _default_bus is None:
                _default_bus = EventBus(name="default")
            bus = _default_bus
    return bus


def log_event(event: Event) -> None:
    """Queue ``event`` for every handler of the default bus; see ``EventBus.log_event``."""
    bus = _default_bus
    if bus is None:
        if not isinstance(event, Event):
            raise TypeError(f"event must be an Event, not {type(event).__name__}")
        return  # no bus yet, so no handler
    bus.log_event(event)


def register_event_handler(
    callback: EventHandler, *, name: str | None = None
) -> EventHandlerHandle:
    """Register ``callback`` on the default bus; see ``EventBus.register_event_handler``."""
    return get_default_bus().register_event_handler(callback, name=name)


def unregister_event_handler(handle: EventHandlerHandle, timeout: float | None = None) -> bool:
    """Unregister from the bus that returned ``handle``; see ``EventBus.unregister_event_handler``."""
    if not isinstance(handle, EventHandlerHandle):
        raise TypeError(f"handle must be an EventHandlerHandle, not {type(handle).__name__}")
    return handle._handler.bus.unregister_event_handler(handle, timeout)


def flush(timeout: float | None = None) -> bool:
    """Wait for the default bus to deliver everything logged so far; see ``EventBus.flush``."""
    return get_default_bus().flush(timeout)


async def aflush(timeout: float | None = None) -> bool:
    """``flush`` for async callers; see ``EventBus.aflush``."""
    return await get_default_bus().aflush(timeout)


def subscribe(name: EventFilter = None, *, buffer: int = 1024) -> Subscription:
    """Subscribe to the default bus from async code; see ``EventBus.subscribe``.

    Example:
        >>> async def watch_loss():  # doctest: +SKIP
        ...     async with monitor_bus.subscribe("train.step") as events:
        ...         async for event in events:
        ...             print(event.data["loss"])
    """
    return get_default_bus().subscribe(name, buffer=buffer)


def _reset_default_bus() -> None:
    """Close the default bus and forget it (tests use this for a fresh start)."""
    global _default_bus
    with _default_lock:
        bus, _default_bus = _default_bus, None
    if bus is not None:
        bus.close(timeout=5.0)


def _at_exit() -> None:
    _stat._close_all_windows()
    for bus in list(_bus._all_buses):
        try:
            bus._close_at_exit()
        except Exception:
            logger.exception("%r: error while closing at exit", bus)


_mp_finalizer_pid: int | None = None


def _finalize_with_multiprocessing() -> None:
    """A multiprocessing child ends in ``os._exit``, past atexit; its finalizers still run."""
    global _mp_finalizer_pid
    if _mp_finalizer_pid != os.getpid():
        from multiprocessing import util

        util.Finalize(None, _at_exit, exitpriority=100)
        _mp_finalizer_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    _handler._bus_threads.clear()
    for bus in list(_bus._all_buses):
        bus._after_fork_in_child()
    _stat._after_fork_in_child()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
