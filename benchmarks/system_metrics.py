"""What ``monitor_bus.system.SystemMetrics`` costs: its thread's CPU at ``interval=1.0`` with
8 worker processes in the tree (issue 24's bound: at most 1% of one core).

The workers are idle child processes, as DataLoader workers waiting for their next batch; the
sampler reads each of them every second. Each sample's CPU is taken on the sampler's thread
(``time.thread_time``), so the figure is the sampler's alone, not the machine's noise; the
dispatcher's thread (which delivers the Stats' windows to a handler doing nothing) is shown
apart. ``--device cuda`` also samples this rank's GPUs through NVML (needs a GPU and
nvidia-ml-py; not run yet: the machines here have no GPU).

Run:  python benchmarks/system_metrics.py [--seconds 20] [--workers 8] [--device cuda]
      [--save]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

import _results
from _machine import positive
from idle_stats import thread_cpu

import monitor_bus
from monitor_bus.system import SystemMetrics


def measure(seconds: float, workers: int, interval: float, device: str) -> dict[str, object]:
    """Run the sampler for ``seconds`` with ``workers`` idle children; its costs."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        for _ in range(workers)
    ]
    bus = monitor_bus.EventBus(name="system-bench")
    bus.register_event_handler(lambda event: None, name="noop")
    costs: list[float] = []  # CPU seconds of each sample, on the sampler's thread
    try:
        metrics = SystemMetrics(
            interval,
            bus=bus,
            window=timedelta(seconds=10),
            gpus="auto" if device == "cuda" else None,
        )
        assert metrics._baseline.wait(60)  # the first sample reads every process: not timed
        sample = metrics.sample

        def timed_sample() -> None:
            began = time.thread_time()
            sample()
            costs.append(time.thread_time() - began)

        metrics.sample = timed_sample  # type: ignore[method-assign]  # the thread calls this
        (sampler,) = [t for t in threading.enumerate() if t.name == "monitor_bus-system"]
        (dispatcher,) = [t for t in threading.enumerate() if t.name == "monitor_bus-system-bench"]
        cpu0 = (thread_cpu(sampler), thread_cpu(dispatcher))
        began = time.monotonic()
        time.sleep(seconds)  # the sampler works meanwhile; this thread only waits
        wall = time.monotonic() - began
        cpu1 = (thread_cpu(sampler), thread_cpu(dispatcher))
        names = metrics.metrics
        metrics.close()
    finally:
        for child in children:
            child.stdin.close()  # type: ignore[union-attr]
            child.wait()
        bus.close(10)
    if device == "cuda" and not any(".gpu" in name for name in names):
        raise SystemExit("--device cuda: no GPU metric was sampled (no GPU, or no NVML)")
    return {
        "wall": wall,
        "samples": len(costs),
        "costs": costs,
        "sampler_ticks": cpu1[0] - cpu0[0],
        "dispatcher_ticks": cpu1[1] - cpu0[1],
        "metrics": names,
    }


def report(result: dict[str, object], workers: int, interval: float, device: str) -> dict:
    """The run's figures for its results file, with the table the page shows."""
    costs: list[float] = result["costs"]  # type: ignore[assignment]
    wall: float = result["wall"]  # type: ignore[assignment]
    metrics: list[str] = result["metrics"]  # type: ignore[assignment]
    figures = {
        "interval_s": interval,
        "workers": workers,
        "seconds": wall,
        "device": device,
        "gpus": sorted({name.split(".")[1] for name in metrics if ".gpu" in name}),
        "load": os.getloadavg()[0],
        "samples": result["samples"],
        "sample_ms": {"median": statistics.median(costs) * 1e3, "max": max(costs) * 1e3},
        "sampler_percent": sum(costs) / wall * 100,
        "sampler_percent_proc": result["sampler_ticks"] / wall * 100,  # type: ignore[operator]
        "dispatcher_percent": result["dispatcher_ticks"] / wall * 100,  # type: ignore[operator]
        "metrics": len(metrics),
    }
    rows = [
        ["samples taken", str(figures["samples"])],
        [
            "CPU per sample, median / max (ms)",
            f"{figures['sample_ms']['median']:.2f} / {figures['sample_ms']['max']:.2f}",
        ],
        ["sampler's thread, % of one core", f"{figures['sampler_percent']:.2f}"],
        [
            "sampler's thread, % of one core, from /proc (10 ms ticks)",
            f"{figures['sampler_percent_proc']:.2f}",
        ],
        [
            "dispatcher's thread, % of one core (delivers the windows)",
            f"{figures['dispatcher_percent']:.2f}",
        ],
        ["metrics sampled", str(figures["metrics"])],
    ]
    figures["tables"] = {"cost": _results.table(["measure", "result"], rows)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=positive, default=20, help="run length (default 20)")
    parser.add_argument("--workers", type=positive, default=8, help="worker processes (default 8)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    _results.save_argument(parser, "system_metrics")
    args = parser.parse_args()
    result = measure(args.seconds, args.workers, args.interval, args.device)
    results = report(result, args.workers, args.interval, args.device)
    print(_results.markdown(results["tables"]["cost"]))
    if args.save is not None:
        _results.save("system_metrics", results, path=args.save)


if __name__ == "__main__":
    main()
