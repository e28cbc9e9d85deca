"""System metrics: the process tree, the host and the rank's own GPUs, sampled as Stats.

``SystemMetrics`` samples on a thread of its own and adds each reading to a ``Stat`` named
``system.<metric>``, so system metrics get windows, every sink, the child relay and the merge
across ranks as any Stat does. Needs the ``system`` extra (psutil, nvidia-ml-py): ``pip
install 'monitor_bus[system]'``. ``import monitor_bus`` does not import this module, nor does
this module import psutil or NVML before a ``SystemMetrics`` is made.

Guarantees
----------
- Off the training thread: every reading (``/proc``, NVML) runs on the sampler's daemon thread
  ``monitor_bus-system``, never the caller's and never the dispatcher's loop; the caller's
  thread only makes the Stats. The first sample is a baseline: rates (CPU, disk, network)
  are reported from the second sample on.
- The process tree: ``process_cpu_percent`` (100 = one core) and ``process_rss_bytes`` cover
  this process and all its live descendants (DataLoader workers, pools), and the CPU of those
  that ended and were reaped (their parent's children times hold it), so a worker's CPU is
  counted once, live or ended. RSS is summed over the processes (pages they share counted
  once per process).
- One rank per host: host-wide metrics (CPU, memory, disk, network) are sampled only where
  ``LOCAL_RANK`` is 0 or unset (a process no launcher started), so a node is not counted once
  per rank; every rank samples its own tree and its own GPUs.
- The rank's GPUs (``gpus="auto"``): with ``LOCAL_RANK`` set, the one device it uses by
  torchrun's convention (``CUDA_VISIBLE_DEVICES``'s entry at ``LOCAL_RANK``, or its only entry);
  without, every visible device. One home for the rule: ``_rank_gpus``. NVML handles are taken
  once; a reading a device does not support is left out for that device from then on. Another
  NVML error (a GPU lost, a timeout) costs that device's reading of that sample only: it is
  counted in ``missed``, warned of (rate-limited) and taken again at the next sample.
- A missing library is one warning (per package and process) naming the package and the
  ``system`` extra, never an exception: without psutil there are no process or host metrics,
  without nvidia-ml-py no GPU metrics (warned only where an NVIDIA device exists, or where
  ``gpus`` names devices); what the sampler can still take goes on. A failing sample is logged
  (rate-limited) and the next one is taken.
- At most one per bus per process: a second raises ``RuntimeError`` until the first is closed.
  A forked child inherits no running sampler (its tree is its parent's) and may make its own.
- ``close(timeout)`` is idempotent and bounded: it stops the thread (waiting at most
  ``timeout`` for a sample in progress), logs the Stats' open windows and returns whether the
  thread stopped. An unclosed sampler is closed at interpreter exit, before the buses.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from ._aggregates import Aggregation
from ._bus import EventBus
from ._check import check_timeout, wrong_type
from ._descendants import Descendants
from ._lifecycle import process
from ._ratelimit import LOG_INTERVAL, Throttle
from ._stat import Stat

__all__ = ["AGGREGATIONS", "SystemMetrics"]

logger = logging.getLogger("monitor_bus")

#: What each ``system.<metric>`` Stat reports per window (but the ``*_total`` ones).
AGGREGATIONS = (Aggregation.MEAN, Aggregation.MAX, Aggregation.MIN)
# A cumulative ``*_total`` Stat: its reading at the window's last sample (a counter's value).
_TOTAL_AGGREGATIONS = (Aggregation.VALUE,)

PREFIX = "system."
_EXTRA = "pip install 'monitor_bus[system]'"

# A reading: (metric name without the prefix, value).
_Reading = tuple[str, float]

# The packages already warned about in this process: one warning each.
_warned: set[str] = set()
# The running sampler of each bus, by id(bus) (the sampler holds the bus).
_running: dict[int, SystemMetrics] = {}
_running_lock = threading.Lock()


def _warn_missing(package: str, what: str) -> None:
    if package not in _warned:
        _warned.add(package)
        logger.warning(
            "monitor_bus.system: %s is not installed, so %s are not sampled; %s",
            package,
            what,
            _EXTRA,
        )


def _local_rank(environ: Mapping[str, str]) -> int:
    """``LOCAL_RANK`` as set by torchrun (0 where unset: a process no launcher started)."""
    text = environ.get("LOCAL_RANK", "").strip()
    if not text:
        return 0
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if rank < 0:
        raise ValueError(
            f"environment variable LOCAL_RANK={text!r} is not a local rank (an int >= 0)"
        )
    return rank


def _rank_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The devices this rank uses, as NVML indices or UUIDs; None: every device.

    With ``LOCAL_RANK`` set (a launcher started the process) the rank uses one device, as
    torchrun's ``torch.cuda.set_device(LOCAL_RANK)``: the visible device at ``LOCAL_RANK``,
    or the only visible one (a launcher that gives each rank its own ``CUDA_VISIBLE_DEVICES``).
    Without it, the process uses every visible device. ``CUDA_VISIBLE_DEVICES`` is read as
    CUDA reads it: entries up to the first invalid one (``-1`` hides every device).
    """
    visible: list[str] | None = None
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        visible = []
        for entry in (e.strip() for e in text.split(",")):
            if not entry or entry.startswith("-"):
                break
            visible.append(entry)
    if not environ.get("LOCAL_RANK", "").strip():
        return visible
    rank = _local_rank(environ)
    if visible is None:
        return [str(rank)]
    if len(visible) == 1:
        return visible
    return [visible[rank]] if rank < len(visible) else []


