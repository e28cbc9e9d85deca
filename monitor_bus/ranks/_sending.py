"""A rank's sending: its thread, its windows framed and sent upstream (dst, or its host's
leader), and what it does when upstream is gone or stalls.

Guarantees
----------
- Bounded: a send that fails (gloo reports at once a peer that died) makes its upstream
  (``dst`` or the leader) gone for good: the rank logs its own windows locally, marked
  ``"<name>.rank"`` and counted in ``local``. One not taken for ``timeout`` (upstream stopped
  or starved) is warned about and waited for, the rank's windows held in its queue
  meanwhile (memory grows with the stall): a timed-out gloo wait would close the rank's
  group for good, so the rank rejoins once upstream runs again. Only ``close()`` gives it
  up, at its deadline (half its timeout), cancelling the send, and the rank logs what it
  held locally (counted in ``local``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from datetime import timedelta
from typing import Any

from ._frame import (
    _FOREVER,
    _FRAME,
    _TAG,
    _fit,
    _pack,
    _quantile_error,
    _Record,
    _tensor,
    _windows_in,
)
from ._hang import Hang
from ._state import _MIN_TICK

logger = logging.getLogger("monitor_bus")


class Sending(Hang):
    """A rank's side that sends: a rank other than dst, and a host leader sending on."""

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
                    progress = self._progress_out(time.monotonic())
                    self._send(records, mark, bye=closing, progress=progress)
                    last_sent = self._now()
            except Exception:
                logger.exception("merge_stats_across_ranks: rank %d failed a round", self.rank)
            if closing:
                self._finish()
                return

    def _send(
        self, records: list[_Record], mark: float, *, bye: bool, host: str = "", progress: str = ""
    ) -> None:
        """Send ``records`` upstream (dst, or this host's leader), then how far this rank is,
        ``progress`` (``_hang``'s) and, from a leader, ``host``: what it says of its host's
        ranks."""
        for frame, sent in self._frames(records, mark, bye, host, progress):
            if self._dst_gone:
                self._log_local(sent)
                continue
            try:
                tensor = _tensor(frame)
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
        self, records: list[_Record], mark: float, bye: bool, host: str = "", progress: str = ""
    ) -> list[tuple[bytes, list[_Record]]]:
        """The frames carrying ``records`` (``_pack``'s), each within ``_FRAME`` bytes (but for
        a ``host`` longer than a frame); a record no frame can carry is logged here."""
        fitted = []
        for record in records:
            text = self._fitted(record)
            if text is None:
                self._log_unsent(record)
                continue
            fitted.append((text, record))
        return _pack(fitted, mark, bye, host, progress)

    def _fitted(self, record: _Record) -> str | None:
        """The record's JSON, within a frame (``_fit``: its Histogram coarsened until it
        fits, warned per Stat); None if even that does not do."""
        fitted = _fit(record)
        if fitted is None:
            return None
        text, coarsened = fitted
        if coarsened is None:
            return text
        start, scale = coarsened
        name = record[0]
        if self._throttle.ready(("coarsened", name)):
            logger.warning(
                "merge_stats_across_ranks: a window of Stat %r is too large for a %d-byte frame: "
                "rank %d sent its Histogram at scale %d (from %d), its percentiles within "
                "%.2g%% (see docs/multihost.md)",
                name,
                _FRAME,
                self.rank,
                scale,
                start,
                100 * _quantile_error(scale),
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

    def _log_local(self, records: list[_Record]) -> None:
        for record in records:
            self._log_own(record)
            self.local += _windows_in(record)
