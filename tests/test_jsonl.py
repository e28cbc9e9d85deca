"""JsonlEventHandler and read_jsonl: the line format, batching, round trips and torn lines."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import monitor_bus
from monitor_bus import (
    STAT_EVENT,
    Aggregation,
    Event,
    JsonlEventHandler,
    Stat,
    _jsonl_encode,
    read_jsonl,
)

from .conftest import require

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

UTC = timezone.utc
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
ENCODERS = ["fast", "stdlib"]


@contextmanager
def encoder(kind: str) -> Iterator[None]:
    """Handlers encode data with orjson (``"fast"``) or the standard library meanwhile."""
    if kind == "fast":
        require(
            _jsonl_encode._fast_encode_data is not None, "orjson (the fast extra) is not installed"
        )
    chosen = (
        _jsonl_encode._fast_encode_data if kind == "fast" else _jsonl_encode._stdlib_encode_data
    )
    saved = _jsonl_encode._encode_data
    _jsonl_encode._encode_data = chosen  # type: ignore[assignment]
    try:
        yield
    finally:
        _jsonl_encode._encode_data = saved


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines()]


def test_line_format(tmp_path: Path) -> None:
    """Each event is one line: name, ISO 8601 timestamp with offset, data; non-finite floats as {"$float": ...}."""
    path = tmp_path / "run.jsonl"
    with JsonlEventHandler(path) as handler:
        handler(Event("a", T0, {"i": 3, "f": 1.0, "b": True, "s": "x", "nan": math.nan}))
        handler(Event("b", T0, {"inf": math.inf, "ninf": -math.inf}))
    text = path.read_text("utf-8")
    assert text == (
        '{"name":"a","timestamp":"2026-03-01T12:00:00.123456+00:00","data":'
        '{"i":3,"f":1.0,"b":true,"s":"x","nan":{"$float":"NaN"}}}\n'
        '{"name":"b","timestamp":"2026-03-01T12:00:00.123456+00:00","data":'
        '{"inf":{"$float":"Infinity"},"ninf":{"$float":"-Infinity"}}}\n'
    )
    # Standard JSON: a strict parser (no NaN/Infinity tokens) reads every line.
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard token {c}"))


@pytest.mark.parametrize("kind", ENCODERS)
def test_round_trip_types_unicode_and_non_finite(tmp_path: Path, kind: str) -> None:
    """read_jsonl gives back equal events, either encoder: unicode names, ints of any size,
    floats, bools, strings, infinities, offsets; NaN stays NaN."""
    tz = timezone(timedelta(hours=-5, minutes=-30))
    logged = [
        Event(
            "训练.损失 🚀",
            T0,
            {"ключ": "значение ✓", "n": 2**70, "zero": 0.0, "t": True, "f": False},
        ),
        Event(
            "ints", T0, {"max": 2**64 - 1, "past": 2**64, "min": -(2**63), "below": -(2**63) - 1}
        ),
        Event("floats", T0, {"tiny": 1e-7, "big": 1e16, "one": 1.0, "max": 1.7976931348623157e308}),
        Event("inf", T0.astimezone(tz), {"pos": math.inf, "neg": -math.inf, "small": 5e-324}),
        Event("empty", T0, {}),
    ]
    path = tmp_path / "run.jsonl"
    with encoder(kind), JsonlEventHandler(path) as handler:
        for event in logged:
            handler(event)
        handler(Event("nan", T0, {"x": math.nan}))
    back = read_jsonl(path)
    assert back[:5] == logged
    assert [type(v) for v in back[0].data.values()] == [str, int, float, bool, bool]
    assert [type(v) for v in back[1].data.values()] == [int] * 4
    assert [type(v) for v in back[2].data.values()] == [float] * 4
    assert back[3].timestamp.utcoffset() == timedelta(hours=-5, minutes=-30)
    assert back[5].name == "nan"
    assert list(back[5].data) == ["x"]
    assert math.isnan(back[5].data["x"])


def test_naive_timestamps_read_back_as_local_time(tmp_path: Path) -> None:
    """A naive timestamp is written as local time with its offset and reads back as that aware time."""
    naive = datetime(2026, 7, 4, 9, 30, 15, 250)
    path = tmp_path / "run.jsonl"
    with JsonlEventHandler(path) as handler:
        handler(Event("x", naive, {}))
    (event,) = read_jsonl(path)
    assert event.timestamp.utcoffset() is not None
    assert event.timestamp == naive.astimezone()
    assert event.timestamp.replace(tzinfo=None) == naive


@settings(max_examples=60, deadline=None)
@given(
    name=st.text(min_size=0, max_size=20),
    data=st.dictionaries(
        st.text(max_size=10),
        st.one_of(
            st.integers(),
            st.floats(allow_nan=False),
            st.booleans(),
            st.text(max_size=20),
        ),
        max_size=6,
    ),
    micros=st.integers(0, 10**12),
)
@pytest.mark.parametrize("kind", ENCODERS)
def test_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    name: str,
    data: dict[str, Any],
    micros: int,
) -> None:
    """Any event with aware timestamp and plain data (NaN aside) reads back equal, value types
    included, either encoder."""
    path = tmp_path_factory.mktemp("rt") / "run.jsonl"
    event = Event(name, T0 + timedelta(microseconds=micros), data)
    with encoder(kind), JsonlEventHandler(path) as handler:
        handler(event)
    (back,) = read_jsonl(path)
    assert back == event
    assert [type(v) for v in back.data.values()] == [type(v) for v in event.data.values()]


def test_writes_happen_at_flush(tmp_path: Path) -> None:
    """__call__ only buffers; flush() writes the batch out."""
    path = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(path)
    handler(Event("a", T0, {"x": 1}))
    handler(Event("b", T0, {"x": 2}))
    assert path.read_bytes() == b""
    assert handler.written == 0
    handler.flush()
    assert [d["name"] for d in lines(path)] == ["a", "b"]
    assert handler.written == 2
    handler.close()


def test_on_a_bus_everything_is_on_disk_after_flush(
    bus: monitor_bus.EventBus, tmp_path: Path
) -> None:
    """After bus.flush(), every logged event is in the file, Stat windows included, in order."""
    path = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(path)
    bus.register_event_handler(handler, name="jsonl")
    logged = [Event("step", T0 + timedelta(seconds=i), {"i": i}) for i in range(500)]
    for event in logged:
        bus.log_event(event)
    stat = Stat("lat", [Aggregation.MAX], timedelta(hours=1), max_samples=2, bus=bus)
    stat.add(1.0)
    stat.add(4.0)  # the window is full: it is logged now
    assert bus.flush(timeout=10)
    back = read_jsonl(path)
    assert back[:500] == logged
    assert [(e.name, e.data) for e in back[500:]] == [(STAT_EVENT, {"lat.max": 4.0})]
    assert back[500].timestamp.tzinfo is not None
    assert bus.stats()["handlers"][0]["delivered"] == 501
    handler.close()


def test_unregister_writes_the_rest(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """unregister_event_handler returns only once the handler has written what was logged before it."""
    path = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(path)
    handle = bus.register_event_handler(handler)
    for i in range(100):
        bus.log_event(Event("e", T0, {"i": i}))
    assert bus.unregister_event_handler(handle, timeout=10)
    assert [e.data["i"] for e in read_jsonl(path)] == list(range(100))
    handler.close()


def test_appends_and_keeps_existing_lines(tmp_path: Path) -> None:
    """A second handler on the same file appends after what is there."""
    path = tmp_path / "run.jsonl"
    for i in range(2):
        with JsonlEventHandler(path) as handler:
            handler(Event("run", T0, {"i": i}))
    assert [e.data for e in read_jsonl(path)] == [{"i": 0}, {"i": 1}]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_writes_to_a_pipe(tmp_path: Path) -> None:
    """A named pipe (or /dev/stdout) works as the path: lines stream to the reader."""
    fifo = tmp_path / "events.pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    with JsonlEventHandler(fifo) as handler:
        handler(Event("piped", T0, {"x": 1}))
    reader.join(10)
    assert received == [
        b'{"name":"piped","timestamp":"2026-03-01T12:00:00.123456+00:00","data":{"x":1}}\n'
    ]


def test_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """A last line cut mid-write (even mid UTF-8 character) is skipped with a warning naming it."""
    path = tmp_path / "run.jsonl"
    with JsonlEventHandler(path) as handler:
        handler(Event("kept", T0, {"x": 1}))
        handler(Event("torn ✓", T0, {"x": 2}))
    data = path.read_bytes()
    cut = data.index("✓".encode()) + 1  # inside the 3-byte character
    path.write_bytes(data[:cut])
    with pytest.warns(
        UserWarning, match=r"run\.jsonl, line 2: skipped a line that is not valid JSON"
    ):
        back = read_jsonl(path)
    assert back == [Event("kept", T0, {"x": 1})]


def test_appending_after_a_torn_line_starts_a_new_line(tmp_path: Path) -> None:
    """Appending to a file that ends in a torn line keeps the new events readable."""
    path = tmp_path / "run.jsonl"
    path.write_bytes(
        b'{"name":"old","timestamp":"2026-03-01T12:00:00+00:00","data":{}}\n{"name":"cr'
    )
    with JsonlEventHandler(path) as handler:
        handler(Event("new", T0, {"x": 1}))
    with pytest.warns(UserWarning, match="line 2"):
        back = read_jsonl(path)
    assert [e.name for e in back] == ["old", "new"]


def test_not_jsonl_at_all_raises(tmp_path: Path) -> None:
    """A file with no valid line is a ValueError naming it, not a list of warnings and nothing."""
    path = tmp_path / "picture.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    with (
        pytest.warns(UserWarning, match=r"picture\.png, line \d: skipped"),
        pytest.raises(ValueError, match=r"picture\.png: no line is a valid JSON event"),
    ):
        read_jsonl(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "expected a JSON object"),
        (
            '{"name": 1, "timestamp": "2026-01-01T00:00:00+00:00", "data": {}}',
            "'name' must be a string",
        ),
        ('{"name": "a", "timestamp": "yesterday", "data": {}}', "not ISO 8601"),
        ('{"name": "a", "timestamp": "2026-01-01T00:00:00", "data": {}}', "no UTC offset"),
        (
            '{"name": "a", "timestamp": "2026-01-01T00:00:00+00:00", "data": []}',
            "'data' must be an object",
        ),
        (
            '{"name": "a", "timestamp": "2026-01-01T00:00:00+00:00", "data": {"k": [1]}}',
            "data\\['k'\\]",
        ),
        (
            '{"name": "a", "timestamp": "2026-01-01T00:00:00+00:00", "data": {"k": {"$float": "big"}}}',
            "data\\['k'\\]",
        ),
        (
            '{"name": "a", "timestamp": "2026-01-01T00:00:00+00:00", "data": {"k": null}}',
            "data\\['k'\\]",
        ),
    ],
)
def test_valid_json_that_is_not_an_event_raises(tmp_path: Path, line: str, message: str) -> None:
    """A JSON line that is not an event is a ValueError naming the file, line and problem."""
    path = tmp_path / "run.jsonl"
    path.write_text(
        '{"name":"ok","timestamp":"2026-01-01T00:00:00+00:00","data":{}}\n' + line + "\n"
    )
    with pytest.raises(ValueError, match=rf"run\.jsonl, line 2: .*{message}"):
        read_jsonl(path)


def test_bad_paths(tmp_path: Path) -> None:
    """Bad paths raise at once: TypeError for a non-path, OSError naming a directory or a missing file."""
    with pytest.raises(TypeError, match="path must be"):
        JsonlEventHandler(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path must be"):
        read_jsonl(None)  # type: ignore[arg-type]
    with pytest.raises(IsADirectoryError) as info:
        JsonlEventHandler(tmp_path)
    assert info.value.filename == str(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(IsADirectoryError):
        read_jsonl(tmp_path)


def test_closed_handler_raises_and_close_is_idempotent(tmp_path: Path) -> None:
    """After close(), a call raises ValueError (counted by the bus as a handler error); flush/close are no-ops."""
    path = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(path)
    handler(Event("a", T0, {}))
    handler.close()
    handler.close()
    handler.flush()
    with pytest.raises(ValueError, match="closed"):
        handler(Event("b", T0, {}))
    assert [e.name for e in read_jsonl(path)] == ["a"]


def test_flush_is_safe_from_another_thread(tmp_path: Path) -> None:
    """flush() from another thread while events are added loses and duplicates nothing."""
    path = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(path)
    done = threading.Event()

    def flusher() -> None:
        while not done.is_set():
            handler.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    for i in range(5000):
        handler(Event("e", T0, {"i": i}))
    done.set()
    thread.join()
    handler.close()
    assert [e.data["i"] for e in read_jsonl(path)] == list(range(5000))


def test_int_too_long_for_text_is_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An int over Python's int-to-text digit limit is skipped and counted; the event is written."""
    import sys

    if not hasattr(sys, "get_int_max_str_digits"):
        pytest.skip("this Python (before 3.10.7) has no int-to-text digit limit")
    monkeypatch.setattr("monitor_bus._skipped._clock", lambda: 100.0)
    path = tmp_path / "run.jsonl"
    with JsonlEventHandler(path) as handler:
        handler(Event("a", T0, {"big": 10**5000, "ok": 1, "limit": 10**4299, "nan": math.nan}))
        handler(Event("a", T0, {"big": -(10**5000)}))
        handler(Event("b", T0, {"n": 2}))
    assert [d["data"] for d in lines(path)] == [
        {"ok": 1, "limit": 10**4299, "nan": {"$float": "NaN"}},
        {},
        {"n": 2},
    ]
    assert (handler.written, handler.skipped_values) == (3, 2)
    limit = sys.get_int_max_str_digits()
    assert [r.getMessage() for r in caplog.records if r.name == "monitor_bus"] == [
        f"JsonlEventHandler({str(path)!r}): data['big'] of event 'a' is an int too long to "
        f"write as decimal text (sys.get_int_max_str_digits() is {limit}): skipped (1 so far; "
        "repeats of this key are logged at most every 10 s)"
    ]


