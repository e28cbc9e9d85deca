"""The link between a ``ProcessHandler`` and its child: the messages, their framing, and
events as they cross.

The two ends speak over a ``multiprocessing`` Pipe (a Unix socket pair), each message one pickle
in ``Connection``'s framing, so the child reads with ``recv_bytes`` what the parent writes to
the socket itself (with a timeout: ``frame``), and the parent reads what the child sends with
``send_bytes`` without waiting (``read_frames``). Below ``_process_sink`` (the child's end) and
``_process_handler`` (the parent's), which both import it.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from typing import Any

from ._queue import SLOTS, RemoteData

# Messages: parent -> child (kind, seq, slots); child -> parent (kind, ...). FINAL: flush, and
# give up what the sink could not write (the bus lets go of the handler).
BATCH, FLUSH, CLOSE, FINAL = 0, 1, 2, 3
READY, FAILED, ACK = 10, 11, 12
CHUNK = 1024  # events per message at most: bounds the size of one pickle
PROTOCOL = pickle.HIGHEST_PROTOCOL

# Events travel as the bus queues them: three slots each (name, timestamp, data; see _queue),
# the data a plain dict, or a RemoteData carrying the event's origin. The bus hands its batches
# over as they are (``_handler.handler_calls``): no Event is built or copied for the pickle,
# which copies anyway. Pickling, per event: 0.59 µs for the slots, 0.66 µs for tuples, 1.96 µs
# for Events (benchmarks/process_sink.py); building the Events and tuples beforehand cost
# about 0.4 µs more (timeit, 1,024 four-key events).


def wire(slots: list[Any]) -> list[Any]:
    """``slots`` with every data that is not a plain dict (a Stat window, an event from a
    child process) as a plain dict or a ``RemoteData`` with its origin."""
    if set(map(type, slots[2::SLOTS])) <= {dict}:
        return slots
    slots = slots.copy()
    for i in range(2, len(slots), SLOTS):
        data = slots[i]
        if data.__class__ is not dict:
            slots[i] = tagged(data, data.origin)
    return slots


def tagged(data: dict[str, Any], origin: Any) -> dict[str, Any]:
    if origin is None:
        return dict(data)
    tagged = RemoteData(data)
    tagged.origin = origin
    return tagged


def frame(message: tuple[Any, ...]) -> bytes:
    """``message`` pickled, with ``Connection``'s header: what ``recv_bytes`` reads."""
    payload = pickle.dumps(message, PROTOCOL)
    n = len(payload)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return header + payload


def read_frames(buf: bytearray) -> Iterator[tuple[Any, ...]]:
    """Each whole message at the start of ``buf`` (bytes as ``send_bytes`` framed them), taken
    out of it; a partial one stays for the next read."""
    while len(buf) >= 4:
        (n,) = struct.unpack_from("!i", buf)
        start = 4
        if n == -1:
            if len(buf) < 12:
                return
            (n,) = struct.unpack_from("!Q", buf, 4)
            start = 12
        if len(buf) < start + n:
            return
        message = pickle.loads(bytes(buf[start : start + n]))
        del buf[: start + n]
        yield message


def wait_ready(objects: list[Any], timeout: float | None) -> list[Any]:
    """``multiprocessing.connection.wait``, imported at its first use, not with monitor_bus."""
    from multiprocessing.connection import wait

    return wait(objects, timeout)
