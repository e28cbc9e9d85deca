"""One TensorBoard event file, written so that a failed or interrupted write never spoils it.

Guarantees:

- The file is a sequence of TFRecords (length, its masked CRC32C, the serialized ``Event``,
  its masked CRC32C), byte for byte as ``tensorboard``'s ``RecordWriter`` makes them, the
  checksums in C when google-crc32c is installed.
- It only ever holds whole records, each once: a write that fails part way (a full disk) or is
  interrupted (Ctrl-C) is cut back to the last whole record with ``os.ftruncate``, since a torn
  record would make TensorBoard stop reading the file there; the file's size tells which
  records it holds, so none is written again. The records not written are kept, up to
  ``KEEP_RECORDS`` records and ``KEEP_BYTES`` bytes, and written at the next flush; a record
  added to a full bound that a write cannot empty is refused (``add`` raises ``OSError``) and
  counted in ``dropped``.
- Records reach the file at ``flush()``, when ``max_queue`` are waiting (in ``add``; a failure
  there keeps them and is raised by the next ``flush()``), and every ``flush_secs`` seconds
  from a timer thread of its ``SummaryWriter``. ``close()`` writes what it can; what it cannot
  (a failed or interrupted write) is counted in ``dropped``, and the error raised.

Imported by ``monitor_bus.tensorboard`` only (it needs the ``tensorboard`` package).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections import deque

from tensorboard.compat.proto import event_pb2  # type: ignore[import-untyped]
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (  # type: ignore[import-untyped]
    masked_crc32c,
)

try:  # the optional extra "fast": CRC32C in C (tensorboard's own is pure Python, ~6 us/record)
    from google_crc32c import value as _crc32c
except ImportError:
    _crc32c = None

#: Records an event file keeps after a failed write, to write at its next flush; past this (or
#: ``KEEP_BYTES`` bytes in all) a new record is refused and counted as dropped.
KEEP_RECORDS = 65536
#: Bytes of records kept after a failed write, at most.
KEEP_BYTES = 16 * 2**20

_write = os.write  # a seam: the tests interrupt a write part way

_uid = itertools.count()  # tells apart the files one process opens in one second


def _masked_c(data: bytes) -> int:
    crc: int = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


_masked = masked_crc32c if _crc32c is None else _masked_c


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data))


class EventFile:
    """A new ``events.out.tfevents.*`` file in ``log_dir``, written as the module says.

    Thread-safe. Not usable in a forked child (its ``SummaryWriter`` refuses first).
    """

    def __init__(self, log_dir: str, max_queue: int, suffix: str) -> None:
        # The name tensorboard's EventFileWriter gives: the time, host, process and a counter.
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_uid)}"
        name = f"events.out.tfevents.{stamp}{suffix}"
        self.path = os.path.join(log_dir, name)
        self._max_queue = max_queue
        self._lock = threading.Lock()
        # Framed records not known to be in the file yet, each with the offset it ends at
        # there. With the file's size they say exactly what reached it, whatever cut a write
        # short: each step of ``_settle`` keeps that true, so an interrupt between two leaves
        # nothing to write twice.
        self._records: deque[tuple[int, bytes]] = deque()
        self._size = 0  # where the first of them starts: the end of the file's whole records
        #: Records lost: refused past the bound, or not written by ``close()``.
        self.dropped = 0
        # O_APPEND: after a cut back to the last whole record, the next write goes right there.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o666)
        try:
            version = event_pb2.Event(
                wall_time=time.time(),
                file_version="brain.Event:2",
                source_metadata=event_pb2.SourceMetadata(writer="monitor_bus.tensorboard"),
            )
            self.add(version.SerializeToString())
            self.flush()
        except BaseException:
            os.close(self._fd)
            raise

    def add(self, data: bytes) -> None:
        """Queue one serialized ``Event``; write the queue once ``max_queue`` are waiting.

        Raises:
            OSError: the record is refused: earlier writes failed and the records kept for
                another try fill the bound (it is counted in ``dropped``).
        """
        framed = record(data)
        with self._lock:
            self._check_open()
            records = self._records
            if self._full(framed):
                with contextlib.suppress(OSError):  # space may have come back meanwhile
                    self._write_locked()
            if self._full(framed):
                self.dropped += 1
                raise OSError(
                    f"{self.path}: {len(records)} records are waiting for a write that keeps "
                    f"failing (disk full?); a new one is dropped ({self.dropped} so far)"
                )
            records.append((self._tail() + len(framed), framed))
            if len(records) >= self._max_queue:
                with contextlib.suppress(OSError):  # kept; the next flush() retries and raises
                    self._write_locked()

    def _tail(self) -> int:
        """The offset the records waiting end at."""
        return self._records[-1][0] if self._records else self._size

    def _full(self, framed: bytes) -> bool:
        """Whether ``framed`` does not fit in the bound of records kept."""
        waiting = self._tail() - self._size
        return len(self._records) >= KEEP_RECORDS or waiting + len(framed) > KEEP_BYTES

    def flush(self) -> None:
        """Write the waiting records.

        Raises:
            OSError: the write failed; the file is cut back to its last whole record and the
                records not written are kept for the next flush.
        """
        with self._lock:
            if self._fd >= 0:
                self._write_locked()

    def _settle(self) -> None:
        """Let go of the records the file holds whole and cut off a torn one, going by the
        file's size: a write cut short by an error or an interrupt (Ctrl-C) wrote part of
        them, and only the file knows how much."""
        records = self._records
        size = os.fstat(self._fd).st_size
        while records and records[0][0] <= size:
            self._size = records[0][0]  # first: a repeat after an interrupt here is harmless
            records.popleft()
        if size > self._size:  # part of a record: TensorBoard would stop reading there
            os.ftruncate(self._fd, self._size)

    def _write_locked(self) -> None:
        self._settle()  # an interrupted write may have left the file ahead of the records
        if not self._records:
            return
        data = b"".join(framed for _, framed in self._records)
        try:
            view = memoryview(data)
            sent = 0
            while sent < len(data):
                sent += _write(self._fd, view[sent:])
        finally:
            # Whole records written are done with, the rest kept: after a failure (a full
            # disk) or an interrupt alike, none is written twice and the file stays whole.
            self._settle()

    def close(self) -> None:
        """Write what is waiting and close the file. Idempotent.

        Raises:
            OSError: the last write failed; what it did not write is counted in ``dropped``.
        """
        with self._lock:
            if self._fd < 0:
                return
            try:
                self._write_locked()
            finally:  # an error or an interrupt: what is left is lost, and counted
                self.dropped += len(self._records)
                self._records.clear()
                os.close(self._fd)
                self._fd = -1

    def _check_open(self) -> None:
        if self._fd < 0:
            raise RuntimeError(f"event file {self.path} is closed")