def test_lone_surrogates_are_written_as_escapes_and_read_back(tmp_path: Path) -> None:
    """Text holding lone surrogates (os.fsdecode of a non-UTF-8 file name) is written as \\u
    escapes, so the batch around it is written and the file stays UTF-8."""
    path = tmp_path / "run.jsonl"
    logged = [
        Event("before", T0, {"n": 1}),
        Event("odd\udc80", T0, {"path\ud800": "run\udcff.bin", "n": 2}),
        Event("after", T0, {"n": 3}),
    ]
    with JsonlEventHandler(path) as handler:
        for event in logged:
            handler(event)
        handler.flush()
        assert handler.written == 3
    text = path.read_bytes().decode("utf-8")
    assert text.splitlines()[1] == (
        '{"name":"odd\\udc80","timestamp":"2026-03-01T12:00:00.123456+00:00",'
        '"data":{"path\\ud800":"run\\udcff.bin","n":2}}'
    )
    assert read_jsonl(path) == logged


class _LossOnly(JsonlEventHandler):
    """Keeps the events named "loss" only: a subclass that changes ``__call__`` alone."""

    def __call__(self, event: Event) -> None:
        if event.name == "loss":
            super().__call__(event)


def test_the_bus_calls_a_subclass_that_redefines_call(tmp_path: Path) -> None:
    """The bus hands batches to the writer's own batch calls only where nothing below them
    redefined ``__call__``: a subclass's ``__call__`` still decides what is written."""
    path = tmp_path / "loss.jsonl"
    handler = _LossOnly(path)
    bus = monitor_bus.EventBus(name="subclass")
    bus.register_event_handler(handler, name="jsonl")
    for i in range(6):
        bus.log_event(Event("loss" if i % 2 else "lr", T0, {"i": i}))
    assert bus.close(10)
    handler.close()
    assert [e.data["i"] for e in monitor_bus.read_jsonl(path)] == [1, 3, 5]


