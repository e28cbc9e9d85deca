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
  then the gradients all-reduced by hand inside ``anatomy.collective()``);
- ``slower``, after ``BASELINE`` clean windows (the slowdown rule's baseline again): every rank
  sleeping ``SLOWER`` seconds more per step in its data stage (the job slower, no straggler).

Then the hang: with ``hang_after`` at ``HANG_AFTER`` seconds, rank 2 is stuck in its data stage
until dst has named it (dst's handler of ``HANG_EVENT`` writes ``OUT_DIR/hang``; rank 2 waits
for that file), while ranks 0 and 1 wait for it in DDP's all-reduce; then, ``hang_after`` back
at its default, the job trains ``AFTER`` more windows; last, ``TWIN_STEPS`` steps of the model
beside a twin (its copy, under DDP's Python all-reduce hook, ``allreduce_hook``) on the same
batches: whether every rank's model ended equal to its twin goes under ``"same_weights"``.

Rank 0 writes ``OUT_DIR/rank0.json``: each phase's start (wall clock), the host of each rank,
every straggler, anatomy, slowdown and hang event, and every merged window of ``step.wait_s`` and
``step.time_s`` it logged; and ``OUT_DIR/merged.jsonl`` (a ``JsonlEventHandler``): the merged
``step.time_s`` windows, the slowdown events and a ``"slow_rank_job.phase"`` event stamped at
each phase's start.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import monitor_bus as monitor
from monitor_bus.integrations.torch import (
    ANATOMY_EVENT,
    HANG_EVENT,
    SLOWDOWN_EVENT,
    STRAGGLER_EVENT,
    StepAnatomy,
    merge_stats_across_ranks,
)

WINDOW = 0.5
DELAY = 0.030
SLOW_RANK = 2
BALLAST = 100_000
SLOW, CLEAN = 4, 2  # windows of a slow phase, and of the clean one after it
BASELINE = 30  # clean windows before the slower phase
# (phase, windows long)
PHASES = (
    [("clean", 6)]
    + [
        phase
        for name in ("backward", "gc", "data", "forward", "optimizer", "nostages", "collective")
        for phase in ((name, SLOW), ("clean", CLEAN))
    ]
    + [("clean", BASELINE), ("slower", 20)]
)
SLOWER = 0.010
# The events OUT_DIR/merged.jsonl keeps, with the merged step.time_s windows.
KEPT = ("slow_rank_job.phase", SLOWDOWN_EVENT)
HANG_AFTER = 2.0  # four of the senders' half-second rounds: rank 2 reports its stage first
AFTER = 4  # windows of clean steps after the hang
HANG_WAIT = 60.0  # how long rank 2 waits at most for dst to name it
TWIN_STEPS = 5


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
    hang_file = out / "hang"

    def on_hang(event: monitor.Event) -> None:
        if event.name == HANG_EVENT and not hang_file.exists():
            (out / "hang.tmp").write_text(json.dumps(event.data))
            os.replace(out / "hang.tmp", hang_file)  # whole, for rank 2 to see

    bus.register_event_handler(on_hang)
    jsonl = None
    if rank == 0:
        jsonl = monitor.JsonlEventHandler(out / "merged.jsonl")

        def keep(event: monitor.Event) -> None:
            if event.name in KEPT or "step.time_s.mean" in event.data:
                jsonl(event)

        bus.register_event_handler(keep)
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
            if phase == "slower":
                time.sleep(SLOWER)
            if slow == "hang":  # stuck until dst has named it
                deadline = time.monotonic() + HANG_WAIT
                while not hang_file.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no hang event within {HANG_WAIT} s")
                    time.sleep(0.01)
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
    if rank == 0:
        for (name, _), start in zip(PHASES, starts, strict=True):
            stamp = datetime.fromtimestamp(start, timezone.utc)
            bus.log_event(monitor.Event("slow_rank_job.phase", stamp, {"phase": name}))
    phase_now = torch.zeros(1)

    def train_until(end: float, phase_of: Any) -> None:
        """Train while rank 0's clock is before ``end``, in the phase ``phase_of(now)`` says
        (1 + its index in PHASES; 0: clean)."""
        while True:
            with anatomy.step():
                now = time.time()
                phase_now[0] = (phase_of(now) if now < end else -1) if rank == 0 else 0
                with anatomy.collective():
                    dist.all_reduce(phase_now)
                index = int(phase_now[0])
                if index < 0:
                    return
                phase = PHASES[index - 1][0] if index else "clean"
                train_step(anatomy, "" if phase == "clean" else phase)

    train_until(end, lambda now: sum(now >= s for s in starts))
    anatomy.hang_after = HANG_AFTER
    with anatomy.step():
        train_step(anatomy, "hang")
    anatomy.hang_after = 60.0  # dst's own, at once: no other hang can be named after this
    train_until(time.time() + AFTER * WINDOW, lambda now: 0)
    # The timed all-reduce averages the gradients as DDP's own hook does, bit for bit.
    twin_module = torch.nn.Linear(32, 8)
    twin_module.load_state_dict(model.module.state_dict())
    twin = torch.nn.parallel.DistributedDataParallel(twin_module)
    twin.register_comm_hook(None, allreduce_hook)
    nets = [(model, optimizer), (twin, torch.optim.SGD(twin.parameters(), lr=0.01))]
    for _ in range(TWIN_STEPS):
        batch = torch.randn(16, 32)
        for net, opt in nets:
            net(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
    pairs = zip(model.module.parameters(), twin.module.parameters(), strict=True)
    same = torch.tensor([float(all(torch.equal(a, b) for a, b in pairs))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    anatomy.close()
    assert merge.close(30)
    assert bus.close(30)
    if jsonl is not None:
        jsonl.close()
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
            "same_weights": bool(same[0]),
            "slowdowns": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == SLOWDOWN_EVENT
            ],
            "hangs": [dict(e.data) for e in seen if e.name == HANG_EVENT],
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
