"""The relay's wire format: frames, who may speak, and what a message may hold.

Guarantees
----------
- Framing: a message is a 4-byte little-endian length, then its body. A connection's first
  body is the child's credentials (``credentials``), of exactly ``AUTH_SIZE`` bytes; every later
  one a pickled tuple whose first item is its kind, at most ``MAX_FRAME`` bytes. A length out of
  bounds is refused before any of the body is read.
- Who may speak: a process proves it is a child of the family by a MAC (HMAC-SHA256) keyed by
  ``multiprocessing``'s ``authkey`` over a role label, the listener's pid and its own pid.
  ``fork``, ``spawn`` and ``forkserver`` children get that key the way ``multiprocessing``
  hands it to them (before their main module is imported), as do ``os.fork`` children; a
  ``subprocess`` program gets a random key of its own and cannot prove anything. The listener
  checks the MAC against the pid the kernel reports for the peer (``SO_PEERCRED``), whose uid
  must be ours: a proof is good for one process, and only a process that is the listener
  (which a child checks first, below) ever sees one, so there is nothing to replay or reflect.
- Whom a child speaks to: before it sends anything, a child checks that the process listening
  at the path is the listener it was told of (``SO_PEERCRED``: our uid, the listener's pid),
  not another user's (or another process's) socket at the same path.
- What a message may hold: bodies are decoded by an unpickler that makes only what the relay's
  messages hold (tuples, dicts and plain values, ``datetime``, ``timedelta``, ``timezone``,
  and a Stat window's ``Histogram``, whose fields are checked as its constructor checks them,
  and which must have them: one made without its state is refused);
  any other global is refused (``pickle.UnpicklingError``), so no body can run code. A decoded
  message must then have exactly the shape and types its kind has (``check``: an index that
  fits the answer, an event's name, timestamp and data as ``Event`` holds them (a window's data
  may hold a ``Histogram`` too), a drop count from 1 to 2**63 - 1), or it is refused
  (``Refused``) before it touches a bus. A child sends its timestamps in that form
  (``stamp``): a ``ZoneInfo`` by its key, another tzinfo as its fixed offset, a ``datetime``
  subclass as a ``datetime``.
- A refusal's cost is bounded: its reason shows the start of what the peer sent, made without
  a full ``repr`` (a few bytes of shared references can hold 2**k values).
- On a platform without ``SO_PEERCRED`` the key alone decides, on the pid the peer states.
"""

from __future__ import annotations

import hmac
import io
import os
import pickle
import socket
import struct
import sys
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any

from ._histogram import Histogram

# Messages: a 4-byte length, then a body.
HEADER = struct.Struct("<I")
HELLO, BUS, EVENT, WINDOW, DROPPED, SENT = range(6)
# The parent's only message: for each bus a child announces (by its index), whether it has no
# such bus (the child stops sending it), a bus that takes it, or a closed bus (the child counts
# what it sends it as dropped); later, CLOSING: the parent's bus is closing, the child sends
# the bus's open Stat windows, then SENT, and counts what it sends the bus afterwards as
# dropped. EXITING is added to CLOSED and CLOSING when the parent process is exiting.
VERDICT = struct.Struct("<IB")
NO_BUS, ROUTED, CLOSED, CLOSING = range(4)
EXITING = 4
# The first body: the child's pid and its MAC.
_CREDENTIALS = struct.Struct("<q32s")
AUTH_SIZE = _CREDENTIALS.size
# A body larger than this closes the connection (a child's messages are far smaller: an event).
MAX_FRAME = 64 << 20
_LABEL = b"monitor_bus relay: a child of listener %d, process %d"
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# A bus's index travels back in its answer (VERDICT: 4 unsigned bytes); a drop count is a
# child's counter.
_MAX_INDEX = 2**32 - 1
_MAX_COUNT = 2**63 - 1
_PLAIN = (str, int, float, bool)  # an event's data values (as ``Event`` holds them)
_WINDOW_VALUES = (*_PLAIN, Histogram)  # a Stat window's
_KINDS = {
    HELLO: "HELLO",
    BUS: "BUS",
    EVENT: "EVENT",
    WINDOW: "WINDOW",
    DROPPED: "DROPPED",
    SENT: "SENT",
}
_SIZES = {BUS: 4, EVENT: 6, WINDOW: 6, SENT: 2}  # the others: 3


class Refused(Exception):
    """A peer broke the protocol: its connection is closed (the reason is the message)."""


def frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _key() -> bytes:
    """The family's secret: ``multiprocessing``'s authkey for this process."""
    import multiprocessing.process

    return bytes(multiprocessing.process.current_process().authkey)


def prepare() -> None:
    """Fix the key before any child is forked (``os.fork`` copies it; imported later, it would
    be a new random one)."""
    _key()


def _mac(listener_pid: int, child_pid: int) -> bytes:
    return hmac.digest(_key(), _LABEL % (listener_pid, child_pid), "sha256")


def credentials(listener_pid: int) -> bytes:
    """This process's first frame to the listener of pid ``listener_pid``."""
    pid = os.getpid()
    return HEADER.pack(AUTH_SIZE) + _CREDENTIALS.pack(pid, _mac(listener_pid, pid))


