"""stdlib logging and the bus, both ways: records become events (kept in a JSON-lines file),
and events go back out to a logger, with no loop between the two.

    python logging_bridge.py --out run.jsonl
"""

from __future__ import annotations

import argparse
import logging
import sys

import monitor_bus as monitor
from monitor_bus.integrations.logging import LoggingEventHandler, MonitorBusHandler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="run.jsonl", help="the JSON-lines file to write")
    args = parser.parse_args()

    # --8<-- [start:bridge]
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
    to_bus = MonitorBusHandler()  # records -> events on the default bus
    logging.getLogger().addHandler(to_bus)

    with monitor.JsonlEventHandler(args.out) as jsonl:
        monitor.register_event_handler(jsonl)
        # ... and events -> records: a sink that writes each event to a logger. Its records are
        # made on the sink's thread, so MonitorBusHandler does not send them back.
        monitor.register_event_handler(LoggingEventHandler("bus", names=("monitor_bus.log",)))

        log = logging.getLogger("train")
        log.info("epoch done", extra={"epoch": 1, "loss": 0.25})
        log.warning("odd batch", extra={"shape": (8, 3)})  # a tuple: kept as its repr, counted
        monitor.flush()
    # --8<-- [end:bridge]

    logging.getLogger().removeHandler(to_bus)
    events = list(monitor.read_jsonl(args.out))
    print(f"{len(events)} events in {args.out}; extras sanitized: {to_bus.sanitized_values}")
    print(f"loop avoided: {to_bus.skipped_records} records from the bus's own threads skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
