"""The loggers benchmarks/peers.py compares, each run in a process of its own.

Each tool is set up the way its documentation shows, logs K scalars a training step and is
flushed and closed at the end; ``run`` times the loop and the close. peers.py starts this
script once per tool and round (a fresh interpreter, so no tool's threads or helper processes
tax another's); it runs the tool on each configuration, each right after the same loop without
logging, and prints one line of JSON per configuration.

    python benchmarks/_peers_tools.py TOOL '[[BATCH, STEPS, K, TOOL_FIRST], ...]' WORKDIR
"""

from __future__ import annotations

import os

# The step's matrices are small: BLAS worker threads only contend. Read when numpy loads.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import functools  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

Log = Callable[[int, list[float]], None]  # log(step, the step's scalars)


class Tool(NamedTuple):
    """What a tool gives the loop."""

    log: Log
    """Log one step's scalars (timed: the caller's cost)."""
    close: Callable[[], None]
    """Flush and close: what was logged is then where the tool keeps it (timed)."""
    settle: Callable[[], None] = lambda: None
    """After the warm-up step: wait until what it started lazily has started (not timed)."""


Setup = Callable[[Path, list[str]], Tool]

WINDOW = timedelta(milliseconds=250)  # Stat windows and OpenTelemetry's export interval
EXPORT_MS = 250


def _none(work: Path, names: list[str]) -> Tool:
    def log(step: int, values: list[float]) -> None:
        pass

    return Tool(log, lambda: None)


def tensorboard_sink(log_dir: str) -> Any:
    """The TensorBoard sink with monitor_bus's writer (a picklable factory, for a process)."""
    import monitor_bus
    from monitor_bus.tensorboard import SummaryWriter

    return monitor_bus.TensorboardEventHandler(SummaryWriter(log_dir))


def _on_bus(log: Callable[[Any], Log], sink: Any, *closables: Any) -> Tool:
    """A monitor_bus tool: ``sink`` on a bus of its own, ``log(bus)`` the loop's call."""
    import monitor_bus

    bus = monitor_bus.EventBus(name="peers")
    bus.register_event_handler(sink, name="sink")

    def close() -> None:
        if not bus.flush(600):
            raise RuntimeError("the bus did not flush in 600 s")
        stats = bus.stats()
        bus.close()
        for c in closables:
            c.close()
        lost = stats["handler_dropped"] + stats["handler_errors"] + stats["dropped"]
        if lost:
            raise RuntimeError(f"monitor_bus lost {lost} events: {stats}")

    return Tool(log(bus), close, lambda: bus.flush(600))


def _mb_stat(work: Path, names: list[str]) -> Tool:
    import monitor_bus
    from monitor_bus.tensorboard import SummaryWriter

    agg = monitor_bus.Aggregation
    aggs = [agg.MEAN, agg.MIN, agg.MAX, agg.COUNT]

    def log(bus: Any) -> Log:
        adds = [monitor_bus.Stat(n, aggs, WINDOW, bus=bus).add for n in names]

        def log(step: int, values: list[float]) -> None:
            for add, v in zip(adds, values, strict=True):
                add(v)

        return log

    writer = SummaryWriter(work / "tb")
    return _on_bus(log, monitor_bus.TensorboardEventHandler(writer), writer)


def _mb_log(names: list[str]) -> Callable[[Any], Log]:
    """The loop's call for ``log()``: one event of the step's scalars, at its step (the
    TensorBoard sink writes a ``METRICS_EVENT``'s numbers at its ``"step"``)."""
    import monitor_bus

    metrics = monitor_bus.METRICS_EVENT

    def bind(bus: Any) -> Log:
        blog = bus.log

        def log(step: int, values: list[float]) -> None:
            blog(metrics, step=step, **dict(zip(names, values, strict=True)))

        return log

    return bind


def _mb_log_jsonl(work: Path, names: list[str]) -> Tool:
    import monitor_bus

    sink = monitor_bus.JsonlEventHandler(work / "run.jsonl")
    return _on_bus(_mb_log(names), sink, sink)


