"""bus.subscribe(): events as an async iterator in the caller's loop, under asyncio and trio."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import anyio
import pytest

import monitor_bus
from monitor_bus import Event, EventBus

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def ev(name: str, i: int) -> Event:
    return Event(name, datetime(2026, 1, 1, tzinfo=timezone.utc), {"i": i})


async def take(events: monitor_bus._subscription.Subscription, n: int) -> list[Event]:
    out = []
    with anyio.fail_after(10):
        async for event in events:
            out.append(event)
            if len(out) == n:
                break
    return out


async def test_yields_events_logged_while_subscribed_in_order(bus: EventBus) -> None:
    """The subscriber gets every event logged inside the block, once, in order, and nothing from before."""
    bus.register_event_handler(lambda e: None)  # keeps the bus running before the subscription
    bus.log_event(ev("before", 0))
    async with bus.subscribe() as events:
        for i in range(50):
            bus.log_event(ev("step", i))
        got = await take(events, 50)
    assert [(e.name, e.data["i"]) for e in got] == [("step", i) for i in range(50)]
    assert events.received == 50
    assert events.dropped == 0


async def test_name_selects_events_by_name(bus: EventBus) -> None:
    """A str filter passes only the events of that name."""
    async with bus.subscribe("loss") as events:
        for i in range(6):
            bus.log_event(ev("loss" if i % 2 else "other", i))
        await bus.aflush()
        got = await take(events, 3)
    assert [e.data["i"] for e in got] == [1, 3, 5]
    assert events.received == 3


async def test_callable_filter_selects_events(bus: EventBus) -> None:
    """A callable filter passes the events for which it returns true."""
    async with bus.subscribe(lambda e: e.data["i"] >= 7) as events:
        for i in range(10):
            bus.log_event(ev("step", i))
        got = await take(events, 3)
    assert [e.data["i"] for e in got] == [7, 8, 9]


async def test_full_buffer_drops_newest_and_counts_in_bus_stats(bus: EventBus) -> None:
    """Past `buffer` unread events the newest are dropped, counted on the subscription and in bus.stats()."""
    async with bus.subscribe(buffer=3) as events:
        for i in range(10):
            bus.log_event(ev("step", i))
        assert await bus.aflush(10)
        assert (events.received, events.dropped) == (3, 7)
        got = await take(events, 3)
        [entry] = bus.stats()["handlers"]
    assert [e.data["i"] for e in got] == [0, 1, 2]
    assert entry["name"] == "subscription"
    assert (entry["logged"], entry["delivered"], entry["dropped"], entry["pending"]) == (
        10,
        3,
        7,
        0,
    )


async def test_leaving_the_block_unsubscribes(bus: EventBus) -> None:
    """After the block the handler is gone from the bus and the iterator is exhausted."""
    async with bus.subscribe("x") as events:
        assert [h["name"] for h in bus.stats()["handlers"]] == ["subscription('x')"]
        bus.log_event(ev("x", 1))
        await take(events, 1)
    assert bus.stats()["handlers"] == []
    bus.log_event(ev("x", 2))
    assert [e async for e in events] == []
    assert events.received == 1


async def test_cancelled_subscriber_still_unsubscribes(bus: EventBus) -> None:
    """Leaving the block by cancellation (a timeout) still removes the handler."""
    with anyio.move_on_after(0.05) as scope:
        async with bus.subscribe() as events:
            async for _ in events:
                pass  # nothing is logged: waits until cancelled
    assert scope.cancelled_caught
    assert bus.stats()["handlers"] == []


async def test_two_subscriptions_each_get_every_event(bus: EventBus) -> None:
    """Subscriptions are not keyed: two at once both see each event."""
    async with bus.subscribe() as a, bus.subscribe() as b:
        for i in range(5):
            bus.log_event(ev("s", i))
        got_a = await take(a, 5)
        got_b = await take(b, 5)
    assert got_a == got_b
    assert [e.data["i"] for e in got_a] == list(range(5))


async def test_events_from_other_threads_arrive(bus: EventBus) -> None:
    """Events logged by a plain thread reach a subscriber on the loop, per-thread order kept."""
    async with bus.subscribe() as events:
        threads = [
            threading.Thread(target=lambda k=k: [bus.log_event(ev(f"t{k}", i)) for i in range(100)])
            for k in range(3)
        ]
        for t in threads:
            t.start()
        got = await take(events, 300)
        for t in threads:
            t.join()
    for k in range(3):
        assert [e.data["i"] for e in got if e.name == f"t{k}"] == list(range(100))


async def test_stat_windows_reach_a_subscriber(bus: EventBus) -> None:
    """A Stat's closed window arrives as a STAT_EVENT through a subscription to that name."""
    from datetime import timedelta

    async with bus.subscribe(monitor_bus.STAT_EVENT) as events:
        stat = monitor_bus.Stat(
            "loss",
            [monitor_bus.Aggregation.MEAN, monitor_bus.Aggregation.COUNT],
            timedelta(seconds=60),
            max_samples=2,
            bus=bus,
        )
        stat.add(1.0)
        stat.add(3.0)
        [got] = await take(events, 1)
    assert got.data == {"loss.mean": 2.0, "loss.count": 2}


async def test_module_level_subscribe_uses_the_default_bus() -> None:
    """monitor_bus.subscribe follows monitor_bus.log_event."""
    async with monitor_bus.subscribe("hi") as events:
        monitor_bus.log_event(ev("hi", 1))
        [got] = await take(events, 1)
    assert got.data == {"i": 1}


async def test_entering_twice_is_an_error(bus: EventBus) -> None:
    """A subscription object is single-use."""
    sub = bus.subscribe()
    async with sub:
        pass
    with pytest.raises(RuntimeError, match="already entered"):
        async with sub:
            pass


