"""The default bus behind the module-level functions, and how to configure it."""

from __future__ import annotations

import math
import os
import sys
from datetime import datetime
from typing import Any

from ._bus import Children, EventBus, Overflow, check_setting
from ._check import wrong_type
from ._event import Event, data_value_t
from ._handler import EventHandler, EventHandlerHandle
from ._lifecycle import process
from ._subscription import EventFilter, Subscription

# Environment variables read when the default bus is made, and the EventBus argument each sets.
_ENVIRONMENT = {
    "MONITOR_BUS_CAPACITY": "capacity",
    "MONITOR_BUS_OVERFLOW": "overflow",
    "MONITOR_BUS_BLOCK_TIMEOUT": "block_timeout",
    "MONITOR_BUS_EXIT_TIMEOUT": "exit_timeout",
    "MONITOR_BUS_CHILDREN": "children",
    "MONITOR_BUS_LINGER": "linger",
    # Not an EventBus setting: starts a monitor_bus.system.SystemMetrics on the default bus.
    "MONITOR_BUS_SYSTEM_INTERVAL": "system_interval",
}


def configure_default_bus(
    *,
    capacity: int | None = None,
    overflow: Overflow | None = None,
    block_timeout: float | None = None,
    exit_timeout: float | None = None,
    children: Children | None = None,
    linger: float | None = None,
    system_interval: float | None = None,
) -> None:
    """Set the default bus's settings before its first use; see ``EventBus`` for each.

    ``system_interval`` (seconds; 0: off) starts a ``monitor_bus.system.SystemMetrics``
    sampling every that many seconds on the default bus when it is made, except in a child
    process that reports to a monitor_bus parent (whose process tree already counts it).

    An argument left as None keeps its environment variable's value, if set
    (``MONITOR_BUS_CAPACITY``, ``MONITOR_BUS_OVERFLOW``, ``MONITOR_BUS_BLOCK_TIMEOUT``,
    ``MONITOR_BUS_EXIT_TIMEOUT``, ``MONITOR_BUS_CHILDREN``, ``MONITOR_BUS_LINGER``,
    ``MONITOR_BUS_SYSTEM_INTERVAL``; a timeout of ``inf`` or ``none``
    means no limit), or else the ``EventBus`` default. Arguments are checked now. A spawned
    child process makes its default bus afresh: where it must differ from the default, set the
    environment variable (children inherit it), not only this call.

    Raises:
        RuntimeError: the default bus already exists (it was used: a handler was registered,
            a Stat made, ``get_default_bus()`` called).
        TypeError, ValueError: an argument is invalid (the message names it).

    Examples:
        ```python
        import monitor_bus
        monitor_bus.configure_default_bus(capacity=1_000_000, overflow="block")
        ```
    """
    settings: dict[str, Any] = {
        "capacity": capacity,
        "overflow": overflow,
        "block_timeout": block_timeout,
        "exit_timeout": exit_timeout,
        "children": children,
        "linger": linger,
        "system_interval": system_interval,
    }
    settings = {key: value for key, value in settings.items() if value is not None}
    for key, value in settings.items():
        _check(key, value)  # now, not at the default bus's first use
    with process.default_lock:
        if process.default_bus is not None:
            raise RuntimeError(
                "the default bus already exists: call configure_default_bus() before the first"
                " register_event_handler(), Stat() or get_default_bus()"
            )
        process.default_settings = settings


def _check(argument: str, value: object) -> Any:
    """A default bus setting, checked: an ``EventBus`` one, or ``system_interval``."""
    if argument != "system_interval":
        return check_setting(argument, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(argument, "a number of seconds", value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"{argument} must be a finite number of seconds >= 0 (0: off), got {value}"
        )
    return float(value)


def _start_system_metrics(bus: EventBus, interval: float) -> None:
    """The default bus's ``SystemMetrics``, if asked for; not in a child that reports to a
    monitor_bus parent: the parent's process tree holds it."""
    if interval and process.uplink is None:
        from .system import SystemMetrics

        SystemMetrics(interval, bus=bus)


def _from_environment() -> dict[str, Any]:
    """The default bus's settings from the environment; a bad value names its variable."""
    settings: dict[str, Any] = {}
    for variable, argument in _ENVIRONMENT.items():
        text = os.environ.get(variable, "").strip()
        if not text:
            continue
        try:
            if argument == "capacity":
                value: object = int(text)
            elif argument in ("overflow", "children"):
                value = text
            elif argument == "system_interval":
                value = 0.0 if text.lower() == "off" else float(text)
            elif text.lower() in ("none", "inf", "infinity"):
                value = math.inf  # no limit
            else:
                value = float(text)
            _check(argument, value)  # now, to name the variable; EventBus keeps it
            settings[argument] = value
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"environment variable {variable}={text!r} is invalid: {exc}"
            ) from None
    return settings


