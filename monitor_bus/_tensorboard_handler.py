"""TensorBoard as a sink, through any writer with ``add_scalar`` (and ``add_histogram_raw``
for a window's ``Histogram``)."""

from __future__ import annotations

import math
import re
from typing import Any, Protocol

from ._event import Event, epoch_seconds, from_slots
from ._handler import call_each
from ._histogram import Histogram
from ._queue import SLOTS
from ._run import METRICS_EVENT, RUN_END_EVENT, RUN_START_EVENT
from ._skipped import (
    FLOAT32_OVERFLOW,
    INT64_MAX,
    INT64_MIN,
    SkipReporter,
    float64_or_why,
    is_utf8,
)
from ._window import STAT_EVENT
from .ranks import HANG_EVENT, SLOWDOWN_EVENT, STRAGGLER_EVENT

_RUN_EVENTS = frozenset(
    (RUN_START_EVENT, RUN_END_EVENT, METRICS_EVENT, STRAGGLER_EVENT, HANG_EVENT, SLOWDOWN_EVENT)
)
_WANTED = _RUN_EVENTS | {STAT_EVENT}

_SYSTEM = "system."  # SystemMetrics' Stats
#: TensorBoard's section of the system metrics, and the CUSTOM SCALARS category of their charts.
SYSTEM_SECTION = "system"
# A system metric's unit, by the end of its name: in its chart's title.
_UNITS = (
    ("_bytes_per_s", "bytes/s"),
    ("_bytes_total", "bytes"),
    ("_seconds_total", "s"),
    ("_percent", "%"),
    ("_bytes", "bytes"),
    ("_watts", "W"),
    ("_c", "°C"),
)


def system_tag(key: str) -> tuple[str, str, str] | None:
    """A system metric's key as (tag, metric, aggregation), or None for any other key.

    The mean (a counter's value) is the metric's own tag, ``system/<metric>``; its min and
    max go to sections of their own, ``system.min/<metric>`` and ``system.max/<metric>``: a
    card's title, cut short, keeps the start of the tag's last part, which names the metric.
    """
    stat, _, aggregation = key.rpartition(".")
    if not stat.startswith(_SYSTEM) or aggregation not in ("mean", "value", "min", "max"):
        return None
    metric = stat[len(_SYSTEM) :]
    if aggregation in ("mean", "value"):
        return f"{SYSTEM_SECTION}/{metric}", metric, aggregation
    return f"{SYSTEM_SECTION}.{aggregation}/{metric}", metric, aggregation


def chart_title(metric: str) -> str:
    """A system metric's chart title: its name and unit (``disk_read_bytes_per_s (bytes/s)``)."""
    unit = next((unit for end, unit in _UNITS if metric.endswith(end)), None)
    return metric if unit is None else f"{metric} ({unit})"


class ScalarWriter(Protocol):
    """What ``TensorboardEventHandler`` needs of a writer (torch's and tensorboardX's
    ``SummaryWriter`` qualify)."""

    def add_scalar(
        self, tag: str, scalar_value: Any, global_step: Any = ..., walltime: Any = ...
    ) -> Any: ...


def tensorboard_histogram(histogram: Histogram) -> dict[str, Any] | None:
    """``histogram`` as the arguments of ``add_histogram_raw`` (TensorBoard's
    ``HistogramProto``), or None if it has no finite sample.

    The buckets are the upper edge of each non-empty one (ascending) and its count, a bucket
    reaching from the edge before it (the first from ``min``); a gap between two becomes one
    empty bucket, so none stretches over values it never held. NaN and infinite samples are
    left out (TensorBoard's charts need finite edges): ``num`` counts the others and ``min``,
    ``max`` are the outer edges of their buckets when the histogram's own are infinite.
    ``sum_squares``, which a Histogram does not keep and TensorBoard's charts do not use, is 0.
    """
    limits: list[float] = []
    counts: list[int] = []
    for lower, upper, count in histogram.buckets():
        if lower == upper and math.isinf(lower):
            continue  # the -inf and +inf samples
        if not limits:
            first = lower
        elif lower > limits[-1] and lower != upper:
            limits.append(lower)
            counts.append(0)
        limits.append(upper)
        counts.append(count)
    if not limits:
        return None
    low, high = histogram.min, histogram.max
    return {
        "min": low if math.isfinite(low) else first,
        "max": high if math.isfinite(high) else limits[-1],
        "num": histogram.count
        - histogram.nan_count
        - histogram.inf_count
        - histogram.neg_inf_count,
        "sum": histogram.sum,
        "sum_squares": 0.0,
        "bucket_limits": limits,
        "bucket_counts": counts,
    }


