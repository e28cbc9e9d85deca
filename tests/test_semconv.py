"""The system metrics as the OpenTelemetry and Prometheus exporters send them, held against
OpenTelemetry's semantic conventions v1.44.0, and the Prometheus exposition against promtool."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import urllib.request
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import monitor_bus
from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat
from monitor_bus.system import SystemMetrics

from .conftest import IN_CI, Recorder, require
from .test_system import FakeNvml

if not IN_CI:  # in CI the imports below fail instead
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    pytest.importorskip("psutil", reason="the system extra is not installed")

from opentelemetry.sdk._logs import LoggerProvider  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader, Sum  # noqa: E402
from opentelemetry.semconv._incubating.metrics import (  # noqa: E402
    hw_metrics,
    process_metrics,
    system_metrics,
)
from opentelemetry.semconv.schemas import Schemas  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from monitor_bus.exporters import _semconv  # noqa: E402
from monitor_bus.exporters.otel import OpenTelemetryEventHandler, make_resource  # noqa: E402
from monitor_bus.exporters.prometheus import PrometheusEventHandler  # noqa: E402

VERSION = "1.44.0"
# OpenTelemetry's semantic conventions v1.44.0, each metric the system Stats become:
# name -> (unit, instrument kind, attribute keys, Prometheus name, Prometheus type).
CONVENTIONS = {
    "process.cpu.utilization": ("1", "gauge", (), "process_cpu_utilization_ratio", "gauge"),
    "process.cpu.time": ("s", "counter", (), "process_cpu_time_seconds", "counter"),
    "process.memory.usage": ("By", "updowncounter", (), "process_memory_usage_bytes", "gauge"),
    "system.cpu.utilization": ("1", "gauge", (), "system_cpu_utilization_ratio", "gauge"),
    "system.memory.utilization": (
        "1",
        "gauge",
        ("system.memory.state",),
        "system_memory_utilization_ratio",
        "gauge",
    ),
    "system.disk.io": ("By", "counter", ("disk.io.direction",), "system_disk_io_bytes", "counter"),
    "system.network.io": (
        "By",
        "counter",
        ("network.io.direction",),
        "system_network_io_bytes",
        "counter",
    ),
    "hw.gpu.utilization": ("1", "gauge", ("hw.id",), "hw_gpu_utilization_ratio", "gauge"),
    "hw.gpu.memory.usage": (
        "By",
        "updowncounter",
        ("hw.id",),
        "hw_gpu_memory_usage_bytes",
        "gauge",
    ),
    "hw.power": ("W", "gauge", ("hw.id", "hw.type"), "hw_power_watts", "gauge"),
    "hw.temperature": ("Cel", "gauge", ("hw.id", "hw.type"), "hw_temperature_celsius", "gauge"),
}
CPUS = len(os.sched_getaffinity(0))


def expected_points(data: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the conventions' points should hold, from the Stats' windows ``data``."""
    points = {
        ("process.cpu.utilization", ()): data["system.process_cpu_percent.mean"] / 100 / CPUS,
        ("process.cpu.time", ()): data["system.process_cpu_seconds_total.value"],
        ("process.memory.usage", ()): data["system.process_rss_bytes.mean"],
        ("system.cpu.utilization", ()): data["system.host_cpu_percent.mean"] * 0.01,
        ("system.memory.utilization", (("system.memory.state", "used"),)): (
            data["system.host_memory_percent.mean"] * 0.01
        ),
    }
    for direction, stat in (("read", "disk_read"), ("write", "disk_write")):
        key = ("system.disk.io", (("disk.io.direction", direction),))
        points[key] = data[f"system.{stat}_bytes_total.value"]
    for direction, stat in (("transmit", "net_sent"), ("receive", "net_recv")):
        key = ("system.network.io", (("network.io.direction", direction),))
        points[key] = data[f"system.{stat}_bytes_total.value"]
    for gpu in ("gpu0", "gpu1"):
        points[("hw.gpu.utilization", (("hw.id", gpu),))] = (
            data[f"system.{gpu}.utilization_percent.mean"] * 0.01
        )
        points[("hw.gpu.memory.usage", (("hw.id", gpu),))] = data[
            f"system.{gpu}.memory_used_bytes.mean"
        ]
        typed = (("hw.id", gpu), ("hw.type", "gpu"))
        points[("hw.power", typed)] = data[f"system.{gpu}.power_watts.mean"]
        points[("hw.temperature", typed)] = data[f"system.{gpu}.temperature_c.mean"]
    return points


