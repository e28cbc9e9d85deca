"""The dispatcher's guarantees: delivery, isolation, re-entrancy, overflow, flush and close."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from datetime import datetime, timedelta, timezone
from pathlib import Path

import anyio
import pytest

import monitor_bus
from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _ratelimit

from .conftest import Recorder
from .test_relay_flow import attempt

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)


def ev(i: int, name: str = "e") -> Event:
    return Event(name, TS, {"i": i})


def indices(events: list[Event]) -> list[int]:
    return [e.data["i"] for e in events]  # type: ignore[misc]


def bus_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("monitor_bus-")]


def test_no_handler_means_no_thread_and_no_op() -> None:
    """Logging with no handler registered starts nothing and delivers nothing."""
    monitor_bus.log_event(ev(1))
    bus = monitor_bus.get_default_bus()
    bus.log_event(ev(2))
    assert bus_threads() == []
    assert bus.stats()["logged"] == 0


def test_module_functions_use_the_default_bus(recorder: Recorder) -> None:
    """register/log/flush/unregister at module level, in log order, each event once."""
    handle = monitor_bus.register_event_handler(recorder)
    for i in range(1000):
        monitor_bus.log_event(ev(i))
    assert monitor_bus.flush(timeout=10)
    assert indices(recorder.events) == list(range(1000))
    monitor_bus.unregister_event_handler(handle)
    monitor_bus.log_event(ev(1000))
    assert monitor_bus.flush(timeout=10)
    assert len(recorder.events) == 1000


def test_only_events_logged_after_registration(bus: EventBus) -> None:
    """A handler gets exactly the events logged after its registration returned."""
    first, second = Recorder(), Recorder()
    bus.register_event_handler(first)
    for i in range(100):
        bus.log_event(ev(i))
    bus.register_event_handler(second)
    for i in range(100, 200):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert indices(first.events) == list(range(200))
    assert indices(second.events) == list(range(100, 200))


def test_per_thread_order_from_many_producers(bus: EventBus, recorder: Recorder) -> None:
    """With four producing threads, each thread's events arrive in its order, each once."""
    bus.register_event_handler(recorder)

    def produce(k: int) -> None:
        for i in range(5000):
            bus.log_event(Event("e", TS, {"k": k, "i": i}))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bus.flush(10)
    for k in range(4):
        assert [e.data["i"] for e in recorder.events if e.data["k"] == k] == list(range(5000))


def test_unregister_delivers_pending_first(bus: EventBus) -> None:
    """unregister returns after the handler got every event logged before it; then no more calls."""
    got: list[int] = []

    def slow(e: Event) -> None:
        time.sleep(0.001)
        got.append(e.data["i"])  # type: ignore[arg-type]

    handle = bus.register_event_handler(slow)
    for i in range(50):
        bus.log_event(ev(i))
    assert bus.unregister_event_handler(handle) is True
    assert got == list(range(50))
    bus.log_event(ev(50))
    assert bus.flush(10)
    assert got == list(range(50))
    assert bus.unregister_event_handler(handle) is True  # already removed: a no-op


def test_unregister_bad_handles(bus: EventBus, recorder: Recorder) -> None:
    """A non-handle is a TypeError; a handle of another bus is a ValueError."""
    with pytest.raises(TypeError, match="handle must be a monitor_bus.EventHandlerHandle, not str"):
        bus.unregister_event_handler("nope")  # type: ignore[arg-type]
    with EventBus() as other:
        handle = other.register_event_handler(recorder)
        with pytest.raises(ValueError, match="another bus"):
            bus.unregister_event_handler(handle)


