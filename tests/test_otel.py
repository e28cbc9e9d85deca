"""OpenTelemetryEventHandler on the real SDK: in-memory reader and exporter, then OTLP/HTTP to a
local receiver that decodes the payload with the official opentelemetry-proto messages."""

from __future__ import annotations

import gzip
import math
import os
import select
import signal
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import monitor_bus
from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Histogram, Stat

from .conftest import IN_CI, WINDOW_SAMPLES, distribution_window, real_window

if not IN_CI:  # in CI the import below fails instead
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2  # noqa: E402
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2  # noqa: E402
from opentelemetry.sdk._logs import LoggerProvider  # noqa: E402
from opentelemetry.sdk._logs.export import (  # noqa: E402
    InMemoryLogRecordExporter,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.metrics import Histogram as SdkHistogram  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import (  # noqa: E402
    AggregationTemporality,
    ExponentialHistogram,
    InMemoryMetricReader,
)

from monitor_bus.exporters.otel import (  # noqa: E402
    OpenTelemetryEventHandler,
    histogram_view,
    make_resource,
)

T0 = datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=timezone.utc)
T0_NS = 1772600767_891011000


class InMemory:
    """The SDK's own in-memory reader and log exporter behind one handler."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.logs = InMemoryLogRecordExporter()
        resource = make_resource("trainer", rank=2)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[self.reader])
        self.logger_provider = LoggerProvider(resource=resource)
        self.logger_provider.add_log_record_processor(SimpleLogRecordProcessor(self.logs))
        self.handler = OpenTelemetryEventHandler(self.meter_provider, self.logger_provider)

    def gauges(self) -> dict[str, float | int]:
        data = self.reader.get_metrics_data()
        if data is None:
            return {}
        return {
            metric.name: point.value
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            for point in metric.data.data_points
        }


@pytest.fixture
def otel() -> Iterator[InMemory]:
    sdk = InMemory()
    yield sdk
    sdk.meter_provider.shutdown()
    sdk.logger_provider.shutdown()


def test_stat_event_sets_one_gauge_per_key(otel: InMemory, bus: EventBus) -> None:
    """A Stat event sets one gauge per `<stat>.<aggregation>` key, ints staying ints."""
    bus.register_event_handler(otel.handler)
    bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.25, "step_time.count": 4}))
    bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.5, "step_time.count": 6}))
    assert bus.flush(10)
    gauges = otel.gauges()
    assert gauges == {"step_time.mean": 0.5, "step_time.count": 6}
    assert type(gauges["step_time.count"]) is int
    assert otel.logs.get_finished_logs() == ()


def test_real_stat_window_becomes_gauges(otel: InMemory, bus: EventBus) -> None:
    """A window closed by monitor_bus.Stat reaches the meter as its aggregates."""
    bus.register_event_handler(otel.handler)
    stat = Stat(
        "loss",
        [Aggregation.MEAN, Aggregation.COUNT, Aggregation.MAX],
        timedelta(hours=1),
        max_samples=3,
        bus=bus,
    )
    for v in (1.0, 2.0, 6.0):
        stat.add(v)
    assert bus.flush(10)
    assert otel.gauges() == {"loss.mean": 3.0, "loss.count": 3, "loss.max": 6.0}


def test_gauge_metadata_and_resource(otel: InMemory, bus: EventBus) -> None:
    """Gauge points come from the `monitor_bus` scope with the provider's resource."""
    bus.register_event_handler(otel.handler)
    bus.log_event(Event(STAT_EVENT, T0, {"gpu.util.mean": 0.75}))
    assert bus.flush(10)
    data = otel.reader.get_metrics_data()
    assert data is not None
    (rm,) = data.resource_metrics
    assert rm.resource.attributes["service.name"] == "trainer"
    assert rm.resource.attributes["rank"] == 2
    (sm,) = rm.scope_metrics
    assert sm.scope.name == "monitor_bus"
    (metric,) = sm.metrics
    assert type(metric.data).__name__ == "Gauge"
    (point,) = metric.data.data_points
    assert (metric.name, point.value, dict(point.attributes or {})) == ("gpu.util.mean", 0.75, {})


