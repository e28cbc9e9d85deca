"""Stat windows of every ``torch.distributed`` rank merged into one stream on ``dst``.

Guarantees
----------
- Off the training thread: a closed window reaches ``RankMerge._tap`` on the thread that
  closed it (a ``Stat.add``, the dispatcher's timer), which only appends it to a deque. All
  reading of device values, encoding and I/O run on the merge's own daemon threads.
- Own group: the windows travel over a gloo group made by ``merge_stats_across_ranks`` (a
  collective), never the training's group. Each rank sends to ``dst`` point to point; ``dst``
  takes whatever any rank sends with one receive from any source, so a dead or hung rank
  holds up no other rank's messages; a receive that fails (matched to a rank that died
  mid-send) is warned about and the next one made (three failing in a row end it, logged).
- Two levels (``two_level``; by default once a host other than ``dst``'s runs two or more
  ranks): a host is a torchrun node (host name and ``GROUP_RANK``). Its lowest rank, the
  leader, takes its host's windows as ``dst`` takes a rank's (the rules below hold there,
  ``dst``'s own host sending to ``dst``), merges each window once due, at most half the
  timeout past its end, and sends ``dst`` one host record for it: the merge, plus each rank's
  count and sum, the rank whose VALUE it kept and the ranks it was merged without. ``dst``
  merges a host record as the windows it holds, so the merged window, its spread and the
  stragglers are those of the flat shape. A rank lost at its leader is warned about there
  and, once the leader says so, on ``dst`` too (in ``lost_ranks``); windows merged without it
  count in ``dst``'s ``missing``; what it sends after rejoining goes on to ``dst``, merged or
  logged late there. A leader says goodbye once its host's ranks did (or half its close
  timeout passed), naming those done; ``dst`` waits for the others. A dead leader is a dead
  ``dst`` to its host's ranks (they log their windows, counted in ``local``) and, to ``dst``, a
  silent rank whose whole host is lost; what it held unsent is lost with it, and the windows
  merged without its host count in ``missing``. A stopped leader is waited for by its
  host's ranks (below) and is, to ``dst``, a lost rank with its host until it speaks again.
- Bounded: a send that fails (gloo reports at once a peer that died) makes its upstream
  (``dst`` or the leader) gone for good: the rank logs its own windows locally, marked
  ``"<name>.rank"`` and counted in ``local``. One not taken for ``timeout`` (upstream stopped
  or starved) is warned about and waited for, the rank's windows held in its queue
  meanwhile (memory grows with the stall): a timed-out gloo wait would close the rank's
  group for good, so the rank rejoins once upstream runs again. Only ``close()`` gives it
  up, at its deadline (half its timeout), cancelling the send, and the rank logs what it
  held locally (counted in ``local``). ``dst`` merges a window once every rank
  it still expects has said it is past the window's end, or ``timeout`` after the end; a rank
  silent for ``timeout`` is lost (warned, rate-limited) and no longer waited for, and every
  window merged before it said it was past the window counts in ``missing``.
- Starved is not dead: a lost rank may only be short of CPU. When it speaks again it rejoins
  (warned), its windows merged, or, if their window was merged already, logged on their own
  (marked ``"<name>.late": True``, no spread keys) and counted in ``late``, not ``merged``.
  ``dst``'s ``close()`` waits, within its timeout, for the goodbye of
  every rank it has heard from, lost or not; a rank whose goodbye did not come is named
  (warning, ``unfinished_ranks``) and what it still sends is logged on its own, counted in
  ``late``, for as long as ``dst``'s process lives.
- Exact and once (either shape): counts and sums add, max of maxes, min of mins (NaN if any
  rank's is, as a Stat's MAX and MIN over its samples; here, locally and late), mean is sum
  over count, value is the one of the rank whose window closed last (on a tie, the higher
  rank); STDDEV from the ranks' moments (Chan et al.'s pairwise update: in the two-level
  shape in another order, so equal to rounding), the percentiles read from, and HISTOGRAM
  is, the ranks' Histograms merged (``Histogram.merge``: exact). Each
  window of each rank is merged once; one arriving after its window was merged is logged on
  its own, marked ``"<name>.late"``, counted in ``late``.
- Every sample travels: every frame is within ``FRAME_BYTES`` (the mark and a leader's word
  on its host go in a frame of their own when they do not fit beside the windows; a frame
  that cannot be encoded costs its own windows, logged and counted in ``unsent``, never
  upstream). A window too large for a frame goes with its
  Histogram coarsened a scale at a time until it fits (each scale doubles the percentiles'
  error bound), warned per Stat (rate-limited); one that cannot fit even so (a Stat name about
  a frame long) is logged by its rank, marked ``"<name>.rank"``, counted in ``unsent``.
- Spread (``spread=True``): a merged window of a Stat with MEAN also holds
  ``<name>.rank_min``, ``.rank_p50``, ``.rank_max`` over the window means of the ranks that
  contributed (NaN means left out) and ``<name>.slowest_rank``, the rank of the highest
  mean (on a tie, the lower rank). ``hosts[rank]`` names its host.
- Stragglers (dst only): a rank whose window mean of a watched Stat exceeds the median of the
  other ranks' means (never its own: two ranks compare with each other) by its factor for
  ``straggler_windows`` merged windows in a row is named once by a ``STRAGGLER_EVENT`` (and
  a warning, rate-limited per Stat), and once more with ``recovered: True`` in its first
  merged window back under the factor. A Stat without MEAN or SUM gives each rank's mean
  from its Histogram's sum or its moments; one with neither (only VALUE, COUNT, MAX, MIN)
  is warned about and names nobody. Windows it has no samples in (or no other rank has),
  and late windows, leave its count as it was.
- Windows line up: the bus's windows are moved to wall-clock multiples of their size
  (``bus._clock_offset``); a rank whose clock is off by ``d`` puts its samples ``d`` late.
- Fork: in a forked child (a DataLoader worker) the tap declines, so the child's windows take
  the bus's usual way (to its parent's bus, as events): they are not merged.
- Exit: ``close()`` closes the bus's open windows, sends them, and (on ``dst``) waits for
  every rank's last message, all within its timeout; it runs at interpreter exit (``atexit``,
  before the buses close) for a merge left open. ``dst``'s receiving thread may stay blocked
  on a rank that never said goodbye: it is a daemon and does not hold up exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import socket
import statistics
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from .. import _stat
from .._check import check_int, check_timeout, type_name, wrong_type
from .._event import Event
from .._histogram import Histogram
from .._ratelimit import LOG_INTERVAL, Throttle
from .._stat import STAT_EVENT, AggregateValue, ClosedWindow, merge_moments

if TYPE_CHECKING:
    from .._bus import EventBus

logger = logging.getLogger("monitor_bus")

#: The name of the event ``dst`` logs when it names a straggler, or one recovers: data
#: ``stat``, ``rank``, ``ratio`` (the rank's window mean over the median of the other ranks' means), ``windows``
#: (how many merged windows in a row it was over), ``host`` and ``recovered``.
STRAGGLER_EVENT = "monitor_bus.straggler"

# Every message is one frame of this many bytes: a 4-byte length, then JSON. One fixed size
# lets dst take a frame from any rank with a single receive (gloo needs sizes to match).
_FRAME = FRAME_BYTES = 16384
# The most JSON a window may be: a frame less its length and the envelope of a frame that
# carries no mark (``RankMerge._encode``'s); the mark and a leader's word go in a frame of
# their own when they do not fit beside the windows.
_ROOM = _FRAME - 4 - len('{"mark":null,"bye":false,"windows":[]}')
_TAG = 7301
# How often a rank says how far its clock is, when it has nothing else to send.
_HEARTBEAT = 1.0
# Shortest pause between two rounds of a rank's thread (windows shorter than this are sent
# in batches).
_MIN_TICK = 0.02
# dst's receive waits this long: a timed-out gloo wait fails every peer of the group, so it
# must not time out while the ranks are merely quiet.
_FOREVER = timedelta(days=365)
# A receiving thread ends after this many failed receives in a row (one is a rank that died
# mid-send).
_RECEIVE_TRIES = 3
# A window is past on a rank once its clock is this far beyond the end (float slack).
_EPSILON = 1e-3

# Record fields: name, aggregation values, window size, window index, count, sum, max, min,
# value, close time (wall seconds), moments (STDDEV), Histogram.to_dict() or None; a host
# record (a leader's merge of its host's windows) adds a 13th: {"rank": the rank whose value
# it kept, "parts": [[rank, count, sum], ...] of the ranks it merged, "behind": the ranks of
# its host it was merged without}.
_Record = list[Any]
# A window due on dst or a leader: its key, its bucket, whether late, the ranks it is without.
_Due = tuple[tuple[Any, ...], "_Bucket", bool, set[int]]


def _record(window: ClosedWindow) -> _Record:
    stat = window.stat
    size = stat._window
    return [
        stat._name,
        [agg.value for agg in stat._aggregations],
        size,
        round(window.end / size),
        window.count,
        _window_sum(window),
        window.high,
        window.low,
        window.value,
        window.stamp.timestamp(),
        list(window.moments),
        None if window.histogram is None else window.histogram.to_dict(),
    ]


def _window_sum(window: ClosedWindow) -> float:
    """The window's sum; for a Stat without SUM or MEAN (which folds no sum), the one its
    Histogram or moments hold, so a straggler watch has each rank's mean all the same."""
    if window.stat._want_sum:
        return window.total
    if window.histogram is not None:
        return window.histogram.sum
    n, shift, mean, _ = window.moments
    return (shift + mean) * n if n else window.total


