"""Rerun examples/slow_rank_ddp.py under torchrun and put what it printed on the page and its
plot in docs/img: the "Find the slow rank" section of docs/multihost.md quotes that run.

Runs three gloo ranks on this machine (torch and matplotlib needed), writes the example's
output between the page's ``slow-rank-example`` markers and its ``anatomy.png`` to
``docs/img/slow-rank-anatomy.png``.
Usage: python docs/slow_rank_example.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import publish  # noqa: E402


def main() -> int:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "slow_rank_ddp")  # the plot's title: slow_rank_ddp/rank0.jsonl
        os.mkdir(out)
        proc = subprocess.run(
            [
                torchrun,
                "--nproc_per_node=3",
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=localhost:0",
                str(ROOT / "examples" / "slow_rank_ddp.py"),
                out,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=out,
            check=True,
        )
        size = anatomy_bytes(Path(out) / "rank0.jsonl")
        shutil.copyfile(Path(out) / "anatomy.png", ROOT / "docs" / "img" / "slow-rank-anatomy.png")
    printed = proc.stdout.replace(out, "runs/slow_rank_ddp").rstrip().splitlines()
    publish(
        ["```text", *printed, "```", "", size], ROOT / "docs" / "multihost.md", "slow-rank-example"
    )
    return 0


def anatomy_bytes(run: Path) -> str:
    """What the breakdown cost the run's JSONL file: its anatomy events' bytes, a sentence."""
    lines = run.read_bytes().splitlines(keepends=True)
    anatomy = [line for line in lines if json.loads(line)["name"] == "monitor_bus.anatomy"]
    total, theirs = sum(map(len, lines)), sum(map(len, anatomy))
    return (
        f"In that file, the {len(anatomy)} `monitor_bus.anatomy` events (3 ranks, 4 stages) take "
        f"{theirs / len(anatomy):,.0f} bytes each, {theirs / total:.0%} of its {total:,} bytes."
    )


if __name__ == "__main__":
    sys.exit(main())
