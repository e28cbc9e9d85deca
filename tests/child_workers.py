"""Code that runs in child processes (importable by spawn and forkserver children)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

import monitor_bus
from monitor_bus import Aggregation, Event, Stat

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)

_adds: dict[int, Stat] = {}


def adds() -> Stat:
    """This process's Stat "adds", made on first use on the default bus of the time. Its window
    is an hour long, so it closes only when its process ends normally."""
    stat = _adds.get(os.getpid())
    if stat is None:
        stat = _adds[os.getpid()] = Stat("adds", [Aggregation.COUNT], timedelta(hours=1))
    return stat


def log_events(tag: str, n: int) -> int:
    """Log n events tagged ``tag`` (a Pool task): returns the pid that logged them."""
    for i in range(n):
        monitor_bus.log_event(Event("child", TS, {"tag": tag, "i": i}))
    return os.getpid()


def add_only(n: int) -> int:
    """Add 1 to the module-level Stat n times and log nothing else (a Pool task)."""
    stat = adds()
    for _ in range(n):
        stat.add(1)
    return os.getpid()


def log_then_wait(n: int, ready: object, sleep_forever: object) -> None:
    """Log n events and one Stat add, tell the parent, then wait to be killed."""
    log_events("killed", n)
    adds().add(1)
    ready.set()  # type: ignore[attr-defined]
    sleep_forever.wait()  # type: ignore[attr-defined]


class ItemDataset:
    """A map-style dataset that logs an event and adds to a Stat for every item it loads."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        monitor_bus.log_event(Event("item", TS, {"i": i}))
        adds().add(1)
        return i


def log_and_report(n: int, out: str) -> None:
    """Log n events as fast as possible, then write this bus's stats to ``out`` (a child whose
    parent is gone or not listening)."""
    bus = monitor_bus.get_default_bus()
    for i in range(n):
        monitor_bus.log_event(Event("orphan", TS, {"i": i}))
    stats = bus.stats()
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"{stats['dropped']} {stats['to_parent']}\n")


def add_and_wait(release: object) -> None:
    """Add one value to a Stat of 50 ms windows, then wait until the parent releases it."""
    stat = Stat("tick", [Aggregation.COUNT], timedelta(milliseconds=50))
    stat.add(1)
    release.wait(60)  # type: ignore[attr-defined]


def stamps() -> list[datetime]:
    """Timestamps of every kind a child may log: naive, UTC, another fixed offset, a zone,
    the repeated hour of a DST change (fold=1)."""
    from zoneinfo import ZoneInfo

    berlin = ZoneInfo("Europe/Berlin")
    return [
        datetime(2026, 3, 1, 12, 30, 5, 123456),
        datetime(2026, 3, 1, 12, 30, 5, tzinfo=timezone.utc),
        datetime(2026, 3, 1, 12, 30, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        datetime(2026, 7, 1, 9, 0, tzinfo=berlin),
        datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=berlin),
        datetime(2026, 10, 25, 2, 30, fold=1),
        datetime(1969, 12, 31, 23, 59, 59, 999999),
    ]


def log_stamps() -> None:
    for i, ts in enumerate(stamps()):
        monitor_bus.log_event(Event("stamp", ts, {"i": i}))


def log_on_a_bus_of_its_own(announced: object, go: object, out: str) -> None:
    """Log one event on a bus the parent has no bus of that name for, wait for ``go``, log 999
    more, then write how many were sent to the parent and whether the bus still forwards."""
    bus = monitor_bus.EventBus(name="the-child's-own")
    bus.log_event(Event("mine", TS, {"i": 0}))
    announced.set()  # type: ignore[attr-defined]
    go.wait(60)  # type: ignore[attr-defined]
    for i in range(1, 1000):
        bus.log_event(Event("mine", TS, {"i": i}))
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"{bus.stats()['to_parent']} {bus.stats()['dropped']} {bus._uplink is None}\n")


