"""StepAnatomy's picture of a run for ``monitor-bus summary`` and ``plot``: where each rank's
step goes (its stages' time outside the wait, the wait, the rest) and the time the job lost
waiting for its slowest rank, per rank and stage, folded from ``dst``'s ``ANATOMY_EVENT``.

Guarantees: the events are folded one at a time and none is kept, so memory grows with the
families, ranks and stages, not with the file. A window weighs its ``steps``: a rank's
breakdown is its means over the run's steps, and the time lost in a window is its
``lost_s`` times its ``steps``. A value that is not a number is left out and counted
(``_StatSkips``, by key).

Below ``_cli_summary`` and ``_cli_plot``, which import it; it imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ._cli_read import _StatSkips
from ._event import Event
from .ranks import ANATOMY_EVENT

#: The parts of a rank's step after its stages, as the breakdown names them.
WAIT = "wait"
OTHER = "other"


def _number(data: Mapping[str, object], key: str, skips: _StatSkips) -> float | None:
    """``data[key]`` as a finite float, or None (a value that is not one counted in ``skips``)."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        skips.not_numbers[key] += 1
        return None
    try:
        number = float(value)
    except OverflowError:
        skips.too_large[key] += 1
        return None
    return number if math.isfinite(number) else None


class Family:
    """One StepAnatomy family (a ``prefix``) of a run, folded."""

    __slots__ = ("hosts", "lost", "ranks", "stages", "step_s", "steps", "windows")

    def __init__(self) -> None:
        #: Windows folded.
        self.windows = 0
        #: Steps summed over the windows (a window's ``steps``).
        self.steps = 0.0
        #: The job's step time over the run: each window's merged mean step times its steps.
        self.step_s = 0.0
        #: The stages, in the order met.
        self.stages: list[str] = []
        #: rank -> part (``time_s``, ``wait_s``, a stage) -> its means times steps, summed.
        self.ranks: dict[int, dict[str, float]] = {}
        #: rank -> its host, as the events named it.
        self.hosts: dict[int, str] = {}
        #: (rank the job waited for, stage) -> [seconds lost, windows].
        self.lost: dict[tuple[int, str], list[float]] = {}

    def add(self, data: Mapping[str, object], skips: _StatSkips) -> None:
        """Fold one ``ANATOMY_EVENT``'s data."""
        steps = _number(data, "steps", skips)
        if steps is None or steps <= 0:
            return  # no step to weigh: nothing to add
        self.windows += 1
        self.steps += steps
        step = _number(data, "step_s", skips)
        if step is not None:
            self.step_s += step * steps
        lost, rank = _number(data, "lost_s", skips), data.get("lost_to_rank")
        if lost is not None and isinstance(rank, int) and not isinstance(rank, bool):
            stage = data.get("stage")
            entry = self.lost.setdefault(
                (rank, stage if isinstance(stage, str) else ""), [0.0, 0.0]
            )
            entry[0] += lost * steps
            entry[1] += 1
            host = data.get("host")
            if isinstance(host, str):
                self.hosts[rank] = host
        for key in data:
            head, _, part = key.partition(".")
            if not (head.startswith("rank") and head[4:].isdigit() and part):
                continue
            value = _number(data, key, skips)
            if value is None:
                continue
            if part.endswith(".busy_s"):
                part = part.removesuffix(".busy_s")
                if part not in self.stages:
                    self.stages.append(part)
            parts = self.ranks.setdefault(int(head[4:]), {})
            parts[part] = parts.get(part, 0.0) + value * steps

    def breakdown(self) -> dict[int, dict[str, float]]:
        """rank -> seconds per step of each stage (outside the wait), ``WAIT`` and ``OTHER``
        (the rest of its step: outside the stages and the wait), and ``"step"``, the step."""
        out = {}
        for rank in sorted(self.ranks):
            sums = self.ranks[rank]
            parts = {stage: sums.get(stage, 0.0) / self.steps for stage in self.stages}
            parts[WAIT] = sums.get("wait_s", 0.0) / self.steps
            step = sums.get("time_s", 0.0) / self.steps
            parts[OTHER] = max(0.0, step - sum(parts.values()))
            parts["step"] = step
            out[rank] = parts
        return out


class Anatomy:
    """The StepAnatomy families of a run, by prefix, folded from its ``ANATOMY_EVENT``."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def add(self, event: Event, skips: _StatSkips) -> bool:
        """Fold ``event`` if it is an ``ANATOMY_EVENT``; whether it was one."""
        if event.name != ANATOMY_EVENT:
            return False
        prefix = event.data.get("prefix")
        if isinstance(prefix, str):
            family = self.families.get(prefix)
            if family is None:
                family = self.families[prefix] = Family()
            family.add(event.data, skips)
        return True
