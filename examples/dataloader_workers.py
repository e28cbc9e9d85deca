"""DataLoader workers log to the parent's sinks: events and Stat windows, with their origin.

A dataset logs an event and adds to a Stat for every item it loads, in the DataLoader's worker
processes. Nothing is set up in the workers: the parent registers a JSONL sink, and what the
workers log reaches it, each event marked with the worker it came from. At the end the script
reads the file back and prints what each worker sent.

Run:  python examples/dataloader_workers.py --items 1000 --workers 4 --context spawn
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from datetime import datetime, timedelta, timezone

import torch.utils.data

import monitor_bus as monitor

# --8<-- [start:dataset]
_load_time: dict[int, monitor.Stat] = {}


class Squares(torch.utils.data.Dataset[int]):
    """Each item logs one event; each worker keeps a Stat of its own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        stat = _load_time.get(os.getpid())
        if stat is None:  # made in the worker, on the worker's default bus
            stat = _load_time[os.getpid()] = monitor.Stat(
                "items", [monitor.Aggregation.COUNT], timedelta(seconds=1)
            )
        monitor.log_event(monitor.Event("item", datetime.now(timezone.utc), {"i": i}))
        stat.add(1)
        return i * i


# --8<-- [end:dataset]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context", choices=["fork", "spawn", "forkserver"], default="fork")
    args = parser.parse_args(argv)
    if args.items < 1 or args.workers < 1:
        parser.error("--items and --workers must be at least 1")
    path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    # --8<-- [start:parent]
    sink = monitor.JsonlEventHandler(path)
    monitor.register_event_handler(sink, name="jsonl")
    loader = torch.utils.data.DataLoader(
        Squares(args.items),
        batch_size=50,
        num_workers=args.workers,
        multiprocessing_context=args.context,
    )
    total = sum(int(x) for batch in loader for x in batch)
    del loader  # the workers end, sending their last Stat windows
    monitor.flush()  # everything the workers sent is in the file now
    # --8<-- [end:parent]
    sink.close()
    events = monitor.read_jsonl(path)
    items = Counter(e.origin.worker for e in events if e.name == "item" and e.origin)
    counted = sum(
        int(e.data["items.count"]) for e in events if e.name == monitor.STAT_EVENT and e.origin
    )
    print(f"sum of squares {total}")
    for worker in sorted(items):
        print(f"worker {worker}: {items[worker]} item events")
    print(f"Stat windows from the workers counted {counted} items")
    print(f"dropped {monitor.get_default_bus().stats()['dropped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
