"""One rank of a torchrun job for tests/test_merge_ranks.py (CPU, gloo).

    torchrun --nproc_per_node=3 tests/merge_ranks_job.py OUT_DIR SCENARIO

Every rank adds known samples to two Stats on its own bus, with its windows merged to rank 0;
its bus writes what it logs to ``OUT_DIR/rank<r>.jsonl`` and the rank writes what it added,
every window its Stats closed (seen through the bus's window tap) and the merge's counters to
``OUT_DIR/rank<r>.json``. Scenarios: ``normal``; ``at_exit`` (no rank calls close()); ``peer_dies`` (rank 2 ends with ``os._exit(0)``
halfway: a zero exit, as a non-zero one makes torchrun stop every rank); ``dst_dies`` (rank 0
does); ``dst_hangs`` (rank 0 stops itself halfway with SIGSTOP; rank 1 resumes it after its
close()); ``starved`` (run as two torchrun "nodes" of 2 ranks: rank 2, the second node's leader,
stops itself halfway with SIGSTOP; rank 1 resumes it once dst named it lost, after the others'
steps, so dst and rank 3 are closing by then); ``straggler`` (run as two
torchrun "nodes" of 2 ranks, so in the two-level shape: the last rank's ``step_time`` is 3
times the others' for a while, then back; rank 0 also writes TensorBoard to ``OUT_DIR/tb``);
``leader_dies`` (two nodes of 2 ranks: rank 2, the second node's leader, ends with
``os._exit(0)`` halfway).
"""

from __future__ import annotations

import json
import logging
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
A = monitor.Aggregation


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bus = monitor.EventBus(name="merge")
    bus.register_event_handler(monitor.JsonlEventHandler(out / f"rank{rank}.jsonl"))
    # leader_dies: 3 s, so that a loaded machine's stall does not cut rank 1 off dst too.
    timeout = {"normal": 10.0, "straggler": 10.0, "leader_dies": 3.0}.get(scenario, 2.0)
    # Made before the merge: its open window must move to the wall-clock alignment too.
    loss = monitor.Stat("loss", ALL, timedelta(seconds=WINDOW), bus=bus)
    stragglers = {"step_time": 1.5} if scenario == "straggler" else None
    if stragglers and rank == 0:
        from monitor_bus.tensorboard import SummaryWriter

        bus.register_event_handler(monitor.TensorboardEventHandler(SummaryWriter(out / "tb")))
    merge = merge_stats_across_ranks(
        bus=bus, timeout=timeout, stragglers=stragglers, straggler_windows=2
    )
    closed: list[Any] = []  # every window the Stats closed, as the tap saw them
    tap = bus._window_tap
    assert tap is not None

    def record(window: Any) -> bool:
        closed.append(window)
        return tap(window)

    bus._window_tap = record
    grad = monitor.Stat("grad", [monitor.Aggregation.MEAN], timedelta(seconds=WINDOW), bus=bus)
    step_time = monitor.Stat(
        "step_time", [monitor.Aggregation.MEAN], timedelta(seconds=WINDOW), bus=bus
    )
    # normal: a distribution whose samples differ by rank, in one window from the merge's start
    # to close(): windows end at wall-clock multiples of their size, so a size of ten years
    # puts no window end inside any run (an hour would split a run that crosses the hour).
    latency = monitor.Stat(
        "latency",
        [A.COUNT, A.P50, A.P99, A.STDDEV],
        timedelta(days=3650),
        bus=bus,
    )
    added: dict[str, list[float]] = {"loss": [], "grad": [], "step_time": [], "latency": []}
    world = dist.get_world_size()
    steps = STEPS if scenario != "straggler" else 160
    dies = {"peer_dies": 2, "dst_dies": 0, "leader_dies": 2}.get(scenario)
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())

    def report(**extra: Any) -> None:
        counters = {
            k: getattr(merge, k)
            for k in (
                "sent",
                "relayed",
                "merged",
                "received",
                "missing",
                "late",
                "local",
                "unsent",
                "errors",
            )
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
        result = {
            "added": added,
            "closed": windows,
            "counters": counters,
            "hosts": merge.hosts,
            "upstream": merge.upstream,
            **extra,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(result))

    if scenario == "starved" and rank == 0:
        # A handler of its own: the warnings still reach stderr, as without one.
        logging.getLogger("monitor_bus").addHandler(logging.StreamHandler())
        logging.getLogger("monitor_bus").addHandler(SignalLost())
    for step in range(steps):
        if step == STEPS // 2 and rank == 2 and scenario == "starved":
            os.kill(os.getpid(), signal.SIGSTOP)  # starved past the timeout, not dead
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
        if scenario == "normal":
            sample = (rank + 1) * 10.0 + (step * 7919 % 101) * 0.5
            latency.add(sample)
            added["latency"].append(sample)
        if scenario == "straggler":  # slow for at least 0.8 s (3 windows), then 0.6 s not
            seconds = 3.0 if rank == world - 1 and 20 <= step < 100 else 1.0
            step_time.add(seconds)
            added["step_time"].append(seconds)
        time.sleep(0.01)  # the training step
    if scenario == "at_exit":  # no close(): interpreter exit closes the merge
        report()
        return
    # The last window is open: close() merges it.
    started = time.monotonic()
    # dst_hangs: a rank gives the stopped dst up at its close's deadline, half of 4 s.
    finished = merge.close(timeout={"dst_hangs": 4.0, "starved": 20.0}.get(scenario))
    took = time.monotonic() - started
    assert bus.close(timeout=10)
    if scenario == "starved" and rank == 1:
        job_store().wait(["rank2_lost"], timedelta(seconds=20))
        # Starved a while longer: dst is closing, with rank 2 lost, when rank 2 speaks again.
        time.sleep(1.0)
        os.kill(pids[2], signal.SIGCONT)
    if scenario == "dst_hangs" and rank == 1:
        # Once rank 2 is done too, so that both gave dst up before it runs again. The
        # rendezvous store is torchrun's agent's, so it answers while rank 0 is stopped.
        try:
            job_store().wait(["rank2_closed"], timedelta(seconds=20))
        finally:
            os.kill(pids[0], signal.SIGCONT)
    report(
        finished=finished,
        close_seconds=took,
        lost=sorted(merge.lost_ranks),
        unfinished=sorted(merge.unfinished_ranks),
    )
    if scenario == "dst_hangs" and rank == 2:
        job_store().set("rank2_closed", "1")


class SignalLost(logging.Handler):
    """dst's log: once it names rank 2 lost, tell rank 1 (through the job's store)."""

    def emit(self, record: logging.LogRecord) -> None:
        if "rank 2 silent for" in record.getMessage():
            job_store().set("rank2_lost", "1")


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
