"""Batch handlers: handle_batch(events) once per batch, events shared between batch handlers."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat

from .conftest import Recorder

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)


class Batches:
    """A sync batch handler that keeps every batch it gets."""

    def __init__(self) -> None:
        self.calls: list[list[Event]] = []

    def handle_batch(self, events: list[Event]) -> None:
        self.calls.append(events)


class AsyncBatches(Batches):
    async def handle_batch(self, events: list[Event]) -> None:  # type: ignore[override]
        self.calls.append(events)


@pytest.fixture
def lingering() -> Iterator[EventBus]:
    """A bus whose dispatcher only drains when flushed: one batch per flush()."""
    bus = EventBus(name="batches")
    bus._linger = 30.0
    yield bus
    assert bus.close(10)


@pytest.mark.parametrize("kind", [Batches, AsyncBatches])
def test_a_batch_handler_gets_each_batch_in_one_call(
    kind: type[Batches], lingering: EventBus
) -> None:
    """100 events drained together reach a batch handler (sync or async) in one call, in order,
    and count as 100 delivered."""
    handler = kind()
    lingering.register_event_handler(handler, name="batch")
    for i in range(100):
        lingering.log_event(Event("e", TS, {"i": i}))
    assert lingering.flush(10)
    assert [[e.data["i"] for e in call] for call in handler.calls] == [list(range(100))]
    (stats,) = lingering.stats()["handlers"]
    assert (stats["delivered"], stats["dropped"], stats["async"]) == (
        100,
        0,
        kind is AsyncBatches,
    )


def test_every_handler_gets_its_own_events(lingering: EventBus, recorder: Recorder) -> None:
    """Two batch handlers and a plain one get equal events, none of them the same object or
    the same data dict: what one changes, no other sees."""
    first, second = Batches(), Batches()
    lingering.register_event_handler(first, name="first")
    lingering.register_event_handler(second, name="second")
    lingering.register_event_handler(recorder, name="plain")
    for i in range(3):
        lingering.log_event(Event("e", TS, {"i": i}))
    assert lingering.flush(10)
    (a,), (b,) = first.calls, second.calls
    assert a == b == recorder.events
    assert not any(x is y or x.data is y.data for x, y in zip(a, b, strict=True))
    assert not any(x is y or x.data is y.data for x, y in zip(a, recorder.events, strict=True))


def test_a_large_batch_comes_in_lists_of_128(lingering: EventBus) -> None:
    """300 events drained together reach a batch handler in lists of 128, 128 and 44, in
    order (few events alive at a time)."""
    handler = Batches()
    lingering.register_event_handler(handler, name="batch")
    for i in range(300):
        lingering.log_event(Event("e", TS, {"i": i}))
    assert lingering.flush(10)
    assert [len(call) for call in handler.calls] == [128, 128, 44]
    assert [e.data["i"] for call in handler.calls for e in call] == list(range(300))


def test_a_failing_batch_handler_counts_one_error_and_keeps_receiving(lingering: EventBus) -> None:
    """An exception from handle_batch is one error; its events count as delivered, and the
    next batch is delivered too."""

    class Failing(Batches):
        def handle_batch(self, events: list[Event]) -> None:
            super().handle_batch(events)
            if len(self.calls) == 1:
                raise RuntimeError("sink down")

    handler = Failing()
    lingering.register_event_handler(handler, name="failing")
    for round_ in range(2):
        for i in range(5):
            lingering.log_event(Event("e", TS, {"i": i, "round": round_}))
        assert lingering.flush(10)
    (stats,) = lingering.stats()["handlers"]
    assert (stats["delivered"], stats["errors"], len(handler.calls)) == (10, 1, 2)


def test_windows_reach_batch_handlers(lingering: EventBus) -> None:
    """Stat windows arrive in batches like any event, as plain dicts."""
    handler = Batches()
    lingering.register_event_handler(handler, name="batch")
    stat = Stat("s", [Aggregation.COUNT], timedelta(hours=1), bus=lingering)
    stat.add(1.0)
    lingering.log_event(Event("e", TS, {"i": 0}))
    stat._close()
    assert lingering.flush(10)
    events = [e for call in handler.calls for e in call]
    assert [(e.name, e.data, type(e.data)) for e in events] == [
        ("e", {"i": 0}, dict),
        (STAT_EVENT, {"s.count": 1}, dict),
    ]


def test_an_object_with_neither_call_nor_handle_batch_is_refused(bus: EventBus) -> None:
    """Registration names what a handler must be."""
    with pytest.raises(TypeError, match=r"callback must be callable \(or a batch handler\)"):
        bus.register_event_handler(object())  # type: ignore[arg-type]


def test_the_bundled_sinks_are_batch_handlers(tmp_path: Path, lingering: EventBus) -> None:
    """The JSONL, TensorBoard, Prometheus and process sinks take whole batches."""
    import monitor_bus
    from monitor_bus.exporters.prometheus import PrometheusEventHandler
    from monitor_bus.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path / "tb")
    jsonl = monitor_bus.JsonlEventHandler(tmp_path / "run.jsonl")
    sinks = [
        jsonl,
        monitor_bus.TensorboardEventHandler(writer),
        PrometheusEventHandler(registry=None),
    ]
    try:
        for k, sink in enumerate(sinks):
            lingering.register_event_handler(sink, name=f"sink{k}")
        assert [h.batch_call is not None for h in lingering._handlers] == [True, True, True]
    finally:
        lingering.close(10)
        jsonl.close()
        writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_subscriber_changing_its_events_changes_no_sink(tmp_path: Path) -> None:
    """What a subscriber does to an event's data reaches no other handler."""
    import monitor_bus

    bus = EventBus(name="sub-copy")
    path = tmp_path / "run.jsonl"
    jsonl = monitor_bus.JsonlEventHandler(path)
    bus.register_event_handler(jsonl, name="jsonl")
    seen = Batches()
    bus.register_event_handler(seen, name="seen")
    async with bus.subscribe() as events:
        bus.log_event(Event("e", TS, {"i": 1}))
        async for event in events:
            event.data["i"] = 99
            break
    assert bus.flush(10)
    assert [e.data for call in seen.calls for e in call] == [{"i": 1}]
    bus.close(10)
    jsonl.close()
    assert [e.data for e in monitor_bus.read_jsonl(path)] == [{"i": 1}]


def test_each_failure_in_a_batch_counts(lingering: EventBus) -> None:
    """A batch handler that fails on some events (call_each) still handles the others, and
    the bus counts one error per failed event."""
    from monitor_bus._handler import call_each

    handled: list[int] = []

    def one(event: Event) -> None:
        if event.data["i"] % 3 == 0:
            raise ValueError(f"event {event.data['i']}")
        handled.append(int(event.data["i"]))

    class Sink:
        def handle_batch(self, events: list[Event]) -> None:
            call_each(events, one)

    lingering.register_event_handler(Sink(), name="sink")
    for i in range(10):
        lingering.log_event(Event("e", TS, {"i": i}))
    assert lingering.flush(10)
    (stats,) = lingering.stats()["handlers"]
    assert handled == [1, 2, 4, 5, 7, 8]
    assert (stats["delivered"], stats["errors"]) == (10, 4)
