"""Code that runs in the child processes of tests/test_relay_security.py (importable by spawn)."""

from __future__ import annotations

from datetime import datetime, timezone

import monitor_bus
from monitor_bus import Event

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)
BIG = 16 << 20  # far more than a socket's buffer holds: its send stops halfway


def interrupted_send(interrupted: object, out: str) -> None:
    """Log one event too big for the socket (the parent reads part of it, then stops) until a
    Ctrl-C interrupts it, then three small ones; write ``dropped to_parent`` to ``out``."""
    bus = monitor_bus.EventBus(overflow="block", name="big")  # block_timeout None: for ever
    try:
        bus.log_event(Event("big", TS, {"blob": "x" * BIG}))
    except KeyboardInterrupt:
        interrupted.set()  # type: ignore[attr-defined]
    for i in range(3):
        bus.log_event(Event("after", TS, {"i": i}))
    stats = bus.stats()
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"{stats['dropped']} {stats['to_parent']}\n")


def log_then_start_a_grandchild(method: str, out: str) -> None:
    """Log one event, then start a child of this child that logs three; write its pid."""
    import multiprocessing

    from . import child_workers

    monitor_bus.log_event(Event("child", TS, {"i": 0}))
    grandchild = multiprocessing.get_context(method).Process(
        target=child_workers.log_events, args=("grandchild", 3)
    )
    grandchild.start()
    grandchild.join(60)
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"{grandchild.pid} {grandchild.exitcode}\n")
