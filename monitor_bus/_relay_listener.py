"""The parent's end of the relay: the socket its children connect to and the thread reading them.

Guarantees
----------
- Leftovers: the socket's directory is removed when the relay closes; a new listener removes
  those of listeners that died without closing (``_socketdir.py``).
- Out of descriptors (EMFILE) when a child connects, the relay warns (throttled), stops
  watching the listening socket (a pending connection would make it spin) and tries to accept
  again after a back-off of 50 ms doubling to 1 s, or at a sweep; the child's connection waits
  in the backlog, its events in its socket.
- In the parent, one thread reads every child's socket and queues what it reads as
  ``log_event`` does (same queue, capacity, policy and counters), in each child's order, each
  event once, its origin (``Event.origin``) attached. It reads fairly: one chunk (64 KiB) from
  each child that has data, round by round, so a child writing flat out starves no other. It
  never waits: under ``"block"``, events that find the queue full wait for room in the queue's
  ``parked`` (at most one chunk's worth per child) and that child is not read meanwhile, so its
  kernel buffer fills and the child's own policy applies; room in the queue wakes the relay.
  ``flush()`` and ``close()`` first have it read and queue what each child had written when
  they were called (the bytes readable then), within their timeout; a closed bus counts what
  children send it afterwards as dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from . import _socketdir, _wire
from ._ratelimit import Throttle
from ._relay_address import CONNECT_TIMEOUT as _CONNECT_TIMEOUT
from ._relay_address import ENVIRONMENT
from ._relay_connection import Reception, _Connection
from ._wire import Refused

if TYPE_CHECKING:
    from ._bus import EventBus

logger = logging.getLogger("monitor_bus")

_READ_SIZE = 1 << 16
# Out of descriptors, the relay tries to accept again after the first, doubling to the second.
_ACCEPT_BACKOFF = (0.05, 1.0)


# A sweep: set once every connection is read up to its target (bytes read in all).
_Sweep = tuple[Future[None], dict[socket.socket, int]]


def _readable(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive buffer (FIONREAD: Linux, macOS, the BSDs)."""
    import fcntl  # Unix only, as the relay is
    import termios

    try:
        (n,) = struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0\0\0\0"))
    except OSError:  # closed meanwhile: nothing more to read
        return 0
    return int(n)


