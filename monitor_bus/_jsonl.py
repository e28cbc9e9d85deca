"""A JSON-lines file as a sink, and the reader that gives the events back.

One line per event: ``{"name": ..., "timestamp": ..., "data": {...}}``, UTF-8. An event that
came from a child process also has ``"origin": {"pid": ..., "worker": ...}`` (``worker``: its
DataLoader worker id, or null), which ``read_jsonl`` restores as ``Event.origin``.

- ``timestamp`` is ISO 8601 with a UTC offset. An aware timestamp keeps its offset; a naive one
  is taken as local time (``datetime.astimezone()``) and written with the local offset.
  ``read_jsonl`` always returns aware timestamps, equal to the logged ones when those were
  aware (``Stat`` windows are) and to ``logged.astimezone()`` when they were naive.
- Encoding: with orjson installed (the ``fast`` extra) ``data`` is encoded by it, at C speed;
  the data of a line orjson refuses (an int past 64 bits, a lone surrogate) or would write as
  ``null`` (a non-finite float) goes through the standard library's encoder, as it does
  without orjson. The bytes may differ between the two (``1e-7`` or ``1e-07``); the events
  ``read_jsonl`` gives back are equal either way. A value of a type JSON does not have is
  encoded by one function for both (``_default``).
- ``data`` values are JSON strings, integers, floats and ``true``/``false``; an ``int``
  reads back as an ``int``, a ``float`` as a ``float`` (written with a ``.0`` or an
  exponent), a ``bool`` as a ``bool``. JSON has no NaN or infinities, so a non-finite float
  is written as the object ``{"$float": "NaN"}``, ``{"$float": "Infinity"}`` or
  ``{"$float": "-Infinity"}``, and a ``Histogram`` (a Stat window's ``<name>.histogram``) as
  ``{"$histogram": Histogram.to_dict()}``, which ``read_jsonl`` restores to an equal
  ``Histogram`` (an object there that ``Histogram.from_dict`` refuses makes the line not an
  event). No other value is ever an object, so these cannot be confused with one, and every
  line stays standard JSON that any tool can parse.
- Text holding lone surrogates (what ``os.fsdecode`` makes of a non-UTF-8 file name) is written
  with those as ``\\udXXX`` escapes, so the file stays UTF-8 and reads back equal. An int too
  long to write as decimal text (over ``sys.get_int_max_str_digits()`` digits) is skipped and
  counted in ``JsonlEventHandler.skipped_values``; the rest of the event is written.
- Torn lines: a crash or a full disk in the middle of a write leaves an incomplete line. ``read_jsonl``
  skips a line that is not valid JSON (or not UTF-8) with a warning naming the file and line;
  a file in which no line at all is valid raises ``ValueError``, and so does a valid line that
  is not an event (deep nesting included). A UTF-8 byte order mark opening the file is read
  past; an int over the reading Python's digit limit, or a number beyond a float's range
  (``1e999``, which Python would read as infinity), is skipped with a warning, its event kept;
  a line longer than ``MAX_LINE_BYTES`` is skipped with a warning, never held whole. A handler that appends to a file ending in a torn line first ends that line, so the new
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

import codecs
import json
import math
import os
import re
import stat
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

from ._event import Event, EventOrigin, from_slots, split_time
from ._histogram import Histogram
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

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_FLOAT_KEY = "$float"
_HISTOGRAM_KEY = "$histogram"


def _default(value: Any) -> Any:
    """The JSON form of a value the encoder has no type for, the one hook of both encoders
    (orjson's and the standard library's): a ``Histogram`` as ``{"$histogram":
    Histogram.to_dict()}``; any other type is a TypeError."""
    if isinstance(value, Histogram):
        return {_HISTOGRAM_KEY: value.to_dict()}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_encoder = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_default
)
_encode = _encoder.encode
_encode_str = json.encoder.encode_basestring  # _encoder's own, for ensure_ascii=False


def _make_data_encoder() -> Callable[[dict[str, Any]], str]:
    """``_encode`` for a flat dict of plain values, with the C encoder built once.

    ``JSONEncoder.encode`` builds a new C encoder on every call (a third of what it costs for
    a four-value event). Built here with ``_encoder``'s settings and no circular-reference
    check: event data is flat. Checked against ``_encode`` once; ``_encode`` itself where the C
    encoder is missing or differs.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _encode
    try:
        c_encode = make(None, _default, _encode_str, None, ":", ",", False, False, False)

        def encode(data: dict[str, Any]) -> str:
            return "".join(c_encode(data, 0))

        sample = {"s": 'é\ud800"', "i": -(2**70), "f": 1e-07, "b": True, "g": 0.1}
        if encode(sample) != _encode(sample):
            return _encode
        encode({"f": math.nan})
    except ValueError:  # allow_nan=False holds: non-finite floats still raise
        return encode
    except Exception:  # an interpreter whose C encoder takes other arguments
        pass
    return _encode


