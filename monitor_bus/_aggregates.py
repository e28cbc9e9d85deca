"""The aggregates a Stat reports, and the arithmetic that computes them from a window's samples.

``Aggregation`` names them; ``_fold`` folds a chunk of samples into SUM, MAX, MIN and the
scaled sum MEAN falls back on; ``merge_moments`` and ``distribution`` give STDDEV, the
percentiles and HISTOGRAM, for one window or for windows merged across processes. These are
pure functions of their arguments: no lock, no clock, no bus.

The numbers' edges (an overflowing sum, a NaN) are handled once per fold, never per add
(``_fold``). A window's Histogram counts at most 2 x 2048 buckets.
"""

from __future__ import annotations

import enum
import math
import operator
from functools import reduce
from itertools import chain, repeat
from typing import TYPE_CHECKING, Union

from . import _vectorized
from ._buckets import Accumulator
from ._histogram import Histogram, from_accumulator

if TYPE_CHECKING:
    from fractions import Fraction

    from ._window import WindowFold

AggregateValue = Union[float, int, Histogram]  # noqa: UP007 - a runtime alias
"""What a window reports per aggregation: a float, COUNT's int or HISTOGRAM's Histogram."""

Moments = tuple[int, float, float, float]
"""``(n, shift, mean, sd)`` of some samples: their mean is ``shift + mean`` (``shift`` is a
sample, so ``mean`` keeps its low digits for samples far from zero; 0.0 for samples spread
wider than the float range) and ``sd`` is their population standard deviation (a root, not a
sum of squares, so it is finite for any finite samples); NaN once a sample is infinite or
NaN."""
_NO_MOMENTS: Moments = (0, 0.0, 0.0, 0.0)


class Aggregation(enum.Enum):
    """What a ``Stat`` reports for each window."""

    #: The last value added.
    VALUE = 1
    #: The arithmetic mean of the values added.
    MEAN = 2
    #: How many values were added (an ``int``).
    COUNT = 3
    #: The sum of the values added.
    SUM = 4
    #: The largest value added.
    MAX = 5
    #: The smallest value added.
    MIN = 6
    #: The median of the values added, from the window's ``Histogram`` (within 0.54% for
    #: values spanning up to 32 octaves).
    P50 = 7
    #: The 90th percentile, from the window's ``Histogram``.
    P90 = 8
    #: The 95th percentile, from the window's ``Histogram``.
    P95 = 9
    #: The 99th percentile, from the window's ``Histogram``.
    P99 = 10
    #: The population standard deviation of the values added, computed stably.
    STDDEV = 11
    #: The window's values as a ``monitor_bus.Histogram``, which merges exactly.
    HISTOGRAM = 12


# The aggregations read from a window's Histogram, with their quantiles.
_QUANTILES = {
    Aggregation.P50: 0.5,
    Aggregation.P90: 0.9,
    Aggregation.P95: 0.95,
    Aggregation.P99: 0.99,
}
_DISTRIBUTION = frozenset((*_QUANTILES, Aggregation.STDDEV, Aggregation.HISTOGRAM))

# The sum scaled by this once it overflows: the scaled sum of 2**63 samples of at most
# sys.float_info.max stays finite, and a power of two scales without rounding.
_SCALE = 2.0**-64

_Aggregates = tuple[float, float, float, float | None]