def _mb_log_tensorboard(work: Path, names: list[str]) -> Tool:
    import monitor_bus
    from monitor_bus.tensorboard import SummaryWriter

    writer = SummaryWriter(work / "tb")
    return _on_bus(_mb_log(names), monitor_bus.TensorboardEventHandler(writer), writer)


def _mb_log_process(work: Path, names: list[str]) -> Tool:
    import monitor_bus

    sink = monitor_bus.ProcessHandler(functools.partial(tensorboard_sink, str(work / "tb")))
    return _on_bus(_mb_log(names), sink, sink)


def _torch_monitor(work: Path, names: list[str]) -> Tool:
    import torch.monitor as tm
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(work / "tb"))
    handle = tm.register_event_handler(tm.TensorboardEventHandler(writer))
    agg = tm.Aggregation
    aggs = [agg.MEAN, agg.MIN, agg.MAX, agg.COUNT]
    adds = [tm.Stat(n, aggs, WINDOW, 2**31).add for n in names]

    def log(step: int, values: list[float]) -> None:
        for add, v in zip(adds, values, strict=True):
            add(v)

    def close() -> None:
        tm.unregister_event_handler(handle)
        writer.close()

    return Tool(log, close, writer.flush)


def _writer(module: str) -> Setup:
    """A TensorBoard ``SummaryWriter`` (torch's or tensorboardX's) called per scalar."""

    def setup(work: Path, names: list[str]) -> Tool:
        writer = importlib.import_module(module).SummaryWriter(str(work / "tb"))
        add = writer.add_scalar

        def log(step: int, values: list[float]) -> None:
            for n, v in zip(names, values, strict=True):
                add(n, v, step)

        return Tool(log, writer.close, writer.flush)

    return setup


def _wandb(work: Path, names: list[str]) -> Tool:
    os.environ["WANDB_SILENT"] = "true"
    import wandb

    # The logged values only: no system metrics sampler, no console capture, no code or git.
    settings = wandb.Settings(
        x_disable_stats=True, console="off", disable_code=True, disable_git=True
    )
    run = wandb.init(mode="offline", dir=str(work), project="peers", settings=settings)
    wlog = run.log

    def log(step: int, values: list[float]) -> None:
        wlog(dict(zip(names, values, strict=True)), step=step)

    return Tool(log, run.finish)


def _mlflow(work: Path, names: list[str]) -> Tool:
    # MLflow 3 keeps its file store in maintenance mode (its default is now a SQLite
    # database): this opts in, as its error message says to.
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    import mlflow

    mlflow.set_tracking_uri((work / "mlruns").as_uri())
    mlflow.start_run()
    log_metrics = mlflow.log_metrics

    def log(step: int, values: list[float]) -> None:
        log_metrics(dict(zip(names, values, strict=True)), step=step, synchronous=False)

    def close() -> None:
        mlflow.flush_async_logging()  # the queued batches, written by MLflow's thread
        mlflow.end_run()

    return Tool(log, close, mlflow.flush_async_logging)


def _otel(kind: str) -> Setup:
    def setup(work: Path, names: list[str]) -> Tool:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )

        out = (work / "metrics.jsonl").open("w")
        exporter = ConsoleMetricExporter(
            out=out, formatter=lambda data: data.to_json(indent=None) + "\n"
        )
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=EXPORT_MS)
        provider = MeterProvider(metric_readers=[reader])
        meter = provider.get_meter("peers")
        if kind == "histogram":
            calls = [meter.create_histogram(n).record for n in names]
        else:
            calls = [meter.create_counter(n).add for n in names]

        def log(step: int, values: list[float]) -> None:
            for call, v in zip(calls, values, strict=True):
                call(v)

        def close() -> None:
            provider.shutdown()  # exports what the instruments hold, then stops the reader
            out.close()

        return Tool(log, close, provider.force_flush)

    return setup


def _prometheus(multiprocess: bool) -> Setup:
    def setup(work: Path, names: list[str]) -> Tool:
        if multiprocess:  # read when prometheus_client is imported
            (work / "prom").mkdir()
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(work / "prom")
        from prometheus_client import CollectorRegistry, Histogram, write_to_textfile

        registry = CollectorRegistry()
        observes = [Histogram(n, n, registry=registry).observe for n in names]

        def log(step: int, values: list[float]) -> None:
            for observe, v in zip(observes, values, strict=True):
                observe(v)

        def close() -> None:
            if not multiprocess:  # the node exporter's textfile collector's way to keep it
                write_to_textfile(str(work / "metrics.prom"), registry)

        return Tool(log, close)

    return setup


