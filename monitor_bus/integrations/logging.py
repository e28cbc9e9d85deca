"""Standard library ``logging`` and the bus, both ways.

- ``MonitorBusHandler``: a ``logging.Handler`` that turns each record into an event on a bus,
  for code that reports through ``logging``.
- ``LoggingEventHandler``: a bus sink that writes each event to a logger, for pipelines built on
  structured logs.

No loop when both are on: ``MonitorBusHandler`` does not turn into events the records made on
a thread of a bus (a sink's thread, where ``LoggingEventHandler`` writes, or a dispatcher's,
where the bus reports its own drops and errors), nor records that carry the
``monitor_bus_event`` attribute that ``LoggingEventHandler`` sets; it counts them in
``skipped_records``. A record logged while the handler is already emitting on the same thread
is skipped and counted the same way.

Only the standard library is needed; ``import monitor_bus`` does not import this module.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .._check import wrong_type
from .._default import log_event
from .._event import Event, _plain_value, data_value_t
from .._handler import call_each
from .._lifecycle import in_bus_thread

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["LOG_EVENT", "LoggingEventHandler", "MonitorBusHandler"]

LOG_EVENT = "monitor_bus.log"
"""The name of the events ``MonitorBusHandler`` logs."""

# The attribute LoggingEventHandler puts on its records (the event's name).
MARK = "monitor_bus_event"

# What every LogRecord has: anything else on a record came in through ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}
_RESERVED = ("level", "levelno", "logger", "message", "exception")
_MAX_TEXT = 1000  # a sanitized value's repr is cut to this many characters


class MonitorBusHandler(logging.Handler):
    """Turn log records into events on a bus, never blocking or raising into the caller.

    Each record becomes ``Event(LOG_EVENT, record time, data)`` with:

    - ``level`` (``"WARNING"``), ``levelno`` (30), ``logger`` (the logger's name),
      ``message`` (the formatted message, ``record.getMessage()``);
    - ``exception``: the exception's qualified type name, when the record has ``exc_info``;
    - each ``extra=`` field. A value an event can hold (``str``, ``int``, ``float``, ``bool``,
      numpy and torch scalars) is kept; any other is kept as its ``repr()`` (cut to 1000
      characters) and counted in ``sanitized_values``. An extra named like one of the keys
      above is stored as ``extra.<name>``.

    ``emit`` only builds the event and calls ``log_event``, which appends to the bus's queue
    and returns (a bus created with ``overflow="block"`` waits up to its ``block_timeout``, as
    ``log_event`` does). Any error is counted in ``errors`` and the record dropped: nothing
    is raised into the code that logged. No loop with ``LoggingEventHandler``: see
    [Standard library logging](integrations.md#standard-library-logging).

    Args:
        bus: the bus to log to; the default bus if omitted.
        level: the least severe level handled, as for any ``logging.Handler``.

    Examples:
        >>> import logging
        >>> from monitor_bus.integrations.logging import MonitorBusHandler
        >>> logging.getLogger("train").addHandler(MonitorBusHandler())  # doctest: +SKIP
        >>> logging.getLogger("train").warning("loss spiked", extra={"step": 120, "loss": 9.5})  # doctest: +SKIP
    """

    def __init__(self, bus: EventBus | None = None, level: int | str = logging.NOTSET) -> None:
        super().__init__(level)
        if bus is not None and not callable(getattr(bus, "log_event", None)):
            raise wrong_type("bus", "an EventBus", bus)
        self._log_event: Callable[[Event], None] | None = None if bus is None else bus.log_event
        self._local = threading.local()
        #: Records turned into events.
        self.emitted = 0
        #: ``extra`` values stored as their ``repr()`` because an event cannot hold them.
        self.sanitized_values = 0
        #: Records not turned into events to avoid a loop (made on a bus's own threads).
        self.skipped_records = 0
        #: Records dropped because building or logging their event failed.
        self.errors = 0

    def emit(self, record: logging.LogRecord) -> None:
        """Log ``record`` as an event (see the class docs); never raises."""
        local = self._local
        if getattr(local, "emitting", False) or hasattr(record, MARK) or in_bus_thread():
            self.skipped_records += 1
            return
        local.emitting = True
        try:
            event = Event(
                LOG_EVENT,
                datetime.fromtimestamp(record.created, timezone.utc),
                self._data(record),
            )
            if self._log_event is not None:
                self._log_event(event)
            else:
                log_event(event)
            self.emitted += 1
        except Exception:  # noqa: BLE001 - never into the caller; counted
            self.errors += 1
        finally:
            local.emitting = False

    def _data(self, record: logging.LogRecord) -> dict[str, data_value_t]:
        data: dict[str, data_value_t] = {
            "level": record.levelname,
            "levelno": record.levelno,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and record.exc_info[0] is not None:
            cls = record.exc_info[0]
            data["exception"] = f"{cls.__module__}.{cls.__qualname__}"
        for key, value in vars(record).items():
            if key in _RECORD_ATTRS:
                continue
            name = f"extra.{key}" if key in _RESERVED else str(key)
            data[name] = self._value(key, value)
        return data

    def _value(self, key: str, value: object) -> data_value_t:
        try:
            return _plain_value(key, value)
        except Exception:  # noqa: BLE001 - any object may be passed in extra=
            self.sanitized_values += 1
            try:
                text = repr(value)
            except Exception:  # noqa: BLE001 - a broken __repr__
                text = f"<unrepresentable {type(value).__qualname__}>"
            return text[:_MAX_TEXT]


class LoggingEventHandler:
    """A bus sink that writes every event to a logger, the way back from the bus to logs.

    Each event becomes one record, ``logger.log(level, "<name> key=value ...")``, with the
    event under the record attributes ``monitor_bus_event`` (its name),
    ``monitor_bus_data`` (its data, a dict) and ``monitor_bus_timestamp`` (its timestamp),
    for structured formatters. The record is made on the sink's own thread, so a
    ``MonitorBusHandler`` on the same logger tree does not send it back (see
    [Standard library logging](integrations.md#standard-library-logging)).

    Args:
        logger: the logger to write to, or its name; ``"monitor_bus.events"`` by default.
        level: the level of the records.
        names: only events with these names, when given; all events otherwise.

    Raises:
        TypeError: an argument has the wrong type.
    """

    def __init__(
        self,
        logger: logging.Logger | str = "monitor_bus.events",
        level: int = logging.INFO,
        names: tuple[str, ...] | None = None,
    ) -> None:
        if isinstance(logger, str):
            logger = logging.getLogger(logger)
        elif not isinstance(logger, logging.Logger):
            raise wrong_type("logger", "a logging.Logger or a name", logger)
        if isinstance(level, bool) or not isinstance(level, int):
            raise wrong_type("level", "an int", level)
        self._logger = logger
        self._level = level
        self._names = frozenset(names) if names is not None else None

    def handle_batch(self, events: list[Event]) -> None:
        """Log each event of a batch (the bus's batch call)."""
        call_each(events, self)

    def __call__(self, event: Event) -> None:
        if self._names is not None and event.name not in self._names:
            return
        if not self._logger.isEnabledFor(self._level):
            return
        pairs = " ".join(f"{key}={value!r}" for key, value in event.data.items())
        extra: dict[str, Any] = {
            MARK: event.name,
            "monitor_bus_data": event.data,
            "monitor_bus_timestamp": event.timestamp,
        }
        self._logger.log(self._level, "%s %s", event.name, pairs, extra=extra)
