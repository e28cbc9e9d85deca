"""``monitor-bus plot``: each Stat of a run over time and each metric over its step, drawn
into an image file with matplotlib (imported only here, when the command runs).

Guarantees: the output is written only once the inputs have been checked (its directory, the
run, matplotlib, something to draw), and replaces the file atomically: it is saved beside it
and renamed over it, so a failed save leaves the old file be. Points are kept as packed
doubles, 16 bytes a point drawn. One panel per Stat (counts and sums get panels of their
own), with the band between ``<name>.p50`` and ``<name>.p99`` shaded where a Stat's windows
have both; then one panel per metric. A Stat's last window cut short by the run's end is
drawn hollow and labelled (and said so on stderr). What the read skipped is reported on
stderr (``_cli_read``). A run with StepAnatomy's breakdown (``_cli_anatomy``) gets first a
panel per family: a stacked bar per rank, its stages' time outside the wait, the wait and
the rest, in ms per step over the run (with ``--anatomy``, only those; with ``--stat``,
none of them).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys
import tempfile
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._cli_anatomy import OTHER, WAIT, Anatomy, Family
from ._cli_read import (
    PROG,
    CliError,
    _events,
    _metric_values,
    _partial_last,
    _Skips,
    _stat_values,
    _StatSkips,
    _step,
)
from ._run import METRICS_EVENT

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# Aggregates in the units of the values: drawn together in their Stat's panel.
_SHARED_AXES = {"value", "mean", "min", "max", "p50", "p90", "p95", "p99", "stddev"}


def _log_label(value: float, _pos: object) -> str:
    """Label 1, 2 and 5 times a power of ten on a log axis; the other ticks stay bare."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if any(math.isclose(mantissa, m) for m in (1, 2, 5)) else ""


def _panel(key: str) -> str:
    """The panel a Stat key is drawn in: its Stat's, or its own for counts and sums."""
    stat, _, agg = key.rpartition(".")
    return stat if agg in _SHARED_AXES else key


def _draw_series(ax: Axes, xs: list[float], ys: Sequence[float], label: str, partial: bool) -> None:
    """One series; a partial last window is drawn hollow, on a dashed segment, labelled (once
    per panel)."""
    if not partial:
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
        return
    (line,) = ax.plot(xs[:-1], ys[:-1], marker="o", markersize=3, label=label)
    color = line.get_color()
    ax.plot(
        xs[-2:],
        ys[-2:],
        linestyle="--",
        color=color,
        marker="o",
        markersize=4,
        markerfacecolor="none",
        markevery=[1],
    )
    if any(text.get_text() == "partial" for text in ax.texts):
        return  # one label a panel: its series end together
    ax.annotate(
        "partial",
        (xs[-1], ys[-1]),
        textcoords="offset points",
        xytext=(4, 4),
        fontsize="small",
        color=color,
    )


def _draw_family(ax: Axes, prefix: str, family: Family) -> None:
    """A stacked bar per rank: where its ``prefix`` step goes, in ms per step over the run;
    the legend outside the bars, the rank the job lost most time waiting for said above."""
    ranks = family.breakdown()
    xs = list(range(len(ranks)))
    bottoms = [0.0] * len(ranks)
    parts = [*family.stages, WAIT, OTHER]
    for i, part in enumerate(parts):
        heights = [means[part] * 1e3 for means in ranks.values()]
        style: dict[str, object] = {"color": f"C{i % 10}"}
        if part == WAIT:
            style = {"color": "0.6", "hatch": "//", "edgecolor": "0.35"}
        elif part == OTHER:
            style = {"color": "0.88", "edgecolor": "0.6"}
        label = part if part in (WAIT, OTHER) else f"{part} (outside the wait)"
        ax.bar(xs, heights, 0.6, bottom=bottoms, label=label, linewidth=0.5, **style)  # type: ignore[arg-type]
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(xs, [f"rank {r}" for r in ranks])
    ax.set_ylabel("ms per step")
    title = f"where each rank's step goes ({prefix}: mean over {family.windows} windows)"
    if family.lost:
        (rank, stage), (seconds, _) = max(family.lost.items(), key=lambda item: item[1][0])
        host = f" ({family.hosts[rank]})" if family.hosts.get(rank) else ""
        where = f" in {stage}" if stage else ""
        title += f"\nthe others lost {seconds:.3g} s waiting for rank {rank}{host}{where}"
    ax.set_title(title, loc="left", fontsize="medium")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    handles, labels = ax.get_legend_handles_labels()  # top to bottom, as the bars stack
    ax.legend(
        handles[::-1],
        labels[::-1],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        frameon=False,
    )