def _nvidia_device_present() -> bool:
    """Whether the host has an NVIDIA device (its driver's device files)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.isdir("/proc/driver/nvidia/gpus")


class _Tree:
    """This process and its descendants: CPU (100 = one core) and resident memory."""

    def __init__(self, psutil: Any) -> None:
        self._psutil = psutil
        self._me = psutil.Process()
        self._procs: dict[int, Any] = {}  # descendants' psutil objects, by pid
        linux = os.path.isdir(f"/proc/{self._me.pid}")
        self._descendants = Descendants(self._me.pid) if linux else None
        self._last: tuple[float, float] | None = None  # (clock, CPU seconds)

    def _tree(self) -> list[Any]:
        psutil = self._psutil
        if self._descendants is None:
            with contextlib.suppress(psutil.Error):
                return [self._me, *self._me.children(recursive=True)]
            return [self._me]
        procs = {}
        for pid in self._descendants():
            proc = self._procs.get(pid)
            if proc is None:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
            if proc is not None:
                procs[pid] = proc
        self._procs = procs
        return [self._me, *procs.values()]

    def sample(self, now: float) -> list[_Reading]:
        psutil = self._psutil
        cpu = rss = 0.0
        for proc in self._tree():
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    memory = proc.memory_info()
            except psutil.Error:  # ended meanwhile: once reaped, its parent's times hold it
                continue
            # A process's children times hold its reaped children: an ended worker's CPU
            # moves there from its own entry, so the sum goes on without a jump.
            cpu += times.user + times.system + times.children_user + times.children_system
            rss += memory.rss
        readings = [("process_rss_bytes", rss), ("process_cpu_seconds_total", cpu)]
        if self._last is not None:
            then, before = self._last
            # A descendant reparented away (not reaped here) takes its CPU out of the sum.
            readings.append(("process_cpu_percent", max(0.0, cpu - before) / (now - then) * 100))
        self._last = (now, cpu)
        return readings


class _Host:
    """Host-wide CPU and memory use, disk and network throughput."""

    def __init__(self, psutil: Any) -> None:
        self._psutil = psutil
        self._last: tuple[float, tuple[float, float], dict[str, float]] | None = None

    def _counters(self) -> dict[str, float]:
        psutil = self._psutil
        counters: dict[str, float] = {}
        disk = psutil.disk_io_counters(nowrap=False)  # its wrap cache costs more than it saves
        if disk is not None:  # None where the host has no disk counters (some containers)
            counters["disk_read_bytes_per_s"] = disk.read_bytes
            counters["disk_write_bytes_per_s"] = disk.write_bytes
        net = psutil.net_io_counters(nowrap=False)
        if net is not None:
            counters["net_sent_bytes_per_s"] = net.bytes_sent
            counters["net_recv_bytes_per_s"] = net.bytes_recv
        return counters

    def sample(self, now: float) -> list[_Reading]:
        psutil = self._psutil
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        # Linux counts guest time in user and nice already.
        guest = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
        cpu = (sum(times) - guest, idle)
        counters = self._counters()
        readings = [("host_memory_percent", float(psutil.virtual_memory().percent))]
        # The counters as they are (since boot): OpenTelemetry's system.disk.io and the like.
        readings += [(name[: -len("per_s")] + "total", v) for name, v in counters.items()]
        if self._last is not None:
            then, (total_before, idle_before), before = self._last
            total = cpu[0] - total_before
            if total > 0:
                busy = total - (idle - idle_before)
                readings.append(("host_cpu_percent", max(0.0, busy) / total * 100))
            for name, value in counters.items():
                if name in before:
                    readings.append((name, max(0.0, value - before[name]) / (now - then)))
        self._last = (now, cpu, counters)
        return readings


# Per GPU: metric, and how to read it from NVML (module, handle).
_GPU_READINGS: tuple[tuple[str, Callable[[Any, Any], float]], ...] = (
    ("utilization_percent", lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
    ("memory_used_bytes", lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used),
    ("power_watts", lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),  # from mW
    (
        "temperature_c",
        lambda nvml, h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
    ),
)


class _Gpus:
    """The rank's GPUs through NVML, their handles taken once."""

    def __init__(self, nvml: Any, devices: list[str] | None) -> None:
        nvml.nvmlInit()
        self._nvml = nvml
        if devices is None:
            devices = [str(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.handles: list[tuple[str, Any]] = []
        for device in devices:
            try:
                if device.isdigit():
                    handle = nvml.nvmlDeviceGetHandleByIndex(int(device))
                else:
                    handle = nvml.nvmlDeviceGetHandleByUUID(device)
                self.handles.append((f"gpu{nvml.nvmlDeviceGetIndex(handle)}", handle))
            except nvml.NVMLError as exc:
                logger.warning("monitor_bus.system: no GPU %r through NVML: %s", device, exc)
        # (gpu, metric) pairs the device does not support: not asked again.
        self._unsupported: set[tuple[str, str]] = set()
        # Readings lost to another NVML error (a GPU lost, a timeout), by "gpu<i>.<metric>".
        self.missed: dict[str, int] = {}
        self._throttle = Throttle(LOG_INTERVAL)

    def sample(self, now: float) -> list[_Reading]:
        nvml = self._nvml
        readings = []
        for gpu, handle in self.handles:
            for metric, read in _GPU_READINGS:
                if (gpu, metric) in self._unsupported:
                    continue
                try:
                    readings.append((f"{gpu}.{metric}", float(read(nvml, handle))))
                except nvml.NVMLError_NotSupported:
                    self._unsupported.add((gpu, metric))
                except nvml.NVMLError as exc:
                    # One device's error costs that reading of this sample only.
                    self._miss(f"{gpu}.{metric}", exc)
        return readings

    def _miss(self, name: str, exc: Exception) -> None:
        missed = self.missed[name] = self.missed.get(name, 0) + 1
        if self._throttle.ready(name):
            logger.warning(
                "monitor_bus.system: NVML could not read %s (%s); that reading is left out of"
                " this sample and taken again at the next (%d missed so far)",
                name,
                exc,
                missed,
            )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def _check_gpus(gpus: object) -> list[str] | None | str:
    """``gpus`` as ``"auto"``, a list of device names, or None (no GPU metrics)."""
    if gpus is None or gpus == "auto":
        return gpus
    if isinstance(gpus, str) or not isinstance(gpus, Iterable):
        raise ValueError(f'gpus must be "auto", None or a sequence of GPU indices, got {gpus!r}')
    devices = []
    for gpu in gpus:
        if isinstance(gpu, bool) or not isinstance(gpu, (int, str)):
            raise wrong_type("gpus", "GPU indices (int) or UUIDs (str)", gpu)
        if isinstance(gpu, int) and gpu < 0:
            raise ValueError(f"gpus must hold indices >= 0, got {gpu}")
        devices.append(str(gpu))
    return devices


class SystemMetrics:
    """Sample the process tree, the host and the rank's GPUs every ``interval`` seconds, on a
    thread of its own, into Stats named ``system.<metric>``.

    Metrics (each a Stat reporting MEAN, MAX and MIN per ``window``):
    ``process_cpu_percent`` (this process and all its descendants; 100 = one core),
    ``process_rss_bytes``; on local rank 0 only: ``host_cpu_percent`` (100 = every core
    busy), ``host_memory_percent``, ``disk_read_bytes_per_s``, ``disk_write_bytes_per_s``,
    ``net_sent_bytes_per_s``, ``net_recv_bytes_per_s``; with ``counters=True``, the
    cumulative counters behind the rates, ``process_cpu_seconds_total`` and (local rank 0)
    ``disk_read_bytes_total``, ``disk_write_bytes_total``, ``net_sent_bytes_total``,
    ``net_recv_bytes_total``, each reporting VALUE (its last reading); per GPU of this rank,
    ``gpu<i>.``
    ``utilization_percent``, ``memory_used_bytes``, ``power_watts``, ``temperature_c``
    (``<i>`` is NVML's index of the device). Without psutil or nvidia-ml-py, one warning and
    the other metrics go on; a reading NVML fails is counted in ``missed``. At most one per
    bus per process.

    Thread-safe. A context manager: the ``with`` block's end closes it. Setting
    ``MONITOR_BUS_SYSTEM_INTERVAL`` (or ``configure_default_bus(system_interval=...)``) starts
    one for the default bus when the default bus is made.

    Args:
        interval: seconds between samples.
        bus: the bus the Stats log to; the default bus if omitted.
        window: the Stats' window.
        gpus: ``"auto"`` (the rank's devices, from ``CUDA_VISIBLE_DEVICES`` and
            ``LOCAL_RANK``), a sequence of NVML indices or UUIDs, or None (no GPU metrics).
        counters: also sample the cumulative ``*_total`` counters, which the OpenTelemetry
            and Prometheus exporters send as the semantic conventions' ``process.cpu.time``,
            ``system.disk.io`` and ``system.network.io``; off by default, as every other sink
            has the rates.

    Raises:
        TypeError, ValueError: an argument (or ``LOCAL_RANK``) is invalid; the message names it.
        RuntimeError: the bus has a running ``SystemMetrics`` in this process already, or is
            closed.

    Examples:
        >>> from datetime import timedelta
        >>> from monitor_bus.system import SystemMetrics
        >>> with SystemMetrics(interval=1.0, window=timedelta(seconds=10)) as metrics:
        ...     pass  # train here: the sampler reads the machine every second meanwhile
        >>> metrics.closed
        True
    """

    def __init__(
        self,
        interval: float = 10.0,
        *,
        bus: EventBus | None = None,
        window: timedelta = timedelta(seconds=60),
        gpus: Sequence[int | str] | str | None = "auto",
        counters: bool = False,
        _nvml: Any = None,  # tests: an NVML stand-in (no GPU here)
        _environ: Mapping[str, str] | None = None,  # tests: the launcher's variables
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise wrong_type("interval", "a number of seconds", interval)
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(
                f"interval must be a positive, finite number of seconds, got {interval}"
            )
        if not isinstance(window, timedelta):
            raise wrong_type("window", "a timedelta", window)
        if window < timedelta(milliseconds=1):
            raise ValueError(f"window must be at least 1 millisecond, got {window!r}")
        devices = _check_gpus(gpus)
        if not isinstance(counters, bool):
            raise wrong_type("counters", "a bool", counters)
        self._counters = counters
        if bus is None:
            bus = process.get_default_bus()
        elif not isinstance(bus, EventBus):
            raise wrong_type("bus", "a monitor_bus.EventBus or None", bus)
        if bus.closed:
            raise RuntimeError(f"bus {bus._name!r} is closed")
        environ = os.environ if _environ is None else _environ
        self._host_sampler = _local_rank(environ) == 0
        if devices == "auto":
            devices = _rank_gpus(environ)
            explicit = False
        else:
            explicit = devices is not None
        self.interval = float(interval)
        self.bus = bus
        self._window = window
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._stats: dict[str, Stat] = {}
        self._throttle = Throttle(LOG_INTERVAL)
        self._sample_lock = threading.Lock()  # one sample at a time: rates need the last
        self._baseline = threading.Event()  # set once the thread's first sample is taken
        with _running_lock:
            other = _running.get(id(bus))
            if other is not None and other._pid == self._pid and not other._closed:
                raise RuntimeError(
                    f"bus {bus._name!r} already has a SystemMetrics in this process: close it"
                    " first (one sampler per bus, so no metric is sampled twice)"
                )
            _running[id(bus)] = self
        self._samplers: list[Any] = []
        self._gpus: _Gpus | None = None
        try:
            self._start_samplers(devices, explicit, _nvml)
        except BaseException:
            self._forget()
            raise
        self._thread = threading.Thread(target=self._run, name="monitor_bus-system", daemon=True)
        self._thread.start()

    def _start_samplers(self, devices: list[str] | None | str, explicit: bool, nvml: Any) -> None:
        try:
            psutil = importlib.import_module("psutil")
        except ImportError:
            _warn_missing("psutil", "process and host metrics")
        else:
            self._samplers.append(_Tree(psutil))
            if self._host_sampler:
                self._samplers.append(_Host(psutil))
        if devices is None or devices == [] or isinstance(devices, str):
            return
        if nvml is None:
            # Auto mode on a host without an NVIDIA device: no GPU metrics, and nothing to say.
            if not explicit and not _nvidia_device_present():
                return
            try:
                nvml = importlib.import_module("pynvml")  # nvidia-ml-py's module
            except ImportError:
                _warn_missing("nvidia-ml-py", "GPU metrics")
                return
        try:
            self._gpus = _Gpus(nvml, devices)
        except nvml.NVMLError as exc:
            logger.warning("monitor_bus.system: NVML is unavailable, so no GPU metrics: %s", exc)
            return
        self._samplers.append(self._gpus)

    @property
    def metrics(self) -> list[str]:
        """The Stats' names sampled so far (``system.<metric>``)."""
        return sorted(self._stats)

    @property
    def missed(self) -> dict[str, int]:
        """GPU readings lost to an NVML error, by Stat name (``system.gpu<i>.<metric>``).

        A reading the device does not support is not counted: it is not asked again.
        """
        gpus = self._gpus
        return {} if gpus is None else {PREFIX + k: n for k, n in sorted(gpus.missed.items())}

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _add(self, metric: str, value: float) -> None:
        name = PREFIX + metric
        stat = self._stats.get(name)
        if stat is None:
            aggregations = _TOTAL_AGGREGATIONS if metric.endswith("_total") else AGGREGATIONS
            stat = self._stats[name] = Stat(name, aggregations, self._window, bus=self.bus)
        stat.add(value)

    def sample(self) -> None:
        """Take one sample now (on the caller's thread; the sampler's thread calls it)."""
        with self._sample_lock:
            self._sample(time.monotonic())

    def _sample(self, now: float) -> None:
        for sampler in self._samplers:
            try:
                readings = sampler.sample(now)
            except Exception:
                if self._throttle.ready(type(sampler)):
                    logger.exception("monitor_bus.system: a sample failed; sampling goes on")
                continue
            for metric, value in readings:
                if self._counters or not metric.endswith("_total"):
                    self._add(metric, value)

    def _run(self) -> None:
        start = time.monotonic()
        ticks = 0
        while not self.bus.closed:
            self.sample()
            self._baseline.set()
            # On a grid from the start: a slow sample does not shift the next ones.
            ticks = max(ticks + 1, math.ceil((time.monotonic() - start) / self.interval))
            if self._stop.wait(start + ticks * self.interval - time.monotonic()):
                return

    def close(self, timeout: float | None = 5.0) -> bool:
        """Stop sampling and log the Stats' open windows. Idempotent and thread-safe.

        Args:
            timeout: seconds to wait for a sample in progress; None waits as long as it takes.

        Returns:
            True if the sampler's thread stopped within ``timeout``.
        """
        timeout = check_timeout("timeout", timeout)
        with self._close_lock:
            first = not self._closed
            self._closed = True
        self._stop.set()
        if os.getpid() != self._pid:
            return True  # a forked child's copy: its thread is not in this process
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        stopped = not self._thread.is_alive()
        if first:
            self._forget()
            for stat in list(self._stats.values()):
                stat._close()
            if self._gpus is not None and stopped:
                self._gpus.close()
        return stopped

    def _forget(self) -> None:
        with _running_lock:
            if _running.get(id(self.bus)) is self:
                del _running[id(self.bus)]

    def __enter__(self) -> SystemMetrics:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<SystemMetrics every {self.interval} s on bus {self.bus._name!r}, {state}>"


def _close_for(bus: EventBus) -> None:
    """Close ``bus``'s sampler in this process, if it has one (the default bus's reset)."""
    sampler = _running.get(id(bus))
    if sampler is not None and sampler._pid == os.getpid():
        sampler.close()


def _close_all() -> None:
    """At exit, before the buses close (atexit runs this first: it was registered later)."""
    for sampler in list(_running.values()):
        if sampler._pid == os.getpid():
            sampler.close()


atexit.register(_close_all)
