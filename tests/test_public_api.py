"""The export surface: torch.monitor's names, reported from the public module."""

from __future__ import annotations

import subprocess
import sys

import pytest

import monitor_bus

TORCH_MONITOR_NAMES = {
    "Aggregation",
    "Event",
    "EventHandlerHandle",
    "Stat",
    "TensorboardEventHandler",
    "data_value_t",
    "log_event",
    "register_event_handler",
    "unregister_event_handler",
}


def test_torch_monitor_names_are_exported() -> None:
    """Every public name of torch.monitor is in monitor_bus.__all__."""
    assert set(monitor_bus.__all__) >= TORCH_MONITOR_NAMES


def test_all_is_sorted_and_resolves() -> None:
    """__all__ is sorted and every name in it exists."""
    assert monitor_bus.__all__ == sorted(monitor_bus.__all__)
    for name in monitor_bus.__all__:
        assert hasattr(monitor_bus, name), name


@pytest.mark.parametrize(
    "obj",
    [
        monitor_bus.Event,
        monitor_bus.Stat,
        monitor_bus.EventBus,
        monitor_bus.Aggregation,
        monitor_bus.log_event,
    ],
)
def test_public_objects_report_the_public_module(obj: object) -> None:
    """Reprs and tracebacks show monitor_bus.X, not a private module."""
    assert obj.__module__ == "monitor_bus"  # type: ignore[attr-defined]


def test_aggregation_members_match_torch() -> None:
    """Aggregation has torch.monitor's members first, with their names and values, then
    the distributions (issue 22)."""
    assert [(a.name, a.value) for a in monitor_bus.Aggregation] == [
        ("VALUE", 1),
        ("MEAN", 2),
        ("COUNT", 3),
        ("SUM", 4),
        ("MAX", 5),
        ("MIN", 6),
        ("P50", 7),
        ("P90", 8),
        ("P95", 9),
        ("P99", 10),
        ("STDDEV", 11),
        ("HISTOGRAM", 12),
    ]


def test_handle_cannot_be_constructed() -> None:
    """EventHandlerHandle only comes from register_event_handler."""
    with pytest.raises(TypeError, match="cannot be constructed"):
        monitor_bus.EventHandlerHandle()


def test_import_starts_no_thread_and_loads_no_optional_dependency() -> None:
    """import monitor_bus starts no thread and imports only anyio among third-party packages."""
    code = (
        "import sys, threading, monitor_bus\n"
        "print(threading.active_count())\n"
        "print(sorted(m for m in ('tensorboard', 'torch', 'numpy', 'prometheus_client', 'opentelemetry') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split("\n")[:2] == ["1", "[]"]


@pytest.mark.asyncio
async def test_what_public_functions_return_is_public() -> None:
    """subscribe() returns a monitor_bus.Subscription and takes an EventFilter, both exported."""
    with monitor_bus.EventBus() as bus:
        subscription = bus.subscribe("train.step")
        assert type(subscription) is monitor_bus.Subscription
        assert monitor_bus.Subscription.__module__ == "monitor_bus"
        assert "EventFilter" in monitor_bus.__all__
        assert "configure_default_bus" in monitor_bus.__all__
