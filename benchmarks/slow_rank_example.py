"""The run "Find the slow rank" in docs/multihost.md shows: examples/slow_rank_ddp.py under
torchrun, its printed output and its plot, from one run.

    python benchmarks/slow_rank_example.py --save
        # benchmarks/results/slow_rank_example.json, docs/img/slow-rank-anatomy.png

Runs three gloo ranks on this machine (torch and matplotlib needed); rank 0 prints the
straggler events, ``monitor-bus summary`` (its stragglers and breakdown) and ``monitor-bus
plot --anatomy``. The results file holds that output as printed (the run's directory shown as
``runs/slow_rank_ddp``) and the figures read from the run's JSONL file: the straggler event
and its recovery, the time the job lost waiting for a rank (as ``summary`` folds it), and what
the ``monitor_bus.anatomy`` events cost the file. With ``--save`` the plot is copied to
``docs/img/slow-rank-anatomy.png`` (``--plot`` elsewhere), so the picture and the text are one
run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _results

from monitor_bus import read_jsonl
from monitor_bus._cli_anatomy import Anatomy
from monitor_bus._cli_read import _StatSkips
from monitor_bus.ranks import ANATOMY_EVENT, STRAGGLER_EVENT

ROOT = Path(__file__).resolve().parents[1]
PLOT = ROOT / "docs" / "img" / "slow-rank-anatomy.png"
SHOWN = "runs/slow_rank_ddp"  # the run's directory as the page shows it


def run_example(out: Path) -> str:
    """Run the example under torchrun (3 ranks) writing to ``out``; what rank 0 printed."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            torchrun,
            "--nproc_per_node=3",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            str(ROOT / "examples" / "slow_rank_ddp.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,
        check=True,
    )
    return proc.stdout


def figures(run: Path) -> dict[str, Any]:
    """The figures of the run's JSONL file ``run``: the straggler event and its recovery, the
    time lost waiting for a rank as ``monitor-bus summary`` folds it, and the anatomy events'
    share of the file.

    Raises:
        ValueError: the run named no straggler, or has no StepAnatomy family.
    """
    events = list(read_jsonl(run))
    named: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.name == STRAGGLER_EVENT:
            d = event.data
            named.setdefault(
                "recovered" if d["recovered"] else "straggler",
                {
                    "rank": d["rank"],
                    "host": d["host"],
                    "stage": d["stage"],
                    "exposed_ms": d["exposed_s"] * 1e3,
                    "windows": d["windows"],
                },
            )
    anatomy, skips = Anatomy(), _StatSkips()
    for event in events:
        anatomy.add(event, skips)
    if "straggler" not in named or len(anatomy.families) != 1:
        raise ValueError(f"{run}: no straggler named, or not one StepAnatomy family")
    (family,) = anatomy.families.values()
    lost = sum(seconds for seconds, _ in family.lost.values())
    lines = run.read_bytes().splitlines(keepends=True)
    theirs = [len(line) for line in lines if json.loads(line)["name"] == ANATOMY_EVENT]
    total = sum(map(len, lines))
    return {
        **named,
        "ranks": len(family.ranks),
        "stages": len(family.stages),
        "lost": {
            "s": lost,
            "share_of_step_time": lost / family.step_s,
            "windows": family.windows,
        },
        "jsonl": {
            "events": len(events),
            "bytes": total,
            "anatomy_events": len(theirs),
            "anatomy_bytes_each": sum(theirs) / len(theirs),
            "anatomy_share": sum(theirs) / total,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, help=f"copy the plot here (with --save: {PLOT})")
    _results.save_argument(parser, "slow_rank_example")
    args = parser.parse_args()
    plot = args.plot or (PLOT if args.save is not None else None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "slow_rank_ddp"  # the plot's title: slow_rank_ddp/rank0.jsonl
        out.mkdir()
        output = run_example(out).replace(str(out), SHOWN).rstrip("\n")
        print(output)
        results = {"output": output, **figures(out / "rank0.jsonl")}
        if plot is not None:
            shutil.copyfile(out / "anatomy.png", plot)
            shown = plot.resolve()
            results["plot"] = str(shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown)
    if args.save is not None:
        _results.save(
            "slow_rank_example",
            results,
            packages=("torch", "matplotlib"),
            path=args.save,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
