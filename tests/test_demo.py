"""The demo trainer, run end to end in a temporary directory with few steps."""

from __future__ import annotations

import json
import math
import signal
import struct
import warnings
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import metadata as hparams_metadata

from monitor_bus import (
    RUN_END_EVENT,
    RUN_START_EVENT,
    STAT_EVENT,
    Event,
    TensorboardEventHandler,
    read_jsonl,
)
from monitor_bus._demo import EPOCH_EVENT, DemoResult, _AtStep, _Progress, run_demo
from monitor_bus.tensorboard import SummaryWriter

from .conftest import distribution_window

STAT_GROUPS = {
    "step_time_ms": {
        "step_time_ms.mean",
        "step_time_ms.min",
        "step_time_ms.max",
        "step_time_ms.p50",
        "step_time_ms.p99",
    },
    "samples_per_s": {"samples_per_s.mean"},
    "train_loss": {"train_loss.mean"},
}
STAT_KEYS = set().union(*STAT_GROUPS.values())
HISTOGRAM_KEY = "step_time_ms.histogram"  # a window's Histogram: not a scalar
EPOCH_KEYS = ["epoch", "step", "train_loss", "val_loss", "val_accuracy"]


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def test_demo_writes_everything_it_logged(tmp_path: Path) -> None:
    """A 70-step run logs its start, 3 epochs (32, 64, 70 steps), Stat windows and its end;
    JSONL, TensorBoard (its HPARAMS session included) and the tally agree."""
    calls: list[tuple[int, int]] = []
    result = run_demo(
        70, tmp_path, seed=3, progress=lambda done, total, loss: calls.append((done, total))
    )

    events = read_jsonl(tmp_path / "events.jsonl")
    epochs = [e for e in events if e.name == EPOCH_EVENT]
    stats = [e for e in events if e.name == STAT_EVENT]
    # The demo's SystemMetrics: as many windows as its samples made, each of one system.* Stat.
    system = [e for e in stats if next(iter(e.data)).startswith("system.")]
    stats = [e for e in stats if e not in system]
    system_keys = {key for e in system for key in e.data}
    for e in system:
        metric = next(iter(e.data)).rpartition(".")[0]
        assert list(e.data) == [f"{metric}.mean", f"{metric}.max", f"{metric}.min"]
    start, end = events[0], events[-1]
    assert (start.name, end.name) == (RUN_START_EVENT, RUN_END_EVENT)
    assert (start.data["run_name"], start.data["config.steps"], start.data["hparams.batch"]) == (
        "demo",
        70,
        256,
    )
    assert (end.data["status"], end.data["exception"]) == ("success", "")
    assert len(events) == len(epochs) + len(stats) + len(system) + 2 == result.written
    assert [(e.data["epoch"], e.data["step"]) for e in epochs] == [(1, 32), (2, 64), (3, 70)]
    assert all(list(e.data) == EPOCH_KEYS for e in epochs)
    assert all(0.0 <= e.data["val_accuracy"] <= 1.0 for e in epochs)
    assert result.final_accuracy == epochs[-1].data["val_accuracy"]
    assert (result.steps, result.epochs) == (70, 3)

    # Each Stat logs its own event per window, holding exactly that Stat's keys.
    by_stat = {
        name: [e for e in stats if set(e.data) - {HISTOGRAM_KEY} == keys]
        for name, keys in STAT_GROUPS.items()
    }
    assert sum(len(windows) for windows in by_stat.values()) == len(stats)
    assert all(by_stat.values())
    system_windows = Counter(next(iter(e.data)).rpartition(".")[0] for e in system)
    assert result.stat_windows == {
        **{name: len(windows) for name, windows in by_stat.items()},
        **system_windows,
    }
    assert result.events_by_name == {
        EPOCH_EVENT: 3,
        STAT_EVENT: len(stats) + len(system),
        RUN_START_EVENT: 1,
        RUN_END_EVENT: 1,
    }
    assert (result.dropped, result.undelivered, result.handler_errors) == (0, 0, 0)
    assert len(result.latencies_ms) == len(events)
    assert all(
        e.data["step_time_ms.min"] <= e.data["step_time_ms.mean"] <= e.data["step_time_ms.max"]
        and e.data["step_time_ms.min"]
        <= e.data["step_time_ms.p50"]
        <= e.data["step_time_ms.p99"]
        <= e.data["step_time_ms.max"]
        for e in by_stat["step_time_ms"]
    )

    # TensorBoard: a run named "demo"; Stat tags in the "stats/" section, epochs in "epoch/";
    # every x is a training step.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo", "events.jsonl"]
    acc = EventAccumulator(str(tmp_path / "demo"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    # A window logged once the training ended (the last, partial one) is not drawn, unless it
    # is its Stat's only one.
    drawn = {
        name: windows[:1] + [e for e in windows[1:] if e.timestamp < result.trained_until]
        for name, windows in by_stat.items()
    }
    # The step time's histogram: one per window drawn, at the step its scalars are drawn at.
    histograms = acc.Histograms(f"stats/{HISTOGRAM_KEY}")
    windows = [e.data[HISTOGRAM_KEY] for e in drawn["step_time_ms"]]
    assert [(h.histogram_value.num, h.histogram_value.sum) for h in histograms] == [
        (w.count, w.sum) for w in windows
    ]
    assert [h.step for h in histograms] == [s.step for s in acc.Scalars("stats/step_time_ms.p50")]
    # A system metric's mean (a counter's value) is its own tag; its min and max sit in
    # sections of their own, so a title cut at its end still names the metric.
    system_tags = {
        ("system/" if agg in ("mean", "value") else f"system.{agg}/") + metric
        for metric, _, agg in (k.removeprefix("system.").rpartition(".") for k in system_keys)
    }
    final = {f"summary/{k.removeprefix('metrics.')}" for k in end.data if k.startswith("metrics.")}
    assert final == {
        "summary/train_loss",
        "summary/val_loss",
        "summary/val_accuracy",
        "summary/step_time_ms_p50",
        "summary/step_time_ms_p99",
    }
    assert (
        set(acc.Tags()["scalars"])
        == {f"stats/{k}" for k in STAT_KEYS}
        | system_tags
        | {f"epoch/{k}" for k in EPOCH_KEYS[2:]}
        | final
    )
    # The run's end (its final metrics, run/stop) at its last step, not at 0.
    for tag in final:
        ((step, value),) = [(s.step, s.value) for s in acc.Scalars(tag)]
        assert (step, value) == (70, f32(end.data["metrics." + tag.removeprefix("summary/")]))
    assert end.data["metrics.val_accuracy"] == result.final_accuracy
    assert [e.step for e in acc.Tensors("run/stop")] == [70]
    # HPARAMS: the final metrics, not every scalar tag.
    content = acc.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    experiment = hparams_metadata.parse_experiment_plugin_data(
        content[hparams_metadata.EXPERIMENT_TAG]
    )
    assert {m.name.tag for m in experiment.metric_infos} == final
    assert [i.name for i in experiment.hparam_infos] == ["hparams.batch", "hparams.hidden"]
    # CUSTOM SCALARS, as its plugin reads the layout: one chart per system metric with a mean,
    # titled with its unit, the mean with its min-max band.
    layout = custom_scalars_layout(tmp_path)
    means = sorted(k for k in system_keys if k.endswith(".mean"))
    assert [c["title"] for c in layout["category"][0]["chart"]] == [
        chart_title(k.removeprefix("system.").removesuffix(".mean")) for k in means
    ]
    assert layout["category"][0]["title"] == "system"
    for chart in layout["category"][0]["chart"]:
        metric = chart["title"].split(" ")[0]
        assert chart["margin"]["series"] == [
            {
                "value": f"system/{metric}",
                "lower": f"system.min/{metric}",
                "upper": f"system.max/{metric}",
            }
        ]
    for name, keys in STAT_GROUPS.items():
        for key in keys:
            points = acc.Scalars(f"stats/{key}")
            assert [s.value for s in points] == [f32(e.data[key]) for e in drawn[name]]
            steps = [s.step for s in points]
            assert steps == sorted(steps)
            assert steps[0] >= 0
            assert steps[-1] <= 70
    for key in EPOCH_KEYS[2:]:
        assert [(s.step, s.value) for s in acc.Scalars(f"epoch/{key}")] == [
            (e.data["step"], f32(e.data[key])) for e in epochs
        ]

    # The run's texts, its HPARAMS experiment and session, and the CUSTOM SCALARS layout.
    assert sorted(acc.Tags()["tensors"]) == [
        "_hparams_/experiment",
        "_hparams_/session_end_info",
        "_hparams_/session_start_info",
        "custom_scalars__config__",
        "run/start",
        "run/stop",
    ]
    assert sorted(acc.PluginTagToContent("hparams")) == [
        "_hparams_/experiment",
        "_hparams_/session_end_info",
        "_hparams_/session_start_info",
    ]

    assert calls[-1] == (70, 70)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_demo_is_seeded(tmp_path: Path) -> None:
    """The same seed gives the same training (epoch losses); another seed does not."""

    def val_losses(run: int, seed: int) -> list[float]:
        run_demo(64, tmp_path / f"run{run}", tensorboard=False, seed=seed)
        events = read_jsonl(tmp_path / f"run{run}" / "events.jsonl")
        return [e.data["val_loss"] for e in events if e.name == EPOCH_EVENT]

    first = val_losses(0, seed=0)
    assert len(first) == 2
    assert val_losses(1, seed=0) == first
    assert val_losses(2, seed=1) != first


def test_demo_learns(tmp_path: Path) -> None:
    """320 steps separate the spirals: held-out accuracy over 90%, validation loss down fourfold."""
    result = run_demo(320, tmp_path, tensorboard=False, seed=0)
    events = read_jsonl(tmp_path / "events.jsonl")
    losses = [e.data["val_loss"] for e in events if e.name == EPOCH_EVENT]
    assert result.final_accuracy > 0.9
    assert losses[-1] < losses[0] / 4


def test_demo_without_tensorboard_writes_only_jsonl(tmp_path: Path) -> None:
    """tensorboard=False writes no event files, and the run still reaches the JSONL file."""
    result = run_demo(40, tmp_path, tensorboard=False)
    assert not result.tensorboard
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]
    assert len(read_jsonl(tmp_path / "events.jsonl")) == result.written > 0


def test_demo_appends_to_an_existing_run(tmp_path: Path) -> None:
    """A second run in the same directory keeps the first run's lines."""
    first = run_demo(40, tmp_path, tensorboard=False)
    second = run_demo(40, tmp_path, tensorboard=False)
    assert len(read_jsonl(tmp_path / "events.jsonl")) == first.written + second.written


def test_demo_rejects_bad_arguments(tmp_path: Path) -> None:
    """steps below 1 and a log directory under a file are refused before anything is written."""
    with pytest.raises(ValueError, match="steps"):
        run_demo(0, tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("keep")
    with pytest.raises(NotADirectoryError, match="cannot create log directory") as info:
        run_demo(10, blocker / "run")
    assert info.value.filename == str(blocker / "run")
    assert blocker.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_latency_percentile_is_nearest_rank() -> None:
    """p50/p99 use the nearest-rank rule; no samples give NaN."""
    result = DemoResult(
        "d",
        "d/e",
        False,
        1,
        1,
        0.0,
        0.0,
        {},
        {},
        0,
        0,
        0,
        0,
        datetime.now(timezone.utc),
        [float(i) for i in range(1, 101)],
    )
    assert (
        result.latency_percentile(50),
        result.latency_percentile(99),
        result.latency_percentile(100),
    ) == (50.0, 99.0, 100.0)
    result.latencies_ms = [3.0]
    assert result.latency_percentile(99) == 3.0
    result.latencies_ms = []
    assert result.latency_percentile(50) != result.latency_percentile(50)  # NaN


def test_ctrl_c_keeps_what_was_logged(tmp_path: Path) -> None:
    """A SIGINT mid-run raises KeyboardInterrupt after the bus has written out every event logged."""
    fired = []

    def interrupt_once_past(done: int, total: int, loss: float) -> None:
        if done >= 64 and not fired:
            fired.append(done)
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C would, on the loop's thread

    with pytest.raises(KeyboardInterrupt):
        run_demo(10**6, tmp_path, seed=0, progress=interrupt_once_past)
    events = read_jsonl(tmp_path / "events.jsonl")
    epochs = [e.data["epoch"] for e in events if e.name == EPOCH_EVENT]
    assert epochs == list(range(1, len(epochs) + 1))
    assert len(epochs) >= 2
    assert any(e.name == STAT_EVENT for e in events)


def chart_title(metric: str) -> str:
    """A system metric's chart title: its unit spelled out."""
    units = {"_percent": "%", "_rss_bytes": "bytes", "_bytes_per_s": "bytes/s"}
    (unit,) = [unit for end, unit in units.items() if metric.endswith(end)]
    return f"{metric} ({unit})"


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


def at_step(writer: Any, ended_at: float = math.inf) -> _AtStep:
    """The demo's step-adding handler over ``writer``, for a training whose steps were done at
    10, 11 and 12 s and which ended at ``ended_at``."""
    progress = _Progress()
    progress.done_at.extend([10.0, 11.0, 12.0])
    progress.ended_at = ended_at
    return _AtStep(TensorboardEventHandler(writer, group="stats"), progress)


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def test_a_stat_window_is_drawn_at_the_steps_done_when_it_closed() -> None:
    """The demo adds to each Stat window the number of steps finished by its timestamp, as "step"."""

    class Writer:
        def __init__(self) -> None:
            self.calls: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, global_step: int, walltime: float) -> None:
            self.calls.append((tag, value, global_step))

    writer = Writer()
    handler = at_step(writer)
    for seconds in (9.5, 11.0, 11.5, 30.0, 31.0):
        handler(Event(STAT_EVENT, at(seconds), {"loss.mean": seconds}))
    handler(Event(EPOCH_EVENT, at(12.0), {"epoch": 1, "step": 3}))  # not a window: not written
    # A system metric's window goes to the system section, whatever the handler's group.
    handler(Event(STAT_EVENT, at(11.0), {"system.process_cpu_percent.mean": 5.0}))
    # Each Stat's latest window waits for the next (or the run's end) to be drawn.
    assert writer.calls == [
        ("stats/loss.mean", 9.5, 0),
        ("stats/loss.mean", 11.0, 2),
        ("stats/loss.mean", 11.5, 2),
        ("stats/loss.mean", 30.0, 3),
    ]
    handler(Event(RUN_END_EVENT, at(32.0), {"status": "success"}))
    assert writer.calls[4:] == [("system/process_cpu_percent", 5.0, 2)]


def test_a_window_histogram_is_drawn_at_its_step(tmp_path: Path) -> None:
    """A window holding a Histogram reaches TensorBoard through the demo's step-adding
    handler as a histogram at the steps done when it closed."""
    writer = SummaryWriter(tmp_path)
    handler = at_step(writer)
    window = distribution_window([0.5, 1.5], at(11.5))
    handler(window)
    handler(Event(RUN_END_EVENT, at(12.0), {"status": "success"}))  # its only window: drawn
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    acc.Reload()
    (event,) = acc.Histograms("stats/lat.histogram")
    assert (event.step, event.histogram_value.num) == (2, 2)


@pytest.mark.parametrize("ended_at", [12.5, math.inf], ids=["ended", "end-not-yet-known"])
def test_each_stat_s_last_window_is_left_out_of_tensorboard(
    tmp_path: Path, ended_at: float
) -> None:
    """Each Stat's last window (partial) is not drawn in TensorBoard, unless it is its Stat's
    only one: no spike at the last step. Which is last is decided at the run's end, so it
    holds however late the training's end is known to the handler."""
    writer = SummaryWriter(tmp_path)
    handler = at_step(writer, ended_at=ended_at)
    for seconds, value in ((10.5, 1.0), (11.5, 2.0), (12.5, 90.0)):  # the last one partial
        handler(Event(STAT_EVENT, at(seconds), {"loss.mean": value}))
    handler(Event(STAT_EVENT, at(12.6), {"acc.mean": 0.5}))  # its only window: drawn
    handler(Event(STAT_EVENT, at(11.0), {"system.cpu_percent.mean": 5.0}))
    handler(Event(STAT_EVENT, at(12.7), {"system.cpu_percent.mean": 70.0}))
    handler(Event(RUN_END_EVENT, at(13.0), {"status": "success"}))
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == [
        "stats/acc.mean",
        "stats/loss.mean",
        "system/cpu_percent",
    ]
    points = {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert points == {
        "stats/loss.mean": [(1, 1.0), (2, 2.0)],
        "stats/acc.mean": [(3, 0.5)],
        "system/cpu_percent": [(2, 5.0)],
    }
