"""Exceptions everywhere: every kind a handler can raise is caught, counted and logged once."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from anyio.lowlevel import checkpoint

from monitor_bus import (
    STAT_EVENT,
    Event,
    EventBus,
    JsonlEventHandler,
    TensorboardEventHandler,
    read_jsonl,
)

from ..conftest import Recorder
from .conftest import Figures

N = 200


class CustomBaseException(BaseException):
    """A BaseException subclass that is not an Exception."""


class UnprintableError(Exception):
    """An exception whose __str__ and __repr__ raise."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ failed")


def _raiser(exc_type: type[BaseException]):  # noqa: ANN202
    def handler(event: Event) -> None:
        raise exc_type("from a handler")

    return handler


def _async_raiser(exc_type: type[BaseException]):  # noqa: ANN202
    async def handler(event: Event) -> None:
        await checkpoint()
        raise exc_type("from an async handler after an await")

    return handler


class FailingSink:
    """A buffering sink whose flush() (run after each batch) and close() raise."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, event: Event) -> None:
        self.seen += 1

    def flush(self) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        raise OSError("close failed")


RAISERS = {
    "sync-ValueError": (_raiser(ValueError), ValueError),
    "sync-BaseException-subclass": (_raiser(CustomBaseException), CustomBaseException),
    "sync-KeyboardInterrupt": (_raiser(KeyboardInterrupt), KeyboardInterrupt),
    "sync-SystemExit": (_raiser(SystemExit), SystemExit),
    "sync-GeneratorExit": (_raiser(GeneratorExit), GeneratorExit),
    "sync-unprintable": (_raiser(UnprintableError), UnprintableError),
    "async-ValueError": (_async_raiser(ValueError), ValueError),
    "async-BaseException-subclass": (_async_raiser(CustomBaseException), CustomBaseException),
    "async-KeyboardInterrupt": (_async_raiser(KeyboardInterrupt), KeyboardInterrupt),
    "async-SystemExit": (_async_raiser(SystemExit), SystemExit),
    "async-unprintable": (_async_raiser(UnprintableError), UnprintableError),
}


def _events(n: int, start: int = 0) -> list[Event]:
    now = datetime.now(timezone.utc)
    return [Event("exc", now, {"i": i}) for i in range(start, start + n)]


def test_every_raising_handler_is_counted_logged_once_and_harmless(
    caplog: pytest.LogCaptureFixture, figures: Figures
) -> None:
    """Handlers raising Exception, BaseException subclasses, KeyboardInterrupt, SystemExit,
    unprintable exceptions (sync, and async after an await) never reach the caller; each call
    is counted as an error, each handler's failure is logged once with its traceback, and a
    healthy handler on the same bus gets every event, before and after."""
    figures.describe(
        load=f"{2 * N} events, {len(RAISERS) + 2} handlers on one bus",
        faults="every event raises in: " + ", ".join(RAISERS) + "; a sink whose flush() raises",
        bad_inputs="exceptions whose `__str__` and `__repr__` raise",
    )
    caplog.set_level(logging.ERROR, logger="monitor_bus")
    bus = EventBus(name="exceptions")
    healthy = Recorder()
    sink = FailingSink()
    try:
        for name, (handler, _) in RAISERS.items():
            bus.register_event_handler(handler, name=name)
        bus.register_event_handler(sink, name="failing-sink")
        bus.register_event_handler(healthy, name="healthy")
        for event in _events(N):  # the caller never sees a handler's exception
            bus.log_event(event)
        assert bus.flush(timeout=30)
        for event in _events(N, start=N):
            bus.log_event(event)
        assert bus.flush(timeout=30)

        assert [e.data["i"] for e in healthy.events] == list(range(2 * N))
        assert sink.seen == 2 * N
        stats = bus.stats()
        per = {h["name"]: h for h in stats["handlers"]}
        for name in RAISERS:
            assert per[name]["delivered"] == 2 * N, name
            assert per[name]["errors"] == 2 * N, name
            assert per[name]["dropped"] == 0, name
        assert per["healthy"]["errors"] == 0
        sink_errors = per["failing-sink"]["errors"]
        assert 2 <= sink_errors <= 2 * N  # once per delivered batch
        assert stats["handler_errors"] == len(RAISERS) * 2 * N + sink_errors

        records = [r for r in caplog.records if r.name == "monitor_bus"]
        by_handler: dict[str, list[logging.LogRecord]] = {}
        for record in records:
            by_handler.setdefault(record.args[0], []).append(record)  # type: ignore[index]
        assert sorted(by_handler) == sorted([*RAISERS, "failing-sink"])
        for name, (_, exc_type) in RAISERS.items():
            (record,) = by_handler[name]  # rate-limited: once per handler and type per 10 s
            assert record.levelno == logging.ERROR
            assert record.exc_info is not None
            assert record.exc_info[0] is exc_type
            text = caplog.handler.format(record)
            assert "Traceback (most recent call last)" in text
            assert "in handler" in text  # the frame that raised
        (sink_record,) = by_handler["failing-sink"]
        assert sink_record.exc_info is not None
        assert sink_record.exc_info[0] is OSError
        figures.measure(
            logged=2 * N,
            delivered_healthy=len(healthy.events),
            errors_counted=stats["handler_errors"],
            log_records=len(records),
            caller_saw_exception=False,
        )
    finally:
        assert bus.close(timeout=30)


def test_rate_limit_is_per_handler_and_exception_type(
    caplog: pytest.LogCaptureFixture, figures: Figures
) -> None:
    """A handler alternating between two exception types is logged once per type, while
    every one of its failures is counted."""
    figures.describe(load=f"{N} events", faults="one handler alternates ValueError and KeyError")
    caplog.set_level(logging.ERROR, logger="monitor_bus")

    def alternating(event: Event) -> None:
        if event.data["i"] % 2:
            raise KeyError(event.data["i"])
        raise ValueError(event.data["i"])

    with EventBus(name="rate") as bus:
        bus.register_event_handler(alternating, name="alternating")
        for event in _events(N):
            bus.log_event(event)
        assert bus.flush(timeout=30)
        (h,) = bus.stats()["handlers"]
        assert h["errors"] == N
        kinds = sorted(r.exc_info[0].__name__ for r in caplog.records if r.exc_info)
        assert kinds == ["KeyError", "ValueError"]
        figures.measure(logged=N, errors_counted=h["errors"], log_records=len(kinds))


def test_keyboard_interrupt_in_handler_does_not_stop_the_bus(figures: Figures) -> None:
    """KeyboardInterrupt and SystemExit raised inside a handler do not interrupt the main
    thread or stop the dispatcher: the bus keeps delivering and close() succeeds."""
    figures.describe(
        load="10 events", faults="KeyboardInterrupt then SystemExit from a sync handler"
    )
    seen: list[int] = []

    def handler(event: Event) -> None:
        i = event.data["i"]
        seen.append(i)  # type: ignore[arg-type]
        if i == 3:
            raise KeyboardInterrupt
        if i == 5:
            raise SystemExit(1)

    bus = EventBus(name="kbi")
    bus.register_event_handler(handler, name="kbi")
    for event in _events(10):
        bus.log_event(event)
    assert bus.flush(timeout=30)
    assert seen == list(range(10))
    assert bus.stats()["handler_errors"] == 2
    assert bus.close(timeout=30)
    figures.measure(logged=10, delivered=len(seen), errors_counted=2)


class FlakyWriter:
    """A SummaryWriter stand-in: every 3rd add_scalar raises, flush and close always raise."""

    def __init__(self) -> None:
        self.calls = 0
        self.written: list[tuple[str, float]] = []

    def add_scalar(self, tag: str, value: float, global_step: int = 0, walltime: float = 0) -> None:
        self.calls += 1
        if self.calls % 3 == 0:
            raise OSError("event file write failed")
        self.written.append((tag, value))

    def flush(self) -> None:
        raise RuntimeError("flush failed")

    def close(self) -> None:
        raise OSError("close failed")


class FailingFile:
    """Wraps a real file; once ``broken``, writes raise ENOSPC and close raises too."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.broken = False

    def write(self, data: bytes) -> int:
        if self.broken:
            raise OSError(28, "No space left on device")
        return int(self.real.write(data))

    def flush(self) -> None:
        self.real.flush()

    @property
    def closed(self) -> bool:
        return bool(self.real.closed)

    def close(self) -> None:
        self.real.close()
        if self.broken:
            raise OSError(5, "Input/output error")


