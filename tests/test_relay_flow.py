"""The relay's flow: a stuck sink, a child writing flat out and a full socket never hang the
parent or a child beyond their timeouts, and every event is delivered or counted."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import monitor_bus
from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _ratelimit

from .conftest import Recorder

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)
FORK = multiprocessing.get_context("fork")


def _within(limit: float, call: Callable[..., Any], *args: Any) -> list[Any]:
    """``[call(*args)]`` if it returned within ``limit`` seconds, else ``[]`` (it hangs)."""
    result: list[Any] = []
    done = threading.Event()

    def run() -> None:
        result.append(call(*args))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    done.wait(limit)
    return result


class StuckSink:
    """A handler that records each event, the first one only once ``release`` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.entered.set()
        self.release.wait()
        self.events.append(event)


def _log_on(bus: EventBus, n: int) -> None:
    """A forked child's task: log ``n`` events on ``bus`` (which it inherited)."""
    for i in range(n):
        bus.log_event(Event("child", TS, {"i": i}))


def _block_bus_fed_by_a_child(n: int) -> tuple[EventBus, StuckSink, Any]:
    """A parent bus under "block" with room for 10 and a sink stuck on its first event, and a
    child (exited) that logged ``n`` events on it: the relay has more than fits."""
    bus = EventBus(capacity=10, overflow="block", name="blocky")
    sink = StuckSink()
    handle = bus.register_event_handler(sink)
    child = FORK.Process(target=_log_on, args=(bus, n))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert sink.entered.wait(30)  # the relay reads the child; the sink holds the first event
    return bus, sink, handle


def test_a_stuck_sink_under_block_leaves_flush_its_timeout() -> None:
    """With the parent's queue full under "block" and its sink stuck, the relay stops reading
    the child instead of waiting for room: each flush(0.5) returns False (it used to hang on
    the relay's lock for as long as the sink was stuck). Once the sink moves, every event the
    child logged arrives, in order, none dropped."""
    bus, sink, _ = _block_bus_fed_by_a_child(500)
    try:
        for _ in range(2):
            assert _within(10, bus.flush, 0.5) == [False]
    finally:
        sink.release.set()
    assert bus.flush(30)
    assert [e.data["i"] for e in sink.events] == list(range(500))
    assert bus.stats()["dropped"] == 0
    assert bus.close(10)


def test_a_stuck_sink_under_block_leaves_close_its_timeout() -> None:
    """close(1) with the sink stuck under "block" returns False in time (it used to hang), and
    what the sink did not get is counted: delivered, dropped for the cut-off handler, and
    dropped by the closed bus (read from the child after close) add up to what the child
    logged."""
    bus, sink, handle = _block_bus_fed_by_a_child(500)
    try:
        assert _within(10, bus.flush, 0.5) == [False]
        assert _within(10, bus.close, 1.0) == [False]
    finally:
        sink.release.set()
    handler = handle._handler
    assert handler.wait_stopped(30)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    assert listener.sweep(30)  # what the child wrote is read: counted by the closed bus
    assert handler.delivered == len(sink.events) > 0
    assert handler.delivered + handler.dropped + bus.stats()["dropped"] == 500


def _flood(bus: EventBus, started: Any, stop: Any) -> None:
    """A forked child's task: log events on ``bus`` as fast as it can until ``stop``; set
    ``started`` once its socket is full. Their text is slow to decode (UTF-8 of 3-byte
    characters, which the child encodes once and caches), so the parent reads more slowly
    than this child writes."""
    blob = "\u20ac" * 8192
    while not stop.is_set():
        for _ in range(100):
            bus.log_event(Event("flood", TS, {"blob": blob}))
        if bus.stats()["dropped"]:
            started.set()  # its socket is full: the parent reads more slowly than it writes


def _spin(until: threading.Event) -> None:
    """Busy in Python (holding the GIL but at each switch interval) until ``until`` is set."""
    n = 0
    while not until.is_set():
        for _ in range(10_000):
            n += 1


