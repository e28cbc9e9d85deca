"""What StepAnatomy's GC timing costs per collection.

While a ``StepAnatomy`` is open, each collection runs its ``gc.callbacks`` callback twice
(start, stop: a clock read each, and a deque append), and the next step's end adds the pause
to its generation's Stat. Measured as rounds of ``--collections`` young-generation collections
(``gc.collect(0)``, the common kind and the cheapest, so the added cost shows most) ending with
one step, with the anatomy open and without (and with a gc callback that does nothing, the
floor), alternating; the difference of the medians per collection, against the package given
by ``PYTHONPATH``.

Run:  python benchmarks/step_anatomy_gc.py [--rounds 21] [--collections 2000]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import cpu_model, positive  # noqa: E402

from monitor_bus import EventBus  # noqa: E402
from monitor_bus.integrations.torch import StepAnatomy  # noqa: E402


def round_ns(collections: int, anatomy: StepAnatomy | None) -> float:
    """ns per collection of one round: the collections, then a step (whose end adds the
    pauses to their Stats)."""
    t0 = time.perf_counter_ns()
    for _ in range(collections):
        gc.collect(0)
    if anatomy is not None:
        with anatomy.step():
            pass
    return (time.perf_counter_ns() - t0) / collections


def nothing(phase: str, info: dict[str, int]) -> None:
    """A gc callback that does nothing: the floor any callback costs."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive, default=21)
    parser.add_argument("--collections", type=positive, default=2000)
    args = parser.parse_args()
    bus = EventBus(name="bench")
    bus.register_event_handler(lambda e: None, name="noop")
    bare, noop, timed = [], [], []
    gc.disable()  # only the benchmark's collections
    for _ in range(args.rounds):
        bare.append(round_ns(args.collections, None))
        gc.callbacks.append(nothing)
        noop.append(round_ns(args.collections, None))
        gc.callbacks.remove(nothing)
        with StepAnatomy(window=timedelta(seconds=1), bus=bus) as anatomy:  # its callback: now
            timed.append(round_ns(args.collections, anatomy))
    gc.enable()
    bus.close(10)
    b, n, t = (statistics.median(ns) for ns in (bare, noop, timed))
    print(f"machine: {cpu_model()}, Python {platform.python_version()}")
    print(f"gc.collect(0), {args.collections} per round, median of {args.rounds} rounds:")
    print(f"  without StepAnatomy {b:8.0f} ns per collection")
    print(f"  a no-op gc callback {n:8.0f} ns per collection (CPython's cost of any callback)")
    print(f"  with StepAnatomy    {t:8.0f} ns per collection")
    print(f"  added               {t - b:8.0f} ns per collection")


if __name__ == "__main__":
    main()
