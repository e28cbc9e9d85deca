"""``RankMerge``, the running merge a rank holds: its roles put together, its start, its
close and what it reports.

A rank is dst, a host leader or a rank that sends; one class holds every role
(``Dst``, ``Leader``, and through them ``Receiving``, ``Sending`` and ``MergeState``), and
the rank's place in the routes picks which thread runs.

Guarantees
----------
- Windows line up: the bus's windows are moved to wall-clock multiples of their size
  (``bus._clock_offset``); a rank whose clock is off by ``d`` puts its samples ``d`` late.
- Exit: ``close()`` closes the bus's open windows, sends them, and (on ``dst``) waits for
  every rank's last message, all within its timeout; it runs at interpreter exit (``atexit``,
  before the buses close) for a merge left open.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

from .. import _stat
from .._check import check_timeout
from ._dst import Dst
from ._leader import Leader

logger = logging.getLogger("monitor_bus")


class RankMerge(Dst, Leader):
    """A running merge of Stat windows across ranks; see ``merge_stats_across_ranks``.

    The counters are plain ints, read from any thread. ``close()`` and the context manager
    end the merge; ``close()`` is idempotent and thread-safe.
    """

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
        self._thread = threading.Thread(
            target=self._run_merger if self._merges else self._run_sender,
            name=f"monitor_bus-merge-{self.rank}",
            daemon=True,
        )
        self._thread.start()
        atexit.register(self._close_at_exit)

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