def test_a_child_writing_flat_out_starves_no_sibling(recorder: Recorder) -> None:
    """One child logs flat out (faster than the relay reads), a sibling logs five events: the
    sibling's events arrive, and flush() returns True meanwhile, having settled what the
    children had written when it was called (the relay used to read the fast child until it
    ran dry, which it never did)."""
    flood = EventBus(capacity=1000, name="flood")
    flooded = [0]
    flood.register_event_handler(lambda _: flooded.__setitem__(0, flooded[0] + 1))
    quiet = EventBus(name="quiet")
    quiet.register_event_handler(recorder)
    started, stop = FORK.Event(), FORK.Event()
    flooder = FORK.Process(target=_flood, args=(flood, started, stop))
    flooder.start()
    # The parent is busy in Python meanwhile, as a trainer and its threads are: the relay's
    # thread waits for the GIL after each read, so the flooder keeps its socket full.
    busy = threading.Event()
    for _ in range(3):
        threading.Thread(target=_spin, args=(busy,), daemon=True).start()
    try:
        assert started.wait(60)
        sibling = FORK.Process(target=_log_on, args=(quiet, 5))
        sibling.start()
        sibling.join(60)
        assert sibling.exitcode == 0
        assert recorder.wait_for(5, timeout=60)
        assert quiet.flush(30)
        assert flood.flush(30)
        assert flooder.is_alive()  # still writing flat out
    finally:
        busy.set()
        stop.set()
        flooder.join(60)
    assert [e.data["i"] for e in recorder.events] == list(range(5))
    assert flooded[0] > 0
    assert quiet.close(10)
    assert flood.close(10)


def _window_waits_event_does_not(held: EventBus, win: EventBus, other: EventBus, out: Any) -> None:
    """A forked child's task: have the parent stop reading it (``held`` parks), fill its
    socket, send a Stat window of ``win`` on one thread (which waits for room: ``win``'s
    exit_timeout is long) and log a drop_newest event of ``other`` on this one; report whether
    that call returned while the window still waited, and ``other``'s drops."""
    for i in range(5):
        held.log_event(Event("held", TS, {"i": i}))  # more than the parent has room for
    blob = "x" * 30000
    while not other.stats()["dropped"]:  # the parent no longer reads: the socket fills
        other.log_event(Event("fill", TS, {"blob": blob}))
    stat = Stat("w", [Aggregation.COUNT], timedelta(hours=1), bus=win)
    stat.add(1)
    waiting, sent = threading.Event(), threading.Event()

    def watch(frame: Any, event: str, arg: Any) -> None:
        # The window's send waits for room in a poll (epoll's or poll's): it waits from now.
        if event == "c_call" and getattr(arg, "__name__", "") == "poll":
            waiting.set()

    def send_window() -> None:
        sys.setprofile(watch)
        win.close()  # logs the open window: it waits for room, up to exit_timeout
        sys.setprofile(None)
        sent.set()

    threading.Thread(target=send_window).start()
    assert waiting.wait(60)
    other.log_event(Event("quick", TS, {"i": 0}))  # drop_newest: no room, no wait
    out.send((not sent.is_set(), other.stats()["dropped"]))
    assert sent.wait(120)


def test_a_window_waiting_for_room_does_not_hold_up_another_threads_event(
    recorder: Recorder,
) -> None:
    """In a child whose parent does not read (its socket full), a Stat window waiting for room
    (up to a long exit_timeout) does not hold up a drop_newest event on another thread: that
    call drops its event, counts it and returns while the window still waits (it used to wait
    on the uplink's lock behind the window). Once the parent reads again, the window arrives."""
    held = EventBus(capacity=1, overflow="block", name="held")
    sink = StuckSink()
    held.register_event_handler(sink)
    win = EventBus(exit_timeout=120, name="win")
    win.register_event_handler(recorder)
    other = EventBus(name="other")
    other.register_event_handler(lambda _: None)
    reader, writer = FORK.Pipe(duplex=False)
    child = FORK.Process(
        target=_window_waits_event_does_not, args=(held, win, other, writer), daemon=True
    )
    child.start()
    try:
        assert reader.poll(60)  # the child reports (it used to hang)
        assert reader.recv() == (True, 2)  # returned while the window waited; the fill's drop too
    finally:
        sink.release.set()
    child.join(120)
    assert child.exitcode == 0
    assert win.flush(30)
    assert [(e.name, e.data) for e in recorder.events] == [(STAT_EVENT, {"w.count": 1})]
    assert held.flush(30)
    assert [e.data["i"] for e in sink.events] == list(range(5))
    for bus in (held, win, other):
        assert bus.close(10)


