"""A slow handler's counters follow its calls, and a cut-off's warnings agree with them."""

from __future__ import annotations

import logging
import queue
import threading
from datetime import datetime, timezone

import pytest

from monitor_bus import Event, EventBus, _runner

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def ev(i: int) -> Event:
    return Event("e", T0, {"i": i})


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "monitor_bus" and r.levelno == logging.WARNING
    ]


class Turnstile:
    """A sink that lets one call through per ``release()``: ``entered`` gets what each call
    was given as it starts."""

    def __init__(self) -> None:
        self.entered: queue.Queue[object] = queue.Queue()
        self._gate = threading.Semaphore(0)

    def call(self, arg: object) -> None:
        self.entered.put(arg)
        assert self._gate.acquire(timeout=30)

    def release(self) -> None:
        self._gate.release()

    def next_call(self) -> object:
        return self.entered.get(timeout=10)


def handler_counts(bus: EventBus) -> tuple[int, int, int, int]:
    (h,) = bus.stats()["handlers"]
    return h["logged"], h["delivered"], h["dropped"], h["pending"]


class BundledTurnstile:
    """A bundled sink (marked as the bundled classes are), calling its turnstile per event:
    it runs on the bus's shared runner thread (``_runner``)."""

    _monitor_bus_bundled = True

    def __init__(self, sink: Turnstile) -> None:
        self.sink = sink

    def __call__(self, event: Event) -> None:
        self.sink.call(event.data["i"])


@pytest.mark.parametrize("bundled", [False, True], ids=["own thread", "shared thread"])
def test_a_slow_handler_is_counted_per_event_and_its_cut_off_adds_up(
    bundled: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that takes its time shows each event delivered as its call returns (not
    when its whole inbox is done), and close(timeout) names exactly what it then drops: on
    its own thread, or as a bundled sink on the shared one (the watchdog out of the way)."""
    monkeypatch.setattr(_runner, "SINK_BUDGET", 600.0)
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    sink = Turnstile()
    bus = EventBus(name="slow")
    callback = BundledTurnstile(sink) if bundled else (lambda e: sink.call(e.data["i"]))
    handle = bus.register_event_handler(callback, name="slow")
    assert handle._handler.bundled is bundled
    for i in range(1000):
        bus.log_event(ev(i))
    assert sink.next_call() == 0
    for k in range(1, 288):
        sink.release()
        assert sink.next_call() == k  # events 0..k-1 returned, event k in its call
        assert handler_counts(bus) == (1000, k, 0, 1000 - k)
    assert bus.close(0.2) is False  # event 287 is held in its call: a cut-off
    assert warnings_of(caplog) == [
        "EventBus 'slow': 1 handler(s) still busy after 0.2 s, cut off: 'slow' "
        "(712 undelivered, 1 in its current call)"
    ]
    sink.release()  # event 287 returns; no other call starts
    runner = handle._handler.thread
    assert runner is not None
    runner.join(10)
    assert not runner.is_alive()
    assert sink.entered.empty()
    handler = handle._handler
    assert (handler.delivered, handler.dropped, handler.offered) == (288, 712, 1000)
    assert warnings_of(caplog)[1:] == [
        "EventBus 'slow': handler 'slow' fell behind (backlog capacity 65536, policy "
        "drop_newest): 712 events dropped since the last report, 712 in all"
    ]


def test_a_slow_batch_handler_is_counted_per_list() -> None:
    """A batch handler's events are counted as each list of up to 128 returns."""

    class Batches:
        def __init__(self) -> None:
            self.sink = Turnstile()

        def handle_batch(self, events: list[Event]) -> None:
            self.sink.call([e.data["i"] for e in events])

    batches = Batches()
    bus = EventBus(name="lists")
    bus.register_event_handler(batches, name="lists")
    for i in range(300):
        bus.log_event(ev(i))
    got: list[int] = []
    while len(got) < 300:
        chunk = batches.sink.next_call()
        assert isinstance(chunk, list)
        assert 0 < len(chunk) <= 128
        # The lists before this one are delivered; this one is in its call.
        assert handler_counts(bus) == (300, len(got), 0, 300 - len(got))
        got += chunk
        batches.sink.release()
    assert bus.flush(10)
    assert got == list(range(300))
    assert handler_counts(bus) == (300, 300, 0, 0)
    assert bus.close(10)