_stdlib_encode_data = _make_data_encoder()


def _make_fast_encoder() -> Callable[[dict[str, Any]], str] | None:
    """``_stdlib_encode_data`` at C speed with orjson (the ``fast`` extra), or None without it.

    A line orjson refuses (an int past 64 bits, a lone surrogate) or would write otherwise
    (it writes a non-finite float as ``null``, which no data value is) takes the standard
    library's path: the bytes may differ (``1e-7`` for ``1e-07``), the values read back equal.
    """
    try:
        from orjson import dumps
    except ImportError:
        return None

    def encode(data: dict[str, Any]) -> str:
        try:
            raw = dumps(data, default=_default)
        except TypeError:  # orjson's JSONEncodeError: an int past 64 bits, a lone surrogate
            return _stdlib_encode_data(data)
        if b":null" in raw:  # NaN or an infinity (or a string holding that text): exactly
            return _stdlib_encode_data(data)
        return raw.decode()

    return encode


_fast_encode_data = _make_fast_encoder()
_encode_data = _fast_encode_data or _stdlib_encode_data
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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
        self._path = _check_path(path)
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
        return self._line(e.name, e.timestamp, e.data, e.origin)

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
            return self._line(name, ts, data, None)
        return self._line(name, ts, dict(data), data.origin)  # type: ignore[attr-defined]

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

    def _line(
        self,
        name: str,
        timestamp: datetime | float,
        data: dict[str, Any],
        origin: EventOrigin | None,
    ) -> str:
        # The line is put together by hand, in the key order and separators ``_encode`` would
        # use for {"name", "timestamp", "data"[, "origin"]}: the same bytes at about half the
        # cost. A timestamp is digits and ``-:.T+`` only, so it needs no escaping.
        try:
            text = _encode_data(data)
        except ValueError:  # a non-finite float, or an int over the digit limit
            text = self._data_text(name, data)
        name = _encode_str(name)
        stamp = _timestamp(timestamp)
        if origin is None:
            return f'{{"name":{name},"timestamp":"{stamp}","data":{text}}}'
        # An event from a child process: which one.
        where = _encode({"pid": origin.pid, "worker": origin.worker})
        return f'{{"name":{name},"timestamp":"{stamp}","data":{text},"origin":{where}}}'

    def flush(self) -> None:
        """Write the buffered events to the file in one write. A no-op once closed."""
        with self._lock:
            self._flush_locked()

    def _data_text(self, name: str, data: dict[str, Any]) -> str:
        """The event's data as JSON, non-finite floats written as objects, values that cannot
        be written skipped and counted."""
        try:
            return _encode_data({k: _value(v) for k, v in data.items()})
        except ValueError:  # an int over the digit limit of int-to-text conversion
            return _encode_data(self._writable(name, data))

    def _writable(self, name: str, data: dict[str, Any]) -> dict[str, Any]:
        """The event's data without the values that cannot be encoded, each counted."""
        kept = {}
        limit = sys.get_int_max_str_digits()
        for key, value in data.items():
            value = _value(value)
            try:
                _encode(value)
            except ValueError:
                self.skipped_values += 1
                self._skips.report(
                    "out_of_range",
                    (name, key),
                    f"data[{key!r}] of event {name!r} is an int too long to write as "
                    f"decimal text (sys.get_int_max_str_digits() is {limit})",
                    self.skipped_values,
                )
            else:
                kept[key] = value
        return kept

    def _flush_locked(self) -> None:
        pending = self._pending
        if not pending or self._file.closed:
            return
        self._pending = []
        text = "\n".join(pending)
        text += "\n"  # in place: the only reference
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: only inside JSON strings, so escape them
            raw = _LONE_SURROGATE.sub(_escape, text).encode("utf-8")
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