class _TrainOnly:
    """A mixin whose ``handle_batch`` keeps the "train.*" events, then hands them on."""

    def handle_batch(self, events: list[Event]) -> None:
        super().handle_batch([e for e in events if e.name.startswith("train.")])  # type: ignore[misc]


class _MixedIn(_TrainOnly, JsonlEventHandler):
    pass


def test_the_bus_calls_a_handle_batch_mixed_in_before_the_writer(tmp_path: Path) -> None:
    """A ``handle_batch`` that comes first in the MRO (a mixin) is what the bus calls, not the
    writer's own way of taking batches."""
    path = tmp_path / "mixed.jsonl"
    handler = _MixedIn(path)
    bus = monitor_bus.EventBus(name="mixin")
    bus.register_event_handler(handler, name="jsonl")
    for name in ("train.a", "eval.a", "train.b"):
        bus.log_event(Event(name, T0, {"i": 1}))
    assert bus.close(10)
    handler.close()
    assert [e.name for e in read_jsonl(path)] == ["train.a", "train.b"]


def test_the_bus_calls_a_handle_batch_set_on_the_instance(tmp_path: Path) -> None:
    """A ``handle_batch`` set on one writer instance is what the bus calls for it."""
    path = tmp_path / "own.jsonl"
    handler = JsonlEventHandler(path)
    seen: list[int] = []
    handler.handle_batch = lambda events: seen.append(len(events))  # type: ignore[method-assign]
    bus = monitor_bus.EventBus(name="own")
    bus.register_event_handler(handler, name="jsonl")
    for i in range(3):
        bus.log_event(Event("e", T0, {"i": i}))
    assert bus.close(10)
    handler.close()
    assert seen == [3]
    assert path.read_bytes() == b""