def _windows_in(record: _Record) -> int:
    """How many ranks' windows a record holds: one, or a host record's parts."""
    return len(record[12]["parts"]) if len(record) > 12 else 1


def _host_record(key: tuple[Any, ...], bucket: _Bucket, behind: set[int]) -> _Record:
    """A leader's merge of its host's windows of ``key``, as one record for dst."""
    name, aggs, size, index = key
    return [
        name,
        list(aggs),
        size,
        index,
        bucket.count,
        bucket.total,
        bucket.high,
        bucket.low,
        bucket.value,
        bucket.last[0],
        list(bucket.moments),
        None if bucket.histogram is None else bucket.histogram.to_dict(),
        {
            "rank": bucket.last[1],
            "parts": [[rank, *part] for rank, part in sorted(bucket.parts.items())],
            "behind": sorted(behind),
        },
    ]


class _Bucket:
    """The windows of one (stat, window) from the ranks that reported it so far."""

    __slots__ = (
        "behind",
        "count",
        "high",
        "histogram",
        "last",
        "low",
        "moments",
        "parts",
        "total",
        "value",
    )

    # ``last``: (close time, rank) of the window whose value is kept: two ranks' timers can
    # close a window in the same microsecond, and the higher rank wins that tie.

    def __init__(self) -> None:
        self.parts: dict[int, tuple[int, float]] = {}  # rank -> its count and sum
        self.count = 0
        self.total = 0.0
        self.high = -math.inf
        self.low = math.inf
        self.value: float = math.nan
        self.last: tuple[float, int] = (-math.inf, -1)
        self.moments: _stat.Moments = (0, 0.0, 0.0, 0.0)
        self.histogram: Histogram | None = None
        self.behind: set[int] = set()  # the ranks host records were merged without

    def add(self, rank: int, record: _Record) -> None:
        """Add ``rank``'s window, or the ranks' windows a host record from ``rank`` holds."""
        count, total, high, low, value, closed = record[4:10]
        if len(record) > 12:  # a host record: its ranks' parts, the rank of its value
            host = record[12]
            for part_rank, part_count, part_total in host["parts"]:
                self.parts[part_rank] = (part_count, part_total)
            self.behind.update(host["behind"])
            rank = host["rank"]
        else:
            self.parts[rank] = (count, total)
        self.count += count
        self.total += total
        # A NaN MAX or MIN of any rank's makes the merged one NaN, as a Stat's over samples.
        if high > self.high or math.isnan(high):
            self.high = high
        if low < self.low or math.isnan(low):
            self.low = low
        if (closed, rank) > self.last:
            self.last, self.value = (closed, rank), value
        moments, histogram = record[10:12]
        self.moments = merge_moments(self.moments, tuple(moments))
        if histogram is not None:
            theirs = Histogram.from_dict(histogram)
            self.histogram = theirs if self.histogram is None else self.histogram.merge(theirs)


