"""read_jsonl and iter_jsonl on files the writer did not quite make: a BOM, deep nesting, long ints."""

from __future__ import annotations

import codecs
import json
import math
import re
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pytest

from monitor_bus import STAT_EVENT, Event, EventBus, Histogram, JsonlEventHandler, read_jsonl
from monitor_bus._jsonl_read import iter_jsonl

from .conftest import WINDOW_SAMPLES, Recorder, distribution_window, real_window

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
LINE = '{"name":"a","timestamp":"2026-03-01T12:00:00+00:00","data":{"x":1}}'
EVENT = Event("a", T0, {"x": 1})


def test_bom_on_the_first_line_is_not_a_torn_write(tmp_path: Path) -> None:
    """A UTF-8 BOM before the first line (as some editors save) is read past, with no warning."""
    run = tmp_path / "run.jsonl"
    run.write_bytes(codecs.BOM_UTF8 + f"{LINE}\n{LINE}\n".encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_jsonl(run) == [EVENT, EVENT]


def test_bom_alone_on_the_first_line_is_a_blank_line(tmp_path: Path) -> None:
    """A BOM followed by a newline counts as a blank first line, not a torn one."""
    run = tmp_path / "run.jsonl"
    run.write_bytes(codecs.BOM_UTF8 + f"\n{LINE}\n".encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_jsonl(run) == [EVENT]


def test_a_bom_past_the_first_line_is_a_bad_line(tmp_path: Path) -> None:
    """Only the file may start with a BOM: one inside is skipped like any line that is not JSON."""
    run = tmp_path / "run.jsonl"
    run.write_bytes(f"{LINE}\n".encode() + codecs.BOM_UTF8 + f"{LINE}\n".encode())
    with pytest.warns(UserWarning, match="line") as caught:
        assert read_jsonl(run) == [EVENT]
    assert [str(w.message) for w in caught] == [
        f"{run}, line 2: skipped a line that is not valid JSON (a write cut short by a crash or a full disk?)"
    ]


@pytest.mark.parametrize("opening", ['{"a":', "["])
def test_deeply_nested_json_is_not_an_event(tmp_path: Path, opening: str) -> None:
    """A line nested 100,000 deep is a ValueError naming the file and line, not a RecursionError."""
    run = tmp_path / "run.jsonl"
    run.write_text(f"{LINE}\n" + opening * 100_000 + "\n")
    with pytest.raises(ValueError, match="nested") as info:
        read_jsonl(run)
    assert str(info.value) == (
        f"{run}, line 2: JSON nested deeper than an event can be; not a monitor_bus JSONL file?"
    )


def test_an_int_too_long_for_this_python_is_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    """An int over sys.get_int_max_str_digits() digits is skipped with a warning; its event's other keys stay."""
    digits = sys.get_int_max_str_digits() + 1
    run = tmp_path / "run.jsonl"
    run.write_text(
        '{"name":"a","timestamp":"2026-03-01T12:00:00+00:00","data":{"big":'
        + "9" * digits
        + ',"x":1,"s":"t"}}\n'
        + f"{LINE}\n"
    )
    with pytest.warns(UserWarning, match="line") as caught:
        events = read_jsonl(run)
    assert events == [Event("a", T0, {"x": 1, "s": "t"}), EVENT]
    assert [str(w.message) for w in caught] == [
        f"{run}, line 1: data['big']: skipped an int of {digits} digits, more than "
        f"sys.get_int_max_str_digits() ({digits - 1}) lets Python read"
    ]


def test_huge_ints_the_writer_wrote_read_back_exactly(tmp_path: Path) -> None:
    """10**400 (beyond float64, within the digit limit) written by the handler reads back as that int."""
    run = tmp_path / "run.jsonl"
    with JsonlEventHandler(run) as handler:
        handler(Event(STAT_EVENT, T0, {"x.sum": 10**400, "y.mean": 1.5}))
        handler(Event("plain", T0, {"n": -(10**400)}))
    assert read_jsonl(run) == [
        Event(STAT_EVENT, T0, {"x.sum": 10**400, "y.mean": 1.5}),
        Event("plain", T0, {"n": -(10**400)}),
    ]


def test_iter_jsonl_reads_lazily(tmp_path: Path) -> None:
    """iter_jsonl yields each event as its line is read: a third line that is JSON but not an
    event reaches the callback only when read, and the reading goes on past it."""
    run = tmp_path / "run.jsonl"
    run.write_text(f"{LINE}\n{LINE}\n[1]\n{LINE}\n")
    skipped: list[tuple[int, str, str]] = []
    events = iter_jsonl(run, lambda *skip: skipped.append(skip))
    assert next(events) == EVENT
    assert next(events) == EVENT
    assert skipped == []
    assert next(events) == EVENT
    assert skipped == [(3, "event", "expected a JSON object, got list")]
    assert list(events) == []


def test_read_jsonl_stops_at_a_line_that_is_not_an_event(tmp_path: Path) -> None:
    """read_jsonl, unlike iter_jsonl's callers, raises at a JSON line that is not an event,
    naming the file, the line and why (the file is not what the handler writes)."""
    run = tmp_path / "run.jsonl"
    run.write_text(
        f'{LINE}\n{{"name":"a","timestamp":"2026-03-01T12:00:00+00:00","data":{{"x":[1]}}}}\n'
    )
    with pytest.raises(ValueError, match="line") as info:
        read_jsonl(run)
    assert str(info.value) == f"{run}, line 2: data['x'] is not a value: [1]"
    assert info.value.__context__ is None


def test_iter_jsonl_reports_skips_to_the_callback(tmp_path: Path) -> None:
    """Each skip reaches the callback as (line, kind, message) and no warning is issued."""
    run = tmp_path / "run.jsonl"
    long_int = "9" * (sys.get_int_max_str_digits() + 1)
    run.write_text(
        f'{LINE}\n{{"name":\n{{"name":"a","timestamp":"2026-03-01T12:00:00+00:00","data":{{"n":{long_int}}}}}\n'
    )
    skipped: list[tuple[int, str, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        events = list(iter_jsonl(run, lambda *skip: skipped.append(skip)))
    assert events == [EVENT, Event("a", T0, {})]
    assert [(line, kind) for line, kind, _ in skipped] == [(2, "line"), (3, "value")]


def test_iter_jsonl_file_without_a_valid_line(tmp_path: Path) -> None:
    """A file with no valid line raises ValueError once it has been read through."""
    run = tmp_path / "run.jsonl"
    run.write_bytes(b"\xff\xfe\n{\n")
    skipped: list[tuple[int, str, str]] = []
    with pytest.raises(ValueError, match="no line is a valid JSON event"):
        list(iter_jsonl(run, lambda *skip: skipped.append(skip)))
    assert [line for line, _, _ in skipped] == [1, 2]


def test_read_jsonl_warning_points_at_the_caller(tmp_path: Path) -> None:
    """The torn-line warning is attributed to the code calling read_jsonl."""
    run = tmp_path / "run.jsonl"
    run.write_text(f"{LINE}\n{{\n")
    with pytest.warns(UserWarning, match="line") as caught:
        read_jsonl(run)
    assert [w.filename for w in caught] == [__file__]


def test_a_line_torn_after_a_long_int_is_a_torn_line(tmp_path: Path) -> None:
    """A line cut short after an over-long int is skipped as torn, like any other cut line."""
    run = tmp_path / "run.jsonl"
    long_int = "9" * (sys.get_int_max_str_digits() + 1)
    run.write_text(f'{LINE}\n{{"name":"a","data":{{"n":{long_int},"m"\n')
    with pytest.warns(UserWarning, match="line") as caught:
        assert read_jsonl(run) == [EVENT]
    assert [str(w.message) for w in caught] == [
        f"{run}, line 2: skipped a line that is not valid JSON (a write cut short by a crash or a full disk?)"
    ]


def test_a_window_histogram_reads_back_equal(tmp_path: Path, bus: EventBus) -> None:
    """A window's Histogram is written as {"$histogram": to_dict()} and read back equal, its
    percentiles and stddev as floats, NaN and infinite samples included."""
    run = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(run)
    bus.register_event_handler(handler)
    windows = [distribution_window(s) for s in (*WINDOW_SAMPLES, [1.5, math.nan, -math.inf])]
    for window in windows:
        bus.log_event(window)
    assert bus.flush(10)
    handler.close()
    lines = run.read_text().splitlines()
    histogram = windows[0].data["lat.histogram"]
    assert json.loads(lines[0])["data"]["lat.histogram"] == {"$histogram": histogram.to_dict()}
    events = read_jsonl(run)
    assert [e.data for e in events] == [w.data for w in windows]
    assert [type(e.data["lat.histogram"]) for e in events] == [Histogram] * 3
    assert events[2].data["lat.histogram"].nan_count == 1


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"$histogram": {"scale": 99}}, "is not a valid histogram: scale must be at most 20"),
        ({"$histogram": [1, 2]}, "is not a value"),
        ({"$histogram": {}, "x": 1}, "is not a value"),
    ],
)
def test_a_bad_histogram_object_is_not_an_event(tmp_path: Path, value: object, why: str) -> None:
    """An object under "$histogram" that from_dict refuses, or that is not one, is named."""
    run = tmp_path / "run.jsonl"
    line = {"name": STAT_EVENT, "timestamp": "2026-03-01T12:00:00+00:00", "data": {"h": value}}
    run.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"line 1: data['h'] {why}")):
        read_jsonl(run)


