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
  Stat an empty window (the parent logs the windows it had open), and the locks are new: the
  package's module-level locks too (``module_lock``), since a thread of the parent may have
  held one at the fork, which would hang the child at its first use.
- Children: the process's end of the relay to its child processes (``listener``) or to its
  parent (``uplink``) lives here too; ``_relay.py`` has their guarantees. A forked child of a
  listening (or linked) process reports to the same listener.
- Exit: at interpreter exit (``atexit``) and at the end of a ``multiprocessing`` child (its
  finalizers, which run where atexit does not, registered again in each child after
  ``multiprocessing`` clears them), in this order: a listening process first waits for its
  live non-daemonic ``multiprocessing`` children (which report to it) to end, up to the
  longest ``exit_timeout`` of its buses; then the open ``Run``s end (``_run`` joins the
  ``enders`` registry, so this module imports nothing above it), every Stat's open window
  is logged, every bus is closed, all at once (each on a thread of its own, so a stuck handler
  on one costs the others nothing), each within its own ``exit_timeout`` (first asking its live
  children, daemonic ones such as DataLoader workers included, for their open windows:
  ``_relay.py``), and the relay is closed. A closing bus queues what children send past its
  capacity rather than have the relay hold it (``EventBus._begin_closing``), so what the same
  child sent another bus follows. The order does not depend on when ``multiprocessing`` was
  imported (a child's connection registers the finalizer too). (Why not simply run after
  ``multiprocessing``'s own join: it terminates the daemonic children first, ``ProcessHandler``
  sinks among them, which the buses still deliver to, and its join has no bound.) A child
  still running after that wait finds its parent's buses closed: what it logs then is counted
  as dropped in the child and reported there.
- SIGTERM: ``handle_sigterm`` (called by ``Run.start`` and by the default bus's handler
  registration) installs the one handler, only from the main thread of a process that is not
  a child of a family, and only over Python's default disposition. On SIGTERM it puts the
  default back, runs the exit sequence (runs ended ``interrupted``, no wait for children) on a
  thread of its own within the buses' ``exit_timeout``, and sends itself SIGTERM again: the
  process dies of SIGTERM, as without it. A forked child takes it back.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._relay import Listener, Uplink, parse_environment

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

    def discard(self, obj: _T) -> None:
        self._refs.pop(id(obj), None)

    def __contains__(self, obj: object) -> bool:
        ref = self._refs.get(id(obj))
        return ref is not None and ref() is obj

    def snapshot(self) -> list[_T]:
        """The live objects, in the order they were added."""
        refs = list(self._refs.values())  # one C call: atomic with respect to other threads
        return [obj for ref in refs if (obj := ref()) is not None]


def _no_default_bus() -> EventBus:
    raise RuntimeError("monitor_bus._default is not imported: import monitor_bus")


