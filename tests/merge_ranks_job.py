"""One rank of a torchrun job for tests/test_merge_ranks.py (CPU, gloo).

    torchrun --nproc_per_node=3 tests/merge_ranks_job.py OUT_DIR SCENARIO

Every rank adds known samples to two Stats on its own bus, with its windows merged to rank 0;
its bus writes what it logs to ``OUT_DIR/rank<r>.jsonl`` and the rank writes what it added,
every window its Stats closed (seen through the bus's window tap) and the merge's counters to
``OUT_DIR/rank<r>.json``. Scenarios: ``normal``; ``at_exit`` (no rank calls close()); ``peer_dies`` (rank 2 ends with ``os._exit(0)``
halfway: a zero exit, as a non-zero one makes torchrun stop every rank); ``dst_dies`` (rank 0
does); ``dst_hangs`` (rank 0 stops itself halfway with SIGSTOP; rank 1 resumes it after its
close()).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import monitor_bus as monitor
from monitor_bus.integrations.torch import merge_stats_across_ranks

WINDOW = 0.25
STEPS = 120
ALL = list(monitor.Aggregation)[:6]  # torch.monitor's six


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bus = monitor.EventBus(name="merge")
    bus.register_event_handler(monitor.JsonlEventHandler(out / f"rank{rank}.jsonl"))
    timeout = 2.0 if scenario != "normal" else 10.0
    # Made before the merge: its open window must move to the wall-clock alignment too.
    loss = monitor.Stat("loss", ALL, timedelta(seconds=WINDOW), bus=bus)
    merge = merge_stats_across_ranks(bus=bus, timeout=timeout)
    closed: list[Any] = []  # every window the Stats closed, as the tap saw them
    tap = bus._window_tap
    assert tap is not None

    def record(window: Any) -> bool:
        closed.append(window)
        return tap(window)

    bus._window_tap = record
    grad = monitor.Stat("grad", [monitor.Aggregation.MEAN], timedelta(seconds=WINDOW), bus=bus)
    added: dict[str, list[float]] = {"loss": [], "grad": []}
    dies = {"peer_dies": 2, "dst_dies": 0}.get(scenario)
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())

    def report(**extra: Any) -> None:
        counters = {
            k: getattr(merge, k)
            for k in ("sent", "merged", "received", "missing", "late", "local", "errors")
        }
        windows = [
            # Read when reported: the merge's thread has read the tensors of rank 0's by then.
            [
                w.stat.name,
                round(w.end / w.stat._window),
                w.count,
                w.total,
                w.high,
                w.low,
                float(w.value),
                w.stamp.timestamp(),
            ]
            for w in closed
        ]
        result = {"added": added, "closed": windows, "counters": counters, **extra}
        (out / f"rank{rank}.json").write_text(json.dumps(result))

    for step in range(STEPS):
        if step == STEPS // 2 and rank == dies:
            report()
            os._exit(0)
        if step == STEPS // 2 and rank == 0 and scenario == "dst_hangs":
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread; rank 1 resumes it at its end
        value = (rank * 1000 + step) * 0.25  # sums of these are exact in floating point
        loss.add(value)
        added["loss"].append(value)
        if rank == 0:  # a tensor: read on the merge's thread
            grad.add(torch.tensor(-value))
            added["grad"].append(-value)
        elif rank == 2:
            grad.add(-value)
            added["grad"].append(-value)
        time.sleep(0.01)  # the training step
    if scenario == "at_exit":  # no close(): interpreter exit closes the merge
        report()
        return
    # The last window is open: close() merges it.
    started = time.monotonic()
    # dst_hangs: the sends waiting on the stopped dst time out within the merge's 2 s.
    finished = merge.close(timeout=10.0 if scenario == "dst_hangs" else None)
    took = time.monotonic() - started
    assert bus.close(timeout=10)
    if scenario == "dst_hangs" and rank == 1:
        # Once rank 2 is done too, so that both gave dst up before it runs again. The
        # rendezvous store is torchrun's agent's, so it answers while rank 0 is stopped.
        try:
            job_store().wait(["rank2_closed"], timedelta(seconds=20))
        finally:
            os.kill(pids[0], signal.SIGCONT)
    report(finished=finished, close_seconds=took, lost=sorted(merge.lost_ranks))
    if scenario == "dst_hangs" and rank == 2:
        job_store().set("rank2_closed", "1")


def job_store() -> dist.Store:
    """The job's rendezvous store, under a prefix of this test's own."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=20),
    )
    return dist.PrefixStore("merge_ranks_job/", store)


if __name__ == "__main__":
    main()
