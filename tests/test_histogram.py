"""Histogram: OpenTelemetry's bucket layout, the quantile bound, coarsening, exact merging, the
non-numbers, encodings and argument checks."""

from __future__ import annotations

import json
import math
import pickle
import random
import sys
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import monitor_bus
from monitor_bus import Histogram

from .conftest import require

QUANTILES = [i / 100 for i in range(101)]


def true_quantiles(samples: list[float]) -> list[tuple[float, float]]:
    """``(q, the nearest-rank q quantile)`` for QUANTILES, as numpy computes them."""
    values = np.quantile(np.array(samples), QUANTILES, method="inverted_cdf")
    return list(zip(QUANTILES, map(float, values), strict=True))


def bound(scale: int) -> float:
    """The largest relative error of a quantile at ``scale`` (a hair over, for rounding)."""
    r = 2.0 ** (2.0**-scale)
    return (r - 1) / (r + 1) * (1 + 1e-9)


def otel_mapping(scale: int) -> Any:
    try:
        from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping import (
            exponent_mapping,
            logarithm_mapping,
        )
    except ImportError:
        require(False, "opentelemetry-sdk is not installed")
    if scale > 0:
        return logarithm_mapping.LogarithmMapping(scale)
    return exponent_mapping.ExponentMapping(scale)


def test_exported() -> None:
    """Histogram is public and reports the public module."""
    assert "Histogram" in monitor_bus.__all__
    assert monitor_bus.Histogram.__module__ == "monitor_bus"


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_powers_of_two_are_their_buckets_upper_bound(sign: float) -> None:
    """2**e lands in bucket (e << scale) - 1, whose upper bound is 2**e, for every float
    exponent, subnormals included."""
    for e in range(-1074, 1024):
        h = Histogram.of([sign * 2.0**e])
        assert h.scale == 20
        offset = h.positive_offset if sign > 0 else h.negative_offset
        assert offset == (e << 20) - 1, e
        ((low, high, n),) = h.buckets()
        assert n == 1
        assert (high if sign > 0 else low) == sign * 2.0**e


def test_indices_agree_with_opentelemetry_mapping() -> None:
    """At every scale, a sample's bucket is the one OpenTelemetry's SDK maps it to (normal
    floats from 2**-1000 to 2**1000, and the powers of two among them)."""
    rng = random.Random(22)
    values = [2.0 ** rng.uniform(-1000, 1000) for _ in range(2000)]
    values += [2.0**e for e in range(-1000, 1001, 7)]
    for scale in (-10, -3, 0, 1, 6, 12, 20):
        mapping = otel_mapping(scale)
        for v in values:
            ours = Histogram.of([v]).positive_offset >> (20 - scale)
            assert ours == mapping.map_to_index(v), (scale, v)


def test_quantiles_within_one_percent_over_32_octaves() -> None:
    """Samples spanning 32 octaves ((1, 2**32], both signs) keep scale 6 and every
    percentile is within 1% of the true one."""
    rng = random.Random(6)
    magnitudes = [2.0 ** rng.uniform(0, 32) for _ in range(20000)] + [2.0**32, 1.0000001]
    for samples in (magnitudes, [-v for v in magnitudes], magnitudes + [-v for v in magnitudes]):
        h = Histogram.of(samples)
        assert h.scale == 6
        for q, true in true_quantiles(samples):
            assert abs(h.quantile(q) - true) <= 0.01 * abs(true), q


def test_quantile_ends_are_min_and_max_and_ranks_are_nearest() -> None:
    """quantile(0) is min, quantile(1) is max, and the others are their nearest-rank sample
    within the bucket's bound ((r - 1) / (r + 1), r the bucket's width ratio)."""
    samples = [3.0, 1.0, 2.0, 4.0, 100.0]
    h = Histogram.of(samples)
    assert h.quantile(0) == 1.0
    assert h.quantile(1) == 100.0
    assert h.scale == 8  # 1..100: 1702 buckets of 1/256 octave
    for q, true in true_quantiles(samples):
        assert abs(h.quantile(q) - true) <= bound(8) * true