@pytest.fixture
def sampled(bus: EventBus) -> dict[str, Any]:
    """A real SystemMetrics (psutil, with its counters; NVML's calls for two GPUs) that took
    two samples of every metric on ``bus``, closed; its windows' data once the bus delivered
    them."""
    recorder = Recorder()
    bus.register_event_handler(recorder, name="recorder")
    metrics = SystemMetrics(
        3600.0, bus=bus, window=timedelta(hours=1), gpus=[0, 1], counters=True, _nvml=FakeNvml()
    )
    try:
        assert metrics._baseline.wait(30)
        # The rates need the kernel's CPU counters (in clock ticks) to move between samples.
        while not {"system.process_cpu_percent", "system.host_cpu_percent"} <= set(metrics.metrics):
            metrics.sample()
    finally:
        assert metrics.close()
    assert bus.flush(10)
    data: dict[str, Any] = {}
    for event in recorder.events:
        if event.name == STAT_EVENT:
            data.update(event.data)
    return data


def test_the_table_is_the_installed_conventions() -> None:
    """Each convention's name, unit and instrument kind, as the installed
    opentelemetry-semantic-conventions package defines it (schema 1.44.0), and the code's."""
    assert Schemas.V1_44_0.value == f"https://opentelemetry.io/schemas/{VERSION}"
    assert (VERSION, Schemas.V1_44_0.value) == (_semconv.SEMCONV_VERSION, _semconv.SCHEMA_URL)
    modules = {"process": process_metrics, "system": system_metrics, "hw": hw_metrics}
    meter = MeterProvider().get_meter("test")
    kinds = {
        "Counter": "counter",
        "ObservableCounter": "counter",
        "UpDownCounter": "updowncounter",
        "ObservableUpDownCounter": "updowncounter",
        "Gauge": "gauge",
        "_Gauge": "gauge",
        "ObservableGauge": "gauge",
    }
    for name, (unit, kind, *_) in CONVENTIONS.items():
        module = modules[name.split(".")[0]]
        assert getattr(module, name.upper().replace(".", "_")) == name
        create = getattr(module, "create_" + name.replace(".", "_"))
        args = [meter, []] if "callbacks" in inspect.signature(create).parameters else [meter]
        instrument = create(*args)
        bases = [cls.__name__ for cls in type(instrument).__mro__]
        assert (instrument.name, instrument.unit) == (name, unit)
        assert next(kinds[b] for b in bases if b in kinds) == kind, name
        code = _semconv.CONVENTIONS[name]
        assert (code.name, code.unit, code.kind) == (name, unit, kind)
    assert set(_semconv.CONVENTIONS) == set(CONVENTIONS)


