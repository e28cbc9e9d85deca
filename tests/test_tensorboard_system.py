"""System metrics in TensorBoard: one chart per metric with its unit and its min-max band,
tags that stay distinct when a card's title is cut, read back by TensorBoard itself."""

from __future__ import annotations

import importlib.util
import json
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin

from monitor_bus import STAT_EVENT, Event, EventBus, TensorboardEventHandler
from monitor_bus._tensorboard_handler import chart_title, system_tag
from monitor_bus.tensorboard import SummaryWriter

from .conftest import require

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)

# Two windows of three system metrics and a Stat of the user's own.
WINDOWS = [
    {
        "system.process_cpu_percent.mean": 150.0,
        "system.process_cpu_percent.max": 190.0,
        "system.process_cpu_percent.min": 110.0,
    },
    {"system.disk_read_bytes_total.value": 4096.0},
    {"loss.mean": 0.5},
    {
        "system.gpu0.utilization_percent.mean": 40.0,
        "system.gpu0.utilization_percent.max": 90.0,
        "system.gpu0.utilization_percent.min": 0.0,
    },
    {
        "system.process_cpu_percent.mean": 120.0,
        "system.process_cpu_percent.max": 130.0,
        "system.process_cpu_percent.min": 100.0,
    },
]


def custom_scalars_layout(log_dir: Path) -> dict[str, Any]:
    """The CUSTOM SCALARS tab's layout, as TensorBoard's own plugin serves it."""
    with warnings.catch_warnings():  # its vendored html5lib warns on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(log_dir))
    plugin = CustomScalarsPlugin(
        base_plugin.TBContext(data_provider=provider, multiplexer=mux, logdir=str(log_dir))
    )
    return json.loads(plugin.layout_impl(context.RequestContext(), ""))


def make_writer(kind: str, log_dir: Path) -> Any:
    if kind == "ours":
        return SummaryWriter(log_dir)
    if kind == "torch":
        require(importlib.util.find_spec("torch") is not None, "torch is not installed")
        from torch.utils.tensorboard import SummaryWriter as TorchWriter

        return TorchWriter(str(log_dir))
    require(importlib.util.find_spec("tensorboardX") is not None, "tensorboardX is not installed")
    from tensorboardX import SummaryWriter as XWriter

    return XWriter(str(log_dir))


@pytest.mark.parametrize("kind", ["ours", "torch", "tensorboardX"])
def test_one_chart_per_system_metric_with_its_unit_and_band(
    bus: EventBus, tmp_path: Path, kind: str
) -> None:
    """Through our writer, torch's and tensorboardX's: a system metric's mean (a counter's
    value) is the tag ``system/<metric>``, its min and max are ``system.min/<metric>`` and
    ``system.max/<metric>`` whatever the handler's group; the CUSTOM SCALARS tab has one chart
    per metric with a mean, titled with its unit, the mean with its min-max band, the layout
    written last holding every metric so far."""
    writer = make_writer(kind, tmp_path)
    handle = bus.register_event_handler(TensorboardEventHandler(writer, group="stats"))
    for i, data in enumerate(WINDOWS):
        bus.log_event(Event(STAT_EVENT, T0 + timedelta(seconds=i), data))
    assert bus.unregister_event_handler(handle, timeout=10)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    got = {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got == {
        "system/process_cpu_percent": [(0, 150.0), (1, 120.0)],
        "system.max/process_cpu_percent": [(0, 190.0), (1, 130.0)],
        "system.min/process_cpu_percent": [(0, 110.0), (1, 100.0)],
        "system/disk_read_bytes_total": [(0, 4096.0)],
        "stats/loss.mean": [(0, 0.5)],
        "system/gpu0.utilization_percent": [(0, 40.0)],
        "system.max/gpu0.utilization_percent": [(0, 90.0)],
        "system.min/gpu0.utilization_percent": [(0, 0.0)],
    }
    layout = custom_scalars_layout(tmp_path)
    assert layout == {
        "version": 0,
        "category": [
            {
                "title": "system",
                "closed": False,
                "chart": [
                    {
                        "title": f"{metric} (%)",
                        "margin": {
                            "series": [
                                {
                                    "value": f"system/{metric}",
                                    "lower": f"system.min/{metric}",
                                    "upper": f"system.max/{metric}",
                                }
                            ]
                        },
                    }
                    for metric in ("gpu0.utilization_percent", "process_cpu_percent")
                ],
            }
        ],
    }


# Every metric SystemMetrics samples (one GPU), and the unit its chart's title gives it.
UNITS = {
    "process_cpu_percent": "%",
    "process_rss_bytes": "bytes",
    "process_cpu_seconds_total": "s",
    "host_cpu_percent": "%",
    "host_memory_percent": "%",
    "disk_read_bytes_per_s": "bytes/s",
    "disk_write_bytes_per_s": "bytes/s",
    "net_sent_bytes_per_s": "bytes/s",
    "net_recv_bytes_per_s": "bytes/s",
    "disk_read_bytes_total": "bytes",
    "disk_write_bytes_total": "bytes",
    "net_sent_bytes_total": "bytes",
    "net_recv_bytes_total": "bytes",
    "gpu0.utilization_percent": "%",
    "gpu0.memory_used_bytes": "bytes",
    "gpu0.power_watts": "W",
    "gpu0.temperature_c": "°C",
}


def test_every_system_metric_has_its_unit_and_tags_that_stay_distinct_when_cut() -> None:
    """Each system metric's chart title names its unit, and within each TensorBoard section
    the part of a tag a cut card title keeps (the start of its last segment) names the
    metric, with the aggregation in the section's name: no two cards read alike."""
    assert {metric: chart_title(metric) for metric in UNITS} == {
        metric: f"{metric} ({unit})" for metric, unit in UNITS.items()
    }
    sections: dict[str, list[str]] = {}
    for metric in UNITS:
        aggregations = ("value",) if metric.endswith("_total") else ("mean", "max", "min")
        for aggregation in aggregations:
            made = system_tag(f"system.{metric}.{aggregation}")
            assert made is not None
            tag, name, agg = made
            assert (name, agg) == (metric, aggregation)
            section, _, last = tag.rpartition("/")
            assert last == metric
            sections.setdefault(section, []).append(last)
    assert sorted(sections) == ["system", "system.max", "system.min"]
    for lasts in sections.values():
        assert len(set(lasts)) == len(lasts)
    assert system_tag("loss.mean") is None
    assert system_tag("system.process_cpu_percent.p99") is None