def test_slow_handler_delays_no_one(bus: EventBus, recorder: Recorder) -> None:
    """A handler held at its first event delays neither the caller, a fast handler, nor Stat
    timers."""
    release = threading.Event()
    entered = threading.Event()
    slow_calls: list[int] = []

    def slow(e: Event) -> None:
        slow_calls.append(1)
        entered.set()
        release.wait()  # held until the fast handler has everything: no race with the clock

    bus.register_event_handler(slow)
    bus.register_event_handler(recorder)
    stat = Stat("t", [Aggregation.COUNT], timedelta(milliseconds=20), bus=bus)
    for i in range(20):
        bus.log_event(ev(i))
    stat.add(1)
    # The fast handler gets all 20 events and the Stat window while the slow one is at its first.
    assert recorder.wait_for(21)
    assert entered.wait(10)
    assert slow_calls == [1]
    assert [e.name for e in recorder.events].count(STAT_EVENT) == 1
    release.set()
    assert bus.flush(10)
    assert len(slow_calls) == 21


def test_raising_handler_is_logged_counted_and_kept(
    bus: EventBus, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A raising handler: traceback to the monitor_bus logger, counted, still receives later events."""
    calls: list[int] = []

    def bad(e: Event) -> None:
        calls.append(e.data["i"])  # type: ignore[arg-type]
        raise RuntimeError("sink broke")

    caplog.set_level(logging.ERROR, logger="monitor_bus")
    bus.register_event_handler(bad, name="bad")
    bus.register_event_handler(recorder)
    for i in range(5):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert calls == list(range(5))
    assert len(recorder.events) == 5
    stats = bus.stats()
    assert stats["handler_errors"] == 5
    assert stats["handlers"][0]["errors"] == 5
    assert stats["handlers"][0]["delivered"] == 5
    records = [r for r in caplog.records if r.name == "monitor_bus"]
    assert len(records) == 1  # rate-limited: the same error once per interval
    assert "sink broke" in caplog.text
    assert records[0].exc_info is not None


def test_base_exceptions_in_handlers_do_not_escape(bus: EventBus, recorder: Recorder) -> None:
    """KeyboardInterrupt and SystemExit raised by a handler are counted as errors, never propagated."""
    kinds = [KeyboardInterrupt, SystemExit, GeneratorExit]

    def bad(e: Event) -> None:
        raise kinds[e.data["i"]]()  # type: ignore[index]

    bus.register_event_handler(bad)
    bus.register_event_handler(recorder)
    for i in range(3):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert bus.stats()["handler_errors"] == 3
    assert len(recorder.events) == 3


def test_async_handler(bus: EventBus) -> None:
    """An async handler (coroutine function or async __call__) runs on the bus loop, in order."""
    got: list[int] = []

    async def handler(e: Event) -> None:
        await anyio.lowlevel.checkpoint()
        got.append(e.data["i"])  # type: ignore[arg-type]

    class Sink:
        def __init__(self) -> None:
            self.got: list[int] = []

        async def __call__(self, e: Event) -> None:
            self.got.append(e.data["i"])  # type: ignore[arg-type]

    sink = Sink()
    bus.register_event_handler(handler)
    bus.register_event_handler(sink)
    assert [h["async"] for h in bus.stats()["handlers"]] == [True, True]
    for i in range(100):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert got == sink.got == list(range(100))


def test_non_callable_handler_is_rejected(bus: EventBus) -> None:
    """register_event_handler names the bad callback."""
    with pytest.raises(
        TypeError, match=r"callback must be callable \(or a batch handler\), not int"
    ):
        bus.register_event_handler(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="event must be a monitor_bus.Event, not dict"):
        bus.log_event({"name": "x"})  # type: ignore[arg-type]


def test_handler_may_log_register_and_unregister(bus: EventBus, recorder: Recorder) -> None:
    """Inside a handler: log_event, register and unregister (its own handle too) do not deadlock."""
    handles: dict[str, monitor_bus.EventHandlerHandle] = {}
    late = Recorder()

    def reentrant(e: Event) -> None:
        if e.name == "start":
            bus.log_event(Event("echo", TS, {}))
            handles["late"] = bus.register_event_handler(late)
            bus.log_event(Event("after", TS, {}))
        elif e.name == "stop":
            bus.unregister_event_handler(handles["self"])

    handles["self"] = bus.register_event_handler(reentrant)
    bus.register_event_handler(recorder)
    bus.log_event(Event("start", TS, {}))
    assert recorder.wait_for(3)
    bus.log_event(Event("stop", TS, {}))
    bus.log_event(Event("tail", TS, {}))
    assert bus.flush(10)
    assert [e.name for e in recorder.events] == ["start", "echo", "after", "stop", "tail"]
    assert [e.name for e in late.events] == ["after", "stop", "tail"]
    assert [h["name"] for h in bus.stats()["handlers"]] == ["Recorder", "Recorder"]


def test_async_handler_may_unregister_itself(bus: EventBus, recorder: Recorder) -> None:
    """An async handler unregistering itself gets no event logged after that."""
    got: list[str] = []
    holder: dict[str, monitor_bus.EventHandlerHandle] = {}

    async def handler(e: Event) -> None:
        got.append(e.name)
        if e.name == "stop":
            bus.unregister_event_handler(holder["h"])

    holder["h"] = bus.register_event_handler(handler)
    bus.register_event_handler(recorder)
    bus.log_event(Event("a", TS, {}))
    bus.log_event(Event("stop", TS, {}))
    assert recorder.wait_for(2)
    assert bus.flush(10)
    bus.log_event(Event("b", TS, {}))
    assert bus.flush(10)
    assert got == ["a", "stop"]


def test_flush_from_a_handler_is_refused(bus: EventBus, recorder: Recorder) -> None:
    """flush() inside a handler raises instead of waiting on itself (the error is counted)."""
    errors: list[BaseException] = []

    def handler(e: Event) -> None:
        try:
            bus.flush(1)
        except RuntimeError as exc:
            errors.append(exc)

    bus.register_event_handler(handler)
    bus.log_event(ev(0))
    assert bus.flush(10)
    assert [str(e) for e in errors] == ["flush() cannot be called from inside an event handler"]


def test_flush_times_out_on_a_hung_handler(bus: EventBus) -> None:
    """flush(timeout) returns False when a handler is stuck, True once it catches up."""
    release = threading.Event()
    bus.register_event_handler(lambda e: release.wait())
    bus.log_event(ev(0))
    assert bus.flush(timeout=0.1) is False
    release.set()
    assert bus.flush(timeout=10) is True


@pytest.mark.parametrize("overflow", ["drop_newest", "drop_oldest"])
def test_overflow_drops_are_counted(overflow: str) -> None:
    """A full queue never blocks the caller; delivered + dropped == logged, per handler."""
    release = threading.Event()
    got: list[int] = []

    def blocked(e: Event) -> None:
        release.wait()
        got.append(e.data["i"])  # type: ignore[arg-type]

    with EventBus(capacity=100, overflow=overflow) as bus:  # type: ignore[arg-type]
        bus.register_event_handler(blocked)
        for i in range(5000):
            bus.log_event(ev(i))
        stats = bus.stats()
        assert stats["queued"] <= 100
        release.set()
        assert bus.flush(10)
        stats = bus.stats()
        (h,) = stats["handlers"]
        assert stats["logged"] == h["logged"] == 5000
        assert h["delivered"] + h["dropped"] == 5000
        assert h["pending"] == 0
        assert len(got) == h["delivered"]
        assert got == sorted(got)
        if overflow == "drop_newest":
            assert got[:50] == list(range(50))
        else:
            assert got[-1] == 4999


def test_block_policy_waits_then_delivers_everything() -> None:
    """Under "block" the caller waits for room instead of dropping; every event arrives."""
    got: list[int] = []

    def slowish(e: Event) -> None:
        if e.data["i"] % 100 == 0:
            time.sleep(0.001)
        got.append(e.data["i"])  # type: ignore[arg-type]

    with EventBus(capacity=10, overflow="block") as bus:
        bus.register_event_handler(slowish)
        for i in range(2000):
            bus.log_event(ev(i))
        assert bus.flush(10)
        assert got == list(range(2000))
        assert bus.stats()["dropped"] == 0


def test_block_policy_gives_up_after_block_timeout() -> None:
    """Under "block" with a timeout, a stuck handler makes the caller drop (counted) after the timeout."""
    release = threading.Event()
    with EventBus(capacity=5, overflow="block", block_timeout=0.01) as bus:
        bus.register_event_handler(lambda e: release.wait())
        for i in range(40):
            bus.log_event(ev(i))
        stats = bus.stats()
        assert stats["dropped"] > 0
        release.set()
        assert bus.flush(10)
        (h,) = bus.stats()["handlers"]
        assert h["delivered"] + h["dropped"] == h["logged"] == 40


def test_drops_are_reported_by_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Queue drops are reported on the monitor_bus logger with the count."""
    release = threading.Event()
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    with EventBus(capacity=1, name="tiny") as bus:
        bus.register_event_handler(lambda e: release.wait())
        for i in range(100):
            bus.log_event(ev(i))
        release.set()
        assert bus.flush(10)
    dropped = bus.stats()["dropped"]
    assert dropped > 0
    assert f"{dropped} in all" in caplog.text


def test_close_is_idempotent_and_stops_threads(recorder: Recorder) -> None:
    """close() delivers what is queued, stops every thread, and later calls are harmless."""
    bus = EventBus(name="closing")
    bus.register_event_handler(recorder)

    async def ahandler(e: Event) -> None:
        pass

    bus.register_event_handler(ahandler)
    for i in range(100):
        bus.log_event(ev(i))
    assert bus.close(10) is True
    assert len(recorder.events) == 100
    assert bus_threads() == []
    assert bus.close(10) is True
    bus.log_event(ev(100))
    assert bus.closed
    with pytest.raises(RuntimeError, match="closed"):
        bus.register_event_handler(recorder)


def test_close_times_out_on_a_hung_handler(caplog: pytest.LogCaptureFixture) -> None:
    """close(timeout) returns False on time when a handler never returns, and its warnings
    name that handler only: the dispatcher, left no time to stop, is not blamed."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    entered, release = threading.Event(), threading.Event()

    def stuck(event: Event) -> None:
        entered.set()
        release.wait()

    bus = EventBus(name="hung")
    bus.register_event_handler(stuck, name="stuck")
    bus.log_event(ev(0))
    bus.log_event(ev(1))
    assert entered.wait(10)
    assert bus.close(timeout=0.2) is False
    assert [r.getMessage() for r in caplog.records if r.name == "monitor_bus"] == [
        "EventBus 'hung': 1 handler(s) still busy after 0.2 s, cut off: 'stuck' "
        "(1 undelivered, 1 in its current call)",
    ]
    release.set()


@pytest.mark.asyncio
async def test_aflush_does_not_block_the_event_loop(bus: EventBus) -> None:
    """await aflush() lets other tasks of the caller's loop run while it waits."""
    release = threading.Event()
    bus.register_event_handler(lambda e: release.wait())
    bus.log_event(ev(0))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not release.is_set():
            ticks += 1
            if ticks == 3:
                release.set()
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        assert await bus.aflush(10) is True
    assert ticks >= 3


@pytest.mark.asyncio
async def test_async_context_manager_closes(recorder: Recorder) -> None:
    """async with EventBus() closes the bus on exit."""
    async with EventBus() as bus:
        bus.register_event_handler(recorder)
        bus.log_event(ev(0))
    assert bus.closed
    assert len(recorder.events) == 1


def test_log_event_from_a_signal_handler(bus: EventBus, recorder: Recorder) -> None:
    """log_event is safe inside a signal handler."""
    bus.register_event_handler(recorder)
    previous = signal.signal(signal.SIGUSR1, lambda *_: bus.log_event(Event("signal", TS, {})))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert recorder.wait_for(1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert [e.name for e in recorder.events] == ["signal"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"capacity": 0}, ValueError, "capacity must be at least 1"),
        ({"capacity": "1"}, TypeError, "capacity must be an int"),
        ({"overflow": "drop"}, ValueError, "overflow must be one of"),
        ({"block_timeout": -1}, ValueError, "block_timeout must be >= 0"),
        ({"exit_timeout": None}, TypeError, "exit_timeout must be a number"),
        ({"exit_timeout": float("nan")}, ValueError, "exit_timeout must be >= 0, got nan"),
    ],
)
def test_bad_bus_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    """EventBus names the bad argument."""
    with pytest.raises(error, match=message):
        EventBus(**kwargs)  # type: ignore[arg-type]


