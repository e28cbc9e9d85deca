"""Stat windows: aggregates, closing on add, on the timer and early at max_samples."""

from __future__ import annotations

import gc
import math
import threading
from datetime import datetime, timedelta
from fractions import Fraction
from typing import Any

import pytest

from monitor_bus import (
    STAT_EVENT,
    Aggregation,
    EventBus,
    Stat,
    _aggregates,
    _stat,
    _stat_timer,
    _window,
)

from .conftest import Recorder, StepClock, require

ALL = list(Aggregation)[:6]  # torch.monitor's six (the distributions: test_stat_distributions)
LONG = timedelta(seconds=600)  # the real-time timer never fires within a test


def stat_events(recorder: Recorder) -> list[dict[str, object]]:
    return [e.data for e in recorder.events if e.name == STAT_EVENT]


def test_window_closes_on_add_after_its_end(
    bus: EventBus, recorder: Recorder, clock: StepClock
) -> None:
    """The first add after a window's end logs the window; the new value opens the next one."""
    bus.register_event_handler(recorder)
    stat = Stat("loss", ALL, timedelta(seconds=10), bus=bus)
    for v in (3.0, 1.0, 2.0):
        stat.add(v)
    assert stat.count == 3
    bus.flush()
    assert stat_events(recorder) == []
    clock.now = 1010.0  # the window [1000, 1010) is over
    stat.add(7.0)
    assert bus.flush()
    assert stat_events(recorder) == [
        {
            "loss.value": 2.0,
            "loss.mean": 2.0,
            "loss.count": 3,
            "loss.sum": 6.0,
            "loss.max": 3.0,
            "loss.min": 1.0,
        }
    ]
    assert stat.get() == {
        Aggregation.VALUE: 2.0,
        Aggregation.MEAN: 2.0,
        Aggregation.COUNT: 3,
        Aggregation.SUM: 6.0,
        Aggregation.MAX: 3.0,
        Aggregation.MIN: 1.0,
    }
    assert type(stat.get()[Aggregation.COUNT]) is int
    assert stat.count == 1


def test_empty_window_logs_nothing(bus: EventBus, recorder: Recorder, clock: StepClock) -> None:
    """A window without samples is not logged; get() keeps the last logged window."""
    bus.register_event_handler(recorder)
    stat = Stat("x", [Aggregation.SUM], timedelta(seconds=1), bus=bus)
    stat.add(1)
    clock.now += 1
    assert stat.get() == {Aggregation.SUM: 1.0}
    clock.now += 5
    assert stat.get() == {Aggregation.SUM: 1.0}
    assert stat.count == 0
    bus.flush()
    assert stat_events(recorder) == [{"x.sum": 1.0}]


def test_get_is_empty_before_the_first_window(clock: StepClock) -> None:
    """get() returns {} until a window was logged; count counts the open window."""
    stat = Stat("x", [Aggregation.MEAN], LONG)
    assert stat.get() == {}
    stat.add(2)
    assert (stat.get(), stat.count, stat.name) == ({}, 1, "x")


def test_windows_are_aligned_to_the_clock(
    bus: EventBus, recorder: Recorder, clock: StepClock
) -> None:
    """Windows are [k*w, (k+1)*w) of the monotonic clock, as in torch."""
    bus.register_event_handler(recorder)
    clock.now = 1004.0
    stat = Stat("x", [Aggregation.COUNT], timedelta(seconds=10), bus=bus)
    stat.add(1)
    clock.now = 1009.999
    stat.add(1)
    clock.now = 1010.0
    stat.add(1)
    bus.flush()
    assert stat_events(recorder) == [{"x.count": 2}]


