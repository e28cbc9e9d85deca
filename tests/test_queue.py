"""The queue's protocol: one event's slots stay together, and Stat windows are never dropped."""

from __future__ import annotations

import threading
from collections import deque
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import monitor_bus
from monitor_bus import (
    STAT_EVENT,
    Aggregation,
    Event,
    EventBus,
    JsonlEventHandler,
    Stat,
    read_jsonl,
)

from .conftest import LoopGate as Gate
from .conftest import Recorder

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)
OVERFLOWS = ["drop_newest", "drop_oldest", "block"]


def slots_of(bus: EventBus) -> deque[Any]:
    """The deque of the bus's queued slots (the queue itself in versions before EventQueue,
    so this test can be run against them)."""
    queue = bus._queue
    return queue if isinstance(queue, deque) else queue.slots


# -- item 4: a finalizer that logs while the dispatcher removes from the queue --


class LogsWhenCollected:
    """An object whose finalizer logs events, as a sink's or a Stat's ``__del__`` may."""

    def __init__(self, bus: EventBus, names: list[str]) -> None:
        self.bus = bus
        self.names = names

    def __del__(self) -> None:
        for name in self.names:
            self.bus.log_event(Event(name, TS, {"name": name}))


def test_a_finalizer_logging_mid_removal_cannot_split_an_event(recorder: Recorder) -> None:
    """A finalizer that logs into a full drop_oldest queue while the dispatcher is between two
    removals from its head leaves every event with its own name and data."""
    gate = Gate()
    bus = EventBus(capacity=4, overflow="drop_oldest", name="reentry")
    # Only the queue is small: the handlers' backlogs hold everything, so what each handler
    # gets is exactly what the queue handed over.
    bus._capacity = 100
    slots = slots_of(bus)
    doomed: list[LogsWhenCollected] = []  # armed once the queue is full
    fired = threading.Event()

    def between_removals(frame: FrameType, what: str, arg: object) -> None:
        # Runs on the dispatcher thread after each C call returns: right after the first
        # popleft of the queue's head, collect the object, so its finalizer runs just there.
        if (
            what == "c_return"
            and doomed
            and getattr(arg, "__self__", None) is slots
            and getattr(arg, "__name__", None) == "popleft"
        ):
            doomed.clear()
            fired.set()

    threading.setprofile(between_removals)  # for the bus threads started below
    try:
        bus.register_event_handler(gate, name="gate")
        bus.register_event_handler(recorder)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    try:
        gate.hold(bus)
        names = [f"e{i}" for i in range(4)]
        for name in names:  # fill the queue to its capacity while the loop is blocked
            bus.log_event(Event(name, TS, {"name": name}))
        assert len(slots) == 3 * 4
        # Its first event takes the room the first removal made; the second finds it full.
        doomed.append(LogsWhenCollected(bus, ["fin-a", "fin-b"]))
        gate.release.set()
        assert fired.wait(10)
        assert bus.flush(10)

        stats = bus.stats()
        assert stats["dropped"] == 1  # "fin-b", turned away by the full queue
        for events in (gate.events, recorder.events):
            assert [e.name for e in events if e.data["name"] != e.name] == []
            assert [e.name for e in events] == ["gate", *names, "fin-a"]
    finally:
        assert bus.close(timeout=10)


# -- item 5: Stat windows are never dropped --


def window_stats(bus: EventBus, n: int) -> list[Stat]:
    """``n`` Stats whose single add logs a window at once (max_samples=1)."""
    return [
        Stat(f"w{k}", [Aggregation.COUNT], timedelta(hours=1), max_samples=1, bus=bus)
        for k in range(n)
    ]


def split(events: list[Event]) -> tuple[list[int], list[str]]:
    """The plain events' indices and the windows' keys, in arrival order."""
    plain = [e.data["i"] for e in events if e.name == "e"]
    windows = [key for e in events if e.name == STAT_EVENT for key in e.data]
    return plain, windows  # type: ignore[return-value]


