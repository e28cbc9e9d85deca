"""Soak: a minute at a fixed event rate through an async, a slow and a sometimes-raising handler.

``MONITOR_BUS_SOAK_SECONDS`` shortens it (``.ci/run`` runs 20 s: the same handlers, rate and
counts, and the memory slope over 10 s after the warm-up instead of 50 s); the published run
(``benchmarks/reliability_report.py``) soaks the full minute.
"""

from __future__ import annotations

import os
import time
from array import array
from datetime import datetime, timedelta, timezone

import pytest
from anyio.lowlevel import checkpoint

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat

from .conftest import Figures, percentile, rss_bytes

WARM_UP = 10  # seconds of resident memory left out of the slope


def _duration() -> int:
    """The soak's whole seconds: ``MONITOR_BUS_SOAK_SECONDS``, or a minute."""
    text = os.environ.get("MONITOR_BUS_SOAK_SECONDS") or "60"
    if not text.isdigit() or not WARM_UP + 5 <= int(text) <= 3600:
        raise ValueError(
            f"MONITOR_BUS_SOAK_SECONDS must be whole seconds from {WARM_UP + 5} (the warm-up and "
            f"5 s of memory samples) to 3600, not {text!r}"
        )
    return int(text)


DURATION = _duration()
RATE = 1000  # events per second
TICK = 0.01
N = int(DURATION * RATE)
MB = 1024 * 1024


class Latencies:
    """Delivery latency per event, in a preallocated array so the test itself does not grow."""

    def __init__(self) -> None:
        self.seconds = array("d", bytes(8 * N))
        self.count = 0
        self.stat_events = 0

    def record(self, event: Event) -> None:
        if event.name == STAT_EVENT:
            self.stat_events += 1
            return
        self.seconds[event.data["i"]] = time.monotonic() - event.data["t"]  # type: ignore[index,operator]
        self.count += 1

    def summary(self) -> dict[str, float]:
        s = sorted(self.seconds[:N])
        return {
            "p50_ms": round(percentile(s, 50) * 1000, 3),
            "p99_ms": round(percentile(s, 99) * 1000, 3),
            "max_ms": round(s[-1] * 1000, 3),
        }


def _slope_mb_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time."""
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    num = sum((t - mt) * (r - mr) for t, r in samples)
    den = sum((t - mt) ** 2 for t, _ in samples)
    return num / den * 60 / MB


@pytest.mark.stress
@pytest.mark.timeout(DURATION + 120)
def test_soak_one_minute(figures: Figures) -> None:
    """60 s (or ``MONITOR_BUS_SOAK_SECONDS``) at 1,000 events/s (plus a 1 s Stat) through an
    async handler, a slow handler (0.5 ms per event) and one raising on every 1000th event:
    nothing is dropped, every raise is counted, and resident memory stays flat (slope and
    latencies reported)."""
    figures.describe(
        load=f"{DURATION:.0f} s at {RATE:,} events/s ({N:,} events) + a Stat with 1 s windows",
        faults="3 handlers: async (awaits each event), slow (sleeps 0.5 ms per event), "
        "raising ValueError on every 1000th event",
    )
    lat_async, lat_slow, lat_raising = Latencies(), Latencies(), Latencies()

    async def async_handler(event: Event) -> None:
        await checkpoint()
        lat_async.record(event)

    def slow_handler(event: Event) -> None:
        time.sleep(0.0005)
        lat_slow.record(event)

    def raising_handler(event: Event) -> None:
        lat_raising.record(event)
        if event.name != STAT_EVENT and event.data["i"] % 1000 == 999:  # type: ignore[operator]
            raise ValueError("every 1000th event")

    bus = EventBus(name="soak")
    try:
        bus.register_event_handler(async_handler, name="async")
        bus.register_event_handler(slow_handler, name="slow")
        bus.register_event_handler(raising_handler, name="raising")
        stat = Stat(
            "soak.step", [Aggregation.MEAN, Aggregation.COUNT], timedelta(seconds=1), bus=bus
        )
        stamp = datetime.now(timezone.utc)
        per_tick = int(RATE * TICK)
        rss: list[tuple[float, int]] = []
        start = time.monotonic()
        next_sample = start
        i = 0
        for tick in range(int(DURATION / TICK)):
            delay = start + tick * TICK - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the producer, not waiting for a result
            for _ in range(per_tick):
                bus.log_event(Event("soak", stamp, {"i": i, "t": time.monotonic()}))
                stat.add(1.0)
                i += 1
            now = time.monotonic()
            if now >= next_sample:
                rss.append((now - start, rss_bytes()))
                next_sample += 1.0
        elapsed = time.monotonic() - start
        # The last window, closed now rather than by the timer: none can be logged between
        # the flush and the reading of the counters below.
        stat._close()
        assert bus.flush(timeout=60)
        stats = bus.stats()
        per = {h["name"]: h for h in stats["handlers"]}
        steady = [s for s in rss if s[0] >= WARM_UP]
        growth = steady[-1][1] - steady[0][1]
        slope = _slope_mb_per_min(steady)
        figures.measure(
            logged=stats["logged"],
            delivered={k: h["delivered"] for k, h in per.items()},
            dropped=stats["handler_dropped"],
            errors_counted=per["raising"]["errors"],
            achieved_rate_ev_per_s=round(N / elapsed),
            latency_async=lat_async.summary(),
            latency_slow=lat_slow.summary(),
            latency_raising=lat_raising.summary(),
            rss_start_mb=round(steady[0][1] / MB, 1),
            rss_growth_mb=round(growth / MB, 2),
            rss_slope_mb_per_min=round(slope, 3),
        )
        assert i == N
        stat_events = lat_async.stat_events
        assert stat_events >= int(DURATION) - 1
        for name, lat in (("async", lat_async), ("slow", lat_slow), ("raising", lat_raising)):
            h = per[name]
            assert (lat.count, lat.stat_events) == (N, stat_events), name
            assert h["delivered"] == h["logged"] == N + stat_events, name
            assert h["dropped"] == 0, name
            assert h["pending"] == 0, name
        assert per["raising"]["errors"] == N // 1000
        assert stats["handler_errors"] == N // 1000
        assert stats["dropped"] == 0
        assert growth < 10 * MB
    finally:
        assert bus.close(timeout=30)
