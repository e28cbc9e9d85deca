"""The dispatcher keeps delivering: registries that race, a failing task, and drop reports."""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from datetime import datetime, timedelta, timezone

import anyio
import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, EventHandlerHandle, Stat

from .conftest import LogSeen, Recorder
from .conftest import LoopGate as Gate

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)


def ev(i: int, name: str = "e") -> Event:
    return Event(name, TS, {"i": i})


def errors_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "monitor_bus" and r.levelno >= logging.ERROR
    ]


def drop_warnings(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "monitor_bus" and r.levelno == logging.WARNING and what in r.getMessage()
    ]


@pytest.fixture
def drop_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock of the drop reports' rate limit, stepped by the test (starts at 0)."""
    from monitor_bus import _ratelimit

    now = [0.0]
    monkeypatch.setattr(_ratelimit, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


# -- item 1: Stats created while the timer runs --


@pytest.mark.parametrize(
    ("existing", "created_per_thread"),
    [
        pytest.param(5_000, 10_000, id="5k+2x10k"),
        pytest.param(20_000, 20_000, id="20k+2x20k", marks=pytest.mark.stress),
    ],
)
def test_stats_created_during_timer_passes_do_not_stop_delivery(
    existing: int, created_per_thread: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Stats created by two threads while the timer walks thousands of 5 ms windows leave the
    dispatcher running: no error is logged and a later event arrives without flush()."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    arrived = threading.Event()
    window = timedelta(milliseconds=5)
    bus = EventBus(name="timers")
    try:
        bus.register_event_handler(lambda e: arrived.set() if e.name == "after" else None)
        stats = [Stat(f"s{i}", [Aggregation.COUNT], window, bus=bus) for i in range(existing)]

        def create(k: int) -> None:
            made = [
                Stat(f"t{k}.{i}", [Aggregation.COUNT], window, bus=bus)
                for i in range(created_per_thread)
            ]
            stats.extend(made)

        threads = [threading.Thread(target=create, args=(k,)) for k in range(2)]
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch every microsecond: the race is near-certain
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            sys.setswitchinterval(switch_interval)

        assert errors_of(caplog) == []
        bus.log_event(Event("after", TS, {}))
        assert arrived.wait(30), "the event did not arrive without flush()"
        assert bus.stats()["dispatcher_restarts"] == 0
        assert len(stats) == existing + 2 * created_per_thread
    finally:
        assert bus.close(timeout=30)


def test_a_failed_dispatcher_is_logged_and_started_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, recorder: Recorder
) -> None:
    """An exception in a dispatcher task is logged at CRITICAL naming the bus, the dispatcher
    starts again, later events and Stat windows arrive without flush(), and close() succeeds."""
    from monitor_bus._dispatcher import Dispatcher

    caplog.set_level(logging.WARNING, logger="monitor_bus")
    original = Dispatcher._timer_pass
    calls = [0]
    failed = threading.Event()

    def fail_once(self: Dispatcher, next_end: dict[float, float]) -> float | None:
        calls[0] += 1
        if calls[0] == 2:  # the pass a new window size triggers, after registration
            failed.set()
            raise RuntimeError("injected timer failure")
        return original(self, next_end)

    monkeypatch.setattr(Dispatcher, "_timer_pass", fail_once)
    # The failed thread logs once the new dispatcher runs: what the new one delivers may
    # arrive first. On the root logger, after the capture's handler: once this has seen the
    # record, caplog holds it.
    logged = LogSeen("the dispatcher failed")
    logging.getLogger().addHandler(logged)
    try:
        bus = EventBus(name="crashy")
        bus.register_event_handler(recorder)
        stat = Stat("load", [Aggregation.COUNT], timedelta(milliseconds=5), bus=bus)
        assert failed.wait(10)

        bus.log_event(ev(1))
        assert recorder.wait_for(1), "the event did not arrive without flush()"
        stat.add(1.0)  # the restarted timer closes this window
        assert recorder.wait_for(2), "the Stat window did not arrive without flush()"
        assert logged.seen.wait(10)
    finally:
        logging.getLogger().removeHandler(logged)

    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1
    assert "EventBus 'crashy'" in critical[0].getMessage()
    assert "the dispatcher failed" in critical[0].getMessage()
    assert "injected timer failure" in caplog.text
    assert bus.stats()["dispatcher_restarts"] == 1
    assert [e.name for e in recorder.events] == ["e", STAT_EVENT]
    assert recorder.events[1].data == {"load.count": 1}
    assert bus.close(timeout=10) is True


# -- item 5: every drop is reported, at most once per interval --


def test_handler_drops_are_reported_once_per_interval(
    drop_clock: list[float], caplog: pytest.LogCaptureFixture, recorder: Recorder
) -> None:
    """A handler that falls behind is named in a WARNING with its drop count, at most once per
    interval, and close() reports the rest."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    entered, release = threading.Event(), threading.Event()

    def slow(event: Event) -> None:
        entered.set()
        release.wait()

    bus = EventBus(capacity=10, name="lagging")
    bus.register_event_handler(slow, name="slow")
    bus.register_event_handler(recorder)  # paces the producer: the queue itself never overflows
    bus.log_event(ev(0))
    assert entered.wait(10)  # event 0 in flight; the next 10 fill the backlog, the rest drop

    def log_paced(first: int, last: int) -> None:
        for i in range(first, last + 1):
            bus.log_event(ev(i))
            assert recorder.wait_for(i + 1)

    log_paced(1, 20)  # events 11..20 dropped: one warning, at the first drop
    assert drop_warnings(caplog, "fell behind") == [
        "EventBus 'lagging': handler 'slow' fell behind (backlog capacity 10, policy drop_newest): "
        "1 events dropped since the last report, 1 in all"
    ]
    drop_clock[0] += 10.0  # one interval later, the next drop is reported again
    log_paced(21, 30)
    drop_clock[0] += 1.0  # within that interval: no report
    log_paced(31, 41)
    release.set()
    assert bus.flush(10)
    (slow_stats, _) = bus.stats()["handlers"]
    assert (slow_stats["delivered"], slow_stats["dropped"]) == (11, 31)
    assert bus.stats()["dropped"] == 0
    assert bus.close(timeout=10)

    reports = drop_warnings(caplog, "fell behind")
    assert len(reports) == 3
    assert reports[1].endswith("10 events dropped since the last report, 11 in all")
    assert reports[2].endswith("20 events dropped since the last report, 31 in all")
    assert all("EventBus 'lagging'" in r and "handler 'slow'" in r for r in reports)


def test_queue_drops_are_reported_once_per_interval(
    drop_clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    """Drops by a full queue are reported naming the bus and the count, at most once per
    interval, and the next interval reports what was dropped meanwhile."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    gate = Gate()
    bus = EventBus(capacity=5, name="narrow")
    bus.register_event_handler(gate, name="gate")

    def flood(n: int) -> None:
        gate.hold(bus)
        for i in range(n):
            bus.log_event(ev(i))
        gate.release.set()
        assert bus.flush(10)

    flood(20)  # the loop is blocked: 5 queued, 15 dropped
    flood(20)  # 15 more, within the interval
    assert drop_warnings(caplog, "queue full") == [
        "EventBus 'narrow': queue full (capacity 5, policy drop_newest): "
        "15 events dropped since the last report, 15 in all"
    ]
    drop_clock[0] += 10.0
    assert bus.flush(10)
    assert bus.close(timeout=10)
    reports = drop_warnings(caplog, "queue full")
    assert len(reports) == 2
    assert "EventBus 'narrow'" in reports[1]
    assert reports[1].endswith("15 events dropped since the last report, 30 in all")
    assert bus.stats()["dropped"] == 30


# -- a dispatcher that keeps failing, and what a failure does to handlers --


def test_a_dispatcher_failing_again_and_again_stops_restarting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, recorder: Recorder
) -> None:
    """Three failures within the interval stop the restarts, say so once at CRITICAL, and from
    then on flush() returns False; close() hands what is queued to the sync handlers, whose
    threads still run, and returns False."""
    from monitor_bus._dispatcher import Dispatcher

    original = Dispatcher._timer_pass
    fail = threading.Event()

    def fail_once_told(self: Dispatcher, next_end: dict[float, float]) -> float | None:
        if fail.is_set():  # every pass, of every new dispatcher, from now on
            raise RuntimeError("injected timer failure")
        return original(self, next_end)

    monkeypatch.setattr(Dispatcher, "_timer_pass", fail_once_told)
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    gave_up = LogSeen("it is not started again")
    logging.getLogger().addHandler(gave_up)  # after the capture's handler: caplog has it then
    try:
        bus = EventBus(name="doomed")
        bus.register_event_handler(recorder)
        fail.set()
        Stat("trigger", [Aggregation.COUNT], timedelta(milliseconds=7), bus=bus)  # a pass
        assert gave_up.seen.wait(10)
        bus.log_event(ev(0))
        assert bus.flush(1) is False
        assert bus.stats()["dispatcher_restarts"] == 2
        assert bus.close(1) is False
    finally:
        logging.getLogger().removeHandler(gave_up)
    critical = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert [m.split(";")[0] for m in critical] == [
        f"EventBus 'doomed': the dispatcher failed (failure {n})" for n in (1, 2, 3)
    ]
    assert critical[-1].endswith(
        "3 failures within 10 s: it is not started again; events wait in the queue for "
        "close(), and flush() and close() return False"
    )
    assert [e.data for e in recorder.events] == [{"i": 0}]


