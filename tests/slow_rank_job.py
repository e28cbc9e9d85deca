"""One rank of a torchrun job for tests/test_slow_rank.py (CPU, gloo, DDP), in phases.

    torchrun --nproc_per_node=3 tests/slow_rank_job.py OUT_DIR

Every rank trains a tiny ``DistributedDataParallel`` model under a ``StepAnatomy`` (stages
data, forward, backward, optimizer; windows of ``WINDOW`` seconds), merged across ranks by
``merge_stats_across_ranks()`` with no ``stragglers`` argument. The job runs ``PHASES``, each a
whole number of windows on the wall clock (rank 0's, shared with every rank by a one-element
all-reduce before each step, outside it): clean; rank 2 sleeping ``DELAY`` seconds per step in
backward (a hook on the loss, so before any gradient bucket is launched); clean; rank 2
forcing full collections (``gc.collect()``) for ``DELAY`` seconds per step in its data stage;
clean. (For the storm, rank 2 freezes what it holds, ``gc.freeze()``, so a collection
traverses only a ballast of ``BALLAST`` lists: about 2 ms each, where one over all of torch's
objects takes about 75 ms here.)

Then the hang: with ``hang_after`` at ``HANG_AFTER`` seconds, rank 2 is stuck in its data stage
until dst has named it (dst's handler of ``HANG_EVENT`` writes ``OUT_DIR/hang``; rank 2 waits
for that file), while ranks 0 and 1 wait for it in DDP's all-reduce; then, ``hang_after`` back
at its default, the job trains ``AFTER`` more windows and ends. Rank 0 writes
``OUT_DIR/rank0.json``: each phase's start (wall clock), every straggler and hang event and
every merged window of ``step.wait_s`` and ``step.time_s`` it logged.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import monitor_bus as monitor
from monitor_bus.integrations.torch import (
    HANG_EVENT,
    STRAGGLER_EVENT,
    StepAnatomy,
    merge_stats_across_ranks,
)

WINDOW = 0.5
DELAY = 0.030
SLOW_RANK = 2
BALLAST = 100_000
# (phase, windows long)
PHASES = [("clean", 6), ("backward", 6), ("clean", 5), ("gc", 6), ("clean", 4)]
HANG_AFTER = 2.0  # four of the senders' half-second rounds: rank 2 reports its stage first
AFTER = 4  # windows of clean steps after the hang
HANG_WAIT = 60.0  # how long rank 2 waits at most for dst to name it


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
    hang_file = out / "hang"

    def on_hang(event: monitor.Event) -> None:
        if event.name == HANG_EVENT and not hang_file.exists():
            (out / "hang.tmp").write_text(json.dumps(event.data))
            os.replace(out / "hang.tmp", hang_file)  # whole, for rank 2 to see

    bus.register_event_handler(on_hang)
    ballast: list[list[int]] = []

    def train_step(anatomy: StepAnatomy | None, phase: str) -> None:
        slow = rank == SLOW_RANK
        with anatomy.step() if anatomy else _nothing():
            with anatomy.stage("data") if anatomy else _nothing():
                batch = torch.randn(16, 32)
                if slow and phase == "hang":  # stuck until dst has named it
                    deadline = time.monotonic() + HANG_WAIT
                    while not hang_file.exists():
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"no hang event within {HANG_WAIT} s")
                        time.sleep(0.01)
                if slow and phase == "gc":
                    if not ballast:
                        gc.freeze()
                        ballast.extend([] for _ in range(BALLAST))
                    start = time.perf_counter()
                    while time.perf_counter() - start < DELAY:
                        gc.collect()
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
    phase_now = torch.zeros(1)

    def phase_at(now: float) -> float:  # rank 0's clock: 1 + the phase's index; 0 before
        return sum(now >= s for s in starts) if now < end else -1

    def train_while(phase: Callable[[float], float]) -> None:
        """Train while rank 0's clock says a phase (its index; below 0: stop)."""
        while True:
            phase_now[0] = phase(time.time()) if rank == 0 else 0
            dist.all_reduce(phase_now)  # outside the step: not a wait the anatomy sees
            index = int(phase_now[0])
            if index < 0:
                return
            train_step(anatomy, PHASES[index - 1][0] if index else "clean")

    train_while(phase_at)
    anatomy.hang_after = HANG_AFTER
    train_step(anatomy, "hang")
    anatomy.hang_after = 60.0  # dst's own, at once: no other hang can be named after this
    after = time.time() + AFTER * WINDOW
    train_while(lambda now: 0 if now < after else -1)
    anatomy.close()
    assert merge.close(30)
    assert bus.close(30)
    if rank == 0:
        result: dict[str, Any] = {
            "phases": [[name, start] for (name, _), start in zip(PHASES, starts, strict=True)],
            "end": end,
            "stragglers": [
                {"stamp": e.timestamp.timestamp(), **e.data}
                for e in seen
                if e.name == STRAGGLER_EVENT
            ],
            "hangs": [dict(e.data) for e in seen if e.name == HANG_EVENT],
            "hosts": merge.hosts,
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
