"""Find the slow rank in a synchronized job: a small DDP model under StepAnatomy, merged on rank 0.

Every rank trains the same small ``DistributedDataParallel`` model (gloo, CPU) on its shard of
a synthetic data set. DDP's all-reduce makes every rank's step as long as the slowest one's,
so the step time cannot say who is slow; ``StepAnatomy`` times each step's stages and the
time the rank waited in the all-reduce, and ``merge_stats_across_ranks()`` names the rank the
others wait for, with its stage and the time it cost them. Here the last rank's data loading
is made ``DELAY`` seconds slower per step for a while (as a slow disk or a busy loader would).

Rank 0 writes the merged stream to ``OUT_DIR/rank0.jsonl``, prints the straggler events, then
runs ``monitor-bus summary`` on it (its stragglers and breakdown, the Stat table left out) and
``monitor-bus plot --anatomy``, which draws ``OUT_DIR/anatomy.png``.

Run:  torchrun --nproc_per_node=3 examples/slow_rank_ddp.py [OUT_DIR]
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import monitor_bus as monitor
from monitor_bus.integrations.torch import STRAGGLER_EVENT, StepAnatomy, merge_stats_across_ranks

DELAY = 0.020  # seconds the slow rank's data stage takes longer per step
STEPS, SLOW_FROM, SLOW_UNTIL = 320, 100, 220  # the job's steps, and the slow rank's slow ones


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/slow_rank_ddp")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    features = torch.randn(4096, 32)
    data = TensorDataset(features, features @ torch.randn(32, 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[monitor.Event] = []
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        jsonl = monitor.JsonlEventHandler(out / "rank0.jsonl")
        monitor.register_event_handler(jsonl)
        monitor.register_event_handler(seen.append)

    # --8<-- [start:usage]
    merge = merge_stats_across_ranks(timeout=10.0)  # names stragglers from StepAnatomy's Stats
    anatomy = StepAnatomy(model, window=timedelta(milliseconds=500))
    batches = forever(loader, sampler)
    for step in range(STEPS):
        with anatomy.step():
            with anatomy.stage("data"):
                x, y = next(batches)
                if rank == world - 1 and SLOW_FROM <= step < SLOW_UNTIL:
                    time.sleep(DELAY)  # this rank's data loading is slow for a while
            with anatomy.stage("forward"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            with anatomy.stage("backward"):
                loss.backward()  # DDP's all-reduce: the wait, timed by StepAnatomy's hook
            with anatomy.stage("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    anatomy.close()
    merge.close()
    # --8<-- [end:usage]

    if rank == 0:
        monitor.flush()
        for event in seen:
            if event.name == STRAGGLER_EVENT:
                d = event.data
                what = "recovered" if d["recovered"] else "straggler"
                print(
                    f"{what}: rank {d['rank']} on {d['host']}, the others waited "
                    f"{d['exposed_s'] * 1e3:.1f} ms per step for it, in stage {d['stage']!r}"
                )
        jsonl.close()
        run = str(out / "rank0.jsonl")
        summary = cli("summary", run)
        print(summary.split("\nstat ", 1)[0].rstrip())  # the Stat table left out
        print(cli("plot", run, "--anatomy", "-o", str(out / "anatomy.png")).rstrip())
    dist.destroy_process_group()
    return 0


def forever(loader: DataLoader, sampler: DistributedSampler) -> Iterator[list[torch.Tensor]]:
    """The loader's batches, epoch after epoch."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def cli(*args: str) -> str:
    """What ``monitor-bus ARGS`` prints (it must succeed)."""
    command = [sys.executable, "-m", "monitor_bus", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