class TensorboardEventHandler:
    """Write every ``Stat`` window to TensorBoard as scalars.

    Each ``STAT_EVENT`` becomes ``writer.add_scalar(key, value, global_step=step,
    walltime=...)`` per key, with the event's timestamp as wall time. Run start and end,
    framework metrics and the rank merge's stragglers, hangs and slowdowns (``RUN_START_EVENT``,
    ``RUN_END_EVENT``, ``METRICS_EVENT``, ``STRAGGLER_EVENT``, ``HANG_EVENT``,
    ``SLOWDOWN_EVENT``) go to the writer's ``add_run_event`` where it has one
    (``monitor_bus.tensorboard.SummaryWriter``: the HPARAMS tab, texts and scalars); other events are ignored, as in ``torch.monitor``. The bus
    hands it whole batches as they were queued, so the events it ignores cost next to nothing.

    Steps: an event whose data holds an int under the key ``"step"`` gives that step to all
    its other keys (``"step"`` itself is not written). Otherwise each tag counts its own
    steps, 0, 1, 2, ..., so the n-th window of a Stat is drawn at x = n. (torch.monitor passes
    no step, which puts every point of a series at step 0.) A bool is not a step, nor an int
    outside int64 (the event file's step type): both are written like any other key.

    Values: each reaches the writer as a ``float`` (a bool as 0.0 or 1.0), so every writer
    gets the same input. A value TensorBoard cannot hold is skipped, the rest of the event is
    written: a string, a finite number beyond the range of the 32-bit float a scalar is stored
    as (about 3.4e38, ``2**128`` for an int: it would read back as an infinity), or a key that
    is not valid UTF-8 (a lone surrogate) and so cannot be a tag. Each is counted in
    ``skipped_values`` and logged as a warning on the ``monitor_bus`` logger, at most once per
    key every 10 seconds. The numbers of a ``METRICS_EVENT`` are checked the same way. NaN and
    infinities are written.

    Distributions: a window's percentiles and stddev (``"step_time.p99"``) are scalars like
    the rest; its ``Histogram`` (``"step_time.histogram"``) becomes a histogram summary, shown
    in the HISTOGRAMS and DISTRIBUTIONS tabs, through the writer's ``add_histogram_raw``
    (ours, torch's and tensorboardX's have it), at the same steps: its non-empty buckets with
    their exact edges and counts, its count, sum, min and max (NaN and
    infinite samples are left out, TensorBoard's charts needing finite edges). A histogram
    for a writer without ``add_histogram_raw``, under a key that is not UTF-8, or with no
    finite sample is skipped, counted in ``skipped_values`` and reported like a value.

    The bus calls ``flush()`` after each delivered batch, which flushes the writer (if it
    has a ``flush`` method): once ``bus.flush()`` returns, the scalars are in the event file.

    An event the writer raises on (a closed writer; ours refusing records because a full disk
    filled the bound of those it keeps for another try) is not (wholly) written: it counts
    in ``dropped`` and, on a bus, as dropped by this handler, besides the error. A flush that
    fails is the handler's error; ``monitor_bus.tensorboard.SummaryWriter`` keeps what it did
    not write and writes it at its next flush, leaving the event file whole meanwhile.

    Tags: each key is its own tag (``"step_time.mean"``), as in ``torch.monitor``; TensorBoard
    then shows every key in a section of its own. With ``group="stats"`` the tags are
    ``"stats/step_time.mean"``, ..., all in one section.

    System metrics (``SystemMetrics``' ``system.<metric>`` Stats, whatever ``group``): one
    chart per metric in the section ``system``, its mean (a counter's value) under
    ``system/<metric>``; the window's min and max under ``system.min/<metric>`` and
    ``system.max/<metric>``, so cut titles stay distinct; and, through the writer's
    ``add_custom_scalars`` where it has one (ours, torch's and tensorboardX's do), a CUSTOM
    SCALARS chart per metric with a mean, titled with its unit (``disk_read_bytes_per_s
    (bytes/s)``): the mean with its min-max band (a margin chart), the layout rewritten as
    metrics appear. The cumulative ``*_total`` counters are in the SCALARS tab only.

    Args:
        writer: a ``SummaryWriter`` (``monitor_bus.tensorboard``, torch's or tensorboardX's).
        group: if given, a tag prefix: keys are written as ``"<group>/<key>"``.

    Raises:
        TypeError: ``writer`` has no ``add_scalar`` method, or ``group`` is not a str.
        ValueError: ``group`` is empty or ends with ``"/"``.

    Examples:
        >>> import monitor_bus as monitor
        >>> from torch.utils.tensorboard import SummaryWriter  # doctest: +SKIP
        >>> monitor.register_event_handler(monitor.TensorboardEventHandler(SummaryWriter()))  # doctest: +SKIP
    """

    # Shares the bus's runner with the other bundled sinks (``_runner``): one wake-up per batch.
    _monitor_bus_bundled = True

    def __init__(self, writer: ScalarWriter, *, group: str | None = None) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer must have an add_scalar method, not {type(writer).__name__}")
        if group is not None:
            if not isinstance(group, str):
                raise TypeError(f"group must be a str or None, not {type(group).__name__}")
            if not group or group.endswith("/"):
                raise ValueError(
                    f"group must be a non-empty tag prefix without a trailing '/', got {group!r}"
                )
        self._writer = writer
        add_histogram_raw = getattr(writer, "add_histogram_raw", None)
        self._add_histogram_raw = add_histogram_raw if callable(add_histogram_raw) else None
        add_run_event = getattr(writer, "add_run_event", None)
        self._add_run_event = add_run_event if callable(add_run_event) else None
        self._prefix = "" if group is None else group + "/"
        add_custom_scalars = getattr(writer, "add_custom_scalars", None)
        self._add_layout = add_custom_scalars if callable(add_custom_scalars) else None
        self._tags: dict[str, str] = {}  # key -> its tag, made once
        # The system metrics' CUSTOM SCALARS charts: title -> torch's chart spec.
        self._charts: dict[str, list[Any]] = {}
        # Next step per tag; touched only by the handler's own thread.
        self._steps: dict[str, int] = {}
        self._skips = SkipReporter("TensorboardEventHandler")
        #: Values skipped because TensorBoard cannot hold them (see above).
        self.skipped_values = 0
        self._dropped = 0
        self._dropped_told = 0  # the part of _dropped a bus was told of

    def __call__(self, event: Event) -> None:
        try:
            if event.name == STAT_EVENT:
                self._write_window(event)
            elif self._add_run_event is not None and event.name in _RUN_EVENTS:
                if event.name == METRICS_EVENT:
                    event = self._writable_metrics(event)
                self._add_run_event(event)
        except Exception:
            self._dropped += 1  # not (wholly) written
            raise

    @property
    def dropped(self) -> int:
        """Events not (wholly) written: the writer raised while taking them (a closed writer,
        or ours refusing records while a full disk fills its bound)."""
        return self._dropped

    def _monitor_bus_lost(self, final: bool) -> int:
        """The bus's question (see ``_handler``): events lost since it last asked. What the
        writer still keeps for another write is its own to write or count (``close()``)."""
        lost = self._dropped - self._dropped_told
        self._dropped_told += lost
        return lost

    def _writable_metrics(self, event: Event) -> Event:
        """``event`` without the numbers a scalar cannot hold (each counted and reported)."""
        data = event.data
        kept = {
            key: value
            for key, value in data.items()
            if key == "step"
            or value.__class__ not in (int, float, bool)
            or self._scalar(key, value) is not None
        }
        return event if len(kept) == len(data) else Event(event.name, event.timestamp, kept)

    def handle_batch(self, events: list[Event]) -> None:
        """Write the Stat windows and run events among ``events``; a write that fails costs
        no other event: the failures are raised together at the end, as an ``ExceptionGroup``."""
        wanted = [e for e in events if e.name in _WANTED]
        if wanted:
            call_each(wanted, self)

    def _monitor_bus_take_slots(self, slots: list[Any]) -> None:
        """The bus's call (see ``_handler.handler_calls``): ``handle_batch`` on a batch as it was
        queued, building the Events of the wanted ones only, each with its own ``data`` (the
        writer is the user's code)."""
        names = slots[0::SLOTS]
        if _WANTED.isdisjoint(names):  # most batches: one pass in C
            return
        wanted = [
            from_slots(name, slots[i + 1], slots[i + 2], copy=True)
            for i, name in zip(range(0, len(slots), SLOTS), names, strict=True)
            if name in _WANTED
        ]
        call_each(wanted, self)

    def _tag(self, key: str, data: dict[str, Any]) -> str:
        """``key``'s tag, made at its first window (a system metric's adds its chart)."""
        tag = self._tags.get(key)
        if tag is not None:
            return tag
        system = system_tag(key)
        if system is None:
            tag = self._prefix + key
        else:
            tag, metric, aggregation = system
            stat = key.rpartition(".")[0]
            if aggregation == "mean":
                bounds = f"{stat}.min" in data and f"{stat}.max" in data
                band = [f"{SYSTEM_SECTION}.{edge}/{metric}" for edge in ("min", "max")]
                self._charts[chart_title(metric)] = (
                    ["Margin", [tag, *band]] if bounds else ["Multiline", [f"^{re.escape(tag)}$"]]
                )
                if self._add_layout is not None:
                    self._add_layout({SYSTEM_SECTION: dict(sorted(self._charts.items()))})
        self._tags[key] = tag
        return tag

    def _write_window(self, event: Event) -> None:
        wall = epoch_seconds(event)
        add_scalar = self._writer.add_scalar
        data = event.data
        step = data.get("step")
        if step.__class__ is int and INT64_MIN <= step <= INT64_MAX:
            for key, value in data.items():
                if isinstance(value, Histogram):  # a window's (data_value_t is torch's alias)
                    self._write_histogram(key, value, step, wall)
                elif key != "step":
                    scalar = self._scalar(key, value)
                    if scalar is not None:
                        tag = self._tag(key, data)
                        add_scalar(tag, scalar, global_step=step, walltime=wall)
            return
        steps = self._steps
        for key, value in data.items():
            if isinstance(value, Histogram):  # a window's (data_value_t is torch's alias)
                n = steps.get(key, 0)
                if self._write_histogram(key, value, n, wall):
                    steps[key] = n + 1
                continue
            scalar = self._scalar(key, value)
            if scalar is not None:
                n = steps.get(key, 0)
                steps[key] = n + 1
                add_scalar(self._tag(key, data), scalar, global_step=n, walltime=wall)

    def _write_histogram(self, key: str, value: Histogram, step: int, walltime: float) -> bool:
        """Write ``value`` as a histogram summary; False (counted and reported) if it cannot
        be: a writer without ``add_histogram_raw``, a key that is not UTF-8, no sample in a
        bucket."""
        add_histogram_raw = self._add_histogram_raw
        summary = None
        if add_histogram_raw is None:
            reason = "no_histogram_writer"
            why = f"Stat value {key!r} is a histogram and the writer has no add_histogram_raw"
        elif not is_utf8(key):
            reason, why = "invalid_text", f"Stat key {key!r} is not valid UTF-8, so no tag"
        else:
            summary = tensorboard_histogram(value)
            reason = "empty_histogram"
            why = f"Stat value {key!r} is a histogram without a finite sample"
        if add_histogram_raw is None or summary is None:
            self.skipped_values += 1
            self._skips.report(reason, key, why, self.skipped_values)
            return False
        add_histogram_raw(self._prefix + key, global_step=step, walltime=walltime, **summary)
        return True

    def _scalar(self, key: str, value: object) -> float | None:
        """``value`` as the float to write, or None (counted and reported) if it cannot be."""
        if (
            value.__class__ is float
            and key.isascii()
            and -FLOAT32_OVERFLOW < value < FLOAT32_OVERFLOW
        ):
            return value
        scalar, reason, why = float64_or_why(key, value, "TensorBoard")
        if scalar is not None and math.isfinite(scalar) and abs(scalar) >= FLOAT32_OVERFLOW:
            reason = "out_of_range"
            why = (
                f"Stat value {key!r} ({scalar:.4g}) is beyond the range of the 32-bit "
                "float TensorBoard stores a scalar as (it would read back as an infinity)"
            )
            scalar = None
        if scalar is not None and not is_utf8(key):
            scalar = None
            reason, why = "invalid_text", f"Stat key {key!r} is not valid UTF-8, so no tag"
        if scalar is None:
            self.skipped_values += 1
            self._skips.report(reason, key, why, self.skipped_values)
        return scalar

    def flush(self) -> None:
        """Flush the writer, if it has a ``flush`` method (the bus calls this after each batch)."""
        flush = getattr(self._writer, "flush", None)
        if callable(flush):
            flush()
