"""Events: a name, a wall-clock timestamp and a flat mapping of plain values."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from datetime import datetime
from typing import Union

data_value_t = Union[str, float, int, bool]  # noqa: UP007 - a runtime alias, as in torch
"""A value an event's ``data`` may hold: ``str``, ``float``, ``int`` or ``bool``."""

_PLAIN = frozenset((str, int, float, bool))


class Event:
    """One named, timestamped record handed to every registered handler.

    ``data`` is copied when the event is made, so the caller may reuse its dict. Events cross
    threads on their way to handlers: treat them as immutable once logged.

    Args:
        name: what happened, for example ``"train.epoch"``.
        timestamp: when it happened (wall-clock time).
        data: keys are strings; values are ``str``, ``int``, ``float`` or ``bool``. Other
            scalars are converted through ``__index__`` (to ``int``) or ``__float__`` (to
            ``float``), so numpy scalars are accepted; a numpy bool stays a ``bool``.

    Raises:
        TypeError: an argument has the wrong type; for ``data``, the message names the key.

    Example:
        >>> from datetime import datetime, timezone
        >>> Event("train.epoch", datetime(2026, 1, 1, tzinfo=timezone.utc), {"loss": 0.5})
        Event(name='train.epoch', timestamp=datetime.datetime(2026, 1, 1, 0, 0, tzinfo=datetime.timezone.utc), data={'loss': 0.5})
    """  # noqa: E501

    __slots__ = ("data", "name", "timestamp")

    #: What happened.
    name: str
    #: When it happened.
    timestamp: datetime
    #: The event's values, keyed by name.
    data: dict[str, data_value_t]

    def __init__(self, name: str, timestamp: datetime, data: Mapping[str, data_value_t]) -> None:
        if name.__class__ is not str:
            name = _check_str(name)
        if not isinstance(timestamp, datetime):
            raise TypeError(f"timestamp must be a datetime, not {type(timestamp).__name__}")
        if data.__class__ is dict:
            copied = data.copy()
        elif isinstance(data, Mapping):
            copied = dict(data)
        else:
            raise TypeError(f"data must be a mapping, not {type(data).__name__}")
        # The caller's hot path: a plain loop with identity checks beats set operations on
        # the small dicts events carry.
        for key, value in copied.items():
            if key.__class__ is not str or value.__class__ not in _PLAIN:
                _normalize(copied)
                break
        self.name = name
        self.timestamp = timestamp
        self.data = copied

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Event:
            return NotImplemented
        assert isinstance(other, Event)
        return (
            self.name == other.name
            and self.timestamp == other.timestamp
            and self.data == other.data
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Event(name={self.name!r}, timestamp={self.timestamp!r}, data={self.data!r})"


def _check_str(name: object) -> str:
    if isinstance(name, str):
        return str(name)
    raise TypeError(f"name must be a str, not {type(name).__name__}")


def _normalize(data: dict[str, data_value_t]) -> None:
    """Convert subclasses and numpy-style scalars in place, or raise a TypeError naming the key."""
    for key in list(data):
        if key.__class__ is not str:
            if not isinstance(key, str):
                raise TypeError(f"data keys must be str, not {type(key).__name__} ({key!r})")
            data[str(key)] = data.pop(key)
            key = str(key)
        data[key] = _plain_value(key, data[key])


def _plain_value(key: str, value: object) -> data_value_t:
    cls = value.__class__
    if cls in _PLAIN:
        return value  # type: ignore[return-value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    dtype = getattr(value, "dtype", None)
    if getattr(dtype, "kind", None) == "b":
        return bool(value)
    if not isinstance(value, (bytes, bytearray, complex)):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        if hasattr(cls, "__float__"):
            try:
                return float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError, OverflowError):
                pass
    raise TypeError(
        f"data[{key!r}] must be str, int, float or bool, not {cls.__module__}.{cls.__qualname__}"
        if cls.__module__ != "builtins"
        else f"data[{key!r}] must be str, int, float or bool, not {cls.__qualname__}"
    )
