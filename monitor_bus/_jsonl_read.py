"""Reading a JSON-lines file back: ``read_jsonl`` and ``iter_jsonl``, a line at most
``MAX_LINE_BYTES`` at a time.

- Torn lines: a crash or a full disk in the middle of a write leaves an incomplete line.
  ``read_jsonl`` skips a line that is not valid JSON (or not UTF-8) with a warning naming the
  file and line; a file in which no line at all is valid raises ``ValueError``, and so does a
  valid line that is not an event (deep nesting included). A UTF-8 byte order mark opening the
  file is read past; an int over the reading Python's digit limit, or a number beyond a float's
  range (``1e999``, which Python would read as infinity), is skipped with a warning, its event
  kept; a line longer than ``MAX_LINE_BYTES`` is skipped with a warning, never held whole.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

from ._check import check_path
from ._event import Event, EventOrigin, from_slots
from ._histogram import Histogram
from ._jsonl_encode import FLOAT_KEY, HISTOGRAM_KEY, NONFINITE
from ._jsonl_time import read_timestamp

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
    path = check_path("path", path)

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
    path = check_path("path", path)
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
        timestamp = read_timestamp(stamp)
    except ValueError as exc:
        raise _NotAnEvent(str(exc)) from None
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
        special = obj.get(FLOAT_KEY)
        if isinstance(special, str) and special in NONFINITE:
            return NONFINITE[special]
        fields = obj.get(HISTOGRAM_KEY)
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
