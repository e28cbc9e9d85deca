"""OpenTelemetry as a sink: Stat windows become gauge points (a window's Histogram an exponential
histogram point), other events log records.

Needs the ``otel`` extra (``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``);
both are imported when a handler is made, not when ``monitor_bus`` is.

Mapping
-------
- A ``STAT_EVENT`` (``"torch.monitor.Stat"``) sets one synchronous gauge per data key:
  ``{"step_time.mean": 0.25, "step_time.count": 4}`` sets the gauges ``step_time.mean`` and
  ``step_time.count``. One instrument per ``<stat>.<aggregation>``, not one per stat with an
  ``aggregation`` attribute, because the aggregations are not one quantity: summing or averaging
  ``mean`` with ``max`` and ``count`` across an attribute (what backends do by default) is
  meaningless, ``count`` is an integer where the others are floats, and the key is used as it
  was logged, with no guess about where a dotted stat name ends. A point's timestamp is the SDK's
  collection time, as the metrics data model has it for gauges.
- Distributions: a window's percentiles and stddev (``step_time.p99``, ``step_time.stddev``)
  are gauges like the rest. Its ``Histogram`` (``step_time.histogram``) is recorded on a
  histogram instrument of that name and reaches the readers as an ``ExponentialHistogram``
  point with the window's own scale, offsets and bucket counts, count, sum, min and max, not
  re-bucketed: the ``histogram_view()`` of the provider passes it through, the windows since
  the last collection (delta) or since the start (cumulative, the SDK's default for
  histograms) merged exactly by ``Histogram.merge``. The providers the handler makes have that
  view; give one you make ``views=[histogram_view(scope)]``, else its histograms are skipped
  and counted (the SDK's own exponential aggregation could only re-bucket samples one at a
  time, which a window no longer has). NaN and infinite samples, which no OTLP bucket holds
  (the SDK drops such measurements), are not in the point's count; ``sum``, ``min`` and
  ``max`` are the Histogram's.
- System metrics (``SystemMetrics``' ``system.*`` Stats) follow OpenTelemetry's semantic
  conventions (v1.44.0, the meter's schema URL says so): ``system.process_cpu_percent.mean``
  is ``process.cpu.utilization`` (unit ``1``, a fraction of the CPUs available),
  ``system.gpu0.memory_used_bytes.mean`` is ``hw.gpu.memory.usage`` (``By``) with
  ``hw.id="gpu0"``, the cumulative ``*_total`` Stats (``SystemMetrics(counters=True)``) are
  the counters ``process.cpu.time``, ``system.disk.io`` and ``system.network.io``, each an observable instrument of the
  convention's kind reporting its latest window. Their MAX and MIN and the ``*_per_s`` rates
  are not exported (``_semconv`` holds the table and says why).
- Any other event becomes one log record: ``event_name`` and ``body`` are the event's name,
  ``timestamp`` is the event's timestamp (nanoseconds, exact) and the data are its attributes.

Values OTLP cannot carry
------------------------
Each value is checked on its own; one that cannot be sent is skipped, counted, and the rest of
the event is sent (one bad value used to make every later export of all metrics fail):

- gauge values: a string; an int outside int64 (OTLP's ``as_int``); NaN or an infinity (the SDK
  drops those measurements). A bool is sent as 0 or 1. Counted in ``skipped_values``, as is a
  histogram on a provider without ``histogram_view()``.
- gauge names: a key that is not a valid instrument name once sanitized (over 255 characters, or
  colliding with another key's sanitized name) has no instrument. Counted in ``skipped_names``.
- log attributes: an int outside int64, or a string that is not valid UTF-8 (a lone surrogate,
  which protobuf cannot encode): counted in ``skipped_values``; a key that is not valid UTF-8:
  counted in ``skipped_names``. An event name that is not valid UTF-8 is sent with its lone
  surrogates as ``\\udXXXX`` escapes.

Each skip is logged as a warning on the ``monitor_bus`` logger, at most once per key and reason
every 10 seconds.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .._check import check_timeout
from .._event import Event
from .._handler import call_each
from .._histogram import Histogram
from .._lifecycle import module_lock
from .._skipped import INT64_MAX, INT64_MIN, SkipReporter, is_utf8
from .._window import STAT_EVENT
from . import _semconv

if TYPE_CHECKING:
    from opentelemetry._logs import Logger, LoggerProvider
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import View
    from opentelemetry.sdk.resources import Resource

logger = logging.getLogger("monitor_bus")

# Guards the handlers' instrument making (one handler may serve several buses). Module-level
# so that a forked child gets a new one: a thread of the parent may hold it at the fork.
_lock = module_lock(__name__, "_lock")

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# The API's instrument-name rule: a letter, then up to 254 of [-_./a-zA-Z0-9].
_NAME_OK = re.compile(r"[a-zA-Z][-_./a-zA-Z0-9]{0,254}")
_NAME_BAD_CHAR = re.compile(r"[^-_./a-zA-Z0-9]")


def make_resource(
    service_name: str | None = None,
    *,
    rank: int | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Resource:
    """The OpenTelemetry resource that identifies this process among many.

    Holds ``host.name``, ``process.pid`` and, where a launcher set them, ``rank``,
    ``local_rank``, ``world_size``, ``node_rank`` and ``job_id`` (torchrun's ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK`` and ``TORCHELASTIC_RUN_ID``, else Slurm's
    ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NODEID`` and
    ``SLURM_JOB_ID``; the ``rank`` argument overrides them), then ``attributes``. The SDK merges in
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` from the environment; explicit
    arguments win over both.

    Args:
        service_name: ``service.name``; if None, ``OTEL_SERVICE_NAME`` or the SDK's default.
        rank: the process's rank in a distributed job.
        attributes: more resource attributes; they override the ones above.

    Raises:
        TypeError: an argument has the wrong type (the message names it).
    """
    from opentelemetry.sdk.resources import Resource

    if service_name is not None and not isinstance(service_name, str):
        raise TypeError(f"service_name must be a str, not {type(service_name).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise TypeError(f"rank must be an int, not {type(rank).__name__}")
    if attributes is not None and not isinstance(attributes, Mapping):
        raise TypeError(f"attributes must be a mapping, not {type(attributes).__name__}")
    attrs: dict[str, Any] = {"host.name": socket.gethostname(), "process.pid": os.getpid()}
    attrs.update(_semconv.launcher_attributes())
    if rank is not None:
        attrs["rank"] = rank
    if service_name is not None:
        attrs["service.name"] = service_name
    attrs.update(attributes or {})
    return Resource.create(attrs)


def _unix_nanos(ts: datetime) -> int:
    """Nanoseconds since the epoch, exactly (a naive timestamp is local time, as in torch)."""
    delta = (ts if ts.tzinfo is not None else ts.astimezone()) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


def _instrument_name(key: str) -> str | None:
    """``key`` as a valid instrument name, or None if it cannot be one."""
    if _NAME_OK.fullmatch(key):
        return key
    name = _NAME_BAD_CHAR.sub("_", key)
    if not name[:1].isalpha():
        name = "_" + name if name else "_"
        name = "m" + name
    return name if _NAME_OK.fullmatch(name) else None


class OpenTelemetryEventHandler:
    """Send events to OpenTelemetry: Stat windows as gauges, other events as log records.

    Register it like any handler; it runs on its own thread of the bus and only hands data to
    the SDK, whose readers and processors export on threads of their own. A slow or unreachable
    endpoint therefore never blocks ``log_event`` nor ``bus.flush()``: the SDK retries with
    backoff up to its exporter timeout and then drops that batch, logging the failure on its own
    loggers (``opentelemetry.*``).

    Providers you pass are used as they are (their resource, readers and exporters are yours,
    OTLP over HTTP or gRPC alike). For a provider left as None the handler makes one with
    ``resource`` (default ``make_resource(service_name)``) and an OTLP/HTTP exporter: to
    ``endpoint`` if given (``/v1/metrics`` and ``/v1/logs`` are appended), else wherever the
    standard ``OTEL_EXPORTER_OTLP_*`` environment variables say (``http://localhost:4318`` by
    default). Metrics are exported every ``export_interval`` seconds, logs in batches.

    The handler deliberately has no ``flush()`` method (the bus would call it after every
    batch, making each batch wait on the network); call ``force_flush()`` yourself before the
    process ends, or ``shutdown()``.

    Args:
        meter_provider: where gauge points go.
        logger_provider: where log records go.
        resource: for the providers the handler makes.
        service_name: ``service.name`` of the default resource.
        endpoint: base URL of an OTLP/HTTP receiver, for the providers the handler makes.
        export_interval: seconds between metric exports, for the provider the handler makes.
        scope: the instrumentation scope name of the meter and the logger.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).
        ImportError: the OpenTelemetry SDK is not installed (``pip install monitor_bus[otel]``).

    Examples:
        >>> import monitor_bus as monitor
        >>> from monitor_bus.exporters.otel import OpenTelemetryEventHandler
        >>> otel = OpenTelemetryEventHandler(service_name="trainer", endpoint="http://collector:4318")
        >>> monitor.register_event_handler(otel, name="otel")  # doctest: +SKIP
    """

    def __init__(
        self,
        meter_provider: MeterProvider | None = None,
        logger_provider: LoggerProvider | None = None,
        *,
        resource: Resource | None = None,
        service_name: str | None = None,
        endpoint: str | None = None,
        export_interval: float = 10.0,
        scope: str = "monitor_bus",
    ) -> None:
        if endpoint is not None and not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, not {type(endpoint).__name__}")
        if isinstance(export_interval, bool) or not isinstance(export_interval, (int, float)):
            raise TypeError(
                f"export_interval must be a number of seconds, not {type(export_interval).__name__}"
            )
        if not export_interval > 0:
            raise ValueError(f"export_interval must be > 0, got {export_interval}")
        if not isinstance(scope, str):
            raise TypeError(f"scope must be a str, not {type(scope).__name__}")
        if (
            meter_provider is not None
            and logger_provider is not None
            and (resource is not None or service_name is not None or endpoint is not None)
        ):
            raise ValueError(
                "resource, service_name and endpoint configure the providers the handler makes; "
                "both meter_provider and logger_provider were given, so set them on those"
            )
        if resource is None and (meter_provider is None or logger_provider is None):
            resource = make_resource(service_name)
        self._owned: list[Any] = []
        if meter_provider is None:
            meter_provider = self._make_meter_provider(resource, endpoint, export_interval, scope)
            self._owned.append(meter_provider)
        if logger_provider is None:
            logger_provider = self._make_logger_provider(resource, endpoint)
            self._owned.append(logger_provider)
        self.meter_provider = meter_provider
        self.logger_provider = logger_provider
        self._meter = meter_provider.get_meter(scope)
        # The system metrics' meter names the conventions' version.
        self._system_meter = meter_provider.get_meter(scope, schema_url=_semconv.SCHEMA_URL)
        # convention name -> {attributes: the latest value}, read by its instrument's callback
        self._conventional: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._logger: Logger = logger_provider.get_logger(scope)
        from opentelemetry._logs import LogRecord

        self._log_record = LogRecord
        self._gauges: dict[str, Any] = {}  # event key -> gauge, or None when skipped
        # event key -> histogram instrument, None (no name) or _NO_VIEW (no histogram_view)
        self._histograms: dict[str, Any] = {}
        self._names: dict[str, str] = {}  # instrument name -> the key that owns it
        self._no_name: dict[str, str] = {}  # key without an instrument -> why
        self._skips = SkipReporter("OpenTelemetryEventHandler")
        #: Values skipped because OTLP cannot carry them: in Stat events strings, ints outside
        #: int64 and non-finite floats; in log records ints outside int64 and non-UTF-8 strings.
        self.skipped_values = 0
        #: Values skipped for their key: a Stat key that cannot be an instrument name, a log
        #: attribute key that is not valid UTF-8.
        self.skipped_names = 0

    @staticmethod
    def _make_meter_provider(
        resource: Any, endpoint: str | None, interval: float, scope: str
    ) -> Any:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        exporter = OTLPMetricExporter(endpoint=_signal_url(endpoint, "metrics"))
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval * 1000)
        views = [histogram_view(scope)]
        return MeterProvider(resource=resource, metric_readers=[reader], views=views)

    @staticmethod
    def _make_logger_provider(resource: Any, endpoint: str | None) -> Any:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

        provider = LoggerProvider(resource=resource)
        provider.add_log_record_processor(
            BatchLogRecordProcessor(OTLPLogExporter(endpoint=_signal_url(endpoint, "logs")))
        )
        return provider

    def __call__(self, event: Event) -> None:
        if event.name == STAT_EVENT:
            self._set_gauges(event)
        else:
            self._emit_log(event)

    def handle_batch(self, events: list[Event]) -> None:
        """Stat windows to gauges, other events to log records (the bus's batch call)."""
        call_each(events, self)

    def _set_gauges(self, event: Event) -> None:
        gauges = self._gauges
        for key, value in event.data.items():
            if isinstance(value, Histogram):  # a window's (data_value_t is torch's alias)
                self._record_histogram(key, value)
                continue
            problem = _gauge_problem(value)
            if problem is not None:
                self._skip_value(problem[0], key, f"Stat value {key!r} {problem[1]}")
                continue
            if key.startswith("system."):
                point = _semconv.convert(key, float(value))
                if isinstance(point, _semconv.Point):
                    self._observe(point)
                    continue
                if point is None:  # a known system metric's, not exported (_semconv)
                    continue
            gauge = gauges.get(key, _MISSING)
            if gauge is _MISSING:
                gauge = self._make_instrument(key, gauges, self._meter.create_gauge)
            if gauge is None:
                self.skipped_names += 1
                self._skips.report("no_name", key, self._no_name[key], self.skipped_names)
            else:
                gauge.set(int(value) if value.__class__ is bool else value)

    def _observe(self, point: _semconv.Point) -> None:
        """Hold ``point`` as its convention's latest value, making its instrument once."""
        convention = point.convention
        with _lock:
            values = self._conventional.get(convention.name)
            new = values is None
            if values is None:
                values = self._conventional[convention.name] = {}
            values[point.attributes] = point.value
        if new:  # outside the lock, which the instrument's callback takes while collecting
            self._make_observable(convention, values)

    def _make_observable(
        self, convention: _semconv.Convention, values: dict[tuple[tuple[str, str], ...], float]
    ) -> None:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> list[Any]:
            with _lock:
                held = list(values.items())
            return [Observation(value, dict(attributes)) for attributes, value in held]

        meter = self._system_meter
        create = {
            "gauge": meter.create_observable_gauge,
            "counter": meter.create_observable_counter,
            "updowncounter": meter.create_observable_up_down_counter,
        }[convention.kind]
        create(convention.name, [observe], convention.unit, convention.description)

    def _skip_value(self, reason: str, key: object, message: str) -> None:
        self.skipped_values += 1
        self._skips.report(reason, key, message, self.skipped_values)

    def _make_instrument(
        self, key: str, instruments: dict[str, Any], create: Callable[[str], Any]
    ) -> Any:
        """The instrument of ``key`` in ``instruments``, made by ``create`` (a gauge or a
        histogram) on first use; None if ``key`` cannot have one (``_no_name`` says why)."""
        with _lock:  # one handler object may serve several buses
            if key in instruments:
                return instruments[key]
            name = _instrument_name(key)
            owner = self._names.get(name) if name is not None else None
            instrument = None
            if name is None:
                self._no_name[key] = f"Stat key {key!r} cannot be an instrument name"
            elif owner is not None:
                self._no_name[key] = f"Stat key {key!r} sanitizes to {name!r} like {owner!r}"
            else:
                self._names[name] = key
                instrument = create(name)
            instruments[key] = instrument
            return instrument

    def _record_histogram(self, key: str, value: Histogram) -> None:
        """Record a window's histogram, to reach the readers as it is (``histogram_view``)."""
        histogram = self._histograms.get(key, _MISSING)
        if histogram is _MISSING:
            histogram = self._make_instrument(key, self._histograms, self._meter.create_histogram)
            if histogram is not None and not _passes_through(self.meter_provider, histogram):
                self._histograms[key] = histogram = _NO_VIEW
        if histogram is None:
            self.skipped_names += 1
            self._skips.report("no_name", key, self._no_name[key], self.skipped_names)
        elif histogram is _NO_VIEW:
            self._skip_value(
                "no_histogram_view",
                key,
                f"Stat value {key!r} is a histogram and the meter provider has no "
                "histogram_view() for it (MeterProvider(views=[histogram_view(scope)], ...))",
            )
        else:
            from ._otel_histogram import HistogramMeasurement

            histogram.record(HistogramMeasurement(value))

    def _emit_log(self, event: Event) -> None:
        from opentelemetry._logs import SeverityNumber

        name = event.name
        if not is_utf8(name):
            name = name.encode("utf-8", "backslashreplace").decode("utf-8")
        data = event.data
        for key, value in data.items():
            if not _attribute_ok(key, value):
                data = self._attributes(event)
                break
        self._logger.emit(
            self._log_record(
                timestamp=_unix_nanos(event.timestamp),
                observed_timestamp=time.time_ns(),
                severity_number=SeverityNumber.INFO,
                severity_text="INFO",
                body=name,
                attributes=data,
                event_name=name,
            )
        )

    def _attributes(self, event: Event) -> dict[str, Any]:
        """The event's data without what OTLP cannot carry, each skip counted and reported."""
        kept: dict[str, Any] = {}
        for key, value in event.data.items():
            where = f"data[{key!r}] of event {event.name!r}"
            if not is_utf8(key):
                self.skipped_names += 1
                self._skips.report(
                    "invalid_text",
                    (event.name, key),
                    f"data key {key!r} of event {event.name!r} is not valid UTF-8",
                    self.skipped_names,
                )
            elif value.__class__ is int and not INT64_MIN <= value <= INT64_MAX:
                self._skip_value(
                    "out_of_range", (event.name, key), f"{where} is an int outside int64"
                )
            elif isinstance(value, str) and not is_utf8(value):
                self._skip_value("invalid_text", (event.name, key), f"{where} is not valid UTF-8")
            else:
                kept[key] = value
        return kept

    def force_flush(self, timeout: float | None = None) -> bool:
        """Export what the providers hold now; True if done within ``timeout`` seconds.

        Runs on a helper thread, because the SDK's batch log processor ignores its own timeout
        while an export hangs; after a False return the flush goes on in the background. True
        means the SDK is done trying: a batch it dropped after its retries (logged by the SDK)
        still counts as flushed. Thread-safe. ``timeout`` None or ``math.inf``: no limit.
        """
        timeout = check_timeout("timeout", timeout)
        # The SDK takes whole milliseconds; "no limit" is the largest it surely handles.
        millis = _NO_LIMIT_MS if timeout is None else max(int(timeout * 1000), 1)
        providers = (self.meter_provider, self.logger_provider)

        def run() -> bool:
            ok = True
            for provider in providers:  # the API's no-op providers have no force_flush
                flush = getattr(provider, "force_flush", None)
                if flush is not None:
                    ok = bool(flush(millis)) and ok
            return ok

        return _bounded(run, timeout)

    def shutdown(self, timeout: float | None = 30.0) -> bool:
        """Flush, then shut down the providers this handler made (never ones passed in).

        Unregister the handler first. Like ``force_flush``, waits at most ``timeout`` seconds
        (None or ``math.inf``: no limit).

        Returns:
            True if everything was exported and shut down in time.
        """
        timeout = check_timeout("timeout", timeout)
        owned, self._owned = self._owned, []
        if not owned:
            return self.force_flush(timeout)

        def run() -> bool:
            ok = True
            for provider in owned:  # shutdown flushes first
                ok = provider.shutdown() is not False and ok
            return ok

        return _bounded(run, timeout)


_NO_LIMIT_MS = 2**31 - 1


def _bounded(func: Callable[[], bool], timeout: float | None) -> bool:
    """``func()`` on a daemon thread; its result, or False if it is not done in ``timeout`` s."""
    results: list[bool] = []
    done = threading.Event()

    def run() -> None:
        try:
            results.append(func())
        except Exception:
            logger.exception("OpenTelemetryEventHandler: flush or shutdown failed")
            results.append(False)
        finally:
            done.set()

    threading.Thread(target=run, name="monitor_bus-otel-flush", daemon=True).start()
    return done.wait(timeout) and all(results)


_MISSING: Any = object()
_NO_VIEW: Any = object()  # a histogram instrument no histogram_view() passes through


def histogram_view(scope: str = "monitor_bus") -> View:
    """The view that lets a ``MeterProvider`` you make carry the handler's histograms.

    Pass it to the provider whose meter the handler uses (``MeterProvider(views=[
    histogram_view()], ...)``; the providers the handler makes have it): each window's
    ``<stat>.histogram`` then reaches the readers as an ``ExponentialHistogram`` point with
    the window's own scale, offsets, bucket counts, count, sum, min and max (the windows since
    the last collection merged exactly, by ``Histogram.merge``; with cumulative temporality
    every window since the start). Without it, the SDK could only re-bucket samples one at a
    time, so the handler skips and counts histograms instead.

    Args:
        scope: the handler's ``scope``, the meter name the view matches.

    Raises:
        TypeError: ``scope`` is not a str.
        ImportError: the OpenTelemetry SDK is not installed.
    """
    from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
    from opentelemetry.sdk.metrics.view import View

    from ._otel_histogram import WindowHistogramAggregation

    if not isinstance(scope, str):
        raise TypeError(f"scope must be a str, not {type(scope).__name__}")
    return View(
        instrument_type=HistogramInstrument,
        meter_name=scope,
        aggregation=WindowHistogramAggregation(),
    )


def _passes_through(meter_provider: Any, instrument: Any) -> bool:
    """Whether a ``histogram_view()`` of ``meter_provider`` matches ``instrument`` (an SDK
    provider's views are only readable through its private configuration)."""
    views = getattr(getattr(meter_provider, "_sdk_config", None), "views", None)
    if not views:
        return False
    from ._otel_histogram import WindowHistogramAggregation

    return any(
        isinstance(getattr(view, "_aggregation", None), WindowHistogramAggregation)
        and view._match(instrument)
        for view in views
    )


def _gauge_problem(value: object) -> tuple[str, str] | None:
    """Why a gauge point cannot hold ``value`` (reason, description), or None if it can."""
    if value.__class__ is float:
        if math.isfinite(value):
            return None
        return "non_finite", f"is not finite ({value!r}); the SDK drops those"
    if value.__class__ is int:
        if INT64_MIN <= value <= INT64_MAX:
            return None
        return "out_of_range", "is an int outside int64"
    if isinstance(value, str):
        return "string_value", "is a string; gauges hold numbers"
    return None  # a bool: sent as 0 or 1


def _attribute_ok(key: str, value: object) -> bool:
    """True if OTLP can carry ``key: value`` as a log attribute (the common case, checked fast)."""
    if not is_utf8(key):
        return False
    if value.__class__ is int:
        return INT64_MIN <= value <= INT64_MAX
    if value.__class__ is str:
        return is_utf8(value)
    return True


def _signal_url(endpoint: str | None, signal: str) -> str | None:
    return None if endpoint is None else f"{endpoint.rstrip('/')}/v1/{signal}"
