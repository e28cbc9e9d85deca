"""PrometheusEventHandler: gauges in its registry, the /metrics endpoint, and a real Prometheus
server (Debian's ``prometheus`` binary) scraping it."""

from __future__ import annotations

import json
import math
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Histogram, Stat
from monitor_bus._event import from_slots

from .conftest import IN_CI, WINDOW_SAMPLES, distribution_window, real_window, require

if not IN_CI:  # in CI the import below fails instead
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")

from prometheus_client import (  # noqa: E402
    REGISTRY,
    CollectorRegistry,
    Gauge,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from monitor_bus.exporters.prometheus import (  # noqa: E402
    MAX_LE_BUCKETS,
    PrometheusEventHandler,
    le_buckets,
    metric_name,
    serve,
)

T0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=timezone.utc)


def test_stat_event_sets_sanitized_gauges(bus: EventBus) -> None:
    """Each Stat key becomes a gauge named monitor_bus_<key> with invalid characters as `_`."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    bus.log_event(
        Event(STAT_EVENT, T0, {"step_time.mean": 0.25, "loss (val)/max": 3.0, "n.count": 4})
    )
    bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.5}))
    bus.log_event(Event("train.epoch", T0, {"epoch": 1}))  # not a Stat: ignored
    assert bus.flush(10)
    get = prom.registry.get_sample_value
    assert get("monitor_bus_step_time_mean") == 0.5
    assert get("monitor_bus_loss__val__max") == 3.0
    assert get("monitor_bus_n_samples") == 4.0
    names = {m.name for m in prom.registry.collect()}
    assert names == {
        "monitor_bus_skipped",
        "monitor_bus_step_time_mean",
        "monitor_bus_loss__val__max",
        "monitor_bus_n_samples",
    }


def test_real_stat_window_becomes_gauges(bus: EventBus) -> None:
    """A window closed by monitor_bus.Stat lands in the registry as its aggregates."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    stat = Stat(
        "loss", [Aggregation.MEAN, Aggregation.MAX], timedelta(hours=1), max_samples=2, bus=bus
    )
    stat.add(1.0)
    stat.add(5.0)
    assert bus.flush(10)
    assert prom.registry.get_sample_value("monitor_bus_loss_mean") == 3.0
    assert prom.registry.get_sample_value("monitor_bus_loss_max") == 5.0


def test_strings_and_taken_names_are_skipped_and_counted(bus: EventBus) -> None:
    """String values and keys whose name is taken are skipped and counted, and nothing fails."""
    prom = PrometheusEventHandler(labels={"rank": "3"})
    bus.register_event_handler(prom)
    bus.log_event(
        Event(
            STAT_EVENT,
            T0,
            {
                "a.b": 1.0,
                "a_b": 2.0,  # sanitizes to the name a.b already has
                "skipped": 3.0,  # the handler's own counter has this name
                "note": "text",
                "ok": 4.0,
            },
        )
    )
    bus.log_event(Event(STAT_EVENT, T0, {"note": "again", "a_b": 5.0}))
    assert bus.flush(10)
    get = prom.registry.get_sample_value
    assert get("monitor_bus_a_b", {"rank": "3"}) == 1.0
    assert get("monitor_bus_ok", {"rank": "3"}) == 4.0
    assert (prom.skipped_values, prom.skipped_names) == (2, 3)
    assert get("monitor_bus_skipped_total", {"reason": "string_value", "rank": "3"}) == 2.0
    assert get("monitor_bus_skipped_total", {"reason": "name_taken", "rank": "3"}) == 3.0
    assert bus.stats()["handler_errors"] == 0


@pytest.fixture
def still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeze the skip reporter's clock, so repeats fall in one rate-limit interval."""
    monkeypatch.setattr("monitor_bus._skipped._clock", lambda: 100.0)