class RankMerge:
    """A running merge of Stat windows across ranks; see ``merge_stats_across_ranks``.

    The counters are plain ints, read from any thread. ``close()`` and the context manager
    end the merge; ``close()`` is idempotent and thread-safe.
    """

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
        #: The host name of each rank, by rank.
        self.hosts: list[str] = hosts or [""] * self.world_size
        #: The (Stat name, rank) pairs dst names stragglers now (dst only).
        self.straggling: set[tuple[str, int]] = set()
        self._streaks: dict[tuple[str, int], int] = {}
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
        self._thread = threading.Thread(
            target=self._run_merger if self._merges else self._run_sender,
            name=f"monitor_bus-merge-{self.rank}",
            daemon=True,
        )

    @property
    def _merges(self) -> bool:
        """Whether this rank merges what others send it: dst, and a host leader."""
        return self.rank == self.dst or bool(self._sources)

    @property
    def lost_ranks(self) -> frozenset[int]:
        """The ranks dst stopped waiting for: silent for ``timeout`` (dst only; a host leader:
        its host's). On dst they include those lost at their host's leader, and every rank of
        a lost leader's host."""
        lost = set(self._lost)
        for leader in self._lost:
            lost |= self._below.get(leader, set())
        for below in self._lost_below.values():
            lost |= below
        return frozenset(lost)

    @property
    def unfinished_ranks(self) -> frozenset[int]:
        """The ranks whose goodbye dst still waits for, or did not get by its close (dst only;
        a host leader: its host's)."""
        return frozenset(self._unfinished() if self._merges else ())

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
            data = self._data(record, bucket)
            data[f"{record[0]}.late"] = True
            self.bus._log_window((STAT_EVENT, _stamp(bucket.last[0]), data))

    def _start(self) -> None:
        bus = self.bus
        bus._clock_offset = time.time() - _stat._clock()
        for stat in bus._stats():  # their open windows end on the old clock: logged here
            stat._close()
        bus._window_tap = self._tap
        if self._merges:
            self._receiver = threading.Thread(
                target=self._receive, name="monitor_bus-merge-receive", daemon=True
            )
            self._receiver.start()
        self._thread.start()
        atexit.register(self._close_at_exit)

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

    # -- a rank other than dst --

    def _run_sender(self) -> None:
        last_sent = -math.inf
        while True:
            closing = self._closing.is_set()
            if not closing:
                self._wake.wait(self._next_round(last_sent))
                self._wake.clear()
                closing = self._closing.is_set()
            try:
                records, mark = self._collect()
                if closing:
                    mark = math.inf
                if self._dst_gone:
                    self._log_local(records)
                else:
                    self._send(records, mark, bye=closing)
                    last_sent = self._now()
            except Exception:
                logger.exception("merge_stats_across_ranks: rank %d failed a round", self.rank)
            if closing:
                self._finish()
                return

    def _send(self, records: list[_Record], mark: float, *, bye: bool, host: str = "") -> None:
        """Send ``records`` upstream (dst, or this host's leader), then how far this rank is
        and, from a leader, ``host``: what it says of its host's ranks."""
        for frame, sent in self._frames(records, mark, bye, host):
            if self._dst_gone:
                self._log_local(sent)
                continue
            try:
                tensor = self._tensor(frame)
            except Exception:  # this frame's fault, not upstream's: its windows only
                self._log_unframed(sent)
                continue
            try:
                work = self._dist.isend(tensor, dst=self.upstream, group=self._group, tag=_TAG)
                self._wait_sent(work)
            except Exception as exc:
                self._dst_gone = True
                logger.warning(
                    "merge_stats_across_ranks: rank %d cannot reach %s rank %d (%s); from now "
                    "on it logs its own Stat windows, marked %r",
                    self.rank,
                    self._upstream_name,
                    self.upstream,
                    str(exc).splitlines()[0][:200],
                    "<name>.rank",
                )
                self._log_local(sent)
                continue
            for record in sent:
                own = len(record) <= 12 or any(p[0] == self.rank for p in record[12]["parts"])
                self.sent += own
                self.relayed += _windows_in(record) - own
            self.frames += 1

    def _wait_sent(self, work: Any) -> None:
        """Wait until upstream takes a send. One that takes nothing for ``timeout`` (stopped,
        starved) is warned about and waited for, this rank's windows held meanwhile: a
        timed-out gloo wait closes every pair of the rank's group, so it could never rejoin.
        Only ``close()`` gives it up, at its deadline, cancelling the send (that same timed
        wait), so that what the rank logs itself never reaches upstream too.

        Raises:
            Exception: the send failed (gloo reports a dead peer at once) or was given up.
        """
        done = threading.Event()
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                work.wait(timeout=_FOREVER)
            except Exception as exc:  # raised on the sending thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name="monitor_bus-merge-send", daemon=True).start()
        started = time.monotonic()
        stalled = warned = False
        while not done.wait(_MIN_TICK * 5):
            waited = time.monotonic() - started
            if not stalled and waited >= self.timeout:
                stalled = True
                # Rate-limited: on an overloaded host a send may often wait that long.
                warned = self._throttle.ready("stalled")
                if warned:
                    logger.warning(
                        "merge_stats_across_ranks: rank %d: %s rank %d has taken no message "
                        "for %.1f s (stopped or starved?); it holds its windows until it does, "
                        "or its close() gives it up",
                        self.rank,
                        self._upstream_name,
                        self.upstream,
                        waited,
                    )
            if self._closing.is_set() and time.monotonic() >= self._close_deadline:
                # gloo's own timeout closes the group's pairs: the send is never delivered.
                with contextlib.suppress(Exception):
                    work.wait(timeout=timedelta(milliseconds=1))
                if not done.wait(self.timeout) or failed:
                    raise TimeoutError(f"it took no message for {waited:.1f} s; given up at close")
        if failed:
            raise failed[0]
        if warned:
            logger.warning(
                "merge_stats_across_ranks: rank %d: %s rank %d takes messages again (after "
                "%.1f s); the rank sends on",
                self.rank,
                self._upstream_name,
                self.upstream,
                time.monotonic() - started,
            )

    @property
    def _upstream_name(self) -> str:
        return "dst" if self.upstream == self.dst else "its host's leader"

    def _frames(
        self, records: list[_Record], mark: float, bye: bool, host: str = ""
    ) -> list[tuple[bytes, list[_Record]]]:
        """The frames carrying ``records``, each within ``_FRAME`` bytes (but for a ``host``
        longer than a frame); only the last one says how far this rank is and carries
        ``host``, a JSON object, on its own if they do not fit beside the windows."""
        frames: list[tuple[bytes, list[_Record]]] = []
        batch: list[str] = []
        batch_records: list[_Record] = []
        size = 0  # the batch's JSON: its windows and the commas between them
        for record in records:
            text = self._fitted(record)
            if text is None:
                self._log_unsent(record)
                continue
            # ASCII (json.dumps escapes the rest): a character is a byte.
            if batch and size + 1 + len(text) > _ROOM:
                frames.append((self._encode(batch, None, False), batch_records))
                batch, batch_records, size = [], [], 0
            size += len(text) + (1 if batch else 0)
            batch.append(text)
            batch_records.append(record)
        if batch and len(self._encode([], mark, bye, host)) + size > _FRAME:
            frames.append((self._encode(batch, None, False), batch_records))
            batch, batch_records = [], []
        frames.append((self._encode(batch, mark, bye, host), batch_records))
        return frames

    def _fitted(self, record: _Record) -> str | None:
        """The record's JSON, within a frame: its Histogram coarsened (``Histogram.merge``'s
        own coarsening, a scale at a time) until it fits; None if even that does not do."""
        text = json.dumps(record)
        if len(text) <= _ROOM:
            return text
        original = record[11]
        if original is None:
            return None
        histogram = Histogram.from_dict(original)
        start = histogram.scale
        while len(text) > _ROOM:
            widest = max(len(histogram.positive_counts), len(histogram.negative_counts))
            if widest <= 3:  # as coarse as a Histogram gets: logged here at full resolution
                record[11] = original
                return None
            # An empty Histogram of one bucket fewer: the merge coarsens by one scale.
            histogram = histogram.merge(Histogram(max_buckets=widest - 1))
            coarse = histogram.to_dict()
            coarse["max_buckets"] = original["max_buckets"]  # merges on dst as before
            record[11] = coarse
            text = json.dumps(record)
        name = record[0]
        if self._throttle.ready(("coarsened", name)):
            logger.warning(
                "merge_stats_across_ranks: a window of Stat %r is too large for a %d-byte frame: "
                "rank %d sent its Histogram at scale %d (from %d), its percentiles within "
                "%.2g%% (see docs/multihost.md)",
                name,
                _FRAME,
                self.rank,
                histogram.scale,
                start,
                100 * _quantile_error(histogram.scale),
            )
        return text

    def _log_unsent(self, record: _Record) -> None:
        """A record no frame can carry (a Stat name too long): logged here, counted, warned."""
        self.unsent += 1
        if self._throttle.ready(("unsent", record[0])):
            logger.warning(
                "merge_stats_across_ranks: a window of Stat %r does not fit a %d-byte frame even "
                "with its Histogram coarsened: rank %d logs it itself, marked %r (%d in all)",
                record[0][:200],
                _FRAME,
                self.rank,
                "<name>.rank",
                self.unsent,
            )
        self._log_own(record)

    def _log_unframed(self, records: list[_Record]) -> None:
        """Records whose frame could not be made (a leader's word on its host longer than a
        frame): logged here, counted in ``unsent``, warned; upstream is not given up."""
        windows = sum(map(_windows_in, records))
        self.unsent += windows
        if self._throttle.ready("unframed"):
            logger.exception(
                "merge_stats_across_ranks: rank %d could not encode a frame; it logs the %d "
                "window(s) it held itself, marked %r (%d unsent in all)",
                self.rank,
                windows,
                "<name>.rank",
                self.unsent,
            )
        for record in records:
            self._log_own(record)

    @staticmethod
    def _encode(batch: list[str], mark: float | None, bye: bool, host: str = "") -> bytes:
        windows = ",".join(batch)
        extra = f',"host":{host}' if host else ""
        body = f'{{"mark":{json.dumps(mark)},"bye":{json.dumps(bye)},"windows":[{windows}]{extra}}}'
        data = body.encode()
        return struct.pack("<I", len(data)) + data

    def _tensor(self, frame: bytes) -> Any:
        import torch

        if len(frame) > _FRAME:
            raise ValueError(f"a frame of {len(frame)} bytes, over {_FRAME}")
        buf = torch.zeros(_FRAME, dtype=torch.uint8)
        buf[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        return buf

    def _log_local(self, records: list[_Record]) -> None:
        for record in records:
            self._log_own(record)
            self.local += _windows_in(record)

    def _log_own(self, record: _Record) -> None:
        """Log one of this rank's windows itself, marked ``"<name>.rank"``."""
        bucket = _Bucket()
        bucket.add(self.rank, record)
        data = self._data(record, bucket)
        data[f"{record[0]}.rank"] = self.rank
        self.bus._log_window((STAT_EVENT, _stamp(bucket.last[0]), data))

    # -- dst --

    def _receive(self) -> None:
        """dst's receiving thread: one receive from any rank at a time, as long as it takes (a
        timed-out gloo receive fails every pair of the group)."""
        import torch

        buf = torch.zeros(_FRAME, dtype=torch.uint8)
        waiting = set(self._sources)
        failures = 0
        while waiting:
            try:
                work = self._dist.irecv(buf, src=None, group=self._group, tag=_TAG)
                work.wait(timeout=_FOREVER)
            except Exception as exc:
                # A receive matched to a rank that died mid-send fails; the other ranks'
                # sends still come. Only receives failing in a row end the thread.
                failures += 1
                if failures == _RECEIVE_TRIES:
                    logger.exception(
                        "merge_stats_across_ranks: rank %d: receive failed %d times in a row; "
                        "it receives no more",
                        self.rank,
                        failures,
                    )
                    return
                logger.warning(
                    "merge_stats_across_ranks: rank %d: a receive failed (%s); receiving on",
                    self.rank,
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                )
                continue
            failures = 0
            self.frames += 1
            raw = buf.numpy().tobytes()
            (length,) = struct.unpack_from("<I", raw)
            source = work._source_rank()  # source_rank() warns: deprecated
            message = json.loads(raw[4 : 4 + length])
            bye = message["bye"]
            with self._tap_lock:
                if not self._sealed:
                    self._inbox.append((source, message))
                    self._wake.set()
                    message = None
            if message is not None:  # after dst's close: logged on their own
                self._log_late(source, message)
            if bye:
                waiting.discard(source)

    def _run_merger(self) -> None:
        """dst's thread, and a host leader's: take this rank's windows and what the others
        send, and merge each window once due (dst logs it; a leader sends it on to dst)."""
        last_round = -math.inf
        closed_round = False  # the round that takes this rank's last windows
        role = "dst" if self.rank == self.dst else "host leader"
        while True:
            closing = self._closing.is_set()
            if not closing:
                wait = self._next_dst_round(last_round)
            else:
                wait = 0.0 if not closed_round else min(_MIN_TICK * 5, self._left())
            if wait:
                self._wake.wait(wait)
                self._wake.clear()
            final = False
            try:
                now = self._now()
                if (closing and not closed_round) or (
                    not closing and now - last_round >= _MIN_TICK
                ):
                    records, mark = self._collect()
                    last_round = now
                    if closing:
                        mark, closed_round = math.inf, True
                    for record in records:
                        self._take(self.rank, record)
                    if self.rank == self.dst:  # a leader counts its own once sent on
                        self.sent += len(records)
                    self._mark[self.rank] = mark
                    self._heard[self.rank] = time.monotonic()
                self._read_inbox()
                final = closing and (self._everyone_done() or not self._left())
                now = self._now()
                due = self._due(now, final=final)
                if self.rank == self.dst:
                    self._log_merged(due)
                else:
                    self._send_on(due, now, final=final)
            except Exception:
                logger.exception(
                    "merge_stats_across_ranks: %s rank %d failed a round", role, self.rank
                )
                final = closing and not self._left()
            if final:
                unfinished = self._unfinished()
                if unfinished:
                    logger.warning(
                        "merge_stats_across_ranks: %s rank %d closed without the last windows "
                        "of rank(s) %s (no goodbye within its timeout); what they still send is "
                        "logged on its own and counted in late while this process lives",
                        role,
                        self.rank,
                        ", ".join(map(str, sorted(unfinished))),
                    )
                self._finish()
                return

    def _send_on(self, due: list[_Due], now: float, *, final: bool) -> None:
        """A host leader: send dst a host record of each window due, how far this host is,
        and its word on its ranks; with nothing to send, only once the mark passed a window
        end (dst may wait for it) or a heartbeat is due."""
        # Every window ending before the mark was sent on: those of the ranks expected, and
        # any once past the leader's patience.
        ahead = max(min(self._mark[r] for r in self._expected()), now - self._patience)
        mark = math.inf if final else ahead
        records = [_host_record(key, bucket, behind) for key, bucket, _, behind in due]
        clock = time.monotonic()
        if records or final or self._crossed(mark) or clock - self._last_sent >= self._heartbeat:
            done = sorted(self._sources - self._unfinished())
            host = json.dumps({"lost": sorted(self._lost), "done": done}, separators=(",", ":"))
            self._send(records, mark, bye=final, host=host)
            self._sent_mark, self._last_sent = mark, clock

    def _crossed(self, mark: float) -> bool:
        """Whether ``mark`` is past the end of a window (of a size this rank saw) that the
        last mark sent was not."""
        last = self._sent_mark
        if not mark > last:
            return False
        return last == -math.inf or any(mark // size > last // size for size in self._sizes)

    _sent_mark = _last_sent = -math.inf  # a leader's last mark to dst, and when it sent it

    def _left(self) -> float:
        """Seconds left to close in."""
        return max(self._close_deadline - time.monotonic(), 0.0)

    def _next_dst_round(self, last_round: float) -> float:
        wait = self._next_round(last_round)
        if self._buckets:  # the earliest deadline of a window not yet merged
            now = self._now()
            first = min(key[2] * key[3] for key in self._buckets)
            wait = min(wait, max(first + self._patience - now, _MIN_TICK))
        return min(wait, max(self.timeout / 4, _MIN_TICK))  # notice a silent rank in time

    def _read_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            source, message = inbox.popleft()
            self._heard[source] = time.monotonic()
            self._spoken.add(source)
            if source in self._lost:
                self._lost.discard(source)
                logger.warning("merge_stats_across_ranks: rank %d is heard from again", source)
            for record in message["windows"]:
                self._take(source, record)
                self.received += _windows_in(record)
            if message["mark"] is not None:
                self._mark[source] = max(self._mark[source], message["mark"])
                if "host" in message:  # a leader's word on its host, with its mark
                    self._note_host(source, message["host"])
            if message["bye"]:
                self._finished.add(source)

    def _note_host(self, leader: int, host: dict[str, list[int]]) -> None:
        """dst: what a host leader says of its host's ranks: lost (warned here too, where the
        user looks) and done (their goodbye reached the leader)."""
        lost, before = set(host["lost"]), self._lost_below.get(leader, set())
        for rank in sorted(lost - before):
            logger.warning(
                "merge_stats_across_ranks: rank %d silent for timeout=%s s at its host's leader "
                "rank %d; windows are merged without it from now on",
                rank,
                self.timeout,
                leader,
            )
        for rank in sorted(before - lost):
            logger.warning(
                "merge_stats_across_ranks: rank %d is heard from again (by its host's leader "
                "rank %d)",
                rank,
                leader,
            )
        self._lost_below[leader] = lost
        self._done_below[leader] = set(host["done"])

    def _take(self, rank: int, record: _Record) -> None:
        key = (record[0], tuple(record[1]), record[2], record[3])
        self._sizes.add(record[2])
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        if key in self._merged_keys and self.rank == self.dst:  # a leader: dst tells
            self.late += _windows_in(record)
        bucket.add(rank, record)

    def _expected(self) -> set[int]:
        return (self._sources | {self.rank}) - self._finished - self._lost

    def _unfinished(self) -> set[int]:
        """The ranks sending to this one without a goodbye, but for lost ones never heard
        from (dead at start); on dst, with the ranks behind a leader that did not say theirs
        (all of a leader's host while its own goodbye has not come)."""
        unfinished = set()
        for source in self._sources - (self._lost - self._spoken):
            below = self._below.get(source, set())
            if source not in self._finished:
                unfinished |= {source} | below
            else:
                unfinished |= below - self._done_below.get(source, set())
        return unfinished

    def _everyone_done(self) -> bool:
        return not self._unfinished()

    def _due(self, now: float, *, final: bool) -> list[_Due]:
        """Name the ranks silent for ``timeout`` lost; take out the windows due, oldest first,
        each with whether it was merged before (late) and the ranks it is merged without
        (the ranks of a leader's host too, and those its host record was merged without)."""
        clock = time.monotonic()
        for rank in self._expected() - {self.rank}:
            if clock - self._heard[rank] >= self.timeout:
                self._lost.add(rank)
                logger.warning(
                    "merge_stats_across_ranks: rank %d silent for %.1f s; windows are merged "
                    "without it from now on",
                    rank,
                    clock - self._heard[rank],
                )
        expected = self._expected()
        due = []
        for key in sorted(self._buckets, key=lambda k: k[2] * k[3]):
            end = key[2] * key[3]
            late = key in self._merged_keys
            if (
                not late
                and not final
                and now < end + self._patience
                and any(self._mark[r] < end for r in expected)
            ):
                continue
            bucket = self._buckets.pop(key)
            # Lost ranks too: a starved rank's window may come later, logged on its own.
            behind = set()
            for rank, mark in self._mark.items():
                if mark < end:
                    behind |= {rank} | self._below.get(rank, set())
            due.append((key, bucket, late, behind | (bucket.behind - set(bucket.parts))))
            self._merged_keys[key] = end
        # A window merged long ago cannot come back but as a late one: forget it.
        horizon = now - 4 * self.timeout - 60.0
        for key, end in list(self._merged_keys.items()):
            if end < horizon:
                del self._merged_keys[key]
        return due

    def _log_merged(self, due: list[_Due]) -> None:
        """dst: log each window due, merged, with its spread, and watch it for stragglers; one
        merged before is logged on its own, marked late."""
        for key, bucket, late, behind in due:
            if behind and not late:
                self.missing += 1
                if self._throttle.ready(("missing", tuple(sorted(behind)))):
                    logger.warning(
                        "merge_stats_across_ranks: window %r ending %s merged without rank(s) "
                        "%s (no word from them within timeout=%s s)",
                        key[0],
                        _stamp(key[2] * key[3]).isoformat(),
                        ", ".join(map(str, sorted(behind))),
                        self.timeout,
                    )
            record: _Record = [key[0], list(key[1])]
            data = self._data(record, bucket)
            stamp = _stamp(bucket.last[0])
            if late:  # the rank(s) it came from only, after the merged window: marked
                data[f"{key[0]}.late"] = True
                self.bus._log_window((STAT_EVENT, stamp, data))
                continue
            means = _means(bucket)
            if self.spread and _MEAN in key[1]:
                data.update(_spread(key[0], means))
            self.bus._log_window((STAT_EVENT, stamp, data))
            self.merged += 1
            if key[0] in self.stragglers:
                self._watch(key[0], key[1], means, stamp)

    def _watch(
        self, name: str, aggs: tuple[int, ...], means: dict[int, float], stamp: datetime
    ) -> None:
        """dst: count each rank's windows over the factor; name a straggler, or its recovery."""
        if _MEAN_SOURCES.isdisjoint(aggs):  # no sum, moments or Histogram travels: no mean
            if self._throttle.ready(("no mean", name)):
                logger.warning(
                    "merge_stats_across_ranks: stragglers[%r] watches a Stat whose windows "
                    "hold no mean (aggregations %s): add MEAN, SUM, STDDEV, a percentile or "
                    "HISTOGRAM to it to have its stragglers named",
                    name,
                    ", ".join(_AGG_NAMES[agg].upper() for agg in aggs),
                )
            return
        # Each rank against the median of the others' means: one that held its own mean
        # would hide a slow rank among two, and move as ranks die.
        ordered = sorted((mean, rank) for rank, mean in means.items())
        place = {rank: i for i, (_, rank) in enumerate(ordered)}
        values = [mean for mean, _ in ordered]
        factor = self.stragglers[name]
        for rank, mean in sorted(means.items()):
            median = _median_without(values, place[rank])
            if not median > 0:  # no other rank, or no ratio to speak of: its count stays
                continue
            key = (name, rank)
            ratio = mean / median
            if ratio > factor:
                streak = self._streaks[key] = self._streaks.get(key, 0) + 1
                if streak == self.straggler_windows:
                    self.straggling.add(key)
                    self._name_straggler(name, rank, ratio, streak, stamp, recovered=False)
            else:
                streak = self._streaks.pop(key, 0)
                if key in self.straggling:
                    self.straggling.discard(key)
                    self._name_straggler(name, rank, ratio, streak, stamp, recovered=True)

    def _name_straggler(
        self, name: str, rank: int, ratio: float, windows: int, stamp: datetime, *, recovered: bool
    ) -> None:
        host = self.hosts[rank]
        data: dict[str, str | float | int | bool] = {
            "stat": name,
            "rank": rank,
            "ratio": ratio,
            "windows": windows,
            "host": host,
            "recovered": recovered,
        }
        self.bus.log_event(Event(STRAGGLER_EVENT, stamp, data))
        if self._throttle.ready(("straggler", name, recovered)):
            logger.warning(
                "merge_stats_across_ranks: rank %d (%s) %s: its %r mean is %.2f times the other "
                "ranks' median (%d merged windows%s)",
                rank,
                host,
                "has recovered" if recovered else "is a straggler",
                name,
                ratio,
                windows,
                "" if recovered else f" in a row over {self.stragglers[name]}",
            )

    @staticmethod
    def _data(record: _Record, bucket: _Bucket) -> dict[str, AggregateValue]:
        name, aggs = record[0], record[1]
        count = bucket.count
        values = (
            bucket.value,
            bucket.total / count,
            count,
            bucket.total,
            bucket.high,
            bucket.low,
            *_stat.distribution(bucket.moments, bucket.histogram),
        )
        data: dict[str, AggregateValue] = {}
        for agg in aggs:
            data[f"{name}.{_AGG_NAMES[agg]}"] = values[agg - 1]
        data[f"{name}.ranks"] = len(bucket.parts)
        return data

    # -- ending --

    def close(self, timeout: float | None = None) -> bool:
        """Close this bus's open Stat windows, send them (dst: merge every rank's last ones),
        and stop. Idempotent and thread-safe; a later Stat window is logged locally as usual.

        Args:
            timeout: seconds to wait; None waits the merge's ``timeout``.

        Returns:
            Whether the exchange finished in time (on dst: the goodbye of every rank it heard
            from arrived, lost ones included, through their host's leader in the two-level
            shape; see ``unfinished_ranks``).
        """
        limit = check_timeout("timeout", timeout)
        if limit is None:
            limit = self.timeout
        with self._close_lock:
            if not self._closed:
                self._closed = True
                # A leader gives its host's ranks half the time, to send on what they sent.
                share = 1.0 if self.rank == self.dst else 0.5
                self._close_deadline = time.monotonic() + limit * share
                for stat in self.bus._stats():
                    stat._close()  # into the tap: this rank's last windows
                self._closing.set()
                self._wake.set()
                atexit.unregister(self._close_at_exit)
        finished = self._done.wait(limit)
        return finished and (not self._merges or self._everyone_done())

    def _close_at_exit(self) -> None:
        if not self.close():
            logger.warning(
                "merge_stats_across_ranks: rank %d did not finish within timeout=%s s at exit",
                self.rank,
                self.timeout,
            )

    def __enter__(self) -> RankMerge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "active"
        return (
            f"<RankMerge rank {self.rank}/{self.world_size} to dst {self.dst} ({state}): "
            f"sent={self.sent} relayed={self.relayed} merged={self.merged} "
            f"received={self.received} "
            f"missing={self.missing} lost={sorted(self._lost)} local={self.local} late={self.late} "
            f"unsent={self.unsent} errors={self.errors}>"
        )

    _close_deadline = math.inf


_AGG_NAMES = {agg.value: agg.name.lower() for agg in _stat.Aggregation}
_MEAN = _stat.Aggregation.MEAN.value
# The aggregations whose windows carry a sum (``_window_sum``), so a rank's mean.
_MEAN_SOURCES = frozenset(
    agg.value for agg in _stat.Aggregation if agg.name not in ("VALUE", "COUNT", "MAX", "MIN")
)


def _means(bucket: _Bucket) -> dict[int, float]:
    """Each contributing rank's window mean, but for empty windows and NaN means."""
    means = {}
    for rank, (count, total) in bucket.parts.items():
        if count:
            mean = total / count
            if not math.isnan(mean):
                means[rank] = mean
    return means


def _median_without(ordered: list[float], place: int) -> float:
    """The median of ``ordered`` (sorted) without its item at ``place``; NaN if none is left."""
    n = len(ordered) - 1
    if n < 1:
        return math.nan
    half = n // 2

    def at(i: int) -> float:
        return ordered[i + (i >= place)]

    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2


def _spread(name: str, means: dict[int, float]) -> dict[str, float | int]:
    """The spread keys of a merged window: the ranks' means' min, median, max, slowest."""
    if not means:
        return {}
    ordered = sorted(means.values())
    return {
        f"{name}.rank_min": ordered[0],
        f"{name}.rank_p50": statistics.median(ordered),
        f"{name}.rank_max": ordered[-1],
        # The highest mean; on a tie, the lower rank.
        f"{name}.slowest_rank": min(means, key=lambda rank: (-means[rank], rank)),
    }


def _quantile_error(scale: int) -> float:
    """The bound on a percentile's relative error at ``scale`` (see ``Histogram.quantile``)."""
    r = math.pow(2.0, math.ldexp(1.0, -scale))
    return (r - 1) / (r + 1)


def _stamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def merge_stats_across_ranks(
    *,
    bus: EventBus | None = None,
    dst: int = 0,
    timeout: float = 30.0,
    keep_local: bool = False,
    spread: bool = True,
    stragglers: Mapping[str, float] | None = None,
    straggler_windows: int = 3,
    two_level: bool | None = None,
) -> RankMerge:
    """Merge the Stat windows of every ``torch.distributed`` rank into one stream on ``dst``.

    Call it on every rank, after ``torch.distributed.init_process_group`` (any backend): it
    makes a gloo group of its own (a collective: it waits up to ``timeout`` for every rank to
    call it), moves the bus's Stat windows to wall-clock
    multiples of their size, and from then on each closed window goes to ``dst`` on a thread
    of the merge, never the caller's. ``dst`` logs one ``"torch.monitor.Stat"`` event per
    (Stat name, window) with the usual keys (``"loss.mean"``) plus ``"<name>.ranks"``, the
    number of ranks that contributed. COUNT and SUM add up, MAX and MIN are the max of maxes
    and min of mins (NaN if any rank's is), MEAN is SUM / COUNT, VALUE is the one of the rank whose window closed
    last (on a tie, the higher rank). The event's timestamp is when that window closed.
    Stats merge by name, aggregations and window size (Stats of one name with other
    aggregations make events of their own).
    Plain events are not merged.

    With ``spread`` (the default), the merged window of a Stat with MEAN also holds
    ``"<name>.rank_min"``, ``"<name>.rank_p50"`` and ``"<name>.rank_max"`` over the window
    means of the ranks that contributed, and ``"<name>.slowest_rank"`` (an int: the rank of the
    highest mean; on a tie, the lower rank); ``RankMerge.hosts`` names each rank's host.

    ``stragglers`` maps Stat names to a factor: ``dst`` names a rank whose window mean of that
    Stat exceeds the median of the other ranks' means by the factor for ``straggler_windows`` merged
    windows in a row, once, by a ``STRAGGLER_EVENT`` (``"monitor_bus.straggler"``: ``stat``,
    ``rank``, ``ratio``, ``windows``, ``host``, ``recovered``) and a rate-limited warning, and
    once more (``recovered`` True) when it falls back under the factor. A Stat without MEAN
    or SUM gives a rank's mean from its Histogram or moments (a percentile, HISTOGRAM or
    STDDEV); one with none of them is warned about on ``dst``.

    With ``two_level`` (by default, once a host other than ``dst``'s runs two or more ranks),
    the lowest rank of each host (a torchrun node: ``GROUP_RANK``, so two nodes on one machine
    are two hosts) merges its host's windows and sends ``dst`` one record per window, holding
    each rank's count and sum, so everything above, the spread and stragglers included, comes
    out as in the flat shape (every rank to ``dst``), but ``dst`` receives from hosts, not
    ranks. The ranks of ``dst``'s own host send to it directly.

    The other ranks do not log their Stat windows (``keep_local=True`` logs them too). A rank
    that dies or hangs costs only what it had not sent: ``dst`` waits ``timeout`` past a
    window's end at most, merges the window among the ranks that reported it and logs a
    warning naming the others. If ``dst`` is gone, each rank logs its own windows with
    ``"<name>.rank"`` (its rank) added, and counts them in ``local``; one stopped or starved
    (taking no message for ``timeout``) is warned about and waited for, each rank holding its
    windows until it runs again or the rank's ``close()`` gives it up. A rank named lost
    may only be starved of CPU: when it speaks again it rejoins, and ``dst``'s ``close()``
    waits (within its timeout) for every rank it has heard from; windows that come after
    theirs was merged are logged on their own, marked ``"<name>.late": True``, and counted in
    ``late``. A window too large for a frame is sent with its Histogram coarsened (warned);
    one that cannot fit even so is logged by its rank and counted in ``unsent``.

    Args:
        bus: the bus whose Stats are merged; the default bus if omitted.
        dst: the rank that logs the merged windows.
        timeout: seconds any wait of the exchange may take: how long past a window's
            end dst waits for a rank, how long a rank may stay silent before dst stops
            waiting for it (or a send untaken before it is warned about), and
            ``close()``'s default.
        keep_local: also log each rank's own windows on its bus, as without the merge.
        spread: add the spread across ranks to each merged window of a Stat with MEAN.
        stragglers: Stat name -> factor (a number above 1) for naming straggling ranks.
        straggler_windows: how many merged windows in a row make a straggler (at least 1).
        two_level: True: each host's leader merges its host first; False: every rank sends
            to ``dst`` (flat); None: two-level once a host other than ``dst``'s has two or
            more ranks.

    Returns:
        The running merge: ``close()`` it (or use it as a context manager) before the
        process group is destroyed; it is closed at interpreter exit otherwise.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``dst`` is not a rank of the job, ``timeout`` is not positive, a factor of
            ``stragglers`` is not above 1 or ``straggler_windows`` is below 1.
        RuntimeError: ``torch.distributed`` is not initialized, or the bus is merged already.
        ImportError: torch is not installed.

    Examples:
        >>> from monitor_bus.integrations.torch import merge_stats_across_ranks
        >>> with merge_stats_across_ranks(timeout=10.0):  # doctest: +SKIP
        ...     train()
    """
    from .._bus import EventBus

    if bus is None:
        from .._default import get_default_bus

        bus = get_default_bus()
    elif not isinstance(bus, EventBus):
        raise wrong_type("bus", "a monitor_bus.EventBus or None", bus)
    check_int("dst", dst, 0)
    seconds = check_timeout("timeout", timeout, allow_none=False)
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout}")
    if not isinstance(keep_local, bool):
        raise wrong_type("keep_local", "a bool", keep_local)
    if not isinstance(spread, bool):
        raise wrong_type("spread", "a bool", spread)
    factors = _check_stragglers(stragglers)
    check_int("straggler_windows", straggler_windows, 1)
    if two_level is not None and not isinstance(two_level, bool):
        raise wrong_type("two_level", "a bool or None", two_level)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "merge_stats_across_ranks needs torch.distributed.init_process_group() first"
        )
    if dst >= dist.get_world_size():
        raise ValueError(
            f"dst must be a rank below the world size {dist.get_world_size()}, got {dst}"
        )
    if bus._window_tap is not None:
        raise RuntimeError(f"bus {bus._name!r} is merged across ranks already")
    # The group's timeout bounds its making (a rank that never calls this); dst's receives
    # pass a timeout of their own.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    # A host is a torchrun node: its host name and node rank (GROUP_RANK).
    nodes: list[Any] = [None] * dist.get_world_size()
    node = (socket.gethostname(), os.environ.get("GROUP_RANK", ""))
    dist.all_gather_object(nodes, node, group=group)
    hosts = [name for name, _ in nodes]
    merge = RankMerge(
        bus,
        dist,
        group,
        dst,
        seconds,
        keep_local,
        spread=spread,
        stragglers=factors,
        straggler_windows=straggler_windows,
        hosts=hosts,
        upstream=_routes([tuple(n) for n in nodes], dst, two_level),
    )
    merge._start()
    return merge


