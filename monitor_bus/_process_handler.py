"""A sink in another process: ``ProcessHandler`` feeds a handler in a child process in batches.

This is the parent's end. The messages and their framing are ``_process_link``'s, the child's
end ``_process_sink``'s, starting and ending the child ``_process_start``'s.

Guarantees
----------
- Threads: ``__call__`` and ``flush()`` run on the handler's own thread, as for any sync
  handler that is not a bundled sink (a flush waits for this child only, never for the bundled
  sinks' shared thread); nothing here blocks the thread that logs. ``close()`` and ``stats()``
  may be called from any thread.
- Bounded: at most ``max_pending`` events are sent and not yet acknowledged by the child.
  Past that the handler thread waits for the child, up to ``timeout`` seconds, then counts the
  events it could not send as dropped (meanwhile the bus's own per-handler backlog bound holds).
- Counted: the child acknowledges every message with how many events its sink handled, how
  many calls raised and how many events the sink lost (a bundled sink's ``_monitor_bus_lost``:
  a full disk), which count as dropped, not handled.
  ``received == handled + dropped + pending + buffered`` (see ``stats()``).
- Flushed: ``flush()`` sends what is buffered and returns once the child has acknowledged
  everything sent (handled it and called its sink's ``flush()``), or after ``timeout`` (then
  the events stay pending, counted). ``bus.flush(t)`` returns True only once the child has
  acknowledged every event the bus delivered before the call: past the handler thread's own
  wait it waits on, from the caller's thread, up to ``t``.
- Exit: ``close(timeout)`` has the child flush and close its sink and exit; past the timeout
  the child is terminated (killed if it has not ended a moment later: a stopped process never
  acts on SIGTERM), so ``close`` returns within its timeout and a fraction of a second, and
  what it had not acknowledged counts as dropped. At interpreter exit a ``multiprocessing``
  finalizer does the same within ``exit_timeout``: after the buses are closed (so what they
  deliver at exit reaches the child) and before ``multiprocessing`` terminates its daemonic
  children.
- Crash: a child that exits unasked (a crash, SIGKILL) is seen through its sentinel or the
  connection, logged on the ``monitor_bus`` logger with its exit code, and the events it had
  not acknowledged count as dropped, as does every later event: it is not restarted.
- Told to the bus: every event counted in ``dropped`` is told once to the bus that delivered it
  (``_monitor_bus_lost``, asked after each batch and when the handler leaves), which moves it
  from its ``delivered`` to its ``dropped`` and reports it: on the bus, ``delivered`` counts
  what the child acknowledged or still holds. A loss found from the caller's thread (a
  ``bus.flush``) is told at the handler's next batch or when it leaves the bus. When it leaves,
  the child's sink first gives up what it could not write (as on the bus directly), which is
  told then. The sink's errors in the child count as the handler's errors on the bus
  (``_monitor_bus_errors``).
- Exit's warning says why: a child stopped after ``exit_timeout``, or one already gone, with
  its exit code or signal (then at once: no time is spent on it).
- Never a hang: every wait has a timeout. Frames are written to the Pipe's socket with a
  timeout (``Connection.send_bytes`` has none); a child that reads nothing for ``timeout``
  seconds is terminated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._check import check_int, check_timeout
from ._event import Event
from ._handler import call_each
from ._lifecycle import process
from ._process_link import (
    ACK,
    BATCH,
    CHUNK,
    CLOSE,
    FAILED,
    FINAL,
    FLUSH,
    READY,
    frame,
    read_frames,
    tagged,
    wait_ready,
    wire,
)
from ._process_start import check_start_method, end, exit_status, is_factory, start_child
from ._queue import SLOTS, count_events
from ._ratelimit import LOG_INTERVAL, Throttle

logger = logging.getLogger("monitor_bus")

# Seconds a child stopped for not responding gets to end on SIGTERM before SIGKILL; at close,
# which must keep to its timeout, a moment (a stopped process never acts on SIGTERM).
_GRACE = 1.0
_CLOSE_GRACE = 0.2
# Runs after monitor_bus's own exit finalizer (priority 100), which closes the buses.
_EXIT_PRIORITY = 10


class ProcessHandler:
    """Run a sink in a child process, fed in batches, so its CPU leaves this interpreter's lock.

    Register it like any handler: ``bus.register_event_handler(ProcessHandler(factory),
    name="jsonl")``. It buffers the events it is given and sends them to the child through a
    ``multiprocessing`` Pipe in ``flush()``, which the bus calls after each delivered batch
    (and every 1024 events within a batch). The child builds the sink, calls it with the
    events of each message as a bus would (one sync ``handle_batch`` call if the sink has one
    that knows of its ``__call__``, else once per event) and calls its ``flush()`` when this
    handler's ``flush()`` asks, then acknowledges. Once
    ``bus.flush()`` returns True, the sink has handled and flushed every event delivered so
    far; a child slower than ``timeout`` makes it wait on (up to its own timeout), and a
    child gone unasked makes it return False.

    Worth it on a machine with a spare core and a sink that costs more per event than sending
    it (about 0.5 µs of this process's CPU); ``Event.origin`` crosses with the event. The
    child is a daemonic ``multiprocessing`` process started when the handler is made; with
    ``spawn`` it imports your ``__main__`` module, which must be guarded by
    ``if __name__ == "__main__":``. ``__call__`` and ``flush()`` are for one thread (the bus's
    handler thread); ``close()`` and ``stats()`` are thread-safe.

    Args:
        factory: a picklable zero-argument callable returning the sink (such as
            ``functools.partial(JsonlEventHandler, path)``), or a picklable sync handler:
            anything that cannot be called with no arguments is taken as the handler itself.
        start_method: how the child starts: ``"spawn"`` (the default), ``"forkserver"`` or
            ``"fork"``. ``spawn`` is safe when threads run (the bus's do): a forked child
            inherits locks that other threads held at the fork (logging's, a sink's) and can
            hang on them, and Python 3.12+ warns about forking a threaded process.
        max_pending: most events sent and not yet acknowledged by the child.
        timeout: seconds the handler thread waits for the child to make room or to finish a
            flush (None: no limit); events it could not send by then are counted as dropped.
        exit_timeout: seconds the child gets to finish at interpreter exit.
        start_timeout: seconds the child gets to start and build the sink.

    Raises:
        TypeError: ``factory`` is not callable or cannot be pickled, or another argument has
            the wrong type (the message names it).
        ValueError: ``start_method`` is not one of this platform's, or a number is out of range.
        RuntimeError: the factory raised in the child (the message holds its traceback), the
            sink is async, or the child did not start within ``start_timeout``.

    Examples:
        >>> import functools
        >>> import monitor_bus as monitor
        >>> sink = monitor.ProcessHandler(  # doctest: +SKIP
        ...     functools.partial(monitor.JsonlEventHandler, "run.jsonl")
        ... )
        >>> monitor.register_event_handler(sink, name="jsonl")  # doctest: +SKIP
    """

    # Not one of the bundled sinks that share the bus's runner (``_runner``): its flush() waits
    # for the child, and a slow sink beside it must not delay its own work, nor it theirs.

    def __init__(
        self,
        factory: Callable[..., Any],
        *,
        start_method: str = "spawn",
        max_pending: int = 16384,
        timeout: float | None = 10.0,
        exit_timeout: float = 5.0,
        start_timeout: float = 60.0,
    ) -> None:
        from multiprocessing import util

        if not callable(factory):
            raise TypeError(f"factory must be callable, not {type(factory).__qualname__}")
        build = is_factory(factory)
        check_start_method(start_method)
        self._max_pending = check_int("max_pending", max_pending, 1)
        self._timeout = check_timeout("timeout", timeout)
        exit_after = check_timeout("exit_timeout", exit_timeout, allow_none=False) or 0.0
        start_after = check_timeout("start_timeout", start_timeout, allow_none=False)
        self._chunk = min(CHUNK, self._max_pending)
        self._name = repr(factory)
        self._buffer: list[Any] = []  # slots of the events not sent yet
        self._lock = threading.RLock()
        self._throttle = Throttle()
        self._received = 0  # given to __call__
        self._sent = 0
        self._handled = 0  # acknowledged by the child
        self._sink_lost = 0  # of those, what the sink lost (in ``_dropped`` too)
        self._errors = 0
        self._errors_told = 0  # the part of ``_errors`` told to the bus (_monitor_bus_errors)
        self._dropped = 0
        self._reported = 0  # the part of ``_dropped`` already in a warning
        self._told = 0  # the part of ``_dropped`` already told to the bus (_monitor_bus_lost)
        self._stopped = False  # close() stopped a child that had not finished in time
        self._grace = _GRACE  # seconds a child stopped gets to end on SIGTERM before SIGKILL
        self._seq = 0  # messages sent
        self._acked = 0  # seq of the last message the child acknowledged
        self._dead = False
        self._closed = True  # until the child is ready: a failed start is not a crash
        self._closed_ok = False
        self._reason = "closed"  # why events are dropped once it is dead or closed
        self._dirty = False  # events sent since the last flush message
        self._rbuf = bytearray()
        self._ready = False
        self._failure: str | None = None

        self._proc, self._sock = start_child(start_method, factory, build)
        self._started(start_after or 0.0)
        self._closed = False
        self._owner = os.getpid()
        _handlers.add(self)
        process.finalize_with_multiprocessing()  # the buses close before this handler does
        self._exit_timeout = exit_after
        # Holds this handler until close() cancels it: an unclosed child lives until exit.
        self._finalizer = util.Finalize(None, self._close_at_exit, exitpriority=_EXIT_PRIORITY)

    # -- the bus's side (its handler thread) --

    def __call__(self, event: Event) -> None:
        """Buffer ``event``; send the buffer once it holds 1024 events."""
        self._received += 1
        if self._dead or self._closed:
            self._drop(1, self._reason)
            return
        origin = event.origin
        data = event.data if origin is None else tagged(event.data, origin)
        self._buffer += (event.name, event.timestamp, data)
        if len(self._buffer) >= SLOTS * self._chunk:
            self._send_buffered(flush=False)

    def handle_batch(self, events: list[Event]) -> None:
        """Buffer a batch of events, sending every 1024 events."""
        call_each(events, self)

    def _monitor_bus_take_slots(self, slots: list[Any]) -> None:
        """The bus's call (see ``_handler.handler_calls``): buffer a batch as it was queued."""
        n = count_events(len(slots))
        self._received += n
        if self._dead or self._closed:
            self._drop(n, self._reason)
            return
        self._buffer += wire(slots)
        if len(self._buffer) >= SLOTS * self._chunk:
            self._send_buffered(flush=False)

    def flush(self) -> bool:
        """Send what is buffered; wait until the child's sink has handled and flushed it.

        Returns:
            True if the child acknowledged everything sent (by an earlier call too) within
            ``timeout``.
        """
        return self._send_buffered(flush=True)

    def _send_buffered(self, *, flush: bool) -> bool:
        with self._lock:
            slots, self._buffer = self._buffer, []
            return self._send(slots, flush=flush)

    def _send(
        self, slots: list[Any], *, flush: bool, close: bool = False, final: bool = False
    ) -> bool:
        """Send the events of ``slots`` to the child in messages of at most 1024 events, then,
        if ``flush``, wait until the child has acknowledged every message sent so far (its
        sink flushed). The one way events leave this process."""
        with self._lock:
            deadline = _deadline(self._timeout)
            total = count_events(len(slots))
            if self._dead:
                self._drop(total, self._reason)
                return False
            if not total and not (close or final) and not (flush and self._dirty):
                # Nothing to send: a flush still waits for what an earlier one left pending.
                return not flush or self._wait(lambda: self._acked >= self._seq, deadline)
            for start in range(0, max(total, 1), self._chunk):
                chunk = slots[SLOTS * start : SLOTS * (start + self._chunk)]
                n = count_events(len(chunk))
                last = start + self._chunk >= total
                kind = CLOSE if close else FINAL if final else FLUSH if flush else BATCH
                kind = kind if last else BATCH
                if not self._make_room(n, deadline):
                    if self._dead:
                        self._drop(total - start, "the child process is gone")
                        return False
                    self._drop(n, f"the child did not make room within {self._timeout} s")
                    chunk, n = [], 0
                if not n and kind == BATCH:
                    continue
                self._dirty = kind == BATCH
                if not self._write(kind, chunk, deadline if close else None):
                    self._drop(total - start - n, "the child process is gone")
                    return False
            if not (flush or close or final):
                return True
            seq = self._seq
            done = self._wait(lambda: self._acked >= seq, deadline)
            if not done and not self._dead and self._throttle.ready(("flush",)):
                logger.warning(
                    "ProcessHandler %s: the child did not finish a flush within %s s; %d events "
                    "sent to it are not acknowledged yet",
                    self._name,
                    self._timeout,
                    self._sent - self._handled,
                )
            return done

    def _make_room(self, n: int, deadline: float | None) -> bool:
        """Wait until ``n`` more events fit under ``max_pending`` (False: timed out, or dead)."""
        self._read()
        limit = max(self._max_pending - n, 0)
        return self._wait(lambda: self._sent - self._handled <= limit, deadline)

    def _write(self, kind: int, slots: list[Any], deadline: float | None = None) -> bool:
        """Write one message, waiting up to ``timeout`` for room (up to ``deadline``, if
        given: a close's)."""
        self._seq += 1
        n_events = count_events(len(slots))
        data = frame((kind, self._seq, slots))
        try:
            wait = self._timeout
            if deadline is not None:  # at least a moment: 0 would make the socket non-blocking
                wait = max(_remaining(deadline) or 0.0, 0.001)
            self._sock.settimeout(wait)
            self._sock.sendall(data)  # Connection's framing: the child reads it
        except TimeoutError:
            # Part of a frame may be written: the stream is broken, and the child stuck.
            self._stop_child(f"it read nothing for {self._timeout} s", lost=n_events)
            return False
        except OSError:  # it closed its end: it is exiting
            self._child_gone(lost=n_events)
            return False
        self._sent += n_events
        return True

    def _monitor_bus_wait_done(self, timeout: float | None) -> bool:
        """The bus's ``flush(timeout)``, once this handler has settled, from the caller's
        thread: wait up to ``timeout`` until the child has acknowledged everything sent (the
        handler thread's own wait may have given up first). False if it has not, or if the
        child is gone unasked (what it had not acknowledged is dropped)."""
        deadline = _deadline(timeout)
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False  # the handler thread waits on the child, to its own timeout
        try:
            if self._dead:
                return self._closed
            # The handler's flush() has sent its flush message: only its answer is missing.
            # Nothing is written here (a write with what is left of the caller's timeout could
            # time out midway and break the stream).
            seq = self._seq
            return self._wait(lambda: self._acked >= seq, deadline)
        finally:
            self._lock.release()

    def _monitor_bus_lost(self, final: bool) -> int:
        """The bus's question (see ``_handler``), on its handler thread: events dropped since it
        last asked, all of them events the bus delivered here (fed by one bus, as registered:
        on several, the first to ask is told). ``final`` changes nothing: what the child still
        holds is not lost yet, and ``close()`` counts and reports what it then loses. No lock:
        one read of the count (``_monitor_bus_wait_done`` may hold the lock meanwhile).
        ``final``: the bus lets go of the handler, so the child's sink gives up what it could
        not write (its ``_monitor_bus_lost(True)``), which is dropped here then."""
        if final and not (self._dead or self._closed):
            self._send([], flush=True, final=True)
        dropped = self._dropped
        lost, self._told = dropped - self._told, dropped
        return lost

    def _monitor_bus_errors(self) -> int:
        """The bus's question (see ``_handler``): the sink's errors in the child since it last
        asked (logged here as they arrive)."""
        errors = self._errors
        new, self._errors_told = errors - self._errors_told, errors
        return new

    # -- what the child says --

    def _wait(self, done: Callable[[], bool], deadline: float | None) -> bool:
        """Read the child's messages until ``done()`` or the deadline or the child's end."""
        while not done():
            if self._dead:
                return False
            remaining = _remaining(deadline)
            if remaining == 0:
                return False
            ready = wait_ready([self._sock, self._proc.sentinel], remaining)
            if self._sock in ready:
                self._read()
            elif ready:  # exited, and nothing more to read
                self._read()
                self._child_gone(lost=0)
        return True

    def _read(self) -> None:
        """Take in what the child has sent, without waiting."""
        if self._dead:
            return
        self._sock.settimeout(0)
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # its end is closed: it exited or is exiting
                self._parse()
                self._child_gone(lost=0)
                return
            self._rbuf += data
        self._parse()

    def _parse(self) -> None:
        for message in read_frames(self._rbuf):
            self._on_message(message)

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == ACK:
            _, self._acked, self._handled, errors, reports, lost = message
            new_errors, self._errors = errors - self._errors, errors
            new_lost, self._sink_lost = lost - self._sink_lost, lost
            self._drop(new_lost, "its sink in the child process could not write them")
            if new_errors:
                for type_name, (count, text) in reports.items():
                    if self._throttle.ready(("error", type_name)):
                        logger.error(
                            "ProcessHandler %s: the sink raised %s in the child process "
                            "(%d of %d errors so far; the same error is logged at most once "
                            "per %g s)\n%s",
                            self._name,
                            type_name,
                            count,
                            self._errors,
                            LOG_INTERVAL,
                            text,
                        )
        elif kind == READY:
            self._ready = True
        elif kind == FAILED:
            self._failure = message[1]

    def _started(self, timeout: float) -> None:
        """Wait for the child to build the sink: a factory that fails reaches the caller."""
        deadline = _deadline(timeout)
        self._wait(lambda: self._ready or self._failure is not None, deadline)
        if self._ready:
            return
        failure = self._failure
        self._dead = True
        self._proc.join(_remaining(deadline) or 0.1)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(1.0)
        self._sock.close()
        if failure is not None:
            raise RuntimeError(
                f"ProcessHandler: the sink could not be made in the child:\n{failure}"
            )
        raise RuntimeError(
            f"ProcessHandler: the child process did not start within start_timeout={timeout} s "
            f"(exit code {self._proc.exitcode})"
        )

    # -- the child's end --

    def _child_gone(self, lost: int) -> None:
        """The child exited (or closed its end): report, and count what it did not handle."""
        if self._dead:
            return
        self._dead = True
        self._reason = "the child process is gone"
        self._proc.join(1.0)  # its sentinel is ready, or about to be: the exit code
        in_flight = self._sent - self._handled
        self._dropped += in_flight + lost
        if self._closed and self._acked >= self._seq:
            return
        logger.error(
            "ProcessHandler %s: the child process (pid %s) exited with code %s; %d events "
            "it had not acknowledged are counted as dropped, and so is every later event",
            self._name,
            self._proc.pid,
            self._proc.exitcode,
            in_flight + lost,
        )
        self._reported = self._dropped

    def _stop_child(self, why: str, lost: int) -> None:
        """Terminate a child that does not respond (then kill it), and count what is lost."""
        logger.error(
            "ProcessHandler %s: stopping the child process (pid %s): %s",
            self._name,
            self._proc.pid,
            why,
        )
        end(self._proc, self._grace)
        self._child_gone(lost)

    def _drop(self, n: int, why: str) -> None:
        if not n:
            return
        self._dropped += n
        if self._throttle.ready(("drops",)):
            logger.warning(
                "ProcessHandler %s dropped %d events (%s); at most one such warning per %g s",
                self._name,
                self._dropped - self._reported,
                why,
                LOG_INTERVAL,
            )
            self._reported = self._dropped

    # -- control, from any thread --

    def close(self, timeout: float | None = 5.0) -> bool:
        """Send what is buffered, have the child flush and close its sink and exit.

        Idempotent. Past ``timeout`` the child is terminated, and what it had not
        acknowledged counts as dropped. Thread-safe.

        Args:
            timeout: seconds to wait; None or ``math.inf`` waits as long as it takes.

        Returns:
            True if the child handled everything and exited within ``timeout``.
        """
        timeout = check_timeout("timeout", timeout)
        deadline = _deadline(timeout)
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            # The handler thread waits on a stuck child: stopping it releases that thread.
            self._stopped = True
            self._proc.kill()
            self._proc.join(1.0)
            return False
        try:
            if self._closed:
                return self._closed_ok
            self._closed = True
            self._finalizer.cancel()
            # A closing child is stopped at once: close(timeout) keeps to its timeout.
            saved, self._timeout = self._timeout, timeout
            self._grace = _CLOSE_GRACE
            try:
                slots, self._buffer = self._buffer, []
                dropped = self._dropped
                # Acknowledged, nothing dropped: done, even when the child's exit was read with
                # its last acknowledgement (that marks it dead too).
                done = self._send(slots, flush=False, close=True) and self._dropped == dropped
            finally:
                self._timeout = saved
                self._grace = _GRACE
            if done:
                self._proc.join(_remaining(deadline))
            if self._proc.is_alive():
                self._stopped = True
                self._grace = _CLOSE_GRACE
                try:
                    self._stop_child(f"it did not finish within {timeout} s", lost=0)
                finally:
                    self._grace = _GRACE
                done = False
            self._dead = True
            self._sock.close()
            self._closed_ok = done
            return done
        finally:
            self._lock.release()

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters.

        Keys: ``received`` (events given to the handler), ``sent`` (to the child), ``handled``
        (acknowledged by the child: its sink was called with them, and has not lost them),
        ``errors`` (sink calls and flushes that raised in the child), ``dropped`` (not sent in
        time, lost with the child, received after it was gone, or lost by the sink: a full
        disk), ``pending`` (sent,
        not yet acknowledged), ``buffered`` (not sent yet), ``alive`` and ``exitcode`` (of
        the child). ``received == handled + dropped + pending + buffered``.
        """
        pending = 0 if self._dead else self._sent - self._handled
        exitcode = self._proc.exitcode if self._owner == os.getpid() else None
        return {
            "received": self._received,
            "sent": self._sent,
            "handled": self._handled - self._sink_lost,
            "errors": self._errors,
            "dropped": self._dropped,
            "pending": pending,
            "buffered": count_events(len(self._buffer)),
            "alive": not self._dead,
            "exitcode": exitcode,
        }

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        pid: int | None = self._proc.pid
        return pid

    def __repr__(self) -> str:
        state = "running" if not self._dead else f"exited {self.stats()['exitcode']}"
        return f"<ProcessHandler {self._name} pid={self._proc.pid} {state}>"

    def _after_fork_in_child(self) -> None:
        # A forked process's copy must not write into the parent's stream: what a copy is
        # given (a bus with children="own" runs copies) is dropped, counted and reported.
        self._lock = threading.RLock()
        self._buffer = []
        self._dead = self._closed = True
        self._reason = "a copy in a forked process"
        self._told = self._dropped  # the bus here starts its counts afresh (``after_fork``)
        self._sock.close()  # this process's descriptor only
        self._finalizer.cancel()

    def _close_at_exit(self) -> None:
        self._stopped = False  # what this close does is what the warning says
        if self.close(self._exit_timeout):
            return
        if self._stopped:
            logger.warning(
                "ProcessHandler %s: not finished within exit_timeout=%s s at exit; stats: %s",
                self._name,
                self._exit_timeout,
                self.stats(),
            )
        else:  # it exited by itself (before exit, or while closing): no time was spent on it
            logger.warning(
                "ProcessHandler %s: at exit, the child process (pid %s) is gone (%s); what it "
                "had not acknowledged is counted as dropped; stats: %s",
                self._name,
                self._proc.pid,
                exit_status(self._proc.exitcode),
                self.stats(),
            )


_handlers: weakref.WeakSet[ProcessHandler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for handler in list(_handlers):
        handler._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
