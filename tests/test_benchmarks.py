"""The benchmark script runs (its figures live in docs/performance.md, not in assertions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_benchmark_runs_and_prints_every_measure() -> None:
    """benchmarks/core.py completes a tiny round and prints the four measures with their targets."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "core.py"), "--rounds", "1", "--scale", "0.01"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "target" not in line]
    assert [row.split(" | ")[-1].rstrip(" |") for row in rows] == [
        "<= 1.0",
        "<= 0.5",
        ">= 10",
        "<= 2.0",
    ]
