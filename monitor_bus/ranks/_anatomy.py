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
  ``exposed_s`` and ``cause`` are over the windows of the episode so far. The stage is the one
  whose time outside the wait is most over the others' median, if that explains at least
  half the exposed time, as GC must to be the cause; a step without stages, or a stage a
  few stray samples put ahead, names none.
- What it cost (with ``spread``, whether the rule is on or off): the merged window of a
  family's ``<prefix>.wait_s`` holds ``.lost_s``, the exposed time per step of its rank that
  waits least (the rule's candidate, over the rule or not), and ``.lost_to_rank``, that rank
  (``lost_keys``; two ranks or more). After the family's windows, one ``ANATOMY_EVENT`` per
  family and window carries each rank's means (``rank<r>.time_s``, ``.wait_s``, ``.gc_s``,
  ``.<stage>.busy_s``), what the others lost and to whom, the stage it was lost in and the
  steps it was lost over: the one place each rank's breakdown travels, R x (S + 3) numbers
  a window for R ranks and S stages, on an event no Stat exporter writes.
"""

from __future__ import annotations

import statistics
from datetime import datetime

from .._event import Event
from ._state import Exposure
from ._stragglers import Stragglers

WAIT = ".wait_s"
TIME = ".time_s"
BUSY = ".busy_s"
GC = ".gc_s"
#: The endings of the Stat names the rule reads (dst keeps the merged means of these only).
SUFFIXES = (WAIT, TIME, BUSY, GC)

#: The name of the event ``dst`` logs after each merged window of a ``StepAnatomy`` family
#: (with ``spread``): data ``prefix``, ``window_s``, ``ranks``, ``step_s`` (the merged mean
#: step), ``lost_s``, ``lost_to_rank`` and ``host`` (as the wait's ``.lost_s`` and
#: ``.lost_to_rank``, and that rank's host; two ranks or more), ``stage`` (where that rank's
#: time outside the wait is most over the others' median, where that explains half the lost
#: time; ``""`` if nowhere), ``steps`` (that rank's steps in the window; with one rank, its
#: steps), and each rank's window means ``rank<r>.time_s``, ``rank<r>.wait_s``,
#: ``rank<r>.gc_s`` and ``rank<r>.<stage>.busy_s``.
ANATOMY_EVENT = "monitor_bus.anatomy"

# A merged window of one Stat: each rank's window mean, the merged mean, its stamp, each
# rank's count.
Merged = tuple[dict[int, float], float, datetime, dict[int, int]]


def lost_keys(name: str, means: dict[int, float]) -> dict[str, float | int]:
    """The cost keys of the merged window of a family's wait ``name``: ``.lost_s``, the median
    of the other ranks' means minus the lowest (the rank the others waited for), and
    ``.lost_to_rank``, that rank (on a tie, the lower one); none with fewer than two ranks."""
    if len(means) < 2:
        return {}
    least = min(means, key=lambda rank: (means[rank], rank))
    others = statistics.median(m for r, m in means.items() if r != least)
    return {f"{name}.lost_s": others - means[least], f"{name}.lost_to_rank": least}


def families(names: list[tuple[str, float, int]]) -> set[tuple[str, float, int]]:
    """The ``(<prefix>.wait_s, size, index)`` of each family among merged windows ``names``
    (Stat name, window size, index; each with MEAN): a wait with its step in the window."""
    present = set(names)
    return {
        (name, size, index)
        for name, size, index in present
        if name.endswith(WAIT) and (name[: -len(WAIT)] + TIME, size, index) in present
    }


def _over_others(means: dict[int, float] | None, rank: int, others: list[int]) -> float:
    """``rank``'s mean over the median of ``others``' (a rank without one spent nothing)."""
    if means is None:
        return 0.0
    return means.get(rank, 0.0) - statistics.median(means.get(r, 0.0) for r in others)


def _stages(prefix: str, merged: dict[str, Merged]) -> dict[str, dict[int, float]]:
    """Each stage of the family ``prefix`` in ``merged``, in the order met: its busy_s means."""
    stages = {}
    for name, (means, _, _, _) in merged.items():
        stage = name[len(prefix) + 1 : -len(BUSY)]
        if name.startswith(prefix + ".") and name.endswith(BUSY) and stage and "." not in stage:
            stages[stage] = means
    return stages


def _stage_of(extra: dict[str, float], exposed: float) -> str:
    """The stage a rank spent most over the others in (``extra``: stage -> that time), when
    that is at least half the ``exposed`` time (it explains the wait); else none, ``""``."""
    stage = max(extra, key=extra.__getitem__, default="")
    return stage if stage and extra[stage] > 0 and extra[stage] >= exposed / 2 else ""


class AnatomyStragglers(Stragglers):
    """dst's straggler watch on ``StepAnatomy``'s Stats, with no ``stragglers=`` argument."""

    def _watch_anatomy(self, windows: dict[tuple[float, int], dict[str, Merged]]) -> None:
        """dst: for each family of ``windows`` ((size, index) -> the merged windows of the
        Stats named with ``SUFFIXES``, by name), oldest window first, log its
        ``ANATOMY_EVENT`` (with ``spread``) and apply the rule. A family whose wait the user
        watches (``stragglers``) is left to that rule."""
        for size, index in sorted(windows, key=lambda k: (k[0] * k[1], k[0])):
            merged = windows[size, index]
            for name in sorted(merged):
                prefix = name[: -len(WAIT)]
                if not (name.endswith(WAIT) and prefix + TIME in merged):
                    continue
                stages = _stages(prefix, merged)
                if self.spread:
                    self._log_anatomy(prefix, size, merged, stages)
                if name not in self.stragglers:
                    self._watch_family(prefix, merged, stages)

    def _log_anatomy(
        self,
        prefix: str,
        size: float,
        merged: dict[str, Merged],
        stages: dict[str, dict[int, float]],
    ) -> None:
        """dst: the ``ANATOMY_EVENT`` of one merged window of the family ``prefix``."""
        waits, _, stamp, _ = merged[prefix + WAIT]
        times, step, _, steps = merged[prefix + TIME]
        data: dict[str, str | float | int | bool] = {
            "prefix": prefix,
            "window_s": size,
            "ranks": len(waits),
            "step_s": step,
            "steps": max(steps.values(), default=0),
        }
        lost = lost_keys(prefix + WAIT, waits)
        if lost:
            rank = int(lost[prefix + WAIT + ".lost_to_rank"])
            others = sorted(set(waits) - {rank})
            extra = {stage: _over_others(means, rank, others) for stage, means in stages.items()}
            stage = _stage_of(extra, float(lost[prefix + WAIT + ".lost_s"]))
            data.update(
                lost_s=lost[prefix + WAIT + ".lost_s"],
                lost_to_rank=rank,
                host=self.hosts[rank],
                stage=stage,
                steps=steps.get(rank, 0),
            )
        gc = merged.get(prefix + GC)
        for rank in sorted(set(waits) | set(times)):
            data[f"rank{rank}.time_s"] = times.get(rank, 0.0)
            data[f"rank{rank}.wait_s"] = waits.get(rank, 0.0)
            data[f"rank{rank}.gc_s"] = gc[0].get(rank, 0.0) if gc else 0.0
            for stage, means in stages.items():
                data[f"rank{rank}.{stage}.busy_s"] = means.get(rank, 0.0)
        self.bus.log_event(Event(ANATOMY_EVENT, stamp, data))

    def _watch_family(
        self, prefix: str, merged: dict[str, Merged], stages: dict[str, dict[int, float]]
    ) -> None:
        """dst: one merged window of the family ``prefix``: count each rank's episode."""
        waits, _, stamp, _ = merged[prefix + WAIT]
        step = merged[prefix + TIME][1]
        fraction = self.exposed_fraction
        if len(waits) < 2 or not step > 0 or fraction is None:  # no one to wait for: counts stay
            return
        candidate = min(waits, key=lambda rank: (waits[rank], rank))
        others = sorted(set(waits) - {candidate})
        exposed = statistics.median(waits[r] for r in others) - waits[candidate]
        over = exposed / step >= fraction
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
        stage = _stage_of(episode.extra_stage, episode.exposed)
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
