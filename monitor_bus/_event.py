"""Events: a name, a wall-clock timestamp and a flat mapping of plain values."""

from __future__ import annotations

import copyreg
import math
import operator
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, NamedTuple, Union

from ._check import type_name, wrong_type
from ._device import ARRAY_CLASSES, Deferred, array_class, capture, one_value

data_value_t = Union[str, float, int, bool]  # noqa: UP007 - a runtime alias, as in torch
"""A value an event's ``data`` may hold: ``str``, ``float``, ``int`` or ``bool``."""

# The value types ``data`` holds as they are; anything else goes through ``normalize``.
PLAIN = frozenset((str, int, float, bool))


class EventOrigin(NamedTuple):
    """The child process an event was logged in, when it reached this process from there."""

    #: The process id of the child.
    pid: int
    #: The torch DataLoader worker id, when the child is a DataLoader worker.
    worker: int | None = None


class Event:
    """One named, timestamped record handed to every registered handler.

    ``data`` is copied when the event is made, so the caller may reuse its dict. Events cross
    threads on their way to handlers: treat them as immutable once logged.

    Args:
        name: what happened, for example ``"train.epoch"``.
        timestamp: when it happened (wall-clock time).
        data: keys are strings; values are ``str``, ``int``, ``float`` or ``bool``. Numpy
            scalars and host arrays holding one element are converted to the Python value
            they hold (a bool stays a ``bool``); other scalars through ``__index__`` (to
            ``int``) or ``__float__`` (to ``float``). A torch tensor holding one element, on
            any device, or a one-element array on a device (``__dlpack__``: CuPy, JAX) is
            copied, not read: the bus reads it on a thread of its own, so the caller never
            waits for the device, and handlers get the Python value it held at the call.

    Raises:
        TypeError: an argument has the wrong type; for ``data``, the message names the key.

    Examples:
        >>> from datetime import datetime, timezone
        >>> event = Event("train.epoch", datetime(2026, 1, 1, tzinfo=timezone.utc), {"loss": 0.5})
        >>> event.name, event.timestamp.isoformat(), event.data
        ('train.epoch', '2026-01-01T00:00:00+00:00', {'loss': 0.5})
    """

    __slots__ = ("_origin", "_timestamp", "data", "name")

    _origin: EventOrigin | None
    # A datetime, or ``time.time()`` as a float (``EventBus.log``) until ``timestamp`` is read.
    _timestamp: datetime | float
    #: What happened.
    name: str
    #: The event's values, keyed by name.
    data: dict[str, data_value_t]

    def __init__(self, name: str, timestamp: datetime, data: Mapping[str, data_value_t]) -> None:
        if name.__class__ is not str:
            name = check_name(name)
        if not isinstance(timestamp, datetime):
            raise wrong_type("timestamp", "a datetime", timestamp)
        if data.__class__ is dict:
            copied = data.copy()
        elif isinstance(data, Mapping):
            copied = dict(data)
        else:
            raise wrong_type("data", "a mapping", data)
        self.name = name
        self._timestamp = timestamp
        self.data = plain(copied)
        self._origin = None

    @property
    def timestamp(self) -> datetime:
        """When it happened.

        An event logged with ``log`` holds the time as a float until this is first read,
        which makes it the naive local ``datetime`` of that instant (as ``datetime.now()``
        gave it then), in the local zone of the process reading it: a handler that never
        reads it never pays for it.
        """
        ts = self._timestamp
        if ts.__class__ is float:
            ts = self._timestamp = datetime.fromtimestamp(ts)
        return ts  # type: ignore[return-value]

    @timestamp.setter
    def timestamp(self, value: datetime) -> None:
        self._timestamp = value

    def __getstate__(self) -> object:
        """The default state of a slotted object (a subclass's slots and ``__dict__``
        included), with the timestamp made a ``datetime`` here: a float would become the local
        time of wherever the copy is unpickled."""
        self.timestamp  # noqa: B018 - made by the property
        return _default_state(self)

    @property
    def origin(self) -> EventOrigin | None:
        """The child process the event was logged in (None: logged in this process).

        Set by the bus for events that child processes sent to this one (see
        ``EventBus(children=...)``), and by ``read_jsonl`` for the events it reads back.
        """
        return self._origin

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Event:
            return NotImplemented
        assert isinstance(other, Event)
        return (
            self.name == other.name
            and self.timestamp == other.timestamp
            and self.data == other.data
            and self.origin == other.origin
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        origin = self.origin
        extra = "" if origin is None else f", origin={origin!r}"
        return f"Event(name={self.name!r}, timestamp={self.timestamp!r}, data={self.data!r}{extra})"


def _slots_state(obj: object) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``object.__getstate__`` of Python 3.11+, for 3.10: ``(__dict__ or None, slots)``, the
    slots named as pickle's own default names them (mangled, every class's)."""
    names = copyreg._slotnames(type(obj))  # type: ignore[attr-defined]
    slots = {name: getattr(obj, name) for name in names if hasattr(obj, name)}
    return getattr(obj, "__dict__", None) or None, slots


# The state pickle and copy take of an object by default: at C speed from Python 3.11.
_default_state: Callable[[object], object] = getattr(object, "__getstate__", _slots_state)


def split_time(ts: float) -> tuple[int, int]:
    """``ts`` (seconds since the epoch) as whole seconds and microseconds, rounded half to
    even as ``datetime.fromtimestamp`` rounds it: what is made from the float equals what is
    made from the ``datetime`` it stands for."""
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    if us >= 1_000_000:
        return int(whole) + 1, us - 1_000_000
    if us < 0:
        return int(whole) - 1, us + 1_000_000
    return int(whole), us


def epoch_seconds(event: Event) -> float:
    """``event.timestamp.timestamp()``, without making the ``datetime`` of an event logged
    with ``log``."""
    ts = event._timestamp
    if ts.__class__ is float:
        whole, us = split_time(ts)
        return whole + us / 1e6
    return ts.timestamp()  # type: ignore[union-attr]


def from_slots(
    name: str, timestamp: datetime | float, data: dict[str, Any], *, copy: bool = False
) -> Event:
    """The ``Event`` of one queued event's slots (see ``_queue``): a plain dict as it is (a
    copy if ``copy``), a window's or a child process's as a plain dict, with its origin."""
    event = Event.__new__(Event)
    event.name, event._timestamp = name, timestamp
    if data.__class__ is dict:
        event.data, event._origin = data.copy() if copy else data, None
    else:
        event.data, event._origin = dict(data), data.origin  # type: ignore[attr-defined]
    return event


def plain(data: dict[str, Any]) -> dict[str, Any]:
    """``data``, a dict the caller owns, with plain ``str`` keys and values (see ``Event``):
    as it is when they are, else converted in place (or a ``DeferredData`` holding device
    values). Raises a TypeError naming the key of a value that is none of these.

    The caller's hot path (``Event``, ``EventBus.log``): a plain loop with identity checks
    beats set operations on the small dicts events carry.
    """
    for key, value in data.items():
        if type(key) is not str or type(value) not in PLAIN:
            return normalize(data)
    return data


def check_name(name: object) -> str:
    """An event's name that is not exactly a ``str``: a subclass becomes one, anything else
    raises a TypeError naming ``name`` (callers test ``name.__class__ is str`` first)."""
    if isinstance(name, str):
        return str(name)
    raise wrong_type("name", "a str", name)


class DeferredData(dict):  # type: ignore[type-arg]
    """The data of an event holding device values (``Deferred``): the dispatcher reads
    them and hands handlers a plain ``dict``; pickled (to a parent process) as one."""

    __slots__ = ()

    def __reduce__(self) -> tuple[object, ...]:
        return (dict, (resolved(self),))


def resolved(data: dict[str, object]) -> dict[str, object]:
    """``data`` with each device value read (waiting for its device)."""
    out = {}
    for key, value in data.items():
        if value.__class__ is Deferred:
            value.wait()
            value = value.value()
        out[key] = value
    return out


def normalize(data: dict[str, data_value_t]) -> dict[str, data_value_t]:
    """Convert subclasses, numpy-style scalars and device values, or raise a TypeError naming
    the key. Returns ``data``, or a ``DeferredData`` copy of it holding device values."""
    deferred = False
    for key in list(data):
        if key.__class__ is not str:
            if not isinstance(key, str):
                raise TypeError(f"data keys must be str, not {type(key).__name__} ({key!r})")
            data[str(key)] = data.pop(key)
            key = str(key)
        value: object = _plain_value(key, data[key])
        data[key] = value  # type: ignore[assignment]
        deferred = deferred or value.__class__ is Deferred
    return DeferredData(data) if deferred else data


def _plain_value(key: str, value: object) -> data_value_t:
    if value.__class__ in PLAIN:
        return value  # type: ignore[return-value]
    cls = value.__class__
    array = ARRAY_CLASSES.get(cls)
    if array is None:
        array = array_class(cls)
    ndim: object = getattr(value, "ndim", 0)
    if array or ndim:  # an array or tensor
        value = capture(f"data[{key!r}]", value)
    else:  # a scalar (numpy's): as it is, or the Python value it holds
        value = one_value(f"data[{key!r}]", value)
    cls = value.__class__
    if cls in PLAIN or cls is Deferred:
        return value  # type: ignore[return-value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str(value)
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
    raise TypeError(f"data[{key!r}] must be str, int, float or bool, not {type_name(value)}")