def _timestamp(ts: datetime | float) -> str:
    """``ts.isoformat()``, after ``astimezone()`` when ``ts`` is naive (local time); a float
    (``EventBus.log``'s ``time.time()``) as the ``datetime.fromtimestamp(ts)`` it stands for.

    A naive ``datetime`` takes the local offset of its hour from ``_local_offsets`` rather
    than from an ``astimezone()`` per call (about a third of the cost of a line).
    """
    if isinstance(ts, float):
        return _float_timestamp(ts)
    if ts.__class__ is datetime:
        tz = ts.tzinfo
        if tz is None:
            text = ts.isoformat()
            offsets = _local_offsets
            if offsets.tzname is time.tzname:
                suffix: str | None = offsets.get(text[:13])  # the hour: "YYYY-MM-DDTHH"
                if suffix:
                    return text + suffix
            return _naive_timestamp(ts, text)
        if tz is _UTC:
            return ts.isoformat()
    if ts.utcoffset() is None:
        ts = ts.astimezone()  # naive: local time
    return ts.isoformat()


def _float_timestamp(ts: float) -> str:
    """``_timestamp(datetime.fromtimestamp(ts))``, with the text of each whole second made
    once (``_local_seconds``): the float is an instant, so its offset is never in doubt."""
    whole = int(ts)
    us = round((ts - whole) * 1e6)  # split_time's rounding, inline (a line's hot path)
    seconds = _local_seconds
    parts = seconds.get(whole)
    if parts is None or not 0 < us < 1_000_000 or seconds.tzname is not time.tzname:
        return _second_timestamp(ts)
    # The microseconds' six digits: cheaper sliced from a number than padded by a format spec.
    return f"{parts[0]}{str(us + 1_000_000)[1:]}{parts[1]}"


def _second_timestamp(ts: float) -> str:
    """``_float_timestamp`` of a float whose second is not in ``_local_seconds`` yet, or that
    has no fraction, or rounds into the next second."""
    global _local_seconds
    whole, us = split_time(ts)
    seconds = _local_seconds
    tzname = time.tzname  # read before the text it labels, as in _naive_timestamp
    if seconds.tzname is not tzname or len(seconds) >= _LOCAL_OFFSETS_MAX:
        seconds = _local_seconds = _LocalOffsets(tzname)
    parts = seconds.get(whole)
    if parts is None:
        text = datetime.fromtimestamp(whole, _UTC).astimezone().isoformat()
        parts = seconds[whole] = (text[:19] + ".", text[19:])  # "YYYY-MM-DDTHH:MM:SS.", offset
    head, offset = parts
    return f"{head}{us:06d}{offset}" if us else head[:-1] + offset


class _LocalOffsets(dict[Any, Any]):
    """A table of local time's text. ``_local_offsets``: the UTC offset as ``isoformat``
    writes it (``"+01:00"``), by hour of naive local time; ``""`` for an hour ``astimezone()``
    must decide (an offset change in or next to it). ``_local_seconds``: by whole second since
    the epoch, its local date and time and its offset.

    Valid while ``time.tzname`` is the tuple in ``tzname``: ``time.tzset()``, which must be
    called for a change of the local zone to take effect, makes a new one.
    """

    __slots__ = ("tzname",)

    def __init__(self, tzname: object) -> None:
        super().__init__()
        self.tzname = tzname


