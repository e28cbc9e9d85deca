"""The adaptive linger: it grows while batches stay small, and a burst ends it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _dispatcher
from monitor_bus._queue import SLOTS

from .conftest import Recorder, StepClock


def test_the_linger_doubles_after_small_batches_up_to_its_cap_and_a_burst_resets_it() -> None:
    """After each batch under BURST events the linger doubles, up to LINGER_MAX, and while it
    is grown a producer hurries it at BURST queued events; a batch of BURST events brings back
    the bus's linger and the half-capacity threshold."""
    bus = EventBus(name="grow", linger=0.02)  # no handler: no loop runs these steps meanwhile
    dispatcher, queue = bus._dispatcher, bus._queue
    grown = [dispatcher._grow_linger(SLOTS * 10) for _ in range(5)]
    assert grown == [0.02, 0.04, 0.08, 0.1, 0.1]  # the first linger is the bus's
    assert queue.crowded == SLOTS * _dispatcher.BURST
    assert dispatcher._grow_linger(SLOTS * _dispatcher.BURST) == 0.02
    assert queue.crowded == queue.half == SLOTS * (65536 // 2)
    assert bus.close(10)


@pytest.mark.parametrize("linger", [0.0, 0.5])
def test_a_linger_of_zero_or_past_the_cap_never_grows(linger: float) -> None:
    """linger=0 hands every batch over at once, and a linger of LINGER_MAX or more is kept:
    small batches change neither, nor the hurry threshold."""
    bus = EventBus(name="fixed", linger=linger)
    dispatcher, queue = bus._dispatcher, bus._queue
    assert [dispatcher._grow_linger(SLOTS) for _ in range(3)] == [linger] * 3
    assert queue.crowded == queue.half
    assert bus.close(10)


def test_a_burst_ends_a_grown_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """A linger grown to a minute (the cap raised for the test) ends as soon as a producer
    has queued BURST events: the burst is delivered long before the minute is over."""
    monkeypatch.setattr(_dispatcher, "LINGER_MAX", 60.0)
    recorder = Recorder()
    bus = EventBus(name="burst")
    bus.register_event_handler(recorder, name="rec")
    bus._dispatcher._linger = 30.0  # as if small batches had grown it: the next is 60 s
    n = _dispatcher.BURST + 100
    for i in range(n):
        bus.log("step", i=i)
    assert recorder.wait_for(n, timeout=10)
    assert [e.data["i"] for e in recorder.events] == list(range(n))
    assert bus.close(10)


@pytest.mark.parametrize("idle", [True, False], ids=["idle", "lingering"])
def test_a_window_closed_by_stat_add_does_not_wait_for_a_grown_linger(
    monkeypatch: pytest.MonkeyPatch, clock: StepClock, idle: bool
) -> None:
    """A linger grown to a minute (the cap raised for the test): a Stat window that
    ``Stat.add`` closes is handed over at once, whether the dispatcher was idle or in the
    minute's linger that an event logged before woke it into (flush() delivers that event
    and leaves the linger running)."""
    monkeypatch.setattr(_dispatcher, "LINGER_MAX", 60.0)
    recorder = Recorder()
    bus = EventBus(name="window")
    bus.register_event_handler(recorder, name="rec")
    stat = Stat("s", [Aggregation.COUNT], timedelta(seconds=1), bus=bus)
    stat.add(1.0)
    bus._dispatcher._linger = 30.0  # as if small batches had grown it: the next is 60 s
    before = []
    if not idle:
        bus.log("step", i=0)
        assert bus.flush(10)
        before = [("step", {"i": 0})]
    clock.now += 1.0
    stat.add(2.0)  # closes the window of the first add
    assert recorder.wait_for(len(before) + 1, timeout=10)
    assert [(e.name, e.data) for e in recorder.events] == [*before, (STAT_EVENT, {"s.count": 1})]
    assert bus.close(10)


class Batches:
    """A batch handler that keeps the size of each batch."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def handle_batch(self, events: list[Event]) -> None:
        self.sizes.append(len(events))


@pytest.mark.stress
def test_a_steady_trickle_makes_few_batches_and_a_burst_waits_no_longer_than_the_linger() -> None:
    """One event every 2 ms for a second: with the linger grown to 100 ms that is about a
    dozen batches, not the fifty a fixed 20 ms linger makes. A burst after it is handed over
    within the bus's linger (plus a loaded machine's slack), not the grown one."""
    sink = Batches()
    burst = Recorder()
    bus = EventBus(name="trickle")
    bus.register_event_handler(sink, name="batches")
    for i in range(500):
        bus.log("step", i=i)
        time.sleep(0.002)  # the steady rate is the scenario
    assert bus.flush(10)
    assert sum(sink.sizes) == 500
    assert len(sink.sizes) <= 25, sink.sizes
    bus.register_event_handler(burst, name="burst")
    n = _dispatcher.BURST + 1  # the event past BURST hurries the linger
    start = time.perf_counter()
    for i in range(n):
        bus.log("burst", i=i)
    assert burst.wait_for(n, timeout=10)
    assert time.perf_counter() - start < 0.08
    assert bus.close(10)