TOOLS: dict[str, Setup] = {
    "none": _none,  # the baseline: the same loop and brackets, logging nothing
    "mb_stat": _mb_stat,
    "mb_log_jsonl": _mb_log_jsonl,
    "mb_log_tensorboard": _mb_log_tensorboard,
    "mb_log_process": _mb_log_process,
    "torch_monitor": _torch_monitor,
    "torch_tensorboard": _writer("torch.utils.tensorboard"),
    "tensorboardx": _writer("tensorboardX"),
    "wandb": _wandb,
    "mlflow": _mlflow,
    "otel_histogram": _otel("histogram"),
    "otel_counter": _otel("counter"),
    "prometheus": _prometheus(False),
    "prometheus_multiprocess": _prometheus(True),
}


def tree_cpu() -> float:
    """CPU seconds of this process (every thread), its children that have ended, and every
    live descendant (a tool's helper processes) with the ended children they reaped."""
    import psutil

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + children.ru_utime + children.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:  # ended between the listing and the reading
            continue
        total += c.user + c.system + c.children_user + c.children_system
    return total


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(
    tool: str, step: Callable[[], tuple[float, float]], steps: int, k: int, work: Path
) -> dict[str, float]:
    """Set ``tool`` up in ``work``, run ``steps`` training steps logging ``k`` scalars each,
    and close it.

    Returns:
        cpu_s: process-tree CPU from the first step to the end of the close;
        loop_s, close_s: the training thread's wall time in the loop and in the close;
        caller_s: the training thread's CPU inside the logging calls (``time.thread_time``
        around them: the brackets' own cost is what the run without logging measures);
        setup_s: the tool's set-up and warm-up step, wall; bytes: what the run added on
        disk.
    """
    work.mkdir(parents=True, exist_ok=True)
    before = disk_bytes(work)
    names = [f"m{j:03d}" for j in range(k)]
    start = time.perf_counter()
    log, close, settle = TOOLS[tool](work, names)
    # One step logged before the measure, so what a tool starts lazily (a thread, a writer,
    # a sink process's imports) is set up, as it is in a loop past its first step.
    log(0, [step()[0]] * k)
    settle()
    setup_s = time.perf_counter() - start
    clock, thread_time = time.perf_counter, time.thread_time
    caller = 0.0
    gc.collect()
    cpu0, wall0 = tree_cpu(), clock()
    for i in range(1, steps + 1):
        loss, norm = step()
        values = [loss + norm * j for j in range(k)]
        c0 = thread_time()
        log(i, values)
        caller += thread_time() - c0
    wall1 = clock()
    close()
    wall2 = clock()
    cpu = tree_cpu() - cpu0
    return {
        "cpu_s": cpu,
        "loop_s": wall1 - wall0,
        "close_s": wall2 - wall1,
        "caller_s": caller,
        "setup_s": setup_s,
        "bytes": disk_bytes(work) - before,
    }


def main() -> None:
    """Run TOOL for each configuration (a JSON list of [batch, steps, k, tool_first]), each
    beside the same loop without logging, and print one line of JSON per configuration."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import numpy_mlp_step

    tool, configs, work = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    for n, (batch, steps, k, tool_first) in enumerate(configs):
        step = numpy_mlp_step(batch)
        for _ in range(10 if batch < 1000 else 3):
            step()
        # The baseline runs in this process next to the tool, so both see the same load; which
        # goes first alternates (peers.py chooses), so neither always pays for a cold start.
        got: dict[str, dict[str, float]] = {}
        for which in (tool, "none") if tool_first else ("none", tool):
            got[which] = run(which, step, steps, k, work / f"{n}-{which}")
            if which == "wandb":  # its service outlives finish(): end it, outside the measure
                import wandb

                wandb.teardown()
        line = {"batch": batch, "steps": steps, "k": k, "none": got["none"], "tool": got[tool]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
