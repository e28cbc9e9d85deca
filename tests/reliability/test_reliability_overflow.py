"""Overflow: two million events into a bus of capacity 10,000 whose only handler is stuck."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

from monitor_bus import Event, EventBus

from .conftest import Figures, rss_bytes

N = 2_000_000
CAPACITY = 10_000
BLOCK_TIMEOUT = 0.02
MB = 1024 * 1024


class Gate:
    """A sync handler that waits on a threading.Event before counting each event."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, event: Event) -> None:
        self.release.wait()
        self.calls += 1


def _log_timed(bus: EventBus, events: list[Event] | Event, n: int) -> float:
    """Log n events (one shared Event, or a list cycled through); return the longest call."""
    log = bus.log_event
    clock = time.perf_counter
    worst = 0.0
    if isinstance(events, Event):
        event = events
        for _ in range(n):
            t = clock()
            log(event)
            d = clock() - t
            if d > worst:
                worst = d
    else:
        for event in events[:n]:
            t = clock()
            log(event)
            d = clock() - t
            if d > worst:
                worst = d
    return worst


def _check_counts(bus: EventBus, gate: Gate, logged: int) -> dict[str, int]:
    stats = bus.stats()
    (h,) = stats["handlers"]
    assert stats["logged"] == logged
    assert h["logged"] == logged
    assert h["pending"] == 0
    assert h["delivered"] == gate.calls
    assert h["delivered"] + h["dropped"] == logged
    assert stats["handler_dropped"] == h["dropped"]
    assert stats["queued"] == 0
    return h


@pytest.mark.stress
@pytest.mark.parametrize(
    ("overflow", "fresh"),
    [("drop_newest", False), ("drop_oldest", False), ("drop_oldest", True)],
    ids=["drop_newest", "drop_oldest", "drop_oldest-fresh-events"],
)
def test_drop_policies_never_block_and_count_every_drop(
    overflow: str, fresh: bool, figures: Figures
) -> None:
    """Under a drop policy, 2M events into a full bus never hold the caller back, memory stays
    bounded, and after release delivered + dropped == logged exactly, as stats() says."""
    figures.describe(
        load=f"{N:,} events, capacity {CAPACITY:,}, policy {overflow}"
        + (", a new Event per call" if fresh else ", one Event logged repeatedly"),
        faults="the only handler blocks on a threading.Event until all are logged",
    )
    bus = EventBus(capacity=CAPACITY, overflow=overflow, name="overflow")  # type: ignore[arg-type]
    gate = Gate()
    try:
        bus.register_event_handler(gate, name="gate")
        stamp = datetime.now(timezone.utc)
        rss0 = rss_bytes()
        start = time.perf_counter()
        if fresh:
            worst = 0.0
            for base in range(0, N, 100_000):
                chunk = [Event("overflow", stamp, {"i": i}) for i in range(base, base + 100_000)]
                worst = max(worst, _log_timed(bus, chunk, len(chunk)))
                del chunk
        else:
            worst = _log_timed(bus, Event("overflow", stamp, {"i": 1}), N)
        elapsed = time.perf_counter() - start
        rss_growth = rss_bytes() - rss0
        gate.release.set()
        assert bus.flush(timeout=60)
        h = _check_counts(bus, gate, N)
        assert h["dropped"] >= N - 3 * CAPACITY  # the queue and one backlog hold the rest
        assert worst < 0.5, f"a log_event call took {worst:.3f}s"
        assert rss_growth < 50 * MB
        figures.measure(
            logged=N,
            delivered=h["delivered"],
            dropped=h["dropped"],
            max_log_event_s=round(worst, 6),
            mean_log_event_us=round(elapsed / N * 1e6, 3),
            rss_growth_mb=round(rss_growth / MB, 1),
        )
    finally:
        gate.release.set()
        assert bus.close(timeout=30)


@pytest.mark.stress
def test_block_policy_waits_at_most_block_timeout(figures: Figures) -> None:
    """Under "block", a caller facing a stuck handler waits at most block_timeout per call, then
    the event is counted as dropped; once the handler runs, the rest of 2M events get through
    with every event delivered or counted."""
    figures.describe(
        load=f"{N:,} events, capacity {CAPACITY:,}, policy block, block_timeout={BLOCK_TIMEOUT}s",
        faults="handler stuck until 100 calls have timed out (the batch in flight, its backlog "
        "and the queue full), then released",
    )
    bus = EventBus(capacity=CAPACITY, overflow="block", block_timeout=BLOCK_TIMEOUT, name="block")
    gate = Gate()
    try:
        bus.register_event_handler(gate, name="gate")
        event = Event("overflow", datetime.now(timezone.utc), {"i": 1})
        rss0 = rss_bytes()
        # How much the batch in flight holds depends on when the handler's thread first ran:
        # log until 100 calls have waited out their timeout, whatever that took.
        stuck_worst, stuck_calls = 0.0, 0
        while bus.stats()["dropped"] < 100:
            stuck_worst = max(stuck_worst, _log_timed(bus, event, 100))
            stuck_calls += 100
        stuck_dropped = bus.stats()["handlers"][0]["dropped"]
        rss_growth = rss_bytes() - rss0
        gate.release.set()
        start = time.perf_counter()
        running_worst = _log_timed(bus, event, N - stuck_calls)
        elapsed = time.perf_counter() - start
        assert bus.flush(timeout=60)
        h = _check_counts(bus, gate, N)
        # While stuck, the calls past queue + backlog each timed out and were dropped.
        assert stuck_dropped >= 100
        assert stuck_worst >= BLOCK_TIMEOUT  # it did block...
        assert stuck_worst < BLOCK_TIMEOUT + 0.5  # ...but no longer than its timeout
        assert running_worst < BLOCK_TIMEOUT + 0.5
        assert rss_growth < 50 * MB
        figures.measure(
            logged=N,
            delivered=h["delivered"],
            dropped=h["dropped"],
            dropped_while_stuck=stuck_dropped,
            max_wait_stuck_s=round(stuck_worst, 4),
            max_wait_running_s=round(running_worst, 4),
            throughput_running_ev_per_s=round((N - stuck_calls) / elapsed),
            rss_growth_mb=round(rss_growth / MB, 1),
        )
    finally:
        gate.release.set()
        assert bus.close(timeout=30)
