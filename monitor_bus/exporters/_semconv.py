"""``SystemMetrics``' Stats under OpenTelemetry's semantic conventions, v1.44.0: the names,
units, instrument kinds and attributes the OpenTelemetry and Prometheus exporters use.

Guarantees
----------
- One table, ``CONVENTIONS``, maps each ``system.<metric>`` Stat of ``SystemMetrics`` to its
  convention (``process.cpu.utilization``, ``hw.gpu.memory.usage``, ...); both exporters read
  it, and ``convert`` is the one place a window's value becomes a convention's.
- The value: a gauge or an up-down counter takes the window's MEAN (for a utilization, the
  rate over the window); a counter takes the VALUE of the cumulative ``*_total`` Stat (its
  reading at the window's last sample; ``SystemMetrics(counters=True)`` samples them). Percentages become fractions (unit ``1``); the
  process tree's CPU (100 = one core) becomes a fraction of the CPUs available to this
  process (``os.sched_getaffinity``), as ``process.cpu.utilization`` is defined.
- Only conventions go out: the window's MAX and MIN and the ``*_per_s`` rates of a known
  metric are not exported (``convert`` returns None), since a backend takes ``max_over_time``
  and ``rate()`` from the points. A ``system.*`` key the table does not know (a Stat of the
  user's own) is ``NOT_CONVENTIONAL``: exported as any other Stat key.
- ``launcher_attributes``: the rank, local rank, world size, node rank and job id a launcher
  (torchrun, else Slurm) set, the resource attributes both exporters attach.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "CONVENTIONS",
    "NOT_CONVENTIONAL",
    "SCHEMA_URL",
    "SEMCONV_VERSION",
    "Convention",
    "Point",
    "convert",
    "launcher_attributes",
    "prometheus_name",
]

#: The semantic conventions' version followed, and its schema URL (the meter's).
SEMCONV_VERSION = "1.44.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"


class Convention(NamedTuple):
    """A metric of the semantic conventions."""

    #: Its name, e.g. ``"process.cpu.utilization"``.
    name: str
    #: Its UCUM unit, e.g. ``"1"``, ``"By"``, ``"s"``.
    unit: str
    #: Its instrument kind: ``"gauge"``, ``"counter"`` or ``"updowncounter"``.
    kind: str
    #: Its description, as the conventions word it.
    description: str


class Point(NamedTuple):
    """One exported value of a convention's metric."""

    convention: Convention
    #: The point's attributes, as sorted (key, value) pairs.
    attributes: tuple[tuple[str, str], ...]
    value: float


_C = Convention
PROCESS_CPU_UTILIZATION = _C(
    "process.cpu.utilization",
    "1",
    "gauge",
    "Difference in process.cpu.time since the last measurement, divided by the elapsed time"
    " and number of CPUs available to the process",
)
PROCESS_CPU_TIME = _C("process.cpu.time", "s", "counter", "Total CPU seconds")
PROCESS_MEMORY_USAGE = _C(
    "process.memory.usage", "By", "updowncounter", "The amount of physical memory in use"
)
SYSTEM_CPU_UTILIZATION = _C(
    "system.cpu.utilization", "1", "gauge", "Fraction of the host's CPU time not idle"
)
SYSTEM_MEMORY_UTILIZATION = _C(
    "system.memory.utilization", "1", "gauge", "Percentage of memory bytes in use"
)
SYSTEM_DISK_IO = _C("system.disk.io", "By", "counter", "Disk bytes transferred")
SYSTEM_NETWORK_IO = _C(
    "system.network.io", "By", "counter", "The number of bytes transmitted and received"
)
HW_GPU_UTILIZATION = _C(
    "hw.gpu.utilization", "1", "gauge", "Fraction of time spent in a specific task"
)
HW_GPU_MEMORY_USAGE = _C("hw.gpu.memory.usage", "By", "updowncounter", "GPU memory used")
HW_POWER = _C("hw.power", "W", "gauge", "Instantaneous power consumed by the component")
HW_TEMPERATURE = _C("hw.temperature", "Cel", "gauge", "Temperature in degrees Celsius")

_PER_CPU = "per_cpu"  # a scale: divide by 100 and by the CPUs available to this process

