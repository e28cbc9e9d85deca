"""Fork, interpreter exit and multiprocessing children, each in a real child process."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import monitor_bus
from monitor_bus import Aggregation, Event, EventBus, Stat

from .conftest import Recorder, StepClock

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)


def run_child(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_exit_delivers_everything_and_open_windows(tmp_path: Path) -> None:
    """At normal exit, queued events and open Stat windows reach the handlers without a flush."""
    out = tmp_path / "out.txt"
    result = run_child(
        f"""
        from datetime import datetime, timedelta
        import monitor_bus as monitor
        sink = open({str(out)!r}, "w")
        def write(event):
            sink.write(f"{{event.name}} {{sorted(event.data.items())}}\\n")
            sink.flush()
        monitor.register_event_handler(write)
        stat = monitor.Stat("s", [monitor.Aggregation.SUM], timedelta(hours=1))
        stat.add(2)
        stat.add(3)
        for i in range(5000):
            monitor.log_event(monitor.Event("e", datetime.now(), {{"i": i}}))
        """
    )
    assert result.returncode == 0, result.stderr
    lines = out.read_text().splitlines()
    assert lines[:5000] == [f"e [('i', {i})]" for i in range(5000)]
    assert lines[5000:] == ["torch.monitor.Stat [('s.sum', 5.0)]"]


def test_exit_is_bounded_by_exit_timeout_with_a_hung_handler(tmp_path: Path) -> None:
    """A handler that never returns cannot hang the exit; the other handler still gets everything."""
    out = tmp_path / "out.txt"
    result = run_child(
        f"""
        import threading
        from datetime import datetime
        import monitor_bus as monitor
        bus = monitor.EventBus(exit_timeout=0.5)
        sink = open({str(out)!r}, "w")
        entered = threading.Event()
        bus.register_event_handler(
            lambda e: (entered.set(), threading.Event().wait()), name="hung"
        )
        bus.register_event_handler(lambda e: (sink.write("x\\n"), sink.flush()), name="good")
        for i in range(100):
            bus.log_event(monitor.Event("e", datetime.now(), {{}}))
        assert entered.wait(10)
        """,
        timeout=20,  # a hang fails here; how long the exit took is no assertion
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text().count("x") == 100
    assert (
        "EventBus 'bus': 1 handler(s) still busy after 0.5 s, cut off: 'hung' "
        "(99 undelivered, 1 in its current call)" in result.stderr
    )


def test_every_bus_thread_is_a_daemon(bus: EventBus, recorder: Recorder) -> None:
    """Dispatcher and handler threads are daemons, so a stuck handler cannot hold the interpreter."""

    async def ahandler(e: Event) -> None:
        pass

    bus.register_event_handler(recorder)
    bus.register_event_handler(ahandler)
    threads = [t for t in threading.enumerate() if t.name.startswith("monitor_bus-")]
    assert len(threads) == 2
    assert all(t.daemon for t in threads)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_gets_a_working_bus(tmp_path: Path, recorder: Recorder) -> None:
    """With children="own", a forked child's bus restarts on the first event, with the handlers kept and an empty queue."""
    out = tmp_path / "child.txt"
    bus = EventBus(children="own")
    release = threading.Event()
    # Keep the parent's dispatcher busy (and its handler holding events) across the fork.
    bus.register_event_handler(lambda e: release.wait(5), name="busy")
    bus.register_event_handler(recorder)
    for i in range(100):
        bus.log_event(Event("parent", TS, {"i": i}))
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            sink = open(out, "w")  # noqa: SIM115 - closed after the flush below
            bus.register_event_handler(lambda e: sink.write(e.name + "\n"), name="child-sink")
            release.set()
            for _ in range(10):
                bus.log_event(Event("child", TS, {}))
            if bus.flush(10):
                sink.close()
                stats = bus.stats()
                code = 0 if stats["logged"] == 10 and len(stats["handlers"]) == 3 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    release.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_text().splitlines() == ["child"] * 10
    assert bus.flush(10)
    assert [e.name for e in recorder.events] == ["parent"] * 100
    assert bus.close(10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_relog_the_parents_open_window(
    bus: EventBus, recorder: Recorder, clock: StepClock
) -> None:
    """The parent's open Stat window is the parent's: the child starts the window empty. (The
    Stat clock stands still: the fork and the wait for the child do not end the window.)"""
    bus.register_event_handler(recorder)
    stat = Stat("s", [Aggregation.COUNT], timedelta(hours=1), bus=bus)
    stat.add(1)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if stat.count == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert stat.count == 1


def _worker(path: str) -> None:
    sink = open(path, "w")  # noqa: SIM115 - closed by the handler's process ending
    monitor_bus.register_event_handler(lambda e: (sink.write(e.name + "\n"), sink.flush()))
    stat = Stat("w", [Aggregation.COUNT], timedelta(hours=1))
    stat.add(1)
    for _ in range(500):
        monitor_bus.log_event(Event("work", TS, {}))
    # No flush: the process ends in os._exit; multiprocessing's finalizers must deliver.


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_child_delivers_without_flush(method: str, tmp_path: Path) -> None:
    """A multiprocessing worker that logs and returns without flushing still delivers everything."""
    path = tmp_path / f"{method}.txt"
    ctx = multiprocessing.get_context(method)
    proc = ctx.Process(target=_worker, args=(str(path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert path.read_text().splitlines() == ["work"] * 500 + ["torch.monitor.Stat"]


def test_what_is_logged_after_the_last_handler_left_is_named_at_exit() -> None:
    """A program that unregisters its only handler and goes on logging is told at exit, once,
    how many events (a Stat window included) went nowhere."""
    result = run_child(
        """
        from datetime import timedelta
        import monitor_bus as monitor
        handle = monitor.register_event_handler(lambda event: None)
        steps = monitor.Stat("steps", [monitor.Aggregation.COUNT], timedelta(hours=1))
        assert monitor.unregister_event_handler(handle, timeout=10)
        steps.add(1.0)  # its window is logged at exit, with no handler to take it
        monitor.log("after", i=1)
        monitor.log("after", i=2)
        assert monitor.get_default_bus().stats()["unhandled"] == 2
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        "EventBus 'default': 3 events (Stat windows included) were logged while it had no "
        "handler and went nowhere: unregister the last handler only once the run is over\n"
    )