def test_max_samples_logs_inside_the_add_and_discards_the_rest(
    bus: EventBus, recorder: Recorder, clock: StepClock
) -> None:
    """The add that reaches max_samples logs the window; later adds wait for the next window."""
    bus.register_event_handler(recorder)
    stat = Stat(
        "x", [Aggregation.COUNT, Aggregation.SUM], timedelta(seconds=10), max_samples=3, bus=bus
    )
    for v in (1, 2, 3):
        stat.add(v)
    assert stat.count == 0
    assert stat.get() == {Aggregation.COUNT: 3, Aggregation.SUM: 6.0}
    for v in (100, 200):
        stat.add(v)
    assert stat.count == 0
    clock.now += 10
    stat.add(5)
    assert stat.count == 1
    clock.now += 10
    stat.add(0)
    bus.flush()
    assert stat_events(recorder) == [{"x.count": 3, "x.sum": 6.0}, {"x.count": 1, "x.sum": 5.0}]


def test_large_max_samples_across_folds(clock: StepClock) -> None:
    """max_samples above the fold chunk still cuts the window at exactly max_samples."""
    n = _window._CHUNK * 2 + 17
    stat = Stat("x", [Aggregation.COUNT, Aggregation.SUM], LONG, max_samples=n)
    for _ in range(n + 500):
        stat.add(1.0)
    assert stat.get() == {Aggregation.COUNT: n, Aggregation.SUM: float(n)}
    assert stat.count == 0


def test_many_samples_fold_exactly(clock: StepClock) -> None:
    """Folding every chunk gives the same aggregates as one pass over the values."""
    values = [float((i * 7919) % 1000 - 500) for i in range(3 * _window._CHUNK + 5)]
    stat = Stat("x", ALL, LONG)
    for v in values:
        stat.add(v)
    clock.now += 600
    got = stat.get()
    total = 0.0
    for v in values:
        total += v
    assert got == {
        Aggregation.VALUE: values[-1],
        Aggregation.MEAN: total / len(values),
        Aggregation.COUNT: len(values),
        Aggregation.SUM: total,
        Aggregation.MAX: max(values),
        Aggregation.MIN: min(values),
    }


def window_of(
    values: list[Any], aggregations: list[Aggregation], clock: StepClock
) -> dict[Aggregation, float | int]:
    """The aggregates a Stat logs for one window of ``values``."""
    stat = Stat("x", aggregations, LONG)
    for v in values:
        stat.add(v)
    clock.now += 600
    return stat.get()


NAN_AT = [0, 1, 3, _window._CHUNK + 2]  # first, inside the first fold, last, in a later fold


@pytest.mark.parametrize("position", NAN_AT)
def test_a_nan_makes_max_and_min_nan_wherever_it_is(position: int, clock: StepClock) -> None:
    """A NaN anywhere in a window makes MAX and MIN NaN, as SUM and MEAN (numpy's max, not
    Python's, whose result depends on where the NaN is)."""
    values = [1.0, 3.0, -math.inf] + [2.0] * _window._CHUNK
    values.insert(position, math.nan)
    got = window_of(values, ALL, clock)
    assert [math.isnan(got[agg]) for agg in ALL] == [False, True, False, True, True, True]
    assert got[Aggregation.COUNT] == len(values)


@pytest.mark.parametrize("position", NAN_AT)
@pytest.mark.parametrize("aggregations", [[Aggregation.MAX], [Aggregation.MIN, Aggregation.COUNT]])
def test_a_nan_makes_max_and_min_nan_without_sum(
    aggregations: list[Aggregation], position: int, clock: StepClock
) -> None:
    """The same for a Stat that reports neither SUM nor MEAN."""
    values = [1.0, 3.0, -math.inf] + [2.0] * _window._CHUNK
    values.insert(position, math.nan)
    got = window_of(values, aggregations, clock)
    assert math.isnan(got[aggregations[0]])
    assert got.get(Aggregation.COUNT, len(values)) == len(values)


