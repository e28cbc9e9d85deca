"""Find the slow rank: the spread across ranks and stragglers named from the merged Stats.

Every rank times its steps into a ``step_time`` Stat, as it would anyway. Merged on rank 0
(``merge_stats_across_ranks``), each window also says how the ranks' means spread
(``step_time.rank_min`` / ``rank_p50`` / ``rank_max``) and which rank was slowest
(``step_time.slowest_rank``); with ``stragglers={"step_time": 1.5}`` rank 0 names a rank
whose mean stays over 1.5 times the other ranks' median for 3 windows in a row, once, and once
more when it has recovered. Here the last rank is made slow on purpose for 1.5 s. This works
where ranks do not wait for each other; in a synchronized (DDP) job every rank's step is as
long as the slowest one's: see ``slow_rank_ddp.py``.

Run:  torchrun --nproc_per_node=3 examples/find_slow_rank.py
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist

import monitor_bus as monitor
from monitor_bus.integrations.torch import STRAGGLER_EVENT, merge_stats_across_ranks


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list[monitor.Event] = []
    if rank == 0:
        monitor.register_event_handler(seen.append)

    # --8<-- [start:usage]
    step_time = monitor.Stat("step_time", [monitor.Aggregation.MEAN], timedelta(milliseconds=250))
    with merge_stats_across_ranks(timeout=10.0, stragglers={"step_time": 1.5}):
        started = time.monotonic()
        while time.monotonic() - started < 4.0:
            start = time.perf_counter()
            slow = rank == world - 1 and 1.0 <= time.monotonic() - started < 2.5
            time.sleep(0.04 if slow else 0.005)  # the training step
            step_time.add(time.perf_counter() - start)
    # --8<-- [end:usage]

    if rank == 0:
        monitor.flush()
        for event in seen:
            data = event.data
            if event.name == STRAGGLER_EVENT:
                what = "recovered" if data["recovered"] else "straggler"
                print(f"{what}: rank {data['rank']} on {data['host']}, {data['ratio']:.1f}x")
            elif "step_time.slowest_rank" in data:
                print(
                    f"step_time p50 over ranks {data['step_time.rank_p50'] * 1000:.1f} ms, "
                    f"max {data['step_time.rank_max'] * 1000:.1f} ms "
                    f"(rank {data['step_time.slowest_rank']})"
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
