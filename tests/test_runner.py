"""Runners: the bundled sinks of a bus share one thread, a watchdog moves one that overruns."""

from __future__ import annotations

import logging
import re
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from monitor_bus import (
    Event,
    EventBus,
    JsonlEventHandler,
    TensorboardEventHandler,
    _ratelimit,
    _runner,
    read_jsonl,
)
from monitor_bus.tensorboard import SummaryWriter

from .conftest import Recorder


class Held:
    """A bundled sink (marked as the bundled classes are) whose calls wait for ``release``
    once ``hold`` is set, one call per event."""

    _monitor_bus_bundled = True

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.got: list[int] = []

    def __call__(self, event: Event) -> None:
        self.entered.set()
        self.release.wait()
        self.got.append(event.data["i"])


class Counting(Recorder):
    """A bundled sink that records its events and the threads that call it."""

    _monitor_bus_bundled = True

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[threading.Thread] = set()

    def __call__(self, event: Event) -> None:
        self.threads.add(threading.current_thread())
        super().__call__(event)


class Failing:
    """A bundled sink that raises on every event."""

    _monitor_bus_bundled = True

    def __call__(self, event: Event) -> None:
        raise ValueError(event.data["i"])


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> float:
    """A short watchdog budget, so a test sees the move without waiting a second."""
    monkeypatch.setattr(_runner, "SINK_BUDGET", 0.1)
    return 0.1


def handler_stats(bus: EventBus) -> dict[str, tuple[int, int, int, int]]:
    """Each handler's (delivered, dropped, errors, pending)."""
    return {
        h["name"]: (h["delivered"], h["dropped"], h["errors"], h["pending"])
        for h in bus.stats()["handlers"]
    }


class Said(logging.Handler):
    """The messages of the ``monitor_bus`` logger holding ``text``, with a wait for them: the
    watchdog logs on the loop's thread after the move, so a test that has seen the move's
    threads has not necessarily seen its warning yet."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.messages: list[str] = []
        self.cv = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.text in message:
            with self.cv:
                self.messages.append(message)
                self.cv.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[str]:
        """The messages once there are ``n`` (fewer if ``timeout`` passed first)."""
        with self.cv:
            self.cv.wait_for(lambda: len(self.messages) >= n, timeout)
            return list(self.messages)


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The captured messages holding ``text``."""
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture
def moved() -> Iterator[Said]:
    """The watchdog's warnings that it moved a sink, as they are logged."""
    said = Said("thread of its own")
    logger = logging.getLogger("monitor_bus")
    logger.addHandler(said)
    yield said
    logger.removeHandler(said)


def runner_threads() -> list[str]:
    """The names of the runners' threads alive."""
    prefixes = ("monitor_bus-handler-", "monitor_bus-sinks-")
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefixes))


def test_bundled_sinks_share_one_thread_and_a_user_handler_has_its_own(tmp_path: Path) -> None:
    """JSONL and TensorBoard sinks run on one thread of the bus; a user handler on its own."""
    user = Recorder()
    with (
        SummaryWriter(tmp_path / "tb") as writer,
        JsonlEventHandler(tmp_path / "run.jsonl") as sink,
        EventBus(name="one") as bus,
    ):
        jsonl = bus.register_event_handler(sink, name="j")
        tb = bus.register_event_handler(TensorboardEventHandler(writer), name="tb")
        own = bus.register_event_handler(user, name="user")
        for i in range(300):
            bus.log("step", i=i)
        assert bus.flush(10)
        shared = jsonl._handler.thread
        assert shared is not None
        assert shared.name == "monitor_bus-sinks-one"
        assert tb._handler.thread is shared
        assert own._handler.thread is not shared
        assert runner_threads() == ["monitor_bus-handler-user", "monitor_bus-sinks-one"]
    assert [e.data["i"] for e in read_jsonl(tmp_path / "run.jsonl")] == list(range(300))
    assert [e.data["i"] for e in user.events] == list(range(300))
    assert not shared.is_alive()


def test_a_failing_bundled_sink_costs_the_others_nothing(tmp_path: Path) -> None:
    """A sink raising on every event, sharing the thread, has each error counted; the JSONL
    sink behind it writes every event."""
    with JsonlEventHandler(tmp_path / "run.jsonl") as sink, EventBus(name="iso") as bus:
        bus.register_event_handler(Failing(), name="failing")
        bus.register_event_handler(sink, name="j")
        for i in range(50):
            bus.log("step", i=i)
        assert bus.flush(10)
        assert handler_stats(bus) == {"failing": (50, 0, 50, 0), "j": (50, 0, 0, 0)}
        assert bus._handlers[0].thread is bus._handlers[1].thread
    assert [e.data["i"] for e in read_jsonl(tmp_path / "run.jsonl")] == list(range(50))


