"""MonitorBusCallback on the real ``transformers`` Trainer: a tiny BERT built from a config
(no download) trained a few steps on CPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import monitor_bus
from monitor_bus import METRICS_EVENT, RUN_END_EVENT, RUN_START_EVENT

from .conftest import Recorder, require

try:
    import torch
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from monitor_bus.integrations.transformers import MonitorBusCallback
except ImportError:
    transformers = None


@pytest.fixture(autouse=True)
def _transformers() -> None:
    require(
        transformers is not None,
        "transformers and torch are not installed (pip install 'monitor_bus[transformers]')",
    )


class _Data(torch.utils.data.Dataset if transformers is not None else object):  # type: ignore[misc]
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.tensor([1 + i % 7, 2, 3, 4]), "labels": torch.tensor(i % 2)}


def _trainer(tmp_path: Path, callback: Any, model: Any = None) -> Any:
    config = BertConfig(
        vocab_size=16,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        logging_steps=1,
        per_device_train_batch_size=4,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        run_name="tiny-bert",
    )
    return Trainer(
        model=model or BertForSequenceClassification(config),
        args=args,
        train_dataset=_Data(),
        callbacks=[callback],
    )


def test_training_logs_run_start_steps_and_success(
    bus: monitor_bus.EventBus, recorder: Recorder, tmp_path: Path
) -> None:
    """Args and model config open the run, on_log is one event per global step, success ends it."""
    bus.register_event_handler(recorder)
    _trainer(tmp_path, MonitorBusCallback(bus)).train()
    assert bus.flush(30)
    events = recorder.events
    assert events[0].name == RUN_START_EVENT
    start = events[0].data
    assert start["run_name"] == "tiny-bert"
    assert start["hparams.max_steps"] == 4
    assert start["config.hidden_size"] == 8
    assert start["version.transformers"] == transformers.__version__
    metrics = [e for e in events if e.name == METRICS_EVENT]
    # One per logging step, then the Trainer's end-of-training summary at the last step.
    assert [e.data["step"] for e in metrics] == [1, 2, 3, 4, 4]
    assert all(isinstance(e.data["loss"], float) for e in metrics[:4])
    assert "train_runtime" in metrics[-1].data
    assert events[-1].name == RUN_END_EVENT
    assert events[-1].data["status"] == "success"


class _Boom(torch.nn.Module if transformers is not None else object):  # type: ignore[misc]
    def forward(self, input_ids: Any = None, labels: Any = None) -> Any:
        raise RuntimeError("boom")


def test_a_failing_train_is_recorded_failed_at_exit(
    bus: monitor_bus.EventBus, recorder: Recorder, tmp_path: Path
) -> None:
    """A train() that raises leaves the run open; the interpreter's excepthook ends it failed."""
    bus.register_event_handler(recorder)
    callback = MonitorBusCallback(bus)
    trainer = _trainer(tmp_path, callback, model=_Boom())
    try:
        trainer.train()
    except RuntimeError:
        assert callback.run is not None
        assert callback.run.status is None
        sys.excepthook(*sys.exc_info())  # what the interpreter does with an uncaught exception
    assert bus.flush(30)
    end = recorder.events[-1]
    assert end.name == RUN_END_EVENT
    assert end.data["status"] == "failed"
    assert end.data["exception"] == "builtins.RuntimeError"


def test_only_world_process_zero_logs_by_default(
    bus: monitor_bus.EventBus, recorder: Recorder
) -> None:
    """A process other than zero logs nothing unless all_processes=True."""

    class State:
        is_world_process_zero = False
        global_step = 3

    bus.register_event_handler(recorder)
    MonitorBusCallback(bus).on_log(None, State(), None, logs={"loss": 1.0})
    MonitorBusCallback(bus, all_processes=True).on_log(
        None, State(), None, logs={"loss": 1.0, "note": "x"}
    )
    assert bus.flush(10)
    assert [e.data for e in recorder.events] == [{"loss": 1.0, "step": 3}]
