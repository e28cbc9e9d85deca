"""The child's end of the relay: it sends its forwarding buses' events to the parent.

Guarantees
----------
- Whom a child speaks to: a child checks the listener's pid and uid before it sends anything,
  so nobody else receives its events.
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
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _wire
from ._ratelimit import Throttle
from ._relay_address import CONNECT_TIMEOUT as _CONNECT_TIMEOUT
from ._relay_address import ENVIRONMENT
from ._wire import BUS as _BUS
from ._wire import CLOSED as _CLOSED
from ._wire import CLOSING as _CLOSING
from ._wire import DROPPED as _DROPPED
from ._wire import EVENT as _EVENT
from ._wire import EXITING as _EXITING
from ._wire import HELLO as _HELLO
from ._wire import ROUTED as _ROUTED
from ._wire import SENT as _SENT
from ._wire import VERDICT as _VERDICT
from ._wire import WINDOW as _WINDOW
from ._wire import frame as _frame
from ._wire import stamp as _stamp

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._queue import _Item

logger = logging.getLogger("monitor_bus")

# Asked of the kernel for each child's socket (it caps this at net.core.wmem_max): the room a
# child has before the overflow policy applies.
_SEND_BUFFER = 4 << 20
_CLOSED_WHY = "the parent process closed its bus"
_EXITING_WHY = "the parent process is exiting (its bus is closed)"
_GONE = "the parent process is gone"
_INTERRUPTED = "a signal interrupted a send (the stream lost its framing)"


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
