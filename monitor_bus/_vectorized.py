"""The chunk arithmetic of a Histogram and of STDDEV's moments in numpy, where numpy is installed.

Guarantees
----------
- The same Histogram as the pure-Python path (``_buckets.Accumulator.add``), bucket for
  bucket, with the same exact sum, min and max (the sign of a zero included), and the same
  moments' mean (``_aggregates._chunk_moments``); the standard deviation within ``1e-14``
  (relative) of the pure path's (numpy's pairwise sum of the squared deviations, against
  ``math.dist``). The callers take this path only for a chunk ``array`` accepts, and the
  pure path for any other.
- ``array`` accepts a chunk of at least ``MIN_CHUNK`` samples, all finite and none subnormal
  (numpy's arithmetic under a flush-to-zero mode would read a subnormal as zero): a chunk with
  a NaN, an infinity or a subnormal sample takes the pure path whole.
- Bucket indices: ``numpy.log2`` (its SIMD code) differs from ``math.log2`` in the last bit
  for some samples, so a sample whose scaled log2 lies within ``2**-44`` (relative, far more
  than either's error) of an integer, a bucket boundary, is placed by ``math.log2``, as the
  pure path places it.
- Sums are exact integers (``exact_units``), so they equal the pure path's ``math.fsum``-based
  ones by construction; a correctly rounded float of one is ``math.fsum``'s result.
- numpy is imported on the first chunk ``array`` is asked about (never by ``import
  monitor_bus``), once; where it is not importable, never again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Floats = npt.NDArray[np.float64]
    Ints = npt.NDArray[np.int64]
else:
    Floats = Ints = Any

MIN_CHUNK = 256
"""The fewest samples worth numpy's per-call cost (a window's first fold holds one)."""

_SMALLEST_NORMAL = 2.0**-1022
# A sample whose scaled log2 is this close to an integer (relative to its size, plus this
# much of one unit of the scale) is placed by math.log2: numpy's log2 is within a few ulps.
_NEAR = 2.0**-44
# Samples summed per pass of exact_units: the parts of fewer than 2**26 samples add up
# exactly in a float64.
_SLICE = 1 << 20

_numpy: ModuleType | None = None
_tried = False


def import_numpy() -> ModuleType | None:
    """numpy, imported on the first call; None where it is not importable."""
    global _numpy, _tried
    if not _tried:
        try:
            import numpy
        except ImportError:
            numpy = None  # type: ignore[assignment]
        _numpy, _tried = numpy, True
    return _numpy


@contextmanager
def pure_python() -> Iterator[None]:
    """While open, Stats fold their samples as where numpy is not installed: the seam through
    which the tests hold both paths equal and the benchmarks measure each."""
    global _numpy
    saved = _numpy
    _numpy = None
    try:
        yield
    finally:
        _numpy = saved


def array(samples: list[float]) -> Floats | None:
    """``samples`` as a float64 array if this module takes them (see the Guarantees), else
    None."""
    n = len(samples)
    if n < MIN_CHUNK:
        return None
    np = import_numpy()
    if np is None:
        return None
    values: Floats = np.fromiter(samples, np.float64, n)
    magnitudes = np.abs(values)
    if not magnitudes.max() < math.inf:  # an infinity or a NaN
        return None
    tiny = magnitudes < _SMALLEST_NORMAL
    if tiny.any() and magnitudes[tiny].any():  # a subnormal sample; zeros are fine
        return None
    return values


def first_zero(samples: list[float], values: Floats) -> float:
    """The first zero among ``samples`` (``0.0`` or ``-0.0``): what ``min`` or ``max`` of
    samples returns when that is zero."""
    np = _numpy
    assert np is not None
    return samples[int(np.argmax(values == 0))]


def bucket_indices(magnitudes: Floats, extent: tuple[float, float], factor: float) -> Ints:
    """The bucket index of each of ``magnitudes`` (positive and normal, from ``extent[0]`` to
    ``extent[1]``): ``ceil(log2(v) * factor) - 1``, as ``_buckets.bucket_index`` computes it;
    ``factor`` is ``2**scale``."""
    np = _numpy
    assert np is not None
    largest = max(abs(math.log2(extent[0])), abs(math.log2(extent[1]))) * factor
    scaled = np.log2(magnitudes)
    scaled *= factor  # a power of two: exact, as the pure path's product
    keys = np.ceil(scaled)
    slack = (largest + factor) * _NEAR
    gap = keys - scaled  # from 0 up to 1: near either end is near a boundary
    near = np.flatnonzero((gap < slack) | (gap > 1 - slack))
    if near.size:  # on or next to a bucket boundary: as math.log2 places it
        keys[near] = [math.ceil(math.log2(v) * factor) for v in magnitudes[near].tolist()]
    indices: Ints = keys.astype(np.int64)
    indices -= 1
    return indices


class DenseCounts:
    """Counts of the bucket indices from ``base`` up, in a numpy array (``counts[i]`` for
    index ``base + i``): what ``Accumulator`` counts in numpy, without a Python operation
    per bucket."""

    __slots__ = ("base", "counts")

    def __init__(self, base: int, counts: Ints) -> None:
        self.base = base
        self.counts = counts

    def copy(self) -> DenseCounts:
        return DenseCounts(self.base, self.counts.copy())

    def added(self, indices: Ints, held: tuple[int, int]) -> DenseCounts:
        """These counts with ``indices`` counted, over ``held`` (the indices held, which
        include ``indices`` and these counts' own); in place when the range is the same."""
        np = _numpy
        assert np is not None
        low, high = held
        new = np.bincount(indices - low, minlength=high - low + 1)
        counts = self.counts
        if self.base == low and len(counts) == len(new):
            counts += new
            return self
        start = self.base - low
        new[start : start + len(counts)] += counts
        return DenseCounts(low, new)

    def coarsened(self, shift: int) -> DenseCounts:
        """The counts ``shift`` scales coarser: index ``i`` goes to ``i >> shift``."""
        np = _numpy
        assert np is not None
        indices = np.arange(self.base, self.base + len(self.counts)) >> shift
        starts = np.flatnonzero(np.diff(indices, prepend=indices[0] - 1))
        return DenseCounts(int(indices[0]), np.add.reduceat(self.counts, starts))

    def tolist(self, held: tuple[int, int], others: Iterable[tuple[int, int]]) -> list[int]:
        """These counts and ``others`` (``(key, count)`` pairs keyed by index + 1) over
        ``held``, the range holding them all."""
        np = _numpy
        assert np is not None
        low, high = held
        counts = np.zeros(high - low + 1, np.int64)
        start = self.base - low
        counts[start : start + len(self.counts)] = self.counts
        out: list[int] = counts.tolist()
        for key, n in others:
            out[key - 1 - low] += n
        return out


def exact_units(values: Floats, grain: int, largest: float) -> int:
    """The exact sum of finite ``values``, each a multiple of ``2**grain`` (``grain`` at
    least -1074) and at most ``largest`` in magnitude, as a whole number of ``2**-1074``.

    In units of ``2**grain`` the values are integers; split at ``2**26`` into a high and a
    low part, each part's sum is an integer a float64 holds while the values span under about
    14 octaves (checked), so numpy's sums of them are exact in any order. Values spread wider
    are taken as their 53-bit integer mantissas, whose halves (27 and 26 bits) are summed per
    exponent (fewer than ``2**26`` of them add up exactly in a float64), the exponents' sums
    joined as ints.
    """
    np = _numpy
    assert np is not None
    n = len(values)
    if n < _SLICE and math.frexp(largest)[1] - grain + n.bit_length() <= 79:
        whole = np.ldexp(values, -grain)  # integers, scaled exactly
        high = np.trunc(whole * 2.0**-26)
        high *= 2.0**26
        low = whole - high  # exact: under 2**26
        return (int(high.sum()) + int(low.sum())) << (grain + 1074)
    total = 0
    for start in range(0, n, _SLICE):
        part = values[start : start + _SLICE]
        mantissas, exponents = np.frexp(part)
        whole = np.ldexp(mantissas, 53).astype(np.int64)  # |whole| < 2**53, exact
        # v = whole * 2**(e - 53): in units of 2**-1074 times 2**52, whole << (e + 1073),
        # and e + 1073 >= 0 for any finite float.
        shifts = exponents + 1073
        high = np.bincount(shifts, weights=(whole >> 26).astype(np.float64))
        low = np.bincount(shifts, weights=(whole & 0x3FFFFFF).astype(np.float64))
        held = np.flatnonzero((high != 0) | (low != 0))
        for shift, h, lo in zip(
            held.tolist(), high[held].tolist(), low[held].tolist(), strict=True
        ):
            total += ((int(h) << 26) + int(lo)) << shift
    return total >> 52


def grain_of(magnitude: float) -> int:
    """The exponent of the last bit of a ``magnitude`` (its ulp: a float at least this large
    is a multiple of it), at least -1074; 1024 for infinity (no float is that large)."""
    if magnitude == math.inf:
        return 1024
    return max(math.frexp(magnitude)[1] - 53, -1074)


def smallest_nonzero(magnitudes: Floats) -> float:
    """The smallest of ``magnitudes`` but zero (infinity if all are zero)."""
    smallest = float(magnitudes.min())
    if smallest == 0:
        nonzero = magnitudes[magnitudes > 0]
        smallest = float(nonzero.min()) if nonzero.size else math.inf
    return smallest


def chunk_moments(values: Floats, shift: float) -> tuple[float, float] | None:
    """The mean of ``values`` about ``shift`` and their population standard deviation, as
    ``_aggregates._chunk_moments`` computes them: the mean exactly as there (``math.fsum``
    of the offsets over their number), the deviation from the squared deviations' pairwise
    sum (numpy's), within a few parts in ``10**15`` of ``math.dist``'s. None for samples
    whose offsets may pass ``2**1000``, the pure path's rare cases."""
    np = _numpy
    assert np is not None
    n = len(values)
    magnitudes = np.abs(values)
    if not float(magnitudes.max()) + abs(shift) < 2.0**1000:
        return None
    offsets = values - shift  # IEEE subtraction, as operator.sub
    largest = float(np.abs(offsets).max())
    # Each value and shift are multiples of the smallest's last bit, so their differences
    # are too, and so is each rounded difference (rounding a multiple of a power of two to
    # a coarser one keeps it one).
    grain = grain_of(smallest_nonzero(magnitudes))
    if shift:
        grain = min(grain, grain_of(abs(shift)))
    total = exact_units(offsets, grain, largest)
    # math.fsum is correctly rounded, as is an int's true division; a zero sum's sign is
    # fsum's own.
    mean = (total / (1 << 1074) if total else math.fsum(offsets.tolist())) / n
    deviations = offsets - mean
    widest = float(np.abs(deviations).max())
    if not widest:
        return mean, 0.0
    # Scaled by a power of two to below 1, as math.dist scales them: no square overflows,
    # and those that underflow are too small to count.
    exponent = math.frexp(widest)[1]
    scaled = np.ldexp(deviations, -exponent)
    squares = float(np.square(scaled).sum())
    return mean, math.ldexp(math.sqrt(squares), exponent) / math.sqrt(n)
