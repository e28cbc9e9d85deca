"""Core benchmarks, side by side in one run: monitor_bus against torch.monitor and the standard
library's QueueHandler/QueueListener.

    python benchmarks/core.py                    # print the tables
    python benchmarks/core.py --save            # save benchmarks/results/core.json
    python benchmarks/core.py --only stat-add    # just the Stat.add table

Each figure is the median of several rounds; the contenders alternate within each round so
both see the same machine load. ``Stat.add`` is measured as the CPU time of every thread of
the process (the cost: work moved to another thread still takes the interpreter lock the
caller needs) with the caller's thread's share beside it. ``--save`` writes
the figures to ``benchmarks/results/core.json``. torch is
optional: without it, its columns say "n/a".
"""

from __future__ import annotations

import argparse
import gc
import logging
import logging.handlers
import queue
import random
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import _results

import monitor_bus
from monitor_bus import _vectorized

try:
    import torch
    import torch.monitor as torch_monitor
except ImportError:  # the comparison is optional
    torch = None
    torch_monitor = None

DATA = {"loss": 0.25, "step": 7}
TS = datetime(2026, 1, 1)


def per_call_ns(func: Callable[[int], None], n: int) -> float:
    gc.collect()
    start = time.perf_counter_ns()
    func(n)
    return (time.perf_counter_ns() - start) / n


# -- 1. Stat.add: the CPU of every thread per call, and the caller's thread's share --

# Step-time-like samples (a log-normal around 0.1 s), the same for every contender.
_rng = random.Random(22)
VALUES = [_rng.lognormvariate(-2.3, 0.4) for _ in range(1 << 16)]
DISTRIBUTIONS = [
    monitor_bus.Aggregation.MEAN,
    monitor_bus.Aggregation.P50,
    monitor_bus.Aggregation.P99,
    monitor_bus.Aggregation.STDDEV,
]


