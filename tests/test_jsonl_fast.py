"""JsonlEventHandler's writer against the encoding it replaced: the same bytes, event for event.

``reference_bytes`` is the writer as it was before it stopped calling ``astimezone`` per event
and building an encoder per call, copied here as the reference. Naive timestamps are checked in
zones with daylight saving time, half-hour shifts and offsets with seconds, set with
``time.tzset()`` and restored after each use.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor_bus import Event, EventOrigin, JsonlEventHandler, _jsonl_encode, _jsonl_time
from monitor_bus._event import epoch_seconds, from_slots

from .conftest import local_zone


@pytest.fixture(autouse=True)
def stdlib_encoder() -> Iterator[None]:
    """The bytes compared are the standard library encoder's (orjson's may differ: ``1e-7``)."""
    saved = _jsonl_encode._encode_data
    _jsonl_encode._encode_data = _jsonl_encode._stdlib_encode_data
    yield
    _jsonl_encode._encode_data = saved


# -- the reference: the writer before this change --

_ref_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
_REF_SURROGATE = re.compile("[\ud800-\udfff]")


def _ref_timestamp(ts: datetime) -> str:
    if ts.utcoffset() is None:
        ts = ts.astimezone()  # naive: local time
    return ts.isoformat()


def _ref_value(v: Any) -> Any:
    if v.__class__ is float and not math.isfinite(v):
        return {"$float": "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")}
    return v


def _ref_line(event: Event) -> tuple[str, int]:
    """The line the old writer made for ``event``, and how many values it skipped."""
    record = {
        "name": event.name,
        "timestamp": _ref_timestamp(event.timestamp),
        "data": {k: _ref_value(v) for k, v in event.data.items()},
    }
    origin = event.origin
    if origin is not None:
        record["origin"] = {"pid": origin.pid, "worker": origin.worker}
    try:
        return _ref_encode(record), 0
    except ValueError:
        kept = {}
        skipped = 0
        for key, value in event.data.items():
            value = _ref_value(value)
            try:
                _ref_encode(value)
            except ValueError:
                skipped += 1
            else:
                kept[key] = value
        record["data"] = kept
        return _ref_encode(record), skipped


def reference_bytes(events: list[Event]) -> tuple[bytes, int]:
    """The file the old writer made from ``events``, and how many values it skipped."""
    pending = []
    skipped = 0
    for event in events:
        line, n = _ref_line(event)
        pending.append(line)
        skipped += n
    if not pending:
        return b"", 0
    pending.append("")
    text = "\n".join(pending)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raw = _REF_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode("utf-8")
    return raw, skipped


def written_bytes(events: list[Event]) -> tuple[bytes, int]:
    """The file today's JsonlEventHandler makes from ``events``, and its skipped_values."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        with JsonlEventHandler(path) as handler:
            for event in events:
                handler(event)
        return path.read_bytes(), handler.skipped_values


# -- local zones --

ZONES = [
    "Europe/Berlin",  # DST, and double summer time (+03:00) in 1945 and 1947
    "America/St_Johns",  # -03:30 / -02:30
    "Australia/Lord_Howe",  # a 30-minute DST shift
    "Europe/Amsterdam",  # +00:19:32 until 1937: an offset with seconds
    "Africa/Monrovia",  # -00:44:30 until 1972
    "Asia/Kolkata",  # +05:30, no DST today
    "UTC",
]


def transitions(years: list[int]) -> list[datetime]:
    """Local wall times (naive) at which the local UTC offset changes, within ``years``."""
    found = []
    for year in years:
        t = int(datetime(year, 1, 1, tzinfo=timezone.utc).timestamp())
        end = int(datetime(year + 1, 1, 1, tzinfo=timezone.utc).timestamp())
        before = time.localtime(t).tm_gmtoff
        while t < end:
            t += 1800
            after = time.localtime(t).tm_gmtoff
            if after != before:
                found.append(datetime.fromtimestamp(t).replace(minute=0, second=0))
            before = after
    return found


TRANSITION_YEARS = [1916, 1930, 1937, 1945, 1947, 1972, 1996, 2026, 2037, 2040]