def test_other_events_become_log_records(otel: InMemory, bus: EventBus) -> None:
    """A non-Stat event becomes one log record: its name, exact timestamp and data as attributes."""
    bus.register_event_handler(otel.handler)
    bus.log_event(
        Event("train.epoch", T0, {"epoch": 3, "loss": 0.5, "phase": "train", "best": True})
    )
    assert bus.flush(10)
    (record,) = otel.logs.get_finished_logs()
    log = record.log_record
    assert log.event_name == "train.epoch"
    assert log.body == "train.epoch"
    assert log.timestamp == T0_NS
    assert dict(log.attributes or {}) == {"epoch": 3, "loss": 0.5, "phase": "train", "best": True}
    assert log.severity_text == "INFO"
    assert record.resource.attributes["service.name"] == "trainer"
    assert otel.gauges() == {}


def test_naive_timestamp_is_local_time(otel: InMemory, bus: EventBus) -> None:
    """A naive timestamp (what torch.monitor hands out) is read as local time."""
    bus.register_event_handler(otel.handler)
    naive = T0.astimezone().replace(tzinfo=None)
    bus.log_event(Event("e", naive, {}))
    assert bus.flush(10)
    (record,) = otel.logs.get_finished_logs()
    assert record.log_record.timestamp == T0_NS


def test_strings_and_bad_names_are_skipped_and_counted(otel: InMemory, bus: EventBus) -> None:
    """String values and keys that cannot name an instrument are skipped and counted, not fatal."""
    bus.register_event_handler(otel.handler)
    data: dict[str, monitor_bus.data_value_t] = {
        "ok.mean": 1.0,
        "note": "text",  # a string: skipped
        "loss (val).mean": 2.0,  # sanitized to loss__val_.mean
        "loss__val_.mean": 3.0,  # collides with the sanitized name above: skipped
        "1st.max": 4.0,  # must start with a letter: m_1st.max
        "x" * 300: 5.0,  # too long for any instrument name: skipped
        "flag.value": True,  # a bool is 1
    }
    bus.log_event(Event(STAT_EVENT, T0, data))
    bus.log_event(Event(STAT_EVENT, T0, {"note": "again"}))
    assert bus.flush(10)
    assert otel.gauges() == {
        "ok.mean": 1.0,
        "loss__val_.mean": 2.0,
        "m_1st.max": 4.0,
        "flag.value": 1,
    }
    assert (otel.handler.skipped_values, otel.handler.skipped_names) == (2, 2)
    stats = bus.stats()
    assert stats["handler_errors"] == 0
    assert stats["handlers"][0]["delivered"] == 2


@pytest.fixture
def still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeze the skip reporter's clock, so repeats fall in one rate-limit interval."""
    monkeypatch.setattr("monitor_bus._skipped._clock", lambda: 100.0)


def skip_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "monitor_bus"]


REPEATS = "repeats of this key are logged at most every 10 s"