def events_and_a_window_from_forked_children(events: int, adds_: int) -> None:
    """Fork one child that logs ``events`` events tagged "j", then one that adds ``adds_``
    samples to its Stat "adds" (its window closes as it exits); both must exit with 0."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    for target, args in ((log_events, ("j", events)), (add_only, (adds_,))):
        proc = fork.Process(target=target, args=args)
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0


def add_distribution(values: list[float]) -> None:
    """Add ``values`` to a Stat of percentiles, stddev and histogram whose hour-long window
    closes as the process ends (its Histogram crosses the relay)."""
    stat = Stat(
        "dist",
        [Aggregation.P50, Aggregation.P99, Aggregation.STDDEV, Aggregation.HISTOGRAM],
        timedelta(hours=1),
    )
    for v in values:
        stat.add(v)


def log_fast(n: int) -> int:
    """Log n events with ``monitor_bus.log`` (a forked child: the parent's clock seam holds)."""
    for i in range(n):
        monitor_bus.log("fast", i=i, loss=0.5, tag="child")
    return os.getpid()


_named: dict[tuple[int, str], Stat] = {}


class AddsOnly:
    """A map-style dataset that only adds 1 to this process's Stat ``name`` (COUNT, an hour's
    window) for every item it loads: it logs no event, so its worker sends nothing before its
    window closes."""

    def __init__(self, n: int, name: str) -> None:
        self.n = n
        self.name = name

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        key = (os.getpid(), self.name)
        stat = _named.get(key)
        if stat is None:
            stat = _named[key] = Stat(self.name, [Aggregation.COUNT], timedelta(hours=1))
        stat.add(1)
        return i


class HoldsAStat:
    """A map-style dataset whose Stat "held" (COUNT, an hour's window) is made in its
    constructor, in the parent, and added to by every item it loads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.stat = Stat("held", [Aggregation.COUNT], timedelta(hours=1))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.stat.add(1)
        return i


_alive: list[object] = []


def workers_alive_at_exit(context: str, path: str, n: int, workers: int) -> None:
    """Register a JSONL sink at ``path``, run two epochs of a loader of persistent workers
    (Stat "persistent") and take every batch of a loader whose iterator is kept (Stat "kept",
    no StopIteration: its workers wait for more), then return: both loaders' workers are
    alive as this process exits. Each loader has ``workers`` workers. The bus's thread starts
    before torch (and multiprocessing) is first imported."""
    monitor_bus.register_event_handler(monitor_bus.JsonlEventHandler(path))
    monitor_bus.log("started")
    assert monitor_bus.flush(10)
    import torch.utils.data

    persistent = torch.utils.data.DataLoader(
        AddsOnly(n, "persistent"),
        batch_size=2,
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=True,
        timeout=60,
    )
    for _ in range(2):
        assert sum(len(batch) for batch in persistent) == n
    kept = torch.utils.data.DataLoader(
        AddsOnly(n, "kept"),
        batch_size=2,
        num_workers=workers,
        multiprocessing_context=context,
        timeout=60,
    )
    batches = iter(kept)
    assert sum(len(next(batches)) for _ in range(len(kept))) == n
    _alive.extend((persistent, kept, batches))


def close_with_workers_alive(path: str, n: int) -> None:
    """Register a JSONL sink at ``path``, run an epoch of persistent fork workers (Stat
    "persistent"), close the default bus, run another epoch and end the workers: the first
    epoch's windows reach the file, the second's are dropped in the workers, which say the
    parent closed its bus."""
    import torch.utils.data

    sink = monitor_bus.JsonlEventHandler(path)
    monitor_bus.register_event_handler(sink)
    loader = torch.utils.data.DataLoader(
        AddsOnly(n, "persistent"),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
        timeout=60,
    )
    assert sum(len(batch) for batch in loader) == n
    assert monitor_bus.get_default_bus().close(30)
    assert sum(len(batch) for batch in loader) == n
    del loader  # the workers end normally, their second windows with them


def add_then_wait(ready: object, release: object) -> None:
    """Add one value to a Stat "stopped" (COUNT, an hour's window), tell the parent, then
    wait until it releases this process."""
    stat = Stat("stopped", [Aggregation.COUNT], timedelta(hours=1))
    stat.add(1)
    ready.set()  # type: ignore[attr-defined]
    release.wait(60)  # type: ignore[attr-defined]
    del stat  # (kept until here: collected, it would log its window)