def around(points: list[datetime], hours: int = 3) -> Iterator[datetime]:
    """Every 10 minutes (and the last microsecond before each) within ``hours`` of each point,
    in both folds."""
    for point in points:
        t = point - timedelta(hours=hours)
        while t <= point + timedelta(hours=hours):
            for stamp in (t, t - timedelta(microseconds=1)):
                yield stamp
                yield stamp.replace(fold=1)
            t += timedelta(minutes=10)


@pytest.mark.parametrize("zone", ZONES)
def test_naive_timestamps_around_offset_changes(zone: str) -> None:
    """Naive local timestamps around every change of the local offset are written as ``astimezone().isoformat()``."""
    with local_zone(zone):
        points = transitions(TRANSITION_YEARS)
        stamps = list(around(points or [datetime(2026, 3, 29, 2)]))
        got = [_jsonl_time.iso_timestamp(ts) for ts in stamps]
        want = [_ref_timestamp(ts) for ts in stamps]
    assert len(stamps) > 100
    assert bool(points) == (zone != "UTC")  # the zone took effect: it has offset changes
    assert [(ts, g) for ts, g, w in zip(stamps, got, want, strict=True) if g != w] == []


def float_stamps(points: list[datetime]) -> list[float]:
    """``time.time()``-style floats every 7 minutes within 3 hours of each instant in
    ``points``, each with fractions that round up, down, to even and past the second."""
    # 0.0078125 and 0.0234375 (odd multiples of 1/128) are exact half microseconds: ties,
    # which round to even (7812 and 23438 us).
    fractions = (0.0, 0.0000015, 0.0078125, 0.0234375, 0.25, 0.9999994999, 0.9999995, 0.9999999)
    stamps = []
    for point in points:
        start = int(point.timestamp())
        for second in range(start - 3 * 3600, start + 3 * 3600, 420):
            stamps += [second + f for f in fractions]
    return stamps


@pytest.mark.parametrize("zone", ZONES)
def test_float_timestamps_are_written_as_the_datetime_they_stand_for(zone: str) -> None:
    """A ``log()`` timestamp (a float) is written as ``datetime.fromtimestamp`` of it would be, around every offset change, at every rounding edge."""
    with local_zone(zone):
        points = transitions(TRANSITION_YEARS) or [datetime(2026, 3, 29, 2)]
        stamps = float_stamps(points)
        got = [_jsonl_time.iso_timestamp(f) for f in stamps]
        want = [_ref_timestamp(datetime.fromtimestamp(f)) for f in stamps]
    assert len(stamps) >= 400  # 52 seconds, 8 fractions each, around one change at least
    assert [(f, g) for f, g, w in zip(stamps, got, want, strict=True) if g != w] == []


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "Australia/Lord_Howe"])
def test_float_timestamps_give_the_datetimes_wall_time(zone: str) -> None:
    """``epoch_seconds`` of an event holding a float equals ``timestamp.timestamp()`` of the ``datetime`` it stands for (the TensorBoard and MLflow sinks' time)."""
    with local_zone(zone):
        stamps = float_stamps(transitions([2026]) or [datetime(2026, 3, 29, 2)])
        got = [epoch_seconds(from_slots("e", f, {})) for f in stamps]
        want = [datetime.fromtimestamp(f).timestamp() for f in stamps]
    assert got == want


def test_berlin_spring_gap_and_autumn_fold() -> None:
    """In Berlin, the skipped hour of 29 March 2026 and both passes of the repeated one of 25 October are written as astimezone() writes them."""
    with local_zone("Europe/Berlin"):
        gap = datetime(2026, 3, 29, 2, 30)
        fold0 = datetime(2026, 10, 25, 2, 30, 0, 5)
        fold1 = fold0.replace(fold=1)
        got = [_jsonl_time.iso_timestamp(ts) for ts in (gap, fold0, fold1)]
        want = [_ref_timestamp(ts) for ts in (gap, fold0, fold1)]
    assert got == want
    # astimezone() moves a skipped time back an hour up to 3.11, forward from 3.12.
    gap_text = "01:30:00+01:00" if sys.version_info < (3, 12) else "03:30:00+02:00"
    assert got == [
        f"2026-03-29T{gap_text}",
        "2026-10-25T02:30:00.000005+02:00",
        "2026-10-25T02:30:00.000005+01:00",
    ]