@pytest.mark.usefixtures("still_clock")
def test_gauge_values_outside_int64_or_not_finite_are_skipped(
    otel: InMemory, bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """Ints outside int64 and NaN/infinities cannot be gauge points: skipped, counted, logged."""
    bus.register_event_handler(otel.handler)
    data: dict[str, monitor_bus.data_value_t] = {
        "max.sum": 2**63 - 1,
        "min.sum": -(2**63),
        "over.sum": 2**63,
        "under.sum": -(2**63) - 1,
        "nan.mean": math.nan,
        "inf.max": math.inf,
        "ok.mean": 0.5,
    }
    bus.log_event(Event(STAT_EVENT, T0, data))
    bus.log_event(Event(STAT_EVENT, T0, data))
    assert bus.flush(10)
    assert otel.gauges() == {"max.sum": 2**63 - 1, "min.sum": -(2**63), "ok.mean": 0.5}
    assert (otel.handler.skipped_values, otel.handler.skipped_names) == (8, 0)
    assert bus.stats()["handler_errors"] == 0
    assert skip_warnings(caplog) == [
        f"OpenTelemetryEventHandler: Stat value 'over.sum' is an int outside int64: "
        f"skipped (1 so far; {REPEATS})",
        f"OpenTelemetryEventHandler: Stat value 'under.sum' is an int outside int64: "
        f"skipped (2 so far; {REPEATS})",
        f"OpenTelemetryEventHandler: Stat value 'nan.mean' is not finite (nan); the SDK "
        f"drops those: skipped (3 so far; {REPEATS})",
        f"OpenTelemetryEventHandler: Stat value 'inf.max' is not finite (inf); the SDK "
        f"drops those: skipped (4 so far; {REPEATS})",
    ]


def test_resource_from_arguments_and_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_resource carries host, pid, the torchrun ranks, node and job, and service name;
    arguments win."""
    import os
    import socket

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_RANK", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    attrs = make_resource("trainer", attributes={"deployment.environment": "test"}).attributes
    assert attrs["service.name"] == "trainer"
    assert attrs["host.name"] == socket.gethostname()
    assert attrs["process.pid"] == os.getpid()
    assert (attrs["rank"], attrs["local_rank"], attrs["world_size"]) == (3, 1, 8)
    assert (attrs["node_rank"], attrs["job_id"]) == (2, "job-a")
    assert attrs["deployment.environment"] == "test"
    assert make_resource(rank=5).attributes["rank"] == 5
    monkeypatch.delenv("RANK")
    assert "rank" not in make_resource().attributes


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"endpoint": 4318}, TypeError, "endpoint"),
        ({"export_interval": 0}, ValueError, "export_interval"),
        ({"export_interval": "10"}, TypeError, "export_interval"),
        ({"scope": None}, TypeError, "scope"),
    ],
)
def test_bad_arguments_raise_naming_them(
    kwargs: dict[str, Any], error: type[Exception], names: str
) -> None:
    """Invalid constructor arguments raise an exception that names the argument."""
    with pytest.raises(error, match=names):
        OpenTelemetryEventHandler(**kwargs)


def test_settings_for_own_providers_rejected_with_given_providers(otel: InMemory) -> None:
    """service_name with both providers given is an error, not silently ignored."""
    with pytest.raises(ValueError, match="service_name"):
        OpenTelemetryEventHandler(otel.meter_provider, otel.logger_provider, service_name="x")
    with pytest.raises(TypeError, match="rank"):
        make_resource(rank="0")  # type: ignore[arg-type]


# -- OTLP/HTTP to a local receiver --


class Receiver:
    """A minimal OTLP/HTTP receiver on loopback that keeps the decoded requests.

    With ``gate`` set, each request is held unanswered until ``release`` is set, which is what
    a hung collector looks like to the exporter.
    """

    def __init__(self, *, gate: bool = False) -> None:
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.logs: list[logs_service_pb2.ExportLogsServiceRequest] = []
        self.content_types: set[str] = set()
        self.received = threading.Event()
        self.release = threading.Event()
        if not gate:
            self.release.set()
        self._cv = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.received.set()
                receiver.release.wait(30)
                receiver._store(self.path, self.headers.get("Content-Type", ""), body)
                response = (
                    metrics_service_pb2.ExportMetricsServiceResponse()
                    if self.path == "/v1/metrics"
                    else logs_service_pb2.ExportLogsServiceResponse()
                ).SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(response)))
                self.end_headers()
                self.wfile.write(response)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _store(self, path: str, content_type: str, body: bytes) -> None:
        with self._cv:
            self.content_types.add(content_type)
            if path == "/v1/metrics":
                self.metrics.append(
                    metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                )
            elif path == "/v1/logs":
                self.logs.append(logs_service_pb2.ExportLogsServiceRequest.FromString(body))
            self._cv.notify_all()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def any_value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value"))


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_otlp_http_round_trip(
    receiver: Receiver, bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gauges and log records reach an OTLP/HTTP receiver with names, values, times and attributes."""
    import time

    monkeypatch.setenv("RANK", "7")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    handler = OpenTelemetryEventHandler(
        service_name="trainer", endpoint=receiver.url, export_interval=3600
    )
    try:
        bus.register_event_handler(handler, name="otel")
        before = time.time_ns()
        bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.25, "step_time.count": 4}))
        bus.log_event(
            Event("train.epoch", T0, {"epoch": 3, "loss": 0.5, "phase": "train", "best": True})
        )
        assert bus.flush(10)
        assert handler.force_flush(30)
        after = time.time_ns()
    finally:
        assert handler.shutdown(30)

    assert receiver.content_types == {"application/x-protobuf"}
    # The reader's final export at shutdown repeats the gauges; the first request is the flush.
    (rm,) = receiver.metrics[0].resource_metrics
    resource = attributes(rm.resource.attributes)
    assert resource["service.name"] == "trainer"
    assert resource["rank"] == 7
    assert "host.name" in resource
    assert "process.pid" in resource
    (sm,) = rm.scope_metrics
    assert sm.scope.name == "monitor_bus"
    points = {}
    for metric in sm.metrics:
        assert metric.WhichOneof("data") == "gauge"
        (point,) = metric.gauge.data_points
        assert before <= point.time_unix_nano <= after
        assert list(point.attributes) == []
        points[metric.name] = (point.WhichOneof("value"), getattr(point, point.WhichOneof("value")))
    assert points == {"step_time.mean": ("as_double", 0.25), "step_time.count": ("as_int", 4)}

    (request,) = receiver.logs
    (rl,) = request.resource_logs
    assert attributes(rl.resource.attributes)["rank"] == 7
    (sl,) = rl.scope_logs
    assert sl.scope.name == "monitor_bus"
    (log,) = sl.log_records
    assert log.event_name == "train.epoch"
    assert log.body.string_value == "train.epoch"
    assert log.time_unix_nano == T0_NS
    assert before <= log.observed_time_unix_nano <= after
    assert attributes(log.attributes) == {"epoch": 3, "loss": 0.5, "phase": "train", "best": True}


