"""Prometheus as a sink: Stat windows become gauges in a ``prometheus_client`` registry.

Needs the ``prometheus`` extra (``prometheus_client``), imported when a handler is made.

Each key of a ``STAT_EVENT`` becomes the gauge ``<namespace>_<key>`` with every character
outside ``[a-zA-Z0-9_:]`` replaced by ``_``: ``step_time.mean`` is
``monitor_bus_step_time_mean``. Two aggregations are renamed, as Prometheus reserves their
suffixes for histograms and summaries (``promtool check metrics`` refuses a gauge named so):
a window's COUNT is ``<namespace>_<stat>_samples`` and its SUM
``<namespace>_<stat>_sum_of_samples``. Values are float64: bools are 0 or 1, NaN and infinities are
exported as such. Prometheus stores no strings and stamps samples with the scrape time, so string
values (and ints beyond float64's range) are skipped and counted, and the event's timestamp is not
exported. Other events are ignored, as ``torch.monitor``'s TensorBoard handler does.

Distributions: a window's percentiles and stddev (``step_time.p99``) are gauges like the rest.
Its ``Histogram`` (``step_time.histogram``) makes the histogram ``<namespace>_<stat>``
(``monitor_bus_step_time``: its ``_bucket``, ``_count`` and ``_sum`` series), holding every window so far merged exactly (``Histogram.merge``), since
Prometheus histograms are cumulative and queried with ``rate()`` and ``histogram_quantile``. Its
``le`` bounds stay once exposed, as Prometheus classic histograms need: they lie on a fixed
grid, ``0`` and ``±2**k`` (the exponential layout's edges at scale 0), and each window adds the
grid bound at or above each of its non-empty buckets, lowest first, until there are
``MAX_LE_BUCKETS`` (64) besides ``+Inf``; after that no bound is added or dropped, and samples
past them count at the outermost bound above them, or at ``+Inf`` only. Each bound counts
exactly the samples at or below it, so a bound's series only grows; ``-inf`` samples count at
every bound, ``+inf`` and NaN at ``+Inf`` only (which is the count). A negative sample exactly
on a bound counts at the next bound up (a negative bucket holds ``[-upper, -lower)``), as does a
bucket a bound cuts in a Histogram coarser than scale 0 (only one made with a small
``max_buckets``). With a negative sample there are no ``_count`` and ``_sum`` series
(OpenMetrics: a sum that can fall is no counter; ``prometheus_client`` leaves them out);
``+Inf`` still counts every sample.

System metrics (``SystemMetrics``' ``system.*`` Stats) follow OpenTelemetry's semantic
conventions (v1.44.0), under the names OpenTelemetry's Prometheus compatibility gives them,
without the namespace, so dashboards built on those conventions read them:
``process_cpu_utilization_ratio``, ``process_cpu_time_seconds_total``,
``process_memory_usage_bytes``, ``system_cpu_utilization_ratio``,
``system_memory_utilization_ratio``, ``system_disk_io_bytes_total{disk_io_direction}``,
``system_network_io_bytes_total{network_io_direction}``, ``hw_gpu_utilization_ratio{hw_id}``,
``hw_gpu_memory_usage_bytes{hw_id}``, ``hw_power_watts`` and ``hw_temperature_celsius``
(``_semconv`` holds the table, and why a window's MAX and MIN are not among them). Where a
launcher set them, the process's rank, local rank, world size, node rank and job id are the
labels of ``target_info`` (value 1), as OpenTelemetry exposes resource attributes.
"""

from __future__ import annotations

import errno
import math
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._event import Event
from .._handler import call_each
from .._histogram import Histogram
from .._lifecycle import module_lock
from .._skipped import SkipReporter, float64_or_why, is_utf8
from .._window import STAT_EVENT
from . import _semconv

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# Guards the handlers' metric making and the histograms' windows (one handler may serve
# several buses). Module-level so that a forked child gets a new one: a thread of the parent
# (another bus's sinks, a scrape) may hold it at the fork.
_lock = module_lock(__name__, "_lock")

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_BAD_CHAR = re.compile(r"[^a-zA-Z0-9_:]")


# Aggregations whose suffix Prometheus reserves: the key's ending -> the name's.
_RENAMED = ((".count", "_samples"), (".sum", "_sum_of_samples"), (".histogram", ""))