@pytest.mark.parametrize(
    ("stamp", "want"),
    [
        (
            datetime(2026, 7, 1, 12, 0, 0, 250000),
            ("2026-07-01T12:00:00.250000+02:00", "2026-07-01T12:00:00.250000-02:30"),
        ),
        (  # a log() timestamp: the same instant, whose local time moves with the zone
            datetime(2026, 7, 1, 10, 0, 0, 250000, tzinfo=timezone.utc).timestamp(),
            ("2026-07-01T12:00:00.250000+02:00", "2026-07-01T07:30:00.250000-02:30"),
        ),
    ],
    ids=["naive datetime", "float"],
)
def test_local_zone_change_after_tzset(stamp: datetime | float, want: tuple[str, str]) -> None:
    """Once time.tzset() switched zones, nothing kept from the earlier zone is reused: a naive timestamp gets the new offset, a float the new zone's local time and offset."""
    with local_zone("Europe/Berlin"):
        berlin = _jsonl_time.iso_timestamp(stamp)
    with local_zone("America/St_Johns"):
        st_johns = _jsonl_time.iso_timestamp(stamp)
    assert (berlin, st_johns) == want


class _NoOffset(tzinfo):
    """A tzinfo that knows no offset: its datetimes count as naive."""

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None


class _Stamp(datetime):
    """A datetime subclass with its own isoformat and astimezone, as pandas' Timestamp has."""

    def isoformat(self, sep: str = "T", timespec: str = "auto") -> str:
        return "sub:" + super().isoformat(sep, timespec)

    def astimezone(self, tz: tzinfo | None = None) -> datetime:
        return datetime.astimezone(self, tz or timezone(timedelta(hours=-12)))


# -- generated events --

_odd_text = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from(["\ud800", "\udfff", "\udc80", "\u2028", '"', "\\", "\x00", "\x7f", "é"]),
    ),
    max_size=8,
)
_floats = st.one_of(
    st.floats(),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-7, 1e16, 1e22, 5e-324]),
)
_limit = sys.get_int_max_str_digits()
_ints = st.one_of(
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.sampled_from([10 ** (_limit - 1), -(10 ** (_limit - 1)), 10**_limit, -(10 ** (_limit + 5))])
    if _limit
    else st.just(10**5000),
)
_values = st.one_of(_ints, _floats, st.booleans(), _odd_text)
_microseconds = st.one_of(st.just(0), st.integers(0, 999_999))
_offsets = st.one_of(
    st.just(timezone.utc),
    st.timedeltas(
        min_value=timedelta(hours=-23, minutes=-59), max_value=timedelta(hours=23, minutes=59)
    ).map(timezone),
    st.sampled_from(
        [timezone(timedelta(seconds=1172)), timezone(timedelta(seconds=-2670, microseconds=7))]
    ),
)


@st.composite
def _naive_near_transition(draw: st.DrawFn, points: list[datetime]) -> datetime:
    point = draw(st.sampled_from(points))
    stamp = point + timedelta(seconds=draw(st.integers(-3 * 3600, 3 * 3600)))
    return stamp.replace(microsecond=draw(_microseconds), fold=draw(st.integers(0, 1)))


def _timestamps(points: list[datetime]) -> st.SearchStrategy[datetime]:
    plain = st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2100, 1, 1)).map(
        lambda ts: ts.replace(microsecond=0) if ts.second % 2 else ts
    )
    return st.one_of(
        _naive_near_transition(points),
        plain,
        plain.map(lambda ts: ts.replace(fold=1)),
        st.tuples(plain, _offsets).map(lambda p: p[0].replace(tzinfo=p[1])),
        plain.map(lambda ts: ts.replace(tzinfo=_NoOffset())),
        plain.map(lambda ts: _Stamp(ts.year, ts.month, ts.day, ts.hour, tzinfo=timezone.utc)),
        plain.map(lambda ts: _Stamp(ts.year, ts.month, ts.day, ts.hour, ts.minute)),
    )


def _events(points: list[datetime]) -> st.SearchStrategy[list[Event]]:
    origins = st.one_of(
        st.none(),
        st.builds(EventOrigin, st.integers(1, 2**22), st.one_of(st.none(), st.integers(0, 64))),
    )

    def make(parts: tuple[str, datetime, dict[str, Any], EventOrigin | None]) -> Event:
        name, stamp, data, origin = parts
        event = Event(name, stamp, data)
        if origin is not None:
            event._origin = origin
        return event

    one = st.tuples(
        _odd_text,
        _timestamps(points),
        st.dictionaries(_odd_text, _values, max_size=6),
        origins,
    ).map(make)
    return st.lists(one, min_size=1, max_size=8)