def stat_add_cpu(aggregations: list[monitor_bus.Aggregation], n: int) -> tuple[float, float]:
    """CPU ns per ``Stat.add`` of ``VALUES`` (cycled), a handler registered (the dispatcher
    runs, as in any real use): of every thread of the process (``time.process_time``) and of
    the caller's thread (``time.thread_time``). The window is logged at the end, inside the
    figures, so no bucketing is left out."""
    stat = monitor_bus.Stat("x", aggregations, timedelta(hours=1))
    add = stat.add
    values = (VALUES * (n // len(VALUES) + 1))[:n]
    gc.collect()
    process, caller = time.process_time_ns(), time.thread_time_ns()
    for v in values:
        add(v)
    stat._close()
    return (time.process_time_ns() - process) / n, (time.thread_time_ns() - caller) / n


def stat_add_cpu_torch(n: int) -> tuple[float, float]:
    """As ``stat_add_cpu`` for torch.monitor's ``[MEAN]`` (which runs inline)."""
    stat = torch_monitor.Stat("x", [torch_monitor.Aggregation.MEAN], timedelta(hours=1))
    add = stat.add
    values = (VALUES * (n // len(VALUES) + 1))[:n]
    gc.collect()
    process, caller = time.process_time_ns(), time.thread_time_ns()
    for v in values:
        add(v)
    return (time.process_time_ns() - process) / n, (time.thread_time_ns() - caller) / n


def stat_add_rows(r: dict[str, float], n: int, turn: int) -> None:
    """The Stat.add measures of one round, the contenders alternating (each round starts
    with the next one)."""

    def pure(n: int) -> tuple[float, float]:
        with _vectorized.pure_python():
            return stat_add_cpu(DISTRIBUTIONS, n)

    contenders: list[tuple[str, Callable[[int], tuple[float, float]]]] = [
        ("add_mean", lambda n: stat_add_cpu([monitor_bus.Aggregation.MEAN], n)),
        ("add_dist", lambda n: stat_add_cpu(DISTRIBUTIONS, n)),
        ("add_pure", pure),
    ]
    if torch_monitor is not None:
        contenders.append(("add_torch", stat_add_cpu_torch))
    handle = monitor_bus.register_event_handler(lambda e: None)
    for i in range(len(contenders)):
        key, measure = contenders[(turn + i) % len(contenders)]
        r[key], r[f"{key}_caller"] = measure(n)
    monitor_bus.unregister_event_handler(handle)


# -- 2. Event + log_event with one handler --


def log_ours(n: int) -> None:
    Event, log = monitor_bus.Event, monitor_bus.log_event
    for _ in range(n):
        log(Event("e", TS, DATA))
    monitor_bus.flush()


def log_torch(n: int) -> None:
    Event, log = torch_monitor.Event, torch_monitor.log_event
    for _ in range(n):
        log(Event("e", TS, DATA))


# -- 2b. the caller's own cost: log(name, **data) against Event(name, now, data) + log_event --


def _call(name: str, /, **data: object) -> None:
    """A call with ``log``'s signature that does nothing: the interpreter's part of its cost."""


def caller_ns(kind: str, n: int) -> float:
    """CPU ns per call on the caller's thread alone (``time.thread_time``), one no-op handler
    registered; the bus lingers its longest and never fills half way (which ends a linger), so
    its thread rarely runs meanwhile. ``kind``: ``"log"``, ``"event"`` (``Event(name,
    datetime.now(), data)`` + ``log_event``), or the parts of ``log``'s cost: ``"call"`` (a
    call with the same arguments that does nothing) and ``"append"`` (that call, then the
    timestamp and the append to a deque that keeps the events, as the queue does)."""
    with monitor_bus.EventBus(capacity=2 * n + 2, linger=1.0) as bus:
        bus.register_event_handler(lambda e: None)
        slots: deque[object] = deque()
        extend, now = slots.extend, time.time

        def append(name: str, /, **data: object) -> None:
            extend((name, now(), data))

        gc.collect()
        start = time.thread_time_ns()
        if kind == "event":
            Event, log_event, now_dt = monitor_bus.Event, bus.log_event, datetime.now
            for _ in range(n):
                log_event(Event("e", now_dt(), {"loss": 0.25, "step": 7}))
        else:
            log = {"log": bus.log, "call": _call, "append": append}[kind]
            for _ in range(n):
                log("e", loss=0.25, step=7)
        spent = time.thread_time_ns() - start
        bus.flush()
    return spent / n


# -- 3. delivered events per second, one producer, one sync handler --


def throughput_ours(n: int, kind: str = "event") -> float:
    """Delivered events/s: ``kind`` ``"event"`` logs ``Event(name, TS, data)`` (one fixed
    timestamp), ``"event_now"`` ``Event(name, datetime.now(), data)``, ``"log"`` ``log()``."""
    with monitor_bus.EventBus(capacity=n + 1) as bus:
        done = threading.Event()
        count = 0

        def handler(event: monitor_bus.Event) -> None:
            nonlocal count
            count += 1
            if count == n:
                done.set()

        bus.register_event_handler(handler)
        Event, log_event, log, now = monitor_bus.Event, bus.log_event, bus.log, datetime.now
        start = time.perf_counter()
        if kind == "log":
            for _ in range(n):
                log("e", loss=0.25, step=7)
        elif kind == "event_now":
            for _ in range(n):
                log_event(Event("e", now(), DATA))
        else:
            for _ in range(n):
                log_event(Event("e", TS, DATA))
        done.wait()
        return n / (time.perf_counter() - start)


def throughput_queue_listener(n: int) -> float:
    done = threading.Event()
    count = 0

    class Counting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            nonlocal count
            count += 1
            if count == n:
                done.set()

    q: queue.Queue[logging.LogRecord] = queue.Queue(n + 1)
    logger = logging.getLogger("bench.queue")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    qh = logging.handlers.QueueHandler(q)
    logger.addHandler(qh)
    listener = logging.handlers.QueueListener(q, Counting())
    listener.start()
    try:
        start = time.perf_counter()
        info = logger.info
        for _ in range(n):
            info("e loss=%s step=%s", 0.25, 7)
        done.wait()
        return n / (time.perf_counter() - start)
    finally:
        listener.stop()
        logger.removeHandler(qh)


# -- 4. the caller's p99 with a slow extra handler --


def p99_log_event_us(n: int, slow: bool) -> float:
    with monitor_bus.EventBus(capacity=n + 1) as bus:
        bus.register_event_handler(lambda e: None)
        release = threading.Event()
        if slow:
            bus.register_event_handler(lambda e: release.wait(0.010))
        Event, log = monitor_bus.Event, bus.log_event
        clock = time.perf_counter_ns
        lat = []
        for i in range(n):
            event = Event("e", TS, DATA)
            t0 = clock()
            log(event)
            lat.append(clock() - t0)
            if i % 64 == 0:
                time.sleep(0.0001)  # a training loop does other work between events
        release.set()
        bus.close(0)  # the slow handler's backlog is not what is measured here
    lat.sort()
    return lat[int(len(lat) * 0.99)] / 1000


def median_of(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds if key in r)


def run(rounds: int, scale: float, only: str) -> dict[str, float]:
    n_add = int(1_000_000 * scale)
    n_log = int(200_000 * scale)
    n_tp = int(200_000 * scale)
    n_lat = int(20_000 * scale)
    results: list[dict[str, float]] = []
    _vectorized.import_numpy()  # imported before any round: its import is not a Stat.add's cost
    for turn in range(rounds):
        r: dict[str, float] = {}
        stat_add_rows(r, n_add, turn)
        if only == "stat-add":
            results.append(r)
            continue
        handle = monitor_bus.register_event_handler(lambda e: None)
        r["log_ours"] = per_call_ns(log_ours, n_log)
        monitor_bus.unregister_event_handler(handle)
        if torch_monitor is not None:
            th = torch_monitor.register_event_handler(lambda e: None)
            r["log_torch"] = per_call_ns(log_torch, n_log)
            torch_monitor.unregister_event_handler(th)
        for kind in ("log", "event", "call", "append"):  # interleaved with each other
            r[f"caller_{kind}"] = caller_ns(kind, n_log)
        r["tp_ours"] = throughput_ours(n_tp)
        r["tp_log"] = throughput_ours(n_tp, "log")
        r["tp_now"] = throughput_ours(n_tp, "event_now")
        r["tp_queue"] = throughput_queue_listener(n_tp)
        r["p99_base"] = p99_log_event_us(n_lat, slow=False)
        r["p99_slow"] = p99_log_event_us(n_lat, slow=True)
        results.append(r)
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {k: median_of(results, k) for k in results[0]}


# Each row: what is measured, monitor_bus's median, the other's, who the other is, the
# format of both, the target, and the name its ratio is saved under.
ROWS = [
    (
        "`Event(...)` + `log_event`, one handler, ns/call",
        "log_ours",
        "log_torch",
        "torch.monitor",
        ".0f",
        "<= 0.5",
        "log_event",
    ),
    (
        "`log(name, **data)`, caller's thread CPU, ns/call",
        "caller_log",
        "caller_event",
        "`Event(name, datetime.now(), data)` + `log_event`",
        ".0f",
        "<= 0.33",
        "caller_log",
    ),
    (
        "of which: a call with `log`'s arguments that does nothing, ns/call",
        "caller_call",
        "caller_event",
        "`Event(name, datetime.now(), data)` + `log_event`",
        ".0f",
        "report",
        "caller_call",
    ),
    (
        "of which: that call, `time.time()` and a deque append, ns/call",
        "caller_append",
        "caller_event",
        "`Event(name, datetime.now(), data)` + `log_event`",
        ".0f",
        "report",
        "caller_append",
    ),
    (
        "delivered events/s, one producer, one sync handler, `log()`",
        "tp_log",
        "tp_ours",
        "`Event(...)` + `log_event`",
        ",.0f",
        ">= 1.5",
        "tp_log",
    ),
    (
        "delivered events/s, one producer, one sync handler, `log()`",
        "tp_log",
        "tp_now",
        "`Event(name, datetime.now(), data)` + `log_event`",
        ",.0f",
        "report",
        "tp_log_now",
    ),
    (
        "delivered events/s, one producer, one sync handler",
        "tp_ours",
        "tp_queue",
        "QueueHandler + QueueListener",
        ",.0f",
        ">= 10",
        "tp_queue",
    ),
    (
        "caller's p99 `log_event`, us, with a 10 ms/event handler vs without",
        "p99_slow",
        "p99_base",
        "monitor_bus without the slow handler",
        ".2f",
        "<= 2.0",
        "p99_slow",
    ),
]


def ratios(m: dict[str, float]) -> dict[str, float]:
    """Each row's ratio, monitor_bus's median over the other's (rows without both left out)."""
    return {name: m[a] / m[b] for _, a, b, _, _, _, name in ROWS if a in m and b in m}


def table(m: dict[str, float]) -> dict[str, Any]:
    """The results table (``_results.table``): a row per measure with both medians."""
    r = ratios(m)
    rows = [
        [label, format(m[a], fmt), format(m[b], fmt), who, f"{r[name]:.2f}", target]
        for label, a, b, who, fmt, target, name in ROWS
        if name in r
    ]
    columns = ["measure", "monitor_bus", "other", "other is", "ratio", "target"]
    return _results.table(columns, rows, "lrrlrl")


STAT_ADD_ROWS = [
    # (what, its key, the other, the other's key, target)
    ("`[MEAN]`", "add_mean", "torch.monitor `[MEAN]`", "add_torch", "<= 1.0"),
    ("`[MEAN, P50, P99, STDDEV]`", "add_dist", "monitor_bus `[MEAN]`", "add_mean", "<= 1.5"),
    (
        "`[MEAN, P50, P99, STDDEV]` without numpy",
        "add_pure",
        "monitor_bus `[MEAN]`",
        "add_mean",
        "report",
    ),
    ("`[MEAN, P50, P99, STDDEV]`", "add_dist", "torch.monitor `[MEAN]`", "add_torch", "report"),
]


def stat_add_ratios(m: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each Stat.add row's ratios (process CPU, caller's thread CPU), by its keys."""
    return {
        f"{ours}/{other}": {
            "process": m[ours] / m[other],
            "caller": m[f"{ours}_caller"] / m[f"{other}_caller"],
        }
        for _, ours, _, other, _ in STAT_ADD_ROWS
        if ours in m and other in m
    }


def stat_add_table(m: dict[str, float]) -> dict[str, Any]:
    """``Stat.add``'s costs (``_results.table``): the process's CPU (every thread) beside the
    caller's thread's."""
    ratios = stat_add_ratios(m)
    rows = []
    for what, ours, other_is, other, target in STAT_ADD_ROWS:
        if f"{ours}/{other}" not in ratios:
            continue  # torch.monitor is not installed
        ratio = ratios[f"{ours}/{other}"]
        rows.append(
            [
                what,
                f"{m[ours]:.0f}",
                f"{m[f'{ours}_caller']:.0f}",
                other_is,
                f"{m[other]:.0f}",
                f"{m[f'{other}_caller']:.0f}",
                f"{ratio['process']:.2f}",
                f"{ratio['caller']:.2f}",
                target,
            ]
        )
    columns = [
        "Stat",
        "process CPU",
        "caller's thread",
        "other",
        "other's process CPU",
        "other's caller's thread",
        "ratio, process CPU",
        "ratio, caller's thread",
        "target",
    ]
    return _results.table(columns, rows, "lrrlrrrrl")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds to take the median of (default 5)"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every iteration count")
    parser.add_argument(
        "--only", choices=["all", "stat-add"], default="all", help="run only these rows"
    )
    parser.add_argument(
        "--save",
        type=Path,
        nargs="?",
        const=None,
        default=False,
        help="save the results file (default benchmarks/results/core.json; core_stat_add.json"
        " with --only stat-add)",
    )
    args = parser.parse_args()
    medians = run(args.rounds, args.scale, args.only)
    tables = {"stat_add": stat_add_table(medians)}
    if args.only == "all":
        tables["results"] = table(medians)
    results = {
        "rounds": args.rounds,
        "scale": args.scale,
        "samples": len(VALUES),
        "medians": medians,
        "ratios": ratios(medians),
        "stat_add_ratios": stat_add_ratios(medians),
        "tables": tables,
    }
    print(f"Median of {args.rounds} rounds; contenders alternate within each round.")
    for spec in tables.values():
        print(f"\n{_results.markdown(spec)}")
    if args.save is not False:
        name = "core" if args.only == "all" else "core_stat_add"
        saved = _results.save(name, results, packages=("torch", "numpy"), path=args.save)
        print(f"\n{_results.measured(_results.load(name, path=saved))}")


if __name__ == "__main__":
    main()
