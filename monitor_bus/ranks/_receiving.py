"""The receiving and merging of dst and of a host leader: its receiving thread, its inbox,
the buckets it merges windows in, and when a window is due.

What a window due becomes is the role's: dst logs it (``_dst``), a leader sends it on as one
host record (``_leader``).

Guarantees
----------
- Own group: each rank sends to ``dst`` point to point; ``dst``
  takes whatever any rank sends with one receive from any source, so a dead or hung rank
  holds up no other rank's messages; a receive that fails (matched to a rank that died
  mid-send) is warned about and the next one made (three failing in a row end it, logged).
- Bounded: ``dst`` merges a window once every rank
  it still expects has said it is past the window's end, or ``timeout`` after the end; a rank
  silent for ``timeout`` is lost (warned, rate-limited) and no longer waited for, and every
  window merged before it said it was past the window counts in ``missing``.
- Two levels: a rank lost at its leader is warned about there
  and, once the leader says so, on ``dst`` too (in ``lost_ranks``); windows merged without it
  count in ``dst``'s ``missing``; what it sends after rejoining goes on to ``dst``, merged or
  logged late there.
- Starved is not dead: a lost rank may only be short of CPU. When it speaks again it rejoins
  (warned), its windows merged, or, if their window was merged already, logged on their own
  (marked ``"<name>.late": True``, no spread keys) and counted in ``late``, not ``merged``.
  ``dst``'s ``close()`` waits, within its timeout, for the goodbye of
  every rank it has heard from, lost or not; a rank whose goodbye did not come is named
  (warning, ``unfinished_ranks``) and what it still sends is logged on its own, counted in
  ``late``, for as long as ``dst``'s process lives.
- Exact and once: each
  window of each rank is merged once; one arriving after its window was merged is logged on
  its own, marked ``"<name>.late"``, counted in ``late``.
- Exit: ``dst``'s receiving thread may stay blocked
  on a rank that never said goodbye: it is a daemon and does not hold up exit.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from typing import Any

from ._bucket import _Bucket
from ._frame import _FOREVER, _FRAME, _TAG, _Record, _windows_in
from ._hang import Hang
from ._state import _MIN_TICK

logger = logging.getLogger("monitor_bus")

# A receiving thread ends after this many failed receives in a row (one is a rank that died
# mid-send).
_RECEIVE_TRIES = 3

# A window due on dst or a leader: its key, its bucket, whether late, the ranks it is without.
_Due = tuple[tuple[Any, ...], "_Bucket", bool, set[int]]


class Receiving(Hang):
    """What dst and a host leader share: they take what others send them and merge it."""

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
                    if not closing:
                        self._watch_hang(time.monotonic())
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

    def _log_merged(self, due: list[_Due]) -> None:
        """dst's (``_dst``): log each window due."""
        raise NotImplementedError

    def _send_on(self, due: list[_Due], now: float, *, final: bool) -> None:
        """A host leader's (``_leader``): send each window due on to dst."""
        raise NotImplementedError

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
            self._heard[source] = heard = time.monotonic()
            self._note_progress(source, message, heard)
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
