"""The integration examples in examples/ (included by docs/integrations.md) run to completion
and print what reached each sink."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from .conftest import require

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in names)


def test_logging_bridge(tmp_path: Path) -> None:
    """Two records become two events, one extra is sanitized, and the way back makes no loop."""
    proc = run("logging_bridge.py", "--out", "run.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.splitlines()[-2:] == [
        "2 events in run.jsonl; extras sanitized: 1",
        "loop avoided: 2 records from the bus's own threads skipped",
    ]


def test_lightning_mlflow(tmp_path: Path) -> None:
    """The Lightning run reaches MLflow finished, with its hparams and one point per step."""
    require(_installed("lightning", "mlflow"), "lightning and mlflow are not installed")
    proc = run("lightning_mlflow.py", "--store", "mlflow.db", "--steps", "6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == [
        "run tiny-run: FINISHED, params {'hparams.lr': '0.05'}",
        "train_loss: 6 points, steps [0, 1, 2, 3, 4, 5]",
    ]


def test_hf_tensorboard(tmp_path: Path) -> None:
    """The Trainer's losses reach TensorBoard at their global steps, with an HPARAMS session."""
    require(_installed("transformers", "tensorboard"), "transformers is not installed")
    proc = run("hf_tensorboard.py", "--logdir", "tb", "--steps", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "loss at steps [1, 2, 3, 4]; hparams records: "
        "['_hparams_/session_end_info', '_hparams_/session_start_info']"
    )