def metric_name(namespace: str, key: str) -> str:
    """The metric name for ``key``: ``<namespace>_<key>`` with invalid characters as ``_``,
    a window's count, sum and histogram renamed (module docs).

    Examples:
        >>> metric_name("monitor_bus", "step_time.mean")
        'monitor_bus_step_time_mean'
        >>> metric_name("monitor_bus", "step_time.count")
        'monitor_bus_step_time_samples'
        >>> metric_name("monitor_bus", "step_time.histogram")
        'monitor_bus_step_time'
    """
    for ending, renamed in _RENAMED:
        if key.endswith(ending) and len(key) > len(ending):
            key = key[: -len(ending)] + renamed
            break
    name = _BAD_CHAR.sub("_", f"{namespace}_{key}" if namespace else key)
    return name if _METRIC_NAME.fullmatch(name) else f"_{name}"


class PrometheusEventHandler:
    """Keep the latest value of every Stat aggregate as a Prometheus gauge.

    The gauges live in ``registry``: by default a fresh ``CollectorRegistry`` of this handler,
    not ``prometheus_client``'s global ``REGISTRY``, so two handlers (or a test) never collide;
    pass ``prometheus_client.REGISTRY`` to expose them beside your other metrics. Serve the
    registry with ``serve()`` or any ``prometheus_client`` exposition.

    Values a gauge cannot hold are skipped, counted and the rest of the event is set, never
    raised: ``skipped_values`` (strings, and ints beyond float64's range) and ``skipped_names``
    (keys whose sanitized name is taken, by another key or by another metric of the registry;
    the system metrics, whose names have no namespace, of a second handler on one registry),
    also exported as ``<namespace>_skipped_total{reason=...}`` with the reasons
    ``"string_value"``, ``"out_of_range"`` and ``"name_taken"``. A skipped value makes no series.
    Each skip is logged as a warning on the ``monitor_bus`` logger, at most once per key and
    reason every 10 seconds.

    Args:
        registry: where the gauges are registered; None makes a fresh ``CollectorRegistry``.
        namespace: prefix of every metric name (``""`` for none).
        labels: constant labels on every gauge, e.g. ``{"rank": "0"}`` when several ranks of
            one host are scraped as one target.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).
        ImportError: ``prometheus_client`` is not installed (``pip install monitor_bus[prometheus]``).

    Examples:
        >>> import monitor_bus as monitor
        >>> from monitor_bus.exporters.prometheus import PrometheusEventHandler
        >>> prom = PrometheusEventHandler(labels={"rank": "0"})
        >>> server = prom.serve(9464)  # doctest: +SKIP
        >>> monitor.register_event_handler(prom, name="prometheus")  # doctest: +SKIP
    """

    # Shares the bus's runner with the other bundled sinks (``_runner``): one wake-up per batch.
    _monitor_bus_bundled = True

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "monitor_bus",
        *,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter

        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
        elif not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a CollectorRegistry, not {type(registry).__name__}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        if namespace and not _METRIC_NAME.fullmatch(namespace):
            raise ValueError(f"namespace must match [a-zA-Z_:][a-zA-Z0-9_:]*, got {namespace!r}")
        labels = dict(labels or {})
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL_NAME.fullmatch(key) or key.startswith("__"):
                raise ValueError(f"labels: {key!r} is not a valid Prometheus label name")
            if key == "reason":
                raise ValueError("labels: 'reason' is taken by the handler's skipped counter")
            if not isinstance(value, str):
                raise TypeError(f"labels[{key!r}] must be a str, not {type(value).__name__}")
            if not is_utf8(value):  # the exposition could never be encoded
                raise ValueError(f"labels[{key!r}] is not valid UTF-8: {value!r}")
        self.registry = registry
        self.namespace = namespace
        self._labels = labels
        self._gauges: dict[str, Any] = {}  # event key -> labelled gauge child, or None if skipped
        self._histograms: dict[str, Any] = {}  # event key -> _HistogramCollector, or None

        self._names: dict[str, str] = {}  # metric name -> the key that owns it
        self._taken: dict[str, str] = {}  # skipped key -> why its name is taken
        self._skips = SkipReporter("PrometheusEventHandler")
        #: Values skipped because a gauge cannot hold them: strings, ints beyond float64.
        self.skipped_values = 0
        #: Values skipped because their key's metric name was taken.
        self.skipped_names = 0
        skipped = Counter(
            "skipped",
            "Stat values the Prometheus exporter could not hold, by reason",
            ["reason", *labels],
            namespace=namespace,
            registry=registry,
        )
        self._skipped_string = skipped.labels(reason="string_value", **labels)
        self._skipped_range = skipped.labels(reason="out_of_range", **labels)
        self._skipped_name = skipped.labels(reason="name_taken", **labels)
        # The system metrics' names are not namespaced: a second handler on this registry
        # finds them taken, and skips (and counts) its system metrics, the same process's.
        self._system: _SystemCollector | None = _SystemCollector(labels)
        try:
            registry.register(self._system)
        except ValueError as exc:
            self._system = None
            self._taken_system = f"the system metrics' names are taken in the registry ({exc})"
        target = {k: str(v) for k, v in _semconv.launcher_attributes().items() if k not in labels}
        if target and self._system is not None:
            from prometheus_client import Info

            info = Info("target", "The process's place in its job", list(labels), registry=registry)
            (info.labels(**labels) if labels else info).info(target)

    def __call__(self, event: Event) -> None:
        if event.name == STAT_EVENT:
            self._set_gauges(event)

    def handle_batch(self, events: list[Event]) -> None:
        """Set the gauges of the Stat windows among ``events`` (the bus's batch call)."""
        windows = [event for event in events if event.name == STAT_EVENT]
        if windows:
            call_each(windows, self._set_gauges)

    def _set_gauges(self, event: Event) -> None:
        gauges = self._gauges
        for key, value in event.data.items():
            if isinstance(value, Histogram):  # a window's (data_value_t is torch's alias)
                self._add_histogram(key, value)
                continue
            # The value first: a gauge made for a value it cannot hold would export a phantom 0.
            if value.__class__ is float:
                number: float | None = value
            else:
                number, reason, why = float64_or_why(key, value, "Prometheus")
            if number is None:
                self._skip_value(reason, key, why)
                continue
            if key.startswith("system."):
                point = _semconv.convert(key, number)
                if isinstance(point, _semconv.Point):
                    if self._system is not None:
                        self._system.set(point)
                    else:
                        self._taken.setdefault(key, self._taken_system)
                        self._skip_name(key)
                    continue
                if point is None:  # a known system metric's, not exported (_semconv)
                    continue
            gauge = gauges.get(key, _MISSING)
            if gauge is _MISSING:
                gauge = self._make_metric(key, gauges, self._new_gauge)
            if gauge is None:
                self._skip_name(key)
            else:
                gauge.set(number)

    def _add_histogram(self, key: str, value: Histogram) -> None:
        histogram = self._histograms.get(key, _MISSING)
        if histogram is _MISSING:
            histogram = self._make_metric(key, self._histograms, self._new_histogram)
        if histogram is None:
            self._skip_name(key)
        else:
            histogram.add(value)

    def _new_histogram(self, name: str, help_text: str) -> _HistogramCollector:
        collector = _HistogramCollector(name, help_text, self._labels)
        self.registry.register(collector)
        return collector

    def _skip_name(self, key: str) -> None:
        self.skipped_names += 1
        self._skipped_name.inc()
        self._skips.report("name_taken", key, self._taken[key], self.skipped_names)

    def _skip_value(self, reason: str, key: str, why: str) -> None:
        self.skipped_values += 1
        (self._skipped_string if reason == "string_value" else self._skipped_range).inc()
        self._skips.report(reason, key, why, self.skipped_values)

    def _make_metric(
        self, key: str, metrics: dict[str, Any], create: Callable[[str, str], Any]
    ) -> Any:
        """The metric of ``key`` in ``metrics``, made on first use by ``create(name, help)``
        (a ``ValueError`` if the registry has the name); None if its name is taken
        (``_taken`` says why)."""
        with _lock:  # one handler object may serve several buses
            if key in metrics:
                return metrics[key]
            name = metric_name(self.namespace, key)
            owner = self._names.get(name)
            metric = None
            if owner is not None:
                owner = f"by Stat key {owner!r}"
            else:
                # The key as repr in the help text: it escapes a lone surrogate, which would
                # make every later scrape fail to encode.
                help_text = f"monitor_bus Stat {key if is_utf8(key) else repr(key)}"
                try:
                    metric = create(name, help_text)
                except ValueError as exc:  # the registry already has a metric of that name
                    owner = f"in the registry ({exc})"
                else:
                    self._names[name] = key
            if metric is None:
                self._taken[key] = f"Stat key {key!r} maps to {name!r}, which is taken {owner}"
            metrics[key] = metric
            return metric

    def _new_gauge(self, name: str, help_text: str) -> Any:
        from prometheus_client import Gauge

        parent = Gauge(name, help_text, list(self._labels), registry=self.registry)
        return parent.labels(**self._labels) if self._labels else parent

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve this handler's registry over HTTP; see ``serve``."""
        return serve(port, addr, registry=self.registry)


