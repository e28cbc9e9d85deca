"""The ``monitor-bus`` command: ``demo``, ``summary`` and ``plot``.

Errors the user can fix (a bad path, a file that is not a run, a missing extra) end the
command with one line on stderr and exit status 1, never a traceback. Outputs are written
only once the inputs have been checked, and ``plot`` replaces its output file atomically.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

PROG = "monitor-bus"


class CliError(Exception):
    """A problem to report in one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Events and windowed counters without PyTorch: run the demo, or read a run's JSONL file.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train a small numpy network in an async loop, logging through the bus",
        description=(
            "Train a 2-128-128-1 network on two synthetic spirals with numpy, driven by an anyio "
            "loop. Each epoch logs a 'demo.epoch' event (losses, held-out accuracy); step time, "
            "throughput and training loss are Stats with one-second windows. A background "
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
        help="print a run's events per name and a table of its Stats",
        description="Print the events per name of a JSONL run file and, per Stat aggregate, "
        "the number of windows and the last, smallest and largest value.",
    )
    summary.add_argument("run", metavar="RUN.jsonl", help="a file written by JsonlEventHandler")

    plot = commands.add_parser(
        "plot",
        help="draw each Stat of a run over time (needs matplotlib)",
        description="Draw each Stat of a JSONL run file over time, one panel per Stat (counts "
        "and sums get panels of their own), into an image file. Needs matplotlib: "
        "pip install 'monitor_bus[plot]'.",
    )
    plot.add_argument("run", metavar="RUN.jsonl", help="a file written by JsonlEventHandler")
    plot.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="image to write; the format follows the extension (default: RUN.png beside RUN.jsonl)",
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
            return _demo(args)
        if args.command == "summary":
            return _summary(args)
        return _plot(args)
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


# -- reading runs --


def _read(path: str) -> list[Any]:
    from ._jsonl import read_jsonl

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = read_jsonl(path)
    # Reported only when the file was readable: otherwise the error line says it all.
    for warning in caught:
        print(f"{PROG}: warning: {warning.message}", file=sys.stderr)
    return events


def _stat_series(events: list[Any]) -> dict[str, list[tuple[Any, float]]]:
    """Each Stat key (``name.aggregation``) with its (timestamp, value) per window, in order."""
    from ._stat import STAT_EVENT

    series: dict[str, list[tuple[Any, float]]] = {}
    for event in events:
        if event.name != STAT_EVENT:
            continue
        for key, value in event.data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((event.timestamp, float(value)))
    return series


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def _summary(args: argparse.Namespace) -> int:
    events = _read(args.run)
    names = Counter(event.name for event in events)
    if events:
        first = min(e.timestamp for e in events)
        last = max(e.timestamp for e in events)
        span = f", {first.isoformat(timespec='seconds')} to {last.isoformat(timespec='seconds')}"
    else:
        span = ""
    print(f"{args.run}: {len(events)} events{span}")
    width = max((len(name) for name in names), default=0) + 4
    for name, n in sorted(names.items()):
        print(f"  {name:<{width}}{n:>8}")
    series = _stat_series(events)
    print()
    if not series:
        print("no Stat events")
        return 0
    header = ("stat", "aggregate", "windows", "last", "min", "max")
    rows = []
    for key in sorted(series):
        stat, _, agg = key.rpartition(".")
        values = [v for _, v in series[key]]
        finite = [v for v in values if not math.isnan(v)]
        low = _fmt(min(finite)) if finite else "nan"
        high = _fmt(max(finite)) if finite else "nan"
        rows.append((stat, agg, str(len(values)), _fmt(values[-1]), low, high))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    return 0


# -- plot --

_SHARED_AXES = {"value", "mean", "min", "max"}


def _log_label(value: float, _pos: object) -> str:
    """Label 1, 2 and 5 times a power of ten on a log axis; the other ticks stay bare."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if any(math.isclose(mantissa, m) for m in (1, 2, 5)) else ""


def _plot(args: argparse.Namespace) -> int:
    run_path: str = args.run
    output: str = args.output or os.path.splitext(run_path)[0] + ".png"
    if os.path.isdir(output):
        raise CliError(f"output is a directory: {output}")
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise CliError(f"output directory does not exist: {directory}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise CliError("plot needs matplotlib: pip install 'monitor_bus[plot]'") from None

    events = _read(run_path)
    series = _stat_series(events)
    if not series:
        raise CliError(f"no Stat events in {run_path}: nothing to plot")

    # One panel per Stat; counts and sums have other units, so they get panels of their own.
    panels: dict[str, list[str]] = {}
    for key in sorted(series):
        stat, _, agg = key.rpartition(".")
        panels.setdefault(stat if agg in _SHARED_AXES else key, []).append(key)
    start = min(ts for points in series.values() for ts, _ in points)

    figure = Figure(figsize=(8, 2.2 * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, keys) in zip(axes, panels.items(), strict=True):
        for key in keys:
            xs = [(ts - start).total_seconds() for ts, _ in series[key]]
            ys = [v for _, v in series[key]]
            ax.plot(xs, ys, marker="o", markersize=3, label=key.rpartition(".")[2])
        values = [v for key in keys for _, v in series[key] if math.isfinite(v)]
        if values and min(values) > 0 and max(values) > 20 * min(values):
            ax.set_yscale("log")  # spikes or a falling loss would flatten the rest
            ax.yaxis.set_major_formatter(FuncFormatter(_log_label))
            ax.yaxis.set_minor_formatter(FuncFormatter(_log_label))
        ax.set_title(title, loc="left", fontsize="medium")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("seconds since the first window")
    parent = os.path.basename(os.path.dirname(os.path.abspath(run_path)))
    figure.suptitle(os.path.join(parent, os.path.basename(run_path)))

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
    print(f"wrote {output} ({len(panels)} panels, {len(series)} series)")
    return 0
