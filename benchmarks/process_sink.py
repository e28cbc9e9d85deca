"""What a sink costs this process, run in it or in a child process through ProcessHandler.

    python benchmarks/process_sink.py [--events 20000] [--rounds 5] [--save]

A bus with one JSONL sink takes ``--events`` four-key events, then ``flush()``; the figure is
this process's CPU (every thread: the logging loop, the dispatcher, the handler thread) per
event, from ``time.process_time()``. The child's CPU comes from its rusage once it is reaped
(start-up included: about 0.1 s of importing, spread over the round's events).
Contenders alternate within each round; figures are medians. Also: the cost of pickling a
batch as ``Event`` objects, as tuples, and as the queue's flat slots ProcessHandler sends.
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import _results

from monitor_bus import Event, EventBus, JsonlEventHandler, ProcessHandler

DATA = {"loss": 0.25, "lr": 1e-3, "step": 7, "phase": "train"}


class NullSink:
    """Writes each event's name only at close(): what the bus costs without a sink's work."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0

    def __call__(self, event: Event) -> None:
        self.count += 1

    def close(self) -> None:
        self.path.write_text("x\n" * self.count)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(sink: Callable[[Path], object], n: int, tmp: Path, fast: bool) -> dict[str, float]:
    """CPU and wall of this process per event, and the child's CPU per event (0: no child);
    ``fast``: logged with ``log()`` (a float timestamp) instead of ``log_event``."""
    path = tmp / f"{time.monotonic_ns()}.jsonl"
    handler = sink(path)
    child_before = children_cpu()
    bus = EventBus(name="bench", capacity=1 << 20)
    bus.register_event_handler(handler, name="jsonl")  # type: ignore[arg-type]
    stamps = timestamps(n)
    log_event, log = bus.log_event, bus.log
    cpu, wall = time.process_time(), time.perf_counter()
    if fast:
        for i in range(n):
            log("train.step", loss=0.25, lr=1e-3, step=i, phase="train")
    else:
        for i in range(n):
            log_event(Event("train.step", stamps[i], {**DATA, "step": i}))
    assert bus.flush(timeout=600)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert bus.stats()["handlers"][0]["delivered"] == n
    bus.close(timeout=60)
    handler.close(60) if isinstance(handler, ProcessHandler) else handler.close()  # type: ignore[attr-defined]
    with open(path, "rb") as f:
        assert sum(1 for _ in f) == n, "a sink lost events"
    os.unlink(path)
    return {
        "cpu_us": cpu / n * 1e6,
        "wall_us": wall / n * 1e6,
        "child_us": (children_cpu() - child_before) / n * 1e6,
    }


def timestamps(n: int) -> list[datetime]:
    """One timestamp per event, as ``datetime.now()`` per event gives (pickle shares none)."""
    now = datetime.now(timezone.utc)
    return [now + timedelta(microseconds=i) for i in range(n)]


PICKLED = {
    "event": "Event objects",
    "tuple": "(name, timestamp, data) tuples",
    "slots": "the queue's flat slots (what ProcessHandler sends), `datetime` timestamps",
    "slots_float": "the same slots with `time.time()` floats (what `log()` events travel as)",
    "orjson_float": "those slots as JSON with orjson, for comparison (not a wire format here)",
}


