"""A JSON-lines file as a sink: ``JsonlEventHandler`` writes each event as a line, in batches.

The line is ``_jsonl_encode``'s, its timestamp ``_jsonl_time``'s; ``_jsonl_read`` reads the file
back.

- A handler that appends to a file ending in a torn line first ends that line, so the new
  events start on a line of their own (the torn line is then skipped wherever it is).
- A failed write (a full disk: ``ENOSPC``) loses nothing it can keep: the handler counts the
  lines that reached the file whole (``written``), keeps the others, up to ``KEEP_LINES``
  lines and ``KEEP_CHARS`` characters, and writes them at its next flush, ending the torn
  line first; ``flush()`` raises the ``OSError``, so a bus counts and logs it as the
  handler's error. Lines past that bound, and those it still holds when closed or when a bus
  lets go of it, are lost: counted in ``JsonlEventHandler.dropped`` and, on a bus, as dropped
  by that handler (its stats and its warning say so).
- An event that cannot be encoded at all (a timestamp whose zone raises) costs no other event
  of its batch: it is counted in ``JsonlEventHandler.dropped`` (on a bus, as dropped by that
  handler) and its exception is raised with the batch's others, as an ``ExceptionGroup``.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from ._check import check_path
from ._event import Event
from ._jsonl_encode import event_line, to_utf8
from ._skipped import SkipReporter

if sys.version_info < (3, 11):  # anyio depends on the backport there
    from exceptiongroup import ExceptionGroup

if TYPE_CHECKING:
    from types import TracebackType

_T = TypeVar("_T")

#: Lines a handler keeps after a failed write, to write at its next flush; past this (or
#: ``KEEP_CHARS`` characters in all) the newest are dropped and counted.
KEEP_LINES = 65536
#: Characters of lines kept after a failed write (about as many bytes), at most.
KEEP_CHARS = 16 * 2**20


class JsonlEventHandler:
    """Append every event to a JSON-lines file, one line per event.

    The format: [JSON lines](sinks.md#json-lines).

    Events are encoded in ``__call__`` and written out together in ``flush()``, which the bus
    calls after each delivered batch: once ``bus.flush()``, ``unregister_event_handler`` or
    ``bus.close()`` returns, every event delivered so far is in the file (handed to the
    operating system; not ``fsync``-ed). ``close()`` flushes and closes the file.

    The file is opened for appending when the handler is made, so a bad path fails there and
    what the file already holds is kept. ``flush()`` and ``close()`` are thread-safe. A copy
    inherited by a forked child starts with nothing buffered and a new lock: it never writes
    the parent's lines again and never waits on a lock the parent held at the fork.

    A naive timestamp is written with the local offset ``datetime.astimezone()`` gives it. The
    offset of each hour is looked up once and kept, so a change of the local zone (``TZ``) is
    seen once ``time.tzset()`` has been called, as the ``time`` module requires.

    A value that cannot be written (an int over Python's digit limit for int-to-text
    conversion) is skipped, counted in ``skipped_values`` and logged as a warning on the
    ``monitor_bus`` logger, at most once per key every 10 seconds; the rest of the event is
    written.

    A write that fails (a full disk) raises from ``flush()``; the lines not written whole are
    kept (up to ``KEEP_LINES`` lines, ``KEEP_CHARS`` characters) and written, after a newline
    that ends the torn one, at the next ``flush()``. What is lost past that bound, or still
    unwritten at ``close()`` or when a bus lets go of the handler, is counted in ``dropped``
    and, on a bus, as dropped by this handler.

    Args:
        path: the file to append to; its directory must exist.

    Raises:
        TypeError: ``path`` is not a str or path.
        OSError: the file cannot be opened for appending (the message names it).

    Examples:
        >>> import monitor_bus as monitor
        >>> handler = monitor.JsonlEventHandler("run.jsonl")  # doctest: +SKIP
        >>> monitor.register_event_handler(handler, name="jsonl")  # doctest: +SKIP
    """

    # Shares the bus's runner with the other bundled sinks (``_runner``): one wake-up per batch.
    _monitor_bus_bundled = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = check_path("path", path)
        self._lock = threading.Lock()
        self._pending: list[str] = []  # lines to write: kept ones first, then new ones
        self._written = 0
        self._torn = False  # the file ends in a part of a line this handler wrote
        self._dropped = 0
        self._dropped_told = 0  # the part of _dropped a bus was told of
        self._skips = SkipReporter(f"JsonlEventHandler({self._path!r})")
        #: Values skipped because they cannot be written (ints too long for decimal text).
        self.skipped_values = 0
        # O_APPEND without Python's "a" mode, which seeks and so refuses pipes (/dev/stdout).
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_size > 0:
                with open(self._path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        os.write(fd, b"\n")  # end a torn last line
            # Unbuffered: no bytes (and no lock) of the file object's own for a fork to copy.
            self._file = os.fdopen(fd, "wb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        _open_handlers.add(self)

    @property
    def path(self) -> str:
        """The file written to."""
        return self._path

    @property
    def written(self) -> int:
        """How many events this handler has written to the file: its complete lines there."""
        return self._written

    @property
    def dropped(self) -> int:
        """How many events this handler was given and lost: writes failed and it could not
        keep them for another try (see the class docs)."""
        return self._dropped

    def __call__(self, event: Event) -> None:
        self._add_each([event], self._event_line)

    def handle_batch(self, events: Iterable[Event]) -> None:
        """Encode a batch of events; ``flush()`` writes them. An event that cannot be encoded
        costs no other: it counts in ``dropped``, and the failures are raised together at the
        end, as an ``ExceptionGroup``."""
        events = list(events)
        try:
            lines = [self._event_line(e) for e in events]
        except Exception:  # noqa: BLE001 - found again, one by one
            self._add_each(events, self._event_line)
        else:
            self._add(lines)

    def _event_line(self, e: Event) -> str:
        return event_line(e.name, e.timestamp, e.data, e.origin, self)

    def _monitor_bus_take_slots(self, slots: list[Any]) -> None:
        """The bus's call (see ``_handler.handler_calls``): encode a batch as it was queued
        (an event that cannot be encoded costs no other, as in ``handle_batch``)."""
        line = self._slots_line
        it = iter(slots)
        try:
            lines = [line(triple) for triple in zip(it, it, it, strict=True)]
        except Exception:  # noqa: BLE001 - found again, one by one
            it = iter(slots)
            self._add_each(list(zip(it, it, it, strict=True)), line)
        else:
            self._add(lines)

    def _slots_line(self, triple: tuple[str, datetime | float, dict[str, Any]]) -> str:
        name, ts, data = triple
        if data.__class__ is dict:
            return event_line(name, ts, data, None, self)
        origin = data.origin  # type: ignore[attr-defined]
        return event_line(name, ts, dict(data), origin, self)

    def _skip_value(self, key: tuple[str, str], message: str) -> None:
        """A value a line left out (``_jsonl_encode.SkipsValues``): counted and reported."""
        self.skipped_values += 1
        self._skips.report("out_of_range", key, message, self.skipped_values)

    def _add_each(self, items: list[_T], encode: Callable[[_T], str]) -> None:
        """Add the line of each of ``items`` that ``encode`` can make; the others count as
        dropped, and their failures are raised together (an ``ExceptionGroup``)."""
        lines = []
        errors = []
        for item in items:
            try:
                lines.append(encode(item))
            except Exception as exc:  # noqa: BLE001 - raised together below
                errors.append(exc)
        self._add(lines, len(errors))
        if errors:
            raise ExceptionGroup(
                f"{len(errors)} of {len(items)} events could not be encoded", errors
            )

    def _add(self, lines: list[str], unencoded: int = 0) -> None:
        with self._lock:
            if self._file.closed:
                raise ValueError(f"JsonlEventHandler({self._path!r}) is closed")
            self._pending += lines
            self._dropped += unencoded

    def flush(self) -> None:
        """Write the buffered events to the file in one write. A no-op once closed."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        pending = self._pending
        if not pending or self._file.closed:
            return
        self._pending = []
        text = "\n".join(pending)
        text += "\n"  # in place: the only reference
        raw = to_utf8(text)
        # A torn line of an earlier failure is ended first: it stays one torn line.
        lead = int(self._torn)
        view = memoryview(b"\n" + raw if lead else raw)
        sent = 0
        try:
            while sent < len(view):
                sent += self._file.write(view[sent:]) or 0
        except OSError:
            self._keep(pending, raw, sent - lead)
            raise
        self._torn = False
        self._written += len(pending)

    def _keep(self, lines: list[str], raw: bytes, sent: int) -> None:
        """After a failed write of ``lines`` (encoded as ``raw``) of which ``sent`` bytes
        reached the file (< 0: not even the newline ending a torn line): count the whole
        ones as written, keep the rest for the next flush within the bound, drop the others."""
        if sent >= 0:
            done = raw.count(b"\n", 0, sent)
            self._written += done
            self._torn = sent > 0 and raw[sent - 1] != 0x0A  # ends within a line
            lines = lines[done:]
        kept = lines[:KEEP_LINES]
        chars = 0
        for i, line in enumerate(kept):
            chars += len(line) + 1
            if chars > KEEP_CHARS:
                kept = kept[:i]
                break
        self._dropped += len(lines) - len(kept)
        self._pending[:0] = kept  # before what came meanwhile

    def _monitor_bus_lost(self, final: bool) -> int:
        """The bus's question (see ``_handler``): events lost since it last asked. ``final``:
        the bus lets go of this handler, so what it cannot write now is lost."""
        with self._lock:
            if final and self._pending and not self._file.closed:
                try:
                    self._flush_locked()
                except OSError:  # the bus logged this error at the batch's flush already
                    self._dropped += len(self._pending)
                    self._pending = []
            lost = self._dropped - self._dropped_told
            self._dropped_told = self._dropped
            return lost

    def close(self) -> None:
        """Write what is buffered and close the file. Idempotent.

        Raises:
            OSError: the last write failed; what it did not write is counted in ``dropped``.
        """
        with self._lock:
            if self._file.closed:
                return
            try:
                self._flush_locked()
            except OSError:
                self._dropped += len(self._pending)
                self._pending = []
                raise
            finally:
                self._file.close()

    def __enter__(self) -> JsonlEventHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"JsonlEventHandler({self._path!r})"

    def _after_fork_in_child(self) -> None:
        # The lines buffered at the fork are the parent's to write; the lock may have been
        # held by a thread the child does not have.
        self._lock = threading.Lock()
        self._pending = []


_open_handlers: weakref.WeakSet[JsonlEventHandler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for handler in list(_open_handlers):
        handler._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
