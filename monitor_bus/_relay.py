"""Child processes report to their parent: the relay between them.

Guarantees
----------
- Who reports where: the first process of a family to register a handler (on any bus) listens
  on a Unix socket in a private directory and names it in the environment variable
  ``MONITOR_BUS_PARENT`` (``<parent pid>:<listener pid>:<path>``). Its ``multiprocessing``
  children (fork, spawn and forkserver: ``Process``, ``Pool``, ``ProcessPoolExecutor``,
  DataLoader workers) and its ``os.fork`` children find it there, and so do theirs: a whole
  family reports to its first listening process. Other programs it starts (``subprocess``)
  are not its children here: they inherit the variable but check that ``multiprocessing``
  started them. A forkserver child that logs before ``multiprocessing`` has set it up (while
  its task's module is imported) reports nowhere.
- Who is heard: only a process that proves it is a child of the family (``_wire.py``: the
  ``multiprocessing`` key, the peer's pid and uid from the kernel) before anything else; only
  plain values are decoded, and each message must have its kind's shape and types
  (``_wire.check``) and name only buses its connection announced. Any other connection
  (another program of the same user, a plain ``subprocess``) is closed unheard, and a child's
  at its first message that breaks these rules (what it sent before is taken), with a warning
  naming its pid and why (at most once per 10 s per pid; a warning, not an error: the relay
  and every other child go on); the relay thread never waits on it. A child's events carry
  the pid it proved as their origin, never a pid its messages state. A child checks
  the listener's pid and uid before it sends anything, so nobody else receives its events.
- Leftovers: the socket's directory is removed when the relay closes; a new listener removes
  those of listeners that died without closing (``_socketdir.py``).
- What a child sends: each event and each Stat window logged on a bus with
  ``children="forward"`` (the default), written to the socket by ``log_event`` itself, before
  it returns: an event whose ``log_event`` returned is in the kernel's buffer and survives the
  child's death. A signal (Ctrl-C) interrupting ``log_event`` while it writes breaks the
  connection (the stream may hold half a message): that event and every later one are counted
  as dropped. The child runs none of the handlers it inherited; handlers it registers
  itself get its events too. The parent answers each bus's announcement with whether it has a
  bus to take it; a child stops sending the events of a bus its parent has none for (a bus of
  the child's own, say) as soon as it reads that answer. When the parent's bus is closed (the
  parent is exiting), the answer says so: the child counts that bus's events as dropped, those
  it sent before reading the answer included, and reports them (it reads a late answer as it
  exits).
- Open windows at the parent's close: a child announces a bus with its first message, or as
  soon as a Stat of it holds a sample. Before the parent's bus closes (``close()``, and so at
  exit), the parent asks each child that announced it for its open windows (``CLOSING``); a
  thread of the child, which reads the parent's messages as they come, closes that bus's
  Stats' windows, sends them and then says so (``SENT``). The parent waits for every answer
  (or the child's end) within half the close's timeout, and names in a warning the children
  that did not answer (what they send later is counted as dropped there). From then on the
  child counts what it logs on that bus as dropped and says why: the parent closed its bus,
  or is exiting; "the parent process is gone" only when it is.
- Never a hang: the socket is non-blocking. When its buffer is full (the parent is not reading
  fast enough) the bus's overflow policy decides: ``"block"`` waits up to ``block_timeout``
  for room, the others drop the event and count it; a Stat window waits up to the bus's
  ``exit_timeout``. Each send waits only its own budget: the wait for room holds no lock, so
  a window waiting does not hold up another thread's event. A parent that is gone or not
  listening costs a failed ``connect`` once; a socket that cannot be made (no descriptor
  left: EMFILE) costs that event only, and the next one tries again. What a child could not
  send is counted in its ``stats()["dropped"]``, reported on its ``monitor_bus`` logger (at
  most once per 10 s) and, while the parent listens, sent to the parent, which adds it to its
  own ``dropped``.
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
- What a killed child loses: SIGTERM or SIGKILL loses its Stats' open windows and an event
  it was writing at that instant (the parent warns of a torn message), nothing it logged
  before. A child that ends normally (a ``Pool`` or DataLoader worker included) first sends
  its open windows, and so does one still alive when its parent closes its bus or exits
  (persistent DataLoader workers, a kept iterator's), before ``multiprocessing`` terminates it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import selectors
import shutil
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from . import _socketdir, _wire
from ._event import EventOrigin
from ._ratelimit import Throttle
from ._wire import BUS as _BUS
from ._wire import CLOSED as _CLOSED
from ._wire import CLOSING as _CLOSING
from ._wire import DROPPED as _DROPPED
from ._wire import EVENT as _EVENT
from ._wire import EXITING as _EXITING
from ._wire import HEADER as _HEADER
from ._wire import HELLO as _HELLO
from ._wire import NO_BUS as _NO_BUS
from ._wire import ROUTED as _ROUTED
from ._wire import SENT as _SENT
from ._wire import VERDICT as _VERDICT
from ._wire import WINDOW as _WINDOW
from ._wire import Refused
from ._wire import frame as _frame
from ._wire import stamp as _stamp

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._queue import _Item

logger = logging.getLogger("monitor_bus")

ENVIRONMENT = "MONITOR_BUS_PARENT"

# Asked of the kernel for each child's socket (it caps this at net.core.wmem_max): the room a
# child has before the overflow policy applies.
_SEND_BUFFER = 4 << 20
_READ_SIZE = 1 << 16
_CONNECT_TIMEOUT = 1.0
# Out of descriptors, the relay tries to accept again after the first, doubling to the second.
_ACCEPT_BACKOFF = (0.05, 1.0)
_CLOSED_WHY = "the parent process closed its bus"
_EXITING_WHY = "the parent process is exiting (its bus is closed)"
_GONE = "the parent process is gone"
_INTERRUPTED = "a signal interrupted a send (the stream lost its framing)"


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


def _writable(sock: socket.socket, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (None: no limit) until ``sock`` has room to write (or
    has failed: the next send says how). ``poll`` needs no descriptor of its own (EMFILE)."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLOUT)
    except (OSError, ValueError):  # closed by another thread meanwhile: the retry sees it
        return True
    # poll takes a C int of milliseconds (24 days): a longer wait goes round again.
    ms = None if timeout is None else min(max(0, math.ceil(timeout * 1000)), 2**31 - 1)
    return bool(poller.poll(ms))


def _worker_id() -> int | None:
    """The torch DataLoader worker id of this process, if it is one (torch is not imported here:
    only a process that imported it can be a DataLoader worker)."""
    data = sys.modules.get("torch.utils.data")
    info = getattr(data, "get_worker_info", lambda: None)()
    return getattr(info, "id", None)


def parse_environment() -> tuple[int, int, str] | None:
    """The parent's pid, its listener's pid and the listener's path named by
    ``MONITOR_BUS_PARENT``, if another process set it."""
    pid, _, rest = os.environ.get(ENVIRONMENT, "").partition(":")
    listener, _, path = rest.partition(":")
    if not (pid.isdigit() and listener.isdigit()) or not path or int(pid) == os.getpid():
        return None
    return int(pid), int(listener), path


class Uplink:
    """A child's end: sends the events of its forwarding buses to the parent's listener.

    ``linked`` is None until the first send checks that this process is a child of the
    process that set the environment (``subprocess`` programs inherit it too).
    """

    def __init__(
        self,
        path: str,
        parent_pid: int,
        listener_pid: int,
        *,
        linked: bool | None,
        unlinked: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        self.parent_pid = parent_pid
        self.listener_pid = listener_pid  # the parent's, or the process its parent reports to
        self.linked = linked
        self._unlinked = unlinked  # called if resolve() finds this process is no such child
        self._sock: socket.socket | None = None
        self._broken: str | None = None  # why nothing can be sent any more
        self._lock = threading.RLock()
        self._sending = False  # a signal handler or finalizer logging mid-send drops its event
        # Each bus is announced once, with an index (``bus._relay_index``) its messages carry.
        self._next_index = 1
        self._verdicts_due: weakref.WeakValueDictionary[int, EventBus] = (
            weakref.WeakValueDictionary()
        )
        self._verdicts = bytearray()
        # For each bus awaiting its answer: its ``_to_parent`` before it was announced (what
        # it sent since is dropped if the answer is _CLOSED).
        self._sent_before: dict[int, int] = {}
        # Buses whose parent bus is closed (answered _CLOSED, or _CLOSING and their windows
        # sent), with why: what they log is counted here.
        self._refused: weakref.WeakKeyDictionary[EventBus, str] = weakref.WeakKeyDictionary()
        self._announced: weakref.WeakValueDictionary[int, EventBus] = weakref.WeakValueDictionary()
        self._requests: list[int] = []  # buses asked for their windows (_CLOSING), by index
        self._exiting = False  # the parent said it is exiting
        # Reads the parent's messages once connected (None: the sends read them).
        self._listening: threading.Thread | None = None
        # Drops not yet reported to the parent, per bus.
        self._unreported: weakref.WeakKeyDictionary[EventBus, int] = weakref.WeakKeyDictionary()
        self._throttle = Throttle()

    def send(self, bus: EventBus, item: _Item, *, window: bool) -> None:
        """Write one event (or Stat window) of ``bus`` to the parent, or count it dropped.

        Waits for room at most its own budget (a window: the bus's ``exit_timeout``; under
        ``"block"``: ``block_timeout``; else not at all), and never with the lock held: a
        window waiting for room does not hold up another thread's event.
        """
        if self.linked is None and not self.resolve():
            return
        if window:
            wait: float | None = bus._exit_timeout
        elif bus._overflow == "block":
            wait = bus._block_timeout
        else:
            wait = 0.0
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            with self._lock:
                if self._sending:
                    self._drop(bus, "a signal handler or finalizer logged during a send")
                    return
                self._sending = True
                try:
                    full = self._send_locked(bus, item, window, deadline)
                except BaseException:  # Ctrl-C mid-write: the stream may hold half a message
                    self._break(_INTERRUPTED)
                    self._drop(bus, _INTERRUPTED)
                    raise
                finally:
                    self._sending = False
            if full is None:
                return
            # No room: wait for some without the lock, then try again (the last try drops).
            try:
                _writable(full, None if deadline is None else deadline - time.monotonic())
            except BaseException:  # Ctrl-C while waiting: nothing of it was written
                self._drop(bus, "a signal interrupted its wait for room")
                raise

    def resolve(self) -> bool:
        """Whether this process is a ``multiprocessing`` child of the listener's process
        (checked once; a ``subprocess`` program inherits the environment too)."""
        mp = sys.modules.get("multiprocessing")
        parent = getattr(mp.parent_process(), "pid", None) if mp is not None else None
        # A spawned child before multiprocessing has set its parent_process(): importing the
        # task's module, say.
        spawning = "--multiprocessing-fork" in sys.argv and os.getppid() == self.parent_pid
        self.linked = parent == self.parent_pid or spawning
        if self.linked:
            self.adopt()
        else:
            self._unlinked()
        return self.linked

    def adopt(self) -> None:
        """Point this process's own children at the listener this one reports to."""
        os.environ[ENVIRONMENT] = f"{os.getpid()}:{self.listener_pid}:{self.path}"

    def _send_locked(
        self, bus: EventBus, item: _Item, window: bool, deadline: float | None
    ) -> socket.socket | None:
        """Try once to write the message: sent, or dropped and counted (None), or the socket
        to wait on for room (full, with time left before ``deadline``)."""
        if self._sock is None and self._broken is None:
            try:
                self._connect()
            except OSError as exc:  # no descriptor (EMFILE) or memory: tried again next time
                self._drop(bus, f"no socket could be made ({exc.strerror or exc})")
                return None
        if self._broken is not None:
            self._drop(bus, self._broken)
            return None
        if self._verdicts_due:
            self._read_verdicts(answers_only=self._listening is not None)
        if bus._uplink is None:
            return None  # the parent has no such bus: nothing to send it, as with no handler
        why = self._refused.get(bus)
        if why is not None:
            self._drop(bus, why)
            return None
        index = bus._relay_index or self._next_index
        name, timestamp, data = item
        try:
            message = _frame((_WINDOW if window else _EVENT, index, name, *_stamp(timestamp), data))
        except Exception as exc:  # noqa: BLE001 - a device value read as it is pickled failed
            self._drop(bus, f"it could not be encoded ({exc!r})")
            return None
        if bus._relay_index and not self._unreported:
            frames = message  # the common case: nothing to say first
        else:
            frames = b"".join(self._preamble(bus, index)) + message
        if not self._write(frames, 0.0):
            sock = self._sock
            time_left = deadline is None or time.monotonic() < deadline
            if self._broken is None and sock is not None and time_left:
                return sock
            self._drop(bus, self._broken or "its socket is full (the parent reads too slowly)")
            return None
        self._announced_as(bus, index)
        bus._to_parent += 1
        return None

    def _announced_as(self, bus: EventBus, index: int) -> None:
        """``bus``'s preamble (``_preamble``) is written: it is known to the parent by
        ``index``, and the drops it reported are no longer due."""
        if not bus._relay_index:
            bus._relay_index = index
            self._next_index += 1
            self._verdicts_due[index] = bus
            self._sent_before[index] = bus._to_parent
            self._announced[index] = bus
        for b in [b for b in self._unreported if b._relay_index]:
            del self._unreported[b]  # reported in the preamble

    def announce(self, bus: EventBus) -> None:
        """Announce ``bus`` to the parent now (a Stat of it holds samples), not with its first
        message: the parent asks the children it knows of for their open windows before its
        bus closes. What fails here is left to the window's own send, which counts it."""
        if bus._relay_index or (self.linked is None and not self.resolve()):
            return
        with self._lock:
            if bus._relay_index or self._sending:
                return
            self._sending = True
            try:
                if self._sock is None and self._broken is None:
                    with contextlib.suppress(OSError):
                        self._connect()
                if self._sock is None or self._broken is not None:
                    return
                index = self._next_index
                if self._write(b"".join(self._preamble(bus, index)), 0.0):
                    self._announced_as(bus, index)
            except BaseException:  # Ctrl-C mid-write: the stream may hold half a message
                self._break(_INTERRUPTED)
                raise
            finally:
                self._sending = False

    def _read_verdicts(self, *, answers_only: bool = False) -> bool:
        """Take the parent's answers to this child's bus announcements: a bus the parent has
        no bus for stops forwarding (costing the child nothing more); a bus whose parent bus
        is closed counts what it sent since its announcement, and all it sends later, as
        dropped. A bus whose parent bus is closing is queued in ``_requests``; with
        ``answers_only`` (a send, while a thread reads the parent's messages), reading stops
        before the first such request: left in the socket, it wakes that thread. Whether the
        parent closed the connection."""
        sock = self._sock
        assert sock is not None
        ended = False
        try:
            if answers_only:  # (the thread that reads sees the end of the stream, if any)
                self._verdicts += sock.recv(self._answers(sock.recv(4096, socket.MSG_PEEK)))
            else:
                while chunk := sock.recv(4096):
                    self._verdicts += chunk
                ended = True
        except BlockingIOError:  # nothing more yet
            pass
        except OSError:  # reset: the parent is gone
            ended = True
        size = _VERDICT.size
        while len(self._verdicts) >= size:
            index, verdict = _VERDICT.unpack_from(self._verdicts)
            del self._verdicts[:size]
            if verdict & _EXITING:
                self._exiting = True
                verdict &= ~_EXITING
            if verdict == _CLOSING:
                self._requests.append(index)
                continue
            bus = self._verdicts_due.pop(index, None)
            sent_before = self._sent_before.pop(index, 0)
            if bus is None or verdict == _ROUTED:
                continue
            if verdict == _CLOSED:
                self._refused[bus] = _EXITING_WHY if self._exiting else _CLOSED_WHY
                lost = bus._to_parent - sent_before
                bus._to_parent = sent_before
                self._drop(bus, self._refused[bus], lost)
            else:
                bus._uplink = None
        return ended

    def _answers(self, peeked: bytes) -> int:
        """How many bytes of ``peeked`` (after ``_verdicts``) come before the first request."""
        size = _VERDICT.size
        data = self._verdicts + peeked
        end = 0
        while end + size <= len(data) and data[end + size - 1] & ~_EXITING != _CLOSING:
            end += size
        return max(0, end - len(self._verdicts))

    def _listen(self, sock: socket.socket) -> None:
        """The thread that reads the parent's messages as they come (``_read_verdicts``) and
        answers its requests for windows (``_send_windows``), until the connection ends."""
        poller = select.poll()  # needs no descriptor of its own
        poller.register(sock, select.POLLIN)
        while True:
            poller.poll()
            with self._lock:
                if self._sock is not sock or self._broken is not None:
                    return  # closed here: nothing more to read
                ended = self._read_verdicts()
                requests, self._requests = self._requests, []
                if ended:  # nothing can be sent any more: say why
                    self._break("the parent process has exited" if self._exiting else _GONE)
            for index in requests:
                self._send_windows(index)
            if ended:
                return

    def _send_windows(self, index: int) -> None:
        """The parent's bus is closing: send the open Stat windows of the bus announced as
        ``index`` (none if it is gone), then say they are sent (the parent waits for that);
        what the bus logs afterwards is counted here."""
        bus = self._announced.get(index)
        if bus is not None:
            for stat in bus._stats():
                stat._close()
        with self._lock:
            if bus is not None:
                self._refused[bus] = _EXITING_WHY if self._exiting else _CLOSED_WHY
            if self._sock is not None and self._broken is None:
                self._write(_frame((_SENT, index)), _CONNECT_TIMEOUT)

    def _await_verdicts(self, wait: float) -> None:
        """At exit: read the answers still due (up to ``wait`` seconds), so that events a
        closed parent bus discarded are counted as dropped."""
        deadline = time.monotonic() + wait
        while self._verdicts_due and self._sock is not None and self._broken is None:
            if self._read_verdicts():
                return  # the parent closed the connection: no answer will come
            left = deadline - time.monotonic()
            if not self._verdicts_due or left <= 0:
                return
            poller = select.poll()  # needs no descriptor of its own (EMFILE at exit)
            poller.register(self._sock, select.POLLIN)
            if not poller.poll(math.ceil(left * 1000)):
                return

    def _preamble(self, bus: EventBus, index: int) -> list[bytes]:
        """What goes before ``bus``'s next message: its announcement, the first time (as
        ``index``), and the drops of announced buses not reported yet."""
        frames = []
        if not bus._relay_index:
            frames.append(_frame((_BUS, index, bus._creator, bus._name)))
        for b, n in self._unreported.items():
            i = index if b is bus else b._relay_index
            if i:
                frames.append(_frame((_DROPPED, i, n)))
        return frames

    def _write(self, data: bytes, wait: float | None) -> bool:
        """Write ``data`` whole: False (nothing written) if there was no room within ``wait``
        seconds; a message cut off halfway breaks the connection (the stream lost its framing)."""
        sock = self._sock
        assert sock is not None
        view = memoryview(data)
        deadline = None if wait is None else time.monotonic() + wait
        started = False
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                sent = 0
            except OSError as exc:  # the parent is gone
                self._break(f"{_GONE} ({exc.strerror or exc})")
                return False
            if sent:
                started = True
                view = view[sent:]
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if not started and left is not None and left <= 0:
                return False
            # Halfway through a message, finish it (bounded): the stream must stay framed.
            limit = _CONNECT_TIMEOUT if started and (left is None or left <= 0) else left
            if not _writable(sock, limit):
                if started:
                    self._break("the parent stopped reading in the middle of a message")
                return False
        return True

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
            sock.settimeout(_CONNECT_TIMEOUT)
            sock.connect(self.path)
            impostor = _wire.check_listener(sock, self.listener_pid)  # before sending anything
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            self._broken = f"the parent is not listening ({exc.strerror or exc})"
            return
        if impostor is not None:
            sock.close()
            self._broken = impostor
            return
        self._sock = sock
        hello = _wire.credentials(self.listener_pid) + _frame((_HELLO, os.getpid(), _worker_id()))
        if not self._write(hello, None):
            self._break("the parent did not take this child's first message")
            return
        thread = threading.Thread(
            target=self._listen, args=(sock,), name="monitor_bus.uplink", daemon=True
        )
        with contextlib.suppress(RuntimeError):  # at interpreter shutdown: the sends read
            thread.start()
            self._listening = thread

    def _break(self, why: str) -> None:
        self._broken = why
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread that reads it
            with contextlib.suppress(OSError):
                self._sock.close()

    def _drop(self, bus: EventBus, why: str, count: int = 1) -> None:
        """Count ``count`` events of ``bus`` that did not reach the parent, and say so
        (throttled)."""
        if count <= 0:
            return
        queue = bus._queue
        queue.count_dropped(count, said=True)
        if self._broken is None and bus not in self._refused:
            self._unreported[bus] = self._unreported.get(bus, 0) + count
        if self._throttle.ready(why):
            logger.warning(
                "EventBus %r in child process %d: events not sent to the parent process %d: "
                "%s; %d dropped in all",
                bus._name,
                os.getpid(),
                self.parent_pid,
                why,
                queue.dropped,
            )

    def after_fork_in_child(self) -> None:
        """In a forked child: let go of the parent's connection (the child makes its own)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def close(self) -> None:
        """Send the drops not reported yet (at exit), then close the socket."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return
            self._await_verdicts(_CONNECT_TIMEOUT)
            unreported = [(b._relay_index, n) for b, n in self._unreported.items()]
            unreported = [(i, n) for i, n in unreported if i]
            if unreported and self._broken is None:
                frames = b"".join(_frame((_DROPPED, i, n)) for i, n in unreported)
                if self._write(frames, _CONNECT_TIMEOUT):
                    self._unreported.clear()
            self._sock = None
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread that reads it
            with contextlib.suppress(OSError):
                sock.close()


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


class Listener:
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

    def _ask(self, connection: _Connection, index: int) -> None:
        """Ask ``connection``'s child for the open windows of its bus ``index``."""
        verdict = _CLOSING | (_EXITING if self.exiting else 0)
        try:
            connection.sock.send(_VERDICT.pack(index, verdict))
        except OSError:  # its end is closed: it has sent all it will
            return
        connection.asked.add(index)

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