def test_a_nan_stays_in_its_window(bus: EventBus, recorder: Recorder, clock: StepClock) -> None:
    """The window after one with a NaN has its own MAX and MIN."""
    bus.register_event_handler(recorder)
    stat = Stat("x", [Aggregation.MAX, Aggregation.MIN], LONG, bus=bus)
    for v in (1.0, math.nan, 3.0):
        stat.add(v)
    clock.now += 600
    for v in (5.0, 4.0):
        stat.add(v)
    clock.now += 600
    assert stat.get() == {Aggregation.MAX: 5.0, Aggregation.MIN: 4.0}
    assert bus.flush()
    first, second = stat_events(recorder)
    assert math.isnan(first["x.max"])
    assert math.isnan(first["x.min"])
    assert second == {"x.max": 5.0, "x.min": 4.0}


def test_infinities_follow_ieee(clock: StepClock) -> None:
    """SUM and MEAN are IEEE sums of infinite samples (inf - inf is NaN); MAX/MIN see them."""
    got = window_of(
        [1.0, math.inf, -math.inf], [Aggregation.SUM, Aggregation.MAX, Aggregation.MIN], clock
    )
    assert math.isnan(got[Aggregation.SUM])
    assert (got[Aggregation.MAX], got[Aggregation.MIN]) == (math.inf, -math.inf)
    got = window_of([1.0, math.inf], [Aggregation.MEAN, Aggregation.SUM], clock)
    assert got == {Aggregation.MEAN: math.inf, Aggregation.SUM: math.inf}


@pytest.mark.parametrize(
    ("values", "mean", "total"),
    [
        ([1e308, 1e308], 1e308, math.inf),
        ([-1e308, -1e308], -1e308, -math.inf),
        ([1e308, 1e308, -1e308], 1e308 / 3, math.inf),
    ],
)
def test_mean_is_finite_when_the_sum_overflows(
    values: list[float], mean: float, total: float, clock: StepClock
) -> None:
    """MEAN is the mean of the samples even when their float sum overflows; SUM is that sum."""
    got = window_of(values, [Aggregation.MEAN, Aggregation.SUM, Aggregation.COUNT], clock)
    assert got == {Aggregation.MEAN: mean, Aggregation.SUM: total, Aggregation.COUNT: len(values)}


def test_mean_of_huge_samples_is_the_true_mean_to_an_ulp(clock: StepClock) -> None:
    """Samples near the float maximum, of both signs, over several folds: MEAN is within one
    ulp of the exact mean although the running sum overflows."""
    mixed = [((i * 7919) % 1000 + 1) * 1.7e305 * (1 if i % 5 else -1) for i in range(9000)]
    mixed[7] = 1e-300  # tiny samples are absorbed, as in any float sum of such magnitude
    for values in (mixed, [1e308] * (_window._CHUNK + 5)):
        got = window_of(values, [Aggregation.MEAN, Aggregation.SUM], clock)
        exact = float(sum(map(Fraction, values)) / len(values))
        assert got[Aggregation.SUM] == math.inf
        assert abs(got[Aggregation.MEAN] - exact) <= math.ulp(exact)


def test_device_values_keep_the_nan_and_overflow_rules(clock: StepClock) -> None:
    """Tensor samples, folded when the bus reads them, follow the same rules: MEAN of two
    1e308 is 1e308, and a NaN anywhere makes MAX and MIN NaN."""
    try:
        import torch
    except ImportError as exc:
        require(False, f"torch is not installed: {exc}")
    huge = [torch.tensor(1e308, dtype=torch.float64)] * 2
    got = window_of(huge, [Aggregation.MEAN, Aggregation.SUM], clock)
    assert got == {Aggregation.MEAN: 1e308, Aggregation.SUM: math.inf}
    mixed = [1.0, torch.tensor(5.0), torch.tensor(math.nan), 3.0, torch.tensor(4.0)]
    got = window_of(mixed, [Aggregation.MAX, Aggregation.MIN, Aggregation.COUNT], clock)
    assert math.isnan(got[Aggregation.MAX])
    assert math.isnan(got[Aggregation.MIN])
    assert got[Aggregation.COUNT] == 5