@pytest.mark.usefixtures("still_clock")
def test_values_a_gauge_cannot_hold_leave_no_series(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """A string or an int beyond float64 is skipped, counted by reason, and exports no series."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    odd: dict[str, float | int | bool | str] = {
        "note": "text",
        "huge.sum": 2**1100,
        "big.sum": 2**64,  # past int64, still a float64
        "nan.mean": math.nan,
        "inf.max": math.inf,
        "flag.value": True,
        "ok.mean": 0.5,
    }
    bus.log_event(Event(STAT_EVENT, T0, odd))
    bus.log_event(Event(STAT_EVENT, T0, odd))
    assert bus.flush(10)
    assert bus.stats()["handler_errors"] == 0
    exposition = generate_latest(prom.registry).decode()
    series = {
        line.split(" ")[0]: line.split(" ")[1]
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }
    assert {k: v for k, v in series.items() if not k.startswith("monitor_bus_skipped")} == {
        "monitor_bus_big_sum_of_samples": "1.8446744073709552e+19",
        "monitor_bus_nan_mean": "NaN",
        "monitor_bus_inf_max": "+Inf",
        "monitor_bus_flag_value": "1.0",
        "monitor_bus_ok_mean": "0.5",
    }
    get = prom.registry.get_sample_value
    assert get("monitor_bus_skipped_total", {"reason": "string_value"}) == 2.0
    assert get("monitor_bus_skipped_total", {"reason": "out_of_range"}) == 2.0
    assert get("monitor_bus_skipped_total", {"reason": "name_taken"}) == 0.0
    assert (prom.skipped_values, prom.skipped_names) == (4, 0)
    assert [r.getMessage() for r in caplog.records if r.name == "monitor_bus"] == [
        "PrometheusEventHandler: Stat value 'note' is a string; Prometheus holds numbers: "
        "skipped (1 so far; repeats of this key are logged at most every 10 s)",
        "PrometheusEventHandler: Stat value 'huge.sum' is an int beyond float64's range: "
        "skipped (2 so far; repeats of this key are logged at most every 10 s)",
    ]


def test_non_utf8_key_keeps_the_endpoint_readable(bus: EventBus) -> None:
    """A key holding a lone surrogate becomes a gauge, and the exposition still encodes."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    bus.log_event(Event(STAT_EVENT, T0, {"loss\ud800.mean": 0.25, "ok.mean": 1.0}))
    assert bus.flush(10)
    exposition = generate_latest(prom.registry).decode()
    assert "monitor_bus_loss__mean 0.25\n" in exposition
    assert "monitor_bus_ok_mean 1.0\n" in exposition


def test_label_value_that_is_not_utf8_is_refused() -> None:
    """A constant label value the exposition could not encode is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"labels\['host'\] is not valid UTF-8"):
        PrometheusEventHandler(labels={"host": "node\udc801"})


def test_default_registry_is_fresh_and_global_one_is_opt_in() -> None:
    """Without a registry the handler makes its own; REGISTRY is used only when passed."""
    a, b = PrometheusEventHandler(), PrometheusEventHandler()
    assert a.registry is not b.registry
    assert a.registry is not REGISTRY
    registry = CollectorRegistry()
    Gauge("monitor_bus_taken", "already here", registry=registry)
    c = PrometheusEventHandler(registry)
    c(Event(STAT_EVENT, T0, {"taken": 1.0, "free": 2.0}))
    assert c.registry is registry
    assert (registry.get_sample_value("monitor_bus_taken"), c.skipped_names) == (0.0, 1)
    assert registry.get_sample_value("monitor_bus_free") == 2.0


def test_metric_name_sanitizing() -> None:
    """Names keep [a-zA-Z0-9_:], others become `_`, and never start with a digit."""
    assert metric_name("monitor_bus", "step_time.mean") == "monitor_bus_step_time_mean"
    assert metric_name("ns", "a:b-c d") == "ns_a:b_c_d"
    assert metric_name("", "1st.max") == "_1st_max"
    assert metric_name("", "é") == "_"
    # Prometheus reserves _count and _sum for histograms and summaries, and a name that
    # holds its type fails promtool: the window's count, sum and histogram are renamed.
    assert metric_name("monitor_bus", "step_time.count") == "monitor_bus_step_time_samples"
    assert metric_name("ns", "s.sum") == "ns_s_sum_of_samples"
    assert metric_name("ns", "lat.histogram") == "ns_lat"
    assert metric_name("ns", "count") == "ns_count"  # a bare key is no aggregation


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"registry": {}}, TypeError, "registry"),
        ({"namespace": "bad-ns"}, ValueError, "namespace"),
        ({"namespace": 3}, TypeError, "namespace"),
        ({"labels": {"__rank": "0"}}, ValueError, "labels"),
        ({"labels": {"rank": 0}}, TypeError, "labels"),
        ({"labels": {"reason": "x"}}, ValueError, "labels"),
    ],
)
def test_bad_arguments_raise_naming_them(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    """Invalid constructor arguments raise an exception that names the argument."""
    with pytest.raises(error, match=match):
        PrometheusEventHandler(**kwargs)  # type: ignore[arg-type]


def test_serve_exposes_the_registry_on_loopback(bus: EventBus) -> None:
    """serve(0) binds 127.0.0.1 on a free port and /metrics shows the gauges."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.25}))
    assert bus.flush(10)
    with prom.serve(0) as server:
        assert server.addr == "127.0.0.1"
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=10) as response:
            body = response.read().decode()
    assert "monitor_bus_step_time_mean 0.25\n" in body
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", server.port), timeout=5),
    ):
        pass  # closed: the port is released


