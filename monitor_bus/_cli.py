"""The ``monitor-bus`` command: ``demo``, ``summary`` and ``plot``, and ``--version``.

Errors the user can fix (a bad path, a file that is not a run, a missing extra) end the
command with one line on stderr and exit status 1, never a traceback; Ctrl-C ends it with
one line and status 130. Output into a pipe whose reader has gone (``| head``) ends it
without a word, with status 141, as a shell reports a command that SIGPIPE stopped. Outputs
are written only once the inputs have been checked, and ``plot`` replaces its output file
atomically.

This module parses the arguments, runs the demo and maps errors to exit statuses. The reading
of runs and what it skips are ``_cli_read``'s, the summary ``_cli_summary``'s and the plot
``_cli_plot``'s (their guarantees are there).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from typing import TextIO

from ._cli_plot import _plot
from ._cli_read import PROG, CliError
from ._cli_summary import _summary
from ._version import __version__


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
        "image file; a run merged across ranks with StepAnatomy's Stats first gets a stacked "
        "bar per rank: where its step goes. Needs matplotlib: pip install 'monitor_bus[plot]'.",
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
        "--anatomy",
        action="store_true",
        help="draw only where each rank's step goes: StepAnatomy's stacked bar per rank, from "
        "the breakdown merge_stats_across_ranks logs (drawn first by default; not with --stat)",
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
