"""Starting and ending the child process of a ``ProcessHandler``.

The child is a daemonic ``multiprocessing`` process (``_process_sink.serve``), started with the
method asked for, fed through a socket pair; the factory must pickle. Ending it: SIGTERM, then
SIGKILL for one that has not gone within the grace given (a stopped process acts on SIGTERM
only once continued).
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from ._process_sink import serve

# multiprocessing is imported when a ProcessHandler is made: ``import monitor_bus`` does not
# import it (the relay checks whether the program uses it).


def check_start_method(start_method: object) -> None:
    """Raise unless ``start_method`` is one of this platform's and a socket pair feeds the child."""
    import multiprocessing

    if not isinstance(start_method, str):
        raise TypeError(f"start_method must be a str, not {type(start_method).__qualname__}")
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise ValueError(f"start_method must be one of {', '.join(methods)}; got {start_method!r}")
    if sys.platform == "win32":  # pragma: no cover - the child is fed through a socket
        raise RuntimeError("ProcessHandler needs a Unix socket pair (not on Windows)")


def start_child(start_method: str, factory: Any, build: bool) -> tuple[Any, socket.socket]:
    """Start the child that serves ``factory`` (``build``: call it for the sink); return the
    process and the parent's end of the link, as a socket (sends with a timeout).

    Raises:
        TypeError: ``factory`` cannot be pickled.
    """
    import multiprocessing

    ctx: Any = multiprocessing.get_context(start_method)
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(
        target=serve,
        args=(child_end, factory, build),
        name="monitor_bus-sink",
        daemon=True,  # multiprocessing terminates it at exit if close() could not end it
    )
    try:
        proc.start()
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        parent_end.close()
        child_end.close()
        raise TypeError(f"factory must be picklable: {exc}") from exc
    child_end.close()
    # The parent's side as a socket: sends with a timeout.
    sock = socket.socket(fileno=os.dup(parent_end.fileno()))
    parent_end.close()
    return proc, sock


def exit_status(code: int | None) -> str:
    """A process's exit code in words: ``exit code 1``, ``killed by signal SIGKILL``."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def end(proc: Any, grace: float) -> None:
    """Terminate ``proc``, then kill it if it has not gone within ``grace`` seconds (a stopped
    process acts on SIGTERM only once continued; SIGKILL ends it at once)."""
    proc.terminate()
    proc.join(grace)
    if proc.is_alive():
        proc.kill()
        proc.join(1.0)


def is_factory(target: Callable[..., Any]) -> bool:
    """Whether ``target`` is a factory (callable with no arguments) rather than a handler."""
    try:
        inspect.signature(target).bind()
    except TypeError:
        if isinstance(target, type):
            raise TypeError(
                f"factory: {target.__qualname__} needs arguments; pass "
                f"functools.partial({target.__qualname__}, ...)"
            ) from None
        return False
    except ValueError:  # no signature to read: call it as a handler
        return False
    return True
