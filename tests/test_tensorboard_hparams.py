"""SummaryWriter's add_text, add_hparams and add_run_event, read back with EventAccumulator
(HPARAMS and TEXT plugin data included)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import api_pb2, metadata
from tensorboard.util import tensor_util

import monitor_bus
from monitor_bus import METRICS_EVENT, RUN_END_EVENT, Run
from monitor_bus.tensorboard import SummaryWriter

from .conftest import Recorder

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _load(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _hparams(acc: EventAccumulator) -> dict[str, bytes]:
    return acc.PluginTagToContent(metadata.PLUGIN_NAME)


def _values(info: Any) -> dict[str, Any]:
    return {name: getattr(v, v.WhichOneof("kind")) for name, v in info.hparams.items()}


def _text(acc: EventAccumulator, tag: str) -> str:
    (event,) = acc.Tensors(tag)
    return tensor_util.make_ndarray(event.tensor_proto).item().decode()


def test_add_text_is_read_back(tmp_path: Path) -> None:
    """A text is a string tensor of the text plugin at its step."""
    with SummaryWriter(tmp_path) as writer:
        writer.add_text("notes", "hello *world*", global_step=3)
    acc = _load(tmp_path)
    assert acc.Tags()["tensors"] == ["notes"]
    assert acc.SummaryMetadata("notes").plugin_data.plugin_name == "text"
    assert _text(acc, "notes") == "hello *world*"
    assert acc.Tensors("notes")[0].step == 3


def test_add_hparams_writes_a_finished_session(tmp_path: Path) -> None:
    """The experiment, the session start with its hparams, the metric and a success end."""
    with SummaryWriter(tmp_path) as writer:
        writer.add_hparams(
            {"lr": 0.1, "opt": "adam", "bn": True},
            {"hparam/accuracy": 0.75},
            hparam_domain_discrete={"opt": ["adam", "sgd"]},
        )
    acc = _load(tmp_path)
    content = _hparams(acc)
    assert set(content) == {
        metadata.EXPERIMENT_TAG,
        metadata.SESSION_START_INFO_TAG,
        metadata.SESSION_END_INFO_TAG,
    }
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert [i.name for i in experiment.hparam_infos] == ["lr", "opt", "bn"]
    assert [v.string_value for v in experiment.hparam_infos[1].domain_discrete.values] == [
        "adam",
        "sgd",
    ]
    assert [m.name.tag for m in experiment.metric_infos] == ["hparam/accuracy"]
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert _values(start) == {"lr": 0.1, "opt": "adam", "bn": True}
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.STATUS_SUCCESS
    assert [s.value for s in acc.Scalars("hparam/accuracy")] == [0.75]


def _fail(bus: monitor_bus.EventBus, run: Run) -> None:
    with run:
        bus.log_event(monitor_bus.Event(METRICS_EVENT, T0, {"loss": 0.5, "step": 7, "phase": "x"}))
        raise ValueError("boom")


def test_run_events_become_a_session_with_status_and_scalars(
    bus: monitor_bus.EventBus, recorder: Recorder, tmp_path: Path
) -> None:
    """A failed Run's events give an HPARAMS session of its hyperparameters ending in failure,
    its texts (floats to six digits; the start's tag sorting before the end's, as the TEXT tab
    lists them) and its metrics at their steps; other events are not written. A whole number
    stays a number in the session (the tab sorts and filters it as one); the text shows it as
    logged."""
    bus.register_event_handler(recorder)
    run = Run("exp", hparams={"lr": 0.1, "batch": 2048}, config={"layers": 2}, bus=bus)
    with pytest.raises(ValueError, match="boom"):
        _fail(bus, run)
    bus.log_event(monitor_bus.Event("other", T0, {"x": 1}))
    assert bus.flush(10)
    with SummaryWriter(tmp_path) as writer:
        written = [writer.add_run_event(event) for event in recorder.events]
    assert written == [True, True, True, False]
    acc = _load(tmp_path)
    content = _hparams(acc)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    # The config would sort first in the tab.
    assert _values(start) == {"hparams.lr": 0.1, "hparams.batch": 2048.0}
    assert start.hparams["hparams.batch"].WhichOneof("kind") == "number_value"
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.STATUS_FAILURE
    assert [(s.step, s.value) for s in acc.Scalars("loss")] == [(7, 0.5)]
    assert sorted(acc.PluginTagToContent("text")) == ["run/start", "run/stop"]
    assert "| status | failed |" in _text(acc, "run/stop")
    assert "| exception | builtins.ValueError |" in _text(acc, "run/stop")
    assert "| run_name | exp |" in _text(acc, "run/start")
    (duration,) = [e.data["duration_s"] for e in recorder.events if e.name == RUN_END_EVENT]
    assert f"| duration_s | {duration:.6g} |" in _text(acc, "run/stop")
    assert "| config.layers | 2 |" in _text(acc, "run/start")
    assert "| hparams.batch | 2048 |" in _text(acc, "run/start")
    # No final metrics: no experiment, so the tab lists the run's scalar tags, as before.
    assert metadata.EXPERIMENT_TAG not in content


def test_a_run_s_final_metrics_are_the_hparams_metrics_at_its_last_step(
    bus: monitor_bus.EventBus, recorder: Recorder, tmp_path: Path
) -> None:
    """The HPARAMS experiment lists the run's final metrics (``Run.metrics``) rather than
    every scalar tag; they, the session's end and ``run/stop`` are at the highest step the
    writer wrote, the run's last; an int hparam is a number (the tab has no int type)."""
    bus.register_event_handler(recorder)
    with Run("exp", hparams={"lr": 0.1, "batch": 256}, bus=bus) as run:
        run.metrics = {"val_accuracy": 0.875, "step_time_ms_p99": 4.5, "note": "not a number"}
    assert bus.flush(10)
    start, end = recorder.events
    with SummaryWriter(tmp_path) as writer:
        writer.add_run_event(start)
        for step in range(3001):
            writer.add_scalar("loss", 1.0 / (step + 1), global_step=step)
        writer.add_run_event(end)
    acc = _load(tmp_path)
    content = _hparams(acc)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.metric_infos] == [
        "summary/val_accuracy",
        "summary/step_time_ms_p99",
    ]
    assert [(i.name, i.type) for i in experiment.hparam_infos] == [
        ("hparams.lr", api_pb2.DATA_TYPE_FLOAT64),
        ("hparams.batch", api_pb2.DATA_TYPE_FLOAT64),
    ]
    assert [(s.step, s.value) for s in acc.Scalars("summary/val_accuracy")] == [(3000, 0.875)]
    assert [(s.step, s.value) for s in acc.Scalars("summary/step_time_ms_p99")] == [(3000, 4.5)]
    assert [e.step for e in acc.Tensors("run/stop")] == [3000]
    assert "| metrics.note | not a number |" in _text(acc, "run/stop")