def test_a_real_stat_window_reads_back_as_logged(
    tmp_path: Path, bus: EventBus, recorder: Recorder
) -> None:
    """A window of a real Stat with distributions reads back equal to what the bus delivered."""
    run = tmp_path / "run.jsonl"
    handler = JsonlEventHandler(run)
    bus.register_event_handler(handler)
    bus.register_event_handler(recorder)
    real_window(bus, WINDOW_SAMPLES[0])
    assert bus.flush(10)
    handler.close()
    (event,) = read_jsonl(run)
    assert event.data == recorder.events[0].data
    assert event.data["lat.histogram"] == Histogram.of(WINDOW_SAMPLES[0])


def test_a_number_beyond_a_float_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """``1e999`` (valid JSON, beyond a float: Python would read infinity) is skipped with a
    warning naming the line and key, the rest of the event kept; the ``NaN`` and ``Infinity``
    Python's json writes read back as they say, and ``$float`` objects as ever."""
    run = tmp_path / "run.jsonl"
    head = '{"name":"a","timestamp":"2026-03-01T12:00:00+00:00","data":'
    run.write_text(
        f'{head}{{"x":1e999,"y":2.5,"z":-1.5e400}}}}\n'
        f'{head}{{"x":Infinity,"y":NaN,"z":{{"$float":"-Infinity"}}}}}}\n'
    )
    beyond = "a number beyond a float's range (JSON has no infinity), not read as one"
    with pytest.warns(UserWarning, match="beyond a float") as caught:
        first, second = read_jsonl(run)
    assert [str(w.message) for w in caught] == [
        f"{run}, line 1: data['x']: skipped 1e999, {beyond}",
        f"{run}, line 1: data['z']: skipped -1.5e400, {beyond}",
    ]
    assert first == Event("a", T0, {"y": 2.5})
    assert second.data["x"] == math.inf
    assert math.isnan(second.data["y"])
    assert second.data["z"] == -math.inf


def test_a_line_past_the_bound_is_skipped_and_reading_goes_on(tmp_path: Path) -> None:
    """A line longer than ``max_line`` bytes is reported as too long (kind ``"line"``) and
    skipped without being held whole; the lines around it are read, a line of exactly the bound
    too."""
    run = tmp_path / "run.jsonl"
    fits = LINE[:-2] + ',"s":"' + "y" * (100 - len(LINE) - 7) + '"}}'
    assert len(fits) == 100
    run.write_text(f"{LINE}\n{'z' * 1000}\n{fits}\n{'w' * 101}")
    skips: list[tuple[int, str, str]] = []
    events = list(iter_jsonl(run, lambda *skip: skips.append(skip), max_line=100))
    assert [e.name for e in events] == ["a", "a"]
    assert skips == [
        (2, "line", "skipped a line of 1,000 bytes, longer than the 100 a line is read up to"),
        (4, "line", "skipped a line of 101 bytes, longer than the 100 a line is read up to"),
    ]
