"""Child processes report to the parent: multiprocessing, Pools, DataLoaders, fork and exit."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pytest

import monitor_bus
from monitor_bus import STAT_EVENT, Event, EventBus, EventOrigin

from . import child_workers
from .conftest import Recorder, require

METHODS = ["fork", "spawn", "forkserver"]
TS = datetime(2026, 1, 1, tzinfo=timezone.utc)


def window_count(events: list[Event], key: str = "adds.count") -> int:
    """The samples counted by the Stat windows among ``events``."""
    return sum(int(e.data[key]) for e in events if e.name == STAT_EVENT and key in e.data)


def by_name(events: list[Event], name: str) -> list[Event]:
    return [e for e in events if e.name == name]


@pytest.mark.parametrize("method", METHODS)
def test_a_process_reports_its_events_and_last_window_to_the_parent(
    method: str, recorder: Recorder
) -> None:
    """A multiprocessing child's events reach the parent's handler in order, marked with the
    child's pid, and the window of a child that only adds arrives when it ends normally."""
    monitor_bus.register_event_handler(recorder)
    ctx = multiprocessing.get_context(method)
    logger = ctx.Process(target=child_workers.log_events, args=("p", 100))
    adder = ctx.Process(target=child_workers.add_only, args=(1000,))
    for proc in (logger, adder):
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
    assert monitor_bus.flush(10)
    events = by_name(recorder.events, "child")
    assert [e.data["i"] for e in events] == list(range(100))
    assert {e.origin for e in events} == {EventOrigin(logger.pid, None)}  # type: ignore[arg-type]
    windows = by_name(recorder.events, STAT_EVENT)
    assert [(w.data, w.origin) for w in windows] == [
        ({"adds.count": 1000}, EventOrigin(adder.pid, None))  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_with_block_delivers_every_event_despite_terminate(
    method: str, recorder: Recorder
) -> None:
    """``with Pool() as pool: pool.starmap(...)`` terminates its workers on exit; every event
    they logged before returning a result still arrives, once, in each task's order."""
    monitor_bus.register_event_handler(recorder)
    tasks = [(f"t{k}", 50) for k in range(4)]
    with multiprocessing.get_context(method).Pool(2) as pool:
        pids = pool.starmap(child_workers.log_events, tasks)
    assert monitor_bus.flush(10)
    events = by_name(recorder.events, "child")
    assert len(events) == 200
    for (tag, n), pid in zip(tasks, pids, strict=True):
        mine = [e for e in events if e.data["tag"] == tag]
        assert [e.data["i"] for e in mine] == list(range(n))
        assert {e.origin.pid for e in mine if e.origin} == {pid}
        assert all(e.origin is not None for e in mine)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_workers_that_only_add_deliver_their_windows_when_they_end(
    method: str, recorder: Recorder
) -> None:
    """Pool workers that only call Stat.add send their open windows when the pool ends them
    normally (close and join)."""
    monitor_bus.register_event_handler(recorder)
    pool = multiprocessing.get_context(method).Pool(2)
    pids = pool.map(child_workers.add_only, [50] * 4)
    pool.close()
    pool.join()
    assert monitor_bus.flush(10)
    windows = by_name(recorder.events, STAT_EVENT)
    assert window_count(windows) == 200
    assert {w.origin.pid for w in windows if w.origin} == set(pids)


def test_a_terminated_child_loses_only_its_open_window(recorder: Recorder) -> None:
    """SIGTERM ends a child without its exit hooks: every event it logged arrives, its open
    Stat window (one add) does not."""
    monitor_bus.register_event_handler(recorder)
    ctx = multiprocessing.get_context("fork")
    ready, never = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=child_workers.log_then_wait, args=(100, ready, never))
    proc.start()
    assert ready.wait(60)
    proc.terminate()
    proc.join(60)
    assert proc.exitcode == -15
    assert monitor_bus.flush(10)
    assert [e.data["i"] for e in by_name(recorder.events, "child")] == list(range(100))
    assert by_name(recorder.events, STAT_EVENT) == []