def attempt(raised: list[str], call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)``; what it raises is added to ``raised``."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        raised.append(f"{call.__qualname__}: {exc!r}")


class _Warnings(logging.Handler):
    """Counts the warnings of the ``monitor_bus`` logger that contain ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.count += 1


def _no_descriptors(bus: EventBus, out: Any) -> None:
    """A forked child's task: with no file descriptor left (RLIMIT_NOFILE at the lowest free
    one), log three events and close a Stat window in an add; then, descriptors back, log two
    events and close another window. Report what raised, the drops, the warnings."""
    import resource

    warnings = _Warnings("no socket could be made")
    logging.getLogger("monitor_bus").addHandler(warnings)
    now = [0.0]
    monitor_bus._stat._clock = lambda: now[0]  # windows close when this test says
    # The warnings' rate limit reads the same clock: the phase lasts 2 s by it, however slow
    # the machine, so "one warning" does not rest on 10 s outlasting it.
    _ratelimit.time = types.SimpleNamespace(monotonic=lambda: now[0])  # type: ignore[assignment]
    stat = Stat("s", [Aggregation.COUNT], timedelta(seconds=1), bus=bus)
    report: dict[str, Any] = {"raised": []}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    free = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
    os.close(free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))
    try:
        for i in range(3):
            attempt(report["raised"], bus.log_event, Event("none", TS, {"i": i}))
        attempt(report["raised"], stat.add, 1)
        now[0] += 1
        attempt(report["raised"], stat.add, 1)  # closes the first window: no descriptor to send it
        attempt(report["raised"], stat.add, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    report["dropped"] = bus.stats()["dropped"]
    for i in range(2):
        bus.log_event(Event("back", TS, {"i": i}))
    now[0] += 1
    stat.add(1)  # closes the second window (two samples): sent
    report["sent"] = bus.stats()["to_parent"]
    report["warnings"] = warnings.count
    out.send(report)


def test_no_file_descriptor_in_a_child_drops_counts_and_recovers(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A child out of file descriptors (EMFILE as it connects to its parent): log_event and
    Stat.add raise nothing (they used to raise OSError), the three events and the window are
    counted as dropped with one warning, and once descriptors are back the child connects and
    what it logs arrives, its drops reported to the parent, which says they came from a child
    (it used to call them "queue full")."""
    bus = EventBus(name="fds")
    bus.register_event_handler(recorder)
    reader, writer = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_no_descriptors, args=(bus, writer), daemon=True)
    child.start()
    assert reader.poll(60)
    report = reader.recv()
    child.join(60)
    assert child.exitcode == 0
    assert report == {"raised": [], "dropped": 4, "sent": 3, "warnings": 1}
    assert bus.flush(30)
    assert [(e.name, e.data) for e in recorder.events] == [
        ("back", {"i": 0}),
        ("back", {"i": 1}),
        (STAT_EVENT, {"s.count": 2}),
        (STAT_EVENT, {"s.count": 1}),  # the last add's window, as the child exits
    ]
    assert bus.stats()["dropped"] == 4  # reported by the child with its next message
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        assert bus.close(10)
    assert [r.getMessage() for r in caplog.records if "fds" in r.getMessage()] == [
        "EventBus 'fds': child processes reported 4 events they could not send since the last "
        "report, 4 in all"
    ]