def test_timer_closes_a_window_without_another_add(bus: EventBus, recorder: Recorder) -> None:
    """A window with data is logged by the dispatcher's timer even if add is never called again.
    (The Stat clock stands still until the test moves it: however slow this thread, both adds
    fall in one window.)"""
    with pytest.MonkeyPatch.context() as patch:
        clock = StepClock()
        patch.setattr(_stat, "_clock", clock)
        bus.register_event_handler(recorder)
        stat = Stat("t", [Aggregation.SUM], timedelta(milliseconds=50), bus=bus)
        stat.add(2)
        stat.add(3)
        assert step_until_logged(clock, recorder)
        assert stat_events(recorder) == [{"t.sum": 5.0}]
        assert stat.count == 0


def step_until_logged(clock: StepClock, recorder: Recorder) -> bool:
    """Move the Stat clock on, a second at a time, until the dispatcher's timer has logged a
    window (its first pass for a window size only schedules it, from the clock as it reads
    then); False if none came within about 10 s."""
    for _ in range(200):
        clock.now += 1
        if recorder.wait_for(1, timeout=0.05):
            return True
    return False


def test_collected_stat_logs_its_open_window(bus: EventBus, recorder: Recorder) -> None:
    """A Stat that is garbage collected logs the window it had open."""
    bus.register_event_handler(recorder)
    stat = Stat("gc", [Aggregation.COUNT], LONG, bus=bus)
    stat.add(1)
    del stat
    gc.collect()
    assert bus.flush()
    assert stat_events(recorder) == [{"gc.count": 1}]


