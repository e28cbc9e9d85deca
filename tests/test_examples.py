"""Every script in examples/ runs to completion, under each anyio backend where it takes one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=EXAMPLES
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_trainer_stops_early_and_its_sink_gets_every_event(backend: str) -> None:
    """The trainer early-stops from its subscription, and the async sink posted every logged event."""
    proc = run("async_trainer.py", "--backend", backend, "--steps", "300")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    decision, summary = proc.stdout.splitlines()
    # Seeded data: the validation loss stops improving at step 60, so the stopper decides at 90.
    assert decision == (
        "early stop: val_loss has not improved for 3 evals (best 0.01012 at step 60); "
        "stopping after step 90"
    )
    m = re.fullmatch(
        r"trained (\d+) steps, (\d+) evals; bus logged (\d+) events, sink posted (\d+), dropped 0",
        summary,
    )
    assert m, summary
    steps, evals, logged, posted = map(int, m.groups())
    # The decision travels through the bus while training goes on: it lands at step 90 or later.
    assert 90 <= steps <= 300
    assert evals == steps // 10
    assert logged == posted
    assert logged >= steps + evals + 1  # one event per step and per eval, eval.done, Stat windows


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_trainer_runs_to_the_step_limit_without_early_stop(backend: str) -> None:
    """With too few steps to plateau, the stopper reports no early stop and training runs them all."""
    proc = run("async_trainer.py", "--backend", backend, "--steps", "30")
    assert proc.returncode == 0, proc.stderr
    decision, summary = proc.stdout.splitlines()
    assert decision.startswith("no early stop: best val_loss ")
    assert decision.endswith(" at step 30")
    assert summary.startswith("trained 30 steps, 3 evals; ")


def test_async_trainer_rejects_a_bad_step_count() -> None:
    """--steps 0 is one clear line on stderr and a non-zero exit, no traceback."""
    proc = run("async_trainer.py", "--steps", "0")
    assert proc.returncode == 2
    assert "--steps must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_torch_style_writes_every_loss_to_tensorboard(tmp_path: Path) -> None:
    """The torch.monitor docs' usage runs unchanged; TensorBoard's reader finds every loss counted."""
    proc = run("torch_style.py", "--steps", "2000", "--logdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert re.fullmatch(
        r"handler saw \d+ Stat events between 'training_start' and 'torch.monitor.Stat'", lines[0]
    ), lines[0]
    assert re.fullmatch(r"tensorboard loss.count: \d+ windows, 2000 losses", lines[1]), lines[1]
    assert (
        lines[2]
        == "tensorboard tags: loss.count, loss.mean, loss.min, step_time.max, step_time.mean"
    )
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_dataloader_workers_reach_the_parents_sink() -> None:
    """Every item event and Stat window logged in the DataLoader's workers is in the parent's
    JSONL file, marked with its worker."""
    import importlib.util

    from .conftest import require

    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    proc = run("dataloader_workers.py", "--items", "200", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"sum of squares {sum(i * i for i in range(200))}",
        "worker 0: 100 item events",
        "worker 1: 100 item events",
        "Stat windows from the workers counted 200 items",
        "dropped 0",
    ]


def test_slow_rank_ddp_names_the_slow_rank_in_its_stage_and_shows_what_it_cost(
    tmp_path: Path,
) -> None:
    """examples/slow_rank_ddp.py under torchrun (3 gloo ranks, DDP): rank 0 names rank 2, its
    data loading 20 ms slower per step for a while, a straggler in stage "data" with its host,
    then recovered; ``monitor-bus summary`` puts rank 2's data stage first in the time lost,
    and ``monitor-bus plot --anatomy`` draws the bars. (How close the wait comes to the delay
    is timing, checked in tests/test_slow_rank.py's stress job.)"""
    import socket

    from .test_merge_ranks import ROOT, run_job

    proc = run_job(tmp_path, str(tmp_path), script=ROOT / "examples" / "slow_rank_ddp.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    host = socket.gethostname()
    named = [line for line in lines if line.startswith(("straggler:", "recovered:"))]
    assert [line.split(", the others")[0] for line in named] == [
        f"straggler: rank 2 on {host}",
        f"recovered: rank 2 on {host}",
    ], proc.stdout
    assert all(line.endswith("in stage 'data'") for line in named), proc.stdout
    at = next(i for i, line in enumerate(lines) if line.startswith("time lost waiting"))
    assert lines[at + 2].split()[:3] == ["2", f"({host})", "data"], proc.stdout
    assert (
        lines[-1] == f"wrote {tmp_path / 'anatomy.png'} (1 panels, 1 with a bar per rank, 0 series)"
    )
    assert (tmp_path / "anatomy.png").stat().st_size > 0