async def test_sync_with_is_rejected(bus: EventBus) -> None:
    """Using the async API with a plain `with` says to use `async with`."""
    with pytest.raises(TypeError, match="async with"), bus.subscribe():
        pass


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"name": 3}, TypeError, "name must be None, an event name"),
        ({"name": b"loss"}, TypeError, "name must be None, an event name"),
        ({"buffer": 0}, ValueError, "buffer must be at least 1, got 0"),
        ({"buffer": -5}, ValueError, "buffer must be at least 1, got -5"),
        ({"buffer": 2.5}, TypeError, "buffer must be an int, not float"),
        ({"buffer": True}, TypeError, "buffer must be an int, not bool"),
    ],
)
async def test_bad_arguments_name_the_argument(
    bus: EventBus, kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    """Invalid filters and buffer sizes raise at once, naming the argument, and register nothing."""
    with pytest.raises(exc, match=match):
        bus.subscribe(**kwargs)  # type: ignore[arg-type]
    assert bus.stats()["handlers"] == []


def test_subscribing_without_an_event_loop_is_an_error(bus: EventBus) -> None:
    """subscribe() from a thread that runs no event loop raises, saying it needs one."""
    with pytest.raises(RuntimeError, match="needs a running event loop"):
        bus.subscribe()
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            monitor_bus.subscribe()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert len(errors) == 1
    assert "needs a running event loop" in str(errors[0])


def test_flush_from_a_thread_that_reuses_a_finished_handler_threads_id() -> None:
    """A new thread that gets the id of a finished handler thread may call flush().

    Thread ids are reused at once; a stale id in the set of bus threads made anyio's worker
    threads fail in ``await bus.aflush()`` at random (seen after a notebook re-registered a
    named handler). New threads are started until one gets the finished thread's id.
    """
    with EventBus(name="other") as live:
        live.register_event_handler(lambda e: None)
        with EventBus(name="finished") as finished:
            finished.register_event_handler(lambda e: None)
            old = finished._handlers[0].thread
        assert old is not None
        old.join()
        outcome: list[str] = []
        release = threading.Event()

        def flush_if_reusing(decided: threading.Event) -> None:
            if threading.get_ident() != old.ident:
                decided.set()
                release.wait()  # hold this stack, so the next thread gets another one
                return
            try:
                outcome.append("flushed" if live.flush(5) else "timed out")
            except RuntimeError as exc:
                outcome.append(str(exc))
            decided.set()

        candidates = []
        for _ in range(200):
            decided = threading.Event()
            candidates.append(threading.Thread(target=flush_if_reusing, args=(decided,)))
            candidates[-1].start()
            assert decided.wait(10)
            if outcome:
                break
        release.set()
        for t in candidates:
            t.join()
    if not outcome:
        pytest.skip("no new thread got the finished thread's id in 200 tries")
    assert outcome == ["flushed"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_subscription_whose_loop_has_ended_counts_drops_and_detaches(
    bus: EventBus, backend: str
) -> None:
    """If the subscriber's loop ends without leaving the block, later events are counted as dropped
    and the subscription removes itself from the bus."""

    async def enter_and_abandon() -> monitor_bus._subscription.Subscription:
        sub = bus.subscribe()
        await sub.__aenter__()
        return sub

    sub = anyio.run(enter_and_abandon, backend=backend)
    for i in range(5):
        bus.log_event(ev("late", i))
    assert bus.flush(10)
    assert (sub.received, sub.dropped) == (0, 5)
    assert bus.stats()["handlers"] == []


async def test_a_raising_filter_skips_the_event_and_counts_the_error(bus: EventBus) -> None:
    """An event whose filter raises is skipped and counted as a handler error; later ones still arrive."""

    def only_even(event: Event) -> bool:
        if event.data["i"] == 1:
            raise ValueError("bad event")
        return event.data["i"] % 2 == 0

    async with bus.subscribe(only_even) as events:
        for i in range(5):
            bus.log_event(ev("s", i))
        got = await take(events, 3)
        assert bus.stats()["handler_errors"] == 1
    assert [e.data["i"] for e in got] == [0, 2, 4]


async def test_subscribing_to_a_closed_bus_fails_on_entry() -> None:
    """Entering a subscription of a closed bus raises and leaves nothing open."""
    bus = EventBus(name="closed")
    bus.close()
    sub = bus.subscribe()
    with pytest.raises(RuntimeError, match="is closed"):
        async with sub:
            pass
    assert repr(sub) == "<Subscription subscription closed, buffer=1024>"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_unexpected_scheduling_error_is_logged_counted_and_keeps_the_subscription(
    bus: EventBus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure to hand a batch to a live loop is a logged handler error with the batch counted
    as dropped, not a silent "subscriber gone" that detaches the subscription."""
    loop = asyncio.get_running_loop()
    schedule = loop.call_soon_threadsafe
    async with bus.subscribe() as events:

        def broken(callback: Callable[..., object], *args: object, **kwargs: Any) -> object:
            if events._put in (callback, *args):
                raise ValueError("injected scheduling failure")
            return schedule(callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", broken)
        for i in range(3):
            bus.log_event(ev("lost", i))
        assert bus.flush(10)
        monkeypatch.undo()
        bus.log_event(ev("after", 0))
        [got] = await take(events, 1)
        assert got.name == "after"
        assert await bus.aflush(10)  # the bus settles a batch after handing it over
        stats = bus.stats()
        [entry] = stats["handlers"]
        assert stats["handler_errors"] == 1
        assert (events.received, events.dropped) == (1, 3)
        assert (entry["delivered"], entry["dropped"]) == (1, 3)
    [record] = [r for r in caplog.records if r.name == "monitor_bus" and r.exc_info]
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)
