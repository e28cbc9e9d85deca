"""One stream of Stat windows from every rank of a torchrun job, merged on rank 0.

Every rank adds its step time and loss to Stats, as a single process would. With
``merge_stats_across_ranks`` the windows of all ranks travel to rank 0 over a gloo group of
the merge's own, on a thread of the merge (the training loop never waits for it), and rank 0
logs one event per window: ``"loss.mean"`` over every rank's samples, ``"loss.ranks"`` saying
how many ranks contributed. The other ranks log no Stat window of their own.

Run:  torchrun --nproc_per_node=3 examples/torchrun_merge.py --steps 150

The training here runs on gloo (CPU); an NCCL job calls the merge the same way after its
``init_process_group("nccl")``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import monitor_bus as monitor
from monitor_bus.integrations.torch import merge_stats_across_ranks


def main(steps: int) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    merged: list[dict[str, float | int]] = []
    if rank == 0:
        monitor.register_event_handler(lambda event: merged.append(dict(event.data)))

    # --8<-- [start:usage]
    window = timedelta(milliseconds=250)
    step_time = monitor.Stat(
        "step_time", [monitor.Aggregation.MEAN, monitor.Aggregation.MAX], window
    )
    loss = monitor.Stat("loss", [monitor.Aggregation.MEAN, monitor.Aggregation.COUNT], window)
    with merge_stats_across_ranks(timeout=10.0) as merge:  # on every rank
        for step in range(steps):
            start = time.perf_counter()
            value = math.exp(-step / 50) + 0.01 * rank  # the training step
            time.sleep(0.005)
            loss.add(value)
            step_time.add(time.perf_counter() - start)
    # Leaving the block closed the last windows and merged them on rank 0.
    # --8<-- [end:usage]

    if rank == 0:
        monitor.flush()
        samples = sum(int(d["loss.count"]) for d in merged if "loss.count" in d)
        for data in merged:
            if "loss.mean" in data:
                print(f"loss.mean={data['loss.mean']:.4f} from {data['loss.ranks']} ranks")
        print(f"{merge.merged} merged windows; {samples} loss samples of {steps * world} added")
        if samples != steps * world:
            return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    sys.exit(main(args.steps))
