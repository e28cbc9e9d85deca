"""numpy's chunk arithmetic against the pure-Python path: the same Histogram bucket for bucket
(edge values: zeros of both signs, negatives, subnormals, infinities, NaN, huge values, values
on and next to bucket boundaries), the same exact sums and mean, and a STDDEV within its
stated bound; and the pure path where numpy is not importable."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monitor_bus import Aggregation, EventBus, Histogram, Stat, _vectorized, _window
from monitor_bus._aggregates import _chunk_moments
from monitor_bus._buckets import Accumulator

from .conftest import StepClock, require

TOP = sys.float_info.max
SMALLEST_NORMAL = sys.float_info.min


@pytest.fixture(autouse=True)
def _numpy_installed() -> None:
    require(_vectorized.import_numpy() is not None, "numpy is not installed")


@contextmanager
def numpy_for_any_chunk() -> Iterator[None]:
    """numpy for a chunk of any size (it takes only chunks of MIN_CHUNK samples or more)."""
    saved = _vectorized.MIN_CHUNK
    _vectorized.MIN_CHUNK = 1
    try:
        yield
    finally:
        _vectorized.MIN_CHUNK = saved


def state(acc: Accumulator) -> tuple[Any, ...]:
    """Everything an Accumulator counted; floats by repr, so -0.0 and 0.0 differ."""
    return (
        acc.buckets(),
        acc.scale,
        acc.pos_range,
        acc.neg_range,
        acc.count,
        acc.zero,
        acc.nan,
        acc.inf,
        acc.ninf,
        acc.exact,
        repr(acc.low),
        repr(acc.high),
    )


def counted(chunks: list[list[float]], max_buckets: int) -> Accumulator:
    acc = Accumulator(max_buckets)
    for chunk in chunks:
        acc.add(chunk)
    return acc


def boundary(scale: int, index: int) -> float:
    """The float nearest the lower bound of bucket ``index`` at ``scale``."""
    return 2.0 ** (index / 2.0**scale)


def ulps(v: float, steps: int) -> float:
    """``v`` moved ``steps`` floats up (down for negative ``steps``)."""
    for _ in range(abs(steps)):
        v = math.nextafter(v, math.inf if steps > 0 else -math.inf)
    return v


# Every kind of sample, and those the numpy path must place as math.log2 does.
_normal = st.floats(min_value=SMALLEST_NORMAL, max_value=TOP)
_on_boundaries = st.builds(
    lambda scale, where, steps, sign: (
        sign * ulps(boundary(scale, round(where * (1022 << scale))), steps)
    ),
    st.integers(min_value=0, max_value=20),
    st.floats(min_value=-1.0, max_value=1.0),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([1.0, -1.0]),
).filter(lambda v: SMALLEST_NORMAL <= abs(v) < math.inf)
_sample = st.one_of(
    _normal,
    _normal.map(lambda v: -v),
    _on_boundaries,
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, TOP, -TOP, SMALLEST_NORMAL]),
    st.floats(min_value=1e-3, max_value=1e3),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
)
_chunks = st.lists(st.lists(_sample, min_size=1, max_size=40), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=_chunks, max_buckets=st.sampled_from([2048, 160, 3]))
def test_numpy_counts_every_chunk_as_the_pure_path_does(
    chunks: list[list[float]], max_buckets: int
) -> None:
    """An Accumulator fed chunks through numpy holds what the pure path's holds, bucket for
    bucket: the same scale, ranges, counts, zeros (min and max keep the sign of the first
    zero), NaN and infinities, and exact sum; a chunk numpy does not take (a NaN, an
    infinity, a subnormal) goes the pure way in the same Accumulator."""
    with numpy_for_any_chunk():
        fast = counted(chunks, max_buckets)
    with _vectorized.pure_python():
        slow = counted(chunks, max_buckets)
    assert state(fast) == state(slow)


def test_samples_next_to_every_boundary_land_where_math_log2_puts_them() -> None:
    """At every scale from 20 down to -10, samples on and one to four ulps either side of
    bucket boundaries of that scale, of both signs, are bucketed through numpy as the pure
    path buckets them (scales below 0 need few buckets: max_buckets 3)."""
    rng = random.Random(7)
    for scale in range(20, -11, -1):
        samples = []
        if scale >= 0:
            max_buckets, base = 2048, rng.randint(-1021 << scale, (1023 << scale) - 1500)
            indices = [base + rng.randrange(1500) for _ in range(200)]
            bounds = [boundary(scale, i) for i in indices]
        else:
            # Powers of two spanning enough octaves that three buckets need this scale.
            max_buckets, span = 3, 3 << -scale
            low = rng.randint(-1000, 1000 - min(span, 1000))
            bounds = [2.0 ** rng.randint(low, min(low + span, 1023)) for _ in range(200)]
        for v in bounds:
            samples += [rng.choice((1.0, -1.0)) * ulps(v, steps) for steps in range(-4, 5)]
        samples = [v for v in samples if SMALLEST_NORMAL <= abs(v) < math.inf]
        fast = counted([samples], max_buckets)
        with _vectorized.pure_python():
            slow = counted([samples], max_buckets)
        assert state(fast) == state(slow), scale
        assert fast.scale <= scale + 1  # the boundaries' scale or next to it was the one used


def test_where_numpys_log2_and_math_log2_part_samples_are_placed_by_math_log2() -> None:
    """Samples next to scale-20 boundaries near 1, where numpy's log2 (its SIMD code) and
    math.log2 round to different sides of the boundary, are bucketed as math.log2 places
    them. (Where numpy's log2 is the C library's, no sample parts them: skipped.)"""
    np = _vectorized.import_numpy()
    assert np is not None
    factor = 2.0**20
    indices = np.arange(-(1 << 17), 1 << 17)
    bounds = np.exp2(indices / factor)
    candidates = np.concatenate([bounds, np.nextafter(bounds, 0), np.nextafter(bounds, 2)])
    theirs = np.ceil(np.log2(candidates) * factor).tolist()
    parted = [
        v
        for v, key in zip(candidates.tolist(), theirs, strict=True)
        if math.ceil(math.log2(v) * factor) != key
    ]
    if not parted:
        pytest.skip("numpy's log2 agrees with math.log2 next to every boundary here")
    for v in parted:
        with numpy_for_any_chunk():
            fast = counted([[v, v, -v]], 2048)  # at scale 20: one bucket a sign
        with _vectorized.pure_python():
            slow = counted([[v, v, -v]], 2048)
        assert fast.scale == 20
        assert state(fast) == state(slow), v


def test_powers_of_two_are_the_upper_bound_of_their_bucket() -> None:
    """2**e is in bucket (e << scale) - 1 through numpy too, for every normal exponent."""
    exponents = list(range(-1022, 1024))
    samples = [2.0**e for e in exponents]
    acc = counted([samples], 1 << 16)
    offset, counts = acc.buckets()[0]
    held = {offset + i for i, n in enumerate(counts) if n}
    assert held == {((e << 20) - 1) >> (20 - acc.scale) for e in exponents}


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 2.0**-60, 3.0],  # narrow enough for the one-sum pass
        [1e-300, 1e300, -1e300, 3.0],  # wide: summed per exponent
        [TOP, TOP, -TOP, SMALLEST_NORMAL],  # past the float range on the way
        [0.1] * 5000,  # many of one value
        [-0.0, 0.0, 5e-324, -5e-324],  # zeros and subnormals
    ],
    ids=["narrow", "wide", "huge", "many", "tiny"],
)
def test_exact_units_is_the_rational_sum(values: list[float]) -> None:
    """exact_units is the exact sum in 2**-1074 units, by either of its passes."""
    np = _vectorized.import_numpy()
    assert np is not None
    array = np.array(values)
    magnitudes = np.abs(array)
    grain = _vectorized.grain_of(_vectorized.smallest_nonzero(magnitudes))
    exact = sum(map(Fraction, values), Fraction(0)) * 2**1074
    assert exact.denominator == 1
    assert _vectorized.exact_units(array, grain, float(magnitudes.max())) == exact.numerator


def moments_agree(values: list[float], shift: float) -> None:
    array = _vectorized.array(values)
    assert array is not None
    n, shift_fast, mean_fast, sd_fast = _chunk_moments(values, shift, array)
    with _vectorized.pure_python():
        assert (n, shift_fast, mean_fast) == _chunk_moments(values, shift)[:3]
        sd_slow = _chunk_moments(values, shift)[3]
    # numpy's pairwise sum of 4096 squares is within ~24 roundings of theirs, halved by the
    # root; math.dist's within one.
    assert sd_fast == pytest.approx(sd_slow, rel=1e-14, abs=0.0)


@pytest.mark.parametrize(
    ("center", "spread"),
    [(0.0, 1.0), (1e9, 1.0), (-3e12, 1e-3), (0.1, 0.04), (1e-300, 1e-301), (1e250, 1e249)],
)
def test_moments_mean_is_the_pure_paths_and_stddev_within_its_bound(
    center: float, spread: float
) -> None:
    """numpy's chunk moments: the same mean as the pure path's (math.fsum's, correctly
    rounded), and a standard deviation within 1e-14 of it, for samples near zero, far from
    it, tiny and huge."""
    rng = random.Random(int(center) % 1000)
    values = [center + rng.gauss(0, spread) for _ in range(_window._CHUNK)]
    for shift in (values[0], center, values[17] * 3):
        moments_agree(values, shift)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.one_of(_normal, _normal.map(lambda v: -v), st.just(0.0), st.just(-0.0)),
        min_size=2,
        max_size=50,
    ),
    pick=st.integers(min_value=0),
)
def test_moments_agree_for_any_finite_samples(values: list[float], pick: int) -> None:
    """For any normal samples and zeros, and a shift among them, the mean is the pure path's
    and the standard deviation within 1e-14 of it; samples too wide for the numpy path
    (offsets that may pass 2**1000) are left to the pure one."""
    shift = values[pick % len(values)]
    with numpy_for_any_chunk():
        array = _vectorized.array(values)
        assert array is not None
        if _vectorized.chunk_moments(array, shift) is None:
            assert max(map(abs, values)) + abs(shift) >= 2.0**1000
            return
        moments_agree(values, shift)


@pytest.mark.parametrize(
    "values",
    [[1.0, math.nan] * 200, [1.0, math.inf] * 200, [1.0, 5e-324] * 200, [2.0] * 10],
    ids=["nan", "inf", "subnormal", "few"],
)
def test_numpy_leaves_a_chunk_it_cannot_take_whole_to_the_pure_path(values: list[float]) -> None:
    """A chunk with a NaN, an infinity or a subnormal sample, or fewer than MIN_CHUNK samples,
    is not taken (the pure path counts it)."""
    assert _vectorized.array(values) is None


def test_without_numpy_histograms_are_counted_in_pure_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where numpy is not importable, nothing is taken by numpy and Histogram.of counts the
    same buckets."""
    samples = [random.Random(1).lognormvariate(0, 2) for _ in range(5000)]
    expected = Histogram.of(samples)
    monkeypatch.setitem(sys.modules, "numpy", None)  # unimportable
    monkeypatch.setattr(_vectorized, "_numpy", None)
    monkeypatch.setattr(_vectorized, "_tried", False)
    assert _vectorized.import_numpy() is None
    assert _vectorized.array(samples) is None
    assert Histogram.of(samples) == expected


