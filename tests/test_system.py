"""monitor_bus.system: the process tree, the host and the rank's GPUs sampled into Stats.

There is no GPU here: the rank-to-GPU rule is tested through its seam (``_rank_gpus``), and the
NVML path through an NVML stand-in given as ``_nvml`` (``benchmarks/system_metrics.py
--device cuda`` takes the real one on a machine that has a GPU).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from typing import Any

import psutil
import pytest

import monitor_bus
from monitor_bus import _default, system
from monitor_bus.system import SystemMetrics, _rank_gpus

from .conftest import Recorder, require

HOUR = timedelta(hours=1)
# The thread's first sample is the baseline; with this interval it takes no other.
NEVER = 3600.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def windows(recorder: Recorder) -> dict[str, float]:
    """Every Stat window's data the recorder got, merged (one window per Stat here)."""
    data: dict[str, float] = {}
    for event in recorder.events:
        if event.name == monitor_bus.STAT_EVENT:
            data.update(event.data)  # type: ignore[arg-type]
    return data


@pytest.fixture
def recorded(bus: monitor_bus.EventBus, recorder: Recorder) -> Recorder:
    bus.register_event_handler(recorder)
    return recorder


def started(metrics: SystemMetrics) -> SystemMetrics:
    """``metrics`` once its thread has taken the baseline sample."""
    assert metrics._baseline.wait(30)
    return metrics


# A child that burns CPU_SECONDS of CPU, says so, then holds MIB of memory until its stdin ends;
# with "spawn" as its argument it first starts a grandchild that does the same and waits for it.
CPU_SECONDS = 0.25
MIB = 64
_BURNER = textwrap.dedent(
    f"""
    import subprocess, sys, time
    if sys.argv[1:] == ["spawn"]:
        grandchild = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert grandchild.stdout.readline() == b"done\\n"
    else:
        held = b"x" * ({MIB} << 20)  # written, so resident
        start = time.process_time()
        while time.process_time() - start < {CPU_SECONDS}:
            pass
    print("done", flush=True)
    sys.stdin.read()
    if sys.argv[1:] == ["spawn"]:
        grandchild.stdin.close()
        grandchild.wait()
    """
)