def test_orjson_encodes_when_installed() -> None:
    """With orjson installed (the ``fast`` extra), handlers encode data with it."""
    require(_jsonl_encode._fast_encode_data is not None, "orjson (the fast extra) is not installed")
    assert _jsonl_encode._encode_data is _jsonl_encode._fast_encode_data


def test_lines_orjson_refuses_take_the_stdlib_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With orjson, exactly the data it refuses (an int past 64 bits, a lone surrogate) or
    would write as null (NaN, an infinity; a string holding ``:null``, to be exact) goes
    through the standard library's encoder; every line reads back equal."""
    stdlib = _jsonl_encode._stdlib_encode_data
    took: list[dict[str, Any]] = []

    def counting(data: dict[str, Any]) -> str:
        took.append(dict(data))
        return stdlib(data)

    monkeypatch.setattr(_jsonl_encode, "_stdlib_encode_data", counting)
    events = [
        Event("fits", T0, {"max": 2**64 - 1, "min": -(2**63), "f": 1e-7}),
        Event("past", T0, {"n": 2**64}),
        Event("below", T0, {"n": -(2**63) - 1}),
        Event("surrogate", T0, {"s": "a\ud800"}),
        Event("null text", T0, {"s": "x:null"}),
        Event("inf", T0, {"x": math.inf}),
    ]
    path = tmp_path / "run.jsonl"
    with encoder("fast"), JsonlEventHandler(path) as handler:
        for event in events:
            handler(event)
    assert took == [
        {"n": 2**64},
        {"n": -(2**63) - 1},
        {"s": "a\ud800"},
        {"s": "x:null"},
        {"x": math.inf},  # raises there: the line is written with {"$float": ...}
    ]
    assert read_jsonl(path) == events
    first = path.read_text("utf-8").splitlines()[0]
    assert first.endswith(
        '"data":{"max":18446744073709551615,"min":-9223372036854775808,"f":1e-7}}'
    )


