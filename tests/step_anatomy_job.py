"""One rank of a torchrun job for tests/test_step_anatomy.py (CPU, gloo, DDP).

    torchrun --nproc_per_node=3 tests/step_anatomy_job.py OUT_DIR

Every rank trains a tiny ``DistributedDataParallel`` model under a ``StepAnatomy`` (stages
data, forward, backward, optimizer) for ``STEPS`` steps after ``WARMUP`` untimed ones; rank 2
sleeps ``DELAY`` seconds more per step inside backward (a hook on the loss, so before any
gradient bucket is launched). Its Stats' one window (an hour long) is logged as its bus closes,
and the rank writes each Stat's aggregates to ``OUT_DIR/rank<r>.json``, with whether its
model's weights ended equal to those of a twin trained on the same batches between the steps
with DDP's Python all-reduce hook (``allreduce_hook``), under ``"same_weights"``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import monitor_bus as monitor
from monitor_bus.integrations.torch import StepAnatomy

STEPS = 40
WARMUP = 3
DELAY = 0.030
SLOW_RANK = 2


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    twin_module = torch.nn.Linear(32, 8)
    twin_module.load_state_dict(model.module.state_dict())
    twin = torch.nn.parallel.DistributedDataParallel(twin_module)
    twin.register_comm_hook(None, allreduce_hook)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.01)
    bus = monitor.EventBus(name="anatomy")
    anatomy = StepAnatomy(model, window=timedelta(hours=1), bus=bus)

    def stall(grad: torch.Tensor) -> None:
        time.sleep(DELAY)

    for i in range(WARMUP + STEPS):
        timed = i >= WARMUP
        if i == WARMUP:
            dist.barrier()  # the timed steps start together
        step = anatomy.step() if timed else contextlib.nullcontext()
        with step:
            with anatomy.stage("data") if timed else contextlib.nullcontext():
                batch = torch.randn(16, 32)
            with anatomy.stage("forward") if timed else contextlib.nullcontext():
                loss = model(batch).square().mean()
            with anatomy.stage("backward") if timed else contextlib.nullcontext():
                if timed and rank == SLOW_RANK:
                    loss.register_hook(stall)
                loss.backward()
            with anatomy.stage("optimizer") if timed else contextlib.nullcontext():
                optimizer.step()
                optimizer.zero_grad()
        twin(batch).square().mean().backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
    anatomy.close()
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.module.parameters(), twin.module.parameters(), strict=True)
    )
    assert bus.close(30)
    result = {
        name: {agg.name.lower(): value for agg, value in stat.get().items()}
        for name, stat in anatomy.stats.items()
    }
    (out / f"rank{rank}.json").write_text(json.dumps({**result, "same_weights": same}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
