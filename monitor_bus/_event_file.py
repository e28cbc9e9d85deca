"""One TensorBoard event file, written so that a failed write never spoils it.

Guarantees:

- The file is a sequence of TFRecords (length, its masked CRC32C, the serialized ``Event``,
  its masked CRC32C), byte for byte as ``tensorboard``'s ``RecordWriter`` makes them, the
  checksums in C when google-crc32c is installed.
- It only ever holds whole records: a write that fails part way (a full disk) is cut back to
  the last whole record with ``os.ftruncate``, since a torn record would make TensorBoard stop
  reading the file there. The records not written are kept, up to ``KEEP_RECORDS`` records and
  ``KEEP_BYTES`` bytes, and written at the next flush; a record added to a full bound that a
  write cannot empty is refused (``add`` raises ``OSError``) and counted in ``dropped``.
- Records reach the file at ``flush()``, when ``max_queue`` are waiting (in ``add``; a failure
  there keeps them and is raised by the next ``flush()``), and every ``flush_secs`` seconds
  from a timer thread of its ``SummaryWriter``. ``close()`` writes what it can; what it cannot
  is counted in ``dropped`` and raised.

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
        self._records: list[bytes] = []  # framed, not written yet: kept ones first
        self._bytes = 0  # their size
        self._size = 0  # bytes of whole records in the file
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
            records.append(framed)
            self._bytes += len(framed)
            if len(records) >= self._max_queue:
                with contextlib.suppress(OSError):  # kept; the next flush() retries and raises
                    self._write_locked()

    def _full(self, framed: bytes) -> bool:
        """Whether ``framed`` does not fit in the bound of records kept."""
        return len(self._records) >= KEEP_RECORDS or self._bytes + len(framed) > KEEP_BYTES

    def flush(self) -> None:
        """Write the waiting records.

        Raises:
            OSError: the write failed; the file is cut back to its last whole record and the
                records not written are kept for the next flush.
        """
        with self._lock:
            if self._fd >= 0:
                self._write_locked()

    def _write_locked(self) -> None:
        records = self._records
        if not records:
            return
        data = b"".join(records)
        sent = 0
        try:
            view = memoryview(data)
            while sent < len(data):
                sent += os.write(self._fd, view[sent:])
        except OSError:
            # Keep the file whole: back to the last whole record, the rest kept for later.
            done, whole = 0, 0
            for framed in records:
                if whole + len(framed) > sent:
                    break
                whole += len(framed)
                done += 1
            self._size += whole
            del records[:done]
            self._bytes -= whole
            os.ftruncate(self._fd, self._size)
            raise
        self._size += sent
        records.clear()
        self._bytes = 0

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
            except OSError:
                self.dropped += len(self._records)
                self._records.clear()
                self._bytes = 0
                raise
            finally:
                os.close(self._fd)
                self._fd = -1

    def _check_open(self) -> None:
        if self._fd < 0:
            raise RuntimeError(f"event file {self.path} is closed")
