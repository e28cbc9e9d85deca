"""Sinks that tests/test_process_handler.py runs in a child process (importable there, light)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from monitor_bus import Event, JsonlEventHandler
from monitor_bus._handler import call_each

# Long enough never to be reached in a passing test; bounds a child left behind by a failing one.
NEVER = 60.0


class GatedSink:
    """Waits for ``gate`` (a multiprocessing Event) on each event before taking it."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate
        self.seen = 0

    def __call__(self, event: Event) -> None:
        self.gate.wait(NEVER)
        self.seen += 1


class StuckFlushSink:
    """Takes events at once; its flush() waits for ``gate``."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def __call__(self, event: Event) -> None:
        pass

    def flush(self) -> None:
        self.gate.wait(NEVER)


class FailingSink:
    """Writes events to a JSONL file, except those named "bad", on which it raises."""

    def __init__(self, path: str) -> None:
        self.inner = JsonlEventHandler(path)

    def __call__(self, event: Event) -> None:
        if event.name == "bad":
            raise ValueError(f"bad event {event.data['i']}")
        self.inner(event)

    def flush(self) -> None:
        self.inner.flush()


class FailingBatchSink(FailingSink):
    """FailingSink taking whole batches, as the built-in sinks do; it counts its batch calls
    in ``<path>.batches`` at each flush."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path
        self.batches = 0

    def handle_batch(self, events: list[Event]) -> None:
        self.batches += 1
        call_each(events, self)

    def flush(self) -> None:
        super().flush()
        Path(self.path + ".batches").write_text(str(self.batches))


class KeepTrain(JsonlEventHandler):
    """Keeps the "train.*" events only: a subclass that redefines ``__call__`` alone."""

    def __call__(self, event: Event) -> None:
        if event.name.startswith("train."):
            super().__call__(event)


class BatchOnly:
    """A batch handler without ``__call__``: appends each event's name to a text file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def handle_batch(self, events: list[Event]) -> None:
        with open(self.path, "a") as f:
            f.writelines(e.name + "\n" for e in events)


class AsyncBatch(BatchOnly):
    """A sync ``__call__`` and an async ``handle_batch``: the child can only use the first."""

    def __call__(self, event: Event) -> None:
        self.handle_batch_sync([event])

    def handle_batch_sync(self, events: list[Event]) -> None:
        super().handle_batch(events)

    async def handle_batch(self, events: list[Event]) -> None:  # type: ignore[override]
        self.handle_batch_sync(events)


class LineSink:
    """A picklable handler object: appends each event's name to a text file at flush()."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.names: list[str] = []

    def __call__(self, event: Event) -> None:
        self.names.append(event.name)

    def flush(self) -> None:
        with open(self.path, "a") as f:
            f.writelines(name + "\n" for name in self.names)
        self.names = []


def broken_factory() -> None:
    raise ValueError("no sink today")


class HoldSink:
    """Takes events at once until one named "hold": then sets ``reached`` and waits for
    ``gate`` (both multiprocessing Events), holding that event and every later one."""

    def __init__(self, reached: Any, gate: Any) -> None:
        self.reached = reached
        self.gate = gate

    def __call__(self, event: Event) -> None:
        if event.name == "hold":
            self.reached.set()
            self.gate.wait(NEVER)


class Stuck:
    """Never returns from a call (made with no arguments: its repr holds no address)."""

    def __call__(self, event: Event) -> None:
        time.sleep(NEVER)