def test_the_shared_thread_ends_with_its_last_sink_and_a_new_sink_starts_another(
    tmp_path: Path,
) -> None:
    """Unregistering one sink leaves the shared thread to the other; once the last leaves
    it ends, and a sink registered later gets a new one."""
    with EventBus(name="life") as bus:
        first = bus.register_event_handler(Counting(), name="first")
        second_sink = Counting()
        second = bus.register_event_handler(second_sink, name="second")
        shared = first._handler.thread
        assert shared is not None
        assert bus.unregister_event_handler(first, timeout=10)
        bus.log("step", i=0)
        assert bus.flush(10)
        assert second_sink.threads == {shared}
        assert shared.is_alive()
        assert bus.unregister_event_handler(second, timeout=10)
        shared.join(10)
        assert not shared.is_alive()
        third_sink = Counting()
        third = bus.register_event_handler(third_sink, name="third")
        bus.log("step", i=1)
        assert bus.flush(10)
        assert third._handler.thread is not shared
        assert third_sink.threads == {third._handler.thread}
        assert [e.data["i"] for e in third_sink.events] == [1]


def _watch_message(message: str, bus: str, sink: str, budget: float, tail: str) -> float:
    """The time a watchdog warning reports, once the rest of it is checked."""
    pattern = (
        rf"EventBus '{bus}': sink '{sink}' has run for (\d+\.\d) s in one batch "
        rf"\(budget {budget:g} s\): it runs on a thread of its own from now on{re.escape(tail)}"
    )
    match = re.fullmatch(pattern, message)
    assert match is not None, message
    return float(match.group(1))


def test_the_watchdog_moves_a_stuck_sink_and_the_others_go_on(
    tmp_path: Path, budget: float, moved: Said
) -> None:
    """A bundled sink held in its call past the budget gets the thread it is stuck on; the
    sinks behind it get a new shared thread and deliver while it is still held, and a
    warning names it and the time."""
    held = Held()
    after = Counting()
    bus = EventBus(name="wd")
    sink = JsonlEventHandler(tmp_path / "run.jsonl")
    stuck = bus.register_event_handler(held, name="held")  # first: the others wait behind it
    bus.register_event_handler(after, name="after")
    bus.register_event_handler(sink, name="j")
    shared = stuck._handler.thread
    bus.log("step", i=0)
    assert held.entered.wait(10)
    for i in range(1, 5):
        bus.log("step", i=i)
    assert after.wait_for(5)  # while "held" is still in its first call
    assert held.got == []
    assert after.threads == {bus._handlers[1].thread}
    assert bus._handlers[1].thread is not shared
    assert bus._handlers[2].thread is bus._handlers[1].thread
    assert stuck._handler.thread is shared
    assert shared is not None
    assert shared.name == "monitor_bus-handler-held"
    (message,) = moved.wait_for(1)
    assert _watch_message(message, "wd", "held", budget, ", the other sinks on a new one") >= 0.1
    held.release.set()
    assert bus.flush(10)
    assert held.got == [0, 1, 2, 3, 4]
    assert handler_stats(bus) == {
        "held": (5, 0, 0, 0),
        "after": (5, 0, 0, 0),
        "j": (5, 0, 0, 0),
    }
    assert bus.close(10)
    sink.close()
    assert [e.data["i"] for e in read_jsonl(tmp_path / "run.jsonl")] == [0, 1, 2, 3, 4]


def test_close_cuts_off_a_moved_sink_exactly_and_the_others_finish(
    budget: float, caplog: pytest.LogCaptureFixture
) -> None:
    """close() with a bundled sink stuck in its call: the watchdog frees the sinks behind it,
    which get everything; the stuck one is cut off, and what the warning calls undelivered is
    exactly what is then counted as dropped."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    held = Held()
    after = Counting()
    bus = EventBus(name="cut")
    stuck = bus.register_event_handler(held, name="held")
    bus.register_event_handler(after, name="after")
    for i in range(3):
        bus.log("step", i=i)
    assert held.entered.wait(10)
    assert bus.close(1) is False
    # Picked by their text: the loop (the watchdog's move) logs meanwhile, in any order.
    assert said(caplog, "cut off") == [
        "EventBus 'cut': 1 handler(s) still busy after 1.0 s, cut off: 'held' "
        "(2 undelivered, 1 in its current call)"
    ]
    assert [e.data["i"] for e in after.events] == [0, 1, 2]
    held.release.set()
    runner = stuck._handler.thread
    assert runner is not None
    runner.join(10)
    assert not runner.is_alive()
    handler = stuck._handler
    assert held.got == [0]
    assert (handler.delivered, handler.dropped, handler.offered) == (1, 2, 3)
    assert said(caplog, "fell behind") == [
        "EventBus 'cut': handler 'held' fell behind (backlog capacity 65536, policy "
        "drop_newest): 2 events dropped since the last report, 2 in all"
    ]


class HeldFlush(Counting):
    """A bundled sink whose ``flush()`` waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.flushing, self.release = threading.Event(), threading.Event()

    def flush(self) -> None:
        self.flushing.set()
        assert self.release.wait(30)


