"""A distribution in base-2 exponential buckets that merges exactly.

Guarantees
----------
- Layout: OpenTelemetry's. At ``scale`` s, bucket ``i`` holds the magnitudes in
  ``(2**(i * 2**-s), 2**((i + 1) * 2**-s)]``; positive and negative samples have buckets of
  their own (a negative sample by its magnitude), zeros (``-0.0`` too) a count of their own. An
  exact power of two is the upper bound of its bucket: ``2**e`` is in bucket ``(e << s) - 1``.
  Other samples are placed from ``math.log2``, so one a rounding error away from a bucket
  boundary may land in the neighbouring bucket, as in OpenTelemetry's SDK; subnormal samples
  get their own buckets (the SDK puts them all in the lowest normal one).
- Resolution: a Histogram starts at scale 20 and coarsens, one scale at a
  time (each halving the buckets), until each sign's buckets fit ``max_buckets`` (2048 by
  default), as OpenTelemetry's SDK does. With 2048, any samples whose magnitudes lie in an
  interval ``(x, x * 2**31.98]`` keep scale 6 or finer, where ``quantile`` is within 0.54% of
  the true value; those in ``(2**k, 2**(k + 32)]`` too. Wider data gets coarser buckets: each
  scale lower doubles the error bound (``(r - 1) / (r + 1)`` with ``r = 2**(2**-scale)``).
- Exactness: a sample's bucket at scale s is its scale-20 bucket shifted right by ``20 - s``
  (computed as ``ceil(log2(v) * 2**s) - 1``, which equals it exactly: a power of two scales a
  float without rounding), buckets are only ever coarsened by shifting, and a Histogram's
  scale is the finest at which its samples fit, so ``Histogram.of(a + b)``,
  ``Histogram.of(a).merge(Histogram.of(b))`` and ``Histogram.of(b).merge(Histogram.of(a))``
  are equal for any split and order. The sum is kept exactly (as an integer count of
  ``2**-1074``, the smallest float step), so it does not depend on the order either.
- Non-numbers: no sample raises. A NaN is counted in ``count`` and ``nan_count`` and nowhere
  else (not in a bucket, ``sum``, ``min``, ``max`` or ``quantile``). ``+inf`` and ``-inf`` are
  counted in ``count`` and ``inf_count`` / ``neg_inf_count``, are the ``max`` / ``min`` and the
  quantiles that fall on them, and make ``sum`` infinite (NaN with both).
- Bounds, as OpenTelemetry's: scale from -10 to 20, offsets within the buckets of floats at
  the scale (subnormals included: ``index_range``), ``max_buckets`` from 3 to 65,536. Every
  Histogram made from outside (the constructor, ``from_dict``, an unpickled one) is checked
  against them, a huge offset by comparison alone, so a merge never goes below scale -10 and
  costs time linear in its sides' buckets and its result's (at most ``max_buckets`` a sign).
- A Histogram is immutable: ``merge`` returns a new one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ._buckets import (
    MAX_BUCKETS_LIMIT,
    MAX_SCALE,
    MIN_SCALE,
    Accumulator,
    Buckets,
    as_counter,
    bound,
    clamp,
    decode_exact,
    dense,
    encode_exact,
    estimate,
    fit_shift,
    held_range,
    index_range,
    int_text,
    nan_max,
    nan_min,
    observed_sum,
    same_float,
    shifted,
    units,
)
from ._check import check_int, wrong_type

_FLOAT_KEY = "$float"  # non-finite floats in to_dict, as the JSONL sink writes them
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class Histogram:
    """Counts of samples in base-2 exponential buckets (OpenTelemetry's exponential
    histogram), with exact merging; see the Concepts page, "Distributions".

    Make one with ``Histogram.of(samples)``; a ``Stat`` with ``Aggregation.HISTOGRAM`` logs one
    per window. The keyword constructor rebuilds one from its fields (as a sink reads it back)
    and checks them; it accepts zero counts at either end of ``positive_counts`` and
    ``negative_counts`` and drops them. Immutable, comparable with ``==`` and picklable.

    Args:
        scale: the buckets' scale, from -10 to 20.
        zero_count: samples equal to zero.
        positive_offset: the index of ``positive_counts[0]``, within the buckets of floats at
            ``scale`` (from ``-1126170625`` to ``1073741823`` at scale 20, each end shifted
            right by one a scale lower).
        positive_counts: samples per positive bucket, from ``positive_offset`` up, none past
            the bucket of the largest float.
        negative_offset: the index of ``negative_counts[0]`` (by magnitude), as
            ``positive_offset``.
        negative_counts: samples per negative bucket, by magnitude from ``negative_offset`` up.
        count: every sample, NaN and infinities included; computed when omitted.
        sum: the sum of the non-NaN samples.
        min: the smallest non-NaN sample (NaN when there is none).
        max: the largest non-NaN sample (NaN when there is none).
        nan_count: NaN samples.
        inf_count: ``+inf`` samples.
        neg_inf_count: ``-inf`` samples.
        max_buckets: the most buckets per sign, from 3 to 65,536.
        exact_sum: the sum of the finite samples exactly, as ``(m, e)`` meaning ``m * 2**e``;
            when omitted, ``sum`` is taken as exact.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range (an offset or a count past the buckets of
            floats, an int ``sum``, ``min`` or ``max`` past the float range) or the fields
            disagree (``count`` is not the total of the counts, ``sum`` is not ``exact_sum``
            rounded, ``min`` exceeds ``max``, more buckets than ``max_buckets``).

    Examples:
        >>> h = Histogram.of([1.0, 2.0, 3.0, 4.0])
        >>> h.count, h.sum, h.min, h.max
        (4, 10.0, 1.0, 4.0)
        >>> round(h.quantile(0.5), 2)
        2.0
        >>> h.merge(Histogram.of([5.0])) == Histogram.of([1.0, 2.0, 3.0, 4.0, 5.0])
        True
    """

    __slots__ = (
        "_count",
        "_exact",
        "_inf",
        "_max",
        "_max_buckets",
        "_min",
        "_nan",
        "_neg",
        "_ninf",
        "_pos",
        "_scale",
        "_zero",
    )

    _scale: int
    _zero: int
    _pos: Buckets
    _neg: Buckets
    _count: int
    _exact: int
    _min: float
    _max: float
    _nan: int
    _inf: int
    _ninf: int
    _max_buckets: int

    def __init__(
        self,
        *,
        scale: int = MAX_SCALE,
        zero_count: int = 0,
        positive_offset: int = 0,
        positive_counts: Iterable[int] = (),
        negative_offset: int = 0,
        negative_counts: Iterable[int] = (),
        count: int | None = None,
        sum: float = 0.0,  # noqa: A002  # the field's name, as OpenTelemetry's
        min: float = math.nan,  # noqa: A002
        max: float = math.nan,  # noqa: A002
        nan_count: int = 0,
        inf_count: int = 0,
        neg_inf_count: int = 0,
        max_buckets: int = 2048,
        exact_sum: tuple[int, int] | None = None,
    ) -> None:
        check_int("scale", scale, MIN_SCALE)
        if scale > MAX_SCALE:
            raise ValueError(f"scale must be at most {MAX_SCALE}, got {scale}")
        _check_max_buckets(max_buckets)
        zero = check_int("zero_count", zero_count, 0)
        nan = check_int("nan_count", nan_count, 0)
        inf = check_int("inf_count", inf_count, 0)
        ninf = check_int("neg_inf_count", neg_inf_count, 0)
        pos = _check_buckets("positive", positive_offset, positive_counts, max_buckets, scale)
        neg = _check_buckets("negative", negative_offset, negative_counts, max_buckets, scale)
        total = zero + nan + inf + ninf + _total(pos) + _total(neg)
        if count is None:
            count = total
        elif check_int("count", count, 0) != total:
            raise ValueError(f"count must be the total of the counts ({total}), got {count}")
        observed = _check_float("sum", sum)
        low, high = _check_float("min", min), _check_float("max", max)
        if exact_sum is None:
            if inf or ninf or not math.isfinite(observed):
                exact = 0
                if not (inf or ninf) and observed == observed:
                    raise ValueError(f"sum is {observed} without infinite samples: give exact_sum")
            else:
                exact = units(observed)
        else:
            exact = decode_exact(exact_sum)
        if inf or ninf:
            exact = 0  # not observable once the sum is infinite: one form for equality
        if not same_float(observed_sum(exact, inf, ninf), observed):
            raise ValueError(f"sum must be exact_sum rounded ({observed_sum(exact, inf, ninf)})")
        numbers = count - nan
        if not numbers:
            if low == low or high == high:
                raise ValueError("min and max must be NaN when there are no non-NaN samples")
        elif not low <= high:
            raise ValueError(f"min must be at most max, got min={min} and max={max}")
        self._set(scale, zero, pos, neg, count, exact, low, high, (nan, inf, ninf), max_buckets)

    def _set(
        self,
        scale: int,
        zero: int,
        pos: Buckets,
        neg: Buckets,
        count: int,
        exact: int,
        low: float,
        high: float,
        special: tuple[int, int, int],
        max_buckets: int,
    ) -> Histogram:
        self._scale = scale
        self._zero = zero
        self._pos = pos
        self._neg = neg
        self._count = count
        self._exact = exact
        self._min = low
        self._max = high
        self._nan, self._inf, self._ninf = special
        self._max_buckets = max_buckets
        return self

    # -- construction --

    @classmethod
    def of(cls, values: Iterable[float], *, max_buckets: int = 2048) -> Histogram:
        """A Histogram of ``values`` (floats or ints), in one pass.

        Args:
            values: the samples.
            max_buckets: the most buckets per sign, from 3 to 65,536; more coarsens the scale.

        Returns:
            The Histogram of the samples.

        Raises:
            TypeError: ``values`` is not an iterable of real numbers a float holds (an int
                past the float range is refused, as ``Stat.add`` refuses it).
            ValueError: ``max_buckets`` is not from 3 to 65,536.
        """
        _check_max_buckets(max_buckets)
        try:
            samples = list(map(float, values))
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"values must be an iterable of real numbers: {exc}") from None
        accumulator = Accumulator(max_buckets)
        accumulator.add(samples)
        return from_accumulator(accumulator)

    # -- fields --

    @property
    def scale(self) -> int:
        """The buckets' scale: bucket ``i`` is ``(2**(i * 2**-scale), 2**((i+1) * 2**-scale)]``."""
        return self._scale

    @property
    def zero_count(self) -> int:
        """Samples equal to zero."""
        return self._zero

    @property
    def positive_offset(self) -> int:
        """The bucket index of ``positive_counts[0]``."""
        return self._pos[0]

    @property
    def positive_counts(self) -> tuple[int, ...]:
        """Samples per positive bucket from ``positive_offset`` up (no zeros at either end)."""
        return self._pos[1]

    @property
    def negative_offset(self) -> int:
        """The bucket index (by magnitude) of ``negative_counts[0]``."""
        return self._neg[0]

    @property
    def negative_counts(self) -> tuple[int, ...]:
        """Samples per negative bucket, by magnitude from ``negative_offset`` up."""
        return self._neg[1]

    @property
    def count(self) -> int:
        """Every sample, NaN and infinities included."""
        return self._count

    @property
    def sum(self) -> float:
        """The sum of the non-NaN samples, correctly rounded (``inf`` past the float range)."""
        return observed_sum(self._exact, self._inf, self._ninf)

    @property
    def exact_sum(self) -> tuple[int, int]:
        """The sum of the finite samples exactly, as ``(m, e)`` meaning ``m * 2**e`` with ``m``
        odd or zero (``(0, 0)`` once the sum is infinite)."""
        return encode_exact(self._exact)

    @property
    def min(self) -> float:
        """The smallest non-NaN sample; NaN if there is none."""
        return self._min

    @property
    def max(self) -> float:
        """The largest non-NaN sample; NaN if there is none."""
        return self._max

    @property
    def nan_count(self) -> int:
        """NaN samples (in ``count`` only)."""
        return self._nan

    @property
    def inf_count(self) -> int:
        """``+inf`` samples."""
        return self._inf

    @property
    def neg_inf_count(self) -> int:
        """``-inf`` samples."""
        return self._ninf

    @property
    def max_buckets(self) -> int:
        """The most buckets per sign before the scale coarsens."""
        return self._max_buckets

    # -- reading --

    def buckets(self) -> list[tuple[float, float, int]]:
        """Every non-empty bucket as ``(lower, upper, count)``, in ascending value order.

        Negative buckets first (``(-upper, -lower]`` of their magnitudes), then
        ``(0.0, 0.0, zero_count)``, then the positive ones; ``-inf`` and ``+inf`` samples as
        ``(-inf, -inf, n)`` and ``(inf, inf, n)`` at the ends. A bucket whose upper bound is
        past the float range has ``inf`` there.
        """
        out: list[tuple[float, float, int]] = []
        if self._ninf:
            out.append((-math.inf, -math.inf, self._ninf))
        scale = self._scale
        offset, counts = self._neg
        for i in range(len(counts) - 1, -1, -1):
            if counts[i]:
                index = offset + i
                out.append((-bound(index + 1, scale), -bound(index, scale), counts[i]))
        if self._zero:
            out.append((0.0, 0.0, self._zero))
        offset, counts = self._pos
        for i, n in enumerate(counts):
            if n:
                out.append((bound(offset + i, scale), bound(offset + i + 1, scale), n))
        if self._inf:
            out.append((math.inf, math.inf, self._inf))
        return out

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the non-NaN samples, estimated from the buckets.

        The nearest-rank quantile (numpy's ``inverted_cdf``): the sample of rank
        ``max(1, ceil(q * n))`` among ``n``, estimated as the point of its bucket nearest to
        every value the bucket can hold (relative error at most ``(r - 1) / (r + 1)``,
        ``r = 2**(2**-scale)``: 0.54% at scale 6), kept within ``[min, max]``: ``quantile(0)``
        is ``min`` and ``quantile(1)`` is ``max``.

        Args:
            q: from 0 to 1.

        Returns:
            The estimate; NaN when there are no non-NaN samples.

        Raises:
            TypeError: ``q`` is not a real number.
            ValueError: ``q`` is not in ``[0, 1]``.
        """
        if isinstance(q, bool) or not isinstance(q, (int, float)):
            raise wrong_type("q", "a float", q)
        if not 0 <= q <= 1:
            raise ValueError(f"q must be from 0 to 1, got {q}")
        n = self._count - self._nan
        if not n:
            return math.nan
        rank = max(1, math.ceil(q * n))
        if rank >= n:
            return self._max
        if rank == 1:
            return self._min
        return clamp(self._rank_estimate(rank), self._min, self._max)

    def _rank_estimate(self, rank: int) -> float:
        """The estimate of the sample of 1-based ``rank`` in ascending order (bounds are
        computed for its bucket only: a Stat reads four quantiles per window)."""
        seen = self._ninf
        if seen >= rank:
            return -math.inf
        scale = self._scale
        offset, counts = self._neg
        for i in range(len(counts) - 1, -1, -1):
            seen += counts[i]
            if seen >= rank:
                return -estimate(bound(offset + i, scale), bound(offset + i + 1, scale))
        seen += self._zero
        if seen >= rank:
            return 0.0
        offset, counts = self._pos
        for i, n in enumerate(counts):
            seen += n
            if seen >= rank:
                return estimate(bound(offset + i, scale), bound(offset + i + 1, scale))
        return math.inf

    # -- combining --

    def merge(self, other: Histogram) -> Histogram:
        """The Histogram of both sides' samples; neither side changes.

        Exact (equal to the Histogram of all the samples) whatever the split: at equal
        scales bucket counts add, otherwise the finer side is coarsened to the other's scale,
        and the result is coarsened further while a sign's buckets exceed ``max_buckets``
        (the smaller of the two sides').

        Args:
            other: another Histogram.

        Returns:
            A new Histogram.

        Raises:
            TypeError: ``other`` is not a Histogram.
        """
        if not isinstance(other, Histogram):
            raise wrong_type("other", "a monitor_bus.Histogram", other)
        return _merge(self, other)

    # -- encoding --

    def to_dict(self) -> dict[str, Any]:
        """The Histogram as JSON-safe values: the one encoding for sinks and wires.

        Ints, floats, lists and str; a non-finite float as ``{"$float": "NaN"}`` (or
        ``"Infinity"``, ``"-Infinity"``), as the JSONL sink writes one. ``from_dict`` restores
        an equal Histogram.
        """
        return {
            "scale": self._scale,
            "zero_count": self._zero,
            "positive_offset": self._pos[0],
            "positive_counts": list(self._pos[1]),
            "negative_offset": self._neg[0],
            "negative_counts": list(self._neg[1]),
            "count": self._count,
            "sum": _json_float(self.sum),
            "exact_sum": list(encode_exact(self._exact)),
            "min": _json_float(self._min),
            "max": _json_float(self._max),
            "nan_count": self._nan,
            "inf_count": self._inf,
            "neg_inf_count": self._ninf,
            "max_buckets": self._max_buckets,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Histogram:
        """The Histogram ``to_dict`` encoded (its fields checked as the constructor does).

        Args:
            d: a dict as ``to_dict`` returns; keys other than ``count`` may be missing (the
                constructor's defaults).

        Returns:
            The Histogram.

        Raises:
            TypeError: ``d`` is not a dict, or a field has the wrong type.
            ValueError: a key is unknown, or the fields disagree (see the constructor).
        """
        if not isinstance(d, dict):
            raise wrong_type("d", "a dict", d)
        fields = dict(d)
        unknown = set(fields) - _FIELDS
        if unknown:
            raise ValueError(f"d has unknown Histogram fields: {sorted(unknown)}")
        for name in ("sum", "min", "max"):
            if name in fields:
                fields[name] = _from_json_float(name, fields[name])
        if "exact_sum" in fields:
            pair = fields["exact_sum"]
            if not isinstance(pair, (list, tuple)):
                raise wrong_type("exact_sum", "a pair of ints", pair)
            fields["exact_sum"] = tuple(pair)
        return cls(**fields)

    # -- value semantics --

    def _key(self) -> tuple[Any, ...]:
        return (
            self._scale,
            self._zero,
            self._pos,
            self._neg,
            self._count,
            self._exact,
            None if self._min != self._min else self._min,
            None if self._max != self._max else self._max,
            self._nan,
            self._inf,
            self._ninf,
            self._max_buckets,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Histogram):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # equal by value, not hashable (a list)

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # An unpickled Histogram (from a child over the relay, say) is checked as a new one.
        restored = Histogram.from_dict(state)
        for name in Histogram.__slots__:
            object.__setattr__(self, name, getattr(restored, name))

    def __repr__(self) -> str:
        return (
            f"Histogram(count={self._count}, sum={self.sum!r}, min={self._min!r},"
            f" max={self._max!r}, scale={self._scale}, zero_count={self._zero},"
            f" positive_offset={self._pos[0]}, positive_counts=<{len(self._pos[1])} buckets>,"
            f" negative_offset={self._neg[0]}, negative_counts=<{len(self._neg[1])} buckets>)"
        )


_FIELDS = frozenset(
    (
        "scale",
        "zero_count",
        "positive_offset",
        "positive_counts",
        "negative_offset",
        "negative_counts",
        "count",
        "sum",
        "exact_sum",
        "min",
        "max",
        "nan_count",
        "inf_count",
        "neg_inf_count",
        "max_buckets",
    )
)


def _merge(a: Histogram, b: Histogram) -> Histogram:
    max_buckets = min(a._max_buckets, b._max_buckets)
    scale = min(a._scale, b._scale)
    pos = as_counter(a._pos, a._scale - scale)
    pos.update(as_counter(b._pos, b._scale - scale))
    neg = as_counter(a._neg, a._scale - scale)
    neg.update(as_counter(b._neg, b._scale - scale))
    pos_range, neg_range = held_range(pos), held_range(neg)
    shift = max(fit_shift(pos_range, max_buckets), fit_shift(neg_range, max_buckets))
    if shift:
        pos, neg = shifted(pos, shift), shifted(neg, shift)
        pos_range, neg_range = held_range(pos), held_range(neg)
    inf, ninf = a._inf + b._inf, a._ninf + b._ninf
    return Histogram.__new__(Histogram)._set(
        scale - shift,
        a._zero + b._zero,
        dense(pos, pos_range),
        dense(neg, neg_range),
        a._count + b._count,
        0 if inf or ninf else a._exact + b._exact,
        nan_min(a._min, b._min),
        nan_max(a._max, b._max),
        (a._nan + b._nan, inf, ninf),
        max_buckets,
    )


def from_accumulator(accumulator: Accumulator) -> Histogram:
    """The Histogram of the samples ``accumulator`` counted so far."""
    pos, neg = accumulator.buckets()
    return Histogram.__new__(Histogram)._set(
        accumulator.scale,
        accumulator.zero,
        pos,
        neg,
        accumulator.count,
        accumulator.exact,
        accumulator.low,
        accumulator.high,
        (accumulator.nan, accumulator.inf, accumulator.ninf),
        accumulator.max_buckets,
    )


# -- checks and JSON --


def _check_max_buckets(max_buckets: object) -> None:
    check_int("max_buckets", max_buckets, 3)
    if not 3 <= max_buckets <= MAX_BUCKETS_LIMIT:  # type: ignore[operator]
        raise ValueError(
            f"max_buckets must be from 3 to {MAX_BUCKETS_LIMIT}, got {int_text(max_buckets)}"
        )


def _check_buckets(
    sign: str, offset: object, counts: object, max_buckets: int, scale: int
) -> Buckets:
    # The offset first, by comparison only: a huge one costs nothing more.
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise wrong_type(f"{sign}_offset", "an int", offset)
    lowest, highest = index_range(scale)
    if not lowest <= offset <= highest:
        raise ValueError(
            f"{sign}_offset must be from {lowest} to {highest} at scale {scale} (the buckets"
            f" of floats), got {int_text(offset)}"
        )
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Iterable):
        raise wrong_type(f"{sign}_counts", "a sequence of ints", counts)
    values = tuple(counts)
    for n in values:
        check_int(f"{sign}_counts", n, 0)
    start = 0
    while start < len(values) and not values[start]:
        start += 1
    end = len(values)
    while end > start and not values[end - 1]:
        end -= 1
    if offset + end - 1 > highest:
        raise ValueError(
            f"{sign}_counts reach bucket {offset + end - 1}, past {highest}, the highest of"
            f" floats at scale {scale}"
        )
    values = values[start:end]
    if len(values) > max_buckets:
        raise ValueError(
            f"{sign}_counts has {len(values)} buckets, more than max_buckets ({max_buckets})"
        )
    return (offset + start if values else 0, values)


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(name, "a float", value)
    try:
        return float(value)
    except OverflowError:  # an int past the float range
        raise ValueError(f"{name} must be within the float range, got {int_text(value)}") from None


def _total(buckets: Buckets) -> int:
    return sum(buckets[1])


def _json_float(x: float) -> float | dict[str, str]:
    if math.isfinite(x):
        return x
    return {_FLOAT_KEY: "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")}


def _from_json_float(name: str, value: object) -> float:
    if isinstance(value, dict):
        text = value.get(_FLOAT_KEY) if len(value) == 1 else None
        if text not in _NONFINITE:
            raise ValueError(f"{name} must be a float or {{'$float': 'NaN'|'Infinity'|...}}")
        return _NONFINITE[text]
    return _check_float(name, value)
