"""ProcessHandler against the real thing: a real child process, a real JSONL file."""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import monitor_bus
from monitor_bus import Event, EventOrigin, JsonlEventHandler, ProcessHandler

from . import child_workers, process_sinks
from .conftest import LogSeen

SPAWN = multiprocessing.get_context("spawn")
T0 = datetime(2026, 3, 29, 0, 30, tzinfo=timezone.utc)


def jsonl(path: Path, **kwargs: Any) -> ProcessHandler:
    return ProcessHandler(functools.partial(JsonlEventHandler, str(path)), **kwargs)


def event(i: int, name: str = "step") -> Event:
    return Event(name, T0 + timedelta(seconds=i), {"i": i})


@pytest.fixture
def closing() -> Any:
    """Closes every ProcessHandler a test made, so no child outlives it."""
    made: list[ProcessHandler] = []
    yield made.append
    for handler in made:
        handler.close(timeout=10)


def varied_events() -> list[Event]:
    ist = timezone(timedelta(hours=5, minutes=30))
    events = [
        Event("naive", datetime(2026, 3, 29, 1, 30, 15, 123456), {"x": 1.5, "ok": True}),
        Event("utc", T0, {"loss": math.nan, "hi": math.inf, "lo": -math.inf, "n": 10**30}),
        Event("ist", datetime(2026, 1, 1, 12, tzinfo=ist), {"text": "héllo ✓", "f": 1.0}),
        Event("surrogate", T0, {"file": "caf\udce9.txt", "neg": -0.0, "b": False}),
    ]
    from_child = Event("child", T0, {"i": 7})
    from_child._origin = EventOrigin(pid=4242, worker=3)
    events.append(from_child)
    events += [event(i) for i in range(3000)]
    return events


def test_jsonl_through_process_handler_is_byte_identical(tmp_path: Path, closing: Any) -> None:
    """A JSONL file written through ProcessHandler equals, byte for byte, one written directly."""
    direct = JsonlEventHandler(tmp_path / "direct.jsonl")
    remote = jsonl(tmp_path / "remote.jsonl")
    closing(remote)
    for e in varied_events():
        direct(e)
        remote(e)
    direct.flush()
    assert remote.flush() is True
    direct.close()
    expected = (tmp_path / "direct.jsonl").read_bytes()
    assert expected.count(b"\n") == 3005
    assert (tmp_path / "remote.jsonl").read_bytes() == expected


def test_bus_flush_returns_with_everything_written_and_counted(
    tmp_path: Path, closing: Any
) -> None:
    """Once bus.flush() returns, the child's sink has written every event, and stats() says so."""
    remote = jsonl(tmp_path / "remote.jsonl")
    closing(remote)
    with monitor_bus.EventBus(name="process") as bus:
        bus.register_event_handler(remote, name="jsonl")
        for i in range(5000):
            bus.log_event(event(i))
        assert bus.flush(timeout=60)
        assert len(monitor_bus.read_jsonl(tmp_path / "remote.jsonl")) == 5000
        stats = remote.stats()
    assert stats == {
        "received": 5000,
        "sent": 5000,
        "handled": 5000,
        "errors": 0,
        "dropped": 0,
        "pending": 0,
        "buffered": 0,
        "alive": True,
        "exitcode": None,
    }


def test_close_flushes_and_closes_the_sink_and_ends_the_child(tmp_path: Path, closing: Any) -> None:
    """close() sends what is buffered, the child flushes and closes its sink and exits with 0."""
    remote = jsonl(tmp_path / "remote.jsonl")
    closing(remote)
    for i in range(10):
        remote(event(i))
    assert remote.close(timeout=30) is True
    assert remote.close(timeout=30) is True  # idempotent
    assert len(monitor_bus.read_jsonl(tmp_path / "remote.jsonl")) == 10
    stats = remote.stats()
    assert (stats["handled"], stats["alive"], stats["exitcode"]) == (10, False, 0)
    remote(event(11))
    assert remote.stats()["dropped"] == 1


