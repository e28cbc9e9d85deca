"""stdlib logging both ways: records into events, events into records, and no loop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime

import pytest

import monitor_bus
from monitor_bus.integrations.logging import LOG_EVENT, LoggingEventHandler, MonitorBusHandler

from .conftest import Recorder


class _Unloggable:
    def __repr__(self) -> str:
        return "<unloggable>"


@pytest.fixture
def train_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("test_integration_logging.train")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)


def test_record_becomes_an_event(
    bus: monitor_bus.EventBus, recorder: Recorder, train_logger: logging.Logger
) -> None:
    """Level, logger, formatted message and plain extra fields reach the bus."""
    bus.register_event_handler(recorder)
    handler = MonitorBusHandler(bus)
    train_logger.addHandler(handler)
    train_logger.warning("loss %s", "spiked", extra={"step": 120, "loss": 9.5, "ok": False})
    assert bus.flush(10)
    (event,) = recorder.events
    assert event.name == LOG_EVENT
    assert event.data == {
        "level": "WARNING",
        "levelno": 30,
        "logger": "test_integration_logging.train",
        "message": "loss spiked",
        "step": 120,
        "loss": 9.5,
        "ok": False,
    }
    assert (handler.emitted, handler.sanitized_values, handler.errors) == (1, 0, 0)


def test_unloggable_extra_is_sanitized_not_raised(
    bus: monitor_bus.EventBus, recorder: Recorder, train_logger: logging.Logger
) -> None:
    """An extra value no event can hold is stored as its repr and counted; the call returns."""
    bus.register_event_handler(recorder)
    handler = MonitorBusHandler(bus)
    train_logger.addHandler(handler)
    train_logger.info("batch", extra={"shape": [1, 2], "obj": _Unloggable(), "n": 3})
    assert bus.flush(10)
    (event,) = recorder.events
    assert event.data["shape"] == "[1, 2]"
    assert event.data["obj"] == "<unloggable>"
    assert event.data["n"] == 3
    assert handler.sanitized_values == 2


def test_exception_and_reserved_extra(
    bus: monitor_bus.EventBus, recorder: Recorder, train_logger: logging.Logger
) -> None:
    """exc_info gives the exception's type; an extra named like a reserved key is prefixed."""
    bus.register_event_handler(recorder)
    train_logger.addHandler(MonitorBusHandler(bus))
    try:
        raise ValueError("x")
    except ValueError:
        train_logger.exception("failed", extra={"level": "custom"})
    assert bus.flush(10)
    (event,) = recorder.events
    assert event.data["exception"] == "builtins.ValueError"
    assert event.data["level"] == "ERROR"
    assert event.data["extra.level"] == "custom"


class _BrokenBus:
    def log_event(self, event: monitor_bus.Event) -> None:
        raise RuntimeError("bus is gone")


def test_a_failing_bus_never_raises_into_the_caller(train_logger: logging.Logger) -> None:
    """A log_event that raises is counted in errors; the logging call returns normally."""
    handler = MonitorBusHandler(_BrokenBus())  # type: ignore[arg-type]
    train_logger.addHandler(handler)
    train_logger.error("still fine")
    assert (handler.emitted, handler.errors) == (0, 1)


def test_both_ways_on_make_no_loop(bus: monitor_bus.EventBus, recorder: Recorder) -> None:
    """A sink writing to a logger that a MonitorBusHandler watches does not feed the bus again."""
    root = logging.getLogger("test_integration_logging")
    root.setLevel(logging.DEBUG)
    root.propagate = False
    handler = MonitorBusHandler(bus)
    root.addHandler(handler)
    seen: list[logging.LogRecord] = []
    collect = logging.Handler()
    collect.emit = seen.append  # type: ignore[method-assign]
    root.addHandler(collect)
    try:
        bus.register_event_handler(recorder)
        bus.register_event_handler(LoggingEventHandler("test_integration_logging.events"))
        logging.getLogger("test_integration_logging.app").info("hello")
        assert bus.flush(10)
        assert bus.flush(10)
    finally:
        root.removeHandler(handler)
        root.removeHandler(collect)
    assert [e.name for e in recorder.events] == [LOG_EVENT]
    assert [r.name for r in seen] == [
        "test_integration_logging.app",
        "test_integration_logging.events",
    ]
    assert seen[1].monitor_bus_event == LOG_EVENT  # type: ignore[attr-defined]
    assert seen[1].monitor_bus_data["message"] == "hello"  # type: ignore[attr-defined]
    assert handler.skipped_records == 1


def test_sink_filters_by_name(bus: monitor_bus.EventBus) -> None:
    """LoggingEventHandler with names writes only those events, as one readable line each."""
    seen: list[logging.LogRecord] = []
    logger = logging.getLogger("test_integration_logging.only")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    collect = logging.Handler()
    collect.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(collect)
    try:
        bus.register_event_handler(LoggingEventHandler(logger, names=("keep",)))
        bus.log_event(monitor_bus.Event("keep", datetime.now(), {"a": 1}))
        bus.log_event(monitor_bus.Event("skip", datetime.now(), {"a": 2}))
        assert bus.flush(10)
    finally:
        logger.removeHandler(collect)
    assert [r.getMessage() for r in seen] == ["keep a=1"]


def test_bad_arguments_name_themselves() -> None:
    """Wrong types are TypeErrors naming the argument."""
    with pytest.raises(TypeError, match="bus must be an EventBus"):
        MonitorBusHandler(bus=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="logger must be a logging.Logger or a name"):
        LoggingEventHandler(logger=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="level must be an int"):
        LoggingEventHandler(level="INFO")  # type: ignore[arg-type]