def test_otel_exports_every_system_metric_under_the_conventions(
    bus: EventBus, sampled: dict[str, Any]
) -> None:
    """Through the real SDK's in-memory reader, every system metric is a convention's: its
    name, unit, instrument kind and attributes, from a meter of the conventions' schema, with
    the window's value in the convention's unit; nothing else of the system Stats goes out."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=make_resource("t"))
    handler = OpenTelemetryEventHandler(provider, LoggerProvider())
    data = dict(sampled)
    with EventBus(name="otel") as otel_bus:
        otel_bus.register_event_handler(handler)
        otel_bus.log_event(Event(STAT_EVENT, datetime.now(timezone.utc), data))
        assert otel_bus.flush(10)
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    metrics_data = reader.get_metrics_data()
    assert metrics_data is not None
    scopes = [sm for rm in metrics_data.resource_metrics for sm in rm.scope_metrics]
    assert [sm.scope.schema_url for sm in scopes] == [_semconv.SCHEMA_URL]
    for metric in scopes[0].metrics:
        unit, kind, keys, *_ = CONVENTIONS[metric.name]
        assert metric.unit == unit, metric.name
        if kind == "gauge":
            assert isinstance(metric.data, Gauge), metric.name
        else:
            assert isinstance(metric.data, Sum), metric.name
            assert metric.data.is_monotonic == (kind == "counter"), metric.name
        for point in metric.data.data_points:
            assert tuple(sorted(point.attributes)) == keys, metric.name
            got[(metric.name, tuple(sorted(point.attributes.items())))] = point.value
    assert got == expected_points(data)
    assert {name for name, _ in got} == set(CONVENTIONS)
    provider.shutdown()


def test_prometheus_exports_every_system_metric_under_the_conventions(
    sampled: dict[str, Any],
) -> None:
    """Through a real scrape, every system metric is a convention's under OpenTelemetry's
    Prometheus names (unit suffix, ``_total`` on counters, attributes as labels), with the
    handler's own labels; no system Stat is exported under its own name."""
    prom = PrometheusEventHandler(labels={"pod": "a"})
    with EventBus(name="prom") as prom_bus:
        prom_bus.register_event_handler(prom)
        prom_bus.log_event(Event(STAT_EVENT, datetime.now(timezone.utc), sampled))
        assert prom_bus.flush(10)
        with prom.serve(0) as server, urllib.request.urlopen(server.url, timeout=10) as reply:
            text = reply.read().decode()
    prometheus = {v[3]: (name, v[4], v[2]) for name, v in CONVENTIONS.items()}
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        assert not family.name.startswith("monitor_bus_system"), family.name
        if family.name not in prometheus:
            continue
        name, kind, keys = prometheus[family.name]
        assert family.type == kind, family.name
        for sample in family.samples:
            assert sample.name == family.name + ("_total" if kind == "counter" else "")
            labels = dict(sample.labels)
            assert labels.pop("pod") == "a"
            assert tuple(sorted(labels)) == tuple(k.replace(".", "_") for k in keys)
            attributes = zip(keys, (labels[k.replace(".", "_")] for k in keys), strict=True)
            got[(name, tuple(attributes))] = sample.value
    assert got == expected_points(sampled)


def test_a_second_handler_on_one_registry_skips_and_counts_its_system_metrics(
    sampled: dict[str, Any],
) -> None:
    """The conventions' names have no namespace: a second handler on the same registry (another
    namespace) is made, exports its other Stats, and skips and counts its system metrics."""
    registry = CollectorRegistry()
    first = PrometheusEventHandler(registry, namespace="a")
    second = PrometheusEventHandler(registry, namespace="b")
    data = {**sampled, "loss.mean": 0.5}
    exported = [
        key for key, value in sampled.items() if isinstance(_semconv.convert(key, value), tuple)
    ]
    with EventBus(name="prom") as prom_bus:
        prom_bus.register_event_handler(first)
        prom_bus.register_event_handler(second)
        prom_bus.log_event(Event(STAT_EVENT, datetime.now(timezone.utc), data))
        assert prom_bus.flush(10)
    get = registry.get_sample_value
    assert (get("a_loss_mean"), get("b_loss_mean")) == (0.5, 0.5)
    assert (first.skipped_names, second.skipped_names) == (0, len(exported))
    assert get("b_skipped_total", {"reason": "name_taken"}) == len(exported)
    assert get("process_memory_usage_bytes") == sampled["system.process_rss_bytes.mean"]


def test_launcher_attributes_from_torchrun_else_slurm() -> None:
    """torchrun's variables win over Slurm's; a variable unset or not a number is left out."""
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2"}
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    slurm |= {"SLURM_NODEID": "1", "SLURM_JOB_ID": "77"}
    launched = _semconv.launcher_attributes
    assert launched({**slurm, **torchrun, "TORCHELASTIC_RUN_ID": "job-a"}) == {
        "rank": 5,
        "local_rank": 1,
        "world_size": 8,
        "node_rank": 2,
        "job_id": "job-a",
    }
    assert launched(slurm) == {
        "rank": 3,
        "local_rank": 0,
        "world_size": 4,
        "node_rank": 1,
        "job_id": "77",
    }
    assert launched({"RANK": "x", "LOCAL_RANK": " "}) == {}


