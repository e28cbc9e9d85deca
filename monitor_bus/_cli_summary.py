"""``monitor-bus summary``: a run's events per name (and per origin), its runs, the rank
merge's stragglers, hangs and slowdowns, where each rank's step goes and the time lost waiting
for the slowest rank (``_cli_anatomy``), and a table of its Stats and metrics.

Guarantees: the run is folded one event at a time and no event is kept, so memory grows with
the names and keys, not with the file. Per Stat aggregate it prints the windows and the last,
smallest and largest value; per metric, the points, the last step and the last, smallest and
largest value. A Stat's last window cut short by the run's end is left out of "last" (and
said so), told from the latest 33 windows' times, so that too stays bounded. What the read
skipped is reported on stderr before the tables (``_cli_read``).
"""

from __future__ import annotations

import argparse
import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from datetime import datetime

from ._cli_anatomy import OTHER, WAIT, Anatomy, Family
from ._cli_read import (
    _events,
    _float,
    _metric_values,
    _partial_last,
    _Skips,
    _stat_values,
    _StatSkips,
    _step,
)
from ._event import Event, EventOrigin
from ._run import METRICS_EVENT, RUN_END_EVENT, RUN_START_EVENT
from .ranks import HANG_EVENT, SLOWDOWN_EVENT, STRAGGLER_EVENT
from .ranks._hang import where


def _fmt(value: float) -> str:
    return f"{value:.6g}"


# Windows whose times tell a Stat's usual gap, for summary's partial last window.
_RECENT_WINDOWS = 33


class _Column:
    """One Stat key's windows (or one metric's points), folded as they are read."""

    __slots__ = ("before", "high", "last", "last_step", "low", "stamps", "windows")

    def __init__(self) -> None:
        self.windows = 0
        self.last = math.nan
        self.before = math.nan  # the value before the last
        self.last_step = math.nan  # metrics only
        self.low = math.inf  # over the values that are not NaN
        self.high = -math.inf
        # Stats only: the latest windows' times, enough to tell a partial last one (bounded,
        # so memory does not grow with the run).
        self.stamps: deque[float] = deque(maxlen=_RECENT_WINDOWS)

    def add(self, value: float) -> None:
        self.windows += 1
        self.before = self.last
        self.last = value
        if value < self.low:
            self.low = value
        if value > self.high:
            self.high = value


class _Summary:
    """What ``summary`` prints, folded from the events one at a time."""

    def __init__(self) -> None:
        self.events = 0
        self.names: Counter[str] = Counter()
        self.first: datetime | None = None
        self.last: datetime | None = None
        self.stats: dict[str, _Column] = {}
        self.metrics: dict[str, _Column] = {}
        self.metrics_events = 0
        self.skipped = _StatSkips()
        self.origins: Counter[tuple[EventOrigin | None, str]] = Counter()
        # run id -> name, status, duration, exception (start and end events; see Run)
        self.runs: dict[str, list[str]] = {}
        # One line per straggler named or recovered, per hung rank, per slowdown (the rank
        # merge logs few: once each way, once a hang, once a slowdown).
        self.stragglers: list[str] = []
        self.hangs: list[str] = []
        self.slowdowns: list[str] = []
        self.anatomy = Anatomy()


def _summarize(events: Iterable[Event]) -> _Summary:
    """Fold ``events`` into a summary, keeping none of them: memory grows with names and keys."""
    summary = _Summary()
    names = summary.names
    stats = summary.stats
    for event in events:
        summary.events += 1
        names[event.name] += 1
        summary.origins[event.origin, event.name] += 1
        if event.name in (RUN_START_EVENT, RUN_END_EVENT):
            _fold_run(summary.runs, event, summary.skipped)
        elif event.name == STRAGGLER_EVENT:
            summary.stragglers.append(_straggler(event, summary.skipped))
        elif event.name == HANG_EVENT:
            summary.hangs.append(_hang(event, summary.skipped))
        elif event.name == SLOWDOWN_EVENT:
            summary.slowdowns.append(_slowdown(event, summary.skipped))
        else:
            summary.anatomy.add(event, summary.skipped)
        ts = event.timestamp
        if summary.first is None or ts < summary.first:
            summary.first = ts
        if summary.last is None or ts > summary.last:
            summary.last = ts
        for key, value in _stat_values(event, summary.skipped):
            column = stats.get(key)
            if column is None:
                column = stats[key] = _Column()
            column.add(value)
            column.stamps.append(ts.timestamp())
        if event.name == METRICS_EVENT:
            summary.metrics_events += 1
            step = _step(event, summary.metrics_events, summary.skipped)
            if step is None:
                continue
            for key, value in _metric_values(event, summary.skipped):
                column = summary.metrics.get(key)
                if column is None:
                    column = summary.metrics[key] = _Column()
                column.add(value)
                column.last_step = step
    return summary