_MISSING: Any = object()

#: The most ``le`` bounds (besides ``+Inf``) a histogram is exposed with. Bounds are only ever
#: added, so past this many the histogram keeps the ones it has.
MAX_LE_BUCKETS = 64


class _HistogramCollector:
    """One Stat key's histogram: every window added so far, merged exactly, collected as a
    Prometheus histogram (cumulative, as Prometheus histograms are). Thread-safe."""

    def __init__(self, name: str, help_text: str, labels: dict[str, str]) -> None:
        self._name = name
        self._help = help_text
        self._labels = labels
        self._bounds = LeBounds()

    def add(self, histogram: Histogram) -> None:
        with _lock:
            self._bounds.add(histogram)

    def describe(self) -> list[Any]:
        return [self._family()]

    def collect(self) -> list[Any]:
        family = self._family()
        total, buckets = self._bounds.read()
        if total is not None:
            family.add_metric(list(self._labels.values()), buckets=buckets, sum_value=total.sum)
        return [family]

    def _family(self) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        return HistogramMetricFamily(self._name, self._help, labels=list(self._labels))


class _SystemCollector:
    """The system metrics under the semantic conventions' names: each convention's latest
    value per attribute set, collected as a gauge or a counter family. Thread-safe."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}

    def set(self, point: _semconv.Point) -> None:
        with _lock:
            values = self._values.setdefault(point.convention.name, {})
            values[point.attributes] = point.value

    def describe(self) -> list[Any]:
        # Every convention's name, so the registry holds them from the start.
        return [self._family(c, ()) for c in _semconv.CONVENTIONS.values()]

    def collect(self) -> list[Any]:
        with _lock:
            held = {name: list(values.items()) for name, values in self._values.items()}
        families = []
        for name, values in held.items():
            convention = _semconv.CONVENTIONS[name]
            keys = tuple(key for key, _ in values[0][0])  # one attribute set per convention
            family = self._family(convention, keys)
            for attributes, value in values:
                family.add_metric([*self._labels.values(), *(v for _, v in attributes)], value)
            families.append(family)
        return families

    def _family(self, convention: _semconv.Convention, keys: tuple[str, ...]) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        name = _semconv.prometheus_name(convention)
        labels = [*self._labels, *(key.replace(".", "_") for key in keys)]
        help_text = f"{convention.description} (OpenTelemetry's {convention.name})"
        if convention.kind == "counter":
            return CounterMetricFamily(name, help_text, labels=labels)
        return GaugeMetricFamily(name, help_text, labels=labels)


class LeBounds:
    """The ``le`` bounds of one Prometheus histogram and the samples at or below each, over
    every window added so far.

    The bounds stay once added and lie on a fixed grid, ``0`` and ``±2**k``: bucket edges of
    every Histogram of scale 0 or finer, so a bound's count is exact there (the module
    docstring says how bounds are chosen and where samples past them count).

    Args:
        max_buckets: the most bounds besides ``+Inf``.
    """

    def __init__(self, max_buckets: int = MAX_LE_BUCKETS) -> None:
        self._max = max_buckets
        # (every window merged, bound -> samples at or below it): one tuple, replaced whole,
        # so a reader (or a Ctrl-C in add) never sees one updated without the other.
        self._state: tuple[Histogram | None, dict[float, int]] = (None, {})

    def add(self, window: Histogram) -> None:
        """Count ``window``'s samples at every bound, adding the grid bounds it brings."""
        total, counts = self._state
        total = window if total is None else total.merge(window)
        room = self._max - len(counts)
        new = [b for b in grid_bounds(window) if b not in counts][: max(room, 0)]
        old = sorted(counts)
        updated = {b: counts[b] + n for b, n in zip(old, at_or_below(window, old), strict=True)}
        # A new bound counts the earlier windows too: the total holds them exactly.
        updated.update(zip(new, at_or_below(total, new), strict=True))
        self._state = (total, updated)

    def read(self) -> tuple[Histogram | None, list[tuple[str, int]]]:
        """Every window merged (None before the first) and the ``le`` buckets: (bound,
        samples at or below it), ascending, then ``("+Inf", count)``."""
        from prometheus_client.utils import floatToGoString

        total, counts = self._state
        if total is None:
            return None, []
        out = [(floatToGoString(b), counts[b]) for b in sorted(counts)]  # type: ignore[no-untyped-call]
        out.append(("+Inf", total.count))
        return total, out


