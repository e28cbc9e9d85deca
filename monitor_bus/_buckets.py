"""Bucket arithmetic for ``Histogram``: bucket indices and bounds, coarsening, the exact sum,
and the ``Accumulator`` that counts samples chunk by chunk (its guarantees are
``Histogram``'s, in ``_histogram``). Below ``_histogram``, which imports it: the Histogram of
an Accumulator's counts is made there (``_histogram.from_accumulator``)."""

from __future__ import annotations

import math
import operator
from collections import Counter
from itertools import chain, repeat

from . import _vectorized
from ._check import wrong_type

MAX_SCALE = 20
"""The finest scale, where every Histogram starts (OpenTelemetry's SDK's default)."""
MIN_SCALE = -10
"""The coarsest scale: every float magnitude fits 3 buckets there."""
MAX_BUCKETS_LIMIT = 1 << 16
"""The most ``max_buckets`` may be: a merge's result holds up to that many buckets per sign,
however few its sides hold."""

# The exact sum is an int counting 2**-1074 (the smallest subnormal float), so every float
# sample is a whole number of them.
UNIT_EXP = 1074
# |exact sum| < 2**63 samples * 2**1024: a bound for decoded exact sums.
_MAX_EXACT_BITS = UNIT_EXP + 1024 + 64

# The buckets of the float magnitudes at MAX_SCALE: from the smallest subnormal, 2**-1074 (a
# power of two, so the upper bound of its bucket), to the largest float (its log2 rounds to
# 1024). OpenTelemetry's rule with subnormals in buckets of their own (its SDK puts them in
# the lowest normal one); at scale 20 the indices still fit OTLP's sint32 offsets.
_LOWEST = (-UNIT_EXP << MAX_SCALE) - 1
_HIGHEST = (1024 << MAX_SCALE) - 1

Buckets = tuple[int, tuple[int, ...]]
"""A sign's buckets: ``(offset, counts)``."""


