"""Stat distributions (issue 22): P50/P90/P95/P99 from the window's Histogram, a stable
STDDEV, HISTOGRAM, what a closed window carries for a merge, and a child's Histogram across
the relay."""

from __future__ import annotations

import gc
import math
import multiprocessing
import pickle
import random
import statistics
import sys
import threading
import tracemalloc
from datetime import timedelta
from fractions import Fraction
from types import FrameType
from typing import Any

import pytest

import monitor_bus
from monitor_bus import (
    STAT_EVENT,
    Aggregation,
    EventBus,
    EventOrigin,
    Histogram,
    Stat,
    _vectorized,
    _window,
    _wire,
)
from monitor_bus._aggregates import distribution, merge_moments, stddev
from monitor_bus._window import ClosedWindow

from . import child_workers
from .conftest import Recorder, StepClock, require
from .test_stat import stat_events

DIST = [Aggregation.P50, Aggregation.P90, Aggregation.P95, Aggregation.P99]
EVERY = [*DIST, Aggregation.STDDEV, Aggregation.HISTOGRAM]
LONG = timedelta(seconds=600)


def close_window(stat: Stat, clock: StepClock) -> dict[Aggregation, Any]:
    clock.now += 600
    return stat.get()


def test_window_data_has_percentiles_stddev_and_histogram(
    bus: EventBus, recorder: Recorder, clock: StepClock
) -> None:
    """A window of several folds logs <name>.p50 ... .p99 read from its Histogram (the
    Histogram of all its samples, as one pass makes it), .stddev and .histogram; get()
    reports the same."""
    bus.register_event_handler(recorder)
    rng = random.Random(1)
    samples = [rng.lognormvariate(-2, 1) for _ in range(3 * _window._CHUNK + 17)]
    stat = Stat("step", [Aggregation.MEAN, *EVERY], LONG, bus=bus)
    for v in samples:
        stat.add(v)
    got = close_window(stat, clock)
    assert bus.flush()
    whole = Histogram.of(samples)
    expected = {
        Aggregation.MEAN: got[Aggregation.MEAN],
        Aggregation.P50: whole.quantile(0.5),
        Aggregation.P90: whole.quantile(0.9),
        Aggregation.P95: whole.quantile(0.95),
        Aggregation.P99: whole.quantile(0.99),
        Aggregation.STDDEV: got[Aggregation.STDDEV],
        Aggregation.HISTOGRAM: whole,
    }
    assert got == expected
    assert math.isclose(got[Aggregation.STDDEV], statistics.pstdev(samples), rel_tol=1e-14)
    (data,) = stat_events(recorder)
    assert data == {f"step.{agg.name.lower()}": value for agg, value in expected.items()}
    assert list(data) == [
        "step.mean",
        "step.p50",
        "step.p90",
        "step.p95",
        "step.p99",
        "step.stddev",
        "step.histogram",
    ]
    for q, key in ((0.5, "step.p50"), (0.99, "step.p99")):
        true = sorted(samples)[math.ceil(q * len(samples)) - 1]
        assert abs(data[key] - true) <= 0.01 * true  # type: ignore[operator]


@pytest.mark.parametrize("center", [0.0, 1e9, 1e15, -3e12])
def test_stddev_keeps_its_precision_far_from_zero(center: float, clock: StepClock) -> None:
    """STDDEV of samples far from zero (1e9 + noise) is the exact population standard
    deviation to a few roundings: the sum of squares would lose every digit."""
    rng = random.Random(int(center))
    samples = [center + rng.gauss(0, 1) for _ in range(2 * _window._CHUNK + 5)]
    stat = Stat("x", [Aggregation.STDDEV], LONG)
    for v in samples:
        stat.add(v)
    got = close_window(stat, clock)[Aggregation.STDDEV]
    assert math.isclose(got, statistics.pstdev(samples), rel_tol=1e-13)


