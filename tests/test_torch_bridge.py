"""forward_torch_monitor: torch.monitor events re-logged into a monitor_bus bus (real torch)."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest

import monitor_bus
from monitor_bus import STAT_EVENT, Event, EventBus

from .conftest import IN_CI, Recorder, require

if not IN_CI:  # in CI the import below fails instead
    pytest.importorskip("torch.monitor", reason="torch is not installed")

import torch.monitor  # noqa: E402

from monitor_bus.integrations import torch as bridge  # noqa: E402
from monitor_bus.integrations.torch import (  # noqa: E402
    TorchMonitorForwarding,
    forward_torch_monitor,
    stop_forwarding_torch_monitor,
)

TS = datetime(2026, 3, 4, 5, 6, 7, 891011)


@pytest.fixture(autouse=True)
def no_forwarding_left() -> Iterator[None]:
    """Each test starts and ends with no torch.monitor handler of ours registered."""
    yield
    for forwarding in list(bridge._active.values()):
        forwarding.close()
    assert bridge._active == {}


def test_torch_events_are_relogged_into_the_bus(bus: EventBus, recorder: Recorder) -> None:
    """A torch.monitor event arrives in the bus with its name, timestamp and data (bool as float)."""
    bus.register_event_handler(recorder)
    forwarding = forward_torch_monitor(bus)
    torch.monitor.log_event(
        torch.monitor.Event("train.step", TS, {"i": 3, "f": 0.5, "s": "x", "b": True})
    )
    torch.monitor.log_event(torch.monitor.Event("train.end", TS, {}))
    assert bus.flush(10)
    assert recorder.events == [
        Event("train.step", TS, {"i": 3, "f": 0.5, "s": "x", "b": 1.0}),
        Event("train.end", TS, {}),
    ]
    assert type(recorder.events[0].data["b"]) is float
    assert (forwarding.forwarded, forwarding.errors) == (2, 0)


def test_torch_stat_windows_arrive_as_stat_events(bus: EventBus, recorder: Recorder) -> None:
    """A torch.monitor.Stat window reaches the bus as a STAT_EVENT whose values are floats."""
    bus.register_event_handler(recorder)
    forward_torch_monitor(bus)
    stat = torch.monitor.Stat(
        "loss",
        [torch.monitor.Aggregation.MEAN, torch.monitor.Aggregation.COUNT],
        timedelta(milliseconds=1),
    )
    # torch closes a window on the first add after its end; add until one has closed.
    deadline = time.monotonic() + 10
    while bus.stats()["logged"] == 0 and time.monotonic() < deadline:
        stat.add(2.0)
    assert bus.flush(10)
    event = recorder.events[0]
    assert event.name == STAT_EVENT
    assert set(event.data) == {"loss.mean", "loss.count"}
    assert event.data["loss.mean"] == 2.0
    assert type(event.data["loss.count"]) is float
    assert event.data["loss.count"] >= 1


def test_torch_stat_reaches_an_exporter(bus: EventBus) -> None:
    """Forwarded torch Stat windows feed the exporters like monitor_bus's own Stat windows."""
    require(
        importlib.util.find_spec("prometheus_client") is not None,
        "prometheus_client is not installed",
    )
    from monitor_bus.exporters.prometheus import PrometheusEventHandler

    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    forward_torch_monitor(bus)
    torch.monitor.log_event(torch.monitor.Event(STAT_EVENT, TS, {"step_time.mean": 0.25}))
    assert bus.flush(10)
    assert prom.registry.get_sample_value("monitor_bus_step_time_mean") == 0.25


def test_stop_forwarding_is_final_and_idempotent(bus: EventBus, recorder: Recorder) -> None:
    """After the undo, torch events no longer reach the bus; undoing twice is harmless."""
    bus.register_event_handler(recorder)
    forwarding = forward_torch_monitor(bus)
    torch.monitor.log_event(torch.monitor.Event("before", TS, {}))
    stop_forwarding_torch_monitor(forwarding)
    assert not forwarding.active
    torch.monitor.log_event(torch.monitor.Event("after", TS, {}))
    stop_forwarding_torch_monitor(forwarding)  # torch would crash on a second unregister
    forwarding.close()
    assert bus.flush(10)
    assert [e.name for e in recorder.events] == ["before"]


def test_forwarding_twice_does_not_double_events(bus: EventBus, recorder: Recorder) -> None:
    """Forwarding to the same bus again returns the existing forwarding: each event once."""
    bus.register_event_handler(recorder)
    first = forward_torch_monitor(bus)
    assert forward_torch_monitor(bus) is first
    torch.monitor.log_event(torch.monitor.Event("once", TS, {}))
    assert bus.flush(10)
    assert [e.name for e in recorder.events] == ["once"]
    first.close()
    second = forward_torch_monitor(bus)
    assert second is not first
    assert second.active


def test_none_follows_the_default_bus(recorder: Recorder) -> None:
    """With no bus given, events go to whatever the default bus is when they arrive."""
    with forward_torch_monitor() as forwarding:
        monitor_bus.register_event_handler(recorder)
        torch.monitor.log_event(torch.monitor.Event("to.default", TS, {"x": 1}))
        assert monitor_bus.flush(10)
    assert not forwarding.active
    assert recorder.events == [Event("to.default", TS, {"x": 1})]


def test_slow_sink_does_not_block_the_torch_caller(bus: EventBus) -> None:
    """torch.monitor.log_event returns while the bus's handler is stuck on an earlier event."""
    entered, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def stuck(event: Event) -> None:
        entered.set()
        release.wait(30)
        seen.append(event.name)

    bus.register_event_handler(stuck)
    forward_torch_monitor(bus)
    try:
        torch.monitor.log_event(torch.monitor.Event("first", TS, {}))
        assert entered.wait(10)
        torch.monitor.log_event(torch.monitor.Event("second", TS, {}))  # returns: nothing waits
        assert seen == []
        assert not release.is_set()
    finally:
        release.set()
    assert bus.flush(10)
    assert seen == ["first", "second"]


def test_unconvertible_event_is_counted_not_raised(
    bus: EventBus, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """An event the bus cannot take is counted and logged, never raised into torch's caller."""
    bus.register_event_handler(recorder)
    forwarding = forward_torch_monitor(bus)
    forwarding(SimpleNamespace(name="odd", timestamp=TS, data={"x": [1, 2]}))
    forwarding(SimpleNamespace(name="fine", timestamp=TS, data={"x": 1}))
    assert bus.flush(10)
    assert (forwarding.forwarded, forwarding.errors) == (1, 1)
    assert [e.name for e in recorder.events] == ["fine"]
    assert any("forwarding a torch.monitor event failed" in r.getMessage() for r in caplog.records)


def test_bad_arguments_raise_naming_them() -> None:
    """A bus that is not an EventBus, or an undo of something else, raises a TypeError naming it."""
    with pytest.raises(TypeError, match="bus"):
        forward_torch_monitor("default")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="forwarding"):
        stop_forwarding_torch_monitor(object())  # type: ignore[arg-type]
    assert bridge._active == {}
    assert isinstance(forward_torch_monitor(), TorchMonitorForwarding)
