"""Events as JSON lines: the one place a line's text and bytes are made.

One line per event: ``{"name": ..., "timestamp": ..., "data": {...}}``, UTF-8. An event that
came from a child process also has ``"origin": {"pid": ..., "worker": ...}`` (``worker``: its
DataLoader worker id, or null), which ``read_jsonl`` restores as ``Event.origin``.

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
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from ._event import EventOrigin
from ._histogram import Histogram
from ._jsonl_time import iso_timestamp


class SkipsValues(Protocol):
    """The sink a line is made for: told of each value the line leaves out."""

    def _skip_value(self, key: tuple[str, str], message: str) -> None:
        """Count and report a value left out: ``key`` is (event name, data key)."""


NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
FLOAT_KEY = "$float"
HISTOGRAM_KEY = "$histogram"


def _default(value: Any) -> Any:
    """The JSON form of a value the encoder has no type for, the one hook of both encoders
    (orjson's and the standard library's): a ``Histogram`` as ``{"$histogram":
    Histogram.to_dict()}``; any other type is a TypeError."""
    if isinstance(value, Histogram):
        return {HISTOGRAM_KEY: value.to_dict()}
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


def event_line(
    name: str,
    timestamp: datetime | float,
    data: dict[str, Any],
    origin: EventOrigin | None,
    sink: SkipsValues,
) -> str:
    """The line of an event, without its newline; a value that cannot be written is left out
    and told to ``sink`` (passed itself: no bound method to make per line).

    Raises:
        Exception: the event cannot be encoded at all (a timestamp whose zone raises).
    """
    # The line is put together by hand, in the key order and separators ``_encode`` would
    # use for {"name", "timestamp", "data"[, "origin"]}: the same bytes at about half the
    # cost. A timestamp is digits and ``-:.T+`` only, so it needs no escaping.
    try:
        text = _encode_data(data)
    except ValueError:  # a non-finite float, or an int over the digit limit
        text = _data_text(name, data, sink)
    name = _encode_str(name)
    stamp = iso_timestamp(timestamp)
    if origin is None:
        return f'{{"name":{name},"timestamp":"{stamp}","data":{text}}}'
    # An event from a child process: which one.
    where = _encode({"pid": origin.pid, "worker": origin.worker})
    return f'{{"name":{name},"timestamp":"{stamp}","data":{text},"origin":{where}}}'


def _data_text(name: str, data: dict[str, Any], sink: SkipsValues) -> str:
    """The event's data as JSON, non-finite floats written as objects, values that cannot
    be written skipped and told to ``sink``."""
    try:
        return _encode_data({k: _value(v) for k, v in data.items()})
    except ValueError:  # an int over the digit limit of int-to-text conversion
        return _encode_data(_writable(name, data, sink))


def _writable(name: str, data: dict[str, Any], sink: SkipsValues) -> dict[str, Any]:
    """The event's data without the values that cannot be encoded, each told to ``sink``."""
    kept = {}
    limit = sys.get_int_max_str_digits()
    for key, value in data.items():
        value = _value(value)
        try:
            _encode(value)
        except ValueError:
            sink._skip_value(
                (name, key),
                f"data[{key!r}] of event {name!r} is an int too long to write as "
                f"decimal text (sys.get_int_max_str_digits() is {limit})",
            )
        else:
            kept[key] = value
    return kept


def to_utf8(text: str) -> bytes:
    """``text`` (lines) as UTF-8, a lone surrogate written as its ``\\udXXX`` escape."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: only inside JSON strings, so escape them
        return _LONE_SURROGATE.sub(_escape, text).encode("utf-8")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _value(v: Any) -> Any:
    if v.__class__ is float and not math.isfinite(v):
        return {FLOAT_KEY: "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")}
    return v