def test_coarsens_past_max_buckets_as_opentelemetry_sdk() -> None:
    """Wider data than max_buckets holds gets the scale, offset and counts OpenTelemetry's
    SDK aggregator gives the same samples."""
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
    except ImportError:
        require(False, "opentelemetry-sdk is not installed")
    rng = random.Random(7)
    samples = [2.0 ** rng.uniform(-40, 40) for _ in range(3000)]
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader],
        views=[View(instrument_name="h", aggregation=ExponentialBucketHistogramAggregation(160))],
    )
    instrument = provider.get_meter("test").create_histogram("h")
    for v in samples:
        instrument.record(v)
    data = reader.get_metrics_data()
    provider.shutdown()
    (point,) = data.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    h = Histogram.of(samples, max_buckets=160)
    assert h.scale == point.scale < 20
    assert h.positive_offset == point.positive.offset
    assert h.positive_counts == tuple(point.positive.bucket_counts)
    assert (h.count, h.min, h.max) == (point.count, point.min, point.max)
    assert math.isclose(h.sum, point.sum, rel_tol=1e-12)
    # Each scale lower doubles the bucket width: the quantile bound follows.
    for q, true in true_quantiles(samples):
        assert abs(h.quantile(q) - true) <= bound(h.scale) * true


def test_zero_negative_nan_and_infinities() -> None:
    """Zeros (-0.0 too) count as zeros, negatives by magnitude, NaN only in count and
    nan_count, infinities in count, min/max, the sum and the end quantiles; nothing raises."""
    h = Histogram.of([0.0, -0.0, -4.0, 2.0, math.nan, math.inf, -math.inf, math.inf])
    assert h.count == 8
    assert (h.zero_count, h.nan_count, h.inf_count, h.neg_inf_count) == (2, 1, 2, 1)
    assert h.negative_counts == (1,)
    assert h.negative_offset == (2 << 20) - 1
    assert h.positive_counts == (1,)
    assert h.positive_offset == (1 << 20) - 1
    assert (h.min, h.max) == (-math.inf, math.inf)
    assert math.isnan(h.sum)  # +inf and -inf
    assert h.quantile(0) == -math.inf
    assert h.quantile(1) == math.inf
    assert math.isclose(h.quantile(2 / 7), -4.0, rel_tol=bound(20))  # 7 non-NaN: rank 2
    assert h.quantile(3 / 7) == 0.0
    assert math.isclose(h.quantile(5 / 7), 2.0, rel_tol=bound(20))
    assert h.buckets() == [
        (-math.inf, -math.inf, 1),
        (-4.0, -(2.0 ** (1 - 2**-20)) * 2, 1),
        (0.0, 0.0, 2),
        (2.0 ** (1 - 2**-20), 2.0, 1),
        (math.inf, math.inf, 2),
    ]
    assert Histogram.of([math.inf, 1.0]).sum == math.inf
    assert Histogram.of([-math.inf, 1.0]).sum == -math.inf
    only_nan = Histogram.of([math.nan])
    assert (only_nan.count, only_nan.nan_count, only_nan.sum) == (1, 1, 0.0)
    assert math.isnan(only_nan.min)
    assert math.isnan(only_nan.max)
    assert math.isnan(only_nan.quantile(0.5))
    empty = Histogram.of([])
    assert (empty.count, empty.sum, empty.buckets()) == (0, 0.0, [])
    assert math.isnan(empty.quantile(0.99))
    assert empty == Histogram()


def test_sum_is_exact_whatever_the_order() -> None:
    """The sum is the correctly rounded exact sum, so no order of the samples changes it
    (sequential float addition gives 0.0 or 2.0 here)."""
    samples = [1e16, 1.0, -1e16, 1.0, 1e-300]
    assert Histogram.of(samples).sum == 2.0
    assert Histogram.of(samples).exact_sum == Histogram.of(samples[::-1]).exact_sum
    assert Histogram.of([1e308, 1e308]).sum == math.inf  # past the float range
    big = Histogram.of([1e308, 1e308]).merge(Histogram.of([-1e308]))
    assert big.sum == 1e308


def test_merge_leaves_both_sides_and_takes_the_coarser_scale() -> None:
    """merge returns a new Histogram at the coarser of two scales; neither side changes."""
    fine = Histogram.of([1.0, 1.5])
    coarse = Histogram.of([2.0**rng for rng in range(-60, 60)])
    before = (fine.to_dict(), coarse.to_dict())
    merged = fine.merge(coarse)
    assert (fine.to_dict(), coarse.to_dict()) == before
    assert merged.scale == coarse.scale < fine.scale
    assert merged.count == 122
    assert merged == Histogram.of([1.0, 1.5] + [2.0**i for i in range(-60, 60)])