def test_a_failure_does_not_blame_an_async_handler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An async handler cancelled because its loop failed is not counted as raising: its
    backlog is counted as dropped, and it takes events again once the dispatcher restarts."""
    from monitor_bus._dispatcher import Dispatcher

    caplog.set_level(logging.WARNING, logger="monitor_bus")
    original = Dispatcher._timer_pass
    fail = threading.Event()

    def fail_when_told(self: Dispatcher, next_end: dict[float, float]) -> float | None:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected timer failure")
        return original(self, next_end)

    monkeypatch.setattr(Dispatcher, "_timer_pass", fail_when_told)
    restarted = LogSeen("a new one runs")
    logging.getLogger("monitor_bus").addHandler(restarted)
    got: list[int] = []
    entered = threading.Event()

    async def waits_on_first(event: Event) -> None:
        if event.data["i"] == 0:
            entered.set()
            await anyio.sleep_forever()  # cancelled by the failure, not by the handler
        got.append(event.data["i"])  # type: ignore[arg-type]

    bus = EventBus(name="blameless")
    bus.register_event_handler(waits_on_first, name="async")
    for i in range(5):
        bus.log_event(ev(i))
    assert entered.wait(10)
    fail.set()
    Stat("trigger", [Aggregation.COUNT], timedelta(milliseconds=7), bus=bus)  # a timer pass
    try:
        assert restarted.seen.wait(10)
    finally:
        logging.getLogger("monitor_bus").removeHandler(restarted)
    bus.log_event(ev(5))
    assert bus.flush(10)
    (h,) = bus.stats()["handlers"]
    assert (h["errors"], h["delivered"], h["dropped"], h["pending"]) == (0, 1, 5, 0)
    assert got == [5]
    assert bus.close(10)
    assert drop_warnings(caplog, "fell behind") == [
        "EventBus 'blameless': handler 'async' fell behind (backlog capacity 65536, policy "
        "drop_newest): 5 events dropped since the last report, 5 in all"
    ]


def test_a_call_the_dying_loop_ran_is_not_run_twice(bus: EventBus, recorder: Recorder) -> None:
    """When the loop's end runs a scheduled call and the caller then finds the loop closed,
    the call runs once and its result comes back (no 'Future in unexpected state')."""
    bus.register_event_handler(recorder)
    calls: list[int] = []

    class ClosingLoop:
        def call_soon_threadsafe(self, func: object, *args: object, **kwargs: object) -> None:
            for run in list(bus._dispatcher.unrun):  # what a dying dispatcher's last step does
                run()
            raise RuntimeError("Event loop is closed")

    real_loop = bus._dispatcher.loop
    bus._dispatcher.loop = ClosingLoop()
    try:
        assert bus._dispatcher.in_loop(lambda: calls.append(1) or "done") == "done"
    finally:
        bus._dispatcher.loop = real_loop
    assert calls == [1]


def _cut_off_while_stuck(bus: EventBus) -> tuple[EventHandlerHandle, threading.Event]:
    """Register "stuck", stuck in the first of 4 events logged until the returned event is
    set, and unregister it with a timeout it cannot meet; return its handle and that event."""
    entered, release = threading.Event(), threading.Event()

    def stuck(event: Event) -> None:
        entered.set()
        release.wait()

    handle = bus.register_event_handler(stuck, name="stuck")
    for i in range(4):
        bus.log_event(ev(i))
    assert entered.wait(10)
    assert bus.unregister_event_handler(handle, timeout=0.05) is False
    return handle, release


def test_drops_of_a_handler_cut_off_by_unregister_are_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler cut off by unregister_event_handler(timeout) reports what it did not get."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    bus = EventBus(name="cut")
    _, release = _cut_off_while_stuck(bus)
    release.set()
    assert bus.close(10)
    assert drop_warnings(caplog, "fell behind") == [
        "EventBus 'cut': handler 'stuck' fell behind (backlog capacity 65536, policy "
        "drop_newest): 3 events dropped since the last report, 3 in all"
    ]


def test_unregister_the_loop_does_not_answer_in_time_still_detaches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When the loop does not answer unregister_event_handler(timeout) in time, the call
    returns False and still keeps its promise: no call of the handler starts after it, the
    loop detaches it when it gets there, and what was logged before the call and it did not
    get is counted and reported (what was logged after, not)."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    got: list[str] = []
    saw_gate = threading.Event()

    def rec(event: Event) -> None:
        got.append(event.name)
        if event.name == "gate":
            saw_gate.set()

    bus = EventBus(name="busy")
    handle = bus.register_event_handler(rec, name="rec")
    gate = Gate()
    bus.register_event_handler(gate, name="gate")
    gate.hold(bus)  # the loop is blocked from here on; rec, on its own thread, gets the gate
    assert saw_gate.wait(10)
    bus.log_event(ev(1))
    bus.log_event(ev(2))
    assert bus.unregister_event_handler(handle, timeout=0.05) is False
    for i in range(1000):  # logged after the call: none of them is owed to rec
        bus.log_event(ev(i))
    gate.release.set()
    assert bus.flush(10)
    runner = handle._handler.thread
    assert runner is not None
    runner.join(10)
    assert not runner.is_alive()
    assert got == ["gate"]
    assert "unregistered" in repr(handle)
    assert drop_warnings(caplog, "fell behind") == [
        "EventBus 'busy': handler 'rec' fell behind (backlog capacity 65536, policy "
        "drop_newest): 2 events dropped since the last report, 2 in all"
    ]
    assert bus.close(10)


def test_close_waits_for_a_handler_unregister_gave_up_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that unregister_event_handler(timeout) cut off is still running its last
    call: close() waits for it within its own timeout, and says False when it is still busy."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    bus = EventBus(name="cut")
    handle, release = _cut_off_while_stuck(bus)
    assert bus.close(0.2) is False
    assert drop_warnings(caplog, "still busy") == [
        "EventBus 'cut': 1 handler(s) still busy after 0.2 s, cut off: 'stuck' "
        "(3 undelivered, 1 in its current call)"
    ]
    release.set()
    runner = handle._handler.thread
    assert runner is not None
    runner.join(10)
    assert not runner.is_alive()
    assert drop_warnings(caplog, "fell behind") == [
        "EventBus 'cut': handler 'stuck' fell behind (backlog capacity 65536, policy "
        "drop_newest): 3 events dropped since the last report, 3 in all"
    ]


class _Replaced:
    """A keyed handler "sink", stuck in its first event until ``release``, with more logged
    behind it, then replaced by another handler of its name."""

    def __init__(self, bus: EventBus, n: int) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.got: list[int] = []
        self.handle = bus.register_event_handler(self._slow, name="sink")
        for i in range(n):
            bus.log_event(ev(i))
        assert self.entered.wait(10)
        bus.register_event_handler(lambda event: None, name="sink")

    def _slow(self, event: Event) -> None:
        self.entered.set()
        self.release.wait()
        self.got.append(event.data["i"])

    def finish(self) -> list[int]:
        """Release it, wait until its thread has ended, and return what it got."""
        self.release.set()
        runner = self.handle._handler.thread
        assert runner is not None
        runner.join(10)
        assert not runner.is_alive()
        return self.got


def test_close_cuts_off_a_replaced_handler_still_busy(caplog: pytest.LogCaptureFixture) -> None:
    """A keyed handler replaced by another of its name still owes what was logged before:
    close() counts it among the handlers it waits for, and cuts it off past its timeout."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    bus = EventBus(name="keyed")
    replaced = _Replaced(bus, 3)
    assert bus.close(0.2) is False
    assert drop_warnings(caplog, "still busy") == [
        "EventBus 'keyed': 1 handler(s) still busy after 0.2 s, cut off: 'sink' "
        "(2 undelivered, 1 in its current call)"
    ]
    assert replaced.finish() == [0]
    assert drop_warnings(caplog, "fell behind") == [
        "EventBus 'keyed': handler 'sink' fell behind (backlog capacity 65536, policy "
        "drop_newest): 2 events dropped since the last report, 2 in all"
    ]