class Accumulator:
    """A Histogram being built chunk by chunk (a Stat's open window, ``Histogram.of``):
    bucket counts at the finest scale its samples fit so far, counted by C builtins
    (``math.log2`` through ``map``, ``Counter.update``'s C counting) in Counters, or, for a
    chunk ``_vectorized`` takes, by numpy in ``_vectorized.DenseCounts``; the counts are the
    sum of both, and the same whichever counted them. Not
    thread-safe: its owner serialises ``add``. Not interrupt-safe in place: an exception
    inside ``add`` (a KeyboardInterrupt) can leave ``count`` disagreeing with the buckets, so
    an owner that must survive one adds to a ``copy()`` and swaps it in (``Stat`` does).

    Memory: at most ``max_buckets`` counts per sign, whatever it was given.
    """

    __slots__ = (
        "count",
        "exact",
        "high",
        "inf",
        "low",
        "max_buckets",
        "nan",
        "neg",
        "neg_dense",
        "neg_range",
        "ninf",
        "pos",
        "pos_dense",
        "pos_range",
        "scale",
        "zero",
    )

    def __init__(self, max_buckets: int) -> None:
        self.max_buckets = max_buckets
        self.scale = MAX_SCALE
        # Keys are bucket index + 1 (``ceil``, before the ``- 1``), ranges the indices held.
        self.pos: Counter[int] = Counter()
        self.neg: Counter[int] = Counter()
        self.pos_range: tuple[int, int] | None = None
        self.neg_range: tuple[int, int] | None = None
        # Counted in numpy (by index, within the ranges), added to the Counters' counts.
        self.pos_dense: _vectorized.DenseCounts | None = None
        self.neg_dense: _vectorized.DenseCounts | None = None
        self.count = self.zero = self.nan = self.inf = self.ninf = self.exact = 0
        self.low = self.high = math.nan

    def copy(self) -> Accumulator:
        """An independent copy (its Counters copied), to add to and swap in."""
        new = Accumulator.__new__(Accumulator)
        for name in Accumulator.__slots__:
            setattr(new, name, getattr(self, name))
        new.pos, new.neg = self.pos.copy(), self.neg.copy()
        if self.pos_dense is not None:
            new.pos_dense = self.pos_dense.copy()
        if self.neg_dense is not None:
            new.neg_dense = self.neg_dense.copy()
        return new

    def buckets(self) -> tuple[Buckets, Buckets]:
        """The positive and the negative buckets counted, as ``(offset, counts)``."""
        return (
            _buckets_of(self.pos, self.pos_dense, self.pos_range),
            _buckets_of(self.neg, self.neg_dense, self.neg_range),
        )

    def add(self, samples: list[float], array: _vectorized.Floats | None = None) -> None:
        """Count float ``samples``: in numpy where ``_vectorized`` takes them (``array``, their
        array if the caller made it already), with the same result.
        """
        if not samples:
            return
        if array is None:
            array = _vectorized.array(samples)
        if array is not None:
            self._add_array(samples, array)
            return
        self.count += len(samples)
        probe = sum(samples)  # a C loop: finite only if every sample is
        if probe - probe == 0:  # all finite: the common case
            finite = samples
        else:
            self.nan += sum(map(math.isnan, samples))
            inf = samples.count(math.inf)
            ninf = samples.count(-math.inf)
            self.inf += inf
            self.ninf += ninf
            if inf or ninf:
                self.exact = 0  # not observable once the sum is infinite
                self.low = nan_min(self.low, -math.inf if ninf else math.inf)
                self.high = nan_max(self.high, math.inf if inf else -math.inf)
            finite = [v for v in samples if v - v == 0]
            if not finite:
                return
        low, high = min(finite), max(finite)
        self.low, self.high = nan_min(self.low, low), nan_max(self.high, high)
        if low > 0:
            positive, negative = finite, []
            smallest = low
        else:
            positive = [v for v in finite if v > 0]
            negative = [-v for v in finite if v < 0]
            self.zero += len(finite) - len(positive) - len(negative)
            smallest = min(chain((math.inf,), positive, negative))  # inf: zeros only
        pos = (min(positive), high) if positive else None
        neg = (min(negative), max(negative)) if negative else None
        factor = self._fit(pos, neg)
        if positive:
            self.pos.update(map(math.ceil, map(operator.mul, map(math.log2, positive), factor)))
        if negative:
            self.neg.update(map(math.ceil, map(operator.mul, map(math.log2, negative), factor)))
        if not (self.inf or self.ninf) and smallest != math.inf:
            self.exact += exact_sum_of(finite, smallest)

    def _add_array(self, samples: list[float], values: _vectorized.Floats) -> None:
        """``add`` for finite samples none of which is subnormal, in numpy."""
        self.count += len(samples)
        low, high = float(values.min()), float(values.max())
        if low == 0:  # min() keeps the first of 0.0 and -0.0
            low = _vectorized.first_zero(samples, values)
        if high == 0:
            high = _vectorized.first_zero(samples, values)
        self.low, self.high = nan_min(self.low, low), nan_max(self.high, high)
        if low > 0:
            positive, negative = values, values[:0]
        else:
            positive = values[values > 0]
            negative = -values[values < 0]
            self.zero += len(samples) - len(positive) - len(negative)
        pos = (float(positive.min()), high) if len(positive) else None
        neg = (float(negative.min()), float(negative.max())) if len(negative) else None
        self._fit(pos, neg)
        factor = math.ldexp(1.0, self.scale)
        if pos is not None and self.pos_range is not None:
            indices = _vectorized.bucket_indices(positive, pos, factor)
            self.pos_dense = _dense_added(self.pos_dense, indices, self.pos_range)
        if neg is not None and self.neg_range is not None:
            indices = _vectorized.bucket_indices(negative, neg, factor)
            self.neg_dense = _dense_added(self.neg_dense, indices, self.neg_range)
        if not (self.inf or self.ninf) and (pos or neg):
            smallest = min(pos[0] if pos else math.inf, neg[0] if neg else math.inf)
            largest = max(high, -low)
            grain = _vectorized.grain_of(smallest)
            self.exact += _vectorized.exact_units(values, grain, largest)

    def _fit(
        self, pos: tuple[float, float] | None, neg: tuple[float, float] | None
    ) -> repeat[float]:
        """Coarsen to the finest scale where the held buckets and magnitudes ``pos`` and
        ``neg`` (smallest, largest) fit; ``repeat(2**scale)`` for the indices."""
        scale = self.scale
        pos_range = widen(self.pos_range, pos, scale)
        neg_range = widen(self.neg_range, neg, scale)
        shift = max(fit_shift(pos_range, self.max_buckets), fit_shift(neg_range, self.max_buckets))
        if shift:
            scale -= shift
            self.scale = scale
            self.pos = shifted(self.pos, shift)
            self.neg = shifted(self.neg, shift)
            if self.pos_dense is not None:
                self.pos_dense = self.pos_dense.coarsened(shift)
            if self.neg_dense is not None:
                self.neg_dense = self.neg_dense.coarsened(shift)
            pos_range = (
                None if pos_range is None else (pos_range[0] >> shift, pos_range[1] >> shift)
            )
            neg_range = (
                None if neg_range is None else (neg_range[0] >> shift, neg_range[1] >> shift)
            )
        self.pos_range, self.neg_range = pos_range, neg_range
        return repeat(math.ldexp(1.0, scale))


