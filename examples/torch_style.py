"""torch.monitor's documented usage, run against monitor_bus as a drop-in.

The code below is the usage from the ``torch.monitor`` docs: a ``Stat`` fed from a hot loop,
a plain-function handler, ``log_event`` with an ``Event``, and ``TensorboardEventHandler``
with a ``SummaryWriter``. With PyTorch the first two imports would read::

    import torch.monitor as monitor
    from torch.utils.tensorboard import SummaryWriter

Here they are monitor_bus and its torch-free writer; nothing else changes. At the end the
script reads the event file back with TensorBoard's own reader and prints what is in it.

Run:  python examples/torch_style.py --steps 2000 --logdir runs/torch_style
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta

import monitor_bus as monitor
from monitor_bus.tensorboard import SummaryWriter


def main(steps: int, logdir: str) -> int:
    # --8<-- [start:usage]
    # A plain handler, as in the torch.monitor docs: it sees every event, Stat windows too.
    seen: list[str] = []
    losses_reported = 0
    all_reported = threading.Event()

    def handler(event: monitor.Event) -> None:
        nonlocal losses_reported
        seen.append(event.name)
        losses_reported += int(event.data.get("loss.count", 0))
        if losses_reported == steps:
            all_reported.set()

    monitor.register_event_handler(handler)

    writer = SummaryWriter(logdir)
    tb = monitor.register_event_handler(monitor.TensorboardEventHandler(writer))

    loss = monitor.Stat(
        "loss",
        [monitor.Aggregation.MEAN, monitor.Aggregation.MIN, monitor.Aggregation.COUNT],
        timedelta(milliseconds=20),
    )
    step_time = monitor.Stat(
        "step_time", [monitor.Aggregation.MEAN, monitor.Aggregation.MAX], timedelta(milliseconds=20)
    )

    rng = random.Random(0)
    monitor.log_event(monitor.Event("training_start", datetime.now(), {"steps": steps}))
    for step in range(steps):  # the hot loop: Stat.add takes no lock and never waits
        t0 = time.perf_counter()
        value = sum(math.sin(step + i) for i in range(20)) * 1e-3 + 1.0 / (1 + step)
        loss.add(value + rng.random() * 0.01)
        step_time.add(time.perf_counter() - t0)
    monitor.log_event(monitor.Event("training_end", datetime.now(), {"steps": steps}))
    # --8<-- [end:usage]

    # The last window closes on the bus's timer, with no further add (torch.monitor would wait
    # for one): its Stat event arrives within a window length.
    if not all_reported.wait(timeout=30):
        print(f"only {losses_reported} of {steps} losses were reported", file=sys.stderr)
        return 1
    # Unregistering delivers what is pending first; then the writer can close.
    monitor.unregister_event_handler(tb)
    writer.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    counts = acc.Scalars("loss.count")
    print(
        f"handler saw {seen.count(monitor.STAT_EVENT)} Stat events between "
        f"{seen[0]!r} and {seen[-1]!r}"
    )
    print(
        f"tensorboard loss.count: {len(counts)} windows, {int(sum(s.value for s in counts))} losses"
    )
    print(f"tensorboard tags: {', '.join(sorted(acc.Tags()['scalars']))}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--logdir", help="TensorBoard directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.logdir:
        return main(args.steps, args.logdir)
    with tempfile.TemporaryDirectory() as tmp:
        return main(args.steps, tmp)


if __name__ == "__main__":
    sys.exit(cli())