def test_close_waits_until_a_replaced_handler_has_its_backlog() -> None:
    """close() with time enough returns once the replaced handler has every event logged
    before its replacement."""
    bus = EventBus(name="keyed")
    replaced = _Replaced(bus, 3)
    replaced.release.set()
    assert bus.close(10) is True
    assert replaced.got == [0, 1, 2]


def test_unregistering_a_replaced_handler_waits_for_its_backlog_and_cuts_it_off() -> None:
    """The handle of a keyed handler that another registration replaced: unregistering it
    waits for the backlog it still delivers, and past the timeout cuts it off (no call starts
    after the call returns) and says False."""
    bus = EventBus(name="replaced")
    replaced = _Replaced(bus, 5)
    assert bus.unregister_event_handler(replaced.handle, timeout=0.05) is False
    assert replaced.finish() == [0]
    assert bus.close(10)


def test_a_handler_unregister_cut_off_stays_detached_in_a_forked_child() -> None:
    """A handler cut off by unregister_event_handler(timeout) before the loop detached it is
    not run by a child forked meanwhile (children="own"), even though the child starts with
    the parent's handlers."""
    got: list[tuple[int, str]] = []

    def rec(event: Event) -> None:
        got.append((os.getpid(), event.name))

    bus = EventBus(name="forked", children="own")
    handle = bus.register_event_handler(rec, name="rec")
    gate = Gate()
    bus.register_event_handler(gate, name="gate")
    gate.hold(bus)
    assert bus.unregister_event_handler(handle, timeout=0.05) is False
    pid = os.fork()
    if pid == 0:  # the child: log, deliver, and say whether rec ran here
        code = 3
        try:
            bus.log_event(ev(1, "in-child"))
            assert bus.flush(10)
            code = 1 if any(p == os.getpid() for p, _ in got) else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    gate.release.set()
    assert bus.close(10)
    assert os.waitstatus_to_exitcode(status) == 0