def _fold_run(runs: dict[str, list[str]], event: Event, skips: _StatSkips) -> None:
    """Record a run's start (its name) or end (status, duration, exception)."""
    data = event.data
    run_id = str(data.get("run_id", ""))
    run = runs.setdefault(run_id, [run_id, "no end (killed?)", "", ""])
    if event.name == RUN_START_EVENT:
        run[0] = str(data.get("run_name", run_id))
        return
    run[1] = str(data.get("status", "?"))
    duration = data.get("duration_s")
    if isinstance(duration, (int, float)) and not isinstance(duration, bool):
        seconds = _float(duration, "duration_s", skips)
        run[2] = "" if seconds is None else f"{seconds:.1f} s"
    run[3] = str(data.get("exception", ""))


def _straggler(event: Event, skips: _StatSkips) -> str:
    """One line of ``summary``'s stragglers: when, which rank, how slow."""
    data = event.data
    what = "recovered" if data.get("recovered") else "straggler"
    if "exposed_s" in data:  # StepAnatomy's rule: the time the others waited, where, why
        exposed = data["exposed_s"]
        seconds = _float(exposed, "exposed_s", skips) if isinstance(exposed, (int, float)) else None
        how = f"others waited {seconds * 1e3:.1f} ms/step" if seconds is not None else "?"
        if data.get("stage"):
            how += f" in {data['stage']}"
        if data.get("cause"):
            how += f" ({data['cause']})"
    else:
        ratio = data.get("ratio")
        if isinstance(ratio, (int, float)):
            ratio = _float(ratio, "ratio", skips)
        how = f"{ratio:.2f}x" if isinstance(ratio, float) else "?"
        how += " the median"
    stat = str(data.get("stat"))
    if "exposed_s" in data and stat.endswith(".wait_s"):  # the anatomy's family, by its prefix
        which = stat[: -len(".wait_s")]
    else:
        which = f"stat {stat}"
    return (
        f"{event.timestamp.isoformat(timespec='seconds')}  {what}  {which}  "
        f"rank {data.get('rank')} ({data.get('host')})  {how}  "
        f"{data.get('windows')} windows"
    )


def _hang(event: Event, skips: _StatSkips) -> str:
    """One line of ``summary``'s hangs: when, which rank, where, for how long."""
    data = event.data
    seconds = data.get("seconds")
    if isinstance(seconds, (int, float)):
        seconds = _float(seconds, "seconds", skips)
    how = f"no step for {seconds:.1f} s" if isinstance(seconds, float) else "no step for ? s"
    place = where(str(data.get("stage") or ""), bool(data.get("in_step")))
    if data.get("waits"):
        place += ", waiting in a collective"
    return (
        f"{event.timestamp.isoformat(timespec='seconds')}  hang  rank {data.get('rank')} "
        f"({data.get('host')})  {place}  {how}  {data.get('waiting')} ranks waiting"
    )


def _slowdown(event: Event, skips: _StatSkips) -> str:
    """One line of ``summary``'s slowdowns: when, which Stat, from what to what."""
    data = event.data
    figures = []
    for key in ("before", "after", "ratio"):
        value = data.get(key)
        figures.append(_float(value, key, skips) if isinstance(value, (int, float)) else None)
    before, after, ratio = figures
    if before is not None and after is not None:
        how = f"{before * 1e3:.2f} -> {after * 1e3:.2f} ms"
    else:
        how = "? -> ? ms"
    how += f" ({ratio:.2f}x)" if ratio is not None else " (?x)"
    return (
        f"{event.timestamp.isoformat(timespec='seconds')}  slowdown  {data.get('stat')}  "
        f"{how} since {data.get('began')}  {data.get('windows')} windows"
    )