def check_credentials(body: bytes | memoryview, peer_pid: int | None) -> int:
    """The pid of a peer whose first frame is ``body``; raises ``Refused`` unless it proves
    the key for the pid the kernel reports (``peer_pid``; None: unknown here)."""
    pid, mac = _CREDENTIALS.unpack(body)
    if peer_pid is not None and pid != peer_pid:
        raise Refused(f"it claimed to be process {pid}")
    if not hmac.compare_digest(mac, _mac(os.getpid(), pid)):
        raise Refused("it is not a child of this process (wrong key)")
    return pid  # type: ignore[no-any-return]


def peer(sock: socket.socket) -> tuple[int, int] | None:
    """The pid and uid of the process at the other end of a Unix socket (None: not known on
    this platform)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size))
    return pid, uid


def check_listener(sock: socket.socket, listener_pid: int) -> str | None:
    """Why the process listening at the other end of ``sock`` is not the listener of pid
    ``listener_pid`` of this user (None: it is, or this platform cannot tell)."""
    found = peer(sock)
    if found is None or found == (listener_pid, os.getuid()):
        return None
    return (
        f"the socket is held by process {found[0]} of uid {found[1]}, not by the parent's "
        f"listener (process {listener_pid} of uid {os.getuid()})"
    )


_ALLOWED = {
    ("builtins", "dict"): dict,  # the data of an event holding device values, as pickled
    ("datetime", "datetime"): datetime,
    ("datetime", "timedelta"): timedelta,
    ("datetime", "timezone"): timezone,
    # A window's HISTOGRAM: made empty, then its state checked (Histogram.__setstate__).
    ("monitor_bus", "Histogram"): Histogram,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a relay message")
        return found


def loads(body: bytes | memoryview) -> Any:
    """A message decoded, making nothing but plain values (see the guarantees)."""
    return _Unpickler(io.BytesIO(body)).load()


def check(message: Any) -> tuple[Any, ...]:
    """``message`` if it is one of the relay's messages, each item of its kind's type (an
    event's as ``(kind, index, name, timestamp, data)``, its timestamp made); raises
    ``Refused`` saying what is wrong otherwise. Exact classes: nothing else unpickles."""
    if message.__class__ is not tuple or not message:
        raise Refused(f"it sent {_show(message)}, not a message")
    kind = message[0]
    name = _KINDS.get(kind) if kind.__class__ is int else None
    if name is None:
        raise Refused(f"it sent a message of unknown kind {_show(kind)}")
    size = len(message)
    if size != _SIZES.get(kind, 3):
        raise Refused(f"it sent a {name} message of {size} items")
    if kind == HELLO:
        _, pid, worker = message
        if pid.__class__ is not int or not (worker is None or worker.__class__ is int):
            raise Refused(f"it sent a HELLO of {_show(pid)}, {_show(worker)}")
        return message
    index = message[1]
    if index.__class__ is not int or not 0 < index <= _MAX_INDEX:
        raise Refused(f"it sent a {name} message for bus {_show(index)}")
    if kind == SENT:
        return message
    if kind == BUS:
        _, _, creator, bus = message
        if (
            creator.__class__ is not tuple
            or len(creator) != 2
            or any(n.__class__ is not int for n in creator)
            or bus.__class__ is not str
        ):
            raise Refused(f"it announced bus {index} as {_show(creator)}, {_show(bus)}")
        return message
    if kind == DROPPED:
        count = message[2]
        if count.__class__ is not int or not 0 < count <= _MAX_COUNT:
            raise Refused(f"it reported {_show(count)} events of bus {index} dropped")
        return message
    _, _, event, micros, zone, data = message
    if event.__class__ is not str:
        raise Refused(f"it sent a {name} named {_show(event)}")
    values = _WINDOW_VALUES if kind == WINDOW else _PLAIN
    if data.__class__ is not dict or any(
        key.__class__ is not str or value.__class__ not in values for key, value in data.items()
    ):
        raise Refused(f"it sent a {name} whose data is not str keys to plain values")
    if kind == WINDOW:
        for key, value in data.items():
            if value.__class__ is Histogram and not _whole(value):
                raise Refused(
                    f"it sent a {name} whose data[{_show(key)[4:]}] is a Histogram without "
                    "its state"
                )
    return kind, index, event, _timestamp(micros, zone), data


def _whole(histogram: Histogram) -> bool:
    """Whether ``histogram`` has its state: a pickle can make one (NEWOBJ) and never give it
    one (BUILD, whose ``__setstate__`` checks it and sets every field, or none)."""
    return all(hasattr(histogram, name) for name in Histogram.__slots__)


def _timestamp(micros: Any, zone: Any) -> datetime:
    """``unstamp`` of what a peer sent, or ``Refused``."""
    if micros.__class__ is int:
        valid = zone is None or (zone.__class__ is int and zone == 0)
    else:
        valid = (
            micros is None
            and zone.__class__ is tuple
            and len(zone) == 2
            and zone[0].__class__ is datetime
            and zone[0].tzinfo is None
            and (zone[1] is None or zone[1].__class__ in (timezone, str))
        )
    if valid:
        try:
            return unstamp(micros, zone)
        except Exception as exc:  # noqa: BLE001 - out of range, no such zone: all the peer's
            raise Refused(f"it sent a timestamp that is not one ({exc!r})") from None
    raise Refused(f"it sent a timestamp of {_show(micros)}, {_show(zone)}")


def _show(value: object) -> str:
    """A peer's value in a warning: its type and the start of its repr, made in bounded work
    (``_brief``: a message of shared references can hold 2**k values in a few bytes)."""
    parts: list[str] = []
    _brief(value, parts, _SHOWN + 1)
    text = "".join(parts)
    return f"{type(value).__name__} {text if len(text) <= _SHOWN else text[:37] + '...'}"


_SHOWN = 40  # characters of a value a warning shows
_REPR = (type(None), bool, float, datetime, timedelta, timezone)  # short, whatever their value


def _brief(value: object, parts: list[str], room: int) -> int:
    """Append the start of ``repr(value)`` to ``parts``, stopping once about ``room``
    characters are out; returns the room left. Each value visited adds at least one
    character, so the work is bounded by ``room``, whatever ``value`` holds."""
    if room <= 0:
        return room
    cls = value.__class__
    if cls is tuple or cls is list or cls is dict:
        assert isinstance(value, (tuple, list, dict))
        ends = "()" if cls is tuple else "[]" if cls is list else "{}"
        parts.append(ends[0])
        room -= 1
        for i, item in enumerate(value.items() if isinstance(value, dict) else value):
            if room <= 0:
                return room
            if i:
                parts.append(", ")
                room -= 2
            if isinstance(value, dict):
                room = _brief(item[0], parts, room)
                parts.append(": ")
                room = _brief(item[1], parts, room - 2)
            else:
                room = _brief(item, parts, room)
        if cls is tuple and len(value) == 1:
            parts.append(",")
            room -= 1
        parts.append(ends[1])
        return room - 1
    if cls is str or cls is bytes:
        text = repr(value[:room])  # type: ignore[index]
    elif cls is int:
        bits = value.bit_length()  # type: ignore[attr-defined]
        text = repr(value) if bits <= 4 * _SHOWN else f"<{bits}-bit int>"
    elif cls in _REPR:
        text = repr(value)
    elif cls is Histogram:
        text = _brief_histogram(value)
    else:
        text = f"<{cls.__name__}>"
    parts.append(text)
    return room - len(text)


def _brief_histogram(value: Any) -> str:
    try:
        return repr(value)  # its counts by number: short
    except AttributeError:  # made without its state
        return "<Histogram without its state>"


_EPOCH = datetime(1970, 1, 1)
_MICROSECOND = timedelta(microseconds=1)


def stamp(ts: datetime | float) -> tuple[int | None, Any]:
    """A timestamp as microseconds since 1970 and 0 (UTC) or None (naive), or else as its
    naive time and its zone (``unstamp``): pickling an aware datetime costs ~11 us, this ~1 us.
    A float is ``time.time()`` (``EventBus.log``): sent as the naive local time it stands for,
    the ``datetime`` the parent's handlers would get from it here."""
    if isinstance(ts, float):
        ts = datetime.fromtimestamp(ts)
    tz = ts.tzinfo
    if ts.fold or ts.__class__ is not datetime or not (tz is None or tz is timezone.utc):
        return None, _zoned(ts)
    naive = ts if tz is None else ts.replace(tzinfo=None)
    return (naive - _EPOCH) // _MICROSECOND, None if tz is None else 0


def _zoned(ts: datetime) -> tuple[datetime, tzinfo | str | None]:
    """``ts`` as a naive ``datetime`` and a zone the parent may unpickle: a ``timezone``, the
    key of a ``ZoneInfo``, else the fixed offset the zone has at ``ts``."""
    tz = ts.tzinfo
    naive = datetime(*ts.timetuple()[:6], ts.microsecond, fold=ts.fold)
    zone: tzinfo | str | None = tz
    if tz is None or tz.__class__ is timezone:
        pass
    elif getattr(tz, "key", None).__class__ is str and _is_zoneinfo(tz):
        zone = tz.key  # type: ignore[attr-defined]
    else:
        offset, name = ts.utcoffset(), ts.tzname()
        if offset is None:
            zone = None
        else:
            zone = timezone(offset, name) if name.__class__ is str else timezone(offset)
    return naive, zone


def _is_zoneinfo(tz: tzinfo) -> bool:
    zoneinfo = sys.modules.get("zoneinfo")
    return zoneinfo is not None and tz.__class__ is zoneinfo.ZoneInfo


def unstamp(micros: int | None, zone: Any) -> datetime:
    if micros is None:
        naive, tz = zone
        if tz.__class__ is str:
            from zoneinfo import ZoneInfo

            tz = ZoneInfo(tz)
        return naive.replace(tzinfo=tz)  # type: ignore[no-any-return]
    ts = _EPOCH + micros * _MICROSECOND
    return ts if zone is None else ts.replace(tzinfo=timezone.utc)