def test_a_bundled_sink_settles_only_after_its_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """bus.flush() waits for a bundled sink's own flush() (what was delivered is written),
    not only for its calls: held in flush(), its events stay pending."""
    monkeypatch.setattr(_runner, "SINK_BUDGET", 600.0)
    sink = HeldFlush()
    with EventBus(name="flushing") as bus:
        bus.register_event_handler(sink, name="held")
        for i in range(3):
            bus.log("step", i=i)
        assert sink.flushing.wait(10)
        assert bus.flush(0.1) is False
        assert handler_stats(bus)["held"] == (3, 0, 0, 0)
        assert bus._handlers[0].settled == 0
        sink.release.set()
        assert bus.flush(10)
        assert bus._handlers[0].settled == 3


class Returning(Held):
    """A ``Held`` that says when its first call has returned."""

    _monitor_bus_bundled = True

    def __init__(self) -> None:
        super().__init__()
        self.returned = threading.Event()

    def __call__(self, event: Event) -> None:
        super().__call__(event)
        self.returned.set()


def move_starts(held: Held, monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> None:
    """Have ``before()`` run as the watchdog starts a move's new shared thread (on the bus's
    loop, holding the stuck runner's lock, once ``held`` is stuck), then the real start."""
    real = _runner.Runner.start

    def start(self: _runner.Runner) -> None:
        if held.entered.is_set():
            before()
        real(self)

    monkeypatch.setattr(_runner.Runner, "start", start)


def test_a_sink_returning_as_it_is_moved_is_moved_and_loses_nothing(
    budget: float, moved: Said, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stuck sink's call returns while the watchdog moves it (its runner waits for the
    move to end before going on): the move completes, each sink gets every event once, in
    order, and the moved sink keeps the thread it was on."""
    held = Returning()
    after = Counting()
    bus = EventBus(name="race")

    def release_and_wait() -> None:
        held.release.set()
        assert held.returned.wait(10)

    move_starts(held, monkeypatch, release_and_wait)
    stuck = bus.register_event_handler(held, name="held")
    other = bus.register_event_handler(after, name="after")
    shared = stuck._handler.thread
    bus.log("step", i=0)
    assert held.entered.wait(10)
    for i in range(1, 5):
        bus.log("step", i=i)
    (message,) = moved.wait_for(1)
    assert _watch_message(message, "race", "held", budget, ", the other sinks on a new one") >= 0.1
    assert bus.flush(10)
    assert held.got == [0, 1, 2, 3, 4]
    assert [e.data["i"] for e in after.events] == [0, 1, 2, 3, 4]
    assert handler_stats(bus) == {"held": (5, 0, 0, 0), "after": (5, 0, 0, 0)}
    assert stuck._handler.thread is shared
    assert shared is not None
    assert shared.name == "monitor_bus-handler-held"
    assert after.threads == {other._handler.thread} != {shared}
    assert bus.close(10)


def test_a_thread_that_fails_to_start_during_a_move_is_said_once_and_tried_again(
    budget: float, moved: Said, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread can start when the watchdog moves a stuck sink: an error says so (once per
    10 s: the rate limit's clock stands still here), nothing moves, and each next check (one
    budget later) tries again; once a thread starts the others deliver while it is still
    stuck."""
    monkeypatch.setattr(_ratelimit, "time", types.SimpleNamespace(monotonic=lambda: 0.0))
    failed = Said("no thread to move the other sinks to")
    logging.getLogger("monitor_bus").addHandler(failed)
    held = Held()
    after = Counting()
    bus = EventBus(name="nothread")
    attempts: list[bool] = []  # each move's start: whether the stuck thread was renamed yet

    def fail_once() -> None:
        assert bus._handlers[0].thread is not None
        attempts.append(bus._handlers[0].thread.name == "monitor_bus-handler-held")
        if len(attempts) <= 2:
            raise RuntimeError("can't start new thread")

    try:
        move_starts(held, monkeypatch, fail_once)
        stuck = bus.register_event_handler(held, name="held")
        other = bus.register_event_handler(after, name="after")
        shared = stuck._handler.thread
        bus.log("step", i=0)
        assert held.entered.wait(10)
        bus.log("step", i=1)
        assert after.wait_for(2)  # while "held" is still in its first call
        assert failed.wait_for(1) == [
            "EventBus 'nothread': sink 'held' has run for "
            f"{_took(failed.messages[0])} s in one batch; no thread to move the other sinks "
            "to (can't start new thread)"
        ]
        (message,) = moved.wait_for(1)
        assert _watch_message(message, "nothread", "held", budget, ", the other sinks on a new one")
        assert attempts == [False, False, False]  # the failed starts moved nothing
        assert len(failed.messages) == 1
        assert other._handler.thread is not shared
        assert stuck._handler.thread is shared
        held.release.set()
        assert bus.flush(10)
        assert handler_stats(bus) == {"held": (2, 0, 0, 0), "after": (2, 0, 0, 0)}
        assert bus.close(10)
    finally:
        logging.getLogger("monitor_bus").removeHandler(failed)
        held.release.set()


def _took(message: str) -> str:
    """The time a watchdog message reports, as printed."""
    match = re.search(r"has run for (\d+\.\d) s", message)
    assert match is not None, message
    return match.group(1)


def test_the_watchdog_goes_quiet_once_the_shared_thread_has_ended(
    budget: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the last bundled sink leaves and the shared thread ends, the watchdog forgets it
    at its next look and then waits for a batch of bundled sinks: later batches to a user
    handler wake it no more, and no timer runs it."""
    user = Recorder()
    bus = EventBus(name="quiet")
    calls: list[tuple[float | None, bool]] = []  # each look: what it returned, sinks forgotten
    looked = threading.Condition()
    real = _runner.Runner.watch

    def watch(self: _runner.Runner, dispatcher: Any) -> float | None:
        result = real(self, dispatcher)
        if dispatcher.bus is bus:
            with looked:
                calls.append((result, dispatcher.sinks is None))
                looked.notify_all()
        return result

    monkeypatch.setattr(_runner.Runner, "watch", watch)
    dispatcher = bus._dispatcher
    bus.register_event_handler(user, name="user")  # batches go on without a bundled sink
    sink = bus.register_event_handler(Counting(), name="sink")
    shared = sink._handler.thread
    assert shared is not None
    bus.log("step", i=0)
    assert bus.flush(10)
    assert bus.unregister_event_handler(sink, timeout=10)
    shared.join(10)
    assert not shared.is_alive()
    bus.log("step", i=1)  # wakes the watchdog, unless a timer of its does first
    assert bus.flush(10)
    with looked:
        assert looked.wait_for(lambda: calls and calls[-1] == (None, True), 10)
    dispatcher.in_loop(lambda: None)  # the watchdog has gone back to waiting meanwhile
    seen = len(calls)
    for i in range(2, 6):
        bus.log("step", i=i)
        assert bus.flush(10)
        dispatcher.in_loop(lambda: None)
    assert len(calls) == seen
    assert dispatcher.in_loop(lambda: dispatcher._sinks_busy is not None)  # not on a timer
    assert [e.data["i"] for e in user.events] == list(range(6))
    assert bus.close(10)


def test_a_moved_sink_keeps_its_own_thread_once_healthy_again(budget: float, moved: Said) -> None:
    """A sink moved once stays on its own thread for good (it overran once, and would hold
    the others up again): later batches, healthy, run it there and the others on the new
    shared thread, which a sink registered later joins; nothing is moved again."""
    held = Held()
    after = Counting()
    bus = EventBus(name="apart")
    stuck = bus.register_event_handler(held, name="held")
    other = bus.register_event_handler(after, name="after")
    bus.log("step", i=0)
    assert held.entered.wait(10)
    bus.log("step", i=1)
    assert after.wait_for(2)  # moved: "after" is served while "held" is still stuck
    held.release.set()
    assert bus.flush(10)
    own, shared = stuck._handler.thread, other._handler.thread
    assert own is not None
    assert shared is not None
    for i in range(2, 12):
        bus.log("step", i=i)
        assert bus.flush(10)
    third = Counting()
    late = bus.register_event_handler(third, name="third")
    bus.log("step", i=12)
    assert bus.flush(10)
    assert stuck._handler.thread is own
    assert own.name == "monitor_bus-handler-held"
    assert own.is_alive()
    assert other._handler.thread is shared
    assert late._handler.thread is shared
    assert shared.name == "monitor_bus-sinks-apart"
    assert after.threads == third.threads == {shared}
    assert held.got == list(range(13))
    assert [e.data["i"] for e in after.events] == list(range(13))
    assert len(moved.messages) == 1
    assert bus.close(10)