def test_hung_endpoint_blocks_neither_caller_nor_bus(bus: EventBus) -> None:
    """While the collector holds an export unanswered, log_event and bus.flush still complete."""
    hung = Receiver(gate=True)
    handler = OpenTelemetryEventHandler(endpoint=hung.url, export_interval=3600)
    try:
        bus.register_event_handler(handler, name="otel")
        bus.log_event(Event("first", T0, {"n": 1}))
        assert bus.flush(10)
        assert not handler.force_flush(0.2)  # the export is now stuck in the SDK's thread
        assert hung.received.wait(10)
        for n in range(100):
            bus.log_event(Event("more", T0, {"n": n}))
            bus.log_event(Event(STAT_EVENT, T0, {"n.value": n}))
        # Everything reached the handler while the exporter is still waiting for an answer.
        assert bus.flush(10)
        assert not hung.release.is_set()
        assert hung.logs == []
        (stats,) = bus.stats()["handlers"]
        assert (stats["delivered"], stats["dropped"], stats["errors"]) == (201, 0, 0)
        hung.release.set()
        assert handler.force_flush(30)
    finally:
        hung.release.set()
        assert handler.shutdown(30)
        hung.close()
    exported = [
        r.attributes
        for req in hung.logs
        for rl in req.resource_logs
        for sl in rl.scope_logs
        for r in sl.log_records
    ]
    assert [attributes(a)["n"] for a in exported] == [1, *range(100)]


