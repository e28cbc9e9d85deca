"""The state a rank merge shares across its roles, and every rank's side of it: the tap a
Stat's closed window enters by, the collecting of those windows, and the logging of a
window on the rank's own bus.

``MergeState`` holds what each role module (``_sending``, ``_receiving``, ``_leader``,
``_dst``, ``_stragglers``, ``_hang``) reads and writes: its ``__init__`` is the one place a
merge's state is made, leader's and dst's included.

Guarantees
----------
- Off the training thread: a closed window reaches ``RankMerge._tap`` on the thread that
  closed it (a ``Stat.add``, the dispatcher's timer), which only appends it to a deque. All
  reading of device values, encoding and I/O run on the merge's own daemon threads.
- Fork: in a forked child (a DataLoader worker) the tap declines, so the child's windows take
  the bus's usual way (to its parent's bus, as events): they are not merged.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import _stat
from .._ratelimit import LOG_INTERVAL, Throttle
from .._window import STAT_EVENT, ClosedWindow
from ._bucket import _Bucket, _data, _stamp
from ._frame import _Record, _record
from ._slowdown import SlowdownRule

if TYPE_CHECKING:
    from .._bus import EventBus

logger = logging.getLogger("monitor_bus")

# How often a rank says how far its clock is, when it has nothing else to send.
_HEARTBEAT = 1.0
# Shortest pause between two rounds of a rank's thread (windows shorter than this are sent
# in batches).
_MIN_TICK = 0.02
# A window is past on a rank once its clock is this far beyond the end (float slack).
_EPSILON = 1e-3


class Exposure:
    """A straggling rank's episode so far under StepAnatomy's rule (``_anatomy``): its
    windows over the rule, summed."""

    __slots__ = ("exposed", "extra_gc", "extra_stage", "windows")

    def __init__(self) -> None:
        #: Windows counted.
        self.windows = 0
        #: The exposed seconds per step, summed over the windows.
        self.exposed = 0.0
        #: The rank's GC seconds per step over the others' median, summed.
        self.extra_gc = 0.0
        #: stage -> the rank's busy seconds per step over the others' median, summed.
        self.extra_stage: dict[str, float] = {}


class MergeState:
    """A rank merge's state, and what every rank does with it; ``RankMerge`` is the whole."""

    def __init__(
        self,
        bus: EventBus,
        dist: Any,
        group: Any,
        dst: int,
        timeout: float,
        keep_local: bool,
        *,
        spread: bool = True,
        stragglers: Mapping[str, float] | None = None,
        straggler_windows: int = 3,
        exposed_fraction: float | None = None,
        slowdown: float | None = None,
        hosts: list[str] | None = None,
        upstream: Mapping[int, int] | None = None,
    ) -> None:
        self.bus = bus
        self.rank: int = dist.get_rank()
        self.world_size: int = dist.get_world_size()
        self.dst = dst
        # rank -> the rank it sends to: dst, or (two-level) its host's leader; None: flat.
        route = dict(upstream) if upstream else dict.fromkeys(range(self.world_size), dst)
        #: Whether windows go through host leaders (``two_level``) or straight to dst.
        self.two_level = upstream is not None
        #: The rank this rank sends its windows to: dst, or its host's leader (dst: itself).
        self.upstream: int = route[self.rank]
        # The ranks that send to this one (dst; a host leader: its host's other ranks) and,
        # on dst, each leader's other ranks.
        self._sources = {r for r, to in route.items() if to == self.rank and r != self.rank}
        self._below: dict[int, set[int]] = {}
        if self.rank == dst:
            for r, to in route.items():
                if to != dst:
                    self._below.setdefault(to, set()).add(r)
        # dst: what each leader said of its host: the ranks it lost, the ranks done.
        self._lost_below: dict[int, set[int]] = {}
        self._done_below: dict[int, set[int]] = {}
        # A leader merges a window at most half the timeout past its end, so that its record
        # reaches dst, which waits the whole timeout, in time.
        self._patience = timeout if self.rank == dst else timeout / 2
        self.timeout = timeout
        self.keep_local = keep_local
        self.spread = spread
        self.stragglers = dict(stragglers or {})
        self.straggler_windows = straggler_windows
        #: StepAnatomy's straggler rule: the part of the step the others wait for a rank
        #: from which it is over the rule; None: the rule is off.
        self.exposed_fraction = exposed_fraction
        #: The slowdown rule's threshold (``_slowdown``): the part slower the job's step must
        #: get and stay to be named; None: the rule is off.
        self.slowdown = slowdown
        # The slowdown rule of each StepAnatomy family, by its ``<prefix>.time_s`` (dst only).
        self._slowdown_rules: dict[str, SlowdownRule] = {}
        #: The host name of each rank, by rank.
        self.hosts: list[str] = hosts or [""] * self.world_size
        #: The (Stat name, rank) pairs dst names stragglers now (dst only); StepAnatomy's rule's
        #: Stat name is its ``<prefix>.wait_s``.
        self.straggling: set[tuple[str, int]] = set()
        self._streaks: dict[tuple[str, int], int] = {}
        # StepAnatomy's rule: each straggling rank's episode so far, by (wait Stat, rank).
        self._exposures: dict[tuple[str, int], Exposure] = {}
        # The hang rule (``_hang``): each rank's last progress (a leader: its host's; dst: every
        # rank's) and when it was heard of, None once it has none; whether a hang is named.
        self._progress: dict[int, tuple[list[Any], float] | None] = {}
        self._hanging = False
        #: Windows this rank handed to dst (dst counts its own here too).
        self.sent = 0
        #: Merged windows dst logged (dst only).
        self.merged = 0
        #: Windows dst received from the other ranks (dst only).
        self.received = 0
        #: Merged windows logged without a rank dst still expected (dst only).
        self.missing = 0
        #: Windows that reached dst after their window was merged, logged on their own.
        self.late = 0
        #: Windows this rank logged itself because dst was gone (marked ``"<name>.rank"``).
        self.local = 0
        #: Windows no frame could carry, even with their Histogram coarsened (a Stat name too
        #: long): logged by this rank itself, marked ``"<name>.rank"``.
        self.unsent = 0
        #: Windows lost because their device values could not be read (logged).
        self.errors = 0
        #: Windows of its host's other ranks this host leader handed to dst, merged.
        self.relayed = 0
        #: Messages this rank sent (dst: received), each 16 KiB long.
        self.frames = 0
        self._receiver: threading.Thread | None = None  # dst's receiving thread
        self._dist = dist
        self._group = group
        self._windows: deque[ClosedWindow] = deque()
        self._inbox: deque[tuple[int, dict[str, Any]]] = deque()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._done = threading.Event()
        self._close_lock = threading.Lock()
        self._tap_lock = threading.Lock()
        self._pid = os.getpid()
        self._sealed = False
        self._heartbeat = min(_HEARTBEAT, timeout / 4)
        self._closed = False
        self._dst_gone = False
        self._lost: set[int] = set()
        self._spoken: set[int] = set()  # the ranks dst has had a message from
        self._throttle = Throttle(LOG_INTERVAL)
        # dst's view of each rank: how far its clock is, when it was last heard of, and
        # whether it said goodbye.
        now = time.monotonic()
        self._mark = {r: -math.inf for r in self._sources | {self.rank}}
        self._heard = dict.fromkeys(self._sources | {self.rank}, now)
        self._finished: set[int] = set()
        self._buckets: dict[tuple[Any, ...], _Bucket] = {}
        self._sizes: set[float] = set()  # the window sizes of the windows taken so far
        self._merged_keys: dict[tuple[Any, ...], float] = {}
        # The merge's thread, made by ``RankMerge._start``: this rank's sender, or dst's or a
        # host leader's merger.
        self._thread: threading.Thread | None = None
        # A leader's last mark to dst, and when it sent it.
        self._sent_mark = self._last_sent = -math.inf
        self._close_deadline = math.inf  # set by the first close()

    @property
    def _merges(self) -> bool:
        """Whether this rank merges what others send it: dst, and a host leader."""
        return self.rank == self.dst or bool(self._sources)

    # -- the Stat's side: never blocks --

    def _tap(self, window: ClosedWindow) -> bool:
        if os.getpid() != self._pid:  # a forked worker's copy: its bus forwards it as usual
            return False
        with self._tap_lock:  # held only by _finish, briefly: the caller never waits long
            if self._sealed:
                return False
            self._windows.append(window)
        return not self.keep_local

    def _finish(self) -> None:
        """The merge's thread, last: later windows are logged as without the merge."""
        with self._tap_lock:
            self._sealed = True
            if self.bus._window_tap == self._tap:
                self.bus._window_tap = None
            late = list(self._windows)  # closed after the last round
            self._windows.clear()
            inbox = list(self._inbox)
            self._inbox.clear()
        for window in late:
            self.bus._window_closed(window)
        for source, message in inbox:
            self._log_late(source, message)
        self._done.set()

    def _log_late(self, source: int, message: dict[str, Any]) -> None:
        """dst, after its close: what a rank still sends is logged window by window."""
        for record in message["windows"]:
            with self._tap_lock:  # the receiving thread and the merge's may both be here
                self.received += 1
                self.late += 1
            bucket = _Bucket()
            bucket.add(source, record)
            data = _data(record, bucket)
            data[f"{record[0]}.late"] = True
            self.bus._log_window((STAT_EVENT, _stamp(bucket.last[0]), data))

    # -- every rank: close the due windows, take what was closed --

    def _now(self) -> float:
        return _stat._clock() + self.bus._clock_offset

    def _collect(self) -> tuple[list[_Record], float]:
        """Close the windows that are over; return what was closed and how far this rank is."""
        mark = self._now() - _EPSILON
        for stat in self.bus._stats():
            stat.count  # noqa: B018 - reading it closes the window if its end has passed
        records = []
        windows = self._windows
        while windows:
            window = windows.popleft()
            try:
                window.wait()
                window.resolve()
            except Exception:  # a device value that cannot be read: the window is lost
                self.errors += 1
                if self._throttle.ready("errors"):
                    logger.exception(
                        "merge_stats_across_ranks: a window of Stat %r could not be read "
                        "(%d windows in all)",
                        window.stat._name,
                        self.errors,
                    )
                continue
            records.append(_record(window))
        return records, mark

    def _next_round(self, last_sent: float) -> float:
        """Seconds until the next window end of this bus's Stats, or the next heartbeat."""
        now = self._now()
        wake = last_sent + self._heartbeat
        for size in {stat._window for stat in self.bus._stats()}:
            wake = min(wake, (math.floor(now / size) + 1) * size)
        return max(wake - now + _EPSILON, _MIN_TICK)

    def _left(self) -> float:
        """Seconds left to close in."""
        return max(self._close_deadline - time.monotonic(), 0.0)

    def _log_own(self, record: _Record) -> None:
        """Log one of this rank's windows itself, marked ``"<name>.rank"``."""
        bucket = _Bucket()
        bucket.add(self.rank, record)
        data = _data(record, bucket)
        data[f"{record[0]}.rank"] = self.rank
        self.bus._log_window((STAT_EVENT, _stamp(bucket.last[0]), data))
