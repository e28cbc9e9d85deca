"""Stats across fork: a child's windows close on its own timer and at its exit, and no lock a
parent thread held at the fork hangs the child. Each case forks a real child."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _stat

from .conftest import require

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

LONG = timedelta(seconds=600)  # no timer closes it within a test
SHORT = timedelta(milliseconds=100)
SAMPLES = 1000


class Windows:
    """A handler that sums the ``adds.count`` of the Stat windows it gets, per process."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.cv = threading.Condition()

    def __call__(self, event: Event) -> None:
        if event.name != STAT_EVENT:
            return
        with self.cv:
            pid = os.getpid() if event.origin is None else event.origin.pid
            self.counts[pid] += int(event.data["adds.count"])
            self.cv.notify_all()

    def wait(self, total: int = SAMPLES, timeout: float = 30) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: sum(self.counts.values()) >= total, timeout)


def _add_then_wait(stat: Stat, release: threading.Event) -> None:
    """A multiprocessing child: the samples, then no add until the parent has the window."""
    for _ in range(SAMPLES):
        stat.add(1.0)
    if not release.wait(60):
        raise SystemExit(4)


def _add(stat: Stat) -> None:
    for _ in range(SAMPLES):
        stat.add(1.0)


def _fork(child: Callable[[int], object]) -> tuple[int, int, int]:
    """``os.fork`` a child that runs ``child(said)`` (``said``: a pipe to the parent), then
    waits, doing nothing, until the parent closes ``go``; it ends with ``os._exit``. Returns
    the pid, the read end of ``said`` and the write end of ``go``."""
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(said_r)
            os.close(go_w)
            child(said_w)
            os.read(go_r, 1)  # EOF: the parent is done with us
            code = 0
        finally:
            os._exit(code)
    os.close(said_w)
    os.close(go_r)
    return pid, said_r, go_w


def _read(fd: int, timeout: float = 60) -> bytes:
    return os.read(fd, 1000) if select.select([fd], [], [], timeout)[0] else b"(no answer)"


def _end(pid: int, said: int, go: int) -> int:
    """Let the child end; its exit code."""
    os.close(go)
    _, status = os.waitpid(pid, 0)
    os.close(said)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def windows() -> Iterator[tuple[EventBus, Windows]]:
    handler = Windows()
    bus = EventBus(name="inherited")
    bus.register_event_handler(handler)
    yield bus, handler
    assert bus.close(10)


def test_an_inherited_stat_closes_its_window_on_a_forked_childs_timer(
    windows: tuple[EventBus, Windows],
) -> None:
    """A Stat made before ``os.fork()``: the child's timer closes the window of its 1000
    samples with no later add, while the child runs; the parent gets them all."""
    bus, handler = windows
    stat = Stat("adds", [Aggregation.COUNT], SHORT, bus=bus)
    pid, said, go = _fork(lambda said: (_add(stat), os.write(said, b"added")))
    try:
        answer = _read(said)
        delivered = handler.wait()  # the child waits meanwhile: only its timer can send it
    finally:
        code = _end(pid, said, go)
    assert (answer, delivered, code) == (b"added", True, 0)
    assert bus.flush(10)
    assert handler.counts == Counter({pid: SAMPLES})


def test_an_inherited_stat_closes_its_window_on_a_multiprocessing_childs_timer(
    windows: tuple[EventBus, Windows],
) -> None:
    """The same with a multiprocessing child (fork): the window arrives while the child runs."""
    bus, handler = windows
    stat = Stat("adds", [Aggregation.COUNT], SHORT, bus=bus)
    ctx = multiprocessing.get_context("fork")
    release = ctx.Event()
    proc = ctx.Process(target=_add_then_wait, args=(stat, release))
    proc.start()
    try:
        delivered = handler.wait()
        alive = proc.is_alive()
    finally:
        release.set()
        proc.join(60)
    assert (delivered, alive, proc.exitcode) == (True, True, 0)
    assert bus.flush(10)
    assert handler.counts == Counter({proc.pid: SAMPLES})


def test_an_inherited_stat_closes_its_window_on_the_timer_of_a_child_with_own_handlers() -> None:
    """With ``children="own"`` the child runs its copy of the handler, which gets the window
    on the child's timer; the parent's gets nothing of it."""
    handler = Windows()
    bus = EventBus(name="own", children="own")
    try:
        bus.register_event_handler(handler)
        stat = Stat("adds", [Aggregation.COUNT], SHORT, bus=bus)

        def child(said: int) -> None:
            _add(stat)
            got = handler.wait()  # the child's copy of the handler, on its own timer
            os.write(said, f"{got} {handler.counts[os.getpid()]}".encode())

        pid, said, go = _fork(child)
        try:
            answer = _read(said)
        finally:
            code = _end(pid, said, go)
        assert (answer, code) == (f"True {SAMPLES}".encode(), 0)
        assert bus.flush(10)
        assert handler.counts == Counter()
    finally:
        assert bus.close(10)