def test_process_cpu_and_rss_count_every_descendant(
    bus: monitor_bus.EventBus, recorded: Recorder, tmp_path: Any
) -> None:
    """The tree's CPU holds a child's that ended and was reaped and a live grandchild's; its
    RSS holds the live descendants' memory."""
    script = tmp_path / "burner.py"
    script.write_text(_BURNER)
    metrics = started(SystemMetrics(NEVER, bus=bus, window=HOUR, gpus=None, counters=True))
    began = time.monotonic()
    metrics.sample()  # the start of the interval measured
    with subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    ) as ended_child:
        assert ended_child.wait(60) == 0  # reaped: its CPU is in this process's children times
    with subprocess.Popen(
        [sys.executable, str(script), "spawn"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as live:
        assert live.stdout.readline() == b"done\n"  # type: ignore[union-attr]
        own_rss = psutil.Process().memory_info().rss
        metrics.sample()  # the end: the grandchild is alive, holding its memory
        wall = time.monotonic() - began
        live.stdin.close()  # type: ignore[union-attr]  # both end
    assert metrics.close()
    assert bus.flush(10)
    data = windows(recorded)
    # Two descendants burned CPU_SECONDS each within at most `wall` seconds.
    assert data["system.process_cpu_percent.max"] >= 2 * CPU_SECONDS / wall * 100
    # The cumulative counter holds their CPU too (and this process's own), as its last reading.
    assert data["system.process_cpu_seconds_total.value"] >= 2 * CPU_SECONDS
    assert data["system.process_rss_bytes.max"] >= own_rss + (MIB << 20)


def test_host_metrics_only_on_local_rank_0(bus: monitor_bus.EventBus) -> None:
    """Local rank 0 (or no launcher) samples the host; another local rank only its tree."""
    counters = psutil.disk_io_counters() is not None, psutil.net_io_counters() is not None
    host = {"system.host_cpu_percent", "system.host_memory_percent"}
    if counters[0]:
        host |= {"system.disk_read_bytes_per_s", "system.disk_write_bytes_per_s"}
    if counters[1]:
        host |= {"system.net_sent_bytes_per_s", "system.net_recv_bytes_per_s"}
    tree = {"system.process_cpu_percent", "system.process_rss_bytes"}
    for environ, expected in (({}, tree | host), ({"LOCAL_RANK": "1"}, tree)):
        metrics = started(SystemMetrics(NEVER, bus=bus, gpus=None, _environ=environ))
        try:
            # Rates need the kernel's counters to move (CPU times in clock ticks) between two
            # samples: sample until the CPU's is there.
            deadline = time.monotonic() + 30
            while "system.process_cpu_percent" not in metrics.metrics or (
                environ == {} and "system.host_cpu_percent" not in metrics.metrics
            ):
                assert time.monotonic() < deadline, metrics.metrics
                metrics.sample()
            assert set(metrics.metrics) == expected, environ
        finally:
            assert metrics.close()


def test_counters_add_the_cumulative_totals(bus: monitor_bus.EventBus, recorded: Recorder) -> None:
    """counters=True adds each rate's counter as it stands (VALUE: its last reading), and the
    tree's CPU seconds, from the first sample on; the rates and the rest are as without."""
    counters = psutil.disk_io_counters(), psutil.net_io_counters()
    metrics = started(SystemMetrics(NEVER, bus=bus, window=HOUR, gpus=None, counters=True))
    assert metrics.close()
    assert bus.flush(10)
    data = windows(recorded)
    totals = {key: value for key, value in data.items() if "_total" in key}
    expected = {"system.process_cpu_seconds_total.value"}
    if counters[0] is not None:
        expected |= {"system.disk_read_bytes_total.value", "system.disk_write_bytes_total.value"}
        assert totals["system.disk_read_bytes_total.value"] >= counters[0].read_bytes
    if counters[1] is not None:
        expected |= {"system.net_sent_bytes_total.value", "system.net_recv_bytes_total.value"}
        assert totals["system.net_recv_bytes_total.value"] >= counters[1].bytes_recv
    assert set(totals) == expected
    own = psutil.Process().cpu_times()
    assert totals["system.process_cpu_seconds_total.value"] >= own.user + own.system


@pytest.mark.parametrize(
    ("environ", "gpus"),
    [
        ({}, None),  # no launcher, nothing hidden: every device
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
        ({"LOCAL_RANK": "1"}, ["1"]),  # torchrun: cuda:LOCAL_RANK
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, ["3"]),
        ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "5"}, ["5"]),  # one device per rank
        ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, []),  # not among the visible
        ({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, ["0"]),  # CUDA stops at the first invalid one
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f3e, GPU-11aa", "LOCAL_RANK": "1"}, ["GPU-11aa"]),
    ],
)
def test_rank_gpus_from_the_launcher(environ: dict[str, str], gpus: list[str] | None) -> None:
    """A rank's GPUs follow CUDA_VISIBLE_DEVICES and LOCAL_RANK as torchrun's ranks use them."""
    assert _rank_gpus(environ) == gpus


def test_a_bad_local_rank_names_the_variable(bus: monitor_bus.EventBus) -> None:
    """LOCAL_RANK that is not a rank is a ValueError naming it."""
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        SystemMetrics(NEVER, bus=bus, _environ={"LOCAL_RANK": "x"})


