"""A tiny Lightning model trained on CPU, logging through the bus to MLflow: the training
loop never waits on the tracking server.

    python lightning_mlflow.py --store mlflow.db
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import lightning as L
import torch
from mlflow.tracking import MlflowClient

import monitor_bus as monitor
from monitor_bus.exporters.mlflow import MlflowEventHandler
from monitor_bus.integrations.lightning import MonitorBusLogger


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()  # Lightning passes these to log_hyperparams: the run start
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        return torch.utils.data.DataLoader(data, batch_size=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="mlflow.db", help="the SQLite file MLflow tracks in")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    uri = f"sqlite:///{args.store}"

    # --8<-- [start:train]
    mlflow_sink = MlflowEventHandler(uri, experiment_name="tiny")
    monitor.register_event_handler(mlflow_sink)
    trainer = L.Trainer(
        max_steps=args.steps,
        log_every_n_steps=1,
        accelerator="cpu",
        logger=MonitorBusLogger(name="tiny-run"),  # on the default bus
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny())  # finalize("success") ends the run and flushes the bus
    # --8<-- [end:train]

    # finalize() waited at most its finalize_timeout (10 s); MLflow's first write makes the
    # store, which can take longer on a busy machine: wait for every event before reading back.
    monitor.flush()
    run = MlflowClient(uri).get_run(mlflow_sink.run_id)
    history = MlflowClient(uri).get_metric_history(mlflow_sink.run_id, "train_loss")
    print(f"run {run.info.run_name}: {run.info.status}, params {run.data.params}")
    print(f"train_loss: {len(history)} points, steps {[m.step for m in history]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
