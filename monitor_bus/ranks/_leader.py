"""A host leader's role in the two-level shape: it merges its host's windows and sends dst
one host record per window, with its word on its host's ranks.

Guarantees
----------
- Two levels: a host's lowest rank, the
  leader, takes its host's windows as ``dst`` takes a rank's (the rules below hold there,
  ``dst``'s own host sending to ``dst``), merges each window once due, at most half the
  timeout past its end, and sends ``dst`` one host record for it: the merge, plus each rank's
  count and sum, the rank whose VALUE it kept and the ranks it was merged without. A leader
  says goodbye once its host's ranks did (or half its close timeout passed), naming those
  done; ``dst`` waits for the others. A dead leader is a dead
  ``dst`` to its host's ranks (they log their windows, counted in ``local``) and, to ``dst``, a
  silent rank whose whole host is lost; what it held unsent is lost with it, and the windows
  merged without its host count in ``missing``. A stopped leader is waited for by its
  host's ranks (below) and is, to ``dst``, a lost rank with its host until it speaks again.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from ._bucket import _Bucket
from ._frame import _Record
from ._receiving import Receiving, _Due
from ._sending import Sending


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


class Leader(Receiving, Sending):
    """A host leader: it receives and merges as dst does, and sends on as a rank does."""

    def _send_on(self, due: list[_Due], now: float, *, final: bool) -> None:
        """A host leader: send dst a host record of each window due, how far this host is,
        and its word on its ranks and their progress; with nothing to send, only once the
        mark passed a window end (dst may wait for it) or a heartbeat is due."""
        # Every window ending before the mark was sent on: those of the ranks expected, and
        # any once past the leader's patience.
        ahead = max(min(self._mark[r] for r in self._expected()), now - self._patience)
        mark = math.inf if final else ahead
        records = [_host_record(key, bucket, behind) for key, bucket, _, behind in due]
        clock = time.monotonic()
        if records or final or self._crossed(mark) or clock - self._last_sent >= self._heartbeat:
            done = sorted(self._sources - self._unfinished())
            host = json.dumps({"lost": sorted(self._lost), "done": done}, separators=(",", ":"))
            progress = self._progress_out(clock)
            self._send(records, mark, bye=final, host=host, progress=progress)
            self._sent_mark, self._last_sent = mark, clock

    def _crossed(self, mark: float) -> bool:
        """Whether ``mark`` is past the end of a window (of a size this rank saw) that the
        last mark sent was not."""
        last = self._sent_mark
        if not mark > last:
            return False
        return last == -math.inf or any(mark // size > last // size for size in self._sizes)
