"""Process lifecycle: the state every bus and Stat of this process shares, and fork and exit.

Guarantees
----------
- One home: the process-wide state (every bus, every live Stat, the default bus, the threads
  that belong to a bus, the multiprocessing finalizer) lives in ``process``, reset in one place
  after a fork.
- Registries never race: a ``WeakRegistry`` is snapshotted in one C call, so a timer pass or an
  exit iterating Stats is never broken by other threads creating Stats meanwhile (a ``WeakSet``
  iterated in Python raises "Set changed size during iteration").
- Fork: in the child, every bus gets a fresh, stopped dispatcher and the same handlers, every
  Stat an empty window (the parent logs the windows it had open), and the locks are new.
- Exit: at interpreter exit (``atexit``) and at the end of a ``multiprocessing`` child (its
  finalizers, which run where atexit does not), every Stat's open window is logged, then every
  bus is closed within its ``exit_timeout``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from ._bus import EventBus
    from ._stat import Stat

logger = logging.getLogger("monitor_bus")

_T = TypeVar("_T")


def _forget(refs: dict[int, weakref.ref[_T]], key: int, ref: weakref.ref[_T]) -> None:
    if refs.get(key) is ref:
        refs.pop(key, None)


class WeakRegistry(Generic[_T]):
    """A set of weakly held objects whose ``snapshot()`` is safe while other threads add."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[_T]] = {}

    def add(self, obj: _T) -> None:
        key = id(obj)
        self._refs[key] = weakref.ref(obj, functools.partial(_forget, self._refs, key))

    def snapshot(self) -> list[_T]:
        """The live objects, in the order they were added."""
        refs = list(self._refs.values())  # one C call: atomic with respect to other threads
        return [obj for ref in refs if (obj := ref()) is not None]


class _Process:
    """The process-wide state of the package (one instance, ``process``)."""

    def __init__(self) -> None:
        self.buses: WeakRegistry[EventBus] = WeakRegistry()
        self.stats: WeakRegistry[Stat] = WeakRegistry()
        # Identities of the threads that run handlers or a dispatcher: a blocking call made from
        # one of them could wait on itself.
        self.bus_threads: set[int] = set()
        self.default_bus: EventBus | None = None
        self.default_settings: dict[str, Any] = {}  # from configure_default_bus()
        self.default_lock = threading.Lock()
        self.finalizer_pid: int | None = None

    def at_exit(self) -> None:
        for stat in self.stats.snapshot():
            stat._close()
        for bus in self.buses.snapshot():
            try:
                bus._close_at_exit()
            except Exception:
                logger.exception("%r: error while closing at exit", bus)

    def finalize_with_multiprocessing(self) -> None:
        """A multiprocessing child ends in ``os._exit``, past atexit; its finalizers still run."""
        if self.finalizer_pid != os.getpid():
            from multiprocessing import util

            util.Finalize(None, self.at_exit, exitpriority=100)
            self.finalizer_pid = os.getpid()

    def after_fork_in_child(self) -> None:
        self.default_lock = threading.Lock()
        self.bus_threads.clear()
        for bus in self.buses.snapshot():
            bus._after_fork_in_child()
        for stat in self.stats.snapshot():
            stat._after_fork()


process = _Process()


def in_bus_thread() -> bool:
    """Whether the calling thread belongs to a bus (a handler or a dispatcher thread)."""
    return threading.get_ident() in process.bus_threads


atexit.register(process.at_exit)
os.register_at_fork(after_in_child=process.after_fork_in_child)