def test_serve_on_a_port_in_use_names_the_port() -> None:
    """A port already in use gives an OSError naming the address and the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}: port {port} is already in use"):
            serve(port, registry=CollectorRegistry())


@pytest.mark.parametrize(
    ("port", "error"), [(-1, ValueError), (70000, ValueError), ("80", TypeError)]
)
def test_serve_rejects_bad_ports(port: object, error: type[Exception]) -> None:
    """A port that is not an int in 0..65535 raises an exception naming `port`."""
    with pytest.raises(error, match="port"):
        serve(port, registry=CollectorRegistry())  # type: ignore[arg-type]


# -- a real Prometheus server --


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """Debian's prometheus binary on loopback, scraping one target every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: monitor_bus\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "prometheus.log").open("w+")
        self.proc = subprocess.Popen(
            [
                shutil.which("prometheus") or "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, promql: str) -> list[dict[str, object]] | None:
        """The query's result vector, or None while Prometheus is not answering yet."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except OSError:
            return None
        assert body["status"] == "success", body
        return body["data"]["result"]  # type: ignore[no-any-return]

    def wait_for(self, promql: str, deadline: float) -> list[dict[str, object]]:
        """Poll the query until it returns samples; fail with Prometheus's log at the deadline."""
        pause = threading.Event()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            result = self.query(promql)
            if result:
                return result
            pause.wait(0.2)
        self.log.seek(0)
        pytest.fail(
            f"no samples for {promql!r}; prometheus exit={self.proc.poll()} log:\n{self.log.read()}"
        )

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    require(path is not None, "the prometheus binary is not installed (apt-get install prometheus)")
    assert path is not None
    return path


def test_real_prometheus_scrapes_the_gauges(
    prometheus_binary: str, bus: EventBus, tmp_path: Path
) -> None:
    """A real Prometheus server scraping serve()'s endpoint stores the Stat values and skip counts."""
    prom = PrometheusEventHandler(labels={"rank": "0"})
    bus.register_event_handler(prom)
    bus.log_event(
        Event(STAT_EVENT, T0, {"step_time.mean": 0.25, "loss (val).max": 3.5, "note": "text"})
    )
    bus.log_event(distribution_window(WINDOW_SAMPLES[0]))
    assert bus.flush(10)
    with prom.serve(0) as endpoint:
        server = PrometheusServer(tmp_path, f"127.0.0.1:{endpoint.port}")
        try:
            deadline = time.monotonic() + 40
            (sample,) = server.wait_for("monitor_bus_step_time_mean", deadline)
            assert sample["metric"] == {
                "__name__": "monitor_bus_step_time_mean",
                "instance": f"127.0.0.1:{endpoint.port}",
                "job": "monitor_bus",
                "rank": "0",
            }
            assert sample["value"][1] == "0.25"  # type: ignore[index]
            (sample,) = server.wait_for("monitor_bus_loss__val__max", deadline)
            assert sample["value"][1] == "3.5"  # type: ignore[index]
            (sample,) = server.wait_for(
                'monitor_bus_skipped_total{reason="string_value"}', deadline
            )
            assert sample["value"][1] == "1"  # type: ignore[index]
            # A window's Histogram is a histogram: its le buckets count the samples below.
            for le, below in (("0.0", "2"), ("+Inf", "8")):
                (sample,) = server.wait_for(f'monitor_bus_lat_bucket{{le="{le}"}}', deadline)
                assert sample["value"][1] == below  # type: ignore[index]
            # A later window replaces the value at the next scrape.
            bus.log_event(Event(STAT_EVENT, T0, {"step_time.mean": 0.75}))
            assert bus.flush(10)
            (sample,) = server.wait_for("monitor_bus_step_time_mean == 0.75", deadline)
            assert sample["value"][1] == "0.75"  # type: ignore[index]
        finally:
            server.close()


# -- distributions: a window's Histogram, percentiles and stddev --


def scrape(prom: PrometheusEventHandler) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The handler's registry as a scrape reads it: samples by name, through
    prometheus_client's text parser."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(prom.registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def check_le_buckets(
    buckets: list[tuple[dict[str, str], float]], samples: list[float], most: int
) -> None:
    """Each ``le`` bucket counts exactly the samples at or below its bound; at most ``most``
    bounds besides +Inf, which counts them all (NaN too)."""
    bounds = [(float(labels["le"]), value) for labels, value in buckets]
    assert bounds[-1] == (math.inf, len(samples))
    assert 1 < len(bounds) <= most + 1
    assert [b for b, _ in bounds] == sorted(b for b, _ in bounds)
    finite = bounds[:-1]
    assert [value for _, value in finite] == [sum(s <= b for s in samples) for b, _ in finite]


def test_histogram_is_a_prometheus_histogram_with_le_buckets(bus: EventBus) -> None:
    """A window's Histogram becomes a histogram whose le buckets, count and sum hold every
    window so far (Prometheus histograms are cumulative), without count and sum once a sample
    is negative (OpenMetrics); percentiles and stddev are gauges."""
    prom = PrometheusEventHandler(labels={"rank": "3"})
    bus.register_event_handler(prom)
    seen: list[float] = []
    for samples in WINDOW_SAMPLES:
        window = distribution_window(samples)
        positive = [abs(s) for s in samples]
        bus.log_event(window)
        bus.log_event(distribution_window(positive, name="pos"))
        assert bus.flush(10)
        seen += samples
        got = scrape(prom)
        assert {labels["rank"] for labels, _ in got["monitor_bus_lat_bucket"]} == {"3"}
        check_le_buckets(got["monitor_bus_lat_bucket"], seen, MAX_LE_BUCKETS)
        assert "monitor_bus_lat_sum" not in got
        check_le_buckets(got["monitor_bus_pos_bucket"], [abs(s) for s in seen], MAX_LE_BUCKETS)
        assert got["monitor_bus_pos_count"] == [({"rank": "3"}, len(seen))]
        sums = got["monitor_bus_pos_sum"]
        assert sums == [({"rank": "3"}, math.fsum(abs(s) for s in seen))]
        for key in ("p50", "p99", "stddev"):
            assert got[f"monitor_bus_lat_{key}"] == [({"rank": "3"}, window.data[f"lat.{key}"])]
    assert (prom.skipped_values, prom.skipped_names) == (0, 0)


def test_le_buckets_are_bounded_and_exact() -> None:
    """Samples spanning 600 octaves get at most MAX_LE_BUCKETS bounds (the lowest grid
    bounds they bring), each counting its samples exactly; -inf counts at every bound, +inf
    and NaN at +Inf only."""
    rng = random.Random(22)
    wide = [rng.choice((-1, 1)) * 2.0 ** rng.uniform(-300, 300) for _ in range(3000)]
    for samples in (wide, [*wide[:50], -math.inf, math.inf, 0.0]):
        buckets = le_buckets(Histogram.of(samples))
        check_le_buckets([({"le": le}, n) for le, n in buckets], samples, MAX_LE_BUCKETS)
    for samples, most in (([math.nan, 2.5], 1), (wide, 3)):
        buckets = le_buckets(Histogram.of(samples), max_buckets=most)
        check_le_buckets([({"le": le}, n) for le, n in buckets], samples, most)


def grid_at_or_above(sample: float) -> float:
    """The least bound of the grid (0 and +-2**k) at or above ``sample``."""
    if sample > 0:
        return 2.0 ** math.ceil(math.log2(sample))
    return -(2.0 ** math.floor(math.log2(-sample))) if sample < 0 else 0.0


def scrape_windows(windows: list[list[float]], bus: EventBus) -> list[dict[float, float]]:
    """Log each of ``windows`` to a fresh handler and scrape it after each, checking every
    scrape's le buckets against the raw samples so far: the ``le`` bounds and their counts,
    one dict per scrape."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    seen: list[float] = []
    scrapes = []
    for samples in windows:
        bus.log_event(distribution_window(samples))
        assert bus.flush(10)
        seen += samples
        buckets = scrape(prom)["monitor_bus_lat_bucket"]
        check_le_buckets(buckets, seen, MAX_LE_BUCKETS)
        scrapes.append({float(labels["le"]): value for labels, value in buckets})
    return scrapes


def assert_bounds_stay(scrapes: list[dict[float, float]]) -> None:
    """Every bound of a scrape is in the next one, with a count at least as large."""
    for before, after in zip(scrapes, scrapes[1:], strict=False):
        assert set(before) <= set(after)
        assert [b for b in before if after[b] < before[b]] == []


def test_le_bounds_stay_and_their_counts_only_grow(bus: EventBus) -> None:
    """Prometheus classic histograms need stable bounds: a bound once scraped stays, and its
    count only grows, however finely the later windows are bucketed. The bounds are the grid
    bounds (0, +-2**k) at or above the samples."""
    rng = random.Random(26)
    windows = [
        [1.0 + i / 10 for i in range(10)],
        [1.0 + i / 1000 for i in range(1000)],  # same range, finer buckets
        [rng.uniform(-50.0, 3000.0) for _ in range(500)],  # wider, two-signed
    ]
    scrapes = scrape_windows(windows, bus)
    assert_bounds_stay(scrapes)
    seen: list[float] = []
    for samples, got in zip(windows, scrapes, strict=True):
        seen += samples
        assert set(got) == {grid_at_or_above(s) for s in seen} | {math.inf}


def test_le_bounds_past_the_most_keep_the_first_ones(bus: EventBus) -> None:
    """Past MAX_LE_BUCKETS bounds no bound is added or dropped: a window adds its lowest new
    grid bounds while there is room; samples past the bounds count at the outermost bound
    above them, or at +Inf only."""
    rng = random.Random(25)
    narrow = [2.0 ** rng.uniform(-20.0, 20.0) for _ in range(2000)]
    wide = [rng.choice((-1, 1)) * 2.0 ** rng.uniform(-300.0, 300.0) for _ in range(3000)]
    later = [2.0 ** rng.uniform(200.0, 300.0) for _ in range(100)]
    first, second, third = scrapes = scrape_windows([narrow, wide, later], bus)
    assert_bounds_stay(scrapes)
    first_bounds = {grid_at_or_above(s) for s in narrow}
    assert set(first) == first_bounds | {math.inf}
    brought = sorted({grid_at_or_above(s) for s in wide} - first_bounds)
    added = brought[: MAX_LE_BUCKETS - len(first_bounds)]
    assert set(second) == first_bounds | set(added) | {math.inf}
    assert len(second) == MAX_LE_BUCKETS + 1
    assert set(third) == set(second)


def test_histogram_whose_name_is_taken_is_skipped_and_counted(bus: EventBus) -> None:
    """A histogram whose metric name the registry already has is skipped and counted."""
    registry = CollectorRegistry()
    Gauge("monitor_bus_lat_count", "someone else's", registry=registry)
    prom = PrometheusEventHandler(registry)
    bus.register_event_handler(prom)
    bus.log_event(distribution_window(WINDOW_SAMPLES[0]))
    assert bus.flush(10)
    assert prom.skipped_names == 1
    assert registry.get_sample_value("monitor_bus_skipped_total", {"reason": "name_taken"}) == 1
    assert registry.get_sample_value("monitor_bus_lat_p50") is not None


def test_a_real_stat_window_becomes_a_histogram(bus: EventBus) -> None:
    """A window of a real Stat with HISTOGRAM is scraped as le buckets of its samples."""
    prom = PrometheusEventHandler()
    bus.register_event_handler(prom)
    real_window(bus, WINDOW_SAMPLES[0])
    assert bus.flush(10)
    got = scrape(prom)
    check_le_buckets(got["monitor_bus_lat_bucket"], WINDOW_SAMPLES[0], MAX_LE_BUCKETS)
    assert {"monitor_bus_lat_p50", "monitor_bus_lat_p99", "monitor_bus_lat_stddev"} < set(got)


def _in_forked_child(child: Callable[[], str], timeout: float = 30) -> tuple[str, int]:
    """``os.fork`` a child that runs ``child()`` and writes its answer to a pipe; return the
    answer ("(no answer)" if none came within ``timeout``: the child is killed) and its exit
    code."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.write(write, child().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        ready = select.select([read], [], [], timeout)[0]
        answer = os.read(read, 1000).decode() if ready else "(no answer)"
    finally:
        if answer == "(no answer)":
            os.kill(pid, signal.SIGKILL)
        os.close(read)
    _, status = os.waitpid(pid, 0)
    return answer, os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("held_in", ["making a gauge", "adding a histogram"])
def test_a_forked_child_never_waits_for_a_lock_a_parent_thread_held(held_in: str) -> None:
    """children="own": a parent thread is inside the handler holding its lock at the fork
    (making a metric, or adding a window's histogram); the child's copy of the handler sets a
    new gauge and a histogram, and its bus flushes (the lock used to stay held for ever)."""
    prom = PrometheusEventHandler()
    bus = EventBus(name="prom-fork", children="own")
    bus.register_event_handler(prom)
    bus.log_event(from_slots(STAT_EVENT, T0, {"lat.histogram": Histogram.of([1.0])}))
    assert bus.flush(10)
    entered, release = threading.Event(), threading.Event()
    parent = os.getpid()

    class Held(Histogram):
        """A window's histogram whose buckets are read slowly, in the parent only."""

        def buckets(self) -> list[tuple[float, float, int]]:
            if os.getpid() == parent:
                entered.set()
                release.wait(60)
            return super().buckets()

    def blocking(name: str, help_text: str) -> None:
        entered.set()
        release.wait(60)

    if held_in == "making a gauge":
        holder = threading.Thread(target=prom._make_metric, args=("held", {}, blocking))
    else:
        held = Held.__new__(Held)
        held.__setstate__(Histogram.of([2.0]).__getstate__())
        holder = threading.Thread(target=prom._histograms["lat.histogram"].add, args=(held,))
    holder.start()
    try:
        assert entered.wait(10)

        def child() -> str:
            data = {"child.mean": 1.5, "lat.histogram": Histogram.of([3.0])}
            bus.log_event(from_slots(STAT_EVENT, T0, data))
            flushed = bus.flush(10)
            get = prom.registry.get_sample_value
            return repr((flushed, get("monitor_bus_child_mean"), get("monitor_bus_lat_count")))

        answer = _in_forked_child(child)
    finally:
        release.set()
        holder.join(10)
    assert answer == ("(True, 1.5, 2)", 0)
    assert bus.close(10)