@functools.cache
def zone_transitions(zone: str) -> list[datetime]:
    """``transitions`` in ``zone`` over ``TRANSITION_YEARS``."""
    with local_zone(zone):
        return transitions(TRANSITION_YEARS)


@pytest.mark.parametrize("zone", ["Europe/Berlin", "Australia/Lord_Howe", "Europe/Amsterdam"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_written_bytes_equal_the_old_writers(zone: str, data: st.DataObject) -> None:
    """Generated events (naive and aware stamps across offset changes, non-finite floats, unicode, lone surrogates, huge ints, origins) give the old writer's bytes and skip counts."""
    events = data.draw(_events(zone_transitions(zone)))
    with local_zone(zone):
        got = written_bytes(events)
        want = reference_bytes(events)
    assert got == want


def test_fixed_cases_equal_the_old_writers() -> None:
    """Hand-picked events (the edge of every fast path) give the old writer's bytes and skip counts."""
    utc = timezone.utc
    events = [
        Event("stat", datetime(2026, 3, 1, 12, tzinfo=utc), {"x.mean": 0.5, "x.count": 3}),
        Event("stat", datetime(2026, 3, 1, 12, 0, 0, 1, tzinfo=utc), {"nan": math.nan}),
        Event("naive", datetime(2026, 3, 1, 12), {"inf": math.inf, "ninf": -math.inf}),
        Event("naive", datetime(2026, 3, 1, 12, 0, 0, 999999), {"big": 10**5000, "ok": 1}),
        Event("n\ud800é", datetime(2026, 3, 1, 12), {"k\udfff": "v\udc80\u2028", "f": 1e-7}),
        Event("offset", datetime(2026, 3, 1, 12, tzinfo=timezone(timedelta(seconds=1172))), {}),
        Event("none", datetime(2026, 3, 1, 12, tzinfo=_NoOffset()), {"b": True}),
        Event("sub", _Stamp(2026, 3, 1, 12, tzinfo=utc), {"i": -(2**70)}),
        Event("sub", _Stamp(2026, 3, 1, 12), {"i": 2**64}),
    ]
    events[0]._origin = EventOrigin(4242, None)
    events[3]._origin = EventOrigin(4243, 2)
    with local_zone("Europe/Berlin"):
        got = written_bytes(events)
        want = reference_bytes(events)
    assert got == want
    assert want[1] == 1


def test_through_a_bus_the_bytes_equal_the_old_writers(tmp_path: Path) -> None:
    """Registered on a bus (which hands it its batches as queued, no Event built per event),
    the writer gives the old writer's bytes for the events the bus delivered: the fixed cases,
    Stat windows, and a child process's events and window with their origin."""
    import monitor_bus

    from . import child_workers
    from .conftest import Recorder

    utc = timezone.utc
    path = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(path)
    recorder = Recorder()
    with local_zone("Europe/Berlin"):
        bus = monitor_bus.get_default_bus()
        bus.register_event_handler(handler, name="jsonl")
        bus.register_event_handler(recorder, name="recorder")
        for event in [
            Event("stat", datetime(2026, 3, 1, 12, tzinfo=utc), {"x.mean": 0.5, "x.count": 3}),
            Event("naive", datetime(2026, 3, 1, 12), {"inf": math.inf, "ninf": -math.inf}),
            Event("naive", datetime(2026, 3, 1, 12, 0, 0, 999999), {"big": 10**5000, "ok": 1}),
            Event("n\ud800é", datetime(2026, 3, 1, 12), {"k\udfff": "v\udc80\u2028", "f": 1e-7}),
            Event("sub", _Stamp(2026, 3, 1, 12), {"i": 2**64}),
        ]:
            bus.log_event(event)
        stat = monitor_bus.Stat("x", [monitor_bus.Aggregation.MEAN], timedelta(hours=1))
        stat.add(0.25)
        child_workers.events_and_a_window_from_forked_children(2, 3)
        assert bus.close(10)
        handler.close()
        want = reference_bytes(recorder.events)
    assert [e.origin is not None for e in recorder.events] == [False] * 5 + [True] * 3 + [False]
    assert (path.read_bytes(), handler.skipped_values) == want
    assert want[1] == 1