class _Process:
    """The process-wide state of the package (one instance, ``process``)."""

    def __init__(self) -> None:
        self.buses: WeakRegistry[EventBus] = WeakRegistry()
        self.stats: WeakRegistry[Stat] = WeakRegistry()
        self.serials = itertools.count(1)  # with the pid, names a bus to the relay
        # Identities of the threads that run handlers or a dispatcher: a blocking call made from
        # one of them could wait on itself.
        self.bus_threads: set[int] = set()
        # What higher modules end at exit before the Stats close, each given the run status
        # (the runs join from _run): a registry, so this module imports none of them.
        self.enders: list[Callable[[str], None]] = []
        self.default_bus: EventBus | None = None
        # get_default_bus, which _default joins at import: lower modules (a Stat made without
        # a bus) reach the default bus through it, importing nothing above them.
        self.get_default_bus: Callable[[], EventBus] = _no_default_bus
        self.default_settings: dict[str, Any] = {}  # from configure_default_bus()
        self.default_lock = threading.Lock()
        self.module_locks: list[tuple[str, str]] = []  # (module, name): see module_lock()
        self.finalizer: Any = None  # multiprocessing's Finalize running at_exit
        self.multiprocessing_hooked = False
        self.sigterm_installed = False  # _on_sigterm is SIGTERM's handler (handle_sigterm)
        self.sigterm_left = False  # Run(handle_sigterm=False): SIGTERM is left alone
        self.listener: Listener | None = None  # children report here
        self.uplink: Uplink | None = None  # this process reports there
        parent = parse_environment()
        if parent is not None:
            self.uplink = Uplink(parent[2], parent[0], parent[1], linked=None, unlinked=self.unlink)
            self.hook_multiprocessing()  # a spawned child: its finalizers are cleared later

    def ensure_listener(self) -> None:
        """Listen for child processes, unless this process reports to a parent itself."""
        uplink = self.uplink
        if uplink is not None and uplink.linked is None:
            uplink.resolve()
        if self.listener is not None or (self.uplink is not None and self.uplink.linked):
            return
        if not hasattr(socket, "AF_UNIX"):  # Windows without Unix sockets: children fork nothing
            return
        with self.default_lock:
            if self.listener is None:
                try:
                    # A child connecting has this process's exit run before multiprocessing
                    # terminates its daemonic children (DataLoader workers): they are asked
                    # for their windows first.
                    self.listener = Listener(self.route, self.hook_multiprocessing)
                except OSError:
                    logger.exception(
                        "monitor_bus: cannot listen for child processes; a forked child runs "
                        "its copies of the handlers itself"
                    )

    def route(self, creator: tuple[int, int], name: str) -> EventBus | None:
        """The bus a child's messages go to: the same bus, open or closed, if it was forked
        from this process with it (never another bus that happens to share its name); else
        the newest open bus of that name; else a closed one of those (the relay then tells
        the child its events are dropped, not that no bus takes them)."""
        found = closed = None
        for bus in self.buses.snapshot():
            if bus._creator == creator:
                return bus
            if bus._name == name:
                if bus._closed:
                    closed = bus
                else:
                    found = bus
        return found or closed

    def unlink(self) -> None:
        """This process turned out not to be a child of the listener's: it reports nowhere."""
        self.uplink = None
        for bus in self.buses.snapshot():
            bus._uplink = None

    def at_exit(self, *, wait_for_children: bool = True, run_status: str = "success") -> None:
        """End the process's part: runs (with ``run_status``), Stats, buses, then the relay
        (see the guarantees)."""
        if self.listener is not None:
            self.listener.exiting = True  # children asked for their windows are told why
        if wait_for_children:
            self.join_children()
        for end in list(self.enders):
            end(run_status)
        for stat in self.stats.snapshot():
            stat._close()
        self.close_buses()
        if self.uplink is not None:
            self.uplink.close()
        if self.listener is not None:
            self.listener.close()
            for bus in self.buses.snapshot():
                bus._drop_late(0, final=True)  # what children sent the closed buses, all said

    def close_buses(self) -> None:
        """Close every bus at once, each within its own ``exit_timeout``: a handler stuck on
        one bus costs the others none of theirs. (One after another, here, if no thread can
        start.)"""
        buses = self.buses.snapshot()
        for bus in buses:
            bus._begin_closing()  # every bus first: none holds up what children sent another
        closers = []
        for bus in buses:
            closer = threading.Thread(
                target=_close_at_exit, args=(bus,), name="monitor_bus-exit", daemon=True
            )
            try:
                closer.start()
            except RuntimeError:  # no thread to be had
                _close_at_exit(bus)
                continue
            closers.append(closer)
        for closer in closers:
            closer.join()  # each close is bounded by its bus's exit_timeout

    def exit_budget(self) -> float | None:
        """How long the buses with something to deliver may take at exit (they close at
        once): the longest ``exit_timeout`` of theirs; None: no bound."""
        timeouts = [
            bus._exit_timeout
            for bus in self.buses.snapshot()
            if not bus._closed and (bus._dispatcher.loop is not None or bus._queue.slots)
        ]
        if None in timeouts:
            return None
        finite = [t for t in timeouts if t is not None]  # all of them, as typed
        return max(finite, default=0.0)

    def join_children(self) -> None:
        """Wait, within ``exit_budget()``, for the non-daemonic ``multiprocessing`` children
        still running: they report to this process's listener, which must outlive them.
        (``multiprocessing`` joins them too, but after its finalizers, this sequence among
        them, or after this atexit hook, as the import order has it.)"""
        mp = sys.modules.get("multiprocessing")
        if self.listener is None or mp is None:
            return
        try:
            children = [p for p in mp.active_children() if not p.daemon]
        except Exception:  # noqa: BLE001 - multiprocessing torn down: nothing to wait for
            return
        budget = self.exit_budget() if children else 0.0
        deadline = None if budget is None else time.monotonic() + budget
        for child in children:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            child.join(left)

    def handle_sigterm(self) -> None:
        """Install ``_on_sigterm`` if this is the main thread of the main process and SIGTERM
        has Python's default disposition (never over a handler of the user's)."""
        if self.sigterm_installed or self.sigterm_left or not hasattr(signal, "SIGTERM"):
            return
        if threading.current_thread() is not threading.main_thread():
            return
        mp = sys.modules.get("multiprocessing")
        if mp is not None and mp.parent_process() is not None:
            return  # a multiprocessing child: its parent decides how the family ends
        if self.uplink is not None and self.uplink.linked:
            return  # a forked child of a family
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        self.sigterm_installed = True

    def leave_sigterm(self) -> None:
        """Leave SIGTERM to Python's default from now on: take ``_on_sigterm`` back if it is
        still SIGTERM's handler, and install it no more."""
        self.sigterm_left = True
        if self.sigterm_installed:
            self.forget_sigterm()

    def forget_sigterm(self) -> None:
        """Put back the default disposition if ``_on_sigterm`` still has SIGTERM."""
        self.sigterm_installed = False
        with contextlib.suppress(ValueError):  # not the main thread (a fork from another one)
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def finalize_with_multiprocessing(self) -> None:
        """A multiprocessing child ends in ``os._exit``, past atexit; its finalizers still run."""
        if self.finalizer is None or not self.finalizer.still_active():
            from multiprocessing import util

            self.finalizer = util.Finalize(None, self.at_exit, exitpriority=100)

    def hook_multiprocessing(self) -> None:
        """Have every ``multiprocessing`` child (which clears its finalizers as it starts)
        register ``at_exit`` again and start the timers of its Stats."""
        if "multiprocessing" not in sys.modules:
            return
        self.finalize_with_multiprocessing()
        if not self.multiprocessing_hooked:
            from multiprocessing import util

            util.register_after_fork(self, _Process.after_multiprocessing_start)
            self.multiprocessing_hooked = True

    def after_multiprocessing_start(self) -> None:
        self.finalize_with_multiprocessing()
        for bus in self.buses.snapshot():
            if bus._uplink is not None and bus._stats():
                bus._dispatcher.ensure_running()  # its Stats' windows close on time

    def before_fork(self) -> None:
        uplink = self.uplink
        if uplink is not None and uplink.linked is None:
            uplink.resolve()
        if self.listener is not None or self.uplink is not None:
            self.hook_multiprocessing()

    def after_fork_in_child(self) -> None:
        self.default_lock = threading.Lock()
        if self.sigterm_installed:  # a forked child is not the main process
            self.forget_sigterm()
        for module, name in self.module_locks:
            setattr(sys.modules[module], name, threading.Lock())
        self.bus_threads.clear()
        parent_pid = os.getppid()
        listener, uplink = self.listener, self.uplink
        if listener is not None:
            listener.after_fork_in_child()
            self.listener = None
            self.uplink = Uplink(listener.path, parent_pid, parent_pid, linked=True)
        elif uplink is not None and uplink.linked:
            uplink.after_fork_in_child()
            self.uplink = Uplink(uplink.path, parent_pid, uplink.listener_pid, linked=True)
        if self.uplink is not None:
            self.uplink.adopt()
        for bus in self.buses.snapshot():
            bus._after_fork_in_child()
        for stat in self.stats.snapshot():
            stat._after_fork()


