"""Run the reliability suite and publish its figures as ``docs/reliability.md``.

Usage::

    python benchmarks/reliability_report.py            # run tests/reliability, then render
    python benchmarks/reliability_report.py --no-run   # render from the last run's results
    python benchmarks/reliability_report.py -- -m "not stress"   # extra pytest arguments

Each scenario test appends its figures (load, faults, bad inputs, measured outcome) to a
JSON-lines file (``MONITOR_BUS_RELIABILITY_JSON``, see ``tests/reliability/conftest.py``);
pytest's JUnit XML gives every test's result and time. The page is rendered from both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from _machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
# Not the tests' default file, which any plain pytest run starts afresh.
RESULTS = ROOT / "build" / "reliability-report.jsonl"
JUNIT = ROOT / "build" / "reliability-junit.xml"
META = ROOT / "build" / "reliability-run.json"
OUTPUT = ROOT / "docs" / "reliability.md"
PACKAGES = ["monitor_bus", "anyio", "torch", "tensorboard", "hypothesis", "pytest", "psutil"]


def run_suite(extra: list[str]) -> dict[str, Any]:
    """Run pytest on tests/reliability with the recorder on; return when and how it ran."""
    for path in (RESULTS, JUNIT):
        path.unlink(missing_ok=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MONITOR_BUS_RELIABILITY_JSON=str(RESULTS))
    env.pop("MONITOR_BUS_SOAK_SECONDS", None)  # the page publishes the whole minute's soak
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/reliability",
        "-m",
        "",  # the stress scenarios too (the default run leaves them out); extra may narrow
        "-p",
        "no:cacheprovider",
        f"--junitxml={JUNIT}",
        "-q",
        *extra,
    ]
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    meta = {
        "command": " ".join(["python", "-m", "pytest", "tests/reliability", "-m", "''", *extra]),
        "exit_code": code,
        "wall_s": round(time.monotonic() - start, 1),
        "finished": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--", "monitor_bus")),
    }
    META.write_text(json.dumps(meta))
    return meta


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> list[tuple[str, str]]:
    rows = [("OS", f"{platform.system()} {platform.release()} ({platform.machine()})")]
    rows.append(("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores (shared with other jobs)"))
    try:
        import psutil

        rows.append(("Memory", f"{psutil.virtual_memory().total / 2**30:.1f} GiB"))
    except ImportError:
        pass
    rows.append(("Python", f"{platform.python_implementation()} {platform.python_version()}"))
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    rows.append(("Packages", ", ".join(versions)))
    return rows


def load_results() -> list[dict[str, Any]]:
    if not RESULTS.exists():
        return []
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def load_junit() -> list[dict[str, Any]]:
    if not JUNIT.exists():
        return []
    tests = []
    for case in ET.parse(JUNIT).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            result = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            result = "FAILED"
        else:
            result = "passed"
        module = case.get("classname", "").rsplit(".", 1)[-1]
        tests.append(
            {
                "module": module,
                "name": case.get("name", ""),
                "result": result,
                "seconds": float(case.get("time", 0)),
            }
        )
    return tests


def _cell(text: object) -> str:
    return _line(text).replace("|", "\\|")


def _line(text: object) -> str:
    return str(text).replace("\n", " ") or "-"


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)


def outcome(values: dict[str, Any]) -> str:
    return "; ".join(f"{k.replace('_', ' ')}: {_fmt(v)}" for k, v in values.items())


def render(meta: dict[str, Any]) -> str:
    results = load_results()
    tests = load_junit()
    stress_ids = {r["scenario"] for r in results if r["stress"]}
    seconds = {t["name"]: t["seconds"] for t in tests}
    out: list[str] = []
    w = out.append
    w("# Reliability")
    w("")
    w(
        "What the reliability suite (`tests/reliability/`) puts monitor_bus through, and what came "
        "out. Every figure below was measured by the tests of one run on the machine described "
        "here; every scenario is a test that asserts exact outcomes (counts that must match, bounds "
        "that must hold). Regenerate this page with:"
    )
    w("")
    w(
        "<!-- not-run: shell; runs the whole reliability suite "
        f"({meta.get('wall_s', '?')} s in the run below) -->"
    )
    w("```bash")
    w("python benchmarks/reliability_report.py")
    w("```")
    w("")
    w("## The run")
    w("")
    w("| | |")
    w("|---|---|")
    commit = meta.get("commit", "unknown") + (" (package modified)" if meta.get("dirty") else "")
    w(f"| Command | `{meta.get('command', '?')}` |")
    w(f"| Finished | {meta.get('finished', '?')}, commit {commit} |")
    passed = sum(t["result"] == "passed" for t in tests)
    failed = [t for t in tests if t["result"] == "FAILED"]
    w(
        f"| Tests | {len(tests)}: {passed} passed, {len(failed)} failed, "
        f"{len(tests) - passed - len(failed)} skipped |"
    )
    quick = sum(t["seconds"] for t in tests if t["name"] not in stress_ids)
    slow = sum(t["seconds"] for t in tests if t["name"] in stress_ids)
    w(
        f"| Time | {meta.get('wall_s', '?')} s in all; default tests {quick:.1f} s, "
        f"`stress` tests {slow:.1f} s |"
    )
    for key, value in machine():
        w(f"| {key} | {_cell(value)} |")
    w("")
    if failed:
        w(
            "**Failing in this run** (each is a package bug reported to the maintainers, or a "
            "bound the package does not meet yet; the tests stay as they are until it is fixed):"
        )
        w("")
        for t in failed:
            w(f"- `{t['module']}::{t['name']}`")
        w("")
    w("## Scenarios")
    w("")
    # A list per group, not one wide table: eight columns of sentences made rows 20 lines tall
    # and wider than the page's column even at 1280 px.
    group = None
    for r in results:
        if r["group"] != group:
            if group is not None:
                w("")
            group = r["group"]
            w(f"### {_line(group)}")
            w("")
        result = "pass" if r["passed"] else "**FAIL**"
        stress = ", stress" if r["stress"] else ""
        w(
            f"- `{_line(r['scenario'])}`: {result}, "
            f"{seconds.get(r['scenario'], r['seconds']):.1f} s{stress}"
        )
        w(f"    - Load: {_line(r['load'])}")
        w(f"    - Faults: {_line(r['faults'])}")
        if _line(r["bad_inputs"]) != "-":
            w(f"    - Bad inputs: {_line(r['bad_inputs'])}")
        w(f"    - Measured: {_line(outcome(r['outcome']))}")
    w("")
    w("## Every test of the run")
    w("")
    w("| Module | Test | Result | s |")
    w("|---|---|---|---|")
    for t in tests:
        w(f"| {t['module']} | `{_cell(t['name'])}` | {t['result']} | {t['seconds']:.2f} |")
    w("")
    w(GUARANTEES)
    return "\n".join(out) + "\n"


GUARANTEES = """\
## Guarantees

