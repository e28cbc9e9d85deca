from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

import monitor_bus
from monitor_bus import _default

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, reason: str) -> None:
    """Skip when a real dependency is missing, except in CI, where that is a failure."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def fresh_default_bus() -> Iterator[None]:
    """Every test starts with no default bus and leaves no bus thread behind."""
    _default._reset_default_bus()
    yield
    _default._reset_default_bus()


@pytest.fixture
def bus() -> Iterator[monitor_bus.EventBus]:
    b = monitor_bus.EventBus(name="test")
    yield b
    assert b.close(timeout=10), "the test left a handler that does not finish"


class Recorder:
    """A sync handler that records events and lets a test wait for a count."""

    def __init__(self) -> None:
        self.events: list[monitor_bus.Event] = []
        self._cv = threading.Condition()

    def __call__(self, event: monitor_bus.Event) -> None:
        with self._cv:
            self.events.append(event)
            self._cv.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: len(self.events) >= n, timeout)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