process = _Process()


def module_lock(module: str, name: str) -> threading.Lock:
    """A lock for the module-level variable ``name`` of ``module`` (``__name__``), which a
    forked child finds replaced by a new one. Read the variable at each use."""
    process.module_locks.append((module, name))
    return threading.Lock()


def _close_at_exit(bus: EventBus) -> None:
    try:
        bus._close_at_exit()
    except Exception:
        logger.exception("%r: error while closing at exit", bus)


def _on_sigterm(signum: int, frame: Any) -> None:
    """End the runs ``interrupted`` and deliver what the buses hold within their
    ``exit_timeout`` (the exit sequence, less the wait for children), then die of SIGTERM as
    without this handler."""
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        # A handler installed later calls this one (Lightning's composes the ones before it):
        # that handler owns SIGTERM, and may well mean the process to go on (SLURM requeue).
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    process.sigterm_installed = False
    # On another thread: this one may have been interrupted holding a lock the exit needs;
    # then the wait below ends at the budget instead of never.
    budget = process.exit_budget()
    finisher = threading.Thread(
        target=functools.partial(
            process.at_exit, wait_for_children=False, run_status="interrupted"
        ),
        name="monitor_bus-sigterm",
        daemon=True,
    )
    finisher.start()
    finisher.join(None if budget is None else budget + 1.0)  # + the relay's close
    os.kill(os.getpid(), signal.SIGTERM)


def in_bus_thread() -> bool:
    """Whether the calling thread belongs to a bus (a handler or a dispatcher thread)."""
    return threading.get_ident() in process.bus_threads


atexit.register(process.at_exit)
os.register_at_fork(before=process.before_fork, after_in_child=process.after_fork_in_child)