def _figure(
    series: dict[str, tuple[array[float], array[float]]],
    panels: dict[str, list[str]],
    metrics: dict[str, tuple[array[float], array[float]]],
    metric_panels: list[str],
    families: dict[str, Family] | None = None,
) -> tuple[Figure, list[str]]:
    """The figure: a panel per StepAnatomy family (a bar per rank), a panel per Stat
    (``panels``: title -> keys of ``series``), over seconds since the first window drawn,
    then a panel per metric, over its step. Returns it with the Stats whose last window is
    partial."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families = families or {}
    n = len(families) + len(panels) + len(metric_panels)
    figure = Figure(figsize=(8, 2.2 * n + 0.6 * (1 + len(families))), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(n, 1, squeeze=False)[:, 0])
    for ax, (prefix, family) in zip(axes, families.items(), strict=False):
        _draw_family(ax, prefix, family)
    axes = axes[len(families) :]
    stat_axes, metric_axes = axes[: len(panels)], axes[len(panels) :]
    partial: list[str] = []
    drawn = [key for keys in panels.values() for key in keys]
    start = min((series[key][0][0] for key in drawn), default=0.0)  # in time order per key
    for ax, (title, keys) in zip(stat_axes, panels.items(), strict=True):
        if ax is not stat_axes[0]:
            ax.sharex(stat_axes[0])
        band = _band(series, keys)
        values: list[float] = []
        for key in keys:
            stamps, ys = series[key]
            xs = [ts - start for ts in stamps]
            stat, _, agg = key.rpartition(".")
            if band is not None and key in band:
                if agg == "p50":
                    ax.fill_between(
                        xs, ys, series[band[1]][1], alpha=0.25, linewidth=0, label="p50-p99"
                    )
                values.extend(ys)
                continue
            cut = _partial_last(stamps) is not None
            if cut and stat not in partial:
                partial.append(stat)
            _draw_series(ax, xs, ys, agg, cut)
            values.extend(ys)
        _finish_panel(ax, title, values)
    for ax, name in zip(metric_axes, metric_panels, strict=True):
        if ax is not metric_axes[0]:
            ax.sharex(metric_axes[0])
        steps, ys = metrics[name]
        ax.plot(list(steps), list(ys), marker="o", markersize=3, label=name)
        _finish_panel(ax, f"{name} (metrics)", list(ys))
    if stat_axes:
        stat_axes[-1].set_xlabel("seconds since the first window")
    if metric_axes:
        metric_axes[-1].set_xlabel("step")
    return figure, partial


def _band(
    series: dict[str, tuple[array[float], array[float]]], keys: list[str]
) -> tuple[str, str] | None:
    """The panel's (p50 key, p99 key), when both are there for the same windows."""
    low = next((k for k in keys if k.endswith(".p50")), None)
    if low is None:
        return None
    high = low.removesuffix(".p50") + ".p99"
    if high not in keys or series[low][0] != series[high][0]:
        return None
    return low, high


