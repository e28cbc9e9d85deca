"""Code that runs in worker processes (importable by spawn and forkserver children)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import monitor_bus
from monitor_bus import Aggregation, Event, Stat


class FileSink:
    """A buffering sink: lines are kept in __call__ and written in flush(), one file per pid,
    so a forked copy of the sink writes to its own file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.lines: list[str] = []

    def __call__(self, event: Event) -> None:
        if event.name == monitor_bus.STAT_EVENT:
            self.lines.append("stat " + " ".join(f"{k}={v}" for k, v in event.data.items()))
        else:
            self.lines.append(f"{event.name} {event.data['i']}")

    def flush(self) -> None:
        lines, self.lines = self.lines, []
        with open(Path(self.directory) / f"{os.getpid()}.txt", "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))


def read_lines(directory: Path) -> dict[int, list[str]]:
    """Every line the FileSinks wrote under ``directory``, by pid."""
    return {int(p.stem): p.read_text().splitlines() for p in directory.glob("*.txt")}


def log_and_return(directory: str, n: int) -> None:
    """Register a sink, log n events and add n values to an hour-long Stat window, and return
    without flushing: delivery is left to the package's exit hooks."""
    monitor_bus.register_event_handler(FileSink(directory), name="file")
    stat = Stat("mp", [Aggregation.COUNT], timedelta(hours=1))
    now = datetime.now(timezone.utc)
    for i in range(n):
        monitor_bus.log_event(Event("mp", now, {"i": i}))
        stat.add(i)


class LoggingDataset:
    """A map-style dataset that logs an event for every item it loads."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        monitor_bus.log_event(Event("item", datetime.now(timezone.utc), {"i": i}))
        return i


class RegisterSink:
    """A DataLoader worker_init_fn that registers a FileSink in a spawned worker."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        monitor_bus.register_event_handler(FileSink(self.directory), name="file")