class FakeNvml:
    """NVML's calls as nvidia-ml-py makes them, for devices 0-3; device 3 reports no power."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - NVML's spelling
        pass

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.block = threading.Event()  # set: readings wait for release
        self.entered = threading.Event()
        self.release = threading.Event()

    def nvmlInit(self) -> None:  # noqa: N802
        self.calls.append("init")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 4

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        self.calls.append(f"handle {index}")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:  # noqa: N802
        raise self.NVMLError(f"no device {uuid}")

    def nvmlDeviceGetIndex(self, handle: int) -> int:  # noqa: N802
        return handle

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        if self.block.is_set():
            self.entered.set()
            self.release.wait()
        return type("Rates", (), {"gpu": 50 + handle, "memory": 0})()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        return type("Memory", (), {"used": (handle + 1) << 30})()

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802
        if handle == 3:
            raise self.NVMLError_NotSupported("power")
        return 250_000 + handle  # mW

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:  # noqa: N802
        return 60 + handle


def test_gpu_metrics_of_the_rank_s_own_device(
    bus: monitor_bus.EventBus, recorded: Recorder
) -> None:
    """Local rank 1 of CUDA_VISIBLE_DEVICES=2,3 samples device 3 alone, through one cached
    handle; a reading the device does not support is left out; NVML is shut down at close."""
    nvml = FakeNvml()
    environ = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    metrics = started(SystemMetrics(NEVER, bus=bus, window=HOUR, _nvml=nvml, _environ=environ))
    metrics.sample()
    metrics.sample()
    assert [m for m in metrics.metrics if ".gpu" in m] == [
        "system.gpu3.memory_used_bytes",
        "system.gpu3.temperature_c",
        "system.gpu3.utilization_percent",
    ]
    assert metrics.close()
    assert bus.flush(10)
    data = windows(recorded)
    assert data["system.gpu3.utilization_percent.mean"] == 53.0
    assert data["system.gpu3.memory_used_bytes.max"] == 4 << 30
    assert data["system.gpu3.temperature_c.min"] == 63.0
    assert nvml.calls == ["init", "handle 3", "shutdown"]


def test_gpus_given_by_index(bus: monitor_bus.EventBus, recorded: Recorder) -> None:
    """``gpus=[0, 1]`` samples those devices, power in watts."""
    metrics = started(SystemMetrics(NEVER, bus=bus, window=HOUR, gpus=[0, 1], _nvml=FakeNvml()))
    assert metrics.close()
    assert bus.flush(10)
    data = windows(recorded)
    assert data["system.gpu0.power_watts.mean"] == 250.0
    assert data["system.gpu1.power_watts.mean"] == 250.001


class FailingNvml(FakeNvml):
    """nvidia-ml-py's own module with FakeNvml's devices: its error classes, and a reading
    that raises the error ``failing`` maps (device, call) to."""

    def __init__(self) -> None:
        super().__init__()
        import pynvml

        self.NVMLError = pynvml.NVMLError  # type: ignore[misc]
        self.NVMLError_NotSupported = pynvml.NVMLError_NotSupported  # type: ignore[misc]
        self.failing: dict[tuple[int, str], type[Exception]] = {}
        self.tick = 0  # its square is added to utilization, ten times that to temperature

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        error = self.failing.get((handle, "utilization"))
        if error is not None:
            raise error()
        rates = super().nvmlDeviceGetUtilizationRates(handle)
        rates.gpu += self.tick**2
        return rates

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:  # noqa: N802
        error = self.failing.get((handle, "temperature"))
        if error is not None:
            raise error()
        return super().nvmlDeviceGetTemperature(handle, sensor) + 10 * self.tick**2


def test_an_nvml_error_costs_that_reading_of_that_sample_only(
    bus: monitor_bus.EventBus, recorded: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """An NVML error on one device's reading (GPU lost, unknown) loses that reading of that
    sample only: the other readings and devices go on, it is read again at the next sample,
    counted in ``missed`` and warned of once per reading and interval, naming it."""
    require(importlib.util.find_spec("pynvml") is not None, "nvidia-ml-py is not installed")
    import pynvml

    nvml = FailingNvml()
    metrics = started(SystemMetrics(NEVER, bus=bus, window=HOUR, gpus=[0, 1], _nvml=nvml))
    nvml.failing = {
        (1, "temperature"): pynvml.NVMLError_GpuIsLost,
        (0, "utilization"): pynvml.NVMLError_Unknown,
    }
    for tick in (1, 2):
        nvml.tick = tick
        metrics.sample()
    nvml.failing = {}
    nvml.tick = 3
    metrics.sample()
    assert metrics.close()
    assert bus.flush(10)
    data = windows(recorded)
    # Readings at ticks 0 to 3 hold tick**2 (0, 1, 4, 9): which samples they are in shows.
    # Device 0 read its temperature at every sample, device 1 at ticks 0 and 3 only.
    assert data["system.gpu0.temperature_c.mean"] == 60 + 10 * 14 / 4
    assert (data["system.gpu1.temperature_c.min"], data["system.gpu1.temperature_c.max"]) == (
        61.0,
        151.0,
    )
    assert data["system.gpu1.temperature_c.mean"] == 106.0
    # Device 1 read its utilization at every sample, device 0 at ticks 0 and 3 only.
    assert data["system.gpu1.utilization_percent.mean"] == 51 + 14 / 4
    assert data["system.gpu0.utilization_percent.mean"] == 50 + 9 / 2
    assert data["system.gpu0.memory_used_bytes.mean"] == 1 << 30
    warned = sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert warned == [
        "monitor_bus.system: NVML could not read gpu0.utilization_percent (Unknown Error);"
        " that reading is left out of this sample and taken again at the next"
        " (1 missed so far)",
        "monitor_bus.system: NVML could not read gpu1.temperature_c (GPU is lost);"
        " that reading is left out of this sample and taken again at the next"
        " (1 missed so far)",
    ]


def test_close_is_idempotent_bounded_and_logs_open_windows(
    bus: monitor_bus.EventBus, recorded: Recorder
) -> None:
    """close() while a sample hangs in NVML returns False within its timeout, having logged
    the windows open so far; once the sample ends, close() returns True."""
    nvml = FakeNvml()
    nvml.block.set()
    metrics = SystemMetrics(NEVER, bus=bus, window=HOUR, gpus=[0], _nvml=nvml)
    assert nvml.entered.wait(30)  # the first sample hangs on the GPU, after the tree's readings
    assert metrics.close(timeout=0.05) is False
    assert metrics.closed
    assert bus.flush(10)
    assert "system.process_rss_bytes.mean" in windows(recorded)
    logged = len(recorded.events)
    assert metrics.close(timeout=0.05) is False  # still hung; nothing logged twice
    assert bus.flush(10)
    assert len(recorded.events) == logged
    nvml.release.set()
    assert metrics.close(timeout=30) is True
    assert metrics.close() is True


def test_close_in_a_with_block(bus: monitor_bus.EventBus, recorded: Recorder) -> None:
    """The with block's end closes the sampler and logs its windows."""
    with SystemMetrics(NEVER, bus=bus, window=HOUR, gpus=None) as metrics:
        started(metrics)
    assert metrics.closed
    assert bus.flush(10)
    assert "system.process_rss_bytes.mean" in windows(recorded)
    assert not any(t.name == "monitor_bus-system" for t in threading.enumerate())