def test_named_handler_replaces_the_previous_one(bus: EventBus) -> None:
    """Registering under an explicit name replaces the handler of that name; nothing is doubled or lost."""
    a, b = Recorder(), Recorder()
    bus.register_event_handler(a, name="sink")
    bus.log_event(ev(0))
    bus.register_event_handler(b, name="sink")
    bus.log_event(ev(1))
    assert bus.flush(10)
    assert (indices(a.events), indices(b.events)) == ([0], [1])
    assert [h["name"] for h in bus.stats()["handlers"]] == ["sink"]


def test_flush_waits_for_a_replaced_handler_still_delivering(bus: EventBus) -> None:
    """flush() covers what a replaced keyed handler still owes, not only the current handlers."""
    entered, release = threading.Event(), threading.Event()
    got: list[int] = []

    def slow(event: Event) -> None:
        entered.set()
        release.wait(30)
        got.append(event.data["i"])

    bus.register_event_handler(slow, name="sink")
    bus.log_event(ev(0))
    assert entered.wait(10)
    bus.register_event_handler(Recorder(), name="sink")
    assert not bus.flush(0.2)
    release.set()
    assert bus.flush(10)
    assert got == [0]


def test_flush_hook_runs_after_each_batch(bus: EventBus) -> None:
    """A handler's flush() runs after its batch, so after bus.flush() the sink has written everything."""

    class Buffered:
        def __init__(self) -> None:
            self.buffer: list[int] = []
            self.written: list[int] = []

        def __call__(self, e: Event) -> None:
            self.buffer.append(e.data["i"])  # type: ignore[arg-type]

        def flush(self) -> None:
            self.written += self.buffer
            self.buffer.clear()

    sink = Buffered()
    bus.register_event_handler(sink)
    for i in range(300):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert sink.written == list(range(300))
    assert sink.buffer == []