What the package promises, each backed by a scenario above:

- **Logging never stalls the caller.** `log_event` appends to a bounded queue and returns; it
  takes no lock on the fast path. Under the `"block"` overflow policy it waits at most
  `block_timeout` per call, then drops the event and counts it. A handler that is slow, stuck
  or raising delays nobody else: each sync handler has its own thread. Nor do `log_event` and
  `Stat.add` raise when the process is out of threads or file descriptors ("can't start new
  thread", EMFILE): a child counts what it could not send to its parent as dropped and
  connects again later; a bus whose dispatcher cannot start (after a fork) keeps the events
  queued, warns once per 10 s, and starts it with the next event once it can
  (`tests/test_bus.py`, `tests/test_relay_flow.py`).
- **Nothing is lost without being counted.** For every handler,
  `logged == delivered + dropped + pending` in `bus.stats()`; after `flush()` returns True,
  `pending` is 0. `delivered` follows the handler's calls as each returns (each event, each
  list of a batch handler, each queued batch of a bundled sink), so a slow handler's progress
  shows while it works. Drops happen only when a queue or a handler's backlog is full (or a
  handler is cut off by a timeout in `close`/`unregister_event_handler`, or at exit), or when a
  bundled sink cannot write what it was given (a full disk, past what it keeps for another
  try: it moves those events from `delivered` to `dropped`); they are counted per handler and
  reported on the `monitor_bus` logger at most once per 10 s each, naming the bus, the handler
  and the count. A cut-off's warning names what the handler will not get and, apart, what is
  still in its current call (which may yet return); the first is exactly what is then counted
  as dropped. A `Stat` window is never dropped, under any policy. Each handler
  gets its own copy of an event's `data`. If the dispatcher itself fails, the failure is logged
  at CRITICAL and a new dispatcher starts (`stats()["dispatcher_restarts"]`).