def test_exit_with_a_stuck_sink_under_block_keeps_exit_timeout() -> None:
    """A program whose sink is stuck under "block" while a child's events wait in the relay
    exits within its exit_timeout (it used to hang for ever), and names what it lost: what the
    cut-off handler did not get and what the bus dropped add up to what the child logged."""
    code = """
import multiprocessing, threading
from datetime import datetime
from monitor_bus import Event, EventBus
bus = EventBus(capacity=10, overflow="block", name="b", exit_timeout=2)
entered, stuck = threading.Event(), threading.Event()
def sink(event):
    entered.set()
    stuck.wait()
bus.register_event_handler(sink)
def child(bus):
    for i in range(500):
        bus.log_event(Event("c", datetime.now(), {"i": i}))
proc = multiprocessing.get_context("fork").Process(target=child, args=(bus,))
proc.start()
proc.join()
assert entered.wait(30)
assert not bus.flush(0.5)  # the relay holds more than there is room for
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    cut = re.search(
        r"cut off: 'sink' \((\d+) undelivered, (\d+) in its current call\)", result.stderr
    )
    dropped = re.findall(r"(\d+) (?:dropped )?in all", result.stderr)
    assert cut is not None, result.stderr
    # The stuck call holds one event (named apart), the rest were dropped or not delivered
    # (the closing bus queues what the relay held: none is dropped unless the sweep ran out).
    assert int(cut[2]) == 1, result.stderr
    assert int(cut[1]) + 1 + (int(dropped[-1]) if dropped else 0) == 500, result.stderr


def _log_after_each_go(bus: EventBus, go: Any, out: Any) -> None:
    """A forked child's task: log one event per byte read from ``go``, saying so on ``out``;
    then send back ``(to_parent, dropped)``."""
    for i in range(2):
        os.read(go, 1)
        bus.log_event(Event("meant-for-a", TS, {"i": i}))
        os.write(out, b".")
    stats = bus.stats()
    os.write(out, f"{stats['to_parent']} {stats['dropped']}".encode())


def test_a_childs_events_for_a_closed_bus_never_reach_another_bus_of_its_name() -> None:
    """A forked child logging on a bus its parent has closed gets the "closed" answer and
    counts its events dropped, even when another open bus shares the name (every bus is named
    "bus" unless told): they used to reach that unrelated bus's handlers."""
    a, b = EventBus(), EventBus()  # both named "bus"
    got_a: list[Event] = []
    got_b: list[Event] = []
    a.register_event_handler(got_a.append)
    b.register_event_handler(got_b.append)
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    child = FORK.Process(target=_log_after_each_go, args=(a, go_r, out_w))
    child.start()
    try:
        assert a.close(10)
        os.write(go_w, b"!")  # the child announces bus a and sends its first event...
        assert os.read(out_r, 1) == b"."
        assert b.flush(10)  # ...which the relay has read and answered by now
        os.write(go_w, b"!")  # the second send reads the answer first
        assert os.read(out_r, 1) == b"."
        assert os.read(out_r, 100) == b"0 2"  # nothing sent to a bus that takes it; 2 dropped
        child.join(60)
        assert child.exitcode == 0
        assert b.flush(10)
        assert got_a == []
        assert got_b == []
    finally:
        b.close(10)
        for fd in (go_r, go_w, out_r, out_w):
            os.close(fd)


CLOSE_UNREAD = """
import os
from datetime import datetime, timezone

from monitor_bus import Event, EventBus
from monitor_bus._lifecycle import process

bus = EventBus(name="b")
bus.register_event_handler(lambda event: None)
listener = process.listener
go_r, go_w = os.pipe()
out_r, out_w = os.pipe()
child = os.fork()
if child == 0:  # logs while the parent's relay cannot read, then says what it counted sent
    os.read(go_r, 1)
    for i in range(5000):
        bus.log_event(Event("x", datetime.now(timezone.utc), {"i": i, "pad": "y" * 200}))
    stats = bus.stats()
    os.write(out_w, f"{stats['to_parent']} {stats['dropped']}".encode())
    os._exit(0)
assert bus.close(10)
with listener._lock:  # the relay's thread reads nothing meanwhile
    os.write(go_w, b"!")
    sent, child_dropped = map(int, os.read(out_r, 100).split())
os.waitpid(child, 0)
listener.close()  # at exit, after the buses: what the relay had not read yet
print(sent, child_dropped, bus.stats()["dropped"])
"""


def test_closing_the_relay_counts_what_the_children_wrote_and_it_had_not_read() -> None:
    """Every event a child counted as sent is counted by the parent when the relay closes
    (at exit, after the buses), though the relay had not read it yet: dropped, as its bus is
    closed. They used to be closed away unread, counted nowhere."""
    result = subprocess.run(
        [sys.executable, "-c", CLOSE_UNREAD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    sent, child_dropped, parent_dropped = map(int, result.stdout.split())
    assert sent + child_dropped == 5000
    assert sent > 0
    assert parent_dropped == sent, result.stderr
