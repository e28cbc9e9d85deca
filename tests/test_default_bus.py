"""Configuring the default bus without code changes: environment variables and a function."""

from __future__ import annotations

import math
import threading
from datetime import datetime, timedelta, timezone

import pytest

import monitor_bus
from monitor_bus import Event

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)

VARIABLES = (
    "MONITOR_BUS_CAPACITY",
    "MONITOR_BUS_OVERFLOW",
    "MONITOR_BUS_BLOCK_TIMEOUT",
    "MONITOR_BUS_EXIT_TIMEOUT",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MONITOR_BUS_* variable from the caller's shell leaks into a test."""
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def settings(bus: monitor_bus.EventBus) -> tuple[object, ...]:
    return (bus._capacity, bus._overflow, bus._block_timeout, bus._exit_timeout)


def delivered_after_a_flood(n: int) -> tuple[list[int], int]:
    """Log ``n`` events on the default bus while its handler is stuck on the first one; return
    the indices delivered once it is released, and the bus's drop count."""
    entered, release = threading.Event(), threading.Event()
    got: list[int] = []

    def stuck(event: Event) -> None:
        if event.data["i"] == -1:
            entered.set()
            release.wait()
        else:
            got.append(event.data["i"])  # type: ignore[arg-type]

    monitor_bus.register_event_handler(stuck)
    monitor_bus.log_event(Event("e", TS, {"i": -1}))
    assert entered.wait(10)
    for i in range(n):
        monitor_bus.log_event(Event("e", TS, {"i": i}))
    release.set()
    assert monitor_bus.flush(10)
    bus = monitor_bus.get_default_bus()
    (handler,) = bus.stats()["handlers"]
    assert handler["delivered"] == 1 + len(got)
    assert len(got) + handler["dropped"] == n
    return got, handler["dropped"]


def test_environment_sets_the_default_bus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The four MONITOR_BUS_* variables set the default bus's capacity, overflow policy and
    timeouts when it is created, and only then."""
    monkeypatch.setenv("MONITOR_BUS_CAPACITY", "3")
    monkeypatch.setenv("MONITOR_BUS_OVERFLOW", "drop_oldest")
    monkeypatch.setenv("MONITOR_BUS_BLOCK_TIMEOUT", "0.25")
    monkeypatch.setenv("MONITOR_BUS_EXIT_TIMEOUT", " 7 ")
    bus = monitor_bus.get_default_bus()
    assert settings(bus) == (3, "drop_oldest", 0.25, 7.0)
    monkeypatch.setenv("MONITOR_BUS_CAPACITY", "4")  # read once, at creation
    assert monitor_bus.get_default_bus() is bus
    assert bus._capacity == 3


def test_environment_capacity_and_overflow_take_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """With MONITOR_BUS_CAPACITY=3 and MONITOR_BUS_OVERFLOW=drop_oldest, a stuck handler of the
    default bus ends up with the newest events and the rest counted as dropped."""
    monkeypatch.setenv("MONITOR_BUS_CAPACITY", "3")
    monkeypatch.setenv("MONITOR_BUS_OVERFLOW", "drop_oldest")
    got, dropped = delivered_after_a_flood(100)
    assert got[-3:] == [97, 98, 99]
    assert len(got) <= 6  # at most a full backlog plus a full queue
    assert dropped == 100 - len(got)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MONITOR_BUS_CAPACITY", "many"),
        ("MONITOR_BUS_CAPACITY", "0"),
        ("MONITOR_BUS_CAPACITY", "2.5"),
        ("MONITOR_BUS_OVERFLOW", "drop_all"),
        ("MONITOR_BUS_BLOCK_TIMEOUT", "-1"),
        ("MONITOR_BUS_BLOCK_TIMEOUT", "soon"),
        ("MONITOR_BUS_EXIT_TIMEOUT", "nan"),
        ("MONITOR_BUS_EXIT_TIMEOUT", "-0.5"),
    ],
)
def test_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """A bad value is one ValueError naming the variable and the value, at first use."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"^environment variable {variable}={value!r} is invalid"):
        monitor_bus.get_default_bus()
    with pytest.raises(ValueError, match=variable):
        monitor_bus.register_event_handler(lambda e: None)


@pytest.mark.parametrize("text", ["inf", "none", "INF", "None"])
def test_no_limit_in_the_environment(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """``inf`` or ``none`` as a timeout variable means no limit (None, as for EventBus)."""
    monkeypatch.setenv("MONITOR_BUS_BLOCK_TIMEOUT", text)
    monkeypatch.setenv("MONITOR_BUS_EXIT_TIMEOUT", text)
    bus = monitor_bus.get_default_bus()
    assert (bus._block_timeout, bus._exit_timeout) == (None, None)


def test_configure_default_bus_sets_the_default_bus() -> None:
    """configure_default_bus() before first use sets every setting of the default bus."""
    monitor_bus.configure_default_bus(
        capacity=12, overflow="block", block_timeout=0.5, exit_timeout=math.inf
    )
    assert settings(monitor_bus.get_default_bus()) == (12, "block", 0.5, None)


def test_configure_default_bus_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A configured setting wins over its variable; one left out keeps the variable's value."""
    monkeypatch.setenv("MONITOR_BUS_CAPACITY", "3")
    monkeypatch.setenv("MONITOR_BUS_OVERFLOW", "drop_oldest")
    monitor_bus.configure_default_bus(capacity=50)
    got, dropped = delivered_after_a_flood(100)
    assert settings(monitor_bus.get_default_bus())[:2] == (50, "drop_oldest")
    assert got[-1] == 99
    assert dropped > 0


def test_configure_default_bus_with_a_bad_argument_names_it() -> None:
    """A bad argument is refused at once, named, and leaves the default bus unconfigured."""
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        monitor_bus.configure_default_bus(capacity=0)
    with pytest.raises(ValueError, match="overflow must be one of"):
        monitor_bus.configure_default_bus(overflow="sometimes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exit_timeout must be a number of seconds"):
        monitor_bus.configure_default_bus(exit_timeout="5")  # type: ignore[arg-type]
    assert settings(monitor_bus.get_default_bus()) == (65536, "drop_newest", None, 5.0)


@pytest.mark.parametrize(
    "first_use",
    [
        monitor_bus.get_default_bus,
        lambda: monitor_bus.register_event_handler(lambda e: None),
        lambda: monitor_bus.Stat("x", [monitor_bus.Aggregation.COUNT], timedelta(seconds=1)),
    ],
    ids=["get_default_bus", "register_event_handler", "Stat"],
)
def test_configure_default_bus_after_first_use_raises(first_use: object) -> None:
    """Once the default bus exists, configure_default_bus() raises instead of being ignored."""
    first_use()  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="the default bus already exists"):
        monitor_bus.configure_default_bus(capacity=10)
    assert monitor_bus.get_default_bus()._capacity == 65536


def test_configuration_is_reset_with_the_default_bus() -> None:
    """The test fixture's reset forgets the configuration too, so no test leaks it."""
    from monitor_bus import _default

    monitor_bus.configure_default_bus(capacity=9)
    _default._reset_default_bus()
    assert monitor_bus.get_default_bus()._capacity == 65536