def _dense_added(
    dense: _vectorized.DenseCounts | None, indices: _vectorized.Ints, held: tuple[int, int]
) -> _vectorized.DenseCounts:
    if dense is None:
        return _vectorized.DenseCounts(held[0], indices[:0]).added(indices, held)
    return dense.added(indices, held)


def _buckets_of(
    counts: Counter[int], counted: _vectorized.DenseCounts | None, held: tuple[int, int] | None
) -> Buckets:
    """Counts keyed by index + 1 and those counted in numpy, over indices ``held``."""
    if counted is None or held is None:
        return dense(counts, held)
    return (held[0], tuple(counted.tolist(held, counts.items())))


def bucket_index(magnitude: float, scale: int) -> int:
    """The bucket of a positive finite magnitude at ``scale``: ``ceil(log2(v) * 2**scale) - 1``.

    An exact power of two (whose log2 is exact) is the upper bound of its bucket; a power of
    two scales a float exactly, so this is the scale-20 index shifted right, as coarsening
    makes it.
    """
    return math.ceil(math.log2(magnitude) * math.ldexp(1.0, scale)) - 1


def index_range(scale: int) -> tuple[int, int]:
    """The lowest and the highest bucket of a float magnitude at ``scale`` (coarsening shifts
    indices right, so these are the scale-20 ends shifted)."""
    shift = MAX_SCALE - scale
    return _LOWEST >> shift, _HIGHEST >> shift


def widen(
    held: tuple[int, int] | None, new: tuple[float, float] | None, scale: int
) -> tuple[int, int] | None:
    if new is None:
        return held
    low, high = bucket_index(new[0], scale), bucket_index(new[1], scale)
    if held is None:
        return (low, high)
    return (min(held[0], low), max(held[1], high))


def fit_shift(held: tuple[int, int] | None, max_buckets: int) -> int:
    """The fewest scales down at which the indices ``held`` fit ``max_buckets``."""
    if held is None:
        return 0
    low, high = held
    shift = 0
    while (high >> shift) - (low >> shift) >= max_buckets:
        shift += 1
    return shift


def shifted(counts: Counter[int], shift: int) -> Counter[int]:
    """Counts keyed by index + 1, coarsened ``shift`` scales."""
    coarse: Counter[int] = Counter()
    for key, n in counts.items():
        coarse[((key - 1) >> shift) + 1] += n
    return coarse


def dense(counts: Counter[int], held: tuple[int, int] | None) -> Buckets:
    """Counts keyed by index + 1 over indices ``held``, as ``(offset, counts)``."""
    if held is None:
        return (0, ())
    low, high = held
    return (low, tuple(counts.get(i, 0) for i in range(low + 1, high + 2)))