def _count_wakes(bus: EventBus, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the producers' cross-thread wake-ups of ``bus``'s dispatcher."""
    wakes = [0]
    wake = bus._dispatcher.wake

    def counting() -> None:
        wakes[0] += 1
        wake()

    monkeypatch.setattr(bus._dispatcher, "wake", counting)
    return wakes


@pytest.mark.stress
def test_a_steady_producer_never_wakes_the_dispatcher(
    bus: EventBus, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While events keep coming (one every 2 ms here, for a second) the dispatcher stays awake,
    draining once per linger: after the wake-up that starts the stream, producers make no
    cross-thread call. (Before, it went idle after every batch: one wake-up per millisecond.)"""
    import time

    bus.register_event_handler(recorder)
    bus._linger = 0.5  # longer than any stall of this thread on a loaded machine
    wakes = _count_wakes(bus, monkeypatch)
    for i in range(500):
        bus.log_event(ev(i))
        time.sleep(0.002)  # the steady rate is the scenario
    assert bus.flush(10)
    assert [e.data["i"] for e in recorder.events] == list(range(500))
    assert wakes == [1]


def test_a_crowded_queue_ends_the_linger(
    bus: EventBus, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that finds the queue half full hurries the dispatcher out of its linger, so a
    small queue is not dropped from while the dispatcher waits (a 30 s linger here)."""
    small = EventBus(capacity=10, name="small")
    small.register_event_handler(recorder)
    small._linger = 30.0
    for i in range(6):  # the sixth finds five queued: half the capacity
        small.log_event(ev(i))
    assert recorder.wait_for(6, timeout=10)  # long before the linger would have ended
    assert small.close(10)


def test_flush_does_not_wait_for_the_linger(bus: EventBus, recorder: Recorder) -> None:
    """flush() drains what is queued at once, whatever the linger (30 s here)."""
    bus.register_event_handler(recorder)
    bus._linger = 30.0
    for i in range(3):
        bus.log_event(ev(i))
    assert bus.flush(10)
    assert len(recorder.events) == 3


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_register_gives_up_on_a_blocked_loop_and_registers_nothing(kind: str) -> None:
    """While an async handler blocks the loop, register_event_handler(timeout=...) raises a
    TimeoutError naming the handler and registers nothing: once the loop is free the handler
    gets no event, its thread ends, and registering it again works."""
    got: list[str] = []

    def sync_rec(event: Event) -> None:
        got.append(event.name)

    async def async_rec(event: Event) -> None:
        got.append(event.name)

    rec = sync_rec if kind == "sync" else async_rec
    bus = EventBus(name="blocked")
    gate = Gate()
    bus.register_event_handler(gate, name="gate")
    gate.hold(bus)
    before = set(threading.enumerate())
    with pytest.raises(TimeoutError) as info:
        bus.register_event_handler(rec, name="late", timeout=0.2)
    assert str(info.value) == (
        "EventBus 'blocked': the loop did not take handler 'late' within 0.2 s (an async "
        "handler blocks it?); the handler is not registered"
    )
    started = [t for t in set(threading.enumerate()) - before if t.name.endswith("-late")]
    gate.release.set()
    bus.log_event(ev(1))
    assert bus.flush(10)
    for thread in started:
        thread.join(10)
        assert not thread.is_alive()
    assert len(started) == (kind == "sync")
    assert got == []
    assert [h["name"] for h in bus.stats()["handlers"]] == ["gate"]
    bus.register_event_handler(rec, name="late", timeout=10)
    bus.log_event(ev(2))
    assert bus.flush(10)
    assert got == ["e"]
    assert bus.close(10)
