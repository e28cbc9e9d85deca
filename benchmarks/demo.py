"""The demo's run as the pages show it: its printed summary and its plot, from one run.

    python benchmarks/demo.py --save     # benchmarks/results/demo.json, docs/img/demo-plot.png

Runs ``python -m monitor_bus demo`` (its defaults: 3000 steps, the run in ``runs/<date-time>``
of a temporary directory), then ``monitor-bus plot`` on its JSONL file. The results file holds
the demo's output as printed and the figures read from it (steps, epochs, seconds, held-out
accuracy, events, delivery latency); with ``--save`` the plot is written to
``docs/img/demo-plot.png`` (``--plot`` elsewhere), so the picture and the text are one run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _results

PLOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "demo-plot.png"

SUMMARY = re.compile(
    r"Trained (?P<steps>\d+) steps \((?P<epochs>\d+) epochs\) in (?P<seconds>[\d.]+) s; "
    r"held-out accuracy (?P<accuracy>[\d.]+)%\. (?P<events>\d+) events logged\."
)
LATENCY = re.compile(r"delivery latency\s+p50 (?P<p50>[\d.]+) ms, p99 (?P<p99>[\d.]+) ms")


def figures(output: str) -> dict[str, Any]:
    """The figures of the demo's printed summary.

    Raises:
        ValueError: ``output`` lacks the summary's first line or its latency line.
    """
    summary, latency = SUMMARY.search(output), LATENCY.search(output)
    if summary is None or latency is None:
        raise ValueError(f"output: not the demo's summary:\n{output}")
    return {
        "steps": int(summary["steps"]),
        "epochs": int(summary["epochs"]),
        "seconds": float(summary["seconds"]),
        "accuracy_percent": float(summary["accuracy"]),
        "events": int(summary["events"]),
        "latency_ms": {"p50": float(latency["p50"]), "p99": float(latency["p99"])},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="the demo's --steps (default: its own)")
    parser.add_argument("--plot", type=Path, help=f"write the plot here (with --save: {PLOT})")
    _results.save_argument(parser, "demo")
    args = parser.parse_args()
    plot = args.plot or (PLOT if args.save is not None else None)
    extra = ["--steps", str(args.steps)] if args.steps else []
    with tempfile.TemporaryDirectory(prefix="monitor_bus-demo-") as tmp:
        demo = subprocess.run(
            [sys.executable, "-m", "monitor_bus", "demo", *extra],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=True,
        )
        output = demo.stdout.rstrip("\n")
        print(output)
        (run,) = Path(tmp, "runs").iterdir()
        if plot is not None:
            subprocess.run(
                [sys.executable, "-m", "monitor_bus", "plot", str(run / "events.jsonl")]
                + ["-o", str(plot.resolve())],
                cwd=tmp,
                check=True,
            )
    results = {"output": output, **figures(output)}
    if plot is not None:
        root = PLOT.parents[2]
        shown = plot.resolve()
        results["plot"] = str(shown.relative_to(root) if shown.is_relative_to(root) else shown)
    if args.save is not None:
        _results.save(
            "demo", results, packages=("numpy", "tensorboard", "matplotlib"), path=args.save
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