def pickling(n: int) -> dict[str, tuple[float, float, float]]:
    """µs per event to pickle and unpickle a batch, and bytes per event, for each of PICKLED."""
    stamps = timestamps(n)
    events = [Event("train.step", stamps[i], {**DATA, "step": i}) for i in range(n)]
    protocol = pickle.HIGHEST_PROTOCOL
    floats = [e.timestamp.timestamp() for e in events]
    builds: dict[str, Callable[[], object]] = {
        "event": lambda: events,
        "tuple": lambda: [(e.name, e.timestamp, e.data) for e in events],
        "slots": lambda: [slot for e in events for slot in (e.name, e.timestamp, e.data)],
        "slots_float": lambda: [
            slot for e, f in zip(events, floats, strict=True) for slot in (e.name, f, e.data)
        ],
    }
    codecs: dict[str, tuple[Callable[[object], bytes], Callable[[bytes], object]]] = {
        kind: (functools.partial(pickle.dumps, protocol=protocol), pickle.loads) for kind in builds
    }
    try:
        import orjson
    except ImportError:  # the comparison is optional
        pass
    else:
        builds["orjson_float"] = builds["slots_float"]
        codecs["orjson_float"] = (orjson.dumps, orjson.loads)

    def cost(kind: str) -> tuple[float, float, int]:
        batch = builds[kind]()  # built before the clock starts: the bus queues the slots as is
        dumps, loads = codecs[kind]
        start = time.perf_counter()
        payload = dumps(batch)
        dumped = time.perf_counter()
        loads(payload)
        return (dumped - start) / n * 1e6, (time.perf_counter() - dumped) / n * 1e6, len(payload)

    rounds: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in builds}
    for _ in range(5):
        for kind in builds:  # interleaved
            rounds[kind].append(cost(kind))
    return {
        kind: (
            statistics.median(r[0] for r in runs),
            statistics.median(r[1] for r in runs),
            runs[0][2] / n,
        )
        for kind, runs in rounds.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    _results.save_argument(parser, "process_sink")
    args = parser.parse_args()
    in_child = ProcessHandler
    # key: (label, sink, log() rather than log_event)
    contenders: dict[str, tuple[str, Callable[[Path], object], bool]] = {
        "null": ("a sink doing nothing (the bus's own cost)", NullSink, False),
        "jsonl": ("JsonlEventHandler in this process", JsonlEventHandler, False),
        "process": (
            "through ProcessHandler",
            lambda p: in_child(functools.partial(JsonlEventHandler, p)),
            False,
        ),
        "jsonl_log": ("JsonlEventHandler in this process, `log()`", JsonlEventHandler, True),
        "process_log": (
            "through ProcessHandler, `log()`",
            lambda p: in_child(functools.partial(JsonlEventHandler, p)),
            True,
        ),
    }
    runs: dict[str, list[dict[str, float]]] = {key: [] for key in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for key, (_, sink, fast) in contenders.items():
                runs[key].append(run(sink, args.events, Path(tmp), fast))
    sinks = {
        key: {m: statistics.median(r[m] for r in rounds) for m in ("cpu_us", "wall_us", "child_us")}
        for key, rounds in runs.items()
    }
    p = pickling(1024)
    results = {
        "events": args.events,
        "rounds": args.rounds,
        "sinks": sinks,
        # What the sink adds to this process's CPU per event, over a sink doing nothing.
        "added_cpu_us": {k: v["cpu_us"] - sinks["null"]["cpu_us"] for k, v in sinks.items()},
        "pickling": {
            kind: {"dumps_us": d, "loads_us": lo, "bytes": size}
            for kind, (d, lo, size) in p.items()
        },
        "tables": {
            "sinks": _results.table(
                ["sink", "this process CPU µs/event", "wall µs/event", "child CPU µs/event"],
                [
                    [label] + [f"{sinks[key][m]:.2f}" for m in ("cpu_us", "wall_us", "child_us")]
                    for key, (label, _, _) in contenders.items()
                ],
            ),
            "pickling": _results.table(
                ["a batch of 1024 encoded as", "dumps µs/event", "loads µs/event", "bytes/event"],
                [
                    [label, f"{p[kind][0]:.2f}", f"{p[kind][1]:.2f}", f"{p[kind][2]:.0f}"]
                    for kind, label in PICKLED.items()
                    if kind in p  # orjson's row only where it is installed
                ],
            ),
        },
    }
    print(f"{args.events} events per round, medians of {args.rounds} rounds\n")
    print(_results.markdown(results["tables"]["sinks"]) + "\n")
    print(_results.markdown(results["tables"]["pickling"]))
    if args.save is not None:
        _results.save("process_sink", results, packages=("orjson",), path=args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
