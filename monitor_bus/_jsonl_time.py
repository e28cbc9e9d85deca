"""Timestamps in and out of a JSON-lines file: the text a line holds, and the datetime it reads as.

- ``timestamp`` is ISO 8601 with a UTC offset. An aware timestamp keeps its offset; a naive one
  is taken as local time (``datetime.astimezone()``) and written with the local offset.
  ``read_jsonl`` always returns aware timestamps, equal to the logged ones when those were
  aware (``Stat`` windows are) and to ``logged.astimezone()`` when they were naive.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from ._event import split_time


def iso_timestamp(ts: datetime | float) -> str:
    """``ts.isoformat()``, after ``astimezone()`` when ``ts`` is naive (local time); a float
    (``EventBus.log``'s ``time.time()``) as the ``datetime.fromtimestamp(ts)`` it stands for.

    A naive ``datetime`` takes the local offset of its hour from ``_local_offsets`` rather
    than from an ``astimezone()`` per call (about a third of the cost of a line).
    """
    if isinstance(ts, float):
        return _float_timestamp(ts)
    if ts.__class__ is datetime:
        tz = ts.tzinfo
        if tz is None:
            text = ts.isoformat()
            offsets = _local_offsets
            if offsets.tzname is time.tzname:
                suffix: str | None = offsets.get(text[:13])  # the hour: "YYYY-MM-DDTHH"
                if suffix:
                    return text + suffix
            return _naive_timestamp(ts, text)
        if tz is _UTC:
            return ts.isoformat()
    if ts.utcoffset() is None:
        ts = ts.astimezone()  # naive: local time
    return ts.isoformat()


def _float_timestamp(ts: float) -> str:
    """``iso_timestamp(datetime.fromtimestamp(ts))``, with the text of each whole second made
    once (``_local_seconds``): the float is an instant, so its offset is never in doubt."""
    whole = int(ts)
    us = round((ts - whole) * 1e6)  # split_time's rounding, inline (a line's hot path)
    seconds = _local_seconds
    parts = seconds.get(whole)
    if parts is None or not 0 < us < 1_000_000 or seconds.tzname is not time.tzname:
        return _second_timestamp(ts)
    # The microseconds' six digits: cheaper sliced from a number than padded by a format spec.
    return f"{parts[0]}{str(us + 1_000_000)[1:]}{parts[1]}"


def _second_timestamp(ts: float) -> str:
    """``_float_timestamp`` of a float whose second is not in ``_local_seconds`` yet, or that
    has no fraction, or rounds into the next second."""
    global _local_seconds
    whole, us = split_time(ts)
    seconds = _local_seconds
    tzname = time.tzname  # read before the text it labels, as in _naive_timestamp
    if seconds.tzname is not tzname or len(seconds) >= _LOCAL_OFFSETS_MAX:
        seconds = _local_seconds = _LocalOffsets(tzname)
    parts = seconds.get(whole)
    if parts is None:
        text = datetime.fromtimestamp(whole, _UTC).astimezone().isoformat()
        parts = seconds[whole] = (text[:19] + ".", text[19:])  # "YYYY-MM-DDTHH:MM:SS.", offset
    head, offset = parts
    return f"{head}{us:06d}{offset}" if us else head[:-1] + offset


class _LocalOffsets(dict[Any, Any]):
    """A table of local time's text. ``_local_offsets``: the UTC offset as ``isoformat``
    writes it (``"+01:00"``), by hour of naive local time; ``""`` for an hour ``astimezone()``
    must decide (an offset change in or next to it). ``_local_seconds``: by whole second since
    the epoch, its local date and time and its offset.

    Valid while ``time.tzname`` is the tuple in ``tzname``: ``time.tzset()``, which must be
    called for a change of the local zone to take effect, makes a new one.
    """

    __slots__ = ("tzname",)

    def __init__(self, tzname: object) -> None:
        super().__init__()
        self.tzname = tzname


_local_offsets = _LocalOffsets(None)
# The text of whole seconds (``_float_timestamp``): its date and time, and its offset.
_local_seconds = _LocalOffsets(None)
_LOCAL_OFFSETS_MAX = 1024  # hours (seconds) kept; past that the table starts over
_HOUR_END = timedelta(minutes=59, seconds=59, microseconds=999999)
_UTC = timezone.utc


def _naive_timestamp(ts: datetime, text: str) -> str:
    """``iso_timestamp`` of a naive datetime whose hour is not in ``_local_offsets`` yet."""
    global _local_offsets
    offsets = _local_offsets
    tzname = time.tzname  # read before the offsets it labels: a tzset meanwhile invalidates
    if offsets.tzname is not tzname or len(offsets) >= _LOCAL_OFFSETS_MAX:
        offsets = _local_offsets = _LocalOffsets(tzname)
    hour = text[:13]
    suffix = offsets.get(hour)
    if suffix is None:
        suffix = offsets[hour] = _hour_offset(ts.replace(minute=0, second=0, microsecond=0, fold=0))
    if suffix:
        return text + suffix
    return ts.astimezone().isoformat()


def _hour_offset(start: datetime) -> str:
    """The offset text ``astimezone().isoformat()`` gives every naive time of the hour from
    ``start``, or ``""`` when they may differ (the offset changes in or at the edge of it)."""
    try:
        end = start + _HOUR_END
        ends = (start, start.replace(fold=1), end, end.replace(fold=1))
        local = [t.astimezone() for t in ends]
    except (OverflowError, ValueError, OSError):  # out of the platform's range: let it say so
        return ""
    offset = local[0].utcoffset()
    for t, lt in zip(ends, local, strict=True):
        # A time in a skipped hour comes back moved; a repeated hour has two offsets.
        if lt.utcoffset() != offset or lt.replace(tzinfo=None) != t:
            return ""
    return local[0].isoformat()[len(start.isoformat()) :]


def read_timestamp(stamp: str) -> datetime:
    """The aware datetime a line's ``timestamp`` text stands for.

    Raises:
        ValueError: ``stamp`` is not ISO 8601, or has no UTC offset (the message says which).
    """
    try:
        timestamp = datetime.fromisoformat(stamp)
    except ValueError:
        raise ValueError(f"'timestamp' is not ISO 8601: {stamp!r}") from None
    if timestamp.utcoffset() is None:
        raise ValueError(f"'timestamp' has no UTC offset: {stamp!r}")
    return timestamp
