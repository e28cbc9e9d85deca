"""What ``StepAnatomy`` costs, as the CPU of every thread of the process (the training
thread's share beside it), and as a fraction of a 10 ms step:

- the loop: a step of four stages (data, forward, backward, optimizer), each burning a
  quarter of ``--step-ms`` of the training thread's CPU, inside ``anatomy.step()`` and
  ``anatomy.stage()``, against the same loop bare;
- GC: a young-generation collection (``gc.collect(0)``, the common kind and the cheapest, so
  the added cost shows most) while an anatomy is open, against none open and against a gc
  callback that does nothing (CPython's cost of any callback); a step ends each round, adding
  the pauses to their Stats;
- the DDP comm hook: forward and backward of a DDP model (``--layers`` linear layers, in a
  process group of one gloo rank, ``bucket_cap_mb`` small so each layer is a bucket) timed by
  ``StepAnatomy(model)``, against the same model with DDP's default (C++) all-reduce in an
  anatomy without a model; the difference per bucket. torch's own Python ``allreduce_hook``
  is measured beside them: any Python comm hook costs a call into Python per bucket.

The contenders alternate in every round (each round starts with the next); the figures are
the medians of the rounds. A handler is registered, so the Stats' windows are delivered (the
dispatcher's CPU counts).

The figures and the page's table go to benchmarks/results/step_anatomy.json, which the page
quotes; ``--render`` makes the table again from that file's figures, measuring nothing and
keeping the run's commit, date and command.

Run:  python benchmarks/step_anatomy.py [--rounds 11] [--steps 2000] [--collections 2000]
      [--ddp-steps 200]
      python benchmarks/step_anatomy.py --render
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _results
from _machine import positive

from monitor_bus import EventBus
from monitor_bus.integrations.torch import StepAnatomy

STAGES = ("data", "forward", "backward", "optimizer")
STEP_10_MS = 10e6  # ns: the step the costs are a fraction of

Measure = Callable[[], tuple[float, float]]  # () -> (process CPU ns, caller's ns) per unit


def cpu(run: Callable[[], None], units: int) -> tuple[float, float]:
    """CPU ns per unit of ``run()``: of every thread of the process, and of this thread."""
    process, caller = time.process_time_ns(), time.thread_time_ns()
    run()
    return (time.process_time_ns() - process) / units, (time.thread_time_ns() - caller) / units


def rounds_of(contenders: dict[str, Measure], rounds: int) -> dict[str, dict[str, float]]:
    """Each contender's median (process, caller) CPU per unit over ``rounds`` rounds, the
    contenders alternating (each round starts with the next)."""
    names = list(contenders)
    taken: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for turn in range(rounds):
        for i in range(len(names)):
            name = names[(turn + i) % len(names)]
            gc.collect()
            taken[name].append(contenders[name]())
    return {
        name: {
            "process_ns": statistics.median(p for p, _ in values),
            "caller_ns": statistics.median(c for _, c in values),
        }
        for name, values in taken.items()
    }


# -- the loop ---------------------------------------------------------------------------------


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU: the same work whoever else runs."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def loop(bus: EventBus, rounds: int, steps: int, step_s: float) -> dict[str, dict[str, float]]:
    quarter = step_s / len(STAGES)

    def bare() -> None:
        for _ in range(steps):
            for _name in STAGES:
                burn(quarter)

    anatomy = StepAnatomy(window=timedelta(seconds=1), bus=bus, prefix="loop")

    def timed() -> None:
        step, stage = anatomy.step, anatomy.stage
        for _ in range(steps):
            with step():
                for name in STAGES:
                    with stage(name):
                        burn(quarter)

    try:
        return rounds_of(
            {"bare": lambda: cpu(bare, steps), "anatomy": lambda: cpu(timed, steps)}, rounds
        )
    finally:
        anatomy.close()


# -- GC -----------------------------------------------------------------------------------------


def collections_of(count: int, anatomy: StepAnatomy | None) -> None:
    for _ in range(count):
        gc.collect(0)
    if anatomy is not None:
        with anatomy.step():  # its end adds the pauses to their Stats
            pass


def nothing(phase: str, info: dict[str, int]) -> None:
    """A gc callback that does nothing: the floor any callback costs."""


def collections(bus: EventBus, rounds: int, count: int) -> dict[str, dict[str, float]]:
    def bare() -> tuple[float, float]:
        return cpu(lambda: collections_of(count, None), count)

    def noop() -> tuple[float, float]:
        gc.callbacks.append(nothing)
        try:
            return cpu(lambda: collections_of(count, None), count)
        finally:
            gc.callbacks.remove(nothing)

    def timed() -> tuple[float, float]:
        with StepAnatomy(window=timedelta(seconds=1), bus=bus, prefix="gc") as anatomy:
            return cpu(lambda: collections_of(count, anatomy), count)

    gc.disable()  # only the benchmark's collections
    try:
        return rounds_of({"bare": bare, "noop_callback": noop, "anatomy": timed}, rounds)
    finally:
        gc.enable()


# -- the DDP comm hook --------------------------------------------------------------------------


def ddp(bus: EventBus, rounds: int, steps: int, layers: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="step_anatomy-") as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            return ddp_figures(bus, rounds, steps, layers)
        finally:
            dist.destroy_process_group()


def ddp_figures(bus: EventBus, rounds: int, steps: int, layers: int) -> dict[str, dict[str, float]]:
    """The DDP contenders' figures, in the process group ``ddp`` made."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(layers)))
    x = torch.randn(32, 64)
    # A bucket per layer: its weight and bias (16,640 bytes) fill a 0.01 MB bucket.
    plain = DistributedDataParallel(net, bucket_cap_mb=0.01)
    hooked, python_hook = (
        DistributedDataParallel(
            torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(layers))),
            bucket_cap_mb=0.01,
        )
        for _ in range(2)
    )
    python_hook.register_comm_hook(None, allreduce_hook)
    plain_anatomy = StepAnatomy(window=timedelta(seconds=1), bus=bus, prefix="plain")
    hooked_anatomy = StepAnatomy(hooked, window=timedelta(seconds=1), bus=bus, prefix="ddp")

    def run(model: DistributedDataParallel, anatomy: StepAnatomy) -> Callable[[], None]:
        def steps_of() -> None:
            step, stage = anatomy.step, anatomy.stage
            for _ in range(steps):
                with step():
                    with stage("forward"):
                        loss = model(x).sum()
                    with stage("backward"):
                        loss.backward()

        return steps_of

    pairs = {
        "default_hook": (plain, plain_anatomy),
        "torch_allreduce_hook": (python_hook, plain_anatomy),
        "anatomy_hook": (hooked, hooked_anatomy),
    }
    for model, anatomy in pairs.values():
        for _ in range(3):  # DDP rebuilds its buckets after the first step
            run(model, anatomy)()
    buckets = hooked._get_ddp_logging_data()["num_buckets_reduced"]
    figures = rounds_of(
        {
            name: (lambda pair=pair: cpu(run(*pair), steps))  # type: ignore[misc]
            for name, pair in pairs.items()
        },
        rounds,
    )
    plain_anatomy.close()
    hooked_anatomy.close()
    return {**figures, "buckets_per_step": {"count": float(buckets)}}


