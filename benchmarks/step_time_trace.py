"""Record a real job's merged step-time windows: the traces benchmarks/slowdown_rule.py reads.

    torchrun --nproc_per_node=3 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 \\
        benchmarks/step_time_trace.py OUT.jsonl [--seconds 240] [--window 0.5] [--width 32]

Every rank trains a ``DistributedDataParallel`` MLP (``--width`` hidden units, batch 64; CPU,
gloo) under a ``StepAnatomy`` with the stages data, forward, backward and optimizer, merged
across ranks by ``merge_stats_across_ranks()``; nothing is slowed on purpose, so the trace is
a clean run, noisy as the machine is. ``dst`` (rank 0) writes the merged windows of
``step.time_s`` to ``OUT.jsonl`` with a ``JsonlEventHandler`` (read back with
``monitor_bus.read_jsonl``).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import monitor_bus as monitor  # noqa: E402
from monitor_bus.integrations.torch import StepAnatomy, merge_stats_across_ranks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSONL file dst writes the merged windows to")
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--window", type=float, default=0.5, help="StepAnatomy's window, s")
    parser.add_argument("--width", type=int, default=32, help="the MLP's hidden units")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = args.width
    net = torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, 8)
    )
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    bus = monitor.EventBus(name="trace")
    jsonl = None
    if dist.get_rank() == 0:
        jsonl = monitor.JsonlEventHandler(args.out)

        def keep(event: monitor.Event) -> None:
            if "step.time_s.mean" in event.data:
                jsonl(event)

        bus.register_event_handler(keep)
    merge = merge_stats_across_ranks(bus=bus, timeout=30.0)
    anatomy = StepAnatomy(model, window=timedelta(seconds=args.window), bus=bus)
    # Every rank stops at the step rank 0's clock says (a one-element all-reduce per step,
    # outside the step, so no rank is left in the all-reduce).
    end = time.time() + args.seconds
    done = torch.zeros(1)
    while True:
        done[0] = float(dist.get_rank() == 0 and time.time() >= end)
        dist.all_reduce(done)
        if done[0]:
            break
        with anatomy.step():
            with anatomy.stage("data"):
                batch = torch.randn(64, 32)
            with anatomy.stage("forward"):
                loss = model(batch).square().mean()
            with anatomy.stage("backward"):
                loss.backward()
            with anatomy.stage("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    anatomy.close()
    assert merge.close(30)
    assert bus.close(30)
    if jsonl is not None:
        jsonl.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
