"""What idle Stats cost the dispatcher's timer, and what a window's first add costs.

Two patterns, each against the package given by ``PYTHONPATH`` (compare two trees by running
this twice, alternating):

- idle: 10,000 Stats of 100 ms windows that get no sample, 100 more that get one sample per
  window; the dispatcher thread's CPU share over the run.
- first add: ``Stat.add`` when every add is the first of its window (one add per window,
  windows rolled by a stepped clock) against steady adds (many per window), ns per add.

Run:  python benchmarks/idle_stats.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from datetime import timedelta

import _results

import monitor_bus
from monitor_bus import Aggregation, EventBus, Stat, _stat


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of ``thread`` (Linux: /proc)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / 100.0


def idle(seconds: float) -> float:
    """The dispatcher's CPU share with 10,000 idle Stats and 100 busy ones."""
    bus = EventBus(name="idle")
    bus.register_event_handler(lambda e: None, name="noop")
    window = timedelta(milliseconds=100)
    idle_stats = [Stat(f"i{k}", [Aggregation.MEAN], window, bus=bus) for k in range(10_000)]
    busy = [Stat(f"b{k}", [Aggregation.MEAN], window, bus=bus) for k in range(100)]
    (dispatcher,) = [t for t in threading.enumerate() if t.name == "monitor_bus-idle"]
    cpu0, t0 = thread_cpu(dispatcher), time.monotonic()
    deadline = t0 + seconds
    while time.monotonic() < deadline:
        for stat in busy:
            stat.add(1.0)
        time.sleep(0.1)
    share = (thread_cpu(dispatcher) - cpu0) / (time.monotonic() - t0)
    bus.close(10)
    del idle_stats
    return share


def add_cost(first: bool, n: int = 200_000) -> float:
    """ns per Stat.add: each the first of its window (``first``), or steady adds."""
    bus = EventBus(name="adds")  # no handler: windows are logged nowhere
    stat = Stat("s", [Aggregation.MEAN, Aggregation.MAX], timedelta(seconds=1), bus=bus)
    now = [1_000_000.0]
    real = _stat._clock
    _stat._clock = lambda: now[0]  # a stepped clock: no sleeping
    try:
        add = stat.add
        t0 = time.perf_counter()
        if first:
            for _ in range(n):
                now[0] += 1.0  # a new window each time
                add(1.0)
        else:
            for _ in range(n):
                now[0] += 1e-9
                add(1.0)
        return (time.perf_counter() - t0) / n * 1e9
    finally:
        _stat._clock = real
        bus.close(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    _results.save_argument(parser, "idle_stats")
    args = parser.parse_args()
    shares, firsts, steadies = [], [], []
    for _ in range(args.rounds):
        shares.append(idle(args.seconds))
        firsts.append(add_cost(True))
        steadies.append(add_cost(False))
    results = {
        "seconds": args.seconds,
        "rounds": args.rounds,
        "dispatcher_percent": statistics.median(shares) * 100,
        "first_add_ns": statistics.median(firsts),
        "steady_add_ns": statistics.median(steadies),
    }
    print(f"monitor_bus from {monitor_bus.__file__}")
    print(f"dispatcher CPU, 10,000 idle + 100 busy Stats: {results['dispatcher_percent']:.1f}%")
    print(f"Stat.add, first of its window: {results['first_add_ns']:.0f} ns")
    print(f"Stat.add, steady: {results['steady_add_ns']:.0f} ns")
    if args.save is not None:
        _results.save("idle_stats", results, path=args.save)


if __name__ == "__main__":
    main()
