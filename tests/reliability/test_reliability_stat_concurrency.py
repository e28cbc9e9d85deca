"""Stat under concurrency: 8 threads adding to one Stat across many windows lose nothing."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _stat

from .conftest import Figures

THREADS = 8
ALL = list(Aggregation)[:6]  # torch.monitor's six (the distributions: test_stat_distributions)


class StepClock:
    """The Stat window clock, moved by the test between windows."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _value(window: int, thread: int, j: int) -> float:
    # Integer-valued and distinct, so sums are exact in any order and each value names its window.
    return float(window * 10_000_000 + thread * 100_000 + j)


def run_schedule(counts: list[list[int]], max_samples: int | None) -> dict[str, int]:
    """8 threads add counts[w][t] values in window w; check every window's event exactly."""
    clock = StepClock()
    events: list[Event] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_stat, "_clock", clock)
        bus = EventBus(name="stat-conc")
        try:
            bus.register_event_handler(events.append, name="events")
            kwargs = {} if max_samples is None else {"max_samples": max_samples}
            stat = Stat("c", ALL, timedelta(seconds=1), bus=bus, **kwargs)
            barrier = threading.Barrier(THREADS + 1, timeout=60)

            def adder(t: int) -> None:
                add = stat.add
                for w in range(len(counts)):
                    barrier.wait()
                    for j in range(counts[w][t]):
                        add(_value(w, t, j))
                    barrier.wait()

            threads = [threading.Thread(target=adder, args=(t,)) for t in range(THREADS)]
            for th in threads:
                th.start()
            for _ in counts:
                barrier.wait()  # the window opens: everyone adds
                barrier.wait()  # everyone is done with it
                clock.now += 1.0
            for th in threads:
                th.join()
            stat.get()  # closes the last window
            assert bus.flush(timeout=30)
            (h,) = bus.stats()["handlers"]
            assert h["dropped"] == 0
        finally:
            assert bus.close(timeout=30)

    stat_events = [e.data for e in events if e.name == STAT_EVENT]
    windows = [w for w, row in enumerate(counts) if sum(row)]
    assert len(stat_events) == len(windows)
    added = logged = 0
    for w, data in zip(windows, stat_events, strict=True):
        values = [_value(w, t, j) for t in range(THREADS) for j in range(counts[w][t])]
        lasts = {_value(w, t, counts[w][t] - 1) for t in range(THREADS) if counts[w][t]}
        n = len(values)
        added += n
        if max_samples is None or n <= max_samples:
            assert data["c.count"] == n
            assert data["c.sum"] == sum(values)
            assert data["c.max"] == max(values)
            assert data["c.min"] == min(values)
            assert data["c.value"] in lasts
        else:  # a subset of this window's values, each at most once
            assert data["c.count"] == max_samples
            assert min(values) <= data["c.min"] <= data["c.max"] <= max(values)
            assert data["c.sum"] <= sum(sorted(values)[-max_samples:])
            assert data["c.sum"] >= sum(sorted(values)[:max_samples])
            assert data["c.value"] in set(values)
        assert data["c.mean"] == data["c.sum"] / data["c.count"]
        assert isinstance(data["c.count"], int)
        logged += data["c.count"]
    return {"added": added, "logged_count": logged, "windows": len(windows)}


schedules = st.lists(
    st.lists(st.integers(0, 1500), min_size=THREADS, max_size=THREADS), min_size=1, max_size=6
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=schedules, max_samples=st.one_of(st.none(), st.integers(1, 6000)))
def test_random_schedules_lose_nothing(counts: list[list[int]], max_samples: int | None) -> None:
    """For random per-thread, per-window add counts, every window's COUNT/SUM/MAX/MIN/MEAN
    equals the reference (or, past max_samples, a subset of that window's values)."""
    run_schedule(counts, max_samples)


@pytest.mark.parametrize("max_samples", [None, 5000], ids=["unbounded", "max_samples=5000"])
def test_many_windows_eight_threads(max_samples: int | None, figures: Figures) -> None:
    """8 threads x 1000 adds in each of 60 stepped windows: the logged counts and sums
    equal what was added, window by window."""
    counts = [[1000] * THREADS for _ in range(60)]
    figures.describe(
        load=f"{THREADS} threads x 1000 adds x 60 windows into one Stat (all 6 aggregations)"
        + ("" if max_samples is None else f", max_samples={max_samples}"),
        faults="window closes raced by adds, folds and the dispatcher's timer",
    )
    result = run_schedule(counts, max_samples)
    expected = result["added"] if max_samples is None else 60 * max_samples
    assert result["logged_count"] == expected
    figures.measure(
        values_added=result["added"],
        values_in_logged_windows=result["logged_count"],
        windows_logged=result["windows"],
        lost_or_double_counted=0,
    )