def test_one_sampler_per_bus(bus: monitor_bus.EventBus) -> None:
    """A second sampler on a bus is a RuntimeError while the first runs; other buses, and the
    same bus once the first is closed, take one."""
    first = SystemMetrics(NEVER, bus=bus, gpus=None)
    with pytest.raises(RuntimeError, match="bus 'test' already has a SystemMetrics"):
        SystemMetrics(NEVER, bus=bus, gpus=None)
    with monitor_bus.EventBus(name="other") as other:
        SystemMetrics(NEVER, bus=other, gpus=None).close()
    first.close()
    SystemMetrics(NEVER, bus=bus, gpus=None).close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"interval": 0}, ValueError, "interval must be a positive"),
        ({"interval": "1"}, TypeError, "interval must be a number of seconds"),
        ({"window": 60}, TypeError, "window must be a timedelta"),
        ({"gpus": "all"}, ValueError, 'gpus must be "auto"'),
        ({"gpus": [-1]}, ValueError, "gpus must hold indices >= 0"),
        ({"gpus": [1.0]}, TypeError, "gpus must be GPU indices"),
        ({"bus": "default"}, TypeError, "bus must be a monitor_bus.EventBus"),
        ({"counters": 1}, TypeError, "counters must be a bool"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type, message: str) -> None:
    """Each bad argument is an exception naming it."""
    with pytest.raises(error, match=message):
        SystemMetrics(**kwargs)


def running(bus: monitor_bus.EventBus) -> SystemMetrics | None:
    sampler = system._running.get(id(bus))
    return None if sampler is None or sampler.closed else sampler


def test_environment_variable_starts_it_on_the_default_bus(monkeypatch: pytest.MonkeyPatch) -> None:
    """MONITOR_BUS_SYSTEM_INTERVAL starts a sampler with that interval when the default bus is
    made; 0 starts none; the reset closes it."""
    monkeypatch.setenv("MONITOR_BUS_SYSTEM_INTERVAL", "2.5")
    bus = monitor_bus.get_default_bus()
    sampler = running(bus)
    assert sampler is not None
    assert sampler.interval == 2.5
    _default._reset_default_bus()
    assert sampler.closed
    monkeypatch.setenv("MONITOR_BUS_SYSTEM_INTERVAL", "0")
    assert running(monitor_bus.get_default_bus()) is None


def test_configure_default_bus_starts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """configure_default_bus(system_interval=...) starts one, over the environment's 0."""
    monkeypatch.setenv("MONITOR_BUS_SYSTEM_INTERVAL", "0")
    monitor_bus.configure_default_bus(system_interval=7)
    sampler = running(monitor_bus.get_default_bus())
    assert sampler is not None
    assert sampler.interval == 7.0


