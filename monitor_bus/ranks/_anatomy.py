"""The straggler rule on ``StepAnatomy``'s Stats: in a synchronized job, the rank the others
wait for, named with its stage, the time it cost them and whether GC explains it.

In a data-parallel job the all-reduce makes every rank's step as long as the slowest one's,
so no rank's step time stands out; what differs is the wait (``<prefix>.wait_s``): the slow
rank waits least, and the others wait for it.

Guarantees
----------
- Which Stats (dst only, with no ``stragglers=`` argument): a family is the merged windows of
  one window (size and index) named ``<prefix>.wait_s`` and ``<prefix>.time_s``, both with
  MEAN, the names ``StepAnatomy(prefix=...)`` gives. Its stages are the
  ``<prefix>.<stage>.busy_s`` windows (a stage name holds no dot); ``<prefix>.gc_s`` is its
  GC. Names alone tell a family, so a recorded or replayed stream is read the same way, and
  no marker travels.
- The rule, per merged window of a family, over the ranks' window means: the candidate is the
  rank that waits least (on a tie, the lower rank); its exposed time per step is the median of
  the other ranks' waits minus its own; it is over the rule when that is at least
  ``exposed_fraction`` of the step (the merged mean of ``<prefix>.time_s``). Every other rank
  is under it. A window with fewer than two ranks' waits, or no step time, leaves each
  rank's count as it was, as do late windows.
- Episodes: those of ``Stragglers._count``: named once after ``straggler_windows`` windows in
  a row over, once more recovered, by a ``STRAGGLER_EVENT`` (and a warning) whose ``stage``,
  ``exposed_s`` and ``cause`` are over the windows of the episode so far.
"""

from __future__ import annotations

import statistics
from datetime import datetime

from ._state import Exposure
from ._stragglers import Stragglers

WAIT = ".wait_s"
TIME = ".time_s"
BUSY = ".busy_s"
GC = ".gc_s"
#: The endings of the Stat names the rule reads (dst keeps the merged means of these only).
SUFFIXES = (WAIT, TIME, BUSY, GC)

# A merged window of one Stat: each rank's window mean, the merged mean, its stamp.
Merged = tuple[dict[int, float], float, datetime]


def _over_others(means: dict[int, float] | None, rank: int, others: list[int]) -> float:
    """``rank``'s mean over the median of ``others``' (a rank without one spent nothing)."""
    if means is None:
        return 0.0
    return means.get(rank, 0.0) - statistics.median(means.get(r, 0.0) for r in others)


class AnatomyStragglers(Stragglers):
    """dst's straggler watch on ``StepAnatomy``'s Stats, with no ``stragglers=`` argument."""

    def _watch_anatomy(self, windows: dict[tuple[float, int], dict[str, Merged]]) -> None:
        """dst: apply the rule to each family of ``windows`` ((size, index) -> the merged
        windows of the Stats named with ``SUFFIXES``, by name), oldest window first. A family
        whose wait the user watches (``stragglers``) is left to that rule."""
        for size, index in sorted(windows, key=lambda k: (k[0] * k[1], k[0])):
            merged = windows[size, index]
            for name in sorted(merged):
                prefix = name[: -len(WAIT)]
                if name.endswith(WAIT) and prefix + TIME in merged and name not in self.stragglers:
                    self._watch_family(prefix, merged)

    def _watch_family(self, prefix: str, merged: dict[str, Merged]) -> None:
        """dst: one merged window of the family ``prefix``: count each rank's episode."""
        waits, _, stamp = merged[prefix + WAIT]
        step = merged[prefix + TIME][1]
        fraction = self.exposed_fraction
        if len(waits) < 2 or not step > 0 or fraction is None:  # no one to wait for: counts stay
            return
        candidate = min(waits, key=lambda rank: (waits[rank], rank))
        others = sorted(set(waits) - {candidate})
        exposed = statistics.median(waits[r] for r in others) - waits[candidate]
        over = exposed / step >= fraction
        stages = {}  # stage -> its busy_s means
        for name, (means, _, _) in merged.items():
            stage = name[len(prefix) + 1 : -len(BUSY)]
            if name.startswith(prefix + ".") and name.endswith(BUSY) and stage and "." not in stage:
                stages[stage] = means
        gc = merged.get(prefix + GC)
        watch = prefix + WAIT
        for rank in sorted(waits):
            key = (watch, rank)
            if rank == candidate and over:
                episode = self._exposures.setdefault(key, Exposure())
                episode.windows += 1
                episode.exposed += exposed
                episode.extra_gc += _over_others(gc[0] if gc else None, rank, others)
                for stage, means in stages.items():
                    extra = _over_others(means, rank, others)
                    episode.extra_stage[stage] = episode.extra_stage.get(stage, 0.0) + extra
                turn = self._count(key, True)
            else:
                turn = self._count(key, False)
                episode = self._exposures.pop(key, Exposure())
            if turn is not None:
                self._name_exposed(watch, rank, episode, turn, stamp)

    def _name_exposed(
        self, watch: str, rank: int, episode: Exposure, turn: tuple[int, bool], stamp: datetime
    ) -> None:
        """dst: name ``rank`` a straggler of the family ``watch``, or recovered, from its
        episode."""
        windows, recovered = turn
        exposed = episode.exposed / episode.windows
        # The stage the rank spent most over the others in; none if it spent more in none.
        stage = max(episode.extra_stage, key=episode.extra_stage.__getitem__, default="")
        if stage and not episode.extra_stage[stage] > 0:
            stage = ""
        cause = "gc" if episode.extra_gc >= episode.exposed / 2 else ""
        data: dict[str, str | float | int | bool] = {
            "stat": watch,
            "rank": rank,
            "host": self.hosts[rank],
            "stage": stage,
            "exposed_s": exposed,
            "cause": cause,
            "windows": windows,
            "recovered": recovered,
        }
        detail = (
            f"the other ranks waited {exposed * 1e3:.1f} ms per step for it"
            + (f", in stage {stage!r}" if stage else "")
            + (", most of it in GC pauses" if cause else "")
        )
        self._announce(
            watch, data, stamp, detail, f"at {self.exposed_fraction:g} of the step or more"
        )