def _add_and_return(stat: Stat) -> None:
    for _ in range(SAMPLES):
        stat.add(1.0)


def test_an_inherited_stats_open_window_is_logged_at_a_multiprocessing_childs_exit(
    windows: tuple[EventBus, Windows],
) -> None:
    """A multiprocessing child (fork) that adds to an inherited Stat and returns: its open
    window reaches the parent as it exits, every sample counted."""
    bus, handler = windows
    stat = Stat("adds", [Aggregation.COUNT], LONG, bus=bus)
    proc = multiprocessing.get_context("fork").Process(target=_add_and_return, args=(stat,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert bus.flush(10)
    assert handler.counts == Counter({proc.pid: SAMPLES})


def test_an_inherited_stats_open_window_is_logged_at_a_forked_childs_exit(tmp_path: Path) -> None:
    """A child of ``os.fork()`` that adds to an inherited Stat and ends normally (atexit): its
    open window reaches the parent, every sample counted."""
    out = tmp_path / "windows.txt"
    code = f"""
        import os
        from datetime import timedelta
        import monitor_bus as monitor
        sink = open({str(out)!r}, "w")
        def write(event):
            sink.write(f"{{event.name}} {{event.data}} {{event.origin and event.origin.pid}}\\n")
            sink.flush()
        monitor.register_event_handler(write)
        stat = monitor.Stat("adds", [monitor.Aggregation.COUNT], timedelta(hours=1))
        pid = os.fork()
        if pid == 0:
            for _ in range({SAMPLES}):
                stat.add(1.0)
            raise SystemExit(0)  # a normal end: atexit runs
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert monitor.flush(10)
        print(pid)
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout)
    assert out.read_text().splitlines() == [f"{STAT_EVENT} {{'adds.count': {SAMPLES}}} {pid}"]


def test_a_forked_child_never_waits_for_a_module_lock_a_parent_thread_held(
    windows: tuple[EventBus, Windows], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent thread reads a closed window's device values (holding the module lock that
    guards them) at the fork: the child's Stat.add that closes a window of tensor samples (read
    as it is sent to the parent) and its get() finish; the parent gets the window."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch

    now = [1000.0]
    monkeypatch.setattr(_stat, "_clock", lambda: now[0])
    bus, handler = windows
    # A window of a device value, closed in the parent and read on a thread that blocks
    # inside the read, so it holds the lock across the fork.
    quiet = EventBus(name="quiet", children="own")  # no handler: the window goes nowhere
    held = Stat("held", [Aggregation.SUM], LONG, bus=quiet)
    held.add(torch.tensor(1.0))
    now[0] += 600
    assert held.count == 0  # the window closed, its device value unread
    window = held._last_window
    assert window is not None
    assert len(window.pending) == 1
    entered, release = threading.Event(), threading.Event()

    def blocking_read(copy: object) -> float:
        entered.set()
        release.wait(60)
        return 1.0

    window.pending[0]._read = blocking_read
    reader = threading.Thread(target=window.resolve)
    reader.start()
    assert entered.wait(10)

    stat = Stat("adds", [Aggregation.COUNT, Aggregation.SUM], LONG, bus=bus)

    def child(said: int) -> None:
        stat.add(torch.tensor(2.0))
        now[0] += 600
        stat.add(3.0)  # closes the tensor's window: read as it is sent to the parent
        os.write(said, repr(stat.get()).encode())

    pid, said, go = _fork(child)
    try:
        answer = _read(said, timeout=30)
    finally:
        if answer == b"(no answer)":
            os.kill(pid, signal.SIGKILL)
        release.set()
        reader.join(10)
        code = _end(pid, said, go)
        assert quiet.close(10)
    expected = {Aggregation.COUNT: 1, Aggregation.SUM: 2.0}
    assert (answer, code) == (repr(expected).encode(), 0)
    assert handler.wait(1)
    assert handler.counts == Counter({pid: 1})


def test_every_module_lock_of_the_package_is_new_in_a_forked_child() -> None:
    """The package's module-level locks (Stat windows' device values, torch forwarding), held
    in the parent at the fork, are free in the child."""
    import monitor_bus.integrations.torch as forwarding
    from monitor_bus._lifecycle import process

    names = sorted(process.module_locks)
    assert ("monitor_bus._window", "_RESOLVING") in names
    assert (forwarding.__name__, "_lock") in names
    locks = [getattr(sys.modules[module], name) for module, name in names]
    for lock in locks:
        lock.acquire()
    try:
        pid, said, go = _fork(
            lambda said: os.write(
                said,
                repr(
                    [getattr(sys.modules[m], n).acquire(blocking=False) for m, n in names]
                ).encode(),
            )
        )
    finally:
        for lock in locks:
            lock.release()
    answer = _read(said)
    assert (answer, _end(pid, said, go)) == (repr([True] * len(names)).encode(), 0)