_local_offsets = _LocalOffsets(None)
# The text of whole seconds (``_float_timestamp``): its date and time, and its offset.
_local_seconds = _LocalOffsets(None)
_LOCAL_OFFSETS_MAX = 1024  # hours (seconds) kept; past that the table starts over
_HOUR_END = timedelta(minutes=59, seconds=59, microseconds=999999)
_UTC = timezone.utc


def _naive_timestamp(ts: datetime, text: str) -> str:
    """``_timestamp`` of a naive datetime whose hour is not in ``_local_offsets`` yet."""
    global _local_offsets
    offsets = _local_offsets
    tzname = time.tzname  # read before the offsets it labels: a tzset meanwhile invalidates
    if offsets.tzname is not tzname or len(offsets) >= _LOCAL_OFFSETS_MAX:
        offsets = _local_offsets = _LocalOffsets(tzname)
    hour = text[:13]
    suffix = offsets.get(hour)
    if suffix is None:
        suffix = offsets[hour] = _hour_offset(ts.replace(minute=0, second=0, microsecond=0, fold=0))
    if suffix:
        return text + suffix
    return ts.astimezone().isoformat()


def _hour_offset(start: datetime) -> str:
    """The offset text ``astimezone().isoformat()`` gives every naive time of the hour from
    ``start``, or ``""`` when they may differ (the offset changes in or at the edge of it)."""
    try:
        end = start + _HOUR_END
        ends = (start, start.replace(fold=1), end, end.replace(fold=1))
        local = [t.astimezone() for t in ends]
    except (OverflowError, ValueError, OSError):  # out of the platform's range: let it say so
        return ""
    offset = local[0].utcoffset()
    for t, lt in zip(ends, local, strict=True):
        # A time in a skipped hour comes back moved; a repeated hour has two offsets.
        if lt.utcoffset() != offset or lt.replace(tzinfo=None) != t:
            return ""
    return local[0].isoformat()[len(start.isoformat()) :]


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _value(v: Any) -> Any:
    if v.__class__ is float and not math.isfinite(v):
        return {_FLOAT_KEY: "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")}
    return v


#: Called for each part of a file a read skips, with its line number, its kind (``"line"``: a
#: line that is not valid JSON or not UTF-8; ``"event"``: a line of JSON that is not an event,
#: the message says why; ``"value"``: a value this Python cannot read) and a message saying
#: what was skipped, without the file and line.
SkipCallback = Callable[[int, str, str], None]

#: The longest line the reader takes, in bytes, its line ending aside: a longer one is skipped
#: as too long, read through in pieces of this size, so reading never holds more of a line.
MAX_LINE_BYTES = 16 * 2**20


def read_jsonl(path: str | os.PathLike[str]) -> list[Event]:
    """Read back the events a ``JsonlEventHandler`` wrote, in file order.

    Lines that are not valid JSON, or not UTF-8 (a write cut short by a crash or a full
    disk), and lines longer than 16 MiB are skipped with a ``UserWarning`` naming the file
    and line. Blank lines are ignored, and so is a UTF-8 byte order mark at the start
    of the file. An int too long for this Python to read (over ``sys.get_int_max_str_digits()``
    digits) and a number beyond a float's range (``1e999``, which JSON can hold and Python
    would read as infinity) are skipped with a warning naming their key; the rest of their
    event is kept. ``NaN`` and ``Infinity``, which Python's ``json`` writes, read as what they
    say.

    Args:
        path: the JSON-lines file.

    Returns:
        The events, with aware timestamps and the values as logged (see
        [JSON lines](sinks.md#json-lines)).

    Raises:
        TypeError: ``path`` is not a str or path.
        OSError: the file cannot be read (the message names it).
        ValueError: a valid JSON line is not an event (nested deeper than one, say), or the
            file is not empty but holds no valid line (the message names the file and, for a
            line, its number).
    """
    path = _check_path(path)

    def warn(lineno: int, kind: str, message: str) -> None:
        if kind == "event":  # not written by the handler: this reader stops there
            raise ValueError(f"{path}, line {lineno}: {message}")
        # stacklevel: warn, iter_jsonl, read_jsonl, then the caller.
        warnings.warn(f"{path}, line {lineno}: {message}", UserWarning, stacklevel=4)

    return list(iter_jsonl(path, warn))