def test_bad_system_interval_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad interval names the environment variable, or the argument."""
    with pytest.raises(ValueError, match="system_interval must be a finite number"):
        monitor_bus.configure_default_bus(system_interval=-1)
    monkeypatch.setenv("MONITOR_BUS_SYSTEM_INTERVAL", "often")
    with pytest.raises(ValueError, match="MONITOR_BUS_SYSTEM_INTERVAL='often' is invalid"):
        monitor_bus.get_default_bus()


_NO_PSUTIL = textwrap.dedent(
    """
    import sys
    sys.modules["psutil"] = None  # unimportable, as where it is not installed
    sys.modules["pynvml"] = None
    from datetime import timedelta
    import monitor_bus
    from monitor_bus.system import SystemMetrics

    bus = monitor_bus.EventBus(name="train")
    seen = []
    bus.register_event_handler(seen.append)
    loss = monitor_bus.Stat("loss", [monitor_bus.Aggregation.MEAN], timedelta(hours=1), bus=bus)
    for _ in range(2):  # a second sampler does not warn again
        with SystemMetrics(3600, bus=bus) as metrics:
            metrics.sample()
            loss.add(0.5)
        print("metrics", metrics.metrics)
    SystemMetrics(3600, bus=bus, gpus=[0]).close()  # GPUs asked for: nvidia-ml-py is missing
    loss._close()
    bus.flush()
    print("trained", [e.data for e in seen])
    """
)


def test_without_psutil_one_warning_and_training_goes_on() -> None:
    """With psutil (and nvidia-ml-py) unimportable, each is one warning naming the package and
    the extra, no exception, and the training's own Stats are logged."""
    run = subprocess.run(
        [sys.executable, "-c", _NO_PSUTIL],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "metrics []",
        "metrics []",
        "trained [{'loss.mean': 0.5}]",
    ]
    assert run.stderr.splitlines() == [
        "monitor_bus.system: psutil is not installed, so process and host metrics are not"
        " sampled; pip install 'monitor_bus[system]'",
        "monitor_bus.system: nvidia-ml-py is not installed, so GPU metrics are not sampled;"
        " pip install 'monitor_bus[system]'",
    ]


def test_nvml_without_a_driver_is_one_warning(
    bus: monitor_bus.EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """GPUs asked for where NVML cannot load (no driver here): one warning saying so, and the
    process metrics go on."""
    require(importlib.util.find_spec("pynvml") is not None, "nvidia-ml-py is not installed")
    if os.path.exists("/dev/nvidiactl"):  # not a missing dependency: CI=true skips it too
        pytest.skip("this host has an NVIDIA driver, so NVML loads")
    metrics = started(SystemMetrics(NEVER, bus=bus, gpus=[0]))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith("monitor_bus.system: NVML is unavailable, so no GPU metrics")
    assert "system.process_rss_bytes" in metrics.metrics
    assert not [m for m in metrics.metrics if ".gpu" in m]
    assert metrics.close()


def report_sampler(conn: Any) -> None:
    """In a spawned child: whether it reports to the parent, and whether its default bus has a
    sampler (a spawn child's target, so at module level)."""
    from monitor_bus._lifecycle import process

    bus = monitor_bus.get_default_bus()
    conn.send((process.uplink is not None, running(bus) is not None))
    conn.close()


def test_a_child_reporting_to_its_parent_starts_no_sampler(
    monkeypatch: pytest.MonkeyPatch, recorder: Recorder
) -> None:
    """MONITOR_BUS_SYSTEM_INTERVAL, inherited by a spawned worker, starts no sampler there: the
    parent's process tree already counts the worker."""
    import multiprocessing

    monkeypatch.setenv("MONITOR_BUS_SYSTEM_INTERVAL", "3600")
    monitor_bus.register_event_handler(recorder)  # the parent listens for its children
    assert running(monitor_bus.get_default_bus()) is not None
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=report_sampler, args=(theirs,))
    child.start()
    theirs.close()
    assert ours.recv() == (True, False)
    child.join(60)
    assert child.exitcode == 0
    ours.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_may_run_its_own_sampler(bus: monitor_bus.EventBus) -> None:
    """A forked child's copy of the parent's sampler runs no thread: closing it does nothing
    there, and the child may start a sampler of its own on the bus."""
    metrics = started(SystemMetrics(NEVER, bus=bus, gpus=None))
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status
        code = 1
        try:
            copy_closed = metrics.close(timeout=0) is True
            own = SystemMetrics(NEVER, bus=bus, gpus=None)
            code = 0 if copy_closed and started(own).close() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not metrics.closed  # the parent's sampler runs on
    assert metrics.close()
