"""The ``monitor-bus`` command: ``demo``, ``summary`` and ``plot``, and ``--version``.

Errors the user can fix (a bad path, a file that is not a run, a missing extra) end the
command with one line on stderr and exit status 1, never a traceback; Ctrl-C ends it with
one line and status 130. Output into a pipe whose reader has gone (``| head``) ends it
without a word, with status 141, as a shell reports a command that SIGPIPE stopped. Outputs
are written only once the inputs have been checked, and ``plot`` replaces its output file
atomically.

This module parses the arguments, runs the demo and maps errors to exit statuses. The reading
of runs and what it skips are ``_cli_read``'s, the summary ``_cli_summary``'s (their
guarantees are there).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import math
import os
import shlex
import signal
import sys
import tempfile
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from . import __version__
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
from ._cli_summary import _summary
from ._run import METRICS_EVENT

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Events and windowed counters without PyTorch: run the demo, or read a run's JSONL file.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train a small numpy network in an async loop, logging through the bus",
        description=(
            "Train a 2-128-128-1 network on two synthetic spirals with numpy, driven by an anyio "
            "loop. Each epoch logs a 'demo.epoch' event (losses, held-out accuracy); step time, "
            "throughput and training loss are Stats with quarter-second windows. A background "
            "dispatcher writes everything to LOGDIR/events.jsonl and to TensorBoard event files "
            "in LOGDIR. A progress bar runs on stderr; at the end a summary table and the "
            "command that opens TensorBoard on the run are printed."
        ),
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=3000,
        metavar="N",
        help="optimizer steps, minibatches of 256 (default: %(default)s, a few seconds)",
    )
    demo.add_argument(
        "--logdir",
        metavar="DIR",
        help="directory for events.jsonl and the TensorBoard files, made if missing "
        "(default: ./runs/<date-time>)",
    )
    demo.add_argument(
        "--no-tensorboard",
        dest="tensorboard",
        action="store_false",
        help="write only the JSONL file (no tensorboard package needed)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the data set, initial weights and shuffling (default: %(default)s)",
    )

    summary = commands.add_parser(
        "summary",
        help="print a run's events per name and a table of its Stats and metrics",
        description="Print the events per name of a JSONL run file; per Stat aggregate, "
        "the number of windows and the last, smallest and largest value; per metric of its "
        "metrics events (Lightning, Hugging Face), the points, the last step and the last, "
        "smallest and largest value.",
    )
    summary.add_argument("run", metavar="RUN.jsonl", help="a file written by JsonlEventHandler")
    summary.add_argument(
        "--by-origin",
        action="store_true",
        help="also count the events per process they were logged in (this process, or a child "
        "process: its pid and DataLoader worker id)",
    )

    plot = commands.add_parser(
        "plot",
        help="draw each Stat of a run over time, each metric over its step (needs matplotlib)",
        description="Draw each Stat of a JSONL run file over time, one panel per Stat (counts "
        "and sums get panels of their own; a p50-p99 band where the windows have both), and "
        "each metric of its metrics events (Lightning, Hugging Face) over its step, into an "
        "image file. Needs matplotlib: pip install 'monitor_bus[plot]'.",
    )
    plot.add_argument("run", metavar="RUN.jsonl", help="a file written by JsonlEventHandler")
    plot.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="image to write; the format follows the extension (default: RUN.png beside RUN.jsonl)",
    )
    plot.add_argument(
        "--stat",
        action="append",
        metavar="PATTERN",
        help="draw only the Stats and metrics whose name matches this glob pattern "
        "(step_time_ms, 'loss*'); repeat for more",
    )
    plot.add_argument(
        "--max-panels",
        type=_positive_int,
        default=12,
        metavar="N",
        help="draw at most N panels, the first by name, and say so if there are more "
        "(default: %(default)s)",
    )
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already reported
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "demo":
            status = _demo(args)
        elif args.command == "summary":
            status = _summary(args)
        else:
            status = _plot(args)
        sys.stdout.flush()  # here, where a reader gone (``| head``) is caught: not at exit
        return status
    except BrokenPipeError:
        _stop_writing()
        return _BROKEN_PIPE
    except CliError as exc:
        _error(str(exc))
    except OSError as exc:
        _error(_describe_os_error(exc))
    except ValueError as exc:
        _error(str(exc))
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    return 1


# What a shell shows for a command killed by SIGPIPE, as ``cat`` is when its reader goes.
_BROKEN_PIPE = 128 + getattr(signal, "SIGPIPE", 13)


def _stop_writing() -> None:
    """The reader of stdout or stderr has gone: point both at the null device, so what is
    still buffered is dropped in silence, not reported at exit."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # ValueError: no file descriptor
                os.dup2(null, stream.fileno())
    finally:
        os.close(null)


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _describe_os_error(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# -- demo --


class _ProgressBar:
    """A plain-text bar on a stream: redrawn in place on a terminal, a line per tenth otherwise."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._tty = stream.isatty()
        self._shown = -1

    def __call__(self, done: int, total: int, loss: float) -> None:
        fraction = done / total
        if not self._tty:
            tenth = int(fraction * 10)
            if tenth == self._shown:
                return
            self._shown = tenth
        filled = int(fraction * self._width)
        bar = "#" * filled + "-" * (self._width - filled)
        loss_text = "" if math.isnan(loss) else f"  loss {loss:.4f}"
        line = f"[{bar}] {done}/{total} steps{loss_text}"
        self._stream.write(f"\r{line}" if self._tty else f"{line}\n")
        self._stream.flush()

    def end(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()


def _demo(args: argparse.Namespace) -> int:
    if "numpy" not in sys.modules:
        # The demo's matrices are small: BLAS worker threads only contend, and on a busy
        # machine they make a step several times slower. Read when numpy loads.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    try:
        from ._demo import run_demo
    except ImportError as exc:  # pragma: no cover - the package's own module
        raise CliError(str(exc)) from None
    bar = _ProgressBar(sys.stderr)
    try:
        result = run_demo(
            args.steps, args.logdir, tensorboard=args.tensorboard, seed=args.seed, progress=bar
        )
    except ImportError as exc:
        missing = exc.name or "a dependency"
        hint = " (or run with --no-tensorboard)" if missing == "tensorboard" else ""
        raise CliError(f"the demo needs {missing}: pip install 'monitor_bus[demo]'{hint}") from None
    finally:
        bar.end()

    events = sum(result.events_by_name.values())
    rows = [("events by name", "")]
    rows += [(f"  {name}", str(n)) for name, n in sorted(result.events_by_name.items())]
    rows.append(("Stat windows", ""))
    rows += [(f"  {name}", str(n)) for name, n in sorted(result.stat_windows.items())]
    rows += [
        (f"written to {os.path.basename(result.jsonl_path)}", str(result.written)),
        ("dropped", str(result.dropped)),
        ("undelivered to handlers", str(result.undelivered)),
        ("handler errors", str(result.handler_errors)),
        (
            "delivery latency",
            f"p50 {result.latency_percentile(50):.2f} ms, p99 {result.latency_percentile(99):.2f} ms"
            f" ({len(result.latencies_ms)} events)",
        ),
    ]
    print(
        f"Trained {result.steps} steps ({result.epochs} epochs) in {result.seconds:.1f} s; "
        f"held-out accuracy {result.final_accuracy:.1%}. {events} events logged."
    )
    print()
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        print(f"{label:<{width}}{value}".rstrip())
    print()
    jsonl = shlex.quote(result.jsonl_path)
    if result.tensorboard:
        print("Open TensorBoard on this run:")
        print(f"  tensorboard --logdir {shlex.quote(result.log_dir)}")
    print("Summarize or plot the JSONL file:")
    print(f"  {PROG} summary {jsonl}")
    print(f"  {PROG} plot {jsonl} -o {shlex.quote(os.path.join(result.log_dir, 'plot.png'))}")
    return 0


# -- plot --

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


def _figure(
    series: dict[str, tuple[array[float], array[float]]],
    panels: dict[str, list[str]],
    metrics: dict[str, tuple[array[float], array[float]]],
    metric_panels: list[str],
) -> tuple[Figure, list[str]]:
    """The figure: a panel per Stat (``panels``: title -> keys of ``series``), over seconds
    since the first window drawn, then a panel per metric, over its step. Returns it with the
    Stats whose last window is partial."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(panels) + len(metric_panels)
    figure = Figure(figsize=(8, 2.2 * n + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(n, 1, squeeze=False)[:, 0])
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

    def chosen(name: str) -> bool:
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            unchosen.add(name)
            return False
        return True

    order = 0
    for event in _events(run_path, skips):
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
    if not series and not metrics:
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
    total = len(panels) + len(metric_panels)
    if total > args.max_panels:
        print(
            f"{PROG}: note: drew the first {args.max_panels} of {total} panels, by name; "
            "choose with --stat PATTERN or --max-panels N",
            file=sys.stderr,
        )
        panels = dict(list(panels.items())[: args.max_panels])
        metric_panels = metric_panels[: args.max_panels - len(panels)]
    drawn = [key for keys in panels.values() for key in keys]
    figure, partial = _figure(series, panels, metrics, metric_panels)
    parent = os.path.basename(os.path.dirname(os.path.abspath(run_path)))
    figure.suptitle(os.path.join(parent, os.path.basename(run_path)))
    n_panels = len(panels) + len(metric_panels)

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
    print(f"wrote {output} ({n_panels} panels, {len(drawn) + len(metric_panels)} series)")
    if partial:
        print(
            f"{PROG}: note: the last window of {', '.join(partial)} is partial (the run ended "
            "before it was over): drawn hollow, labelled 'partial'",
            file=sys.stderr,
        )
    return 0