def get_default_bus() -> EventBus:
    """The bus the module-level functions use, made on first use (its thread starts later,
    with its first handler).

    Its settings come from ``configure_default_bus()``, else from the environment variables
    ``MONITOR_BUS_CAPACITY``, ``MONITOR_BUS_OVERFLOW``, ``MONITOR_BUS_BLOCK_TIMEOUT``,
    ``MONITOR_BUS_EXIT_TIMEOUT``, ``MONITOR_BUS_CHILDREN`` and ``MONITOR_BUS_LINGER``, else the
    ``EventBus`` defaults. With ``MONITOR_BUS_SYSTEM_INTERVAL`` (or ``system_interval``) set,
    a ``monitor_bus.system.SystemMetrics`` starts sampling on it.

    Raises:
        ValueError: an environment variable holds an invalid value (the message names it).
    """
    bus = process.default_bus
    if bus is None:
        with process.default_lock:
            if process.default_bus is None:
                settings = {**_from_environment(), **process.default_settings}
                interval = settings.pop("system_interval", 0.0)
                made = EventBus(**settings, name="default")
                try:
                    _start_system_metrics(made, interval)
                except BaseException:
                    made.close(timeout=5.0)
                    raise
                process.default_bus = made
            bus = process.default_bus
    return bus


process.get_default_bus = get_default_bus  # for the modules below this one (a Stat)


def log_event(event: Event) -> None:
    """Queue ``event`` for every handler of the default bus; see ``EventBus.log_event``."""
    bus = process.default_bus
    if bus is None:
        if process.uplink is None:
            if not isinstance(event, Event):
                raise wrong_type("event", "a monitor_bus.Event", event)
            return  # no bus yet, so no handler
        bus = get_default_bus()  # a spawned child: its events go to the parent
    bus.log_event(event)


def log(name: str, /, **data: data_value_t) -> None:
    """Queue an event on the default bus, cheaper than ``log_event(Event(...))``; see
    ``EventBus.log``.

    Examples:
        >>> monitor_bus.log("train.step", loss=0.25, lr=1e-3)  # doctest: +SKIP
    """
    bus = process.default_bus
    if bus is None:
        if process.uplink is None:  # no bus yet, so no handler: the arguments are checked
            Event(name, datetime.now(), data)
            if not name:  # as ``EventBus.log`` checks it
                raise ValueError("name must not be empty")
            return
        bus = get_default_bus()  # a spawned child: its events go to the parent
    bus.log(name, **data)


def register_event_handler(
    callback: EventHandler, *, name: str | None = None, timeout: float | None = None
) -> EventHandlerHandle:
    """Register ``callback`` on the default bus; see ``EventBus.register_event_handler``."""
    return get_default_bus().register_event_handler(callback, name=name, timeout=timeout)


def unregister_event_handler(handle: EventHandlerHandle, timeout: float | None = None) -> bool:
    """Unregister from the bus that returned ``handle``; see ``EventBus.unregister_event_handler``."""
    if not isinstance(handle, EventHandlerHandle):
        raise wrong_type("handle", "a monitor_bus.EventHandlerHandle", handle)
    return handle._handler.bus.unregister_event_handler(handle, timeout)


def flush(timeout: float | None = None) -> bool:
    """Wait for the default bus to deliver everything logged so far; see ``EventBus.flush``."""
    return get_default_bus().flush(timeout)


async def aflush(timeout: float | None = None) -> bool:
    """``flush`` for async callers; see ``EventBus.aflush``."""
    return await get_default_bus().aflush(timeout)


def subscribe(name: EventFilter = None, *, buffer: int = 1024) -> Subscription:
    """Subscribe to the default bus from async code; see ``EventBus.subscribe``.

    Examples:
        >>> async def watch_loss():  # doctest: +SKIP
        ...     async with monitor_bus.subscribe("train.step") as events:
        ...         async for event in events:
        ...             print(event.data["loss"])
    """
    return get_default_bus().subscribe(name, buffer=buffer)


def _reset_default_bus() -> None:
    """Close the default bus and forget it and its configuration (tests: a fresh start)."""
    with process.default_lock:
        bus, process.default_bus = process.default_bus, None
        process.default_settings = {}
    if bus is not None:
        system = sys.modules.get("monitor_bus.system")
        if system is not None:
            system._close_for(bus)
        bus.close(timeout=5.0)