def grid_bounds(histogram: Histogram) -> list[float]:
    """The grid bounds (``0``, ``±2**k``) at or above the upper edge of each non-empty
    finite bucket of ``histogram``, ascending, each once."""
    out: list[float] = []
    for _, upper, _ in histogram.buckets():
        if not math.isfinite(upper):  # past the float range, and +-inf: +Inf holds them
            continue
        if upper == 0.0:
            grid = 0.0
        else:
            mantissa, exponent = math.frexp(abs(upper))  # abs(upper) = mantissa * 2**exponent
            if upper > 0:  # the power of two at or above it
                grid = math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)
            else:  # the negated power of two at or below its magnitude
                grid = -math.ldexp(1.0, exponent - 1)
        if not out or out[-1] != grid:
            out.append(grid)
    return out


def at_or_below(histogram: Histogram, bounds: list[float]) -> list[int]:
    """For each of the ascending ``bounds``, the samples of ``histogram`` in buckets wholly
    at or below it (``-inf`` at every bound, ``+inf`` and NaN at none)."""
    out: list[int] = []
    buckets = histogram.buckets()
    i = below = 0
    for b in bounds:
        while i < len(buckets) and buckets[i][1] <= b:
            below += buckets[i][2]
            i += 1
        out.append(below)
    return out