def test_to_dict_round_trip_is_json() -> None:
    """to_dict is plain JSON (non-finite floats as the JSONL sink writes them) and from_dict
    restores an equal Histogram."""
    for samples in (
        [],
        [0.1, 0.2, -3.0, 0.0],
        [math.nan, math.inf, 5.0],
        [-math.inf],
        [1e308, 1e308, 1e-320],
    ):
        h = Histogram.of(samples, max_buckets=64)
        d = h.to_dict()
        text = json.dumps(d, allow_nan=False)
        back = Histogram.from_dict(json.loads(text))
        assert back == h
        assert back.to_dict() == d
    assert Histogram.of([math.inf]).to_dict()["sum"] == {"$float": "Infinity"}
    assert Histogram.of([]).to_dict()["min"] == {"$float": "NaN"}


def test_pickles() -> None:
    """A Histogram pickles to an equal one (every protocol)."""
    h = Histogram.of([0.5, -2.0, 0.0, math.nan, 1e9])
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(h, protocol)) == h


def test_constructor_rebuilds_and_checks_fields() -> None:
    """The keyword constructor takes every field (zeros at the ends dropped) and equals the
    Histogram it describes."""
    h = Histogram.of([3.0, 3.0, -1.0, 0.0])
    rebuilt = Histogram(
        scale=h.scale,
        zero_count=1,
        positive_offset=h.positive_offset - 2,
        positive_counts=(0, 0, *h.positive_counts, 0),
        negative_offset=h.negative_offset,
        negative_counts=h.negative_counts,
        count=4,
        sum=5.0,
        min=-1.0,
        max=3.0,
    )
    assert rebuilt == h
    assert rebuilt != Histogram.of([3.0, 3.0, -1.0, 0.5])
    assert (h == "histogram") is False


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scale": 21}, ValueError, "scale"),
        ({"scale": -11}, ValueError, "scale"),
        ({"scale": 1.5}, TypeError, "scale"),
        ({"zero_count": -1}, ValueError, "zero_count"),
        ({"positive_counts": [1, -1]}, ValueError, "positive_counts"),
        ({"negative_counts": "12"}, TypeError, "negative_counts"),
        ({"positive_counts": [1] * 5, "max_buckets": 4}, ValueError, "positive_counts"),
        ({"max_buckets": 2}, ValueError, "max_buckets"),
        ({"zero_count": 1, "count": 2}, ValueError, "count"),
        ({"zero_count": 1, "min": 0.0, "max": 0.0, "sum": "0"}, TypeError, "sum"),
        ({"zero_count": 2, "min": 1.0, "max": 0.0}, ValueError, "min"),
        ({"min": 1.0, "max": 1.0}, ValueError, "min and max must be NaN"),
        ({"sum": math.inf}, ValueError, "exact_sum"),
        ({"sum": 1.0, "exact_sum": (3, -1)}, ValueError, "sum must be exact_sum"),
        ({"exact_sum": (1, 5000)}, ValueError, "exact_sum"),
        ({"exact_sum": (1 << 20_000, 0)}, ValueError, r"exact_sum .*, got \(an int of 20001 bits"),
        ({"exact_sum": [1, 0]}, TypeError, "exact_sum"),
        ({"nan_count": True}, TypeError, "nan_count"),
    ],
)
def test_bad_fields_name_the_argument(kwargs: dict[str, Any], error: type, match: str) -> None:
    """A bad field raises naming it."""
    with pytest.raises(error, match=match):
        Histogram(**kwargs)