def test_failing_writers_are_counted_and_earlier_output_survives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, figures: Figures
) -> None:
    """A TensorBoard writer that fails now and then, and a JSONL file that runs out of space:
    every failure is counted on its handler, an event the writer raised on counts as dropped,
    not delivered, the JSONL lines not written are kept and, when the bus lets go of the
    handler with the disk still full, counted as dropped; the other handlers get everything,
    what was written before the disk filled reads back intact, and a close() that raises
    reaches only the code that called it."""
    n = 30
    figures.describe(
        load=f"{2 * n} Stat events to TensorboardEventHandler, JsonlEventHandler and a recorder",
        faults="writer: every 3rd add_scalar raises, flush/close raise; JSONL file: ENOSPC on "
        "write after the first half, EIO on close",
    )
    caplog.set_level(logging.ERROR, logger="monitor_bus")
    writer = FlakyWriter()
    path = tmp_path / "events.jsonl"
    jsonl = JsonlEventHandler(path)
    file = FailingFile(jsonl._file)
    jsonl._file = file  # type: ignore[assignment]
    healthy = Recorder()
    now = datetime.now(timezone.utc)
    events = [Event(STAT_EVENT, now, {"s.sum": float(i)}) for i in range(2 * n)]
    with EventBus(name="writers") as bus:
        bus.register_event_handler(TensorboardEventHandler(writer), name="tensorboard")
        bus.register_event_handler(jsonl, name="jsonl")
        bus.register_event_handler(healthy, name="healthy")
        for event in events[:n]:
            bus.log_event(event)
        assert bus.flush(timeout=30)
        file.broken = True
        for event in events[n:]:
            bus.log_event(event)
        assert bus.flush(timeout=30)
        per = {h["name"]: h for h in bus.stats()["handlers"]}
        assert [e.data for e in healthy.events] == [e.data for e in events]
        # An event the writer raised on is not written: dropped by that handler.
        assert (per["tensorboard"]["delivered"], per["tensorboard"]["dropped"]) == (
            2 * n - 2 * n // 3,
            2 * n // 3,
        )
        # Each third add_scalar failed, plus one failed flush per delivered batch.
        assert per["tensorboard"]["errors"] >= 2 * n // 3 + 2
        assert writer.calls == 2 * n
        assert len(writer.written) == 2 * n - 2 * n // 3
        # The lines not written are kept for another try: handed over, not lost yet.
        assert (per["jsonl"]["delivered"], per["jsonl"]["dropped"]) == (2 * n, 0)
        assert per["jsonl"]["errors"] >= 1  # each batch after the disk filled
        assert per["healthy"]["errors"] == 0
    # The bus let go of the handler with the disk still full: the kept lines are lost.
    assert (jsonl.written, jsonl.dropped) == (n, n)
    assert [e.data for e in read_jsonl(path)] == [e.data for e in events[:n]]
    with pytest.raises(OSError, match="Input/output error"):
        jsonl.close()
    with pytest.raises(OSError, match="close failed"):
        writer.close()
    figures.measure(
        logged=2 * n,
        delivered_healthy=len(healthy.events),
        tensorboard_errors=per["tensorboard"]["errors"],
        tensorboard_dropped=per["tensorboard"]["dropped"],
        jsonl_errors=per["jsonl"]["errors"],
        jsonl_dropped=jsonl.dropped,
        jsonl_lines_intact=n,
    )