def test_process_pool_executor(recorder: Recorder) -> None:
    """ProcessPoolExecutor workers report events and, at shutdown, their windows."""
    monitor_bus.register_event_handler(recorder)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        list(pool.map(child_workers.log_events, ["a", "b"], [30, 30]))
        list(pool.map(child_workers.add_only, [10, 10, 10]))
    assert monitor_bus.flush(10)
    assert Counter(e.data["tag"] for e in by_name(recorder.events, "child")) == {"a": 30, "b": 30}
    assert window_count(recorder.events) == 30


# Workers end the same way (the loader's shutdown) whether that is at each epoch's end or at
# `del loader`: spawned workers, each a fresh interpreter importing torch (seconds on a busy
# machine), are tested persistent only, for the spawn start (2 processes, not 4).
@pytest.mark.parametrize(
    ("context", "persistent"),
    [("fork", False), ("fork", True), ("spawn", True)],
    ids=["fork-workers", "fork-persistent", "spawn-persistent"],
)
def test_dataloader_workers_report_items_and_windows(
    context: str, persistent: bool, recorder: Recorder
) -> None:
    """DataLoader workers (fork, persistent or not; spawn, persistent) send the parent every
    item's event, marked with their worker id, and the windows of their Stat adds."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch.utils.data

    monitor_bus.register_event_handler(recorder)
    n, epochs = 64, 2
    loader = torch.utils.data.DataLoader(
        child_workers.ItemDataset(n),
        batch_size=8,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=persistent,
        timeout=60,
    )
    for _ in range(epochs):
        assert sorted(int(i) for batch in loader for i in batch) == list(range(n))
    del loader  # shuts the (persistent) workers down: they end normally
    assert monitor_bus.flush(10)
    items = by_name(recorder.events, "item")
    assert sorted(int(e.data["i"]) for e in items) == sorted(list(range(n)) * epochs)
    assert {e.origin.worker for e in items if e.origin} == {0, 1}
    assert window_count(recorder.events) == n * epochs
    assert os.getpid() not in {e.origin.pid for e in recorder.events if e.origin}


def test_dataloader_windows_reach_the_parents_tensorboard(tmp_path: Path) -> None:
    """With TensorBoard's sink registered, the workers run no copy of it (which hung each epoch
    on the child's writer): their windows reach the parent's event file."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch.utils.data
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from monitor_bus.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path)
    handler = monitor_bus.TensorboardEventHandler(writer)
    monitor_bus.register_event_handler(handler, name="tb")
    n = 64
    loader = torch.utils.data.DataLoader(
        child_workers.ItemDataset(n), batch_size=8, num_workers=2, timeout=60
    )
    assert len([b for b in loader]) == n // 8
    del loader
    assert monitor_bus.flush(10)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sum(s.value for s in acc.Scalars("adds.count")) == n