def _in_thread(target: object) -> None:
    threading.Thread(target=target, daemon=True).start()  # type: ignore[arg-type]


def test_leaving_a_with_block_is_bounded_by_exit_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Leaving ``with EventBus(exit_timeout=...)`` around a hung handler returns, cuts the
    handler off and names it with its undelivered count."""
    entered, release = threading.Event(), threading.Event()
    left = threading.Event()

    def stuck(event: Event) -> None:
        entered.set()
        release.wait()

    def body() -> None:
        with EventBus(exit_timeout=0.2, name="hung-with") as bus:
            bus.register_event_handler(stuck, name="stuck")
            bus.log_event(ev(0))
            bus.log_event(ev(1))
            assert entered.wait(10)
        left.set()

    try:
        _in_thread(body)
        assert left.wait(30), "leaving the with block hung"
    finally:
        release.set()
    assert (
        "EventBus 'hung-with': 1 handler(s) still busy after 0.2 s, cut off: 'stuck' "
        "(1 undelivered, 1 in its current call)"
    ) in caplog.text


def test_leaving_an_async_with_block_is_bounded_by_exit_timeout() -> None:
    """Leaving ``async with EventBus(exit_timeout=...)`` around a hung handler returns too."""
    release = threading.Event()
    left = threading.Event()

    async def main() -> None:
        async with EventBus(exit_timeout=0.2) as bus:
            bus.register_event_handler(lambda e: release.wait())
            bus.log_event(ev(0))
        left.set()

    try:
        _in_thread(lambda: anyio.run(main))
        assert left.wait(30), "leaving the async with block hung"
    finally:
        release.set()


def test_each_handler_gets_its_own_copy_of_data(bus: EventBus) -> None:
    """A handler that changes ``data`` changes what no other handler and not the producer sees."""
    popped = threading.Event()
    seen: list[dict[str, object]] = []

    def vandal(event: Event) -> None:
        event.data.pop("loss")
        event.data["added"] = 1
        popped.set()

    def reader(event: Event) -> None:
        assert popped.wait(10)  # read only after the other handler changed its data
        seen.append(dict(event.data))

    bus.register_event_handler(vandal)
    bus.register_event_handler(reader)
    event = Event("train", TS, {"loss": 0.5, "step": 3})
    bus.log_event(event)
    assert bus.flush(10)
    assert seen == [{"loss": 0.5, "step": 3}]
    assert event.data == {"loss": 0.5, "step": 3}


def test_infinite_timeouts_mean_no_limit(bus: EventBus, recorder: Recorder) -> None:
    """``math.inf`` as a timeout waits as long as it takes, in every control call."""
    inf = float("inf")
    handle = bus.register_event_handler(recorder)
    bus.log_event(ev(0))
    assert bus.flush(inf) is True
    bus.log_event(ev(1))
    assert bus.unregister_event_handler(handle, inf) is True
    assert indices(recorder.events) == [0, 1]
    with EventBus(block_timeout=inf, exit_timeout=inf) as other:
        other.register_event_handler(recorder)
        other.log_event(ev(2))
        assert other.close(inf) is True
    assert indices(recorder.events) == [0, 1, 2]


def test_infinite_exit_timeout_delivers_everything_at_exit(tmp_path: Path) -> None:
    """``EventBus(exit_timeout=math.inf)`` delivers everything queued at interpreter exit."""
    out = tmp_path / "out.txt"
    code = f"""
