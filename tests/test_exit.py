"""The end of a process: runs end before the buses close, children are waited for, SIGTERM ends
cleanly, a notebook's crashed cell fails its run. Each test runs a real interpreter."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import monitor_bus
from monitor_bus import RUN_END_EVENT, RUN_START_EVENT

from .conftest import require


def _script(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "main.py"
    path.write_text(textwrap.dedent(code))
    return path


def _run(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=120
    )


_LATE_CHILD = """
import sys, time
import multiprocessing
from datetime import datetime
from multiprocessing import util
import monitor_bus as monitor

def report():
    stats = monitor.get_default_bus().stats()
    print("child", stats["to_parent"], stats["dropped"], flush=True)

def child(ready, go):
    ready.set()
    go.wait()  # set by the parent's last statement: it is exiting meanwhile
    for i in range(20):
        monitor.log_event(monitor.Event("late", datetime.now(), {"i": i}))
        time.sleep(0.01)  # the child's work: the parent's exit runs meanwhile
    util.Finalize(None, report, exitpriority=0)  # after monitor_bus's own finalizer

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[2])
    monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
    ready, go = ctx.Event(), ctx.Event()
    ctx.Process(target=child, args=(ready, go)).start()  # not daemonic, never joined here
    ready.wait()
    go.set()
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_what_a_child_logs_while_the_parent_exits_arrives(tmp_path: Path, method: str) -> None:
    """A non-daemonic child logging after the parent's main code returned: all 20 events arrive
    (exit waits for the child before closing the buses and the relay)."""
    out = tmp_path / "events.jsonl"
    proc = _run(_script(tmp_path, _LATE_CHILD), str(out), method)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "child 20 0\n"
    late = [e.data["i"] for e in monitor_bus.read_jsonl(out) if e.name == "late"]
    assert late == list(range(20))


_SLOW_CHILD = """
import sys, time
import multiprocessing
from datetime import datetime
from multiprocessing import util
import monitor_bus as monitor

def report():
    stats = monitor.get_default_bus().stats()
    print("child", stats["to_parent"], stats["dropped"], flush=True)

def child(ready):
    monitor.log_event(monitor.Event("early", datetime.now(), {}))
    ready.set()
    time.sleep(4)  # outlives the parent's wait (exit_timeout=1)
    for i in range(20):
        monitor.log_event(monitor.Event("late", datetime.now(), {"i": i}))
    util.Finalize(None, report, exitpriority=0)

if __name__ == "__main__":
    monitor.configure_default_bus(exit_timeout=1.0)
    monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    ctx.Process(target=child, args=(ready,)).start()
    ready.wait()
"""