def test_launcher_attributes_are_otel_resource_and_prometheus_target_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torchrun set them, the rank, node rank and job id are resource attributes, and
    the labels of Prometheus' ``target_info``; without a launcher there is no target_info."""
    for name, value in {"RANK": "5", "GROUP_RANK": "2", "TORCHELASTIC_RUN_ID": "job-a"}.items():
        monkeypatch.setenv(name, value)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    attributes = make_resource("t").attributes
    assert (attributes["rank"], attributes["node_rank"], attributes["job_id"]) == (5, 2, "job-a")
    prom = PrometheusEventHandler(labels={"rank": "9"})  # the handler's labels win
    assert (
        prom.registry.get_sample_value(
            "target_info", {"rank": "9", "node_rank": "2", "job_id": "job-a"}
        )
        == 1.0
    )
    for name in ("RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    prom = PrometheusEventHandler()
    assert "target_info" not in {m.name for m in prom.registry.collect()}


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    require(path is not None, "promtool is not installed (apt-get install prometheus)")
    assert path is not None
    return path


def test_a_real_scrape_passes_promtool(
    promtool: str, sampled: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape holding a Stat of every aggregation, the system metrics, the skipped counter
    and target_info passes ``promtool check metrics`` with no problem reported."""
    monkeypatch.setenv("RANK", "1")
    prom = PrometheusEventHandler(labels={"pod": "a"})
    with EventBus(name="prom") as prom_bus:
        prom_bus.register_event_handler(prom)
        step = Stat("step_time", list(Aggregation), timedelta(hours=1), bus=prom_bus)
        for i in range(100):
            step.add(i / 100)
        step._close()
        prom_bus.log_event(Event(STAT_EVENT, datetime.now(timezone.utc), sampled))
        assert prom_bus.flush(10)
        with prom.serve(0) as server, urllib.request.urlopen(server.url, timeout=10) as reply:
            text = reply.read().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"monitor_bus_step_time", "monitor_bus_step_time_samples"} <= names
    assert {"monitor_bus_step_time_sum_of_samples", "target_info", "system_disk_io_bytes"} <= names
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", "")


def test_no_system_metric_escapes_the_table() -> None:
    """Every Stat SystemMetrics makes is a convention's or a rate the counters carry; a
    ``system.*`` key of the user's own is exported as any Stat."""
    known = [
        "process_cpu_percent",
        "process_cpu_seconds_total",
        "process_rss_bytes",
        "host_cpu_percent",
        "host_memory_percent",
        "disk_read_bytes_total",
        "disk_write_bytes_total",
        "net_sent_bytes_total",
        "net_recv_bytes_total",
        "gpu0.utilization_percent",
        "gpu0.memory_used_bytes",
        "gpu0.power_watts",
        "gpu0.temperature_c",
    ]
    for metric in known:
        found = [_semconv.convert(f"system.{metric}.{a}", 1.0) for a in ("mean", "value")]
        assert [type(p) for p in found if p is not None] == [_semconv.Point], metric
        assert _semconv.convert(f"system.{metric}.max", 1.0) is None
    for rate in ("disk_read", "disk_write", "net_sent", "net_recv"):
        assert _semconv.convert(f"system.{rate}_bytes_per_s.mean", 1.0) is None
    assert _semconv.convert("system.my_own.mean", 1.0) is _semconv.NOT_CONVENTIONAL
    assert _semconv.convert("step_time.mean", 1.0) is _semconv.NOT_CONVENTIONAL
    assert monitor_bus.system.AGGREGATIONS == (Aggregation.MEAN, Aggregation.MAX, Aggregation.MIN)