@pytest.mark.parametrize("kind", ENCODERS)
def test_a_value_of_another_type_goes_to_the_one_default_hook(kind: str) -> None:
    """Either encoder hands a value JSON has no type for to ``_jsonl_encode._default`` (one hook for
    both); with none defined for it, a TypeError names its type."""

    class Odd:
        pass

    with (
        encoder(kind),
        pytest.raises(TypeError, match=r"^Object of type Odd is not JSON serializable$"),
    ):
        _jsonl_encode._encode_data({"ok": 1, "odd": Odd()})


class _NoOffset(tzinfo):
    """A zone whose offset cannot be had: an event stamped with it cannot be written."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise ValueError("this zone has no offset")

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)


def test_an_event_that_cannot_be_encoded_costs_that_event_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a bus, one event of a batch of 400 that cannot be encoded (its timestamp has no
    offset) is the only one lost: the 399 others are written, the bad one counts as dropped
    by the sink and on the bus, with one error logged and a warning naming the drop."""
    path = tmp_path / "run.jsonl"
    sink = JsonlEventHandler(path)
    bus = monitor_bus.EventBus(name="encode")
    bus._linger = 30.0  # one batch: drained at flush
    bus.register_event_handler(sink, name="jsonl")
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        for e in unencodable_at(200):
            bus.log_event(e)
        assert bus.flush(10)
        (stats,) = bus.stats()["handlers"]
        assert bus.close(10)
    sink.close()
    assert [e.data["i"] for e in read_jsonl(path)] == [i for i in range(400) if i != 200]
    assert (stats["delivered"], stats["dropped"], stats["errors"]) == (399, 1, 1)
    assert (sink.written, sink.dropped) == (399, 1)
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in records] == [logging.ERROR, logging.WARNING]
    assert records[0][1].startswith("event handler 'jsonl' raised ValueError (error 1 ")
    assert records[1][1].startswith("EventBus 'encode': handler 'jsonl' could not write 1 ")


def test_handle_batch_writes_the_events_it_can_and_raises_for_the_others(tmp_path: Path) -> None:
    """``handle_batch`` of 400 events, one of which cannot be encoded, keeps the 399 others for
    the file and raises the one failure in an ``ExceptionGroup``, counting it as dropped."""
    sink = JsonlEventHandler(tmp_path / "run.jsonl")
    with pytest.raises(ExceptionGroup) as raised:
        sink.handle_batch(unencodable_at(200))
    assert [type(e) for e in raised.value.exceptions] == [ValueError]
    sink.close()
    assert [e.data["i"] for e in read_jsonl(tmp_path / "run.jsonl")] == [
        i for i in range(400) if i != 200
    ]
    assert (sink.written, sink.dropped) == (399, 1)


def unencodable_at(bad: int) -> list[Event]:
    """400 events, the one at ``bad`` stamped in a zone without an offset."""
    events = [Event("e", T0 + timedelta(seconds=i), {"i": i}) for i in range(400)]
    events[bad] = Event("bad", datetime(2026, 1, 1, tzinfo=_NoOffset()), {"i": bad})
    return events