def _fold(
    values: list[float],
    before: int,
    aggregates: _Aggregates,
    wanted: tuple[bool, bool, bool],
) -> _Aggregates:
    """``(sum, max, min, scaled)`` of ``before`` samples and ``values``, for the aggregates
    wanted.

    SUM is sequential float addition, as torch's. ``scaled`` is None until the sum overflows
    from finite samples; from then on it is the sum times ``_SCALE`` (each chunk added with
    ``math.fsum``), from which MEAN is computed (``_mean``): a window of two 1e308 has SUM inf
    and MEAN 1e308. A NaN makes MAX and MIN NaN, wherever it is among the samples (Python's
    ``max`` keeps a NaN only if it comes first); SUM and MEAN are NaN then too. The checks run
    once per chunk, and their slow paths only for a chunk whose sum is not finite.
    """
    total, high, low, scaled = aggregates
    if not values:
        return aggregates
    want_sum, want_max, want_min = wanted
    probe = 0.0  # a NaN among values makes it NaN
    if want_sum:
        previous = total
        total = reduce(operator.add, values, total)
        if not math.isfinite(total):  # overflow, an infinity or a NaN: rare
            probe = total
            if scaled is not None:
                scaled = _scaled_sum(scaled, values)
            elif math.isfinite(previous) and math.isinf(total) and _all_finite(values):
                # An overflow, not an infinite sample: MEAN goes on from the scaled sum.
                scaled = _scaled_sum(previous * _SCALE, values)
    if not (want_max or want_min):
        return total, high, low, scaled
    if not want_sum:
        probe = sum(values)  # a C loop over floats, cheaper than a NaN test per sample
    if probe != probe and any(map(math.isnan, values)):
        # NaN from now on: with ``before`` samples it comes first below, and max keeps it.
        return total, math.nan, math.nan, scaled
    if want_max:
        high = max(chain((high,), values)) if before else max(values)
    if want_min:
        low = min(chain((low,), values)) if before else min(values)
    return total, high, low, scaled


def _all_finite(values: list[float]) -> bool:
    return all(map(math.isfinite, values))


def _scaled_sum(start: float, values: list[float]) -> float:
    """``start`` plus the scaled ``values``, correctly rounded (a chunk of an overflowed
    window: rare, so the exact sum)."""
    try:
        return math.fsum(chain((start,), map(_SCALE.__mul__, values)))
    except ValueError:  # inf - inf
        return math.nan


def _mean(total: float, scaled: float | None, count: int) -> float:
    """MEAN of a window: from the scaled sum once the sum overflowed."""
    if scaled is None:
        return total / count
    return scaled / count / _SCALE


# -- distributions: STDDEV's moments and the percentiles' Histogram --


def merge_moments(a: Moments, b: Moments) -> Moments:
    """The moments of two sets of samples together (Chan et al.'s pairwise update): no
    large sums are subtracted, so samples far from zero (1e9 + noise) keep their precision,
    and the deviations are combined as roots (``math.hypot``), so huge ones do not overflow.

    Args:
        a: the moments of some samples.
        b: the moments of others.

    Returns:
        The moments of both.
    """
    na, shift_a, mean_a, sd_a = a
    nb, shift_b, mean_b, sd_b = b
    if not na:
        return b
    if not nb:
        return a
    n = na + nb
    wa, wb = na / n, nb / n
    delta = (shift_b - shift_a) + (mean_b - mean_a)  # shifts are close samples: exact
    mean = mean_a + delta * wb
    sd = math.hypot(math.sqrt(wa) * sd_a, math.sqrt(wb) * sd_b, math.sqrt(wa * wb) * delta)
    if mean - mean == 0 and sd - sd == 0:  # both finite: the common case
        return (n, shift_a, mean, sd)
    if not all(map(math.isfinite, (shift_a, mean_a, sd_a, shift_b, mean_b, sd_b))):
        return (n, shift_a, mean, math.nan)  # an infinite or NaN sample: its mean stands
    # Finite samples spread near the float range's ends: rare, so exactly.
    from fractions import Fraction

    exact_a = Fraction(shift_a) + Fraction(mean_a)
    exact_b = Fraction(shift_b) + Fraction(mean_b)
    total = (na * exact_a + nb * exact_b) / n
    dev_a, dev_b = Fraction(sd_a), Fraction(sd_b)
    gap_a, gap_b = exact_a - total, exact_b - total
    squares = na * (dev_a * dev_a + gap_a * gap_a) + nb * (dev_b * dev_b + gap_b * gap_b)
    return _exact(n, shift_a, total, squares / n)


def stddev(moments: Moments) -> float:
    """The population standard deviation of samples with these moments (NaN for none, and
    when a sample was NaN or infinite)."""
    n, _, _, sd = moments
    return sd if n else math.nan