def test_non_numbers_have_defined_outcomes(clock: StepClock) -> None:
    """A NaN makes STDDEV NaN and is left out of the percentiles (counted in the Histogram's
    nan_count); an infinity makes STDDEV NaN and is a percentile where its rank falls."""
    stat = Stat("x", [Aggregation.P50, Aggregation.P99, *EVERY[4:]], LONG)
    for v in (1.0, 2.0, math.nan, 4.0):
        stat.add(v)
    got = close_window(stat, clock)
    assert math.isnan(got[Aggregation.STDDEV])
    assert got[Aggregation.P99] == 4.0
    assert got[Aggregation.HISTOGRAM].nan_count == 1
    assert got[Aggregation.HISTOGRAM] == Histogram.of([1.0, 2.0, math.nan, 4.0])
    for v in (1.0, math.inf, math.inf):
        stat.add(v)
    got = close_window(stat, clock)
    assert math.isnan(got[Aggregation.STDDEV])
    assert got[Aggregation.P50] == math.inf
    assert got[Aggregation.P99] == math.inf


def test_a_single_sample_has_zero_stddev_and_itself_as_percentiles(clock: StepClock) -> None:
    """One sample: STDDEV 0 and every percentile the sample (min and max clamp the bucket)."""
    stat = Stat("x", EVERY, LONG)
    stat.add(0.3)
    got = close_window(stat, clock)
    assert got == {
        **dict.fromkeys(DIST, 0.3),
        Aggregation.STDDEV: 0.0,
        Aggregation.HISTOGRAM: Histogram.of([0.3]),
    }


def test_closed_windows_carry_what_a_merge_needs(bus: EventBus, clock: StepClock) -> None:
    """A ClosedWindow carries its moments and Histogram: two windows merged give the STDDEV
    and the Histogram (so the percentiles) of all their samples."""
    closed: list[ClosedWindow] = []

    def tap(window: ClosedWindow) -> bool:
        closed.append(window)
        return True

    bus._window_tap = tap
    stat = Stat("x", [Aggregation.STDDEV, Aggregation.P99], LONG, bus=bus)
    rng = random.Random(3)
    first = [1e6 + rng.random() for _ in range(5000)]
    second = [1e6 + 3 * rng.random() for _ in range(3000)]
    for samples in (first, second):
        for v in samples:
            stat.add(v)
        clock.now += 600
        stat.get()  # closes the window
    a, b = closed
    assert a.count == 5000
    assert a.moments[0] == 5000
    assert math.isclose(stddev(a.moments), statistics.pstdev(first), rel_tol=1e-13)
    merged = merge_moments(a.moments, b.moments)
    assert math.isclose(stddev(merged), statistics.pstdev(first + second), rel_tol=1e-13)
    assert merge_moments(b.moments, a.moments)[0] == 8000
    assert a.histogram is not None
    assert b.histogram is not None
    whole = a.histogram.merge(b.histogram)
    assert whole == Histogram.of(first + second)
    p50, p90, p95, p99, merged_stddev, hist = distribution(merged, whole)
    assert (p50, p90, p95, p99, hist) == (
        *(whole.quantile(q) for q in (0.5, 0.9, 0.95, 0.99)),
        whole,
    )
    assert merged_stddev == stddev(merged)
    bus._window_tap = None


def test_a_stat_without_distributions_carries_none(bus: EventBus, clock: StepClock) -> None:
    """A Stat of torch.monitor's aggregations builds no Histogram and no moments."""
    stat = Stat("x", [Aggregation.MEAN], LONG, bus=bus)
    stat.add(1.0)
    assert (stat._hist, stat._moments) == (None, (0, 0.0, 0.0, 0.0))


def test_merge_moments_of_empty_sides() -> None:
    """Merging with no samples returns the other side; stddev of nothing is NaN."""
    some = (3, 1.0, 0.5, 2.0)
    empty = (0, 0.0, 0.0, 0.0)
    assert merge_moments(some, empty) == some
    assert merge_moments(empty, some) == some
    assert math.isnan(stddev(empty))