def iter_jsonl(
    path: str | os.PathLike[str], on_skip: SkipCallback, *, max_line: int | None = None
) -> Iterator[Event]:
    """Yield the events of a JSON-lines file one at a time, as ``read_jsonl`` reads them.

    Memory stays bounded by ``max_line``, whatever the file's size. What ``read_jsonl``
    warns about is handed to ``on_skip`` instead, so a caller can count it, and so is a line
    of JSON that is not an event (kind ``"event"``), where ``read_jsonl`` raises: the reading
    goes on past it unless ``on_skip`` raises.

    Args:
        path: the JSON-lines file.
        on_skip: called with (line number, kind, message) for each line or value skipped.
        max_line: the longest line read, in bytes; ``MAX_LINE_BYTES`` if None.

    Yields:
        The events, in file order.

    Raises:
        TypeError: ``path`` is not a str or path.
        OSError: the file cannot be read (the message names it).
        ValueError: the file is not empty but holds no event, once the iteration has read
            it through.
    """
    path = _check_path(path)
    limit = MAX_LINE_BYTES if max_line is None else max_line
    events = 0
    skipped = 0
    with open(path, "rb") as f:
        for lineno, raw, length in _lines(f, limit):
            if raw is None:
                skipped += 1
                on_skip(
                    lineno,
                    "line",
                    f"skipped a line of {length:,} bytes, longer than the {limit:,} a line is "
                    "read up to",
                )
                continue
            odd = None
            try:
                text = raw.decode("utf-8")
                obj = _parse(text)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                skipped += 1
                on_skip(lineno, "line", _TORN)
                continue
            except RecursionError:
                odd = "JSON nested deeper than an event can be; not a monitor_bus JSONL file?"
            else:
                try:
                    event = _event(obj, lineno, on_skip, text)
                except _NotAnEvent as exc:
                    odd = str(exc)
            if odd is not None:  # reported out of the except: nothing chained to on_skip's raise
                skipped += 1
                on_skip(lineno, "event", odd)
                continue
            events += 1
            yield event
    if skipped and not events:
        raise ValueError(f"{path}: no line is a valid JSON event; not a monitor_bus JSONL file?")


_TORN = "skipped a line that is not valid JSON (a write cut short by a crash or a full disk?)"


class _NotAnEvent(ValueError):
    """A line of valid JSON that is not an event; the message says why."""


class _LongInt:
    """Stands for an int over the digit limit in a parsed line, so only its key is skipped."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # only int() raises a plain one: an int over the digit limit
        return json.loads(text, parse_int=_parse_int)


def _parse_int(text: str) -> int | _LongInt:
    try:
        return int(text)
    except ValueError:
        return _LongInt(len(text.lstrip("-")))


class _Beyond:
    """Stands for a number beyond a float's range (``1e999``), which ``float`` makes infinite."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _Beyond:
    value = float(text)
    return _Beyond(text) if math.isinf(value) else value


def _beyond(text: str) -> dict[str, Any]:
    """The data of a line read again, its numbers beyond a float's range as ``_Beyond``: the
    ``Infinity`` of Python's json and an overflowing ``1e999`` both read as infinity."""
    obj = json.loads(text, parse_float=_parse_float, parse_int=_parse_int)
    data: dict[str, Any] = obj["data"]
    return data


def _check_path(path: str | os.PathLike[str]) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or path, not {type(path).__name__}")
    return os.fspath(path)


