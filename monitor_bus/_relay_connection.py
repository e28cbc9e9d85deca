"""What the parent takes from one child's connection: a proof first, then checked messages.

Guarantees
----------
- Who is heard: only a process that proves it is a child of the family (``_wire.py``: the
  ``multiprocessing`` key, the peer's pid and uid from the kernel) before anything else; only
  plain values are decoded, and each message must have its kind's shape and types
  (``_wire.check``) and name only buses its connection announced. Any other connection
  (another program of the same user, a plain ``subprocess``) is closed unheard, and a child's
  at its first message that breaks these rules (what it sent before is taken), with a warning
  naming its pid and why (at most once per 10 s per pid; a warning, not an error: the relay
  and every other child go on); the relay thread never waits on it. A child's events carry
  the pid it proved as their origin, never a pid its messages state.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _wire
from ._event import EventOrigin
from ._wire import BUS as _BUS
from ._wire import CLOSED as _CLOSED
from ._wire import CLOSING as _CLOSING
from ._wire import DROPPED as _DROPPED
from ._wire import EVENT as _EVENT
from ._wire import EXITING as _EXITING
from ._wire import HEADER as _HEADER
from ._wire import NO_BUS as _NO_BUS
from ._wire import ROUTED as _ROUTED
from ._wire import SENT as _SENT
from ._wire import VERDICT as _VERDICT
from ._wire import WINDOW as _WINDOW
from ._wire import Refused

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._ratelimit import Throttle

logger = logging.getLogger("monitor_bus")


class _Connection:
    """The parent's end of one child's socket."""

    __slots__ = ("asked", "buffer", "buses", "origin", "peer", "sock", "trusted")

    def __init__(self, sock: socket.socket, peer: int | None) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.origin: EventOrigin | None = None
        self.buses: dict[int, EventBus | None] = {}
        self.peer = peer  # its pid, as the kernel says (None: this platform cannot say)
        self.trusted = False  # it proved it is a child (its first message)
        self.asked: set[int] = set()  # its buses asked for their windows, not answered yet


class Reception:
    """The listener's part that reads a connection's messages and answers them (``Listener``
    mixes it in: the relay's thread runs it, under the listener's lock)."""

    # The listener's, set in its ``__init__``.
    _route: Callable[[tuple[int, int], str], EventBus | None]
    _closing: dict[int, EventBus]  # buses closing, by id: their children are asked (``_ask``)
    _throttle: Throttle
    exiting: bool
    received: int
    refused: int

    def _messages(self, connection: _Connection) -> None:
        """Take each whole message in ``connection``'s buffer; ``Refused`` (said once, why and
        whose) at the first one the protocol does not allow: nothing after it is taken."""
        buffer = connection.buffer
        start = 0
        end = len(buffer)
        header = _HEADER.size
        view = memoryview(buffer)
        try:
            while end - start >= header:
                (size,) = _HEADER.unpack_from(buffer, start)
                if size > _wire.MAX_FRAME or (not connection.trusted and size != _wire.AUTH_SIZE):
                    raise Refused(f"it sent a message of {size} bytes")
                if end - start - header < size:
                    break
                with view[start + header : start + header + size] as body:
                    start += header + size
                    if not connection.trusted:
                        self._authenticate(connection, body)
                        continue
                    try:
                        message = _wire.loads(body)
                    except Exception as exc:  # noqa: BLE001 - whatever a bad pickle raises
                        raise Refused(f"its message was refused ({exc!r})") from None
                self._dispatch(connection, _wire.check(message))
        except Refused as exc:
            raise self._refuse(connection, str(exc)) from None
        finally:
            view.release()
            del buffer[:start]

    def _authenticate(self, connection: _Connection, body: memoryview) -> None:
        pid = _wire.check_credentials(body, connection.peer)
        connection.trusted = True
        connection.origin = EventOrigin(pid, None)  # its events' origin: the pid it proved

    def _refuse(self, connection: _Connection, why: str) -> Refused:
        """Say (throttled, per pid) that ``connection`` is closed unheard; the exception that
        has ``_read`` close it. A warning, not an error: the peer broke the protocol (or is no
        child), the relay and every other connection go on; the traceback would show only
        the relay's own frames."""
        self.refused += 1
        if self._throttle.ready(connection.peer):
            logger.warning(
                "monitor_bus: the relay refused process %s: %s; its connection is closed and "
                "nothing more it sends is taken (%d refused in all)",
                "?" if connection.peer is None else connection.peer,
                why,
                self.refused,
            )
        return Refused(why)

    def _dispatch(self, connection: _Connection, message: tuple[Any, ...]) -> None:
        """Act on one message (``_wire.check``ed); ``Refused`` if the connection may not send
        it: an event or drop count of a bus it did not announce, a bus announced twice,
        another process's pid."""
        kind = message[0]
        buses = connection.buses
        if kind in (_EVENT, _WINDOW):
            if message[1] not in buses:
                raise Refused(f"it sent an event for bus {message[1]}, never announced")
            bus = buses[message[1]]
            if bus is not None:  # else the parent has no such bus (the child is told so)
                self.received += 1
                bus._relay_in(message[2:], connection.origin, kind == _WINDOW)
        elif kind == _BUS:
            _, index, creator, name = message
            if index in buses:
                raise Refused(f"it announced bus {index} twice")
            bus = self._route(creator, name)
            verdict = _NO_BUS if bus is None else _CLOSED if bus._closed else _ROUTED
            if verdict == _CLOSED and self.exiting:
                verdict |= _EXITING
            # A closed bus is kept: what the child sent it before reading the answer is
            # counted dropped here (the child may end first), and the child reports none of it.
            buses[index] = bus
            with contextlib.suppress(OSError):  # the child reads it when it can, if ever
                connection.sock.send(_VERDICT.pack(index, verdict))
            if bus is not None and id(bus) in self._closing:
                self._ask(connection, index)
        elif kind == _SENT:
            if message[1] not in connection.asked:
                raise Refused(f"it sent the windows of bus {message[1]} unasked")
            connection.asked.discard(message[1])  # its windows came before: all queued
        elif kind == _DROPPED:
            if message[1] not in buses:
                raise Refused(f"it reported drops of bus {message[1]}, never announced")
            bus = buses[message[1]]
            if bus is not None:
                bus._queue.count_dropped(message[2], by_children=True)
        else:  # _HELLO: its DataLoader worker id
            origin = connection.origin
            assert origin is not None  # set when it proved its pid
            if message[1] != origin.pid:
                raise Refused(f"it claimed to be process {message[1]}")
            connection.origin = EventOrigin(origin.pid, message[2])

    def _ask(self, connection: _Connection, index: int) -> None:
        """Ask ``connection``'s child for the open windows of its bus ``index``."""
        verdict = _CLOSING | (_EXITING if self.exiting else 0)
        try:
            connection.sock.send(_VERDICT.pack(index, verdict))
        except OSError:  # its end is closed: it has sent all it will
            return
        connection.asked.add(index)
