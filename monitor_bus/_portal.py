"""The dispatcher's portal: how other threads run code on its loop, exactly once, in bounded time.

Guarantees
----------
- Bounded: other threads reach the loop with ``call_soon_threadsafe`` and wait on a future with
  their own timeout, so ``flush``/``close`` stay bounded even if a handler blocks the loop.
- Exactly once: a call scheduled on the loop runs once, by the loop, by the loop's thread as it
  ends (``unrun``), or by the caller if the loop has closed or there is none; on timeout it
  runs in full or not at all. On the loop's own thread it runs at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

_T = TypeVar("_T")


def _run_into(future: Future[_T], func: Callable[..., _T], *args: Any) -> None:
    try:
        future.set_result(func(*args))
    except BaseException as exc:  # noqa: BLE001 - the waiter gets it
        future.set_exception(exc)


def _ran(func: Callable[..., _T], *args: Any) -> Future[_T]:
    future: Future[_T] = Future()
    future.set_running_or_notify_cancel()
    _run_into(future, func, *args)
    return future


class _TimedOut(Exception):
    pass


class Portal:
    """The calls of other threads into a ``Dispatcher``'s loop; the dispatcher mixes it in and
    owns the state it reads."""

    # Set by Dispatcher: its lock, thread and loop, and the calls its loop has not run.
    lock: threading.Lock
    thread: threading.Thread | None
    loop: Any
    loop_context: contextvars.Context | None
    unrun: set[Callable[[], None]]

    def call_soon(self, func: Callable[[], object]) -> None:
        """Run ``func`` on the loop thread soon, without waiting (a no-op once it is gone)."""
        loop = self.loop
        if loop is None:
            return
        if self.thread is threading.current_thread():
            func()
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(func, context=self.loop_context)

    def in_loop(self, func: Callable[..., _T], *args: Any, timeout: float | None = None) -> _T:
        """Run ``func`` on the dispatcher's loop and return its result.

        Scheduled with ``call_soon_threadsafe`` and awaited on a concurrent future, so the
        timeout holds even when the loop is blocked (a handler calling ``time.sleep`` in an
        ``async def``): anyio's portal waits on the loop before it honours any timeout. On
        timeout ``func`` runs in full or not at all.
        """
        future = self.submit(func, *args)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise _TimedOut from None

    def submit(self, func: Callable[..., _T], *args: Any) -> Future[_T]:
        """Have ``func`` run on the loop exactly once (here, if there is no loop), no wait."""
        if self.thread is threading.current_thread():
            return _ran(func, *args)  # we are on the loop
        loop = self.loop
        if loop is None:
            with self.lock:  # no dispatcher: nothing else runs these steps while we hold it
                if self.loop is None:
                    return _ran(func, *args)
                loop = self.loop
        return self._schedule(loop, func, *args)

    def _schedule(self, loop: Any, func: Callable[..., _T], *args: Any) -> Future[_T]:
        """Have ``func`` run on ``loop`` soon, or by the loop's thread as it ends, or here if
        the loop has closed: exactly once, whichever comes first."""
        future: Future[_T] = Future()

        def run() -> None:
            try:
                self.unrun.remove(run)  # claimed once: by the loop, its end, or the caller
            except KeyError:
                return
            if future.set_running_or_notify_cancel():
                _run_into(future, func, *args)

        self.unrun.add(run)
        try:
            loop.call_soon_threadsafe(run, context=self.loop_context)
        except RuntimeError:  # the loop has closed: nothing else runs these steps now
            run()
        return future
