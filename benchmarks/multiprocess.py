"""DataLoader workers reporting to the parent: what logging from every item costs the loader,
and whether anything is lost on the way.

    python benchmarks/multiprocess.py                  # fork, 100,000 items, 3 rounds
    python benchmarks/multiprocess.py --spawn          # spawn as well
    python benchmarks/multiprocess.py --items 2000 --rounds 1

A torch DataLoader (CPU, 4 workers, batches of 64) over a map-style dataset whose
``__getitem__`` does a few numpy operations on a small array, then, with logging on, logs one
event (4 keys) with ``monitor_bus.log_event`` and adds to a Stat of 1 s windows (made lazily
in each worker process). Contenders, alternating within each round:

- no logging: the same dataset with logging off;
- monitor_bus: ``JsonlEventHandler`` and ``TensorboardEventHandler`` (``monitor_bus.tensorboard``
  writer) registered in the parent, which the workers' events and windows reach through the
  relay.

Items/s is the epochs' loop, worker start-up included; "drain" is the ``flush()`` after the
last batch. Losses are checked on the files: every item's event in the JSONL file exactly
once per epoch, the parent's ``stats()`` counting no drop, the windows' COUNT in both the
JSONL and TensorBoard files equal to the items loaded. Parent CPU is read per thread from
``/proc/self/task/<tid>/stat`` (user + system) for the bus's threads and the TensorBoard
writer's, over the loop and the drain, as a share of that wall time (a thread's whole core
is 100 %). The workers' CPU per item comes from the rusage of the workers the loader joined at
the epoch's end (start-up included, which dominates with spawn). Figures are medians over the
rounds; exits 1 if anything was lost. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import _results
from _machine import positive

import monitor_bus

STAT_NAME = "item"
COUNT_KEY = f"{STAT_NAME}.count"
_stats: dict[int, monitor_bus.Stat] = {}  # per worker process: made on its first item


def item_stat() -> monitor_bus.Stat:
    """This process's Stat of 1 s windows (a forked worker must not use its parent's)."""
    stat = _stats.get(os.getpid())
    if stat is None:
        stat = _stats[os.getpid()] = monitor_bus.Stat(
            STAT_NAME,
            [monitor_bus.Aggregation.COUNT, monitor_bus.Aggregation.MEAN],
            timedelta(seconds=1),
        )
    return stat


class Items:
    """A map-style dataset of small arrays; with ``log`` each item logs an event and a Stat add."""

    def __init__(self, n: int, log: bool) -> None:
        self.n = n
        self.log = log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        x = np.sin(np.arange(32, dtype=np.float32) * np.float32(1 + i % 97))
        x = (x - x.mean()) / (x.std() + 1e-6)
        norm = float(np.linalg.norm(x))
        if self.log:
            data = {"i": i, "norm": norm, "max": float(x.max()), "label": i % 10}
            monitor_bus.log_event(monitor_bus.Event("item", datetime.now(timezone.utc), data))
            item_stat().add(norm)
        return x


# -- the parent's threads --

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each live thread of this process: native id -> (name, s)."""
    out = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None:
            continue
        try:
            text = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = text.rsplit(")", 1)[1].split()  # after "(comm)", field 3 is fields[0]
        out[tid] = (thread.name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def role(name: str, writer_threads: set[str]) -> str | None:
    """Which row of the table a parent thread's CPU goes to."""
    if name == "monitor_bus.relay":
        return "relay"
    if name.startswith("monitor_bus-handler-") or name in writer_threads:
        return "sinks"
    if name.startswith("monitor_bus-"):
        return "dispatcher"
    return None


def workers_cpu() -> float:
    """CPU seconds of this process's ended children: the loader joins its workers at each
    epoch's end (not persistent), so a loop's difference is its workers' CPU, start-up included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- one run of the loader --


def run_loader(args: argparse.Namespace, method: str, log: bool) -> dict[str, float]:
    """Load every item ``args.epochs`` times; with ``log``, through the bus to both sinks."""
    import torch.utils.data

    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
        Items(args.items, log),  # type: ignore[arg-type]  # map-style without subclassing
        batch_size=args.batch_size,
        num_workers=args.workers,
        multiprocessing_context=method,
        timeout=600,
    )
    if not log:
        gc.collect()
        workers_before = workers_cpu()
        start = time.perf_counter()
        loaded = sum(len(batch) for _ in range(args.epochs) for batch in loader)
        seconds = time.perf_counter() - start
        worker_us = (workers_cpu() - workers_before) / loaded * 1e6
        if loaded != args.items * args.epochs:
            raise RuntimeError(f"the loader gave {loaded} items, not {args.items * args.epochs}")
        return {"items_s": loaded / seconds, "worker_us": worker_us}
    with tempfile.TemporaryDirectory(prefix="monitor_bus-bench-") as tmp:
        return run_logged(args, loader, Path(tmp))


def run_logged(args: argparse.Namespace, loader: Any, tmp: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    from monitor_bus.tensorboard import SummaryWriter

    bus = monitor_bus.get_default_bus()
    jsonl = monitor_bus.JsonlEventHandler(tmp / "run.jsonl")
    before = {t.name for t in threading.enumerate()}
    writer = SummaryWriter(tmp / "tb")
    writer_threads = {t.name for t in threading.enumerate()} - before
    handles = [
        monitor_bus.register_event_handler(jsonl, name="jsonl"),
        monitor_bus.register_event_handler(
            monitor_bus.TensorboardEventHandler(writer), name="tensorboard"
        ),
    ]
    dropped_before = bus.stats()["dropped"]
    gc.collect()
    cpu_before = thread_cpu()
    workers_before = workers_cpu()
    start = time.perf_counter()
    loaded = sum(len(batch) for _ in range(args.epochs) for batch in loader)
    loop_end = time.perf_counter()
    worker_us = (workers_cpu() - workers_before) / loaded * 1e6
    flushed = monitor_bus.flush(120)
    end = time.perf_counter()
    cpu_after = thread_cpu()
    stats = bus.stats()
    for handle in handles:
        monitor_bus.unregister_event_handler(handle)
    jsonl.close()
    writer.close()

    expected = args.items * args.epochs
    if loaded != expected:
        raise RuntimeError(f"the loader gave {loaded} items, not {expected}")
    r: dict[str, float] = {
        "items_s": loaded / (loop_end - start),
        "worker_us": worker_us,
        "drain_ms": (end - loop_end) * 1000,
        "flushed": float(flushed),
        "dropped": stats["dropped"] - dropped_before,
        "handler_dropped": sum(
            h["dropped"] for h in stats["handlers"] if h["name"] in ("jsonl", "tensorboard")
        ),
    }
    wall = end - start
    for key in ("relay", "dispatcher", "sinks"):
        r[f"cpu_{key}"] = 0.0
    for tid, (name, seconds) in cpu_after.items():
        row = role(name, writer_threads)
        if row is not None:
            r[f"cpu_{row}"] += (seconds - cpu_before.get(tid, (name, 0.0))[1]) / wall * 100
    r["cpu_total"] = r["cpu_relay"] + r["cpu_dispatcher"] + r["cpu_sinks"]

    seen: Counter[int] = Counter()
    windows_count = 0
    with_worker = 0
    for event in monitor_bus.read_jsonl(tmp / "run.jsonl"):
        if event.name == "item":
            seen[int(event.data["i"])] += 1
            origin = event.origin
            with_worker += origin is not None and origin.worker in range(args.workers)
        elif event.name == monitor_bus.STAT_EVENT and COUNT_KEY in event.data:
            windows_count += int(event.data[COUNT_KEY])
    r["missing"] = sum(max(0, args.epochs - seen[i]) for i in range(args.items))
    r["duplicated"] = sum(max(0, n - args.epochs) for n in seen.values())
    r["with_worker"] = with_worker
    r["jsonl_count"] = windows_count
    acc = EventAccumulator(str(tmp / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    r["tb_count"] = sum(s.value for s in acc.Scalars(COUNT_KEY)) if COUNT_KEY in tags else 0
    return r


# -- rounds, table --


def run(args: argparse.Namespace, methods: list[str]) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for method in methods:
            plain = run_loader(args, method, log=False)
            logged = run_loader(args, method, log=True)
            logged["plain_items_s"] = plain["items_s"]
            logged["plain_worker_us"] = plain["worker_us"]
            logged["ratio"] = logged["items_s"] / plain["items_s"]
            results[method].append(logged)
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return results


def failures(args: argparse.Namespace, rounds: list[dict[str, float]]) -> list[str]:
    """What the rounds lost or got wrong, one sentence each (empty: nothing)."""
    expected = args.items * args.epochs * len(rounds)
    total = {k: sum(r[k] for r in rounds) for k in rounds[0]}
    problems = []
    if total["flushed"] != len(rounds):
        problems.append("flush() timed out")
    for key, what in [
        ("missing", "item events missing in the JSONL file"),
        ("duplicated", "item events duplicated in the JSONL file"),
        ("dropped", "events dropped by the parent's bus"),
        ("handler_dropped", "events dropped by a handler"),
    ]:
        if total[key]:
            problems.append(f"{total[key]:,.0f} {what}")
    for key, where in [("jsonl_count", "JSONL"), ("tb_count", "TensorBoard")]:
        if total[key] != expected:
            problems.append(
                f"Stat windows in {where} count {total[key]:,.0f} of {expected:,} items"
            )
    if total["with_worker"] != expected:
        problems.append(f"{expected - total['with_worker']:,.0f} item events without a worker id")
    return problems


def table(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    def median(rounds: list[dict[str, float]], key: str, fmt: str) -> str:
        return format(statistics.median(r[key] for r in rounds), fmt)

    def total(rounds: list[dict[str, float]], key: str) -> str:
        return f"{sum(r[key] for r in rounds):,.0f}"

    def of_items(rounds: list[dict[str, float]], key: str) -> str:
        return f"{total(rounds, key)} / {args.items * args.epochs * len(rounds):,}"

    rows: list[tuple[str, Any]] = [
        ("items/s, no logging", lambda r: median(r, "plain_items_s", ",.0f")),
        ("items/s, monitor_bus", lambda r: median(r, "items_s", ",.0f")),
        ("ratio monitor_bus / no logging", lambda r: median(r, "ratio", ".2f")),
        ("workers' CPU per item, us, no logging", lambda r: median(r, "plain_worker_us", ".1f")),
        ("workers' CPU per item, us, monitor_bus", lambda r: median(r, "worker_us", ".1f")),
        ("drain after the last batch, ms", lambda r: median(r, "drain_ms", ",.0f")),
        ("events lost: missing in JSONL", lambda r: total(r, "missing")),
        ("events duplicated in JSONL", lambda r: total(r, "duplicated")),
        (
            "parent's dropped / handlers' dropped",
            lambda r: f"{total(r, 'dropped')} / {total(r, 'handler_dropped')}",
        ),
        ("item events with their worker id", lambda r: of_items(r, "with_worker")),
        ("Stat windows' COUNT in JSONL / items", lambda r: of_items(r, "jsonl_count")),
        ("Stat windows' COUNT in TensorBoard / items", lambda r: of_items(r, "tb_count")),
        ("parent CPU, relay thread, % of wall", lambda r: median(r, "cpu_relay", ".1f")),
        ("parent CPU, dispatcher thread, % of wall", lambda r: median(r, "cpu_dispatcher", ".1f")),
        (
            "parent CPU, sink threads (JSONL, TensorBoard), % of wall",
            lambda r: median(r, "cpu_sinks", ".1f"),
        ),
        ("parent CPU, all of these, % of wall", lambda r: median(r, "cpu_total", ".1f")),
    ]
    methods = list(results)
    cells = [[label, *(cell(results[m]) for m in methods)] for label, cell in rows]
    return _results.table(["measure", *methods], cells)


def medians(results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each start method's median of every figure over the rounds."""
    return {
        method: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for method, rounds in results.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (default 3)")
    parser.add_argument("--items", type=positive, default=100_000, help="dataset size")
    parser.add_argument("--epochs", type=positive, default=1, help="epochs per run (default 1)")
    parser.add_argument("--workers", type=positive, default=4, help="DataLoader workers")
    parser.add_argument("--batch-size", type=positive, default=64, help="default 64")
    parser.add_argument("--spawn", action="store_true", help="measure spawn as well as fork")
    _results.save_argument(parser, "multiprocess")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("multiprocess.py: reads /proc per thread, so it runs on Linux only", file=sys.stderr)
        return 2
    try:
        import tensorboard  # type: ignore[import-untyped]  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        print(f"multiprocess.py needs torch and tensorboard: {exc}", file=sys.stderr)
        return 2
    # The machine's core count is in the header; torch's advice to use fewer workers is not news.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    load_before = os.getloadavg()
    methods = ["fork", "spawn"] if args.spawn else ["fork"]
    results = run(args, methods)
    load_after = os.getloadavg()
    saved = {
        "items": args.items,
        "epochs": args.epochs,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "load": {"before": load_before[0], "after": load_after[0]},
        "medians": medians(results),
        # What logging adds to a worker's CPU per item, µs (median with, minus median without).
        "worker_added_us": {
            m: f["worker_us"] - f["plain_worker_us"] for m, f in medians(results).items()
        },
        "tables": {"results": table(args, results)},
    }
    print(_results.markdown(saved["tables"]["results"]))
    if args.save is not None:
        packages = ("torch", "numpy", "tensorboard")
        _results.save("multiprocess", saved, packages=packages, path=args.save)
    problems = [f"{m}: {p}" for m in methods for p in failures(args, results[m])]
    for problem in problems:
        print(f"multiprocess.py: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