def test_concurrent_adds_lose_nothing(bus: EventBus, recorder: Recorder) -> None:
    """Eight threads adding at once: logged counts and sums plus the open window equal what was added."""
    bus.register_event_handler(recorder)
    stat = Stat("c", [Aggregation.COUNT, Aggregation.SUM], timedelta(milliseconds=5), bus=bus)
    per_thread = 20_000
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            stat.add(1.0)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stat._close()
    assert bus.flush()
    windows = stat_events(recorder)
    assert sum(w["c.count"] for w in windows) == 8 * per_thread  # type: ignore[misc]
    assert sum(w["c.sum"] for w in windows) == 8 * per_thread  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"aggregations": []}, ValueError, "aggregations must name at least one"),
        (
            {"aggregations": [1]},
            TypeError,
            "aggregations must be monitor_bus.Aggregation members, not int",
        ),
        ({"aggregations": 5}, TypeError, "aggregations must be an iterable"),
        ({"window_size": 1.0}, TypeError, "window_size must be a timedelta"),
        ({"window_size": timedelta(0)}, ValueError, "window_size must be at least 1 millisecond"),
        (
            {"window_size": timedelta(seconds=-1)},
            ValueError,
            "window_size must be at least 1 millisecond",
        ),
        ({"max_samples": 0}, ValueError, "max_samples must be at least 1"),
        ({"max_samples": 1.5}, TypeError, "max_samples must be an int"),
        ({"name": None}, TypeError, "name must be a str"),
        ({"bus": "default"}, TypeError, "bus must be a monitor_bus.EventBus or None, not str"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    """Bad constructor arguments raise a clear exception naming the argument."""
    args: dict[str, object] = {"name": "x", "aggregations": [Aggregation.SUM], "window_size": LONG}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        Stat(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["1", None, b"1", 1j, [1]])
def test_non_numeric_add_is_rejected_and_harmless(value: object, clock: StepClock) -> None:
    """add of a non-number raises a TypeError naming v and leaves the window as it was."""
    stat = Stat("x", [Aggregation.SUM, Aggregation.COUNT], LONG)
    stat.add(2)
    with pytest.raises(TypeError, match="v must be a real number"):
        stat.add(value)  # type: ignore[arg-type]
    clock.now += 600
    assert stat.get() == {Aggregation.SUM: 2.0, Aggregation.COUNT: 1}


def test_numpy_and_bool_values_are_added_as_floats(clock: StepClock) -> None:
    """Anything with __float__ is accepted (numpy scalars, bools)."""
    import numpy as np

    stat = Stat("x", [Aggregation.SUM, Aggregation.VALUE], LONG)
    stat.add(np.float32(1.5))
    stat.add(True)
    clock.now += 600
    assert stat.get() == {Aggregation.SUM: 2.5, Aggregation.VALUE: 1.0}


def test_closing_the_bus_logs_open_windows(recorder: Recorder, clock: StepClock) -> None:
    """bus.close() logs the open window of each of its Stats before the final delivery."""
    bus = EventBus()
    bus.register_event_handler(recorder)
    stat = Stat("x", [Aggregation.COUNT], LONG, bus=bus)
    stat.add(1)
    stat.add(2)
    assert bus.close(10)
    assert stat_events(recorder) == [{"x.count": 2}]


def test_interrupt_inside_a_fold_loses_no_sample(
    monkeypatch: pytest.MonkeyPatch, clock: StepClock
) -> None:
    """A KeyboardInterrupt landing in a fold leaves the samples in the window: the last
    window of an interrupted run holds every sample added."""
    stat = Stat("x", [Aggregation.COUNT, Aggregation.SUM], LONG)
    real_reduce = _aggregates.reduce
    interrupts = []

    def interrupted_once(*args: object) -> object:
        if not interrupts:
            interrupts.append(1)
            raise KeyboardInterrupt
        return real_reduce(*args)  # type: ignore[call-overload]

    stat.add(1.0)  # a window's first add folds at once (it marks the Stat for the timer)
    monkeypatch.setattr(_aggregates, "reduce", interrupted_once)
    n = _window._CHUNK
    for _ in range(n - 1):
        stat.add(1.0)
    with pytest.raises(KeyboardInterrupt):
        stat.add(1.0)  # fills the chunk, so it folds, and the fold is interrupted
    stat.add(1.0)
    assert stat.count == n + 2
    stat._close()
    assert stat.get() == {Aggregation.COUNT: n + 2, Aggregation.SUM: float(n + 2)}


def test_one_element_arrays_are_samples_alike(clock: StepClock) -> None:
    """numpy scalars and one-element arrays are samples; more elements is a TypeError."""
    np = pytest.importorskip("numpy")
    stat = Stat("x", [Aggregation.COUNT, Aggregation.SUM], LONG)
    for v in (np.float32(1.5), np.array([2.0]), np.array(3), np.array([[True]])):
        stat.add(v)
    stat._close()
    assert stat.get() == {Aggregation.COUNT: 4, Aggregation.SUM: 7.5}
    with pytest.raises(TypeError, match="v must hold one value, not a numpy.ndarray of 2 elements"):
        stat.add(np.zeros(2))
    with pytest.raises(TypeError, match="v must be a real number, not str"):
        stat.add("1.0")  # type: ignore[arg-type]


def test_timer_pass_closes_due_windows_by_the_stat_clock(
    bus: EventBus, recorder: Recorder, clock: StepClock
) -> None:
    """The dispatcher's timer pass reads the Stat clock: it closes each window that holds
    data once its end (plus a slack) has passed, leaves empty ones, and returns the next end."""
    slack = _stat_timer._TIMER_SLACK
    bus.register_event_handler(recorder)
    fast = Stat("fast", [Aggregation.SUM], timedelta(seconds=10), bus=bus)
    slow = Stat("slow", [Aggregation.SUM], timedelta(seconds=60), bus=bus)
    next_end: dict[float, float] = {}
    assert bus._dispatcher._timer_pass(next_end) == 1010.0 + slack  # the first pass only schedules
    fast.add(1.0)
    slow.add(2.0)
    clock.now = 1010.0  # the window is over, but not by the slack yet
    assert bus._dispatcher._timer_pass(next_end) == 1010.0 + slack
    assert bus.flush(10)
    assert stat_events(recorder) == []
    clock.now = 1010.0 + slack
    assert bus._dispatcher._timer_pass(next_end) == 1020.0 + slack
    assert bus.flush(10)
    assert stat_events(recorder) == [{"fast.sum": 1.0}]
    clock.now = 1060.0 + slack  # fast's window [1010, 1020) was empty: nothing to log
    assert bus._dispatcher._timer_pass(next_end) == 1070.0 + slack
    assert bus.flush(10)
    assert stat_events(recorder) == [{"fast.sum": 1.0}, {"slow.sum": 2.0}]


def test_interrupt_while_a_window_is_logged_loses_it_not(
    bus: EventBus, recorder: Recorder, monkeypatch: pytest.MonkeyPatch, clock: StepClock
) -> None:
    """A KeyboardInterrupt landing as a window is handed to the bus leaves the window in the
    Stat: the next close logs it, with every sample."""
    bus.register_event_handler(recorder)
    stat = Stat("x", [Aggregation.COUNT], LONG, bus=bus)
    for _ in range(10):
        stat.add(1.0)
    real = bus._log_window
    interrupts: list[int] = []

    def interrupted_once(item: object) -> None:
        if not interrupts:
            interrupts.append(1)
            raise KeyboardInterrupt
        real(item)  # type: ignore[arg-type]

    monkeypatch.setattr(bus, "_log_window", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        stat._close()
    stat._close()
    assert bus.flush(10)
    assert stat_events(recorder) == [{"x.count": 10}]


def test_the_timer_visits_only_stats_holding_data(
    monkeypatch: pytest.MonkeyPatch, bus: EventBus, recorder: Recorder
) -> None:
    """1,000 idle Stats are never visited by the dispatcher's timer; the one Stat with a sample
    is, and its window is logged."""
    visited: list[str] = []
    close_on_timer = Stat._close_on_timer

    def counting(self: Stat, now: float, stamp: datetime) -> None:
        visited.append(self.name)
        close_on_timer(self, now, stamp)

    monkeypatch.setattr(Stat, "_close_on_timer", counting)
    bus.register_event_handler(recorder)
    window = timedelta(milliseconds=20)
    idle = [Stat(f"idle{k}", [Aggregation.COUNT], window, bus=bus) for k in range(1000)]
    busy = Stat("busy", [Aggregation.COUNT], window, bus=bus)
    busy.add(1.0)
    assert recorder.wait_for(1)
    assert stat_events(recorder) == [{"busy.count": 1}]
    assert set(visited) == {"busy"}
    assert len(idle) == 1000


def test_a_pickled_stat_is_an_empty_copy_on_the_default_bus(
    recorder: Recorder, clock: StepClock
) -> None:
    """Unpickled in the same process, a Stat of the default bus is a new Stat with its
    definition and none of its samples, logging its own windows on the default bus."""
    import pickle

    import monitor_bus

    monitor_bus.register_event_handler(recorder)
    stat = Stat("loss", [Aggregation.COUNT, Aggregation.MAX], timedelta(seconds=10), 5)
    stat.add(4.0)
    copy = pickle.loads(pickle.dumps(stat))
    assert copy is not stat
    assert (copy.name, copy.count, repr(copy)) == ("loss", 0, repr(stat))
    assert copy._bus is monitor_bus.get_default_bus()
    for v in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # the fifth logs the window (max_samples kept)
        copy.add(v)
    assert monitor_bus.flush(10)
    assert stat_events(recorder) == [{"loss.count": 5, "loss.max": 5.0}]
    assert stat.count == 1


def test_a_stat_of_another_bus_refuses_to_pickle(bus: EventBus) -> None:
    """A Stat of a bus other than the default bus (which cannot cross processes) says so
    when pickled, naming the Stat and its bus."""
    import pickle

    stat = Stat("loss", [Aggregation.COUNT], LONG, bus=bus)
    with pytest.raises(TypeError, match="cannot pickle Stat 'loss': it logs to EventBus 'test'"):
        pickle.dumps(stat)