def test_add_custom_scalars_checks_its_layout(tmp_path: Path) -> None:
    """A layout not of torch's form is a TypeError or ValueError saying where."""
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="layout must be a mapping"):
            writer.add_custom_scalars([])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"layout\['c'\] must be a mapping"):
            writer.add_custom_scalars({"c": []})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match=r"layout\['c'\]\['t'\] must be"):
            writer.add_custom_scalars({"c": {"t": ["Margin", ["a", "b"]]}})
        with pytest.raises(ValueError, match=r"layout\['c'\]\['t'\] must be"):
            writer.add_custom_scalars({"c": {"t": "Multiline"}})


def test_a_run_without_hyperparameters_has_its_config_in_the_session(
    bus: monitor_bus.EventBus, recorder: Recorder, tmp_path: Path
) -> None:
    """A run with a config and no hyperparameters still has an HPARAMS session: of its config."""
    bus.register_event_handler(recorder)
    with Run("exp", config={"layers": 2}, bus=bus):
        pass
    assert bus.flush(10)
    with SummaryWriter(tmp_path) as writer:
        for event in recorder.events:
            writer.add_run_event(event)
    start = metadata.parse_session_start_info_plugin_data(
        _hparams(_load(tmp_path))[metadata.SESSION_START_INFO_TAG]
    )
    assert _values(start) == {"config.layers": 2.0}


def test_add_text_checks_its_arguments(tmp_path: Path) -> None:
    """Wrong types are TypeErrors naming the argument."""
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="text_string must be a str"):
            writer.add_text("t", 3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="hparam_dict must be a mapping"):
            writer.add_hparams([1])  # type: ignore[arg-type]


def test_the_rank_merge_s_findings_are_texts_each_at_its_own_steps(
    bus: monitor_bus.EventBus, tmp_path: Path
) -> None:
    """Through the bus and the TensorBoard sink: a straggler, two hung ranks and a slowdown
    are Markdown tables under the texts "stragglers", "hangs" and "slowdowns", each tag
    counting its own steps from 0."""
    from monitor_bus.ranks import HANG_EVENT, SLOWDOWN_EVENT, STRAGGLER_EVENT

    hang = {"host": "n1", "stage": "data", "in_step": True, "waits": False, "waiting": 2}
    events = [
        (STRAGGLER_EVENT, {"stat": "step.wait_s", "rank": 2, "host": "n1", "recovered": False}),
        (HANG_EVENT, {**hang, "rank": 2, "seconds": 61.5, "silent_s": 0.5}),
        (HANG_EVENT, {**hang, "rank": 1, "seconds": 61.5, "silent_s": 0.25}),
        (SLOWDOWN_EVENT, {"stat": "step.time_s", "before": 0.01, "after": 0.0125, "ratio": 1.25}),
    ]
    with SummaryWriter(tmp_path) as writer:
        bus.register_event_handler(monitor_bus.TensorboardEventHandler(writer))
        for name, data in events:
            bus.log_event(monitor_bus.Event(name, T0, data))
        assert bus.flush(10)
    acc = _load(tmp_path)
    assert sorted(acc.PluginTagToContent("text")) == ["hangs", "slowdowns", "stragglers"]
    texts = {
        tag: [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
            for e in acc.Tensors(tag)
        ]
        for tag in ("stragglers", "hangs", "slowdowns")
    }
    assert [step for step, _ in texts["stragglers"]] == [0]
    assert "| rank | 2 |" in texts["stragglers"][0][1]
    assert [step for step, _ in texts["hangs"]] == [0, 1]
    assert ["| rank | 2 |" in text for _, text in texts["hangs"]] == [True, False]
    assert "| rank | 1 |" in texts["hangs"][1][1]
    assert "| stage | data |" in texts["hangs"][0][1]
    assert "| seconds | 61.5 |" in texts["hangs"][0][1]
    ((step, slowdown),) = texts["slowdowns"]
    assert step == 0
    assert "| ratio | 1.25 |" in slowdown
    assert "| stat | step.time_s |" in slowdown
