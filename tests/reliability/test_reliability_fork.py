"""Fork torture, multiprocessing start methods, and a PyTorch DataLoader with workers."""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
import select
import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat

from ..conftest import require
from . import workers
from .conftest import Figures

FORKS = 200
CHILD_DEADLINE = 20.0


def _reap(pid: int, deadline: float) -> tuple[int | None, float]:
    """Wait for a child up to ``deadline`` seconds; kill it and return None if it hangs."""
    t0 = time.monotonic()
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], deadline)
    finally:
        os.close(fd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None, time.monotonic() - t0
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), time.monotonic() - t0


@pytest.mark.stress
def test_fork_torture(figures: Figures) -> None:
    """While a thread logs and adds to a Stat flat out, 200 forks each give a child that logs,
    adds, flushes and exits 0 within the deadline; in the parent every event and every Stat add
    is delivered, and each child's event once, from that child."""
    figures.describe(
        load=f"{FORKS} os.fork() calls while a thread logs + Stat.add (10 ms windows) in a tight "
        "loop; overflow policy block",
        faults="fork at arbitrary points of log_event / Stat.add / dispatch (locks held)",
    )
    # "block": the producer waits instead of dropping, so every count below is exact.
    bus = EventBus(overflow="block", name="fork")
    child_events: list[Event] = []
    counted = [0]
    window_adds = [0]  # sum of the COUNTs of the Stat windows delivered
    target = [math.inf]  # set once the hammer has stopped
    all_windows = threading.Event()

    def handler(event: Event) -> None:  # lock-free until the end: it is forked mid-call
        counted[0] += 1
        if event.name == "child":
            child_events.append(event)
        elif event.name == STAT_EVENT and event.origin is None:
            window_adds[0] += event.data["hot.count"]  # type: ignore[operator]
            if window_adds[0] >= target[0]:
                all_windows.set()

    bus.register_event_handler(handler, name="counter")
    stat = Stat("hot", [Aggregation.SUM, Aggregation.COUNT], timedelta(milliseconds=10), bus=bus)
    stop = threading.Event()
    logged = [0]

    def hammer() -> None:
        event = Event("hot", datetime.now(timezone.utc), {"x": 1.0})
        while not stop.is_set():
            bus.log_event(event)
            stat.add(1.0)
            logged[0] += 1

    thread = threading.Thread(target=hammer, name="hammer")
    thread.start()
    codes: list[int | None] = []
    durations: list[float] = []
    pids: list[int] = []
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:  # the child: never return into pytest
                code = 4
                try:
                    before = len(child_events)  # the parent's, copied by the fork
                    bus.log_event(Event("child", datetime.now(timezone.utc), {"pid": os.getpid()}))
                    stat.add(2.0)
                    if not bus.flush(timeout=CHILD_DEADLINE / 2):
                        code = 2
                    elif len(child_events) != before or bus.stats()["dropped"]:
                        code = 3  # the child ran the parent's handler, or dropped its event
                    else:
                        code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
            code, took = _reap(pid, CHILD_DEADLINE)
            codes.append(code)
            durations.append(took)
    finally:
        stop.set()
        thread.join()
    # The dispatcher's timer logs the last window: wait until every add is in a delivered one.
    target[0] = logged[0]
    if window_adds[0] >= target[0]:
        all_windows.set()
    assert all_windows.wait(timeout=10), (window_adds[0], logged[0], bus.stats())
    assert bus.flush(timeout=30)
    (h,) = bus.stats()["handlers"]
    assert codes == [0] * FORKS
    # Each child's event reached the parent once, marked with that child.
    assert sorted((e.data["pid"], e.origin.pid) for e in child_events if e.origin) == sorted(
        (pid, pid) for pid in pids
    )
    assert len(child_events) == FORKS
    assert window_adds[0] == logged[0]  # no add lost or counted twice across 200 forks
    assert h["delivered"] == counted[0] == h["logged"]
    assert h["dropped"] == 0
    assert h["pending"] == 0
    assert bus.close(timeout=30)
    figures.measure(
        forks=FORKS,
        children_ok=codes.count(0),
        child_max_s=round(max(durations), 3),
        child_mean_s=round(sum(durations) / len(durations), 3),
        parent_logged_by_hammer=logged[0],
        parent_delivered=h["delivered"],
        parent_dropped=h["dropped"],
        parent_stat_adds_in_windows=window_adds[0],
    )


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_worker_that_returns_without_flush(
    method: str, tmp_path: Path, figures: Figures
) -> None:
    """A multiprocessing worker that logs, adds to a Stat and returns without flushing still
    delivers every event and its open Stat window (its process ends in os._exit)."""
    n = 5000
    figures.describe(
        load=f"{n} events + {n} Stat.add in a multiprocessing worker ({method})",
        faults="worker returns without flush; the process ends with os._exit (no atexit)",
    )
    ctx = multiprocessing.get_context(method)
    proc = ctx.Process(target=workers.log_and_return, args=(str(tmp_path), n))
    proc.start()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{method} worker did not exit within 60 s")
    assert proc.exitcode == 0
    files = workers.read_lines(tmp_path)
    assert list(files) == [proc.pid]
    lines = files[proc.pid]
    assert lines == [f"mp {i}" for i in range(n)] + [f"stat mp.count={n}"]
    figures.measure(logged=n + 1, delivered=len(lines), lost=n + 1 - len(lines))


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.stress)])
def test_torch_dataloader_workers_deliver_everything(
    context: str, tmp_path: Path, figures: Figures
) -> None:
    """A torch DataLoader with num_workers=2 whose dataset logs from the workers delivers
    every item's event exactly once, without hanging: with fork to the parent's handler (each
    event marked with its worker), with spawn to the handler each worker registers."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch.utils.data

    import monitor_bus

    n = 256
    figures.describe(
        load=f"torch DataLoader, {n} items, num_workers=2, batch_size=8, {context} workers",
        faults="workers are shut down by the DataLoader (no flush in user code)",
    )
    init = None
    if context == "fork":
        monitor_bus.register_event_handler(workers.FileSink(str(tmp_path)), name="file")
    else:
        init = workers.RegisterSink(str(tmp_path))
    loader = torch.utils.data.DataLoader(
        workers.LoggingDataset(n),
        batch_size=8,
        num_workers=2,
        multiprocessing_context=context,
        worker_init_fn=init,
        timeout=60,
    )
    origins = []
    if context == "fork":
        monitor_bus.register_event_handler(lambda e: origins.append(e.origin), name="origins")
    items = [int(i) for batch in loader for i in batch]
    del loader  # shuts the workers down
    assert items == list(range(n))
    if context == "fork":
        assert monitor_bus.flush(10)
    files = workers.read_lines(tmp_path)
    if context == "fork":
        assert list(files) == [os.getpid()]  # the workers ran no handler: the parent did
        assert {origin.worker for origin in origins} == {0, 1}
        assert len({origin.pid for origin in origins}) == 2
    else:
        assert len(files) == 2
        assert os.getpid() not in files
    seen = sorted(int(line.split()[1]) for lines in files.values() for line in lines)
    assert seen == list(range(n))
    figures.measure(logged=n, delivered=len(seen), worker_processes=len(files))
