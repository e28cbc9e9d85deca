"""A torch-free ``SummaryWriter`` for scalars, histograms, text and hparams, on the
``tensorboard`` package's own writer.

Event files hold ``tensorboard.compat.proto`` messages and the text and hparams plugins' own
protos, framed as ``tensorboard``'s own ``RecordWriter`` frames them, so TensorBoard (its
HPARAMS and TEXT tabs too), ``EventAccumulator`` and every other reader of the format load
them. A file only ever holds whole records, even after a failed write (see ``_event_file``);
the records are built in ``_tensorboard_records``.

Needs the ``tensorboard`` extra: ``pip install 'monitor_bus[tensorboard]'``. ``import
monitor_bus`` does not import this module.

Examples:
    >>> import monitor_bus as monitor
    >>> from monitor_bus.tensorboard import SummaryWriter
    >>> writer = SummaryWriter("runs/exp1")  # doctest: +SKIP
    >>> monitor.register_event_handler(monitor.TensorboardEventHandler(writer))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsIndex

try:
    from tensorboard.compat.proto import (  # type: ignore[import-untyped]
        summary_pb2,
        tensor_pb2,
        tensor_shape_pb2,
    )
    from tensorboard.plugins.text import metadata as text_metadata  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "monitor_bus.tensorboard needs the tensorboard package: "
        "pip install 'monitor_bus[tensorboard]'",
        name="tensorboard",
    ) from exc

from ._check import check_path
from ._event import Event, epoch_seconds
from ._event_file import EventFile
from ._run import METRICS_EVENT, RUN_END_EVENT, RUN_START_EVENT
from ._skipped import INT64_MAX, INT64_MIN, is_utf8
from ._tensorboard_records import (
    check_tag,
    custom_scalars,
    experiment,
    plain_event,
    session_end,
    session_start,
    step_event,
    summary_value,
    table,
)
from .ranks import HANG_EVENT, SLOWDOWN_EVENT, STRAGGLER_EVENT

# The rank merge's findings, each a Markdown table under its text tag.
_TEXTS = {STRAGGLER_EVENT: "stragglers", HANG_EVENT: "hangs", SLOWDOWN_EVENT: "slowdowns"}

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["SummaryWriter"]


class SummaryWriter:
    """Write scalars and histograms to a TensorBoard event file, with the interface of
    torch's writer.

    Each writer makes a new ``events.out.tfevents.*`` file in ``log_dir``; several writers
    (or runs) may share a directory. Records reach the disk at ``flush()``, ``close()``, every
    ``flush_secs`` seconds (from a thread of the writer) or when ``max_queue`` records are
    pending (from the call that adds the last). A write that fails (a full disk) or is
    interrupted (Ctrl-C) leaves the file whole, cut back to its last whole record, and writes
    no record twice; the records not written are kept, within a bound, and written at the next
    flush; ``flush()`` raises the ``OSError`` (or the ``KeyboardInterrupt``). A record that
    no longer fits in that bound is refused: the call that adds it raises ``OSError``, and it
    is counted in ``dropped_records``, as are those ``close()`` cannot write. All methods are
    thread-safe. A copy inherited by a forked child cannot write (the writer's thread is not in
    the child, and the parent owns the file): its writes raise ``RuntimeError`` and its
    ``flush()`` and ``close()`` do nothing; open a writer of the child's own (or let the child's
    events go to the parent's handlers, which a bus does by default).

    Args:
        log_dir: the directory to write to, made if missing; default
            ``runs/<date>_<time>_<hostname><comment>``, as in torch.
        comment: appended to the default ``log_dir``; ignored when ``log_dir`` is given.
        max_queue: records held before a write is forced.
        flush_secs: seconds between automatic flushes.
        filename_suffix: appended to the event file names.

    Raises:
        TypeError: an argument has the wrong type.
        OSError: ``log_dir`` cannot be created (the message names it).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        comment: str = "",
        max_queue: int = 10,
        flush_secs: float = 120,
        filename_suffix: str = "",
    ) -> None:
        if log_dir is None:
            stamp = datetime.now().strftime("%b%d_%H-%M-%S")
            log_dir = os.path.join("runs", f"{stamp}_{socket.gethostname()}{comment}")
        else:
            log_dir = check_path("log_dir", log_dir)
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive int, got {max_queue!r}")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)):
            raise TypeError(f"flush_secs must be a number, not {type(flush_secs).__name__}")
        if not flush_secs > 0:
            raise ValueError(f"flush_secs must be positive, got {flush_secs!r}")
        self._log_dir = log_dir
        self._max_queue = max_queue
        self._flush_secs = flush_secs
        self._suffix = filename_suffix
        self._lock = threading.Lock()
        self._closed = False
        self._texts = dict.fromkeys(_TEXTS.values(), 0)  # the next step of each text tag
        self._last_step = 0  # the highest step written: a run's end is drawn there
        self._hparams: dict[str, Any] = {}  # the running session's, for its experiment
        self._pid = os.getpid()  # the process that owns the files
        self._writer = self._open(self._log_dir)
        # add_scalars keeps one file per (main_tag, tag) pair, in its own subdirectory.
        self._sub_writers: dict[str, EventFile] = {}
        self._stop = threading.Event()
        threading.Thread(
            target=self._flush_every, name="monitor_bus-tensorboard-flush", daemon=True
        ).start()
        _writers.add(self)

    def _open(self, log_dir: str) -> EventFile:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot create log_dir: {exc.strerror}", log_dir) from None
        return EventFile(log_dir, self._max_queue, self._suffix)

    def _flush_every(self) -> None:
        """The timer thread: flush every ``flush_secs`` until closed. A failure keeps the
        records for the next flush, whose caller sees the error."""
        while not self._stop.wait(self._flush_secs):
            with contextlib.suppress(OSError):
                self.flush()

    @property
    def dropped_records(self) -> int:
        """Records lost: refused while failed writes filled the bound, or not written by
        ``close()``."""
        with self._lock:
            return sum(f.dropped for f in (self._writer, *self._sub_writers.values()))

    @property
    def log_dir(self) -> str:
        """The directory this writer writes to."""
        return self._log_dir

    def get_logdir(self) -> str:
        """The directory this writer writes to (torch's spelling)."""
        return self._log_dir

    def add_scalar(
        self,
        tag: str,
        scalar_value: SupportsFloat,
        global_step: SupportsIndex | None = None,
        walltime: float | None = None,
        new_style: bool = False,
        double_precision: bool = False,
    ) -> None:
        """Record one scalar.

        By default the value is stored as a 32-bit float in ``simple_value``, as torch does;
        ``new_style=True`` stores it as a tensor of the scalars plugin (64-bit with
        ``double_precision=True``), which readers list under tensors instead of scalars.

        Args:
            tag: the series name, for example ``"loss/train"``.
            scalar_value: a real number (numpy and torch scalars work).
            global_step: the x coordinate; 0 when omitted.
            walltime: seconds since the epoch; now when omitted.
            new_style: store a tensor instead of a ``simple_value``.
            double_precision: with ``new_style``, keep all 64 bits.

        Raises:
            TypeError: ``tag`` is not a str, or ``scalar_value`` is not a real number.
            ValueError: ``tag`` is not valid UTF-8 (holds a lone surrogate), ``scalar_value``
                is an int beyond float64's range, or ``global_step`` is outside int64.
            RuntimeError: the writer is closed.
            OSError: the record is refused: failed writes filled the bound of records kept for
                another try (it is counted in ``dropped_records``).
        """
        value = summary_value(tag, scalar_value, new_style, double_precision)
        self._add(step_event(value, global_step, walltime))

    def add_histogram_raw(
        self,
        tag: str,
        min: SupportsFloat,  # noqa: A002 - torch's argument names
        max: SupportsFloat,  # noqa: A002
        num: SupportsFloat,
        sum: SupportsFloat,  # noqa: A002
        sum_squares: SupportsFloat,
        bucket_limits: Sequence[SupportsFloat],
        bucket_counts: Sequence[SupportsFloat],
        global_step: SupportsIndex | None = None,
        walltime: float | None = None,
    ) -> None:
        """Record a histogram from its buckets, shown in the HISTOGRAMS and DISTRIBUTIONS tabs,
        with the interface of torch's writer.

        Bucket ``i`` holds the values from ``bucket_limits[i - 1]`` (``min`` for the first) up
        to ``bucket_limits[i]``, ``bucket_counts[i]`` of them. Everything is stored as float64
        (``HistogramProto``).

        Args:
            tag: the series name.
            min: the smallest value.
            max: the largest value.
            num: how many values.
            sum: their sum.
            sum_squares: the sum of their squares.
            bucket_limits: the upper edge of each bucket, ascending.
            bucket_counts: the values in each bucket.
            global_step: the x coordinate; 0 when omitted.
            walltime: seconds since the epoch; now when omitted.

        Raises:
            TypeError: ``tag`` is not a str, or a number is not a real number.
            ValueError: ``tag`` is not valid UTF-8, ``bucket_limits`` is empty or not as long
                as ``bucket_counts``, or ``global_step`` is outside int64.
            RuntimeError: the writer is closed.
            OSError: the record is refused (see ``add_scalar``).
        """
        check_tag(tag)
        limits = _floats("bucket_limits", bucket_limits)
        counts = _floats("bucket_counts", bucket_counts)
        if not limits or len(limits) != len(counts):
            raise ValueError(
                f"bucket_limits ({len(limits)}) and bucket_counts ({len(counts)}) must be "
                "equally long and not empty"
            )
        stats = {
            name: _floats(name, [number])[0]
            for name, number in (
                ("min", min),
                ("max", max),
                ("num", num),
                ("sum", sum),
                ("sum_squares", sum_squares),
            )
        }
        histo = summary_pb2.HistogramProto(bucket_limit=limits, bucket=counts, **stats)
        self._add(
            step_event(summary_pb2.Summary.Value(tag=tag, histo=histo), global_step, walltime)
        )

    def add_scalars(
        self,
        main_tag: str,
        tag_scalar_dict: Mapping[str, SupportsFloat],
        global_step: SupportsIndex | None = None,
        walltime: float | None = None,
    ) -> None:
        """Record several scalars to draw on one chart, as torch does.

        Each key gets a file in ``<log_dir>/<main_tag>_<key>`` (``/`` in ``main_tag``
        becomes ``_``) holding the scalar under the tag ``main_tag``, so TensorBoard shows
        one chart with one line per key.

        Raises:
            TypeError: ``main_tag`` is not a str, ``tag_scalar_dict`` not a mapping, or a
                value not a real number.
            ValueError: as for ``add_scalar``.
            RuntimeError: the writer is closed.
        """
        if not isinstance(tag_scalar_dict, Mapping):
            raise TypeError(
                f"tag_scalar_dict must be a mapping, not {type(tag_scalar_dict).__name__}"
            )
        walltime = time.time() if walltime is None else walltime
        events = [
            (
                str(key),
                step_event(summary_value(main_tag, value, False, False), global_step, walltime),
            )
            for key, value in tag_scalar_dict.items()
        ]
        with self._lock:
            self._check_open()
            for key, event in events:
                # Same directory naming as torch, so both writers' runs line up.
                sub_dir = os.path.join(self._log_dir, f"{main_tag.replace('/', '_')}_{key}")
                writer = self._sub_writers.get(sub_dir)
                if writer is None:
                    writer = self._sub_writers[sub_dir] = self._open(sub_dir)
                writer.add(event.SerializeToString())

    def add_text(
        self,
        tag: str,
        text_string: str,
        global_step: SupportsIndex | None = None,
        walltime: float | None = None,
    ) -> None:
        """Record a text (Markdown), shown in TensorBoard's TEXT tab, as torch does.

        Raises:
            TypeError: ``tag`` or ``text_string`` is not a str.
            ValueError: ``tag`` or ``text_string`` is not valid UTF-8.
            RuntimeError: the writer is closed.
        """
        check_tag(tag)
        if not isinstance(text_string, str):
            raise TypeError(f"text_string must be a str, not {type(text_string).__name__}")
        if not is_utf8(text_string):
            raise ValueError("text_string is not valid UTF-8, which event files need")
        tensor = tensor_pb2.TensorProto(
            dtype="DT_STRING",
            string_val=[text_string.encode("utf-8")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        value = summary_pb2.Summary.Value(
            tag=tag,
            tensor=tensor,
            metadata=text_metadata.create_summary_metadata(display_name=None, description=None),
        )
        self._add(step_event(value, global_step, walltime))

    def add_custom_scalars(self, layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
        """Lay out TensorBoard's CUSTOM SCALARS tab, with the interface of torch's writer.

        ``layout`` maps a category to its charts, each a title and either
        ``["Multiline", [tag regex, ...]]`` (the matching tags on one chart) or
        ``["Margin", [value tag, lower tag, upper tag]]`` (a line with its band). The tab
        shows the layout written last.

        Raises:
            TypeError, ValueError: ``layout`` is not of that form.
            RuntimeError: the writer is closed.
        """
        self._add(plain_event(custom_scalars(layout), time.time()))

    def add_hparams(
        self,
        hparam_dict: Mapping[str, Any],
        metric_dict: Mapping[str, SupportsFloat] | None = None,
        hparam_domain_discrete: Mapping[str, list[Any]] | None = None,
        run_name: str | None = None,
        global_step: SupportsIndex | None = None,
    ) -> None:
        """Record one finished session for TensorBoard's HPARAMS tab, as torch does.

        Writes the experiment (the hparams, and ``metric_dict``'s keys as its metrics), the
        session's start with ``hparam_dict``, each metric as a scalar and the session's end
        (success). Unlike torch, which always writes into a new subdirectory (named by the
        time when ``run_name`` is omitted), the session goes to ``log_dir/run_name`` when
        ``run_name`` is given and to this writer's own file otherwise.

        Args:
            hparam_dict: name -> value (``bool``, ``int``, ``float``, ``str``; others as
                their ``str()``).
            metric_dict: name -> value of the session's metrics.
            hparam_domain_discrete: name -> the values that hparam may take.
            run_name: the subdirectory to write to.
            global_step: the step of the metric scalars.

        Raises:
            TypeError: an argument has the wrong type.
            RuntimeError: the writer is closed.
        """
        if not isinstance(hparam_dict, Mapping):
            raise TypeError(f"hparam_dict must be a mapping, not {type(hparam_dict).__name__}")
        if metric_dict is not None and not isinstance(metric_dict, Mapping):
            raise TypeError(f"metric_dict must be a mapping, not {type(metric_dict).__name__}")
        metrics = dict(metric_dict or {})
        now = time.time()
        events = [
            plain_event(experiment(hparam_dict, metrics, hparam_domain_discrete or {}), now),
            plain_event(session_start(hparam_dict, now), now),
        ]
        events += [
            step_event(summary_value(key, value, False, False), global_step, now)
            for key, value in metrics.items()
        ]
        events.append(plain_event(session_end("success", now), now))
        with self._lock:
            self._check_open()
            writer = self._writer
            if run_name is not None:
                sub_dir = os.path.join(self._log_dir, str(run_name))
                sub = self._sub_writers.get(sub_dir)
                if sub is None:
                    sub = self._sub_writers[sub_dir] = self._open(sub_dir)
                writer = sub
            for event in events:
                writer.add(event.SerializeToString())

    def add_run_event(self, event: Event) -> bool:
        """Write a run-lifecycle or metrics event the way TensorBoard shows it; False (and
        nothing written) for any other event.

        - ``RUN_START_EVENT``: an HPARAMS session start holding the ``hparams.*`` values (the
          ``config.*`` ones where there are none), and the whole start data as a Markdown
          table (text ``run/start``; floats to six significant digits). A number is written
          as a number, so the tab sorts it, filters it by range and draws it on a numeric
          axis; the tab has no int type and prints every number as a float (``256.00``),
          the ``run/start`` text shows it as logged.
        - ``RUN_END_EVENT``: the run's final metrics (``metrics.<key>``, ``Run.metrics``) as
          scalars ``summary/<key>`` and the experiment naming them as its metrics, so the
          HPARAMS tab lists those rather than every scalar tag of the run (each its last
          window; what the tab shows for a run without final metrics); the session's end (``success`` -> ``STATUS_SUCCESS``, ``failed`` and
          ``interrupted`` -> ``STATUS_FAILURE``, the tab having no "interrupted") and the end
          data as text ``run/stop``, which names the exact status (the TEXT tab lists tags by
          name: ``run/start``, then ``run/stop``). All at the highest step this writer has
          written: the run's last.
        - ``METRICS_EVENT``: each number as a scalar at the event's int ``"step"`` (strings
          are left out).
        - ``STRAGGLER_EVENT``, ``HANG_EVENT`` and ``SLOWDOWN_EVENT`` (the rank merge naming a
          slow rank or its recovery, a hung rank, a slowdown of the job): its data as a
          Markdown table, text ``stragglers``, ``hangs`` or ``slowdowns``, each tag at step
          0, 1, 2, ... in turn.

        The event's timestamp is the wall time. Thread-safe.

        Raises:
            RuntimeError: the writer is closed.
        """
        wall = epoch_seconds(event)
        data = event.data
        if event.name == RUN_START_EVENT:
            # The hyperparameters alone (the config where there are none): TensorBoard lists
            # them by name and checks the first few, so config.* would crowd out hparams.*.
            hparams = {k: v for k, v in data.items() if k.startswith("hparams.")}
            if not hparams:
                hparams = {k: v for k, v in data.items() if k.startswith("config.")}
            with self._lock:
                self._hparams = hparams
            self._add(plain_event(session_start(hparams, wall), wall))
            self.add_text("run/start", table(data), 0, wall)
        elif event.name == RUN_END_EVENT:
            self._end_run(data, wall)
        elif event.name == METRICS_EVENT:
            step = data.get("step")
            fixed = isinstance(step, int) and step.__class__ is int
            at = step if fixed and INT64_MIN <= step <= INT64_MAX else None  # type: ignore[operator]
            for key, value in data.items():
                if key != "step" and value.__class__ in (int, float, bool) and is_utf8(key):
                    self._add(step_event(summary_value(key, float(value), False, False), at, wall))
        elif event.name in _TEXTS:
            tag = _TEXTS[event.name]
            with self._lock:
                step = self._texts[tag]
                self._texts[tag] = step + 1
            self.add_text(tag, table(data), step, wall)
        else:
            return False
        return True

    def _end_run(self, data: Mapping[str, Any], wall: float) -> None:
        with self._lock:
            step, hparams, self._hparams = self._last_step, self._hparams, {}
        # "summary/", as W&B names a run's final metrics: a section sorting after the usual
        # ones, as TensorBoard's SCALARS tab opens only its first few.
        metrics = {
            f"summary/{key[len('metrics.') :]}": float(value)
            for key, value in data.items()
            if key.startswith("metrics.") and value.__class__ in (int, float, bool) and is_utf8(key)
        }
        if hparams and metrics:  # the experiment: the session's hparams, the chosen metrics
            self._add(plain_event(experiment(hparams, metrics, {}), wall))
        for tag, value in metrics.items():
            self._add(step_event(summary_value(tag, value, False, False), step, wall))
        self._add(plain_event(session_end(str(data.get("status")), wall), wall))
        # Not "run/end": the TEXT tab sorts tags by name, and would list it first.
        self.add_text("run/stop", table(data), step, wall)

    def _add(self, event: Any) -> None:
        with self._lock:
            self._check_open()
            self._writer.add(event.SerializeToString())
            if event.step > self._last_step:
                self._last_step = event.step

    def flush(self) -> None:
        """Write everything recorded so far to disk. A no-op once closed.

        Raises:
            OSError: a write failed (the first failure, after every file was tried); what it
                did not write is kept for the next flush.
        """
        with self._lock:
            if self._closed or self._pid != os.getpid():
                return
            _each((self._writer, *self._sub_writers.values()), EventFile.flush)

    def close(self) -> None:
        """Flush and close the event files. Idempotent.

        Raises:
            OSError: a last write failed; what it did not write is counted in
                ``dropped_records``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            if self._pid != os.getpid():
                return  # the parent's files: the parent closes them
            _each((self._writer, *self._sub_writers.values()), EventFile.close)

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SummaryWriter {self._log_dir!r} ({state})>"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._pid != os.getpid():
            raise RuntimeError(
                f"{self!r} was opened by process {self._pid}; this process is a forked child "
                "of it and cannot write there: open a SummaryWriter in the child"
            )

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork


def _each(files: tuple[EventFile, ...], call: Callable[[EventFile], None]) -> None:
    """``call`` on every file, then raise the first error of them (a Ctrl-C too: the other
    files still get their write, or their close and their count of what was lost)."""
    error: BaseException | None = None
    for file in files:
        try:
            call(file)
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


_writers: weakref.WeakSet[SummaryWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_writers):
        writer._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _floats(name: str, numbers: Sequence[Any]) -> list[float]:
    """``numbers`` as floats, or a ``TypeError`` naming the argument ``name``."""
    try:
        return [float(number) for number in numbers]
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"{name} must hold real numbers, got {numbers!r:.200}") from None