def test_refused_endpoint_is_dropped_by_the_sdk_not_the_bus(
    bus: EventBus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With nothing listening, the bus delivers everything and the SDK retries, then drops and logs."""
    import logging
    import socket

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds the SDK keeps retrying
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    handler = OpenTelemetryEventHandler(endpoint=f"http://127.0.0.1:{port}", export_interval=3600)
    caplog.set_level(logging.WARNING, logger="opentelemetry")
    try:
        bus.register_event_handler(handler, name="otel")
        for n in range(10):
            bus.log_event(Event("step", T0, {"n": n}))
            bus.log_event(Event(STAT_EVENT, T0, {"n.value": n}))
        assert bus.flush(10)
        (stats,) = bus.stats()["handlers"]
        assert (stats["delivered"], stats["dropped"], stats["errors"]) == (20, 0, 0)
        # The SDK reports its flush as done once it gave up on the batch: True, yet dropped.
        assert handler.force_flush(30)
    finally:
        assert handler.shutdown(30)
    failures = {
        r.name.rsplit(".", 1)[-1]
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith("opentelemetry.exporter.otlp")
    }
    assert failures == {"metric_exporter", "_log_exporter"}


def metric_points(request: metrics_service_pb2.ExportMetricsServiceRequest) -> dict[str, Any]:
    return {
        metric.name: getattr(point, point.WhichOneof("value"))
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        for point in metric.gauge.data_points
    }


def test_int_beyond_int64_does_not_break_later_exports(receiver: Receiver, bus: EventBus) -> None:
    """After a Stat event holding 2**63, every later OTLP export still carries the other gauges."""
    handler = OpenTelemetryEventHandler(endpoint=receiver.url, export_interval=3600)
    try:
        bus.register_event_handler(handler, name="otel")
        bus.log_event(Event(STAT_EVENT, T0, {"bytes.sum": 2**63, "step_time.mean": 0.5}))
        assert bus.flush(10)
        assert handler.force_flush(30)
        bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.75, "step_time.count": 3}))
        assert bus.flush(10)
        assert handler.force_flush(30)
    finally:
        assert handler.shutdown(30)
    assert [metric_points(r) for r in receiver.metrics[:2]] == [
        {"step_time.mean": 0.5},
        {"step_time.mean": 0.75, "step_time.count": 3},
    ]
    assert (handler.skipped_values, handler.skipped_names) == (1, 0)


def test_infinite_timeouts_mean_no_limit(receiver: Receiver, bus: EventBus) -> None:
    """force_flush(math.inf) and shutdown(math.inf) wait as long as it takes and export."""
    handler = OpenTelemetryEventHandler(endpoint=receiver.url, export_interval=3600)
    bus.register_event_handler(handler, name="otel")
    bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.5}))
    assert bus.flush(10)
    assert handler.force_flush(math.inf) is True
    assert handler.shutdown(math.inf) is True
    assert metric_points(receiver.metrics[0]) == {"step_time.mean": 0.5}


@pytest.mark.usefixtures("still_clock")
def test_log_attributes_otlp_cannot_carry_are_skipped(
    receiver: Receiver, bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """Ints outside int64 and non-UTF-8 text are left out of the log record; the record and the
    batch around it are exported."""
    handler = OpenTelemetryEventHandler(endpoint=receiver.url, export_interval=3600)
    try:
        bus.register_event_handler(handler, name="otel")
        bus.log_event(Event("before", T0, {"n": 1}))
        bus.log_event(
            Event(
                "odd",
                T0,
                {"big": 2**63, "path": "run\udc80.bin", "k\ud800": 2, "loss": 0.5, "ok": True},
            )
        )
        bus.log_event(Event("name\ud800", T0, {"n": 3}))
        bus.log_event(Event("after", T0, {"n": 4}))
        assert bus.flush(10)
        assert handler.force_flush(30)
    finally:
        assert handler.shutdown(30)
    records = [
        (log.body.string_value, log.event_name, attributes(log.attributes))
        for request in receiver.logs
        for rl in request.resource_logs
        for sl in rl.scope_logs
        for log in sl.log_records
    ]
    assert records == [
        ("before", "before", {"n": 1}),
        ("odd", "odd", {"loss": 0.5, "ok": True}),
        ("name\\ud800", "name\\ud800", {"n": 3}),  # escaped, as repr would
        ("after", "after", {"n": 4}),
    ]
    assert (handler.skipped_values, handler.skipped_names) == (2, 1)
    assert skip_warnings(caplog) == [
        f"OpenTelemetryEventHandler: data['big'] of event 'odd' is an int outside int64: "
        f"skipped (1 so far; {REPEATS})",
        f"OpenTelemetryEventHandler: data['path'] of event 'odd' is not valid UTF-8: "
        f"skipped (2 so far; {REPEATS})",
        f"OpenTelemetryEventHandler: data key 'k\\ud800' of event 'odd' is not valid UTF-8: "
        f"skipped (1 so far; {REPEATS})",
    ]


# -- distributions: a window's Histogram, percentiles and stddev --


def exponential_points(reader: InMemoryMetricReader) -> dict[str, Any]:
    """The exponential histogram points a reader collects now, by metric name."""
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: metric.data.data_points
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if isinstance(metric.data, ExponentialHistogram)
    }


def same_as(point: Any, histogram: Histogram) -> bool:
    """Whether an exponential histogram point holds ``histogram`` (finite samples only)."""
    return (
        point.scale,
        point.zero_count,
        (point.positive.offset, tuple(point.positive.bucket_counts)),
        (point.negative.offset, tuple(point.negative.bucket_counts)),
        point.count,
        point.sum,
        point.min,
        point.max,
    ) == (
        histogram.scale,
        histogram.zero_count,
        (histogram.positive_offset, histogram.positive_counts),
        (histogram.negative_offset, histogram.negative_counts),
        histogram.count,
        histogram.sum,
        histogram.min,
        histogram.max,
    )


def test_histogram_passes_through_as_an_exponential_histogram(bus: EventBus) -> None:
    """With histogram_view(), a window's Histogram reaches the reader as an exponential
    histogram point with its own scale and buckets, the windows merged exactly (cumulative);
    the percentiles and stddev are gauges."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[histogram_view()])
    handler = OpenTelemetryEventHandler(provider, LoggerProvider())
    bus.register_event_handler(handler)
    first, second = (distribution_window(samples) for samples in WINDOW_SAMPLES)
    bus.log_event(first)
    assert bus.flush(10)
    (point,) = exponential_points(reader)["lat.histogram"]
    assert same_as(point, first.data["lat.histogram"])
    bus.log_event(second)
    assert bus.flush(10)
    (point,) = exponential_points(reader)["lat.histogram"]
    everything = Histogram.of([s for samples in WINDOW_SAMPLES for s in samples])
    assert same_as(point, everything)
    assert everything.scale < first.data["lat.histogram"].scale  # the wider span coarsened it
    gauges = {
        metric.name: metric.data.data_points[0].value
        for metric in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
        if metric.name != "lat.histogram"
    }
    assert gauges == {k: v for k, v in second.data.items() if k != "lat.histogram"}
    assert handler.skipped_values == 0
    provider.shutdown()


def test_histogram_delta_temporality_holds_the_windows_since_the_last_collection(
    bus: EventBus,
) -> None:
    """With delta temporality each collection holds the windows logged since the one before,
    and none when there were none."""
    reader = InMemoryMetricReader(
        preferred_temporality={SdkHistogram: AggregationTemporality.DELTA}
    )
    provider = MeterProvider(metric_readers=[reader], views=[histogram_view()])
    bus.register_event_handler(OpenTelemetryEventHandler(provider, LoggerProvider()))
    for samples in WINDOW_SAMPLES:
        bus.log_event(distribution_window(samples))
        assert bus.flush(10)
        (point,) = exponential_points(reader)["lat.histogram"]
        assert same_as(point, Histogram.of(samples))
    assert "lat.histogram" not in exponential_points(reader)
    provider.shutdown()


@pytest.mark.usefixtures("still_clock")
def test_histogram_without_the_view_is_skipped_and_counted(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """On a provider without histogram_view() a histogram is skipped, counted and reported
    (the SDK could only re-bucket samples); NaN and infinite samples, which no OTLP bucket
    holds, are left out of a point's count."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    handler = OpenTelemetryEventHandler(provider, LoggerProvider())
    bus.register_event_handler(handler)
    for samples in WINDOW_SAMPLES:
        bus.log_event(distribution_window(samples))
    assert bus.flush(10)
    assert handler.skipped_values == 2
    assert exponential_points(reader) == {}
    assert skip_warnings(caplog) == [
        "OpenTelemetryEventHandler: Stat value 'lat.histogram' is a histogram and the meter "
        "provider has no histogram_view() for it (MeterProvider(views=[histogram_view(scope)], "
        "...)): skipped (1 so far; repeats of this key are logged at most every 10 s)"
    ]
    provider.shutdown()


def test_histogram_nan_and_infinite_samples_are_not_in_the_point_count(bus: EventBus) -> None:
    """NaN and infinite samples, which no OTLP bucket holds (the SDK drops such measurements),
    are left out of the point's count; sum, min and max are the Histogram's."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[histogram_view()])
    bus.register_event_handler(OpenTelemetryEventHandler(provider, LoggerProvider()))
    bus.log_event(distribution_window([1.5, -2.5, math.nan, math.inf]))
    assert bus.flush(10)
    (point,) = exponential_points(reader)["lat.histogram"]
    assert (point.count, point.sum, point.min, point.max) == (2, math.inf, -2.5, math.inf)
    provider.shutdown()


def test_histogram_over_otlp_http(receiver: Receiver, bus: EventBus) -> None:
    """The provider the handler makes sends a window's Histogram over OTLP/HTTP as an
    exponential histogram with the same scale and buckets."""
    handler = OpenTelemetryEventHandler(endpoint=receiver.url, export_interval=3600)
    window = distribution_window(WINDOW_SAMPLES[0])
    try:
        bus.register_event_handler(handler, name="otel")
        bus.log_event(window)
        assert bus.flush(10)
        assert handler.force_flush(30)
    finally:
        assert handler.shutdown(30)
    histogram = window.data["lat.histogram"]
    (metric,) = [
        metric
        for rm in receiver.metrics[0].resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == "lat.histogram"
    ]
    (point,) = metric.exponential_histogram.data_points
    assert (point.scale, point.zero_count, point.count, point.sum, point.min, point.max) == (
        histogram.scale,
        histogram.zero_count,
        histogram.count,
        histogram.sum,
        histogram.min,
        histogram.max,
    )
    assert (point.positive.offset, tuple(point.positive.bucket_counts)) == (
        histogram.positive_offset,
        histogram.positive_counts,
    )
    assert (point.negative.offset, tuple(point.negative.bucket_counts)) == (
        histogram.negative_offset,
        histogram.negative_counts,
    )


def test_a_real_stat_window_becomes_an_exponential_histogram(bus: EventBus) -> None:
    """A window of a real Stat with HISTOGRAM reaches the reader as the Histogram of its
    samples; its percentiles and stddev as gauges."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[histogram_view()])
    bus.register_event_handler(OpenTelemetryEventHandler(provider, LoggerProvider()))
    real_window(bus, WINDOW_SAMPLES[0])
    assert bus.flush(10)
    (point,) = exponential_points(reader)["lat.histogram"]
    assert same_as(point, Histogram.of(WINDOW_SAMPLES[0]))
    names = {m.name for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics}
    assert names == {"lat.p50", "lat.p99", "lat.stddev", "lat.histogram"}
    provider.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_waits_for_the_lock_a_parent_thread_held(otel: InMemory) -> None:
    """children="own": a parent thread is making an instrument, holding the handler's lock, at
    the fork; the child's copy of the handler makes its gauge and its bus flushes (the lock
    used to stay held for ever)."""
    bus = EventBus(name="otel-fork", children="own")
    bus.register_event_handler(otel.handler)
    entered, release = threading.Event(), threading.Event()

    def blocking(name: str) -> None:
        entered.set()
        release.wait(60)

    holder = threading.Thread(target=otel.handler._make_instrument, args=("held", {}, blocking))
    holder.start()
    read, write = os.pipe()
    try:
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                bus.log_event(Event(STAT_EVENT, T0, {"child.mean": 1.5}))
                os.write(write, repr((bus.flush(10), otel.gauges())).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        ready = select.select([read], [], [], 30)[0]
        answer = os.read(read, 1000).decode() if ready else "(no answer)"
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(read)
        release.set()
        holder.join(10)
    assert (answer, os.waitstatus_to_exitcode(status)) == ("(True, {'child.mean': 1.5})", 0)
    assert bus.close(10)