def test_a_stats_window_is_the_same_through_numpy(bus: EventBus, clock: StepClock) -> None:
    """A window of several chunks of both signs and zeros reports the same Histogram, MEAN
    and percentiles through numpy as in pure Python, and a STDDEV within 1e-14; numpy's
    chunks are folded as they come (none waits for the dispatcher)."""
    rng = random.Random(5)
    samples = [
        rng.choice((-1.0, 0.0, 1.0, 1.0)) * rng.lognormvariate(-2, 3)
        for _ in range(3 * _window._CHUNK + 9)
    ]
    every = [Aggregation.MEAN, Aggregation.P50, Aggregation.P99, Aggregation.STDDEV]
    results = []
    for path in ("numpy", "pure"):
        with _vectorized.pure_python() if path == "pure" else numpy_for_any_chunk():
            stat = Stat("x", [*every, Aggregation.HISTOGRAM], timedelta(seconds=600), bus=bus)
            for i, v in enumerate(samples):
                stat.add(v)
                if path == "numpy" and i == 2 * _window._CHUNK:
                    assert not stat._dist_chunks
            clock.now += 600
            results.append(stat.get())
    fast, slow = results
    sd_fast, sd_slow = fast.pop(Aggregation.STDDEV), slow.pop(Aggregation.STDDEV)
    assert fast == slow
    assert fast[Aggregation.HISTOGRAM] == Histogram.of(samples)
    assert sd_fast == pytest.approx(sd_slow, rel=1e-14, abs=0.0)


def test_import_monitor_bus_does_not_import_numpy() -> None:
    """numpy is imported by the first chunk numpy could take, never by the package."""
    import subprocess

    code = (
        "import sys, monitor_bus\n"
        "from datetime import timedelta\n"
        "s = monitor_bus.Stat('x', [monitor_bus.Aggregation.P50], timedelta(seconds=60))\n"
        "for v in range(100): s.add(float(v))\n"
        "s._close()\n"
        "print('numpy' in sys.modules)\n"
        "monitor_bus.Histogram.of([float(v) for v in range(300)])\n"
        "print('numpy' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.split() == ["False", "True"]


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_min_chunk_is_where_numpy_starts(extra: int) -> None:
    """A chunk of MIN_CHUNK samples or more is taken, one fewer is not."""
    size = _vectorized.MIN_CHUNK + extra
    assert (_vectorized.array([1.5] * size) is not None) == (extra >= 0)