# -- the report ---------------------------------------------------------------------------------


def added(figures: dict[str, dict[str, float]], ours: str, base: str) -> dict[str, float]:
    """What ``ours`` adds to ``base``, process and caller's CPU ns per unit."""
    return {kind: figures[ours][kind] - figures[base][kind] for kind in ("process_ns", "caller_ns")}


def percent_of_10ms(ns: float) -> str:
    return f"{ns / STEP_10_MS * 100:.3f}%"


def table(results: dict[str, Any]) -> dict[str, Any]:
    """The page's table, made from the measured ``results`` (a results file's): each measure's
    CPU without and with StepAnatomy, what it adds, and that as a fraction of a 10 ms step."""
    loop_fig, gc_fig, ddp_fig = results["loop"], results["gc"], results["ddp"]
    loop_added = added(loop_fig, "anatomy", "bare")
    gc_added = added(gc_fig, "anatomy", "bare")
    noop_added = added(gc_fig, "noop_callback", "bare")
    hook_added = added(ddp_fig, "anatomy_hook", "default_hook")
    buckets = ddp_fig["buckets_per_step"]["count"]
    per_bucket = {kind: value / buckets for kind, value in hook_added.items()}
    python_added = added(ddp_fig, "torch_allreduce_hook", "default_hook")
    python_per_bucket = {kind: value / buckets for kind, value in python_added.items()}

    def us(figure: dict[str, float]) -> str:
        return f"{figure['process_ns'] / 1e3:.2f} / {figure['caller_ns'] / 1e3:.2f}"

    def row(
        measure: str, unit: str, without: str, with_: str, more: dict[str, float], target: str
    ) -> list[str]:
        return [
            measure,
            unit,
            without,
            with_,
            us(more),
            percent_of_10ms(more["process_ns"]),
            target,
        ]

    step_ms = results["arguments"]["step_ms"]
    rows = [
        row(
            f"four stages around a {step_ms:g} ms step, against the bare loop",
            "step",
            us(loop_fig["bare"]),
            us(loop_fig["anatomy"]),
            loop_added,
            "<= 1%",
        ),
        row(
            "GC callback, `gc.collect(0)`, against no callback",
            "collection",
            us(gc_fig["bare"]),
            us(gc_fig["anatomy"]),
            gc_added,
            "report",
        ),
        row(
            "of which: a gc callback that does nothing",
            "collection",
            us(gc_fig["bare"]),
            us(gc_fig["noop_callback"]),
            noop_added,
            "report",
        ),
        row(
            f"DDP comm hook, {buckets:.0f} buckets a step, against DDP's default hook",
            "step",
            us(ddp_fig["default_hook"]),
            us(ddp_fig["anatomy_hook"]),
            hook_added,
            "report",
        ),
        row("DDP comm hook, per bucket", "bucket", "—", "—", per_bucket, "<= 1%"),
        row(
            "for comparison: torch's own Python `allreduce_hook`, per bucket",
            "bucket",
            "—",
            "—",
            python_per_bucket,
            "report",
        ),
    ]
    columns = [
        "measure",
        "unit",
        "without, process / caller's (µs)",
        "with StepAnatomy, process / caller's (µs)",
        "added, process / caller's (µs)",
        "added, of a 10 ms step",
        "target",
    ]
    return _results.table(columns, rows, "llrrrrl")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=positive, default=11)
    parser.add_argument("--steps", type=positive, default=2000, help="loop steps per round")
    parser.add_argument("--step-ms", type=float, default=1.0, help="the loop's step, in ms")
    parser.add_argument("--collections", type=positive, default=2000, help="per round")
    parser.add_argument("--ddp-steps", type=positive, default=200, help="DDP steps per round")
    parser.add_argument("--layers", type=positive, default=32, help="the DDP model's buckets")
    parser.add_argument(
        "--results", type=Path, help="the results file (default benchmarks/results/)"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: make the table again from the results file's figures",
    )
    args = parser.parse_args()
    if args.render:
        record = _results.load("step_anatomy", path=args.results)
        tables = {"tables": {"cost": table(record["results"])}}
        _results.amend("step_anatomy", tables, path=args.results)
    else:
        load_before = os.getloadavg()[0]
        bus = EventBus(name="step-anatomy-bench")
        bus.register_event_handler(lambda e: None, name="noop")
        try:
            results: dict[str, Any] = {
                "loop": loop(bus, args.rounds, args.steps, args.step_ms / 1e3),
                "gc": collections(bus, args.rounds, args.collections),
                "ddp": ddp(bus, args.rounds, args.ddp_steps, args.layers),
            }
        finally:
            bus.close(10)
        arguments = {k: v for k, v in vars(args).items() if k not in ("results", "render")}
        results |= {
            "arguments": arguments,
            "load": {"before": load_before, "after": os.getloadavg()[0]},
        }
        results["tables"] = {"cost": table(results)}
        _results.save("step_anatomy", results, packages=("torch",), path=args.results)
    saved = _results.load("step_anatomy", path=args.results)["results"]
    print(_results.markdown(saved["tables"]["cost"]))


if __name__ == "__main__":
    main()
