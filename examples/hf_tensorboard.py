"""A tiny BERT (built from a config, nothing downloaded) trained a few steps with the Hugging
Face Trainer, logging through the bus to TensorBoard with the torch-free SummaryWriter.

    python hf_tensorboard.py --logdir runs/tiny
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PrinterCallback,
    Trainer,
    TrainingArguments,
)

import monitor_bus as monitor
from monitor_bus.integrations.transformers import MonitorBusCallback
from monitor_bus.tensorboard import SummaryWriter


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([1 + i % 7, 2, 3, 4]), "labels": torch.tensor(i % 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/tiny", help="the TensorBoard log directory")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    config = BertConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8,
    )  # fmt: skip

    # --8<-- [start:train]
    writer = SummaryWriter(args.logdir)
    # Run start/end become an HPARAMS session, metrics events scalars at the Trainer's step.
    monitor.register_event_handler(writer.add_run_event)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=BertForSequenceClassification(config),
            args=TrainingArguments(
                output_dir=out,
                max_steps=args.steps,
                logging_steps=1,
                report_to="none",
                per_device_train_batch_size=4,
                save_strategy="no",
                use_cpu=True,
                disable_tqdm=True,
            ),
            train_dataset=Data(),
            callbacks=[MonitorBusCallback()],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()  # on_train_end ends the run and flushes the bus
    writer.close()
    # --8<-- [end:train]

    acc = EventAccumulator(args.logdir)
    acc.Reload()
    steps = [s.step for s in acc.Scalars("loss")]
    print(f"loss at steps {steps}; hparams records: {sorted(acc.PluginTagToContent('hparams'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
