"""Two versions of monitor_bus side by side: the training loop's CPU per step with each.

    git worktree add --detach /tmp/before <commit>
    python benchmarks/compare_code.py /tmp/before .          # before, after
    python benchmarks/compare_code.py /tmp/before . --rounds 9 --save

Each run is a fresh interpreter that imports monitor_bus from one source tree: the numpy step
of ``training_loop.py`` (a two-layer MLP), K four-key events a step with ``bus.log`` and an add
to each of 3 Stats, the JSONL and TensorBoard sinks on the bus, ``flush()`` inside the measured
region. Its figure is process CPU per step as a ratio to the same step without logging,
measured in the same interpreter just before and after (their mean). The two trees alternate
within each round, in an order that flips from round to round; the figures are medians, and
"after / before" is the ratio of the medians. Only the public API is used, so any two commits
since ``log()`` exists compare.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import _results  # noqa: E402
from _machine import numpy_mlp_step  # noqa: E402


def child(steps: int, k: int) -> None:
    """One run, in a fresh interpreter whose ``PYTHONPATH`` is the tree measured."""
    import monitor_bus
    from monitor_bus.tensorboard import SummaryWriter

    step = numpy_mlp_step()

    def none() -> float:
        clock = time.perf_counter
        gc.collect()
        start = time.process_time()
        for _ in range(steps):
            t0 = clock()
            step()
            clock() - t0
        return (time.process_time() - start) / steps

    def logged(tmp: Path) -> float:
        bus = monitor_bus.EventBus(capacity=steps * k + 10_000)
        writer = SummaryWriter(tmp / "tb")
        jsonl = monitor_bus.JsonlEventHandler(tmp / "run.jsonl")
        bus.register_event_handler(jsonl, name="jsonl")
        bus.register_event_handler(monitor_bus.TensorboardEventHandler(writer), name="tb")
        aggs = [monitor_bus.Aggregation.MEAN, monitor_bus.Aggregation.MAX]
        window = timedelta(milliseconds=250)
        s_time, s_loss, s_norm = (
            monitor_bus.Stat(name, aggs, window, bus=bus) for name in ("step_time", "loss", "norm")
        )
        log, clock = bus.log, time.perf_counter
        gc.collect()
        start = time.process_time()
        for i in range(steps):
            t0 = clock()
            loss, norm = step()
            step_time = clock() - t0
            for j in range(k):
                log("train.step", step=i, j=j, loss=loss, grad_norm=norm)
            s_time.add(step_time)
            s_loss.add(loss)
            s_norm.add(norm)
        if not bus.flush(600):
            raise SystemExit("flush timed out")
        cpu = (time.process_time() - start) / steps
        delivered = bus.stats()["handlers"][0]["delivered"]
        bus.close()
        jsonl.close()
        writer.close()
        if delivered < steps * k:
            raise SystemExit(f"the JSONL sink got {delivered} of {steps * k} events")
        return cpu

    none()  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        before, cpu, after = none(), logged(Path(tmp)), none()
    print(cpu / ((before + after) / 2), monitor_bus.__file__)


def tree_commit(tree: Path) -> str:
    """The commit a source tree is checked out at ("unknown" outside a git checkout)."""
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", type=Path, help="source tree of the code before")
    parser.add_argument("after", type=Path, help="source tree of the code after")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 10, 100], help="events a step")
    _results.save_argument(parser, "compare_code")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.ks[0])
        return 0
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for label, tree in trees.items():
        if not (tree / "monitor_bus" / "__init__.py").is_file():
            parser.error(f"{label}: no monitor_bus package in {str(tree)!r}")
    ratios: dict[tuple[str, int], list[float]] = {(t, k): [] for t in trees for k in args.ks}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for k in args.ks:
            for label in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                tree = trees[label]
                out = subprocess.run(
                    [sys.executable, __file__, str(tree), str(tree), "--child"]
                    + ["--steps", str(args.steps), "--ks", str(k)],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": str(tree)},
                    check=False,
                )
                if out.returncode:
                    print(out.stderr, file=sys.stderr)
                    return 1
                ratio, where = out.stdout.split()
                if not where.startswith(str(tree)):
                    print(f"{label} imported monitor_bus from {where}", file=sys.stderr)
                    return 1
                ratios[(label, k)].append(float(ratio))
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    medians = {t: {str(k): statistics.median(ratios[(t, k)]) for k in args.ks} for t in trees}
    rows = []
    for k in args.ks:
        b, a = medians["before"][str(k)], medians["after"][str(k)]
        each = [", ".join(f"{x:.2f}" for x in ratios[(t, k)]) for t in trees]
        rows.append([str(k), f"{b:.3f}x", f"{a:.3f}x", f"{a / b:.3f}", *each])
    columns = ["events per step", "before", "after", "after / before"]
    columns += ["before, each round", "after, each round"]
    results = {
        "steps": args.steps,
        "rounds": args.rounds,
        "commits": {t: tree_commit(tree) for t, tree in trees.items()},
        "load": {"before": load, "after": os.getloadavg()[0]},
        "medians": medians,
        "after_over_before": {
            str(k): medians["after"][str(k)] / medians["before"][str(k)] for k in args.ks
        },
        "tables": {"ratios": _results.table(columns, rows, "rrrrll")},
    }
    print(_results.markdown(results["tables"]["ratios"]))
    if args.save is not None:
        _results.save("compare_code", results, packages=("numpy", "tensorboard"), path=args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