@pytest.mark.parametrize("overflow", OVERFLOWS)
def test_windows_survive_a_full_queue(overflow: str) -> None:
    """With the dispatcher stalled and the queue full, every Stat window logged meanwhile is
    delivered, and every plain event is either delivered or counted as dropped."""
    gate = Gate()
    bus = EventBus(capacity=5, overflow=overflow, block_timeout=0, name="full")  # type: ignore[arg-type]
    try:
        bus.register_event_handler(gate, name="gate")
        stats = window_stats(bus, 20)
        gate.hold(bus)
        for i in range(200):
            bus.log_event(Event("e", TS, {"i": i}))
            if i % 10 == 9:
                stats[i // 10].add(1.0)  # a window closes, with the queue full
        assert bus.stats()["dropped"] > 0
        gate.release.set()
        assert bus.flush(10)

        plain, windows = split(gate.events)
        assert windows == [f"w{k}.count" for k in range(20)]
        (handler,) = bus.stats()["handlers"]
        assert handler["logged"] == 1 + 200 + 20
        assert handler["dropped"] > 0
        assert len(plain) + handler["dropped"] == 200
        assert plain == sorted(plain)
    finally:
        assert bus.close(timeout=10)


@pytest.mark.parametrize("overflow", ["drop_newest", "drop_oldest"])
def test_windows_survive_a_full_handler_backlog(overflow: str, recorder: Recorder) -> None:
    """A handler that falls behind loses plain events (counted) but gets every Stat window,
    in order; the queue itself drops nothing."""
    entered, release = threading.Event(), threading.Event()
    got: list[Event] = []

    def slow(event: Event) -> None:
        entered.set()
        release.wait()
        got.append(event)

    # No linger: the producer waits for each event's delivery, 220 times.
    bus = EventBus(capacity=5, overflow=overflow, name="behind", linger=0)  # type: ignore[arg-type]
    try:
        bus.register_event_handler(slow, name="slow")
        bus.register_event_handler(recorder)  # paces the producer: the queue never overflows
        stats = window_stats(bus, 20)
        bus.log_event(Event("e", TS, {"i": -1}))
        assert entered.wait(10)  # in flight; from now on the backlog fills, then drops
        logged = 1
        for i in range(200):
            bus.log_event(Event("e", TS, {"i": i}))
            logged += 1
            if i % 10 == 9:
                stats[i // 10].add(1.0)
                logged += 1
            assert recorder.wait_for(logged)
        release.set()
        assert bus.flush(10)

        plain, windows = split(got)
        assert windows == [f"w{k}.count" for k in range(20)]
        slow_stats, _ = bus.stats()["handlers"]
        assert bus.stats()["dropped"] == 0
        assert slow_stats["dropped"] > 0
        assert len(plain) + slow_stats["dropped"] == 201
        assert plain == sorted(plain)
    finally:
        assert bus.close(timeout=10)


@pytest.mark.stress
def test_no_window_lost_by_the_default_bus_under_a_flood(tmp_path: Path) -> None:
    """On the default bus, a tight loop of a million events and Stat samples into a
    JsonlEventHandler keeps every window: their counts sum to the samples added."""
    handler = JsonlEventHandler(tmp_path / "run.jsonl")
    monitor_bus.register_event_handler(handler, name="jsonl")
    stat = Stat("step", [Aggregation.COUNT], timedelta(milliseconds=10))
    n = 1_000_000
    for i in range(n):
        monitor_bus.log_event(Event("e", TS, {"i": i}))
        stat.add(1.0)
    bus = monitor_bus.get_default_bus()
    assert bus.flush(120)
    (counts,) = bus.stats()["handlers"]
    assert bus.close(timeout=120)  # logs the last, open window
    handler.close()

    events = read_jsonl(tmp_path / "run.jsonl")
    windows = [e.data["step.count"] for e in events if e.name == STAT_EVENT]
    plain = sum(1 for e in events if e.name == "e")
    assert sum(windows) == n  # type: ignore[arg-type]
    assert plain + counts["dropped"] == n


def test_windows_past_the_allowance_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory stays bounded: behind a handler that takes nothing, windows are kept up to
    WINDOW_ALLOWANCE past the capacity, and the rest are dropped and counted."""
    monkeypatch.setattr(monitor_bus._queue, "WINDOW_ALLOWANCE", 3)
    entered, release = threading.Event(), threading.Event()
    got: list[Event] = []

    def stuck(event: Event) -> None:
        entered.set()
        release.wait()
        got.append(event)

    gate = Gate()  # holds the loop: a window ends the linger, and nothing is drained
    bus = EventBus(capacity=2, name="allowance")
    try:
        bus.register_event_handler(stuck, name="stuck")
        bus.register_event_handler(gate, name="gate")
        stats = window_stats(bus, 10)
        gate.hold(bus)
        assert entered.wait(10)  # in flight: the backlog is empty
        for stat in stats:
            stat.add(1.0)  # one window each
        gate.release.set()
        release.set()
        assert bus.flush(10)
        h, _ = bus.stats()["handlers"]
        assert (h["delivered"], h["dropped"]) == (1 + 2 + 3, 10 - 5)
        assert split(got)[1] == [f"w{k}.count" for k in range(5)]
    finally:
        assert bus.close(timeout=10)
