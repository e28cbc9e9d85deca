"""A ``ProcessHandler``'s child: it builds the sink, then feeds it what the parent sends.

Guarantees
----------
- The sink is called as a bus would call it (``_handler.handler_calls``), with sync calls only;
  every message is answered with an acknowledgement holding the running counts (events
  handled, calls that raised, events the sink lost) and each new error's first traceback.
- The child ignores SIGINT (a Ctrl-C reaches the whole process group:
  the parent decides when the sink stops) and exits, flushing its sink, when the parent dies.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._event import from_slots
from ._handler import handler_calls, is_async_callable
from ._process_link import ACK, BATCH, CLOSE, FAILED, FINAL, PROTOCOL, READY, wait_ready
from ._queue import count_events

if sys.version_info < (3, 11):  # anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from multiprocessing.connection import Connection


def serve(conn: Connection, target: Any, build: bool) -> None:
    """The child: build the sink, then handle what the parent sends until it says close."""
    import multiprocessing

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent decides

    def send(*message: Any) -> None:
        conn.send_bytes(pickle.dumps(message, PROTOCOL))

    try:
        sink = target() if build else target
        # Called as the bus would call it (see handler_calls).
        take_slots, batch = handler_calls(sink)
        if batch is not None and is_async_callable(batch):
            batch = None  # the child makes sync calls only: its __call__, if that is sync
        if batch is None and not callable(sink):
            raise TypeError(f"the factory returned {type(sink).__qualname__}, not a handler")
        if batch is None and is_async_callable(sink):
            raise TypeError(f"{sink!r} is async; ProcessHandler runs sync handlers")
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        send(FAILED, traceback.format_exc())
        return
    flush = getattr(sink, "flush", None)
    close = getattr(sink, "close", None)
    sink_lost = getattr(sink, "_monitor_bus_lost", None)  # what a bundled sink could not write
    parent = multiprocessing.parent_process()
    watch: list[Any] = [conn] if parent is None else [conn, parent.sentinel]
    handled = errors = lost = 0
    reports: dict[str, list[Any]] = {}

    def failed() -> None:
        """Count the exception being handled: each one of a group (see ``call_each``)."""
        nonlocal errors
        exc = sys.exc_info()[1]
        each = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        errors += len(each)
        for one in each:
            name = type(one).__qualname__
            report = reports.setdefault(name, [0, ""])
            if not report[1]:  # the first traceback of each type per message
                report[1] = "".join(traceback.format_exception(one))
            report[0] += 1

    def run(call: Callable[[Any], object], arg: Any) -> None:
        try:
            call(arg)
        except BaseException:  # noqa: BLE001 - counted and reported
            failed()

    def finish(kind: int) -> None:
        for end in (flush, close) if kind == CLOSE else (flush,):
            if callable(end):
                try:
                    end()
                except BaseException:  # noqa: BLE001 - counted and reported
                    failed()

    send(READY, os.getpid())
    try:
        while True:
            if conn not in wait_ready(watch, None):
                break  # the parent died
            try:
                kind, seq, slots = pickle.loads(conn.recv_bytes())
            except EOFError:
                break  # the parent closed its end
            if take_slots is not None:
                run(take_slots, slots)
            else:
                it = iter(slots)
                events = list(map(from_slots, it, it, it))
                if batch is not None:
                    run(batch, events)
                else:
                    for event in events:
                        run(sink, event)
            handled += count_events(len(slots))
            if kind != BATCH:
                finish(kind)
            if callable(sink_lost):
                try:
                    lost += sink_lost(kind in (CLOSE, FINAL))
                except BaseException:  # noqa: BLE001 - counted and reported
                    failed()
            send(ACK, seq, handled, errors, {k: tuple(v) for k, v in reports.items()}, lost)
            reports.clear()
            if kind == CLOSE:
                return
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    finish(CLOSE)  # what it has, it keeps