def _summary(args: argparse.Namespace) -> int:
    skips = _Skips(args.run)
    summary = _summarize(_events(args.run, skips))
    # Reported only when the file was readable: otherwise the error line says it all.
    skips.report()
    summary.skipped.report()
    span = ""
    if summary.first is not None and summary.last is not None:
        first = summary.first.isoformat(timespec="seconds")
        span = f", {first} to {summary.last.isoformat(timespec='seconds')}"
    print(f"{args.run}: {summary.events} events{span}")
    width = max((len(name) for name in summary.names), default=0) + 4
    for name, n in sorted(summary.names.items()):
        print(f"  {name:<{width}}{n:>8}")
    print()
    if summary.runs:
        print("runs")
        runs = list(summary.runs.values())
        widths = [max(len(run[i]) for run in runs) for i in range(4)]
        for run in runs:
            print(
                "  "
                + "  ".join(cell.ljust(w) for cell, w in zip(run, widths, strict=True)).rstrip()
            )
        print()
    for title, lines in (
        ("stragglers", summary.stragglers),
        ("hangs", summary.hangs),
        ("slowdowns", summary.slowdowns),
    ):
        if lines:
            print(title)
            for line in lines:
                print(f"  {line}")
            print()
    for prefix, family in summary.anatomy.families.items():
        _print_family(prefix, family)
    if args.by_origin:
        _print_origins(summary.origins)
    if summary.stats:
        rows = []
        partial: list[str] = []
        for key in sorted(summary.stats):
            stat, _, agg = key.rpartition(".")
            column = summary.stats[key]
            last, low, high = _last_low_high(column)
            if _partial_last(list(column.stamps)) is not None:
                # The run ended during it: few values, where one slow step weighs a lot.
                last = _fmt(column.before)
                if stat not in partial:
                    partial.append(stat)
            rows.append((stat, agg, str(column.windows), last, low, high))
        _print_table(("stat", "aggregate", "windows", "last", "min", "max"), rows, 2)
        if partial:
            print(
                f"last: the last whole window; that of {', '.join(partial)} was partial (the "
                "run ended during it): counted in windows, min and max"
            )
    elif not summary.metrics:
        print("no Stat events")
    if summary.metrics:
        if summary.stats:
            print()
        rows = []
        for key in sorted(summary.metrics):
            column = summary.metrics[key]
            last, low, high = _last_low_high(column)
            rows.append((key, str(column.windows), f"{column.last_step:.0f}", last, low, high))
        _print_table(("metric", "points", "last step", "last", "min", "max"), rows, 1)
    return 0


def _print_family(prefix: str, family: Family) -> None:
    """Where each rank's step goes in the StepAnatomy family ``prefix``, and the time the job
    lost waiting for a rank, per rank and stage, most first."""
    if not family.windows:
        return
    parts = [*family.stages, WAIT, OTHER, "step"]
    print(f"where each rank's step goes ({prefix}: ms per step over {family.windows} windows)")
    rows = [
        (str(rank), *(f"{means[part] * 1e3:.1f}" for part in parts))
        for rank, means in family.breakdown().items()
    ]
    _print_table(("rank", *parts), rows, 1)
    print()
    if not family.lost:
        return
    lost = sum(seconds for seconds, _ in family.lost.values())
    share = f", {lost / family.step_s:.1%} of the step time" if family.step_s > 0 else ""
    print(
        f"time lost waiting for the slowest rank ({prefix}: {lost:.3g} s over "
        f"{family.windows} windows{share})"
    )
    rows = []
    for (rank, stage), (seconds, windows) in sorted(
        family.lost.items(), key=lambda item: (-item[1][0], item[0])
    ):
        host = family.hosts.get(rank, "")
        rows.append((f"{rank} ({host})", stage or "-", f"{seconds:.3f}", f"{windows:.0f}"))
    _print_table(("rank", "stage", "lost s", "windows"), rows, 2)
    print()


def _last_low_high(column: _Column) -> tuple[str, str, str]:
    """A column's last, smallest and largest value as printed ("nan" where all were NaN)."""
    seen = column.low <= column.high
    low = _fmt(column.low) if seen else "nan"
    high = _fmt(column.high) if seen else "nan"
    return _fmt(column.last), low, high


def _print_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], left: int) -> None:
    """Columns padded to their widest cell: the first ``left`` to the left, numbers right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def _print_origins(origins: Counter[tuple[EventOrigin | None, str]]) -> None:
    """Events per origin and name: this process first, then the children by pid."""

    def order(key: tuple[EventOrigin | None, str]) -> tuple[bool, int, int, str]:
        origin, name = key
        if origin is None:
            return (False, 0, 0, name)
        return (True, origin.pid, -1 if origin.worker is None else origin.worker, name)

    rows = []
    for origin, name in sorted(origins, key=order):
        if origin is None:
            where = "this process"
        else:
            worker = "" if origin.worker is None else f" (worker {origin.worker})"
            where = f"pid {origin.pid}{worker}"
        rows.append((where, name, str(origins[origin, name])))
    print("events by origin")
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for where, name, n in rows:
        print(f"  {where:<{widths[0]}}  {name:<{widths[1]}}  {n:>{widths[2]}}")
    print()