@pytest.mark.stress
def test_the_wait_for_children_is_bounded_by_exit_timeout(tmp_path: Path) -> None:
    """A child still running after the parent waited exit_timeout: the parent closes its bus
    then (the early event is written, none after), and the child counts its late events as
    dropped."""
    out = tmp_path / "events.jsonl"
    proc = _run(_script(tmp_path, _SLOW_CHILD), str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "child 1 20\n"
    assert [e.name for e in monitor_bus.read_jsonl(out)] == ["early"]


_CLOSED_PARENT = """
import sys
import multiprocessing
from datetime import datetime
from multiprocessing import util
import monitor_bus as monitor

def report():
    stats = monitor.get_default_bus().stats()
    print("child", stats["to_parent"], stats["dropped"], flush=True)

def child(go):
    go.wait()
    for i in range(20):
        monitor.log_event(monitor.Event("late", datetime.now(), {"i": i}))
    util.Finalize(None, report, exitpriority=0)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
    go = ctx.Event()
    proc = ctx.Process(target=child, args=(go,))
    proc.start()
    monitor.get_default_bus().close()  # as exit does, before the relay closes
    go.set()
    proc.join()
"""


def test_a_closed_parent_bus_is_counted_as_drops_in_the_child(tmp_path: Path) -> None:
    """A child whose parent's bus is closed counts every event it logs as dropped (not as
    sent, not silently ignored), and warns."""
    out = tmp_path / "events.jsonl"
    proc = _run(_script(tmp_path, _CLOSED_PARENT), str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "child 0 20\n"
    assert "the parent process closed its bus" in proc.stderr
    assert not [e for e in monitor_bus.read_jsonl(out) if e.name == "late"]


_IMPORT_AFTER_START = """
import sys
import monitor_bus as monitor
monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
monitor.Run("exp").start()
import multiprocessing  # first imported after the run started
proc = multiprocessing.get_context("fork").Process(target=print, args=("child",))
proc.start()
proc.join()
"""


def test_the_run_ends_when_multiprocessing_is_imported_after_it_started(tmp_path: Path) -> None:
    """multiprocessing imported (and used) after Run.start(): the run's end is still recorded."""
    out = tmp_path / "events.jsonl"
    proc = _run(_script(tmp_path, _IMPORT_AFTER_START), str(out))
    assert proc.returncode == 0, proc.stderr
    events = list(monitor_bus.read_jsonl(out))
    assert [e.name for e in events] == [RUN_START_EVENT, RUN_END_EVENT]
    assert events[1].data["status"] == "success"


_CHILD_RUN = """
import sys
import multiprocessing
import monitor_bus as monitor

def child():
    monitor.Run("in-child").start()  # never ended by the child's code

if __name__ == "__main__":
    monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
    proc = multiprocessing.get_context(sys.argv[2]).Process(target=child)
    proc.start()
    proc.join()
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_run_in_a_multiprocessing_child_ends(tmp_path: Path, method: str) -> None:
    """A Run started in a multiprocessing child and left open is ended at the child's exit."""
    out = tmp_path / "events.jsonl"
    proc = _run(_script(tmp_path, _CHILD_RUN), str(out), method)
    assert proc.returncode == 0, proc.stderr
    events = list(monitor_bus.read_jsonl(out))
    assert [e.name for e in events] == [RUN_START_EVENT, RUN_END_EVENT]
    assert events[1].data["status"] == "success"
    assert events[1].data["run_name"] == "in-child"


_TRAINING = """
import signal, sys, time
from datetime import datetime
import monitor_bus as monitor

def slow(event):
    # Nothing is taken before SIGTERM is being handled (its handler puts the default back),
    # so the whole tail is queued at SIGTERM on any machine, however loaded; unhandled, never.
    while sys.argv[2] != "on" or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        time.sleep(0.001)

monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
monitor.register_event_handler(slow)
monitor.Run("exp", **({} if sys.argv[2] == "on" else {"handle_sigterm": False})).start()
for i in range(10000):
    monitor.log_event(monitor.Event("step", datetime.now(), {"i": i}))
print("ready", monitor.get_default_bus().stats()["queued"] > 0, flush=True)
while True:
    time.sleep(0.01)  # the training loop
"""


def _sigterm(tmp_path: Path, handling: str, code: str = _TRAINING) -> tuple[int, Path, str]:
    out = tmp_path / "events.jsonl"
    path = _script(tmp_path, code)
    with subprocess.Popen(
        [sys.executable, str(path), str(out), handling],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        ready = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        stderr = proc.stderr.read()
    assert ready == "ready True\n", stderr
    return code, out, stderr


def test_sigterm_ends_the_run_and_delivers_the_queued_tail(tmp_path: Path) -> None:
    """SIGTERM during training: every queued event is written, the run ends interrupted, and
    the process still dies of SIGTERM."""
    code, out, stderr = _sigterm(tmp_path, "on")
    assert code == -signal.SIGTERM, stderr
    events = list(monitor_bus.read_jsonl(out))
    assert [e.name for e in events] == [RUN_START_EVENT] + ["step"] * 10000 + [RUN_END_EVENT]
    assert [e.data["i"] for e in events[1:-1]] == list(range(10000))
    assert events[-1].data["status"] == "interrupted"
    assert events[-1].data["exception"] == ""


_TRAINING_WITHOUT_RUN = """
import signal, sys, time
from datetime import datetime, timedelta
import monitor_bus as monitor

def slow(event):
    # Nothing is taken before SIGTERM is being handled (its handler puts the default back),
    # so the whole tail is queued at SIGTERM on any machine, however loaded.
    while signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        time.sleep(0.001)

monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
monitor.register_event_handler(slow)
steps = monitor.Stat("steps", [monitor.Aggregation.COUNT], timedelta(hours=1))
for i in range(10000):
    monitor.log_event(monitor.Event("step", datetime.now(), {"i": i}))
    steps.add(1.0)
print("ready", monitor.get_default_bus().stats()["queued"] > 0, flush=True)
while True:
    time.sleep(0.01)  # the training loop
"""


def test_sigterm_without_a_run_delivers_the_queued_tail_and_the_open_windows(
    tmp_path: Path,
) -> None:
    """SIGTERM to a program that registered a handler on the default bus and started no Run:
    every queued event and the Stat's open window are written, and the process still dies of
    SIGTERM."""
    code, out, stderr = _sigterm(tmp_path, "", _TRAINING_WITHOUT_RUN)
    assert code == -signal.SIGTERM, stderr
    events = list(monitor_bus.read_jsonl(out))
    assert [e.name for e in events] == ["step"] * 10000 + [monitor_bus.STAT_EVENT]
    assert [e.data["i"] for e in events[:-1]] == list(range(10000))
    assert events[-1].data == {"steps.count": 10000}
    assert stderr == ""


_SIGTERM_DURING_CLOSE = """
import signal, sys, threading, time
from datetime import datetime
import monitor_bus as monitor

written = open(sys.argv[1], "w")

def slow(event):  # takes nothing until SIGTERM is being handled (its handler puts the default back)
    while signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        time.sleep(0.001)
    time.sleep(0.005)  # then 0.5 s in all: far more than the exit takes, far less than its 5 s
    written.write(f"{event.data['i']}\\n")
    written.flush()

monitor.register_event_handler(slow)
for i in range(100):
    monitor.log_event(monitor.Event("step", datetime.now(), {"i": i}))
bus = monitor.get_default_bus()

def say_when_detached():
    while bus._handlers:  # close() has not detached the handlers yet
        time.sleep(0.001)
    print("ready", True, flush=True)

threading.Thread(target=say_when_detached, daemon=True).start()
bus.close()  # interrupted by SIGTERM while it waits for the handlers it detached
"""


def test_sigterm_during_close_waits_for_the_handlers_that_close_detached(tmp_path: Path) -> None:
    """SIGTERM while close() waits for the handler it detached: the exit SIGTERM runs waits
    for it too (it found none of its own to detach), so every event reaches it, and the
    process still dies of SIGTERM."""
    code, out, stderr = _sigterm(tmp_path, "", _SIGTERM_DURING_CLOSE)
    assert code == -signal.SIGTERM, stderr
    assert out.read_text().split() == [str(i) for i in range(100)]
    assert stderr == ""


def test_sigterm_handling_can_be_turned_off(tmp_path: Path) -> None:
    """Run(handle_sigterm=False): SIGTERM kills at once, as Python's default does (no run end)."""
    code, out, stderr = _sigterm(tmp_path, "off")
    assert code == -signal.SIGTERM, stderr
    assert RUN_END_EVENT not in out.read_text()  # its last line may be torn: not parsed


_USER_HANDLER = """
import signal, sys, time
import monitor_bus as monitor
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
monitor.Run("exp").start()
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


_CHAINED = """
import signal, sys, time
import monitor_bus as monitor
monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
monitor.Run("exp").start()
previous = signal.getsignal(signal.SIGTERM)
stop = []

def composed(signum, frame):  # as Lightning's Trainer does: its own, then the one it found
    stop.append(signum)
    previous(signum, frame)

signal.signal(signal.SIGTERM, composed)
print("ready", flush=True)
while not stop:
    time.sleep(0.01)
print("stopped gracefully", flush=True)
"""


def _terminated_once_ready(tmp_path: Path, code: str, out: Path) -> tuple[int, str]:
    """Run ``code`` (writing its events to ``out``), send it SIGTERM once it prints "ready",
    and return its exit status and what it printed after."""
    with subprocess.Popen(
        [sys.executable, str(_script(tmp_path, code)), str(out)],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(60)
        return status, proc.stdout.read()


def test_a_later_handler_that_calls_ours_owns_sigterm(tmp_path: Path) -> None:
    """A SIGTERM handler installed after the run started that calls the previous one (as
    Lightning's does): ours does nothing, the program stops its own way, the run ends at exit."""
    out = tmp_path / "events.jsonl"
    assert _terminated_once_ready(tmp_path, _CHAINED, out) == (0, "stopped gracefully\n")
    events = list(monitor_bus.read_jsonl(out))
    assert [e.data.get("status") for e in events] == [None, "success"]


def test_a_users_sigterm_handler_is_left_in_place(tmp_path: Path) -> None:
    """With a SIGTERM handler of the user's installed, Run installs none: the user's runs
    (here: sys.exit(7), which ends the run at exit as success)."""
    out = tmp_path / "events.jsonl"
    assert _terminated_once_ready(tmp_path, _USER_HANDLER, out) == (7, "")
    events = list(monitor_bus.read_jsonl(out))
    assert [e.data.get("status") for e in events] == [None, "success"]


_WHERE = """
import multiprocessing, signal, threading
import monitor_bus as monitor

def ours():
    return signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL

def in_child(queue):
    monitor.Run("child").start()
    queue.put(ours())

if __name__ == "__main__":
    thread = threading.Thread(target=lambda: monitor.Run("thread").start())
    thread.start()
    thread.join()
    print("thread", ours())
    monitor.Run("main").start()
    print("main", ours())
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    ctx.Process(target=in_child, args=(queue,)).start()
    print("child", queue.get())
"""


def test_the_sigterm_handler_is_only_installed_in_the_main_thread_of_the_main_process(
    tmp_path: Path,
) -> None:
    """A Run started in another thread or in a multiprocessing child installs no handler."""
    proc = _run(_script(tmp_path, _WHERE))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "thread False\nmain True\nchild False\n"


def test_a_crashed_notebook_cell_fails_the_run(tmp_path: Path) -> None:
    """In a Jupyter kernel, a cell that raises ends the open run failed (as an uncaught
    exception ends a script's), with the exception's type."""
    try:
        import ipykernel  # noqa: F401
        import nbclient
        import nbformat
    except ImportError as exc:
        require(False, f"notebook tooling missing: {exc}")
    out = tmp_path / "run.jsonl"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import monitor_bus as monitor\n"
            f"monitor.register_event_handler(monitor.JsonlEventHandler({str(out)!r}))\n"
            "run = monitor.Run('nb').start()"
        ),
        nbformat.v4.new_code_cell("1 +"),  # a syntax error: nothing ran, the run goes on
        nbformat.v4.new_code_cell("raise ValueError('boom')"),
        nbformat.v4.new_code_cell("monitor.flush()\nprint(run.status)"),
    ]
    client = nbclient.NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=True)
    client.execute()
    printed = [o.get("text", "") for o in nb.cells[3].outputs if o.output_type == "stream"]
    assert printed == ["failed\n"]
    events = list(monitor_bus.read_jsonl(out))
    assert [e.name for e in events] == [RUN_START_EVENT, RUN_END_EVENT]
    assert events[1].data["status"] == "failed"
    assert events[1].data["exception"] == "builtins.ValueError"


_TWO_BUSES = """
import multiprocessing, sys, threading
from datetime import datetime
from monitor_bus import Event, EventBus, JsonlEventHandler

healthy = EventBus(name="healthy", exit_timeout=2)  # made first: first in the exit's list
healthy.register_event_handler(JsonlEventHandler(sys.argv[1]))
stuck = EventBus(capacity=10, overflow="block", name="stuck", exit_timeout=2)
entered, never = threading.Event(), threading.Event()

def sink(event):
    entered.set()
    never.wait()

stuck.register_event_handler(sink, name="sink")

def child(stuck, healthy):
    for i in range(500):
        stuck.log_event(Event("s", datetime.now(), {"i": i}))
        healthy.log_event(Event("h", datetime.now(), {"i": i}))

if __name__ == "__main__":
    proc = multiprocessing.get_context("fork").Process(target=child, args=(stuck, healthy))
    proc.start()
    proc.join()
    assert entered.wait(30)
"""


def test_a_stuck_sink_on_one_bus_costs_the_other_buses_nothing_at_exit(tmp_path: Path) -> None:
    """At exit each bus gets its own exit_timeout: a sink stuck under "block" on one bus (its
    child's events parked in the relay) no longer holds up the events the same child sent
    another bus, which all arrive; the stuck bus's losses are counted and named."""
    out = tmp_path / "healthy.jsonl"
    proc = _run(_script(tmp_path, _TWO_BUSES), str(out))
    assert proc.returncode == 0, proc.stderr
    events = list(monitor_bus.read_jsonl(out))
    assert [e.data["i"] for e in events] == list(range(500)), proc.stderr
    assert "'healthy'" not in proc.stderr
    undelivered = re.search(
        r"cut off: 'sink' \((\d+) undelivered, 1 in its current call\)", proc.stderr
    )
    assert undelivered is not None, proc.stderr
    dropped = re.findall(r"EventBus 'stuck' .*?(\d+) dropped in all", proc.stderr)
    assert int(undelivered[1]) + (int(dropped[-1]) if dropped else 0) == 499, proc.stderr