def _routes(
    nodes: list[tuple[str, str]], dst: int, two_level: bool | None
) -> dict[int, int] | None:
    """Where each rank sends its windows in the two-level shape: to its host's leader (the
    lowest rank of its node; on ``dst``'s node, ``dst``), the leaders to ``dst``; None for
    the flat shape (``two_level`` False, or None and no host but ``dst``'s runs two ranks).

    Args:
        nodes: each rank's node, by rank.
        dst: the rank that logs the merged windows.
        two_level: as ``merge_stats_across_ranks`` takes it.

    Returns:
        rank -> the rank it sends to (``dst`` -> itself), or None.
    """
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    if two_level is None:  # a leader only saves dst messages on a host of two or more
        two_level = any(len(members) > 1 for members in ranks.values() if dst not in members)
    if not two_level:
        return None
    routes = {}
    for members in ranks.values():
        leader = dst if dst in members else members[0]
        for rank in members:
            routes[rank] = dst if rank == leader else leader
    return routes


def _check_stragglers(stragglers: object) -> dict[str, float]:
    """``stragglers`` checked: a mapping of Stat names to factors above 1."""
    if stragglers is None:
        return {}
    if not isinstance(stragglers, Mapping):
        raise wrong_type("stragglers", "a mapping of Stat names to factors, or None", stragglers)
    factors = {}
    for name, factor in stragglers.items():
        if not isinstance(name, str):
            raise TypeError(f"stragglers keys must be Stat names (str), not {type_name(name)}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"stragglers[{name!r}] must be a number, not {type_name(factor)}")
        if not (factor > 1 and math.isfinite(factor)):
            raise ValueError(f"stragglers[{name!r}] must be a finite factor above 1, got {factor}")
        factors[name] = float(factor)
    return factors