class Listener(Reception):
    """The parent's end: a socket children connect to and the thread that reads them."""

    def __init__(
        self,
        route: Callable[[tuple[int, int], str], EventBus | None],
        on_child: Callable[[], None] = lambda: None,
    ) -> None:
        self._route = route
        self._on_child = on_child  # a child connected (the relay's thread calls it)
        _wire.prepare()
        self._dir = _socketdir.make()
        self.path = os.path.join(self._dir, _socketdir.SOCKET)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(socket.SOMAXCONN)
        self._server.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._connections: dict[socket.socket, _Connection] = {}
        self._lock = threading.Lock()  # one reader at a time: the thread or a flush sweep
        self._sweeps: list[_Sweep] = []
        self._got: dict[socket.socket, int] = {}  # bytes read from each connection
        self._paused: set[socket.socket] = set()  # not read: their events found no room
        self._waiting: dict[int, EventBus] = {}  # buses with parked events, by id
        # Buses closing (by id): their children are asked for their windows, each waiter
        # settled once every child asked has answered or ended.
        self._closing: dict[int, EventBus] = {}
        self._collecting: list[tuple[Future[None], EventBus]] = []
        self.exiting = False  # set as the process exits: children are told so
        self._closed = False
        # Out of descriptors: when to try accepting again (None: the server socket is watched).
        self._retry_accept: float | None = None
        self._accept_backoff = 0.0
        self.received = 0
        self.refused = 0  # connections closed unheard or cut off for a message not allowed
        self._throttle = Throttle()
        self._thread = threading.Thread(target=self._run, name="monitor_bus.relay", daemon=True)
        self._thread.start()
        os.environ[ENVIRONMENT] = f"{os.getpid()}:{os.getpid()}:{self.path}"

    def sweep(self, timeout: float | None) -> bool:
        """Queue what the children had written when this was called; False if ``timeout``
        passed first (a bus under ``"block"`` has no room for it, say). Never waits longer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            if self._closed:
                return True
            self._accept()  # a child that connected before the call is swept too
            # What each connection holds now: the sweep is done once the relay has read and
            # queued that much, whatever a child writes meanwhile.
            targets = {sock: self._got.get(sock, 0) + _readable(sock) for sock in self._connections}
            if self._settled(targets):
                return True
            sweep: _Sweep = (Future(), targets)
            self._sweeps.append(sweep)
        finally:
            self._lock.release()
        self._wake()
        try:
            sweep[0].result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                if sweep in self._sweeps:
                    self._sweeps.remove(sweep)
            return sweep[0].done()
        return True

    def collect_windows(self, bus: EventBus, timeout: float | None) -> bool:
        """Before ``bus`` closes: queue what its children had written, ask each child that
        announced it for its Stats' open windows of it (``CLOSING``; one announcing it
        meanwhile is asked as it does) and wait, within ``timeout``, until each has answered
        (``SENT``, after its windows) or ended. A child that has not is named in a warning:
        what it sends later finds the bus closed and is counted as dropped. False then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.sweep(timeout)  # the announcements the children had written: they are asked
        with self._lock:
            if self._closed:
                return True
            self._closing[id(bus)] = bus
            for connection in self._connections.values():
                for index, announced in connection.buses.items():
                    if announced is bus:
                        self._ask(connection, index)
            if not self._unanswered(bus):  # no child has this bus: nothing to wait for
                del self._closing[id(bus)]
                return True
            waiter: tuple[Future[None], EventBus] = (Future(), bus)
            self._collecting.append(waiter)
        self._wake()
        with contextlib.suppress(FutureTimeout):
            waiter[0].result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            del self._closing[id(bus)]
            if waiter in self._collecting:
                self._collecting.remove(waiter)
            late = self._unanswered(bus)
        if late:
            logger.warning(
                "EventBus %r: %d child process(es) did not send their open Stat windows "
                "within %s s before the bus closed: %s; what they send it later is counted "
                "as dropped",
                bus._name,
                len(late),
                timeout,
                ", ".join(map(str, late)),
            )
        return not late

    def _unanswered(self, bus: EventBus) -> list[int | str]:
        """The pids of the children asked for ``bus``'s windows that have not answered, or
        whose answer came after events still parked (not queued yet)."""
        return [
            "?" if connection.origin is None else connection.origin.pid
            for sock, connection in self._connections.items()
            if any(connection.buses.get(index) is bus for index in connection.asked)
            or (sock in self._paused and bus in connection.buses.values())
        ]

    def _wake(self) -> None:
        """Have the relay's thread go round (a sweep asked, room in a queue, closing)."""
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _settled(self, targets: dict[socket.socket, int]) -> bool:
        """Whether every connection of a sweep is read to its target with nothing parked
        (or has ended)."""
        connections = self._connections
        got = self._got
        return all(
            sock not in connections or (got.get(sock, 0) >= target and sock not in self._paused)
            for sock, target in targets.items()
        )

    def _run(self) -> None:
        try:
            while self._serve():
                pass
        except BaseException:
            # Never quietly: children's events would stop arriving.
            logger.critical(
                "monitor_bus: the relay from child processes failed; their events no longer "
                "arrive (children count them as dropped)",
                exc_info=True,
            )
            with self._lock:
                self._closed = True
                sweeps, self._sweeps = self._sweeps, []
                collecting, self._collecting = self._collecting, []
            for future, _ in [*sweeps, *collecting]:
                future.set_result(None)
            self._release()

    def _serve(self) -> bool:
        """One round: wait for data, read one chunk from each connection that has some (round
        robin: a child writing flat out starves no other), queue what was parked if there is
        room now, and settle the sweeps that are done; False once closed. Never waits for
        room in a queue: a connection whose events find none is not read until there is."""
        retry = self._retry_accept
        ready = self._selector.select(None if retry is None else retry - time.monotonic())
        with self._lock:
            if self._closed:
                return False
            if self._retry_accept is not None and time.monotonic() >= self._retry_accept:
                self._accept()
            for key, _ in ready:
                sock = key.fileobj
                if sock is self._server:
                    self._accept()
                elif sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif sock in self._connections and sock not in self._paused:
                    self._read(self._connections[sock])  # not closed earlier in this round
            if self._waiting or self._paused:
                self._resume()
            if self._sweeps:
                done = [sweep for sweep in self._sweeps if self._settled(sweep[1])]
                for sweep in done:
                    self._sweeps.remove(sweep)
                    sweep[0].set_result(None)
            for waiter in [w for w in self._collecting if not self._unanswered(w[1])]:
                self._collecting.remove(waiter)
                waiter[0].set_result(None)
        return True

    def _accept(self) -> None:
        """Take the children waiting to connect. With no descriptor left (EMFILE), stop
        watching the server socket (a pending connection would keep it readable: a spin) and
        try again after a back-off the relay's ``select`` waits out; meanwhile the child's
        connection waits in the kernel's backlog, its events in its socket."""
        while True:
            try:
                sock, _ = self._server.accept()
            except BlockingIOError:  # none pending
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: no room for one more
                self._accept_later(exc)
                return
            if self._retry_accept is not None:  # room again: watch the server again
                self._retry_accept = None
                self._accept_backoff = 0.0
                self._selector.register(self._server, selectors.EVENT_READ)
            sock.setblocking(False)
            connection = _Connection(sock, None)
            try:
                found = _wire.peer(sock)
            except OSError:
                found = (0, -1)
            if found is not None:
                connection.peer = found[0]
                if found[1] != os.getuid():
                    self._refuse(connection, f"it runs as uid {found[1]}, not {os.getuid()}")
                    sock.close()
                    continue
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ)
            self._on_child()

    def _accept_later(self, exc: OSError) -> None:
        if self._retry_accept is None:
            self._selector.unregister(self._server)
        self._accept_backoff = min(
            _ACCEPT_BACKOFF[1], 2 * self._accept_backoff or _ACCEPT_BACKOFF[0]
        )
        self._retry_accept = time.monotonic() + self._accept_backoff
        if self._throttle.ready("accept"):  # (its other keys: the pids it refused)
            logger.warning(
                "monitor_bus: the relay could not accept a child process's connection (%s); "
                "it tries again, its events wait in its socket meanwhile",
                exc.strerror or exc,
            )

    def _read(self, connection: _Connection) -> None:
        """Read one chunk of what ``connection`` holds and queue its events; close it at its
        end, pause it when a bus under ``"block"`` had no room for them."""
        sock = connection.sock
        buffer = connection.buffer
        ended = False
        try:
            chunk = sock.recv(_READ_SIZE)
        except BlockingIOError:
            chunk = None
        except OSError:
            chunk = b""
        if chunk is not None and not chunk:
            ended = True
        elif chunk:
            self._got[sock] = self._got.get(sock, 0) + len(chunk)
            buffer += chunk
            try:
                self._messages(connection)
            except Refused:  # said why (throttled); nothing more of it is read
                buffer.clear()
                ended = True
            except Exception:  # a message that does not decode: the stream has lost its framing
                origin = connection.origin
                logger.exception(
                    "monitor_bus: a message from child process %s could not be read; its "
                    "connection is closed (what it sends later is lost)",
                    origin.pid if origin is not None else "?",
                )
                buffer.clear()
                ended = True
        if self._park(connection) and not ended:
            # Left in the kernel's buffer from now on: the child's own policy applies when
            # its side fills up.
            self._paused.add(sock)
            self._selector.unregister(sock)
        if ended:
            self._end(connection)

    def _park(self, connection: _Connection) -> bool:
        """Whether a bus ``connection`` feeds has events parked (no room under "block"); such
        a bus is unparked each round, and its queue wakes the relay when it has room."""
        parked = False
        for bus in connection.buses.values():
            if bus is not None and bus._queue.parked:
                bus._queue.on_room = self._wake
                self._waiting[id(bus)] = bus
                parked = True
        return parked

    def _resume(self) -> None:
        """Queue the parked events that fit now; read again the connections whose buses have
        nothing parked left."""
        for key, bus in list(self._waiting.items()):
            if bus._relay_unpark():
                del self._waiting[key]
        for sock in list(self._paused):
            buses = self._connections[sock].buses.values()
            if not any(bus is not None and bus._queue.parked for bus in buses):
                self._paused.discard(sock)
                self._selector.register(sock, selectors.EVENT_READ)

    def _end(self, connection: _Connection) -> None:
        """The child closed its end (or broke the framing): close ours."""
        sock = connection.sock
        if sock in self._paused:
            self._paused.discard(sock)
        else:
            self._selector.unregister(sock)
        del self._connections[sock]
        self._got.pop(sock, None)
        sock.close()
        if connection.buffer:
            origin = connection.origin
            logger.warning(
                "monitor_bus: child process %s ended in the middle of a message; the "
                "event it was sending is lost",
                origin.pid if origin is not None else "?",
            )

    def close(self) -> None:
        """Stop reading and remove the socket (at exit; children then fail to connect)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sweeps, self._sweeps = self._sweeps, []
            collecting, self._collecting = self._collecting, []
        for future, _ in [*sweeps, *collecting]:
            future.set_result(None)  # nothing more will be read
        self._wake()
        self._thread.join(_CONNECT_TIMEOUT)
        if not self._thread.is_alive():
            self._drain()
            self._release()

    def _drain(self) -> None:
        """At close, after the relay's thread: read what the children had written and the
        relay had not (their buses are closed by now, so it is counted as dropped there, not
        lost unseen); a child's later writes fail, and the child counts them."""
        self._accept()  # a child that connected but was not accepted yet has written too
        self._resume()  # a closed bus counts what was parked for it, and its children are read
        for connection in list(self._connections.values()):
            sock = connection.sock
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # what is in the buffer can still be read
            # A bus that is still open (no exit) parks what finds no room: left unread.
            while sock in self._connections and sock not in self._paused:
                got = self._got.get(sock, 0)
                self._read(connection)
                if sock in self._connections and self._got.get(sock, 0) == got:
                    break  # nothing more (its end was not shut: no EOF to end on)

    def _release(self) -> None:
        """Close the sockets and remove the socket's directory (the relay has stopped)."""
        if os.environ.get(ENVIRONMENT, "").startswith(f"{os.getpid()}:"):
            del os.environ[ENVIRONMENT]
        self._close_sockets()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _close_sockets(self) -> None:
        for sock in (self._server, self._wake_r, self._wake_w, *self._connections):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError, ValueError):
            self._selector.close()

    def after_fork_in_child(self) -> None:
        """In a forked child: let go of the parent's sockets without touching its files."""
        self._close_sockets()