def _lines(f: Any, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """Each line that is not blank: its number, its bytes without the line ending (None when
    they are more than ``limit``: the line is read through, never held whole) and their
    number."""
    lineno = 0
    piece = limit + 2  # the line and its "\r\n"
    while raw := f.readline(piece):
        lineno += 1
        length = len(raw)
        while len(raw) == piece and not raw.endswith(b"\n"):  # longer still: read through it
            raw = f.readline(piece)
            length += len(raw)
        if length > len(raw):  # read in pieces: only its ending is left
            length -= len(raw) - len(raw.rstrip(b"\r\n"))
            yield lineno, None, length
            continue
        if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]  # saved by an editor that marks UTF-8
        raw = raw.rstrip(b"\r\n")
        if len(raw) > limit:
            yield lineno, None, len(raw)
        elif raw.strip():
            yield lineno, raw, len(raw)


def _event(obj: Any, lineno: int, on_skip: SkipCallback, text: str) -> Event:
    """The event a parsed line (``text``) holds; ``_NotAnEvent`` if it holds none."""
    if not isinstance(obj, dict):
        raise _NotAnEvent(f"expected a JSON object, got {type(obj).__name__}")
    name, stamp, data = obj.get("name"), obj.get("timestamp"), obj.get("data")
    if not isinstance(name, str):
        raise _NotAnEvent("'name' must be a string")
    if not isinstance(stamp, str):
        raise _NotAnEvent("'timestamp' must be a string")
    if not isinstance(data, dict):
        raise _NotAnEvent("'data' must be an object")
    try:
        timestamp = datetime.fromisoformat(stamp)
    except ValueError:
        raise _NotAnEvent(f"'timestamp' is not ISO 8601: {stamp!r}") from None
    if timestamp.utcoffset() is None:
        raise _NotAnEvent(f"'timestamp' has no UTC offset: {stamp!r}")
    origin = obj.get("origin")
    if origin is not None:
        origin = _origin(origin)
    values = {}
    infinite = False
    for key, value in data.items():
        if value.__class__ is float and (value == math.inf or value == -math.inf):
            infinite = True  # Infinity, or a number beyond a float: told apart below
        elif isinstance(value, _LongInt):
            on_skip(
                lineno,
                "value",
                f"data[{key!r}]: skipped an int of {value.digits} digits, more than "
                f"sys.get_int_max_str_digits() ({sys.get_int_max_str_digits()}) lets Python read",
            )
            continue
        if isinstance(value, dict):
            value = _object_value(key, value)
        elif not isinstance(value, (str, int, float)):  # bool is an int
            raise _NotAnEvent(f"data[{key!r}] is not a value: {value!r}")
        values[key] = value
    if infinite:
        for key, value in _beyond(text).items():
            if isinstance(value, _Beyond):
                shown = value.text if len(value.text) <= 40 else f"{value.text[:37]}..."
                on_skip(
                    lineno,
                    "value",
                    f"data[{key!r}]: skipped {shown}, a number beyond a float's range (JSON has "
                    "no infinity), not read as one",
                )
                del values[key]
    # Every value checked above; a Histogram is a window's value, which Event() takes from no caller.
    event = from_slots(name, timestamp, values)
    if origin is not None:
        event._origin = origin
    return event


def _object_value(key: str, obj: dict[str, Any]) -> float | Histogram:
    """The value a JSON object in ``data`` stands for: a non-finite float or a histogram."""
    if len(obj) == 1:
        special = obj.get(_FLOAT_KEY)
        if isinstance(special, str) and special in _NONFINITE:
            return _NONFINITE[special]
        fields = obj.get(_HISTOGRAM_KEY)
        if isinstance(fields, dict):
            try:
                return Histogram.from_dict(fields)
            except (TypeError, ValueError) as exc:
                raise _NotAnEvent(f"data[{key!r}] is not a valid histogram: {exc}") from None
    raise _NotAnEvent(f"data[{key!r}] is not a value: {obj!r}")


def _origin(obj: Any) -> EventOrigin:
    if isinstance(obj, dict) and not set(obj) - {"pid", "worker"}:
        pid, worker = obj.get("pid"), obj.get("worker")
        if _is_int(pid) and (worker is None or _is_int(worker)):
            return EventOrigin(pid, worker)
    raise _NotAnEvent("'origin' must be {'pid': int, 'worker': int or null}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
