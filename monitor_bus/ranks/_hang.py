"""The hang rule: while the job hangs, dst names the rank that holds it up, from the progress
each rank's ``StepAnatomy`` reports (``_step_anatomy.progress()``).

A hung data-parallel job stops in a collective: the ranks that reached it wait there (gloo's
default timeout is 30 minutes, NCCL's 10) for the one that did not. Each rank's progress says
whether it waits, so the one that does not is named, with its stage, while the job hangs.

Guarantees
----------
- What travels: every message a rank sends upstream carries its progress, read on the
  merge's thread (never the training thread), and a rank sends at least every heartbeat (a
  second) whatever its training thread does, blocked in the all-reduce or stuck; a host
  leader passes on each of its host's ranks' last progress, its seconds grown by the time the
  leader held it. Bounded: a stage name travels cut to ``_STAGE_CHARS`` characters, and a
  host's progress longer than half a frame is left out of its message (warned, rate-limited;
  its windows and mark travel as ever).
- Clocks: every time is a difference on one process's clock (a rank's seconds since its last
  step, a leader's and dst's time since they heard of a rank): ranks' clocks need not agree.
- The rule (dst's merge thread, each round: at least every heartbeat, the training thread
  blocked or not): the job hangs once every rank reporting progress has had no step end for
  its own ``hang_after``. dst then logs one ``HANG_EVENT`` (and a warning) per rank not waiting
  in a collective, the ranks that hold the others up; when every rank waits (a collective some
  rank never called outside the anatomy's sight, a rank reporting no progress, the network),
  one per rank, each with ``waits`` True, so their stages can be compared, and one warning
  grouping them by stage (one line however many ranks). Once per episode:
  the rule re-arms once a step ends on any rank (its seconds back under its ``hang_after``).
- Who counts: a rank with no ``StepAnatomy`` open reports none and is left out, as is one
  whose merge said goodbye. A rank gone silent (dead, stopped, starved of CPU) keeps its last
  progress, its seconds growing on dst's clock: it is named in the stage it was last heard in,
  ``silent_s`` (how long dst has not heard of it) telling it from one alive and stuck.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from .. import _step_anatomy
from .._event import Event
from ._frame import _ROOM
from ._state import MergeState

logger = logging.getLogger("monitor_bus")

#: The name of the event ``dst`` logs when no step has ended on any rank for ``hang_after``
#: (``StepAnatomy``'s), once per hung rank: data ``rank``, ``host``, ``stage`` (where it is;
#: ``""`` outside every stage), ``in_step`` (False: between steps), ``waits`` (whether it waits
#: in a collective itself: only when every rank does), ``waiting`` (how many ranks wait in a
#: collective), ``seconds`` (since a step last ended on it) and ``silent_s`` (since dst last
#: heard of it).
HANG_EVENT = "monitor_bus.hang"

# A stage name travels cut to this many characters, so that a host's progress fits a frame.
_STAGE_CHARS = 64
# A rank not heard of for this long (five heartbeats) is said silent in the warning.
_SILENT = 5.0

# One rank's progress as it travels: [seconds since its last step ended, seconds since it was
# heard of (at the hop that sent it), stage, in_step, waits, hang_after].
_Entry = list[Any]


def _grown(entry: _Entry, heard: float, now: float) -> _Entry:
    """``entry``, heard of at ``heard``, as of ``now``: its seconds and silence grown."""
    held = max(now - heard, 0.0)
    return [entry[0] + held, entry[1] + held, *entry[2:]]


class Hang(MergeState):
    """Every rank's progress: sent upstream, passed on by a leader, and dst's rule on it."""

    def _own_progress(self) -> _Entry | None:
        """This rank's progress, from its open anatomies; None if it has none open."""
        own = _step_anatomy.progress()
        if own is None:
            return None
        stage = own.stage[:_STAGE_CHARS]
        return [own.seconds, 0.0, stage, own.in_step, own.waits, own.hang_after]

    def _progress_out(self, now: float) -> str:
        """The progress a message upstream carries, as JSON: this rank's and (a leader) its
        host's ranks', each as of ``now``, null for a rank with none; "" if too long."""
        ranks = {
            rank: None if held is None else _grown(*held, now)
            for rank, held in self._progress.items()
        }
        ranks[self.rank] = self._own_progress()
        entries = {
            str(rank): None if entry is None else [round(entry[0], 3), *entry[1:]]
            for rank, entry in sorted(ranks.items())
        }
        text = json.dumps(entries, separators=(",", ":"))
        if len(text) <= _ROOM // 2:
            return text
        if self._throttle.ready("progress"):
            logger.warning(
                "merge_stats_across_ranks: rank %d: the progress of %d ranks takes %d bytes, "
                "over half a frame: it is left out of the messages upstream, and the hang "
                "rule goes without it",
                self.rank,
                len(entries),
                len(text),
            )
        return ""

    def _note_progress(self, source: int, message: dict[str, Any], now: float) -> None:
        """dst's and a leader's: what a message from ``source``, read at ``now``, says of its
        ranks' progress; a goodbye ends its ranks' (they are done, not hung)."""
        entries: dict[str, _Entry | None] = message.get("progress") or {}
        for key, entry in entries.items():
            self._progress[int(key)] = None if entry is None else (entry, now)
        if message["bye"]:
            for rank in {source, *map(int, entries)}:
                self._progress[rank] = None

    def _watch_hang(self, now: float) -> None:
        """dst: the hang rule on every rank's last progress, as of ``now`` (dst's clock)."""
        own = self._own_progress()
        self._progress[self.rank] = None if own is None else (own, now)
        ranks = {
            rank: _grown(*held, now) for rank, held in self._progress.items() if held is not None
        }
        if not ranks or any(entry[0] < entry[5] for entry in ranks.values()):
            self._hanging = False  # a step ended on some rank: the next hang is named again
            return
        if self._hanging:
            return
        self._hanging = True
        waiting = sum(bool(entry[4]) for entry in ranks.values())
        holding = [rank for rank, entry in sorted(ranks.items()) if not entry[4]]
        stamp = datetime.now()
        for rank in holding or sorted(ranks):
            seconds, silent, stage, in_step, waits, _ = ranks[rank]
            data: dict[str, str | float | int | bool] = {
                "rank": rank,
                "host": self.hosts[rank],
                "stage": stage,
                "in_step": bool(in_step),
                "waits": bool(waits),
                "waiting": waiting,
                "seconds": seconds,
                "silent_s": silent,
            }
            self.bus.log_event(Event(HANG_EVENT, stamp, data))
            if holding:
                self._warn_holding(data)
        if not holding:
            self._warn_all_waiting(ranks)

    def _warn_holding(self, data: dict[str, Any]) -> None:
        """dst: say a ``HANG_EVENT``'s ``data``, of a rank not waiting, in a warning."""
        silent = (
            f"; not heard of for {data['silent_s']:.1f} s (dead or stopped?)"
            if data["silent_s"] >= _SILENT
            else ""
        )
        logger.warning(
            "merge_stats_across_ranks: rank %d (%s) holds the job up %s; %d rank(s) wait in a "
            "collective: no step has ended on it for %.1f s, nor on any rank for its "
            "hang_after%s",
            data["rank"],
            data["host"],
            where(data["stage"], data["in_step"]),
            data["waiting"],
            data["seconds"],
            silent,
        )

    def _warn_all_waiting(self, ranks: dict[int, _Entry]) -> None:
        """dst: say in one warning (however many ranks) that every rank waits, and where."""
        places: dict[str, list[int]] = {}
        for rank, entry in sorted(ranks.items()):
            places.setdefault(where(entry[2], entry[3]), []).append(rank)
        silent = [rank for rank, entry in sorted(ranks.items()) if entry[1] >= _SILENT]
        logger.warning(
            "merge_stats_across_ranks: every rank (%d) waits in a collective, and no step has "
            "ended on any for its hang_after (a collective not every rank called, or the "
            "network?): %s%s",
            len(ranks),
            "; ".join(f"{where}: {_ranks(members)}" for where, members in places.items()),
            f"; not heard of for {_SILENT:g} s or more: {_ranks(silent)}" if silent else "",
        )


def where(stage: str, in_step: bool) -> str:
    """Where a rank is, in words."""
    if stage:
        return f"in stage {stage!r}"
    return "in a step, outside every stage" if in_step else "between steps"


def _ranks(ranks: list[int], most: int = 8) -> str:
    """``ranks`` in words, the first ``most`` of them named."""
    named = ", ".join(map(str, ranks[:most]))
    more = f" and {len(ranks) - most} more" if len(ranks) > most else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {named}{more}"
