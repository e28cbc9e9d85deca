"""One rank of a torchrun job for tests/test_slow_rank.py (CPU, gloo, DDP), in phases.

    torchrun --nproc_per_node=3 tests/slow_rank_job.py OUT_DIR

Every rank trains a tiny ``DistributedDataParallel`` model under a ``StepAnatomy`` (stages
data, forward, backward, optimizer; windows of ``WINDOW`` seconds), merged across ranks by
``merge_stats_across_ranks()`` with no ``stragglers`` argument. The job runs ``PHASES``, each a
whole number of windows on the wall clock (rank 0's, shared with every rank by a one-element
all-reduce before each step, outside it): clean; rank 2 sleeping ``DELAY`` seconds per step in
backward (a hook on the loss, so before any gradient bucket is launched); clean; rank 2
forcing full collections (``gc.collect()``) for ``DELAY`` seconds per step in its data stage;
clean (long enough for the slowdown rule to take the clean step as its baseline again);
every rank sleeping ``SLOWER`` seconds more per step in its data stage (the job slower, no
straggler). (For the storm, rank 2 freezes what it holds, ``gc.freeze()``, so a collection
traverses only a ballast of ``BALLAST`` lists: about 2 ms each, where one over all of torch's
objects takes about 75 ms here.) Rank 0 writes ``OUT_DIR/rank0.json``: each phase's start (wall clock), every
straggler and slowdown event and every merged window of ``step.wait_s`` and ``step.time_s`` it
logged; and ``OUT_DIR/merged.jsonl`` (a ``JsonlEventHandler``): the merged ``step.time_s``
windows, the slowdown events and a ``"slow_rank_job.phase"`` event stamped at each phase's
start.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import monitor_bus as monitor
from monitor_bus.integrations.torch import (
    SLOWDOWN_EVENT,
    STRAGGLER_EVENT,
    StepAnatomy,
    merge_stats_across_ranks,
)

WINDOW = 0.5
DELAY = 0.030
SLOW_RANK = 2
BALLAST = 100_000
SLOWER = 0.010
# The events OUT_DIR/merged.jsonl keeps, with the merged step.time_s windows.
KEPT = ("slow_rank_job.phase", SLOWDOWN_EVENT)
# (phase, windows long)
PHASES = [
    ("clean", 6),
    ("backward", 6),
    ("clean", 5),
    ("gc", 6),
    ("clean", 30),
    ("slower", 20),
]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    bus = monitor.EventBus(name="slow-rank")
    seen: list[monitor.Event] = []
    bus.register_event_handler(seen.append)
    jsonl = None
    if rank == 0:
        jsonl = monitor.JsonlEventHandler(out / "merged.jsonl")

        def keep(event: monitor.Event) -> None:
            if event.name in KEPT or "step.time_s.mean" in event.data:
                jsonl(event)

        bus.register_event_handler(keep)
    ballast: list[list[int]] = []

    def train_step(anatomy: StepAnatomy | None, phase: str) -> None:
        slow = rank == SLOW_RANK
        with anatomy.step() if anatomy else _nothing():
            with anatomy.stage("data") if anatomy else _nothing():
                batch = torch.randn(16, 32)
                if slow and phase == "gc":
                    if not ballast:
                        gc.freeze()
                        ballast.extend([] for _ in range(BALLAST))
                    start = time.perf_counter()
                    while time.perf_counter() - start < DELAY:
                        gc.collect()
                if phase == "slower":
                    time.sleep(SLOWER)
            with anatomy.stage("forward") if anatomy else _nothing():
                loss = model(batch).square().mean()
            with anatomy.stage("backward") if anatomy else _nothing():
                if slow and phase == "backward":
                    loss.register_hook(lambda grad: time.sleep(DELAY))
                loss.backward()
            with anatomy.stage("optimizer") if anatomy else _nothing():
                optimizer.step()
                optimizer.zero_grad()

    for _ in range(5):  # warm up, untimed
        train_step(None, "clean")
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
    while True:
        if rank == 0:  # rank 0's clock says the phase: 1 + its index; 0 before; -1 the end
            now = time.time()
            phase_now[0] = sum(now >= s for s in starts) if now < end else -1
        else:
            phase_now[0] = 0
        dist.all_reduce(phase_now)  # outside the step: not a wait the anatomy sees
        index = int(phase_now[0])
        if index < 0:
            break
        train_step(anatomy, PHASES[index - 1][0] if index else "clean")
    anatomy.close()
    assert merge.close(30)
    assert bus.close(30)
    if jsonl is not None:
        jsonl.close()
    if rank == 0:
        result: dict[str, Any] = {
            "phases": [[name, start] for (name, _), start in zip(PHASES, starts, strict=True)],
            "end": end,
            "stragglers": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == STRAGGLER_EVENT
            ],
            "slowdowns": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == SLOWDOWN_EVENT
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


class _nothing:
    """A context manager doing nothing (the untimed warm-up steps)."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


if __name__ == "__main__":
    main()
