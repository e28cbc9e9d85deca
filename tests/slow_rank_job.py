"""One rank of a torchrun job for tests/test_slow_rank.py (CPU, gloo, DDP), in phases.

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 ... tests/slow_rank_job.py OUT_DIR
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 ... tests/slow_rank_job.py OUT_DIR

Two torchrun "nodes": rank 0 (dst) on the first, ranks 1 and 2 on the second, so the merge
is two-level (rank 1 merges its node's windows for dst) and ``SLOW_RANK`` sits behind a leader.
Every rank trains a tiny ``DistributedDataParallel`` model under a ``StepAnatomy`` (stages
data, forward, backward, optimizer; windows of ``WINDOW`` seconds), merged across ranks by
``merge_stats_across_ranks()`` with no ``stragglers`` argument. Each step opens with a
one-element all-reduce of the phase (rank 0's wall clock says which), wrapped in
``anatomy.collective()``: a collective called by hand, so a rank late to it is waited for
there, in the step. The job runs ``PHASES``, each a whole number of windows; in each slow one,
rank 2 spends ``DELAY`` seconds more per step:

- ``backward``: sleeping in a hook on the loss (inside the backward pass, before any gradient
  bucket is launched);
- ``gc``: forcing full collections (``gc.collect()``) in its data stage (it freezes what it
  holds, ``gc.freeze()``, so a collection traverses only a ballast of ``BALLAST`` lists:
  about 2 ms each, where one over all of torch's objects takes about 75 ms here);
- ``data``, ``forward``, ``optimizer``: sleeping in that stage;
- ``nostages``: sleeping in a step without stages;
- ``collective``: sleeping in forward, in steps that bypass DDP (the plain module's backward,
  then the gradients all-reduced by hand inside ``anatomy.collective()``).

Rank 0 writes ``OUT_DIR/rank0.json``: each phase's start (wall clock), the host of each rank,
every straggler and anatomy event, and every merged window of ``step.wait_s`` and
``step.time_s`` it logged.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import monitor_bus as monitor
from monitor_bus.integrations.torch import (
    ANATOMY_EVENT,
    STRAGGLER_EVENT,
    StepAnatomy,
    merge_stats_across_ranks,
)

WINDOW = 0.5
DELAY = 0.030
SLOW_RANK = 2
BALLAST = 100_000
SLOW, CLEAN = 4, 2  # windows of a slow phase, and of the clean one after it
# (phase, windows long)
PHASES = [("clean", 6)] + [
    phase
    for name in ("backward", "gc", "data", "forward", "optimizer", "nostages", "collective")
    for phase in ((name, SLOW), ("clean", CLEAN))
]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    bus = monitor.EventBus(name="slow-rank")
    seen: list[monitor.Event] = []
    bus.register_event_handler(seen.append)
    ballast: list[list[int]] = []
    none = contextlib.nullcontext()

    def train_step(anatomy: StepAnatomy | None, phase: str) -> None:
        slow = rank == SLOW_RANK and phase
        staged = anatomy is not None and phase != "nostages"

        def stage(name: str) -> Any:
            return anatomy.stage(name) if staged and anatomy else none

        if slow == "nostages":
            time.sleep(DELAY)
        with stage("data"):
            batch = torch.randn(16, 32)
            if slow == "data":
                time.sleep(DELAY)
            if slow == "gc":
                if not ballast:
                    gc.freeze()
                    ballast.extend([] for _ in range(BALLAST))
                start = time.perf_counter()
                while time.perf_counter() - start < DELAY:
                    gc.collect()
        with stage("forward"):
            net = model.module if phase == "collective" else model
            loss = net(batch).square().mean()
            if slow in ("forward", "collective"):
                time.sleep(DELAY)
        with stage("backward"):
            if slow == "backward":
                loss.register_hook(lambda grad: time.sleep(DELAY))
            loss.backward()
            if phase == "collective":  # DDP bypassed: the gradients all-reduced by hand
                with anatomy.collective() if anatomy else none:
                    for param in model.module.parameters():
                        dist.all_reduce(param.grad)
                        param.grad /= world
        with stage("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
            if slow == "optimizer":
                time.sleep(DELAY)

    for _ in range(5):  # warm up, untimed
        train_step(None, "")
    merge = merge_stats_across_ranks(bus=bus, timeout=10.0)
    anatomy = StepAnatomy(model, window=timedelta(seconds=WINDOW), bus=bus)
    # Rank 0's schedule: each phase a whole number of windows, from the next window but one.
    begin = (math.floor(time.time() / WINDOW) + 2) * WINDOW
    starts, at = [], begin
    for _, windows in PHASES:
        starts.append(at)
        at += windows * WINDOW
    end = at
    phase_now = torch.zeros(1)
    while True:
        with anatomy.step():
            if rank == 0:  # rank 0's clock says the phase: 1 + its index; 0 before; -1 the end
                now = time.time()
                phase_now[0] = sum(now >= s for s in starts) if now < end else -1
            else:
                phase_now[0] = 0
            with anatomy.collective():
                dist.all_reduce(phase_now)
            index = int(phase_now[0])
            if index < 0:
                break
            phase = PHASES[index - 1][0] if index else "clean"
            train_step(anatomy, "" if phase == "clean" else phase)
    anatomy.close()
    assert merge.close(30)
    assert bus.close(30)
    if rank == 0:
        result: dict[str, Any] = {
            "phases": [[name, start] for (name, _), start in zip(PHASES, starts, strict=True)],
            "end": end,
            "hosts": merge.hosts,
            "stragglers": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == STRAGGLER_EVENT
            ],
            "anatomy": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == ANATOMY_EVENT
            ],
            "windows": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == monitor.STAT_EVENT
                and ("step.wait_s.mean" in e.data or "step.time_s.mean" in e.data)
            ],
        }
        (out / "rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