- **Memory is bounded** by `capacity` events in the queue and in each handler's backlog,
  whatever the event rate. (A closed `Stat` window is queued even past `capacity` rather than
  dropped: at most one event per Stat per window; behind a handler that never returns, they
  accumulate at that rate until it is cut off.)
- **Handler failures are contained.** Any exception a handler (or its `flush()` hook) raises,
  including `BaseException` subclasses, `KeyboardInterrupt` and `SystemExit`, is caught on the
  handler's thread or task, counted (`errors`, `handler_errors`) and logged with its traceback
  to the `monitor_bus` logger, at most once per handler and exception type every 10 s. The
  caller never sees it. A `KeyboardInterrupt` or `SystemExit` raised *inside a handler* does not
  interrupt the main thread or end the process: Ctrl-C is delivered to the main thread by
  Python, never to a handler thread, so such an exception can only come from the handler's own
  code, and it is treated as that handler's failure.
- **Time-bounded shutdown.** `flush(timeout)`, `close(timeout)` and
  `unregister_event_handler(handle, timeout)` return False once the timeout has passed, even
  with a handler that never returns (`math.inf` means no limit);
  `register_event_handler(..., timeout=)` raises `TimeoutError` past its timeout, with nothing
  registered, when an async handler blocks the loop. Once
  `unregister_event_handler` returns, True or False, no further call of that handler starts
  (bar one its thread was starting at that very moment); what was logged before the call and
  it did not get is counted as dropped for it, and nothing logged after the call is. `close()` also waits for handlers detached
  earlier and still running (cut off by that timeout, or replaced by a keyed registration and
  delivering their backlog), and reports their drops before it returns. At interpreter exit, and
  when a `with` or `async with` block around a bus ends, the bus delivers what is queued
  within its `exit_timeout`; a handler still busy then is cut off and named in a warning with
  its undelivered count, and a handler that never returns does not keep the process alive.
- **Child processes report to the parent.** What a `multiprocessing` child (fork, spawn or
  forkserver; `Pool`, `ProcessPoolExecutor`, PyTorch `DataLoader` workers, persistent or not)
  or an `os.fork()` child logs reaches the parent's handlers, once each, in the child's order,
  with `Event.origin` naming the child; the child runs none of the parent's handlers. The
  child's `log_event` writes each event to a Unix socket before it returns, so an event whose
  `log_event` returned survives the child's death (`with Pool() as pool:` terminating its
  workers included). A child that ends normally (returns without flushing, a Pool worker
  closed and joined, a DataLoader worker at the end of an epoch) also sends its open `Stat`
  windows: the package closes its buses in multiprocessing's finalizers, which run before the
  worker's `os._exit`. A child never blocks on its parent: when the socket is full the
  overflow policy applies (each call waits only its own budget: an event never waits behind
  another thread's window), and what a child cannot send (its parent gone or not listening,
  no file descriptor left) is counted and reported. Nor does the parent block on a child: it
  reads its children in turn, a bounded chunk each, and under `overflow="block"` with no room
  (a stuck sink) it stops reading a child rather than waiting, so `flush(timeout)`,
  `close(timeout)` and exit keep their timeouts (`tests/test_relay_flow.py`). Locks held by other threads at the fork (the bus's, a
  Stat's, the package's module-level ones, a `JsonlEventHandler`'s, a `SummaryWriter`'s) do not deadlock the child, and a sink object it
  inherits never writes the parent's pending lines again.
