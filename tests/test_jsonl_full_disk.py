"""JsonlEventHandler on a full disk: what is written is counted, what is not is kept (within
a bound) and written when space returns, what is lost is counted as dropped by its handler."""

from __future__ import annotations

import logging
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pytest

from monitor_bus import Event, EventBus, JsonlEventHandler, _jsonl, read_jsonl

from .full_disk import small_disk

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def ev(i: int) -> Event:
    return Event("e", T0, {"i": i, "pad": "x" * 30})


def counts(bus: EventBus) -> tuple[int, int, int, int]:
    (h,) = bus.stats()["handlers"]
    return h["logged"], h["delivered"], h["dropped"], h["pending"]


def lost_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]


def read_back(path: Path) -> tuple[list[int], int]:
    """The ``i`` of each event in the file, and how many lines were skipped as torn."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = read_jsonl(path)
    return [e.data["i"] for e in events], len(caught)  # type: ignore[misc]


def test_a_full_disk_loses_nothing_it_can_keep_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a real full disk (a 64 KiB tmpfs) a write fails part way: ``written`` is the number
    of whole lines in the file, the next 200 (the bound here) are kept and the rest counted as
    dropped by the handler; once space is freed the kept lines follow the one torn line, and
    delivered + dropped == logged, delivered == lines on disk."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    monkeypatch.setattr(_jsonl, "KEEP_LINES", 200)
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        filler = disk / "filler"
        filler.write_bytes(b"x" * 40 * 1024)  # about 240 lines' room left
        path = disk / "run.jsonl"
        sink = JsonlEventHandler(path)
        bus = EventBus(name="disk")
        handle = bus.register_event_handler(sink, name="jsonl")
        for i in range(600):
            bus.log_event(ev(i))
        assert bus.flush(10)
        data = path.read_bytes()
        written = data.count(b"\n")
        torn = not data.endswith(b"\n")
        assert 0 < written < 400
        assert sink.written == written
        assert counts(bus) == (600, written + 200, 400 - written, 0)
        assert bus.stats()["handler_errors"] >= 1  # the OSError, logged by the bus

        filler.unlink()  # space returns: the next flush writes the kept lines
        bus.log_event(ev(600))
        assert bus.flush(10)
        assert counts(bus) == (601, written + 201, 400 - written, 0)
        assert sink.written == written + 201 == path.read_bytes().count(b"\n") - torn
        got, skipped = read_back(path)
        assert got == [*range(written + 200), 600]
        assert skipped == torn  # the torn line was ended: the next line is whole
        assert bus.close(10)
        handler = handle._handler
        assert (handler.delivered, handler.dropped, handler.offered) == (
            written + 201,
            400 - written,
            601,
        )
        assert lost_warnings(caplog)[-1].endswith(f"{400 - written} in all")
        sink.close()
        assert sink.dropped == 400 - written


def test_dev_full_every_event_is_counted_as_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a disk that stays full (/dev/full) nothing counts as written: the handler keeps the
    oldest lines within its bound and drops the rest, and when the bus closes it gives up on
    the kept ones too: every event is dropped, and the warning says so."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    monkeypatch.setattr(_jsonl, "KEEP_LINES", 4)
    sink = JsonlEventHandler("/dev/full")
    bus = EventBus(name="full")
    handle = bus.register_event_handler(sink, name="jsonl")
    for i in range(10):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert counts(bus) == (10, 4, 6, 0)  # 4 kept for another try
    assert bus.close(10)
    handler = handle._handler
    assert (handler.delivered, handler.dropped) == (0, 10)
    assert (sink.written, sink.dropped) == (0, 10)
    reports = lost_warnings(caplog)
    assert sum(int(r.split(" could not write ")[1].split()[0]) for r in reports) == 10
    assert reports[-1].startswith("EventBus 'full': handler 'jsonl' could not write ")
    assert reports[-1].endswith(
        " events it was given (see its errors), dropped since the last report, 10 in all"
    )
    sink.close()  # nothing left to write


def test_close_counts_what_it_cannot_write_and_raises() -> None:
    """Closing a handler whose last write fails raises the OSError and counts the lines."""
    sink = JsonlEventHandler("/dev/full")
    for i in range(3):
        sink(ev(i))
    with pytest.raises(OSError, match="No space left"):
        sink.close()
    assert (sink.written, sink.dropped) == (0, 3)
    sink.close()  # idempotent