def test_a_child_with_handlers_of_its_own_gets_its_events_too(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A forked child that registers a handler gets its own events, and the parent gets them as
    well; the child never runs the parent's handler."""
    monitor_bus.register_event_handler(recorder)
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with open(out, "w") as sink:
                monitor_bus.register_event_handler(lambda e: sink.write(f"{e.data['i']}\n"))
                for i in range(5):
                    monitor_bus.log_event(Event("child", TS, {"i": i}))
                ok = monitor_bus.flush(10)
            code = 0 if ok and recorder.events == [] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_text().split() == ["0", "1", "2", "3", "4"]
    assert monitor_bus.flush(10)
    assert [(e.data["i"], e.origin) for e in recorder.events] == [
        (i, EventOrigin(pid, None)) for i in range(5)
    ]


def test_children_own_keeps_the_handlers_in_the_child(tmp_path: Path, recorder: Recorder) -> None:
    """With children="own" a forked child runs its copies of the handlers and the parent gets
    none of its events (torch.monitor's behaviour)."""
    bus = EventBus(children="own", name="own")
    out = tmp_path / "child.txt"
    bus.register_event_handler(recorder)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            bus.log_event(Event("child", TS, {"i": 0}))
            code = 0 if bus.flush(10) and len(recorder.events) == 1 else 2
            out.write_text(str(bus.stats()["to_parent"]))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_text() == "0"
    assert bus.flush(10)
    assert recorder.events == []
    assert bus.close(10)


def test_origin_is_written_to_jsonl_and_read_back(tmp_path: Path) -> None:
    """The JSONL sink writes a child's origin and read_jsonl restores it; local events have
    none and their lines are unchanged."""
    path = tmp_path / "run.jsonl"
    handler = monitor_bus.JsonlEventHandler(path)
    monitor_bus.register_event_handler(handler, name="jsonl")
    monitor_bus.log_event(Event("parent", TS, {"i": 0}))
    proc = multiprocessing.get_context("fork").Process(
        target=child_workers.log_events, args=("j", 2)
    )
    proc.start()
    proc.join(60)
    assert monitor_bus.flush(10)
    handler.close()
    lines = path.read_text().splitlines()
    assert lines[0] == '{"name":"parent","timestamp":"2026-01-01T00:00:00+00:00","data":{"i":0}}'
    assert lines[1] == (
        '{"name":"child","timestamp":"2026-01-01T00:00:00+00:00","data":{"tag":"j","i":0},'
        f'"origin":{{"pid":{proc.pid},"worker":null}}}}'
    )
    events = monitor_bus.read_jsonl(path)
    assert [e.origin for e in events] == [None] + [EventOrigin(proc.pid, None)] * 2  # type: ignore[arg-type]


def test_forked_children_never_duplicate_or_deadlock_on_a_busy_jsonl_sink(
    tmp_path: Path,
) -> None:
    """Forks taken while the parent logs flat out to a JSONL sink whose copies the children run
    (children="own") never write the parent's lines again and never hang on its lock."""
    path = tmp_path / "run.jsonl"
    bus = EventBus(overflow="block", children="own", name="jsonl-fork")  # exact counts
    handler = monitor_bus.JsonlEventHandler(path)
    bus.register_event_handler(handler, name="jsonl")
    stop = threading.Event()
    logged = [0]

    def hammer() -> None:
        while not stop.is_set():
            bus.log_event(Event("hot", TS, {"seq": logged[0]}))
            logged[0] += 1

    thread = threading.Thread(target=hammer)
    thread.start()
    codes = []
    try:
        for _ in range(30):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    for i in range(3):
                        bus.log_event(Event("child", TS, {"seq": i}))
                    code = 0 if bus.flush(10) else 2
                finally:
                    os._exit(code)
            codes.append(_reap(pid))
    finally:
        stop.set()
        thread.join()
    assert bus.close(30)
    handler.close()
    assert codes == [0] * 30
    events = monitor_bus.read_jsonl(path)
    hot = Counter(int(e.data["seq"]) for e in events if e.name == "hot")
    assert sorted(hot) == list(range(logged[0]))  # every parent event, and each once
    assert set(hot.values()) == {1}
    assert Counter(int(e.data["seq"]) for e in events if e.name == "child") == {0: 30, 1: 30, 2: 30}


def _reap(pid: int, deadline: float = 30.0) -> int | None:
    """The child's exit code, or None (after killing it) if it is still running at ``deadline``."""
    import select
    import signal

    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], deadline)
    finally:
        os.close(fd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if ready else None


def _run_child(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
        check=False,
    )


def test_a_child_whose_parent_is_not_listening_never_blocks_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A child pointed at a socket nobody listens on logs without waiting, counts every event
    it could not send, and says so once on its log."""
    monitor_bus.register_event_handler(print)  # this process listens...
    # ... but the child is told another address (the environment is read as it starts).
    monkeypatch.setenv(
        "MONITOR_BUS_PARENT", f"{os.getpid()}:{os.getpid()}:{tmp_path}/nobody-listens"
    )
    out = tmp_path / "stats.txt"
    proc = multiprocessing.get_context("spawn").Process(
        target=child_workers.log_and_report, args=(5000, str(out))
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert out.read_text().split() == ["5000", "0"]  # dropped, sent
    err = capfd.readouterr().err
    assert err.count("not sent to the parent process") == 1
    assert "the parent is not listening" in err


def test_a_child_whose_parent_died_never_blocks_and_counts() -> None:
    """A forked child whose parent has exited logs without waiting and counts what it could not
    send (the parent's socket is gone). The parent is a program of its own (subprocess), which
    listens for its children rather than reporting to this test's process."""
    result = _run_child(
        """
        import os
        import select
        import monitor_bus
        from tests import child_workers
        monitor_bus.register_event_handler(print)  # the parent listens for its children
        parent = os.getpid()
        watch = os.pidfd_open(parent)  # readable once the parent's exit is complete
        if os.fork() == 0:
            select.select([watch], [], [], 60)  # (a pipe's end can close before its sockets)
            child_workers.log_and_report(5000, "/dev/stdout")
        else:
            os._exit(0)  # without its exit hooks: as if killed
        """
    )
    # run() waits for the child too: it holds the captured stdout until it exits.
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["5000", "0"]
    assert "not sent to the parent process" in result.stderr


@pytest.mark.stress
def test_a_flood_from_children_is_delivered_or_counted(recorder: Recorder) -> None:
    """Children logging faster than a small parent queue takes: every event is delivered or
    counted as dropped, in the parent's stats."""
    monitor_bus.configure_default_bus(capacity=100)  # a small queue: the parent drops
    bus = monitor_bus.get_default_bus()
    monitor_bus.register_event_handler(recorder)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=child_workers.log_events, args=(f"f{k}", 20_000)) for k in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    assert monitor_bus.flush(30)
    (h,) = bus.stats()["handlers"]
    assert h["delivered"] + h["dropped"] == 40_000
    assert h["delivered"] == len(recorder.events)
    assert bus.stats()["logged"] == 40_000


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_childs_window_closes_on_the_timer(method: str, recorder: Recorder) -> None:
    """A child's Stat window closes on its dispatcher's timer, not only at its exit: a worker
    idle between epochs still reports on time."""
    monitor_bus.register_event_handler(recorder)
    ctx = multiprocessing.get_context(method)
    release = ctx.Event()
    proc = ctx.Process(target=child_workers.add_and_wait, args=(release,))
    proc.start()
    try:
        # The child still runs: only its timer can have closed the window.
        assert recorder.wait_for(1, timeout=30)
        assert proc.is_alive()
    finally:
        release.set()
        proc.join(60)
    assert [(e.name, e.data, e.origin) for e in recorder.events] == [
        (STAT_EVENT, {"tick.count": 1}, EventOrigin(proc.pid, None))  # type: ignore[arg-type]
    ]


def test_a_message_that_does_not_decode_closes_only_that_connection(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection sending bytes that are not a message is logged and closed; the relay goes
    on serving the other children."""
    import socket
    import struct

    monitor_bus.register_event_handler(recorder)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
        bad.connect(listener.path)
        bad.sendall(struct.pack("<I", 5) + b"\xffjunk")
        assert listener.sweep(10)
        assert bad.recv(1) == b""  # closed by the relay
    assert "the relay refused process" in caplog.text
    proc = multiprocessing.get_context("fork").Process(
        target=child_workers.log_events, args=("after", 3)
    )
    proc.start()
    proc.join(60)
    assert monitor_bus.flush(10)
    assert [e.data["i"] for e in by_name(recorder.events, "child")] == [0, 1, 2]


def test_a_forked_child_cannot_write_to_an_inherited_summary_writer(tmp_path: Path) -> None:
    """A SummaryWriter copied into a forked child refuses writes with a clear error and its
    flush and close return at once (before, they waited for a writer thread the child lacks);
    the parent's file holds only the parent's scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from monitor_bus.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path, max_queue=1)
    writer.add_scalar("parent", 1.0, 0)
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                writer.add_scalar("child", 2.0, 0)
                message = "no error"
            except RuntimeError as exc:
                message = str(exc)
            writer.flush()
            writer.close()
            out.write_text(message)
            code = 0
        finally:
            os._exit(code)
    assert _reap(pid) == 0
    assert "cannot write there: open a SummaryWriter in the child" in out.read_text()
    writer.add_scalar("parent", 3.0, 1)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["parent"]
    assert [s.value for s in acc.Scalars("parent")] == [1.0, 3.0]


def test_timestamps_arrive_exactly_as_logged(recorder: Recorder) -> None:
    """A child's timestamps arrive equal and of the same kind: naive or aware, the same tzinfo,
    the same fold."""
    monitor_bus.register_event_handler(recorder)
    proc = multiprocessing.get_context("spawn").Process(target=child_workers.log_stamps)
    proc.start()
    proc.join(60)
    assert monitor_bus.flush(10)
    got = [e.timestamp for e in recorder.events]
    want = child_workers.stamps()
    assert got == want
    assert [(t.tzinfo, t.fold, t.isoformat()) for t in got] == [
        (t.tzinfo, t.fold, t.isoformat()) for t in want
    ]


def test_a_childs_events_meet_the_parents_overflow_policy(recorder: Recorder) -> None:
    """Events from a child enter the parent's queue under its capacity and policy: with the
    dispatcher held and room for 10, 10 of the child's 50 are queued, 40 dropped and counted."""
    from .conftest import LoopGate

    bus = EventBus(capacity=10, name="small")
    gate = LoopGate()
    bus.register_event_handler(gate)
    bus.register_event_handler(recorder)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    gate.hold(bus)
    try:
        proc = multiprocessing.get_context("fork").Process(target=_log_on, args=(bus, 50))
        proc.start()
        proc.join(60)
        assert listener.sweep(10)  # the relay has queued what it could
    finally:
        gate.release.set()
    assert bus.flush(10)
    assert [e.data["i"] for e in by_name(recorder.events, "child")] == list(range(10))
    assert bus.stats()["dropped"] == 40
    assert bus.close(10)


def _log_on(bus: EventBus, n: int) -> None:
    for i in range(n):
        bus.log_event(Event("child", TS, {"i": i}))


def test_a_bus_the_parent_does_not_have_stops_forwarding(
    tmp_path: Path, recorder: Recorder
) -> None:
    """The parent answers a child's announcement of a bus it has no bus for; once the child
    has read that answer it sends nothing more for that bus (a bus of the child's own costs it
    nothing), and counts nothing as dropped."""
    monitor_bus.register_event_handler(recorder)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    ctx = multiprocessing.get_context("spawn")
    announced, go = ctx.Event(), ctx.Event()
    out = tmp_path / "out.txt"
    proc = ctx.Process(target=child_workers.log_on_a_bus_of_its_own, args=(announced, go, str(out)))
    proc.start()
    try:
        assert announced.wait(60)
        assert listener.sweep(10)  # the announcement is read and answered
    finally:
        go.set()
    proc.join(60)
    assert proc.exitcode == 0
    assert out.read_text().split() == ["1", "0", "True"]
    assert monitor_bus.flush(10)
    assert recorder.events == []


def test_a_childs_events_do_not_cut_the_parents_linger_short(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events relayed from a child into a queue far from full batch like local ones: they do
    not hurry the dispatcher out of its linger (a 30 s one here; flush() delivers them)."""
    bus = monitor_bus.get_default_bus()
    monitor_bus.register_event_handler(recorder)
    bus._linger = 30.0
    hurries = []
    monkeypatch.setattr(bus._dispatcher, "hurry", lambda: hurries.append(1))
    proc = multiprocessing.get_context("fork").Process(
        target=child_workers.log_events, args=("l", 10)
    )
    proc.start()
    proc.join(60)
    assert monitor_bus.flush(10)
    assert [e.data["i"] for e in by_name(recorder.events, "child")] == list(range(10))
    assert hurries == []


def _windows_in(path: Path) -> Counter[str]:
    """The samples the Stat windows in the JSONL file at ``path`` counted, per Stat."""
    counted: Counter[str] = Counter()
    for event in monitor_bus.read_jsonl(path):
        if event.name == STAT_EVENT:
            for key, value in event.data.items():
                counted[key.removesuffix(".count")] += int(value)
    return counted


# Spawned workers each import torch afresh (seconds on a busy machine): one per loader.
@pytest.mark.parametrize(("context", "workers"), [("fork", 2), ("spawn", 1)])
def test_dataloader_workers_alive_at_exit_send_their_open_windows(
    context: str, workers: int, tmp_path: Path
) -> None:
    """Persistent workers and the workers of a kept iterator, alive (idle) when the parent
    exits normally, are asked for their open windows before the parent's bus closes (and
    before multiprocessing terminates them, though it was imported after the bus's thread
    started): every sample they added reaches the parent's sink, and nothing is said lost."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    path = tmp_path / "run.jsonl"
    n = 16
    result = _run_child(
        f"""
        from tests import child_workers
        child_workers.workers_alive_at_exit({context!r}, {str(path)!r}, {n}, {workers})
        """
    )
    assert result.returncode == 0, result.stderr
    assert _windows_in(path) == {"persistent": 2 * n, "kept": n}
    assert "dropped" not in result.stderr, result.stderr


def test_closing_the_parents_bus_collects_the_workers_windows(tmp_path: Path) -> None:
    """A parent that closes its bus while its persistent workers live gets their open windows
    first; what the workers add afterwards is counted as dropped in each worker, which says
    that the parent closed its bus (not that it is gone)."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    path = tmp_path / "run.jsonl"
    n = 16
    result = _run_child(
        f"""
        from tests import child_workers
        child_workers.close_with_workers_alive({str(path)!r}, {n})
        """
    )
    assert result.returncode == 0, result.stderr
    assert _windows_in(path) == {"persistent": n}
    said = [line for line in result.stderr.splitlines() if "not sent to the parent" in line]
    assert len(said) == 2, result.stderr  # one per worker
    assert all("the parent process closed its bus" in line for line in said), result.stderr
    assert "is gone" not in result.stderr


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_stat_made_in_a_datasets_constructor_reports_from_the_workers(
    context: str, recorder: Recorder
) -> None:
    """A Dataset holding a Stat crosses to spawn and forkserver workers (the Stat's definition
    is pickled): each worker's copy logs through the worker's default bus, and the parent
    gets every sample added in ``__getitem__``, none of the parent's own."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch.utils.data

    monitor_bus.register_event_handler(recorder)
    dataset = child_workers.HoldsAStat(16)
    dataset.stat.add(1)  # the parent's own sample: it stays (and is logged) here
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=2, num_workers=2, multiprocessing_context=context, timeout=60
    )
    assert sorted(int(i) for batch in loader for i in batch) == list(range(16))
    del loader  # the workers end normally, sending their windows
    assert monitor_bus.get_default_bus().close(10)  # and logs the parent's open window
    windows = by_name(recorder.events, STAT_EVENT)
    from_workers = [(w.origin.worker, w.data) for w in windows if w.origin is not None]
    assert sorted(from_workers) == [(0, {"held.count": 8}), (1, {"held.count": 8})]
    assert [w.data for w in windows if w.origin is None] == [{"held.count": 1}]


def test_a_child_that_does_not_send_its_windows_in_time_is_named_and_counted(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A child stopped (SIGSTOP) while its Stat holds a sample cannot answer the parent's
    request for its windows: ``close()`` returns False within its timeout, a warning names
    the child, and the window it sends once resumed is counted as dropped in the parent."""
    import signal

    from monitor_bus._lifecycle import process

    monitor_bus.register_event_handler(recorder)
    bus = monitor_bus.get_default_bus()
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=child_workers.add_then_wait, args=(ready, release))
    proc.start()
    assert ready.wait(60)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # every thread of it has stopped
    assert os.WIFSTOPPED(status)
    try:
        with caplog.at_level("WARNING", logger="monitor_bus"):
            assert not bus.close(2)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        release.set()
        proc.join(60)
    assert proc.exitcode == 0
    assert process.listener is not None
    assert process.listener.sweep(10)  # what the child sent once resumed is read
    assert recorder.events == []
    assert bus.stats()["dropped"] == 1
    assert (
        "EventBus 'default': 1 child process(es) did not send their open Stat windows within "
        f"1.0 s before the bus closed: {proc.pid}"
    ) in caplog.text
