"""The same scenarios against torch.monitor and monitor_bus.

Run when torch is installed (CI installs torch 2.13 CPU; with CI=true a missing torch fails).
Where the two differ on purpose (the defects monitor_bus fixes), the test says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import pytest

import monitor_bus

from .conftest import require

try:
    import torch.monitor as torch_monitor
except ImportError:  # checked in the fixture
    torch_monitor = None


@pytest.fixture(params=["torch", "monitor_bus"])
def api(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    if request.param == "torch":
        require(torch_monitor is not None, "torch is not installed")
        yield torch_monitor  # type: ignore[misc]
    else:
        yield monitor_bus


class Collect:
    def __init__(self, api: ModuleType) -> None:
        self.api = api
        self.events: list[Any] = []

    def __call__(self, event: Any) -> None:
        self.events.append(event)

    def settled(self) -> list[Any]:
        if self.api is monitor_bus:
            assert monitor_bus.flush(10)
        return self.events


def test_max_samples_window(api: ModuleType) -> None:
    """The add that reaches max_samples logs MEAN/COUNT/SUM/MAX/MIN of the window; later adds wait."""
    sink = Collect(api)
    handle = api.register_event_handler(sink)
    A = api.Aggregation
    stat = api.Stat("s", [A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN], timedelta(hours=1), 3)
    for v in (4.0, 1.0, 7.0, 100.0):
        stat.add(v)
    events = sink.settled()
    api.unregister_event_handler(handle)
    assert [e.name for e in events] == ["torch.monitor.Stat"]
    assert events[0].data == {
        "s.mean": 4.0,
        "s.count": 3,
        "s.sum": 12.0,
        "s.max": 7.0,
        "s.min": 1.0,
    }
    assert stat.count == 0
    assert {a.name: v for a, v in stat.get().items()} == {
        "MEAN": 4.0,
        "COUNT": 3,
        "SUM": 12.0,
        "MAX": 7.0,
        "MIN": 1.0,
    }
    # A difference on purpose: torch reports COUNT as a float, monitor_bus as an int.
    assert type(events[0].data["s.count"]) is (float if api is torch_monitor else int)


def test_handler_sees_only_its_registration_span(api: ModuleType) -> None:
    """Events before registration and after unregistration are not delivered; data round-trips."""
    sink = Collect(api)
    ts = datetime(2026, 5, 1, 12, 0, 0)
    api.log_event(api.Event("before", ts, {"x": 1}))
    handle = api.register_event_handler(sink)
    api.log_event(api.Event("during", ts, {"i": 2, "f": 0.5, "s": "text"}))
    events = sink.settled()
    api.unregister_event_handler(handle)
    api.log_event(api.Event("after", ts, {}))
    assert [e.name for e in sink.settled()] == ["during"]
    assert events[0].data == {"i": 2, "f": 0.5, "s": "text"}
    assert events[0].timestamp.replace(tzinfo=None) == ts


def test_bool_in_event_data(api: ModuleType) -> None:
    """A difference on purpose: torch turns a bool into 1.0, monitor_bus keeps the bool."""
    sink = Collect(api)
    handle = api.register_event_handler(sink)
    api.log_event(api.Event("b", datetime(2026, 1, 1), {"flag": True}))
    (event,) = sink.settled()
    api.unregister_event_handler(handle)
    assert type(event.data["flag"]) is (float if api is torch_monitor else bool)


def test_value_aggregation(api: ModuleType) -> None:
    """A difference on purpose: torch's Aggregation.VALUE is bound to NONE and never reported."""
    sink = Collect(api)
    handle = api.register_event_handler(sink)
    stat = api.Stat("v", [api.Aggregation.VALUE, api.Aggregation.COUNT], timedelta(hours=1), 2)
    stat.add(3.0)
    stat.add(5.0)
    (event,) = sink.settled()
    api.unregister_event_handler(handle)
    expected = {"v.count": 2} if api is torch_monitor else {"v.value": 5.0, "v.count": 2}
    assert event.data == expected


def test_numbers_at_the_edges(api: ModuleType) -> None:
    """A NaN not added first and a sum that overflows: SUM agrees; MAX/MIN and MEAN differ on
    purpose (monitor_bus: NaN wherever the NaN is, as torch.max; the mean despite the overflow)."""
    sink = Collect(api)
    handle = api.register_event_handler(sink)
    A = api.Aggregation
    nan_stat = api.Stat("n", [A.SUM, A.MAX, A.MIN], timedelta(hours=1), 3)
    for v in (1.0, math.nan, 3.0):
        nan_stat.add(v)
    big = api.Stat("b", [A.MEAN, A.SUM], timedelta(hours=1), 2)
    for v in (1e308, 1e308):
        big.add(v)
    events = sink.settled()
    api.unregister_event_handler(handle)
    nan_data, big_data = (e.data for e in events)
    assert math.isnan(nan_data["n.sum"])
    assert big_data["b.sum"] == math.inf
    if api is torch_monitor:
        assert (nan_data["n.max"], nan_data["n.min"], big_data["b.mean"]) == (3.0, 1.0, math.inf)
    else:
        assert math.isnan(nan_data["n.max"])
        assert math.isnan(nan_data["n.min"])
        assert big_data["b.mean"] == 1e308