def le_buckets(histogram: Histogram, max_buckets: int = MAX_LE_BUCKETS) -> list[tuple[str, int]]:
    """``histogram`` as the ``le`` buckets of a Prometheus histogram's first scrape (see
    ``LeBounds``): (bound, samples at or below it), ascending, then ``("+Inf", count)``."""
    bounds = LeBounds(max_buckets)
    bounds.add(histogram)
    return bounds.read()[1]


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` (or ``with``) stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        #: The address it listens on.
        self.addr: str = server.server_address[0]
        #: The port it listens on (the chosen one when ``serve(0)`` was asked).
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        """The URL Prometheus should scrape."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url}>"


def serve(port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry) -> MetricsServer:
    """Expose ``registry`` for Prometheus at ``http://addr:port/metrics`` on a daemon thread.

    Binds the loopback interface by default, so only the local host can scrape it: pass
    ``addr="0.0.0.0"`` (or the host's address) for a Prometheus server on another machine, and
    mind who else can reach the port then.

    Args:
        port: TCP port; 0 picks a free one (read it from the result's ``port``).
        addr: address to bind.
        registry: what to expose.

    Raises:
        TypeError, ValueError: ``port`` is not an int in 0..65535.
        OSError: the port cannot be bound; the message names the address and the port.
    """
    from prometheus_client import start_http_server

    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, not {type(port).__name__}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if not isinstance(addr, str):
        raise TypeError(f"addr must be a str, not {type(addr).__name__}")
    try:
        server, thread = start_http_server(port, addr, registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                exc.errno,
                f"cannot serve Prometheus metrics on {addr}:{port}: port {port} is already in use",
            ) from exc
        raise OSError(
            exc.errno, f"cannot serve Prometheus metrics on {addr}:{port}: {exc.strerror or exc}"
        ) from exc
    return MetricsServer(server, thread)