- **Stat windows are exact under concurrency.** `Stat.add` from many threads loses no value and
  counts none twice; a window with data is logged once, by the next `add` after its end or by
  the dispatcher's timer, which stamps the windows it closes with the time its pass began
  (never before the window's end). SUM is sequential float addition, MAX/MIN follow Python's `max`/`min`
  except that a NaN anywhere in a window makes them NaN, VALUE is the last value added (as a
  float), COUNT an `int`, MEAN `sum / count`, still the mean when the sum overflows (two
  `1e308`: SUM `inf`, MEAN `1e308`); past `max_samples`, later adds in the window are discarded. A Ctrl-C that
  lands inside a fold loses no sample.
- **Device values are never read by the caller.** `Stat.add(tensor)` and tensor values in
  `Event` data copy the value (a clone on the CPU, a non-blocking copy and a stream event from
  an accelerator) and the bus reads the copy on the dispatcher's thread, or on a worker thread
  while the device is not done, so delivery does not block the loop on a device (`flush`,
  `close` and handler registration, which deliver what is queued first, wait for it there);
  what was logged is the value at the call, whatever the caller does to its tensor afterwards,
  and no autograd graph is kept. Events holding device values keep their order with the rest. A value that cannot be
  read drops its event, counted in `dropped` and logged (`tests/test_device_values.py`).
- **Merged across ranks, a dead rank costs only what it had not sent.** With
  `merge_stats_across_ranks`, a rank that dies or hangs is named lost about `timeout` after its
  last message (2.24 s with `timeout=2` in `benchmarks/merge_ranks.py`, 4 ranks: see
  [Performance](performance.md#merging-across-ranks)); meanwhile its windows are merged among
  the live ranks, and every window of the live ranks reaches `dst`, merged once
  (`tests/test_merge_ranks.py` checks this sample by sample). If `dst` dies, a send fails at
  once and each rank logs its own windows, marked `"<name>.rank"` and counted; if `dst` hangs,
  sends give up after `timeout`, and once resumed it has merged exactly what the ranks count
  as sent. `close()` and interpreter exit are bounded by `timeout`.
- **Bad input is refused, not absorbed.** `Event` accepts plain `str` keys and
  `str`/`int`/`float`/`bool` values (numpy scalars and host arrays of one element converted,
  one-element tensors and device arrays copied and read by the bus) or raises `TypeError`
  naming the argument or key; `Stat.add` raises `TypeError`
  for a non-real value and leaves the window as it was. Names are kept verbatim (unicode,
  control characters) by every bundled sink; a value a sink cannot represent is skipped,
  counted and reported, and the rest of the event is written.

## What the package does not guarantee

- **SIGKILL, the OOM killer, a crash of the interpreter, power loss.** Events still in the
  queue, in a handler's backlog or buffered by a sink are lost, uncounted: nothing runs after
  the process dies (the crash scenarios above show what survives: everything flushed before, as
  an intact, ordered prefix). `JsonlEventHandler` hands each batch to the operating system but does not
  `fsync`, so power loss can also lose what the OS had not written yet; a line torn by a crash
  is skipped by `read_jsonl` with a warning. (A full disk is not a crash: the bundled sinks
  keep what they could not write, within a bound, write it when space returns, leave no torn
  TensorBoard record and one torn JSON line at most, and count what they lose; see
  [Sinks](sinks.md).)
- **`os._exit()` called by user code, SIGTERM with Python's default handler,** and any other
  exit that skips `atexit`: what was not yet delivered is lost. (A `Run` started in the main
  thread of the main process installs a SIGTERM handler that delivers it first, within
  `exit_timeout`, unless a handler of yours is installed: see
  [SIGTERM](integrations.md#sigterm).) Call `monitor_bus.flush()`
  (or `bus.close()`) before such an exit. (The exits of `multiprocessing` and `DataLoader`
  workers are covered, see above.) In a child process that reports to its parent, such an
  exit (`Pool.terminate()`, leaving a `with Pool()` block, SIGKILL) loses only the open `Stat`
  windows and an event being written at that instant (the parent warns of the torn message).
- **An `async def` handler that blocks the event loop** (a blocking call such as `time.sleep`
  or a synchronous network write inside `async def`). Async handlers share the dispatcher's
  loop, so while one blocks it, no event is distributed to *any* handler and no `Stat` window
  is closed by the timer. Make such a handler a plain function (it then gets its own thread)
  or use `await anyio.to_thread.run_sync(...)`. What is still promised then: the caller never
  blocks (the queue fills and further events are dropped and counted) and the timeouts of
  `flush`/`close`/exit hold.
- **A sync handler that never returns** keeps its (daemon) thread forever; once its backlog is
  full, further events for it are dropped and counted. Other handlers are unaffected.
- **Ordering across threads**: each handler sees the events of one producing thread in order;
  events of different threads are interleaved in queue order, not by timestamp.
- **Real-time deadlines.** Timer-closed `Stat` windows are logged shortly after their end, but
  on a loaded machine with many live Stats this can take tens of milliseconds or more (see the
  timers scenario for the measured lateness); the window's contents are exact regardless.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-run", action="store_true", help="render from the last run's results")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the page to write")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    if args.no_run:
        if not META.exists():
            print(f"error: no results at {META}; run without --no-run first", file=sys.stderr)
            return 2
        meta = json.loads(META.read_text())
    else:
        meta = run_suite(args.pytest_args)
    args.output.write_text(render(meta), encoding="utf-8")
    print(
        f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}"
    )
    return 0 if meta.get("exit_code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