# Stat metric (``system.<metric>``) -> (convention, attributes, aggregation, scale).
_HOST: dict[str, tuple[Convention, dict[str, str], str, float | str]] = {
    "process_cpu_percent": (PROCESS_CPU_UTILIZATION, {}, "mean", _PER_CPU),
    "process_cpu_seconds_total": (PROCESS_CPU_TIME, {}, "value", 1.0),
    "process_rss_bytes": (PROCESS_MEMORY_USAGE, {}, "mean", 1.0),
    "host_cpu_percent": (SYSTEM_CPU_UTILIZATION, {}, "mean", 0.01),
    "host_memory_percent": (
        SYSTEM_MEMORY_UTILIZATION,
        {"system.memory.state": "used"},
        "mean",
        0.01,
    ),
    "disk_read_bytes_total": (SYSTEM_DISK_IO, {"disk.io.direction": "read"}, "value", 1.0),
    "disk_write_bytes_total": (SYSTEM_DISK_IO, {"disk.io.direction": "write"}, "value", 1.0),
    "net_sent_bytes_total": (
        SYSTEM_NETWORK_IO,
        {"network.io.direction": "transmit"},
        "value",
        1.0,
    ),
    "net_recv_bytes_total": (
        SYSTEM_NETWORK_IO,
        {"network.io.direction": "receive"},
        "value",
        1.0,
    ),
}
# The rates the counters above carry: not exported (a backend's rate() gives them).
_RATES = {
    "disk_read_bytes_per_s",
    "disk_write_bytes_per_s",
    "net_sent_bytes_per_s",
    "net_recv_bytes_per_s",
}
# Per GPU (``system.gpu<i>.<metric>``): (convention, more attributes, aggregation, scale);
# every point has ``hw.id`` ``gpu<i>`` (NVML's index).
_GPU: dict[str, tuple[Convention, dict[str, str], str, float | str]] = {
    "utilization_percent": (HW_GPU_UTILIZATION, {}, "mean", 0.01),
    "memory_used_bytes": (HW_GPU_MEMORY_USAGE, {}, "mean", 1.0),
    "power_watts": (HW_POWER, {"hw.type": "gpu"}, "mean", 1.0),
    "temperature_c": (HW_TEMPERATURE, {"hw.type": "gpu"}, "mean", 1.0),
}

#: Every convention a system Stat maps to, by name.
CONVENTIONS: dict[str, Convention] = {c.name: c for c, *_ in (*_HOST.values(), *_GPU.values())}

_GPU_KEY = re.compile(r"system\.(gpu\d+)\.(\w+)\.(\w+)")
_HOST_KEY = re.compile(r"system\.(\w+)\.(\w+)")


class _NotConventional:
    def __repr__(self) -> str:
        return "NOT_CONVENTIONAL"


#: ``convert``'s answer for a key that is no system Stat's the table knows.
NOT_CONVENTIONAL = _NotConventional()


def _cpus() -> int:
    """The CPUs available to this process (its affinity where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def convert(key: str, value: float) -> Point | _NotConventional | None:
    """A Stat window's ``key: value`` as a convention's point.

    Returns:
        The point; None for a known system metric's key that is not exported (its MAX, MIN,
        or a rate the counters carry); ``NOT_CONVENTIONAL`` for any other key.
    """
    gpu = _GPU_KEY.fullmatch(key)
    if gpu is not None:
        hw_id, metric, aggregation = gpu.groups()
        entry = _GPU.get(metric)
        attributes = {"hw.id": hw_id}
    else:
        host = _HOST_KEY.fullmatch(key)
        if host is None:
            return NOT_CONVENTIONAL
        metric, aggregation = host.groups()
        if metric in _RATES:
            return None
        entry = _HOST.get(metric)
        attributes = {}
    if entry is None:
        return NOT_CONVENTIONAL
    convention, more, wanted, scale = entry
    if aggregation != wanted:
        return None
    attributes.update(more)
    number = value / 100 / _cpus() if scale == _PER_CPU else value * float(scale)
    return Point(convention, tuple(sorted(attributes.items())), number)


# UCUM units -> the Prometheus suffix OpenTelemetry's Prometheus compatibility gives them.
_UNIT_SUFFIX = {"By": "bytes", "s": "seconds", "W": "watts", "Cel": "celsius"}


def prometheus_name(convention: Convention) -> str:
    """The Prometheus name of ``convention``, as OpenTelemetry's Prometheus compatibility
    spells it: dots as ``_``, the unit as a suffix (``1`` on a gauge as ``_ratio``); a
    counter's ``_total`` is added by its exposition."""
    name = convention.name.replace(".", "_")
    if convention.unit == "1":
        return f"{name}_ratio" if convention.kind == "gauge" else name
    return f"{name}_{_UNIT_SUFFIX[convention.unit]}"


# (variable, resource key) a launcher sets: torchrun's first, then Slurm's.
_LAUNCHER_ENV = (
    (("RANK", "SLURM_PROCID"), "rank"),
    (("LOCAL_RANK", "SLURM_LOCALID"), "local_rank"),
    (("WORLD_SIZE", "SLURM_NTASKS"), "world_size"),
    (("GROUP_RANK", "SLURM_NODEID"), "node_rank"),
)
_JOB_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def launcher_attributes(environ: Mapping[str, str] | None = None) -> dict[str, int | str]:
    """The process's place in a distributed job, from the variables its launcher set.

    ``rank``, ``local_rank``, ``world_size`` and ``node_rank`` (ints) from torchrun's
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``GROUP_RANK``, else Slurm's
    ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and ``SLURM_NODEID``; ``job_id``
    (a str) from ``TORCHELASTIC_RUN_ID``, else ``SLURM_JOB_ID``. A variable unset, or not a
    number where one is due, is left out.
    """
    environ = os.environ if environ is None else environ
    attributes: dict[str, int | str] = {}
    for names, key in _LAUNCHER_ENV:
        for name in names:
            text = environ.get(name, "").strip()
            if text.isdigit():
                attributes[key] = int(text)
                break
    for name in _JOB_ENV:
        text = environ.get(name, "").strip()
        if text:
            attributes["job_id"] = text
            break
    return attributes
