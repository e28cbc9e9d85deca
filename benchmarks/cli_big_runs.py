"""The command line on big runs: `monitor-bus summary` on a ~200 MB file, `plot` on 400 Stats.

    python benchmarks/cli_big_runs.py               # inputs made in a temporary directory
    python benchmarks/cli_big_runs.py --mb 50       # a smaller summary input

Each command runs as its own process; the table gives its wall time and peak resident memory
(the kernel's accounting of that process, ``os.wait4``). A child's peak starts from the size of
the process that forked it, so this script stays small (the inputs are made in a child) and the
first row, bare ``python -c pass``, shows that floor. Needs matplotlib for ``plot``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

T0 = datetime(2026, 3, 1, tzinfo=timezone.utc)


def big_run(path: Path, megabytes: int) -> None:
    """A Stat window of three aggregates and a plain event per millisecond, to ``megabytes``."""
    import monitor_bus
    from monitor_bus import STAT_EVENT, Event

    with monitor_bus.JsonlEventHandler(path) as handler:
        i = 0
        while True:
            ts = T0 + timedelta(milliseconds=i)
            handler(
                Event(
                    STAT_EVENT,
                    ts,
                    {
                        "step_time_ms.mean": 1.5 + i % 7,
                        "step_time_ms.min": 1.0,
                        "step_time_ms.max": 9.25 + i % 3,
                    },
                )
            )
            handler(Event("train.step", ts, {"loss": 1.0 / (i + 1), "step": i, "phase": "train"}))
            i += 1
            if i % 10_000 == 0:
                handler.flush()
                if path.stat().st_size > megabytes * 1_000_000:
                    return


def many_stats_run(path: Path, stats: int, windows: int) -> None:
    """``stats`` Stats of a mean and a max each, over ``windows`` one-second windows."""
    import monitor_bus
    from monitor_bus import STAT_EVENT, Event

    with monitor_bus.JsonlEventHandler(path) as handler:
        for w in range(windows):
            ts = T0 + timedelta(seconds=w)
            for s in range(stats):
                handler(
                    Event(
                        STAT_EVENT,
                        ts,
                        {f"stat{s:03d}.mean": float(w * s % 17), f"stat{s:03d}.max": float(w)},
                    )
                )


def measure(args: list[str]) -> tuple[float, float, int, str]:
    """Run ``python ARGS``: seconds, peak RSS in MB, exit status, first line of stdout."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    return seconds, usage.ru_maxrss / 1024, proc.returncode, out.splitlines()[0] if out else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="size of the summary input (MB)")
    parser.add_argument("--stats", type=int, default=400, help="Stats in the plot input")
    parser.add_argument("--make", metavar="DIR", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.make:
        big_run(Path(args.make) / "big.jsonl", args.mb)
        many_stats_run(Path(args.make) / "many.jsonl", args.stats, 100)
        return
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "big.jsonl"
        many = Path(tmp) / "many.jsonl"
        make = [__file__, "--make", tmp, "--mb", str(args.mb), "--stats", str(args.stats)]
        subprocess.run([sys.executable, *make], check=True)
        m = ["-m", "monitor_bus"]
        rows = [
            ("python -c pass (the floor)", ["-c", "pass"]),
            (f"summary, {big.stat().st_size / 1e6:.0f} MB", [*m, "summary", str(big)]),
            (
                f"plot, {args.stats} Stats (default panels)",
                [*m, "plot", str(many), "-o", str(Path(tmp) / "a.png")],
            ),
            (
                f"plot, {args.stats} Stats, --stat 'stat00*'",
                [*m, "plot", str(many), "-o", str(Path(tmp) / "b.png"), "--stat", "stat00*"],
            ),
        ]
        version = measure([*m, "--version"])[3]
        print(f"{version}, Python {sys.version.split()[0]}")
        print(f"{'command':<40}{'seconds':>9}{'peak MB':>9}  exit  first line of output")
        for label, command in rows:
            seconds, peak, status, first = measure(command)
            print(f"{label:<40}{seconds:>9.1f}{peak:>9.0f}  {status:>4}  {first.replace(tmp, '')}")


if __name__ == "__main__":
    main()