import math, threading
from datetime import datetime
import monitor_bus as monitor
bus = monitor.EventBus(exit_timeout=math.inf)
sink = open({str(out)!r}, "w")
gate = threading.Event()
def write(event):
    gate.wait(0.001)  # slower than the producer: the backlog is still queued at exit
    sink.write(f"{{event.data['i']}}\\n")
    sink.flush()
bus.register_event_handler(write)
for i in range(300):
    bus.log_event(monitor.Event("e", datetime.now(), {{"i": i}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text().split() == [str(i) for i in range(300)]
    assert result.stderr == ""


def test_bus_name_must_be_a_str() -> None:
    """``EventBus(name=None)`` is a TypeError naming the argument."""
    with pytest.raises(TypeError, match="name must be a str, not NoneType"):
        EventBus(name=None)  # type: ignore[arg-type]


def _no_threads(
    buses: tuple[EventBus, EventBus], seen: tuple[Recorder, Recorder], out: object
) -> None:
    """A forked child's task (its buses keep their handlers: ``children="own"``): with no
    thread able to start, log on both buses and close a Stat window in an add; then, threads
    back, log again and flush. Report what raised, each bus's counts and the warnings."""
    import multiprocessing.connection

    assert isinstance(out, multiprocessing.connection.Connection)
    own, blocky = buses
    warnings = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("monitor_bus").addHandler(catch)
    now = [0.0]
    monitor_bus._stat._clock = lambda: now[0]  # windows close when this test says
    # The warnings' rate limit reads the same clock: the phase lasts 1 s by it, however slow
    # the machine, so "once per bus" does not rest on 10 s outlasting it.
    _ratelimit.time = types.SimpleNamespace(monotonic=lambda: now[0])  # type: ignore[assignment]
    stat = Stat("s", [Aggregation.COUNT], timedelta(seconds=1), bus=own)
    report: dict[str, object] = {}
    # A stack larger than any address space: "can't start new thread", whatever the overcommit.
    threading.stack_size(1 << 50)
    raised: list[str] = []
    try:
        for i in range(3):
            attempt(raised, own.log_event, ev(i))
        for i in range(5):
            attempt(raised, blocky.log_event, ev(i))  # room for 2: no wait for a dispatcher
        attempt(raised, stat.add, 1)
        now[0] += 1
        attempt(raised, stat.add, 1)  # closes the window: it is queued
        attempt(raised, stat.add, 1)
    finally:
        threading.stack_size(0)
    report["raised"] = raised
    report["before"] = [(b.stats()["queued"], b.stats()["dropped"]) for b in buses]
    report["warnings"] = [w for w in warnings if "could not start" in w]
    own.log_event(ev(3))
    blocky.log_event(ev(5))
    report["flushed"] = [b.flush(30) for b in buses]
    report["after"] = [(b.stats()["queued"], b.stats()["dropped"]) for b in buses]
    report["events"] = [[(e.name, dict(e.data)) for e in r.events] for r in seen]
    out.send(report)


def test_no_thread_in_a_child_queues_warns_and_recovers(recorder: Recorder) -> None:
    """In a forked child where no thread can start (its dispatcher and handler threads start
    with its first event): log_event and Stat.add raise nothing (they used to raise
    RuntimeError: can't start new thread), what they log waits in the queue (a full queue
    under "block" drops and counts instead of waiting for a dispatcher that cannot start),
    one warning per bus says so, and once threads can start the next event starts the
    dispatcher and everything queued is delivered, in order."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    own = EventBus(name="own", children="own")
    own.register_event_handler(recorder)
    blocky = EventBus(capacity=2, overflow="block", name="blocky", children="own")
    held = Recorder()
    blocky.register_event_handler(held)
    reader, writer = fork.Pipe(duplex=False)
    child = fork.Process(
        target=_no_threads, args=((own, blocky), (recorder, held), writer), daemon=True
    )
    child.start()
    assert reader.poll(60)
    report = reader.recv()
    child.join(60)
    assert child.exitcode == 0
    assert report["raised"] == []
    assert report["before"] == [(4, 0), (2, 3)]  # 3 events and a window; 2 queued, 3 dropped
    assert len(report["warnings"]) == 2  # one per bus
    assert "RuntimeError: can't start new thread" in report["warnings"][0]
    assert report["flushed"] == [True, True]
    assert report["after"] == [(0, 0), (0, 3)]
    assert report["events"] == [
        [*(("e", {"i": i}) for i in range(3)), (STAT_EVENT, {"s.count": 1}), ("e", {"i": 3})],
        [("e", {"i": i}) for i in (0, 1, 5)],
    ]
    assert recorder.events == held.events == []  # the child ran its own copies
    assert own.close(10)
    assert blocky.close(10)


def test_unregistering_the_last_handler_delivers_the_open_windows_first(
    bus: EventBus, recorder: Recorder
) -> None:
    """Unregistering a bus's last handler logs each Stat's open window (partial, as exit does)
    and delivers it to that handler before detaching it; nothing is counted as unhandled."""
    handle = bus.register_event_handler(recorder)
    stat = Stat("x", [Aggregation.SUM, Aggregation.COUNT], timedelta(hours=1), bus=bus)
    stat.add(1.0)
    stat.add(2.0)
    assert bus.flush(10)
    assert recorder.events == []  # the window is still open
    assert bus.unregister_event_handler(handle, timeout=10) is True
    assert [(e.name, e.data) for e in recorder.events] == [
        (STAT_EVENT, {"x.sum": 3.0, "x.count": 2})
    ]
    assert stat.count == 0
    assert bus.stats()["unhandled"] == 0


def test_unregistering_one_of_two_handlers_leaves_the_windows_open(
    bus: EventBus, recorder: Recorder
) -> None:
    """Only the last handler's leaving closes the windows: another handler still listens."""
    first = Recorder()
    handle = bus.register_event_handler(first)
    last = bus.register_event_handler(recorder)
    stat = Stat("x", [Aggregation.COUNT], timedelta(hours=1), bus=bus)
    stat.add(1.0)
    assert bus.unregister_event_handler(handle, timeout=10) is True
    assert first.events == []
    assert stat.count == 1
    assert bus.unregister_event_handler(last, timeout=10) is True
    assert [e.data for e in recorder.events] == [{"x.count": 1}]
    assert first.events == []


def test_what_is_logged_with_no_handler_left_is_counted_and_named_once_at_close(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """Events and Stat windows logged after the last handler left are counted in
    ``stats()["unhandled"]`` and named in one warning at close, counted after close too."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    bus = EventBus(name="deaf")
    stat = Stat("x", [Aggregation.COUNT], timedelta(hours=1), bus=bus)
    handle = bus.register_event_handler(recorder)
    assert bus.unregister_event_handler(handle, timeout=10) is True
    for i in range(3):
        bus.log_event(ev(i))
    bus.log("e", i=3)
    stat.add(1.0)  # its window is logged by close(), with no handler to take it
    assert bus.stats()["unhandled"] == 4
    assert bus.close(10) is True
    assert bus.stats()["unhandled"] == 5
    assert [r.getMessage() for r in caplog.records if r.name == "monitor_bus"] == [
        "EventBus 'deaf': 5 events (Stat windows included) were logged while it had no handler"
        " and went nowhere: unregister the last handler only once the run is over"
    ]
    assert recorder.events == []


def test_a_bus_that_never_had_a_handler_counts_but_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Logging on a bus nobody ever listened to is torch.monitor's no-op: counted, not warned."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    bus = EventBus(name="quiet")
    stat = Stat("x", [Aggregation.COUNT], timedelta(hours=1), bus=bus)
    bus.log_event(ev(0))
    stat.add(1.0)
    assert bus.close(10) is True
    assert bus.stats()["unhandled"] == 2
    assert [r for r in caplog.records if r.name == "monitor_bus"] == []


def test_counters_survive_close(caplog: pytest.LogCaptureFixture) -> None:
    """A closed bus keeps reporting its final counts: queue drops, per-handler drops and
    errors read the same after close() as before it."""
    from .conftest import LoopGate

    caplog.set_level(logging.ERROR, logger="monitor_bus")
    gate = LoopGate()
    calls: list[int] = []
    failed = threading.Event()

    def failing(e: Event) -> None:
        calls.append(1)
        failed.set()
        raise OSError("the disk is full")

    bus = EventBus(capacity=10, name="totals")
    bus.register_event_handler(gate, name="gate")
    bus.register_event_handler(failing, name="failing")
    gate.hold(bus)  # the loop is blocked: nothing leaves the queue
    assert failed.wait(10)  # its backlog is empty: only the queue drops
    for i in range(100):
        bus.log_event(ev(i))
    gate.release.set()
    assert bus.flush(10)
    before = bus.stats()
    assert before["dropped"] == 90
    assert before["handler_dropped"] == 180
    assert before["handler_errors"] == len(calls) == 11
    assert bus.close(10) is True
    after = bus.stats()
    assert after == before
    assert bus.close(10) is True  # idempotent: a second close keeps them too
    assert bus.stats() == before
    handlers = [
        (h["name"], h["logged"], h["delivered"], h["dropped"], h["errors"])
        for h in after["handlers"]
    ]
    assert handlers == [("gate", 101, 11, 90, 0), ("failing", 101, 11, 90, 11)]


def test_a_close_racing_the_one_that_detaches_waits_for_its_handlers_and_keeps_counts() -> None:
    """A close() that runs while another waits for the handlers it detached finds none to
    detach: it waits for those (not returning while they still deliver), and the bus keeps
    their counts, not an empty list."""
    entered, release = threading.Event(), threading.Event()

    def stuck(e: Event) -> None:
        entered.set()
        release.wait(30)

    bus = EventBus(name="race")
    bus.register_event_handler(stuck, name="stuck")
    for i in range(3):
        bus.log_event(ev(i))
    assert entered.wait(10)
    results: dict[str, bool] = {}
    closes = [
        threading.Thread(target=lambda n=n: results.update({n: bus.close(30)}))
        for n in ("first", "second")
    ]
    closes[0].start()
    deadline = time.monotonic() + 10
    while not bus._detached and time.monotonic() < deadline:  # the first close detached it
        time.sleep(0.001)
    ((handler, _),) = bus._detached
    closes[1].start()
    while len(handler.cv._waiters) < 2 and time.monotonic() < deadline:  # both wait on it
        time.sleep(0.001)
    assert len(handler.cv._waiters) == 2
    assert results == {}
    release.set()
    for close in closes:
        close.join(30)
    assert results == {"first": True, "second": True}
    handlers = [(h["name"], h["logged"], h["delivered"]) for h in bus.stats()["handlers"]]
    assert handlers == [("stuck", 3, 3)]