def test_bad_arguments_name_the_argument() -> None:
    """of, quantile, merge and from_dict reject bad arguments, naming them."""
    with pytest.raises(TypeError, match="values"):
        Histogram.of(["x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="values"):
        Histogram.of(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_buckets"):
        Histogram.of([1.0], max_buckets=0)
    h = Histogram.of([1.0])
    with pytest.raises(ValueError, match="q must be from 0 to 1"):
        h.quantile(1.5)
    with pytest.raises(ValueError, match="q must be from 0 to 1"):
        h.quantile(math.nan)
    with pytest.raises(TypeError, match="q must be"):
        h.quantile("0.5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="other"):
        h.merge([1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="d must be a dict"):
        Histogram.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown Histogram fields"):
        Histogram.from_dict({**h.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="min must be a float"):
        Histogram.from_dict({**h.to_dict(), "min": {"$float": "nan"}})


# Floats of every kind a sample can be, bounded so the property test runs in a few seconds.
_samples = st.lists(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=1e-3, max_value=1e3),
        st.integers(min_value=-(10**6), max_value=10**6).map(float),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(samples=_samples, split=st.integers(min_value=0), order=st.randoms(use_true_random=False))
def test_merge_is_exact_for_any_split_and_order(
    samples: list[float], split: int, order: random.Random
) -> None:
    """a.merge(b) == b.merge(a) == Histogram.of(all), whatever the split and the order."""
    shuffled = samples[:]
    order.shuffle(shuffled)
    cut = split % (len(shuffled) + 1)
    for max_buckets in (2048, 8):
        a = Histogram.of(shuffled[:cut], max_buckets=max_buckets)
        b = Histogram.of(shuffled[cut:], max_buckets=max_buckets)
        whole = Histogram.of(samples, max_buckets=max_buckets)
        assert a.merge(b) == whole
        assert b.merge(a) == whole
        assert a.merge(b).sum == whole.sum or math.isnan(whole.sum)


def test_exact_sum_is_the_rational_sum() -> None:
    """exact_sum is the exact rational sum of the finite samples, for data that needs many
    fsum passes (magnitudes 1e-300 to 1e300) and data past the float range, and sum is it
    correctly rounded."""
    rng = random.Random(5)
    wide = [rng.choice((-1, 1)) * 10.0 ** rng.uniform(-300, 300) for _ in range(500)]
    huge = [1.7e308] * 5 + [-1e308, 3.0]
    for samples in (wide, huge, [0.1] * 10):
        h = Histogram.of(samples)
        m, e = h.exact_sum
        assert Fraction(m) * Fraction(2) ** e == sum(map(Fraction, samples))
        assert h.sum == (math.fsum(samples) if samples is not huge else math.inf)


# The smallest and largest float magnitudes (a subnormal, the float maximum).
TINY = 5e-324
HUGE = sys.float_info.max


def index_range(scale: int) -> tuple[int, int]:
    """The buckets of the smallest and the largest float magnitude at ``scale``, from the
    scale-20 buckets ``of`` gives them."""
    shift = 20 - scale
    return (
        Histogram.of([TINY]).positive_offset >> shift,
        Histogram.of([HUGE]).positive_offset >> shift,
    )


def one_sample(scale: int, offset: int, *, negative: bool = False) -> Histogram:
    """A Histogram of one sample of 1.0 counted in bucket ``offset`` at ``scale``."""
    sign = "negative" if negative else "positive"
    value = -1.0 if negative else 1.0
    fields = {f"{sign}_offset": offset, f"{sign}_counts": [1]}
    return Histogram(scale=scale, sum=value, min=value, max=value, **fields)


def test_offsets_past_the_floats_are_refused_so_a_merge_keeps_scale_minus_10() -> None:
    """Buckets past those of any float, whose merge once reached scale -33 (which neither its
    pickle nor from_dict could rebuild), are refused naming the field; the widest merge of
    real samples, the smallest float with the largest at 3 buckets, stays at scale -10 and
    round trips."""
    with pytest.raises(ValueError, match=r"^positive_offset must be from -2 to 0 at scale -10"):
        one_sample(-10, 1 << 33)
    with pytest.raises(ValueError, match=r"^negative_offset must be from -2 to 0 at scale -10"):
        one_sample(-10, -(1 << 33), negative=True)
    a = Histogram.of([TINY, -HUGE], max_buckets=3)
    b = Histogram.of([HUGE, -TINY, 1.0], max_buckets=3)
    merged = a.merge(b)
    assert merged == Histogram.of([TINY, -HUGE, HUGE, -TINY, 1.0], max_buckets=3)
    assert (merged.scale, merged.positive_offset, merged.negative_offset) == (-10, -2, -2)
    assert merged.positive_counts == (1, 1, 1)  # 1.0 is the upper bound of bucket -1
    assert merged.negative_counts == (1, 0, 1)
    assert pickle.loads(pickle.dumps(merged)) == merged
    assert Histogram.from_dict(json.loads(json.dumps(merged.to_dict()))) == merged


@pytest.mark.parametrize("scale", range(-10, 21))
def test_round_trips_at_the_ends_of_the_index_range(scale: int) -> None:
    """At every scale, buckets at the lowest and the highest index of a float round trip
    through pickle and to_dict; one bucket past either end is refused naming the field."""
    low, high = index_range(scale)
    ends = Histogram(
        scale=scale,
        positive_offset=low,
        positive_counts=[1],
        negative_offset=high,
        negative_counts=[1],
        sum=0.0,
        min=-1.0,
        max=1.0,
    )
    for h in (one_sample(scale, low), one_sample(scale, high, negative=True), ends):
        assert pickle.loads(pickle.dumps(h)) == h
        assert Histogram.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    with pytest.raises(ValueError, match=rf"^positive_offset must be from {low} to {high} at"):
        one_sample(scale, low - 1)
    with pytest.raises(ValueError, match=rf"^negative_offset must be from {low} to {high} at"):
        one_sample(scale, high + 1, negative=True)
    with pytest.raises(ValueError, match=rf"^positive_counts reach bucket {high + 1}, past {high}"):
        Histogram(
            scale=scale, positive_offset=high, positive_counts=[1, 1], sum=2.0, min=1.0, max=1.0
        )


class CountedReads:
    """An iterable of ``n`` counts of 1 that records how many were read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read = 0

    def __iter__(self) -> Any:
        for _ in range(self.n):
            self.read += 1
            yield 1


def test_a_huge_offset_is_refused_before_any_work() -> None:
    """A pickled Histogram whose offset is a 33 KB int (merging it once took seconds, in steps
    quadratic in the offset's digits) is refused naming positive_offset, by its size, without
    printing it; from_dict refuses it before reading a single count."""
    huge = 1 << (8 * 33_000)
    state = {**Histogram.of([1.0] * 2048).to_dict(), "positive_offset": huge}
    blob = pickle.dumps(_Forged(state))
    assert len(blob) > 33_000
    with pytest.raises(ValueError, match=r"^positive_offset must be from .* an int of 264001 bits"):
        pickle.loads(blob)
    counts = CountedReads(2048)
    with pytest.raises(ValueError, match=r"^positive_offset must be from"):
        Histogram.from_dict({**state, "positive_counts": counts})
    assert counts.read == 0


class _Forged:
    """Pickles as a Histogram with the given state (as a crafted message would carry)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def __reduce__(self) -> Any:
        return (object.__new__, (Histogram,), self.state)


def test_max_buckets_is_bounded_so_a_merge_is_linear() -> None:
    """max_buckets is at most 65,536, so a merge, whose result holds up to max_buckets
    buckets per sign, is bounded by that (with 2**40 a merge of two one-sample Histograms,
    the smallest float and the largest, built a tuple of 2 * 10**9 buckets)."""
    with pytest.raises(ValueError, match=r"^max_buckets must be from 3 to 65536, got 65537"):
        Histogram.of([1.0], max_buckets=65_537)
    with pytest.raises(
        ValueError, match=r"^max_buckets must be from 3 to 65536, got 1099511627776"
    ):
        Histogram(max_buckets=1 << 40)
    widest = Histogram.of([TINY], max_buckets=65_536).merge(
        Histogram.of([HUGE], max_buckets=65_536)
    )
    assert len(widest.positive_counts) <= 65_536
    assert widest == Histogram.of([TINY, HUGE], max_buckets=65_536)


def test_an_int_past_the_float_range_is_a_type_error_naming_values() -> None:
    """of() with an int too large for a float raises the documented TypeError naming values,
    as Stat.add does for the same sample."""
    with pytest.raises(TypeError, match=r"^values must be an iterable of real numbers"):
        Histogram.of([1.0, 10**400])
    for field in ("sum", "min", "max"):
        with pytest.raises(ValueError, match=rf"^{field} must be within the float range"):
            Histogram(zero_count=1, **{"sum": 0.0, "min": 0.0, "max": 0.0, field: 10**400})