def test_device_values_reach_the_histogram_and_stddev(clock: StepClock) -> None:
    """Tensor samples, read later on a thread of the bus, are in the window's Histogram and
    STDDEV as floats would be."""
    torch = pytest.importorskip("torch") if not _ci() else __import__("torch")
    stat = Stat("x", [Aggregation.P50, Aggregation.STDDEV, Aggregation.HISTOGRAM], LONG)
    samples = [0.5, 1.5, 2.5, 10.0]
    for v in samples:
        stat.add(torch.tensor(v))
    got = close_window(stat, clock)
    assert got[Aggregation.HISTOGRAM] == Histogram.of(samples)
    assert math.isclose(got[Aggregation.STDDEV], statistics.pstdev(samples), rel_tol=1e-15)


def _ci() -> bool:
    from .conftest import IN_CI

    return IN_CI


def test_a_childs_window_arrives_with_its_histogram(recorder: Recorder, clock: StepClock) -> None:
    """A child process's window crosses the relay with its Histogram intact (equal to the
    Histogram of the child's samples) and its percentiles and stddev. (The forked child's Stat
    clock stands still: its 2,002 adds fall in one window.)"""
    monitor_bus.register_event_handler(recorder)
    rng = random.Random(9)
    samples = [rng.expovariate(3.0) for _ in range(2000)] + [0.0, -1.5]
    proc = multiprocessing.get_context("fork").Process(
        target=child_workers.add_distribution, args=(samples,)
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert monitor_bus.flush(10)
    (event,) = [e for e in recorder.events if e.name == STAT_EVENT]
    assert event.origin == EventOrigin(proc.pid, None)  # type: ignore[arg-type]
    whole = Histogram.of(samples)
    assert event.data["dist.histogram"] == whole
    assert event.data["dist.p50"] == whole.quantile(0.5)
    assert event.data["dist.p99"] == whole.quantile(0.99)
    assert math.isclose(event.data["dist.stddev"], statistics.pstdev(samples), rel_tol=1e-13)  # type: ignore[arg-type]


def test_the_relay_checks_a_histograms_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's unpickler makes a Histogram only from fields its constructor accepts, and
    only a window's data may hold one."""
    h = Histogram.of([1.0, 2.0])
    body = pickle.dumps((_wire.WINDOW, 1, STAT_EVENT, 0, None, {"x.histogram": h}), 5)
    message = _wire.check(_wire.loads(body))
    assert message[4] == {"x.histogram": h}
    event = pickle.dumps((_wire.EVENT, 1, "e", 0, None, {"x.histogram": h}), 5)
    with pytest.raises(_wire.Refused, match="not str keys to plain values"):
        _wire.check(_wire.loads(event))
    forged = {**h.to_dict(), "count": 7}
    monkeypatch.setattr(Histogram, "__getstate__", lambda self: forged)
    with pytest.raises(ValueError, match="count must be the total of the counts"):
        _wire.loads(pickle.dumps(h, 5))


def test_the_dispatcher_buckets_off_the_callers_thread(
    bus: EventBus, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the bus running, a chunk numpy does not take (a window's first, of one sample) is
    bucketed on the dispatcher's thread, not in the caller's add."""
    bus.register_event_handler(recorder)
    threads: list[threading.Thread] = []
    folded = threading.Event()
    real = _window._fold_distribution

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread())
        folded.set()
        return real(*args)

    monkeypatch.setattr(_window, "_fold_distribution", spy)
    stat = Stat("x", [Aggregation.P99], LONG, bus=bus)
    stat.add(1.0)  # a window's first add folds at once
    assert folded.wait(10)
    assert threads == [bus._dispatcher.thread]
    assert stat.count == 1


def test_waiting_chunks_are_bounded_when_the_dispatcher_is_not_running(
    bus: EventBus, clock: StepClock
) -> None:
    """With no dispatcher to fold them (no handlers), at most _DIST_BACKLOG chunks wait: the
    caller folds the rest, and the window still holds every sample."""
    stat = Stat("x", [Aggregation.P50, Aggregation.HISTOGRAM], LONG, bus=bus)
    samples = [float(i % 1000 + 1) for i in range((_window._DIST_BACKLOG + 3) * _window._CHUNK)]
    for v in samples:
        stat.add(v)
        assert len(stat._dist_chunks) <= _window._DIST_BACKLOG
    assert close_window(stat, clock)[Aggregation.HISTOGRAM] == Histogram.of(samples)


@pytest.mark.parametrize("path", ["pure", "numpy"])
def test_open_window_memory_is_bounded(
    path: str, bus: EventBus, clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open window of 100,000 samples of both signs over 80 octaves, with no dispatcher
    folding for it (the worst case: chunks wait up to the backlog), holds under 2 MiB: the
    figure docs/concepts.md gives, folded in pure Python and in numpy (imported before: its
    import is the process's, once, not the window's). (The Stat clock stands still: the slow
    traced loop stays in one window.)"""
    if path == "pure":
        monkeypatch.setattr(_vectorized, "_numpy", None)
        monkeypatch.setattr(_vectorized, "_tried", True)
    else:
        require(_vectorized.import_numpy() is not None, "numpy is not installed")
    stat = Stat("x", [Aggregation.MEAN, *EVERY], LONG, bus=bus)
    rng = random.Random(1)
    samples = [(-1) ** i * 2.0 ** rng.uniform(-40, 40) for i in range(100_000)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for v in samples:
            stat.add(v * 1.0)  # a new float, as a real sample is
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert stat.count == 100_000
    assert peak < 2 << 20


class InterruptAtLine:
    """A trace function raising KeyboardInterrupt (as a SIGINT handler does, between two
    statements) at the ``n``-th line event inside ``Stat._fold_distributions`` and what it
    calls; ``lines`` counts the line events seen."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lines = 0

    def __call__(self, frame: FrameType, event: str, arg: object) -> Any:
        fold = Stat._fold_distributions.__code__
        outer: FrameType | None = frame
        while outer is not None and outer.f_code is not fold:
            outer = outer.f_back
        return None if outer is None else self.line

    def line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.n:
                raise KeyboardInterrupt
        return self.line


def test_a_ctrl_c_in_the_distribution_fold_loses_nothing(bus: EventBus, clock: StepClock) -> None:
    """A KeyboardInterrupt at any statement of a window's distribution fold (at its close,
    the window's Histogram already holding a chunk) leaves the window as it was: closed
    again, it reports every sample once, and its Histogram is valid (count == bucket total,
    it survives to_dict/from_dict)."""
    rng = random.Random(3)
    first = [float(i % 10 + 1) for i in range(10)]
    # Both signs, zeros and 2000 octaves: the fold coarsens the held buckets.
    second = [rng.choice((-1.0, 0.0, 1.0)) * 2.0 ** rng.uniform(-1000, 1000) for _ in range(12)]

    def window(trace: InterruptAtLine | None) -> dict[Aggregation, Any]:
        stat = Stat(
            "x", [Aggregation.COUNT, Aggregation.STDDEV, Aggregation.HISTOGRAM], LONG, bus=bus
        )
        for v in first:
            stat.add(v)
        with stat._lock:  # the window's Histogram holds the first samples (as the dispatcher does)
            stat._take()
            stat._fold_distributions()
        assert stat._hist is not None
        assert not stat._dist_chunks
        for v in second:
            stat.add(v)
        before = sys.gettrace()
        sys.settrace(trace)
        try:
            return close_window(stat, clock)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(before)
        return stat.get()  # the window's end has passed: this closes it

    expected = window(None)
    assert expected[Aggregation.COUNT] == len(first) + len(second)
    hist = expected[Aggregation.HISTOGRAM]
    assert hist == Histogram.of(first + second)
    assert Histogram.from_dict(hist.to_dict()) == hist  # what read_jsonl and the relay check
    n = 0
    while True:
        n += 1
        trace = InterruptAtLine(n)
        got = window(trace)
        assert got == expected, f"interrupted at line event {n}"
        if trace.lines < n:  # the fold ran to its end without reaching line event n
            break
    assert n > 100  # every statement of a fold that coarsens, in both signs, was interrupted


CHUNK = _window._CHUNK
TOP = sys.float_info.max


@pytest.mark.parametrize(
    "samples",
    [
        [1.0, 2.0, -math.inf],
        [1.0, 2.0, math.inf],
        [-math.inf, 1.0, 2.0],
        [math.inf, -math.inf],
        [math.inf],
        [1.0, math.nan, 2.0],
        [math.nan],
        [1.0] * CHUNK + [2.0, -math.inf],  # in the window's second chunk
        [-math.inf] + [1.0] * CHUNK,  # in the first, the second finite
    ],
    ids=lambda s: f"{len(s)}-samples" if len(s) > 4 else repr(s),
)
def test_stddev_is_nan_with_an_infinite_or_nan_sample(
    samples: list[float], clock: StepClock
) -> None:
    """STDDEV is NaN when any sample of the window is infinite or NaN, wherever it falls."""
    stat = Stat("x", [Aggregation.STDDEV], LONG)
    for v in samples:
        stat.add(v)
    assert math.isnan(close_window(stat, clock)[Aggregation.STDDEV])


def exact_pstdev(samples: list[float]) -> float:
    """The population standard deviation of finite ``samples``, from exact fractions, correctly
    scaled where the variance passes the float range or underflows (Python 3.10's
    ``statistics.pstdev`` converts the variance to a float first, and overflows or returns 0)."""
    values = [Fraction(v) for v in samples]
    mean = sum(values, Fraction(0)) / len(values)
    variance = sum(((v - mean) ** 2 for v in values), Fraction(0)) / len(values)
    if variance == 0:
        return 0.0
    # variance * 4**k lies in [1, 4), so its float and square root are exact to a rounding.
    k = (variance.denominator.bit_length() - variance.numerator.bit_length()) // 2
    scaled = variance * Fraction(4) ** k
    while scaled >= 4:
        scaled /= 4
        k -= 1
    while scaled < 1:
        scaled *= 4
        k += 1
    return math.ldexp(math.sqrt(float(scaled)), -k)


# Finite samples whose squared deviations pass the float range, or whose spread does, or
# whose squared deviations underflow.
EXTREME_SAMPLES = {
    "1e-200": [1e-200, 3e-200],
    "subnormal": [5e-324, 1e-323, 0.0],
    "1e300": [1e300, -1e300, 1.0, 2.0],
    "1e200-chunks": [1e200 * (i % 7 - 3) for i in range(2 * CHUNK + 3)],
    "top-both-signs": [TOP, -TOP, TOP / 3, 0.0],
    "top-spread-over-chunks": [TOP * 0.75] * CHUNK + [-TOP * 0.75] * (CHUNK // 2) + [5e-324],
    "1e154-many": [1.5e154 * (-1) ** i for i in range(CHUNK + 1)],
}


@pytest.mark.parametrize("samples", EXTREME_SAMPLES.values(), ids=EXTREME_SAMPLES.keys())
def test_stddev_of_huge_or_tiny_finite_samples_is_exact(
    samples: list[float], clock: StepClock
) -> None:
    """STDDEV of finite samples is the population standard deviation to a few roundings (the
    exact one, from fractions) even where their squared deviations
    or their spread pass the float range (it was ``inf``) or underflow (it was 0)."""
    stat = Stat("x", [Aggregation.STDDEV], LONG)
    for v in samples:
        stat.add(v)
    got = close_window(stat, clock)[Aggregation.STDDEV]
    assert math.isclose(got, exact_pstdev(samples), rel_tol=1e-13)


def test_windows_of_huge_samples_merge_to_the_exact_stddev(bus: EventBus, clock: StepClock) -> None:
    """Two windows' moments (as ranks send them) of huge samples of opposite signs merge to
    the STDDEV of all their samples, either way round."""
    closed: list[ClosedWindow] = []

    def tap(window: ClosedWindow) -> bool:
        closed.append(window)
        return True

    bus._window_tap = tap
    stat = Stat("x", [Aggregation.STDDEV], LONG, bus=bus)
    first = [TOP * 0.9, TOP * 0.8, 1e300]
    second = [-TOP * 0.9, -1e300, -TOP * 0.5, 3.0]
    for samples in (first, second):
        for v in samples:
            stat.add(v)
        clock.now += 600
        stat.get()  # closes the window
    bus._window_tap = None
    a, b = closed
    for merged in (merge_moments(a.moments, b.moments), merge_moments(b.moments, a.moments)):
        assert merged[0] == 7
        assert math.isclose(stddev(merged), exact_pstdev(first + second), rel_tol=1e-13)
