"""Garbage: what is unregistered or closed is freed, and closing leaves no thread behind."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import weakref
from datetime import datetime, timezone

from monitor_bus import Event, EventBus

from .conftest import ROOT, Figures


class Sink:
    """A handler object that a weakref can watch."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, event: Event) -> None:
        self.n += 1


class AsyncSink:
    """An async handler object that a weakref can watch."""

    def __init__(self) -> None:
        self.n = 0

    async def __call__(self, event: Event) -> None:
        self.n += 1


def _event() -> Event:
    return Event("gc", datetime.now(timezone.utc), {"x": 1})


def test_unregistered_handlers_are_freed(figures: Figures) -> None:
    """After unregister_event_handler, a sync and an async handler (and their handles, once
    dropped) are garbage: nothing in the bus keeps them alive."""
    figures.describe(load="100 events to a sync and an async handler, then unregister")
    with EventBus(name="gc-unreg") as bus:
        sync, asyn = Sink(), AsyncSink()
        refs = [weakref.ref(sync), weakref.ref(asyn)]
        handles = [bus.register_event_handler(sync), bus.register_event_handler(asyn)]
        for _ in range(100):
            bus.log_event(_event())
        assert bus.flush(timeout=10)
        assert (sync.n, asyn.n) == (100, 100)
        assert all(bus.unregister_event_handler(h, timeout=10) for h in handles)
        del sync, asyn, handles
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        assert alive == []
        bus.log_event(_event())  # still usable, now without handlers
        assert bus.flush(timeout=10)
    figures.measure(handlers_alive_after_unregister=len(alive))


def test_closed_bus_is_freed_and_leaves_no_thread(figures: Figures) -> None:
    """A closed bus with sync and async handlers leaves no thread of its own running once
    close() returns True, and the bus and its handlers are garbage once dropped."""
    figures.describe(load="3 buses x (2 sync + 1 async handlers) x 1000 events, then close()")
    before = set(threading.enumerate())
    refs: list[weakref.ref[object]] = []
    for k in range(3):
        bus = EventBus(name=f"gc-close-{k}")
        sinks: list[object] = [Sink(), Sink(), AsyncSink()]
        for sink in sinks:
            bus.register_event_handler(sink)  # type: ignore[arg-type]
        for _ in range(1000):
            bus.log_event(_event())
        assert bus.close(timeout=10)
        assert all(s.n == 1000 for s in sinks)  # type: ignore[attr-defined]
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        assert left == [], left
        refs += [weakref.ref(bus), *(weakref.ref(s) for s in sinks)]
        del bus, sinks, sink
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert alive == []
    figures.measure(buses=3, threads_left_after_close=0, objects_alive_after_close=len(alive))


CHILD = textwrap.dedent(
    """
    import asyncio, gc, logging
    from datetime import datetime, timezone
    import monitor_bus
    from monitor_bus import Event, EventBus, Stat, Aggregation
    from datetime import timedelta

    # Debug mode logs each callback over 0.1 s, which a busy machine makes of any: a measure
    # of the machine, not of the bus. Every other report and every warning stays.
    logging.getLogger("asyncio").addFilter(lambda r: r.msg != "Executing %s took %.3f seconds")

    async def ahandler(event):
        await asyncio.sleep(0)

    for k in range(6):
        bus = EventBus(name=f"rw{k}")
        h = bus.register_event_handler(lambda e: None)
        bus.register_event_handler(ahandler)
        stat = Stat("s", [Aggregation.SUM], timedelta(milliseconds=5), bus=bus)
        for i in range(500):
            bus.log_event(Event("x", datetime.now(timezone.utc), {"i": i}))
            stat.add(i)
        bus.unregister_event_handler(h)
        assert bus.close(timeout=10)
        del bus, stat
        gc.collect()
    # The default bus is left open on purpose: exit closes it.
    monitor_bus.register_event_handler(lambda e: None)
    monitor_bus.log_event(Event("x", datetime.now(timezone.utc), {"i": 0}))
    """
)


def test_no_resource_warning_in_dev_mode(figures: Figures) -> None:
    """A child interpreter in development mode with ResourceWarning as an error creates,
    uses, closes and drops buses (and leaves the default bus to exit) without a warning
    (asyncio's report of slow callbacks, a measure of the machine's load, left out)."""
    figures.describe(
        load="6 buses with sync, async handlers and a Stat, then the default bus left open",
        faults="python -X dev -W error (asyncio debug, ResourceWarning as error)",
    )
    # No -X tracemalloc: it adds where an object was allocated to a warning's text, not the
    # warning, and made the child ten times slower (asyncio's debug mode then reported its own
    # slow callbacks on a busy machine).
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    figures.measure(returncode=proc.returncode, stderr_lines=0)