def _chunk_moments(
    values: list[float], shift: float, array: _vectorized.Floats | None = None
) -> Moments:
    """The moments of a chunk about ``shift``, with C builtins: the samples' distances from
    ``shift`` (exact for samples within a factor 2 of it), their mean correctly rounded
    (``math.fsum``), then the root of their squared deviations from it (``math.dist``,
    without overflow or cancellation) over the root of their number. The same in numpy for
    a chunk ``_vectorized`` takes (``array``)."""
    n = len(values)
    if array is not None:
        found = _vectorized.chunk_moments(array, shift)
        if found is not None:
            return (n, shift, *found)
    offsets = list(map(operator.sub, values, repeat(shift)))
    try:
        mean = math.fsum(offsets) / n
    except OverflowError:  # an intermediate sum past the float range
        mean = _scaled_sum(0.0, offsets) / n / _SCALE
    except ValueError:  # inf - inf
        mean = math.nan
    if mean - mean != 0:  # an infinite or NaN sample, or an offset past the float range
        if not _all_finite(values):
            return (n, shift, mean, math.nan)
        return _exact_moments(values, shift)
    sd = math.dist(offsets, [mean] * n) / math.sqrt(n)
    if sd == math.inf:  # a deviation past the float range, of finite samples
        return _exact_moments(values, shift)
    return (n, shift, mean, sd)


def _exact_moments(values: list[float], shift: float) -> Moments:
    """The moments of finite samples whose deviations pass the float range (samples near its
    ends, of both signs), in fractions: rare, so exact rather than fast."""
    from fractions import Fraction

    exact = list(map(Fraction, values))
    n = len(exact)
    mean = sum(exact, Fraction(0)) / n
    return _exact(n, shift, mean, sum(((v - mean) * (v - mean) for v in exact), Fraction(0)) / n)


def _exact(n: int, shift: float, mean: Fraction, variance: Fraction) -> Moments:
    """Moments from an exact mean and variance: the mean about ``shift`` if a float holds
    that offset, otherwise about 0.0; the root of the variance to within an ulp."""
    from fractions import Fraction

    try:
        offset = float(mean - Fraction(shift))  # a Fraction minus a float is a float
    except OverflowError:  # the samples span more than the float range
        shift, offset = 0.0, float(mean)
    p, q = variance.numerator, variance.denominator
    # The root of p / q scaled by 2**k to at least 60 bits, by integer square root.
    k = max(0, (121 - p.bit_length() + q.bit_length()) // 2)
    return (n, shift, offset, math.ldexp(float(math.isqrt((p << 2 * k) // q)), -k))


def _fold_distribution(
    values: list[float],
    moments: Moments,
    hist: Accumulator | None,
    stat: WindowFold,
    array: _vectorized.Floats | None = None,
) -> tuple[Moments, Accumulator | None]:
    """A window's moments and Histogram with ``values`` added, for those ``stat`` wants
    (the Histogram's counts grow in place); in numpy where ``_vectorized`` takes them
    (``array``, if the caller made it already)."""
    if not values:
        return moments, hist
    if array is None:
        array = _vectorized.array(values)  # None: the pure-Python path
    if stat._want_moments:
        # One shift per window (its first sample), so its chunks' means differ exactly.
        shift = moments[1] if moments[0] else values[0]
        moments = merge_moments(moments, _chunk_moments(values, shift, array))
    if stat._want_hist:
        if hist is None:
            hist = Accumulator(_MAX_BUCKETS)
        hist.add(values, array)
    return moments, hist


# Buckets per sign of a window's Histogram: scale 6 (percentiles within 0.54%) for values
# spanning up to 32 octaves; the open window's Histogram holds at most twice this many counts.
_MAX_BUCKETS = 2048


def distribution(moments: Moments, hist: Histogram | None) -> tuple[AggregateValue, ...]:
    """P50, P90, P95, P99, STDDEV and HISTOGRAM of a window (or of merged windows) from its
    moments and Histogram, in ``Aggregation`` order (``picked`` positions 6 to 11).

    Args:
        moments: the samples' ``Moments`` (``_NO_MOMENTS`` if STDDEV is not reported).
        hist: the samples' Histogram, or None if no percentile or HISTOGRAM is reported.

    Returns:
        The six values; NaN percentiles and an empty Histogram without ``hist``.
    """
    if hist is None:
        quantiles = (math.nan,) * len(_QUANTILES)
    else:
        quantiles = tuple(hist.quantile(q) for q in _QUANTILES.values())
    return (*quantiles, stddev(moments), hist if hist is not None else Histogram())


def _histogram_of(accumulator: Accumulator | None) -> Histogram | None:
    return None if accumulator is None else from_accumulator(accumulator)