def test_picklable_handler_object_runs_in_the_child(tmp_path: Path, closing: Any) -> None:
    """A handler object (not a factory) is pickled to the child, which calls it and its flush()."""
    out = tmp_path / "names.txt"
    remote = ProcessHandler(process_sinks.LineSink(str(out)))
    closing(remote)
    for name in ("a", "b", "c"):
        remote(Event(name, T0, {}))
    assert remote.flush() is True
    assert out.read_text() == "a\nb\nc\n"


def test_sink_errors_are_counted_and_logged_once_per_type(
    tmp_path: Path, closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Errors the sink raises in the child are counted, and reported in the parent rate-limited."""
    remote = ProcessHandler(functools.partial(process_sinks.FailingSink, str(tmp_path / "f.jsonl")))
    closing(remote)
    with caplog.at_level(logging.ERROR, logger="monitor_bus"):
        for i in range(6):
            remote(event(i, "bad" if i % 2 else "good"))
        assert remote.flush() is True
        for i in range(6, 8):
            remote(event(i, "bad"))
        assert remote.flush() is True
    stats = remote.stats()
    assert (stats["handled"], stats["errors"], stats["dropped"]) == (8, 5, 0)
    assert [e.data["i"] for e in monitor_bus.read_jsonl(tmp_path / "f.jsonl")] == [0, 2, 4]
    errors = [r for r in caplog.records if "raised ValueError in the child" in r.getMessage()]
    assert len(errors) == 1
    assert "bad event 1" in errors[0].getMessage()
    assert "Traceback" in errors[0].getMessage()


def test_full_child_blocks_then_counts_dropped(
    closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Past max_pending unacknowledged events the handler waits up to timeout, then drops them."""
    gate = SPAWN.Event()
    remote = ProcessHandler(
        functools.partial(process_sinks.GatedSink, gate), max_pending=10, timeout=0.2
    )
    closing(remote)
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        for i in range(20):  # the 10th sends 10 (the child blocks on them); the 20th finds no room
            remote(event(i))
    assert remote.stats()["sent"] == 10
    assert remote.stats()["dropped"] == 10
    assert any("dropped 10 events" in r.getMessage() for r in caplog.records)
    gate.set()
    assert remote.flush() is True
    stats = remote.stats()
    assert (stats["received"], stats["handled"], stats["dropped"], stats["pending"]) == (
        20,
        10,
        10,
        0,
    )


def test_killed_child_is_reported_and_its_events_counted_dropped(
    closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGKILLed child is seen (no hang), logged with its exit code, its events counted dropped."""
    gate = SPAWN.Event()  # never set: the child holds the events it was sent
    remote = ProcessHandler(functools.partial(process_sinks.GatedSink, gate), max_pending=5)
    closing(remote)
    for i in range(5):  # the 5th sends them
        remote(event(i))
    assert remote.stats()["sent"] == 5
    os.kill(remote.pid, signal.SIGKILL)
    with caplog.at_level(logging.ERROR, logger="monitor_bus"):
        assert remote.flush() is False
    stats = remote.stats()
    assert (stats["handled"], stats["dropped"], stats["alive"]) == (0, 5, False)
    assert stats["exitcode"] == -signal.SIGKILL
    crash = [r for r in caplog.records if "exited with code" in r.getMessage()]
    assert len(crash) == 1
    assert f"exited with code {-signal.SIGKILL}; 5 events" in crash[0].getMessage()
    remote(event(5))
    assert remote.stats()["dropped"] == 6
    assert remote.close(timeout=5) is False


def test_close_is_time_boxed_when_the_sink_hangs(
    closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """close(timeout) stops a child whose sink hangs in flush(), counting its events dropped."""
    gate = SPAWN.Event()  # never set: the sink's flush() hangs
    remote = ProcessHandler(functools.partial(process_sinks.StuckFlushSink, gate), timeout=0.2)
    closing(remote)
    for i in range(3):
        remote(event(i))
    assert remote.flush() is False  # gave up after timeout; the events stay pending
    assert remote.stats()["pending"] == 3
    with caplog.at_level(logging.ERROR, logger="monitor_bus"):
        assert remote.close(timeout=0.5) is False
    stats = remote.stats()
    # Never acknowledged (the flush did not finish): not known to be written, so dropped.
    assert (stats["handled"], stats["dropped"], stats["pending"], stats["alive"]) == (
        0,
        3,
        0,
        False,
    )
    assert stats["exitcode"] == -signal.SIGTERM
    assert any("stopping the child process" in r.getMessage() for r in caplog.records)


def test_a_forked_copy_drops_instead_of_writing_into_the_parents_stream(
    tmp_path: Path, closing: Any
) -> None:
    """A forked process's copy counts what it is given as dropped; the parent's stream is intact."""
    remote = jsonl(tmp_path / "remote.jsonl")
    closing(remote)
    remote(event(0))  # buffered at the fork: the parent's to send

    def in_child() -> None:
        remote(event(1))
        remote.flush()
        stats = remote.stats()
        os._exit(0 if (stats["dropped"], stats["alive"], stats["sent"]) == (1, False, 0) else 3)

    child = multiprocessing.get_context("fork").Process(target=in_child)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    remote(event(2))
    assert remote.flush() is True
    assert [e.data["i"] for e in monitor_bus.read_jsonl(tmp_path / "remote.jsonl")] == [0, 2]


def test_factory_failure_reaches_the_caller(tmp_path: Path) -> None:
    """A factory that raises in the child makes the constructor raise, with the child's traceback."""
    with pytest.raises(RuntimeError, match="ValueError: no sink today"):
        ProcessHandler(process_sinks.broken_factory)
    with pytest.raises(RuntimeError, match="No such file or directory"):
        jsonl(tmp_path / "missing" / "x.jsonl")


def test_bad_arguments_raise_naming_them() -> None:
    """Bad arguments raise at once, each message naming the argument."""
    with pytest.raises(TypeError, match="factory must be callable"):
        ProcessHandler("x.jsonl")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="factory must be picklable"):
        ProcessHandler(lambda: JsonlEventHandler("x.jsonl"))
    with pytest.raises(TypeError, match=r"factory: JsonlEventHandler needs arguments"):
        ProcessHandler(JsonlEventHandler)
    with pytest.raises(ValueError, match="start_method must be one of"):
        ProcessHandler(process_sinks.broken_factory, start_method="thread")
    with pytest.raises(ValueError, match="max_pending must be at least 1"):
        ProcessHandler(process_sinks.broken_factory, max_pending=0)
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        ProcessHandler(process_sinks.broken_factory, timeout="1")  # type: ignore[arg-type]


def run_program(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )


def test_events_logged_before_exit_reach_the_child(tmp_path: Path) -> None:
    """At interpreter exit the bus delivers its backlog to the child before the child is closed."""
    out = tmp_path / "out.jsonl"
    done = run_program(
        f"""
        import functools
        from datetime import datetime, timezone
        import monitor_bus

        if __name__ == "__main__":
            # The bus starts before multiprocessing is imported: its exit hook is the older.
            monitor_bus.register_event_handler(lambda event: None)
            sink = monitor_bus.ProcessHandler(
                functools.partial(monitor_bus.JsonlEventHandler, {str(out)!r})
            )
            monitor_bus.register_event_handler(sink, name="jsonl")
            for i in range(2000):
                monitor_bus.log_event(monitor_bus.Event("x", datetime.now(timezone.utc), {{"i": i}}))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert [e.data["i"] for e in monitor_bus.read_jsonl(out)] == list(range(2000))


def test_exit_is_time_boxed_when_the_sink_hangs(tmp_path: Path) -> None:
    """A sink hanging at exit delays the interpreter's exit by exit_timeout, then is stopped."""
    done = run_program(
        """
        import functools, multiprocessing
        from datetime import datetime, timezone
        import monitor_bus
        from tests import process_sinks

        if __name__ == "__main__":
            gate = multiprocessing.get_context("spawn").Event()
            sink = monitor_bus.ProcessHandler(
                functools.partial(process_sinks.StuckFlushSink, gate), timeout=0.2, exit_timeout=0.5
            )
            sink(monitor_bus.Event("x", datetime.now(timezone.utc), {}))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "stopping the child process" in done.stderr
    assert "not finished within exit_timeout=0.5 s at exit" in done.stderr


def test_start_method_is_configurable(tmp_path: Path, closing: Any) -> None:
    """start_method="forkserver" starts the child that way and delivers the same."""
    remote = jsonl(tmp_path / "remote.jsonl", start_method="forkserver")
    closing(remote)
    for i in range(3):
        remote(event(i))
    assert remote.close(timeout=30) is True
    assert [e.data["i"] for e in monitor_bus.read_jsonl(tmp_path / "remote.jsonl")] == [0, 1, 2]
    assert remote._proc._start_method == "forkserver"


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on the orphan with a pidfd")
def test_child_flushes_its_sink_and_exits_when_the_parent_dies(tmp_path: Path) -> None:
    """A child whose parent is SIGKILLed handles what it was sent, flushes its sink and exits."""
    out = tmp_path / "out.jsonl"
    done = run_program(
        f"""
        import functools, os, signal
        from datetime import datetime, timezone
        import monitor_bus

        if __name__ == "__main__":
            sink = monitor_bus.ProcessHandler(
                functools.partial(monitor_bus.JsonlEventHandler, {str(out)!r})
            )
            for i in range(1024):  # one message, sent without a flush
                sink(monitor_bus.Event("x", datetime.now(timezone.utc), {{"i": i}}))
            assert sink.stats()["sent"] == 1024
            print(sink.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        tmp_path,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    pidfd = os.pidfd_open(int(done.stdout))
    try:
        assert select.select([pidfd], [], [], 60)[0] == [pidfd], "the orphaned child lives on"
    finally:
        os.close(pidfd)
    assert [e.data["i"] for e in monitor_bus.read_jsonl(out)] == list(range(1024))


def test_through_the_bus_the_sink_writes_what_it_writes_registered_directly(
    tmp_path: Path, closing: Any
) -> None:
    """Delivered by a bus (its batches as queued, no Event built per event), the sink in the
    child writes the same bytes as the same sink registered directly: plain events, Stat
    windows, and a child process's events and windows with their origin."""
    direct = JsonlEventHandler(tmp_path / "direct.jsonl")
    remote = jsonl(tmp_path / "remote.jsonl")
    closing(remote)
    monitor_bus.register_event_handler(direct, name="direct")
    monitor_bus.register_event_handler(remote, name="remote")
    for e in varied_events()[:4] + [event(i) for i in range(2000)]:
        monitor_bus.log_event(e)
    stat = monitor_bus.Stat("parent.x", [monitor_bus.Aggregation.MEAN], timedelta(hours=1))
    stat.add(1.5)
    stat.add(2.5)
    child_workers.events_and_a_window_from_forked_children(3, 5)
    assert monitor_bus.get_default_bus().close(10)
    assert remote.close(10)
    direct.close()
    expected = (tmp_path / "direct.jsonl").read_bytes()
    assert expected.count(b"\n") == 2004 + 3 + 2
    assert expected.count(b'"origin":{"pid":') == 4
    assert expected.count(b'"name":"torch.monitor.Stat"') == 2
    assert (tmp_path / "remote.jsonl").read_bytes() == expected
    assert remote.stats()["handled"] == 2009


def test_a_batch_sink_gets_each_message_in_one_call_and_its_failures_counted(
    tmp_path: Path, closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink with ``handle_batch`` gets each message's events in one call in the child; one
    bad event costs no other, and each failure of the group is counted."""
    path = str(tmp_path / "f.jsonl")
    remote = ProcessHandler(functools.partial(process_sinks.FailingBatchSink, path))
    closing(remote)
    with caplog.at_level(logging.ERROR, logger="monitor_bus"):
        for i in range(6):
            remote(event(i, "bad" if i % 2 else "good"))
        assert remote.flush() is True
    stats = remote.stats()
    assert (stats["handled"], stats["errors"], stats["dropped"]) == (6, 3, 0)
    assert [e.data["i"] for e in monitor_bus.read_jsonl(path)] == [0, 2, 4]
    assert Path(path + ".batches").read_text() == "1"
    errors = [r for r in caplog.records if "raised ValueError in the child" in r.getMessage()]
    assert len(errors) == 1
    assert "bad event 1" in errors[0].getMessage()


def test_close_is_true_when_the_child_exits_right_after_its_last_acknowledgement(
    tmp_path: Path, closing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child acknowledges the close and exits: a parent that reads the acknowledgement and
    the end of the stream together (descheduled meanwhile, as on a busy machine) still
    reports a clean close."""
    from monitor_bus import _process_handler

    remote = jsonl(tmp_path / "remote.jsonl")
    closing(remote)
    for i in range(3):
        remote(event(i))
    real = _process_handler.wait_ready

    def descheduled(objects: list[Any], timeout: float | None) -> list[Any]:
        real(objects, timeout)
        remote._proc.join(10)  # the parent looks again only once the child has exited
        return real(objects, 0)

    monkeypatch.setattr(_process_handler, "wait_ready", descheduled)
    assert remote.close(timeout=30) is True
    assert remote.stats()["handled"] == 3
    assert remote.stats()["dropped"] == 0
    assert len(monitor_bus.read_jsonl(tmp_path / "remote.jsonl")) == 3


class _OnlyEven(ProcessHandler):
    def __call__(self, event: Event) -> None:
        if event.data["i"] % 2 == 0:
            super().__call__(event)


def test_a_subclass_that_changes_how_events_are_taken_is_called_by_the_bus(
    tmp_path: Path, closing: Any
) -> None:
    """The bus hands its batches over as queued only to ProcessHandler's own way of taking
    them: a subclass's ``__call__`` still decides."""
    path = tmp_path / "even.jsonl"
    remote = _OnlyEven(functools.partial(JsonlEventHandler, str(path)))
    closing(remote)
    bus = monitor_bus.EventBus(name="even")
    bus.register_event_handler(remote, name="even")
    for i in range(6):
        bus.log_event(event(i))
    assert bus.close(10)
    assert remote.close(10)
    assert [e.data["i"] for e in monitor_bus.read_jsonl(path)] == [0, 2, 4]


@pytest.mark.parametrize(
    ("sink", "expected"),
    [
        (process_sinks.KeepTrain, ["train.a", "train.b"]),
        (process_sinks.BatchOnly, ["train.a", "eval.a", "train.b"]),
        (process_sinks.AsyncBatch, ["train.a", "eval.a", "train.b"]),
    ],
)
def test_the_child_calls_the_sink_as_a_bus_would(
    tmp_path: Path, closing: Any, sink: Any, expected: list[str]
) -> None:
    """In the child, a subclass's own ``__call__`` still decides (no inherited
    ``handle_batch`` bypasses it), a sink with ``handle_batch`` only is taken, and an async
    ``handle_batch`` is not called (its sync ``__call__`` is, so nothing is lost)."""
    path = str(tmp_path / "out")
    remote = ProcessHandler(functools.partial(sink, path))
    closing(remote)
    bus = monitor_bus.EventBus(name="as-a-bus")
    bus.register_event_handler(remote, name="remote")
    for name in ("train.a", "eval.a", "train.b"):
        bus.log_event(Event(name, T0, {"i": 1}))
    assert bus.close(10)
    assert remote.close(10)
    if sink is process_sinks.KeepTrain:
        names = [e.name for e in monitor_bus.read_jsonl(path)]
    else:
        names = Path(path).read_text().splitlines()
    assert names == expected
    assert (remote.stats()["handled"], remote.stats()["errors"]) == (3, 0)


def test_flush_waits_for_what_an_earlier_flush_left_unacknowledged(closing: Any) -> None:
    """A flush that gave up on a slow child leaves its events pending: the next flush, with
    nothing new to send, waits for them too instead of saying True at once."""
    gate = SPAWN.Event()
    remote = ProcessHandler(functools.partial(process_sinks.GatedSink, gate), timeout=0.2)
    closing(remote)
    for i in range(3):
        remote(event(i))
    assert remote.flush() is False  # the child holds them at the gate
    assert remote.flush() is False  # still held: nothing new, but nothing acknowledged
    assert remote.stats()["handled"] == 0
    gate.set()
    assert remote.flush() is True
    assert (remote.stats()["handled"], remote.stats()["pending"]) == (3, 0)


def test_bus_flush_is_true_only_once_the_child_has_handled_everything(closing: Any) -> None:
    """bus.flush(t) waits for the child's acknowledgement past the handler thread's own wait
    (here 0.2 s), up to t: False while the child holds the events, True once it has handled
    them, and then the child's counts say so."""
    gate = SPAWN.Event()
    remote = ProcessHandler(functools.partial(process_sinks.GatedSink, gate), timeout=0.2)
    closing(remote)
    gave_up = LogSeen("the child did not finish a flush within 0.2 s")
    logging.getLogger("monitor_bus").addHandler(gave_up)
    try:
        with monitor_bus.EventBus(name="process") as bus:
            bus.register_event_handler(remote, name="remote")
            for i in range(3):
                bus.log_event(event(i))
            assert gave_up.seen.wait(30)  # the handler thread's own wait is over
            assert bus.flush(timeout=0.5) is False
            assert remote.stats()["handled"] == 0
            gate.set()
            assert bus.flush(timeout=60) is True
            stats = remote.stats()
            assert (stats["handled"], stats["pending"], stats["dropped"]) == (3, 0, 0)
    finally:
        logging.getLogger("monitor_bus").removeHandler(gave_up)


def test_bus_flush_is_false_once_the_child_is_gone(closing: Any) -> None:
    """A child killed with events unacknowledged: bus.flush() says False (they are dropped and
    counted), not True."""
    gate = SPAWN.Event()  # never set
    remote = ProcessHandler(
        functools.partial(process_sinks.GatedSink, gate), max_pending=2, timeout=0.2
    )
    closing(remote)
    with monitor_bus.EventBus(name="process") as bus:
        bus.register_event_handler(remote, name="remote")
        for i in range(2):
            bus.log_event(event(i))
        assert bus.flush(timeout=0.5) is False
        os.kill(remote.pid, signal.SIGKILL)
        assert bus.flush(timeout=60) is False
        stats = remote.stats()
        assert (stats["handled"], stats["dropped"], stats["alive"]) == (0, 2, False)
        # Seen from this thread (bus.flush): told to the bus at the handler's next batch.
        bus.log_event(event(2))
        assert bus.flush(timeout=60) is False
        (handler,) = bus.stats()["handlers"]
        assert (handler["logged"], handler["delivered"], handler["dropped"]) == (3, 0, 3)


def test_what_a_killed_child_never_acknowledged_is_dropped_on_the_bus(
    closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The bus moves the events a SIGKILLed child never acknowledged, and each later one, from
    delivered to dropped, once (the handler's own count stays its own), and reports them."""
    reached, gate = SPAWN.Event(), SPAWN.Event()  # gate never set: the child holds "hold"
    remote = ProcessHandler(functools.partial(process_sinks.HoldSink, reached, gate), timeout=60)
    closing(remote)
    with (
        caplog.at_level(logging.WARNING, logger="monitor_bus"),
        monitor_bus.EventBus(name="process") as bus,
    ):
        bus.register_event_handler(remote, name="remote")
        for i in range(3):
            bus.log_event(event(i))
        assert bus.flush(timeout=60) is True  # acknowledged: these three stay delivered
        bus.log_event(event(3, "hold"))
        for i in range(4, 8):
            bus.log_event(event(i))
        assert reached.wait(60)  # the child holds "hold": five events unacknowledged
        os.kill(remote.pid, signal.SIGKILL)
        assert bus.flush(timeout=60) is False  # the handler thread saw it die
        (handler,) = bus.stats()["handlers"]
        assert (handler["logged"], handler["delivered"], handler["dropped"]) == (8, 3, 5)
        bus.log_event(event(8))  # after it is gone
        assert bus.flush(timeout=60) is False
        (handler,) = bus.stats()["handlers"]
        assert (handler["logged"], handler["delivered"], handler["dropped"]) == (9, 3, 6)
        assert handler["pending"] == 0
    stats = remote.stats()
    assert (stats["received"], stats["handled"], stats["dropped"]) == (9, 3, 6)
    # The bus's reports, the last one as it let go of the handler: nothing told twice.
    reports = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert reports[-1].startswith("EventBus 'process': handler 'remote' could not write ")
    assert reports[-1].endswith(", 6 in all")
    assert sum(int(r.split("could not write ")[1].split()[0]) for r in reports) == 6


def test_exit_says_a_dead_child_is_gone_not_late(tmp_path: Path) -> None:
    """At exit, a child that was SIGKILLed before is named gone, with its signal, at once; not
    "not finished within exit_timeout"."""
    done = run_program(
        """
        import os, signal
        from datetime import datetime, timezone
        import monitor_bus
        from tests import process_sinks

        if __name__ == "__main__":
            sink = monitor_bus.ProcessHandler(process_sinks.Stuck, max_pending=2, exit_timeout=30)
            for i in range(2):  # the second sends both: the child holds them
                sink(monitor_bus.Event("x", datetime.now(timezone.utc), {"i": i}))
            os.kill(sink.pid, signal.SIGKILL)
            assert sink.flush() is False
            print(sink.pid)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout)
    stats = {
        "received": 2,
        "sent": 2,
        "handled": 0,
        "errors": 0,
        "dropped": 2,
        "pending": 0,
        "buffered": 0,
        "alive": False,
        "exitcode": -signal.SIGKILL,
    }
    assert done.stderr.splitlines()[-1] == (
        f"ProcessHandler <class 'tests.process_sinks.Stuck'>: at exit, the child process "
        f"(pid {pid}) is gone (killed by signal SIGKILL); what it had not acknowledged is "
        f"counted as dropped; stats: {stats}"
    )
    assert "exit_timeout" not in done.stderr


def test_a_forked_copy_tells_its_own_bus_only_its_own_drops(closing: Any) -> None:
    """A bus with children="own" runs a forked copy of the handler, with counts of its own: the
    copy tells that bus what it dropped there, not what the parent had not told yet."""
    gate = SPAWN.Event()  # never set
    remote = ProcessHandler(
        functools.partial(process_sinks.GatedSink, gate), max_pending=2, timeout=0.2
    )
    closing(remote)
    with monitor_bus.EventBus(name="own", children="own") as bus:
        bus.register_event_handler(remote, name="remote")
        for i in range(2):
            bus.log_event(event(i))
        assert bus.flush(timeout=0.5) is False
        os.kill(remote.pid, signal.SIGKILL)
        assert bus.flush(timeout=60) is False  # 2 dropped, not told to the bus yet

        def in_child() -> None:
            bus.log_event(event(9))  # the copy drops it
            bus.flush(timeout=60)
            (handler,) = bus.stats()["handlers"]
            counts = (handler["logged"], handler["delivered"], handler["dropped"])
            os._exit(0 if counts == (1, 0, 1) else 3)

        child = multiprocessing.get_context("fork").Process(target=in_child)
        child.start()
        child.join(60)
        assert child.exitcode == 0
        bus.log_event(event(2))
        assert bus.flush(timeout=60) is False
        (handler,) = bus.stats()["handlers"]
        assert (handler["logged"], handler["delivered"], handler["dropped"]) == (3, 0, 3)


def test_what_the_sink_loses_in_the_child_is_dropped_and_its_errors_counted_on_the_bus(
    tmp_path: Path, closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSONL sink in the child on a real full disk (a 64 KiB tmpfs): its failed flushes count
    as the handler's errors on the bus, and what it could not write, given up when the bus lets
    go of the handler, counts as dropped by that handler (not delivered), with warnings, and in
    the handler's own stats: delivered == lines in the file, delivered + dropped == logged."""
    from .full_disk import small_disk

    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        (disk / "filler").write_bytes(b"x" * 40 * 1024)  # room for a few hundred lines
        path = disk / "run.jsonl"
        remote = jsonl(path)
        closing(remote)
        bus = monitor_bus.EventBus(name="disk")
        bus._linger = 30.0  # one batch, so one flush of the sink: drained at flush
        handle = bus.register_event_handler(remote, name="jsonl")
        with caplog.at_level(logging.WARNING, logger="monitor_bus"):
            for i in range(3000):
                bus.log_event(event(i))
            assert bus.flush(30)  # the child acknowledged: the sink keeps what it could not write
            (kept,) = bus.stats()["handlers"]
            assert (kept["delivered"], kept["dropped"], kept["errors"]) == (3000, 0, 1)
            assert bus.close(30)
            assert remote.close(10)
        written = path.read_bytes().count(b"\n")
        assert 0 < written < 1000
        handler = handle._handler  # its counters as the bus let go of it
        assert (handler.delivered, handler.dropped, handler.errors) == (written, 3000 - written, 2)
        assert bus.stats()["handler_errors"] == 2
        own = remote.stats()
        assert (own["received"], own["handled"], own["dropped"], own["errors"]) == (
            3000,
            written,
            3000 - written,
            2,
        )
    lost = 3000 - written
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith(f"ProcessHandler {remote._name} dropped {lost} events (its sink ")
        for m in messages
    )
    assert any(
        m.startswith(f"EventBus 'disk': handler 'jsonl' could not write {lost} ") for m in messages
    )


class _StuckWriter:
    """A TensorBoard writer whose ``add_scalar`` waits for ``gate``, saying it entered."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        self.gate.wait(process_sinks.NEVER)


def test_a_process_handler_waits_for_its_own_child_only_not_a_stuck_sink_beside_it(
    tmp_path: Path, closing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With another bundled sink of the bus stuck in a call (and no watchdog to move it), the
    events delivered to a ProcessHandler still reach its child: unregistering it returns True
    with all of them written, the stuck sink's call still going on."""
    from monitor_bus import _runner

    monkeypatch.setattr(_runner, "SINK_BUDGET", 600.0)  # no watchdog within the test
    writer = _StuckWriter()
    path = tmp_path / "run.jsonl"
    remote = jsonl(path)
    closing(remote)
    bus = monitor_bus.EventBus(name="beside")
    try:
        bus.register_event_handler(monitor_bus.TensorboardEventHandler(writer), name="stuck")
        handle = bus.register_event_handler(remote, name="remote")
        bus.log_event(Event(monitor_bus.STAT_EVENT, T0, {"x": 1.0}))
        assert writer.entered.wait(60)  # the stuck sink's call has started
        for i in range(10):
            bus.log_event(event(i))
        assert bus.unregister_event_handler(handle, timeout=10) is True
        assert remote.stats()["handled"] == 11
        assert len(path.read_bytes().splitlines()) == 11
        assert not writer.gate.is_set()
    finally:
        writer.gate.set()
        assert bus.close(30)


def close_stopped(remote: ProcessHandler, timeout: float) -> tuple[bool, float]:
    """Stop (SIGSTOP) the child of ``remote`` after it acknowledged 3 events, give it 2,000
    more (more than its socket holds), and close it: what close returned, and how long it
    took."""
    for i in range(3):
        remote(event(i))
    assert remote.flush() is True
    os.kill(remote.pid, signal.SIGSTOP)
    big = "x" * 1000
    for i in range(3, 1000):
        remote(Event("big", T0, {"i": i, "pad": big}))
    assert remote.stats()["buffered"] == 997
    started = time.monotonic()
    closed = remote.close(timeout)
    return closed, time.monotonic() - started


def test_close_on_a_stopped_child_returns_false_and_counts_what_it_did_not_take(
    closing: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``close(2)`` on a child stopped by SIGSTOP, with more to send than its socket holds,
    returns False (no hang: well under a bound of 10 s), the child killed, and every event it
    had not acknowledged counted as dropped."""
    remote = jsonl(Path(os.devnull))
    closing(remote)
    with caplog.at_level(logging.ERROR, logger="monitor_bus"):
        closed, took = close_stopped(remote, 2.0)
    assert closed is False
    assert took < 10.0
    stats = remote.stats()
    assert (stats["received"], stats["handled"], stats["dropped"]) == (1000, 3, 997)
    assert (stats["pending"], stats["buffered"], stats["alive"]) == (0, 0, False)
    assert stats["exitcode"] == -signal.SIGKILL


@pytest.mark.stress
def test_close_on_a_stopped_child_returns_within_its_timeout(closing: Any) -> None:
    """``close(2)`` on a SIGSTOPped child returns within its timeout and a tenth of a second or
    so (it took 3-4 s: a second given to SIGTERM, which a stopped process never acts on)."""
    remote = jsonl(Path(os.devnull))
    closing(remote)
    closed, took = close_stopped(remote, 2.0)
    assert closed is False
    assert took < 2.5