def _finish_panel(ax: Axes, title: str, values: Sequence[float]) -> None:
    """Title, grid and legend; a log scale where the values span more than 20 times."""
    from matplotlib.ticker import FuncFormatter

    labels = FuncFormatter(_log_label)
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) > 20 * min(finite):
        ax.set_yscale("log")  # spikes or a falling loss would flatten the rest
        ax.yaxis.set_major_formatter(labels)
        ax.yaxis.set_minor_formatter(labels)
    ax.set_title(title, loc="left", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _plot(args: argparse.Namespace) -> int:
    run_path: str = args.run
    output: str = args.output or os.path.splitext(run_path)[0] + ".png"
    patterns: list[str] = args.stat or []
    if os.path.isdir(output):
        raise CliError(f"output is a directory: {output}")
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise CliError(f"output directory does not exist: {directory}")
    try:
        import matplotlib  # noqa: F401 - drawn by _figure
    except ImportError:
        raise CliError("plot needs matplotlib: pip install 'monitor_bus[plot]'") from None

    # Points are kept as packed doubles (x, value), 16 bytes a point: Stat windows at their
    # time (seconds since the epoch), metrics at their step.
    series: dict[str, tuple[array[float], array[float]]] = {}
    metrics: dict[str, tuple[array[float], array[float]]] = {}
    unchosen: set[str] = set()
    skips = _Skips(run_path)
    stat_skips = _StatSkips()
    anatomy = Anatomy()
    bars: bool = args.anatomy or not patterns

    def chosen(name: str) -> bool:
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            unchosen.add(name)
            return False
        return True

    order = 0
    for event in _events(run_path, skips):
        if bars and anatomy.add(event, stat_skips):
            continue
        if args.anatomy:
            continue
        ts = event.timestamp.timestamp()
        for key, value in _stat_values(event, stat_skips):
            points = series.get(key)
            if points is None:
                if not chosen(key.rpartition(".")[0]):
                    continue
                points = series[key] = (array("d"), array("d"))
            points[0].append(ts)
            points[1].append(value)
        if event.name == METRICS_EVENT:
            order += 1
            step = _step(event, order, stat_skips)
            if step is None:
                continue
            for key, value in _metric_values(event, stat_skips):
                points = metrics.get(key)
                if points is None:
                    if not chosen(key):
                        continue
                    points = metrics[key] = (array("d"), array("d"))
                points[0].append(step)
                points[1].append(value)
    skips.report()
    stat_skips.report()
    families = {prefix: f for prefix, f in anatomy.families.items() if f.windows}
    if args.anatomy and not families:
        raise CliError(
            f"no StepAnatomy breakdown in {run_path} (the monitor_bus.anatomy events that "
            "merge_stats_across_ranks logs on dst): nothing to plot"
        )
    if not series and not metrics and not families:
        if unchosen:
            chosen_args = " ".join(f"--stat {p}" for p in patterns)
            raise CliError(
                f"no Stat or metric in {run_path} matches {chosen_args}; "
                f"its Stats and metrics: {', '.join(sorted(unchosen))}"
            )
        raise CliError(f"no Stat or metrics events in {run_path}: nothing to plot")

    # One panel per Stat; counts and sums have other units, so they get panels of their own.
    # Then one panel per metric, over its step.
    panels: dict[str, list[str]] = {}
    for key in sorted(series):
        panels.setdefault(_panel(key), []).append(key)
    metric_panels = sorted(metrics)
    total = len(families) + len(panels) + len(metric_panels)
    if total > args.max_panels:
        print(
            f"{PROG}: note: drew the first {args.max_panels} of {total} panels, by name; "
            "choose with --stat PATTERN or --max-panels N",
            file=sys.stderr,
        )
        families = dict(list(families.items())[: args.max_panels])
        panels = dict(list(panels.items())[: args.max_panels - len(families)])
        metric_panels = metric_panels[: args.max_panels - len(families) - len(panels)]
    drawn = [key for keys in panels.values() for key in keys]
    figure, partial = _figure(series, panels, metrics, metric_panels, families=families)
    parent = os.path.basename(os.path.dirname(os.path.abspath(run_path)))
    figure.suptitle(os.path.join(parent, os.path.basename(run_path)))
    n_panels = len(families) + len(panels) + len(metric_panels)

    suffix = os.path.splitext(output)[1] or ".png"
    # Written beside the output and renamed over it, so a failed save leaves the old file be.
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            figure.savefig(f, format=suffix[1:])
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private
        os.replace(tmp, output)
    except BaseException:
        os.unlink(tmp)
        raise
    per_rank = f", {len(families)} with a bar per rank" if families else ""
    print(f"wrote {output} ({n_panels} panels{per_rank}, {len(drawn) + len(metric_panels)} series)")
    if partial:
        print(
            f"{PROG}: note: the last window of {', '.join(partial)} is partial (the run ended "
            "before it was over): drawn hollow, labelled 'partial'",
            file=sys.stderr,
        )
    return 0
