"""MonitorBusLogger on the real ``lightning`` package: a tiny model trained a few steps on CPU."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import monitor_bus
from monitor_bus import METRICS_EVENT, RUN_END_EVENT, RUN_START_EVENT

from .conftest import require

# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

try:
    import lightning as L
    import torch
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.loggers import CSVLogger

    from monitor_bus.integrations.lightning import MonitorBusLogger
except ImportError:
    L = None


@pytest.fixture(autouse=True)
def _lightning() -> Iterator[None]:
    require(
        L is not None,
        "lightning and torch are not installed (pip install 'monitor_bus[lightning]')",
    )
    sigint = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT after a Ctrl-C


def _model(fail_at: int | None = None, error: type[BaseException] = RuntimeError) -> Any:
    class Tiny(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if fail_at is not None and self.global_step == fail_at:
                raise error("boom")
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
            return torch.utils.data.DataLoader(data, batch_size=8)

    return Tiny()


def _fit(
    bus: monitor_bus.EventBus, tmp_path: Path, model: Any, **logger_args: Any
) -> list[monitor_bus.Event]:
    out = tmp_path / "run.jsonl"
    trainer = L.Trainer(
        max_steps=5,
        log_every_n_steps=1,
        accelerator="cpu",
        logger=[MonitorBusLogger(bus, name="tiny", **logger_args), CSVLogger(tmp_path)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with monitor_bus.JsonlEventHandler(out) as sink:
        handle = bus.register_event_handler(sink)
        try:
            trainer.fit(model)
        finally:
            assert bus.unregister_event_handler(handle, timeout=30)
    return list(monitor_bus.read_jsonl(out))


def test_training_logs_run_start_metrics_per_step_and_success(
    bus: monitor_bus.EventBus, tmp_path: Path
) -> None:
    """Hyperparams open the run, each step's metrics are one event at that step, success closes it."""
    events = _fit(bus, tmp_path, _model())
    names = [e.name for e in events]
    assert names == [RUN_START_EVENT] + [METRICS_EVENT] * 5 + [RUN_END_EVENT]
    start, end = events[0], events[-1]
    assert start.data["hparams.lr"] == 0.1
    assert start.data["run_name"] == "tiny"
    assert start.data["version.lightning"] == L.__version__
    metrics = events[1:-1]
    assert [e.data["step"] for e in metrics] == [0, 1, 2, 3, 4]
    assert all(isinstance(e.data["train_loss"], float) for e in metrics)
    assert {k for e in metrics for k in e.data} == {"train_loss", "epoch", "step"}
    assert end.data["status"] == "success"
    assert end.data["run_id"] == start.data["run_id"]
    # The other logger got the same steps.
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().count("\n") == 6


def test_a_failing_run_is_recorded_as_failed(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """An exception in training_step ends the run failed, with the exception's type."""
    with pytest.raises(RuntimeError, match="boom"):
        _fit(bus, tmp_path, _model(fail_at=2))
    events = list(monitor_bus.read_jsonl(tmp_path / "run.jsonl"))
    assert [e.name for e in events] == [RUN_START_EVENT] + [METRICS_EVENT] * 2 + [RUN_END_EVENT]
    assert events[-1].data["status"] == "failed"
    assert events[-1].data["exception"] == "builtins.RuntimeError"


def test_ctrl_c_is_recorded_as_interrupted(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """Lightning finalizes a Ctrl-C as "failed"; the run ends interrupted."""
    with pytest.raises(SystemExit):  # Lightning turns Ctrl-C into sys.exit(1)
        _fit(bus, tmp_path, _model(fail_at=1, error=KeyboardInterrupt))
    events = list(monitor_bus.read_jsonl(tmp_path / "run.jsonl"))
    assert events[-1].name == RUN_END_EVENT
    assert events[-1].data["status"] == "interrupted"
    assert events[-1].data["exception"] == "builtins.KeyboardInterrupt"


def test_only_rank_zero_logs_unless_all_ranks(
    bus: monitor_bus.EventBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder: Any
) -> None:
    """On a rank other than 0 the logger is silent by default and logs with all_ranks=True."""
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    bus.register_event_handler(recorder)
    quiet = MonitorBusLogger(bus)
    quiet.log_hyperparams({"lr": 0.1})
    quiet.log_metrics({"loss": 1.0}, step=0)
    quiet.finalize("success")
    assert recorder.events == []
    loud = MonitorBusLogger(bus, all_ranks=True)
    loud.log_hyperparams({"lr": 0.1})
    loud.log_metrics({"loss": 1.0}, step=0)
    loud.finalize("success")
    assert [e.name for e in recorder.events] == [RUN_START_EVENT, METRICS_EVENT, RUN_END_EVENT]
    assert recorder.events[0].data["rank"] == 1


def test_unloggable_metric_is_skipped_and_counted(bus: monitor_bus.EventBus, recorder: Any) -> None:
    """A metric value no event can hold is left out and counted; the others are logged."""
    bus.register_event_handler(recorder)
    logger = MonitorBusLogger(bus)
    logger.log_metrics({"loss": torch.tensor(0.5), "bad": torch.ones(3)}, step=7)
    logger.finalize("success")
    metrics = [e for e in recorder.events if e.name == METRICS_EVENT]
    assert metrics[0].data == {"loss": 0.5, "step": 7}
    assert logger.skipped_values == 1


def test_works_under_the_pytorch_lightning_package(
    bus: monitor_bus.EventBus, recorder: Any
) -> None:
    """The same logger drives a run under pytorch_lightning's Trainer (installed with lightning)."""
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = None
    require(pl is not None, "pytorch_lightning is not installed (lightning installs it)")

    class Tiny(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(16, 2))
            return torch.utils.data.DataLoader(data, batch_size=4)

    bus.register_event_handler(recorder)
    trainer = pl.Trainer(
        max_steps=3,
        log_every_n_steps=1,
        accelerator="cpu",
        logger=MonitorBusLogger(bus),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny())
    assert bus.flush(10)
    assert [e.name for e in recorder.events] == [RUN_START_EVENT] + [METRICS_EVENT] * 3 + [
        RUN_END_EVENT
    ]
    assert recorder.events[-1].data["status"] == "success"


def test_the_cli_summarises_and_plots_a_lightning_run(
    bus: monitor_bus.EventBus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``monitor-bus summary`` and ``plot`` read a real Lightning run's JSONL: its logged metric
    over the steps, not "no Stat events"."""
    from monitor_bus.__main__ import main

    events = _fit(bus, tmp_path, _model())
    losses = [e.data["train_loss"] for e in events if e.name == METRICS_EVENT]
    assert len(losses) == 5
    run = tmp_path / "run.jsonl"
    assert main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("metric ") :].splitlines()
    assert table[0].split() == ["metric", "points", "last", "step", "last", "min", "max"]
    assert table[1].split() == [
        "train_loss",
        "5",
        "4",
        *(f"{v:.6g}" for v in (losses[-1], min(losses), max(losses))),  # type: ignore[type-var]
    ]
    assert len(table) == 2
    png = tmp_path / "run.png"
    assert main(["plot", str(run), "-o", str(png)]) == 0
    assert capsys.readouterr().out == f"wrote {png} (1 panels, 1 series)\n"
    assert png.read_bytes().startswith(b"\x89PNG")