def as_counter(buckets: Buckets, shift: int) -> Counter[int]:
    """``(offset, counts)`` as counts keyed by index + 1, coarsened ``shift`` scales."""
    offset, counts = buckets
    out: Counter[int] = Counter()
    for i, n in enumerate(counts):
        if n:
            out[((offset + i) >> shift) + 1] += n
    return out


def held_range(counts: Counter[int]) -> tuple[int, int] | None:
    """The lowest and highest index of counts keyed by index + 1."""
    return (min(counts) - 1, max(counts) - 1) if counts else None


def nan_min(x: float, y: float) -> float:
    """The smaller, ignoring NaN (an empty side's)."""
    if x != x:
        return y
    return x if y != y or x <= y else y


def nan_max(x: float, y: float) -> float:
    if x != x:
        return y
    return x if y != y or x >= y else y


# -- bounds and estimates --


def bound(index: int, scale: int) -> float:
    """``2**(index * 2**-scale)``, the lower bound of bucket ``index`` (``inf`` past floats)."""
    try:
        if scale <= 0:
            return math.ldexp(1.0, index << -scale)
        return float(2.0 ** (index / (1 << scale)))
    except OverflowError:
        return math.inf


def estimate(low: float, high: float) -> float:
    """The point of ``(low, high]`` (``0 < low``) whose largest relative error to a value
    there is least: ``2 * low * high / (low + high)``."""
    if math.isinf(high):
        return 2 * low
    return 2 / (1 / low + 1 / high) if low else high  # low underflows below 2**-1074


def clamp(value: float, low: float, high: float) -> float:
    return low if value < low else high if value > high else value


# -- the exact sum --


def units(x: float) -> int:
    """A finite float as a whole number of ``2**-1074``."""
    n, d = x.as_integer_ratio()
    return n << (UNIT_EXP - d.bit_length() + 1)


def exact_sum_of(values: list[float], smallest: float) -> int:
    """The exact sum of finite floats in ``2**-1074`` units; ``smallest`` is the least
    nonzero magnitude among them.

    ``math.fsum`` rounds correctly; summing again with the rounded sum subtracted gives the
    rest, exactly when the sum is under ``2**52`` times ``smallest`` (the rest is then a
    multiple of ``smallest``'s last bit, under ``2**53`` of them): two C passes for most
    data. Otherwise parts are taken until nothing is left.
    """
    try:
        total = math.fsum(values)
        if abs(total) <= _TWO_POW_52 * smallest:
            return units(total) + units(math.fsum(chain(values, (-total,))))
        parts = [-total]
        while True:
            part = math.fsum(chain(values, parts))
            if not part:
                return -sum(map(units, parts))
            parts.append(-part)
    except OverflowError:  # an intermediate sum past the float range: rare, per sample
        return sum(map(units, values))


_TWO_POW_52 = 2.0**52


def observed_sum(exact: int, inf: int, ninf: int) -> float:
    if inf and ninf:
        return math.nan
    if inf or ninf:
        return math.inf if inf else -math.inf
    try:
        return exact / (1 << UNIT_EXP)  # int division: correctly rounded
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


def encode_exact(exact: int) -> tuple[int, int]:
    if not exact:
        return (0, 0)
    zeros = (exact & -exact).bit_length() - 1
    return (exact >> zeros, zeros - UNIT_EXP)


def decode_exact(pair: object) -> int:
    if (
        not isinstance(pair, tuple)
        or len(pair) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) for x in pair)
    ):
        raise wrong_type("exact_sum", "a pair of ints (m, e)", pair)
    m, e = pair
    if e < -UNIT_EXP or e + UNIT_EXP + m.bit_length() > _MAX_EXACT_BITS:
        raise ValueError(
            "exact_sum must be m * 2**e within the sums of floats, got"
            f" ({int_text(m)}, {int_text(e)})"
        )
    return int(m) << int(e + UNIT_EXP)


def int_text(value: object) -> str:
    """An int for a message: a huge one by its size (printing it costs time, and str()
    refuses one past 4,300 digits)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return str(value)


def same_float(x: float, y: float) -> bool:
    return x == y or (x != x and y != y)
