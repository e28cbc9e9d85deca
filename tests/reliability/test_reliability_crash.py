"""Crashes the package cannot survive (SIGKILL, os._exit): what is on disk stays intact."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from monitor_bus import read_jsonl

from .conftest import ROOT, Figures

CHILD = textwrap.dedent(
    """
    import os, sys
    from datetime import datetime, timezone
    import monitor_bus
    from monitor_bus import Event

    mode, path = sys.argv[1], sys.argv[2]
    monitor_bus.register_event_handler(monitor_bus.JsonlEventHandler(path), name="jsonl")
    stamp = datetime.now(timezone.utc)
    for i in range(1000):
        monitor_bus.log_event(Event("crash", stamp, {"i": i}))
    assert monitor_bus.flush(timeout=30)
    if mode == "os._exit":
        for i in range(1000, 2000):
            monitor_bus.log_event(Event("crash", stamp, {"i": i}))
        os._exit(0)  # user code skipping atexit: what is not yet written is lost
    print("ready", flush=True)
    i = 1000
    while True:  # SIGKILL arrives somewhere in here
        monitor_bus.log_event(Event("crash", stamp, {"i": i, "pad": "x" * 64}))
        i += 1
    """
)


def _read(path: Path) -> tuple[list[int], int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = read_jsonl(path)
    return [int(e.data["i"]) for e in events], len(caught)


@pytest.mark.parametrize("mode", ["SIGKILL", "os._exit"])
def test_hard_exit_leaves_an_intact_prefix(mode: str, tmp_path: Path, figures: Figures) -> None:
    """After SIGKILL mid-logging, or os._exit without flush, the JSONL file holds an unbroken
    prefix of the events in order (everything flushed before is there; at most one torn line,
    skipped by read_jsonl); the rest is lost, as the guarantees page says."""
    figures.describe(
        load="1,000 events flushed, then logging flat out (SIGKILL) or 1,000 more (os._exit)",
        faults=f"{mode} of the process while events are queued and being written",
    )
    path = tmp_path / "events.jsonl"
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        try:
            if mode == "SIGKILL":
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], 30)
                assert ready, "child never got ready"
                assert proc.stdout.readline() == "ready\n"
                size = path.stat().st_size
                deadline = time.monotonic() + 10
                while path.stat().st_size <= size and time.monotonic() < deadline:
                    time.sleep(0.001)  # until the child is writing past the flushed part
                os.kill(proc.pid, signal.SIGKILL)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == (-signal.SIGKILL if mode == "SIGKILL" else 0)
    written, torn = _read(path)
    assert written == list(range(len(written)))  # in order, none twice, none corrupted
    assert len(written) >= 1000  # everything flushed before the crash
    assert torn <= 1
    figures.measure(
        flushed_before=1000,
        logged=2000 if mode == "os._exit" else "unknown (killed mid-loop)",
        intact_events_on_disk=len(written),
        torn_lines_skipped=torn,
        returncode=code,
    )
