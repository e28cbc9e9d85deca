"""An async training loop that reports through monitor_bus, under asyncio or trio.

Four tasks share one event loop:

- a data producer makes batches of a synthetic regression problem;
- the train step fits a numpy linear model with SGD, logs a ``train.step`` event per step and
  feeds two ``Stat`` windows (loss, step time);
- an evaluator scores a copy of the weights every few steps and logs ``eval`` events;
- an early stopper reads the ``eval`` events back through ``bus.subscribe()`` and stops the
  run when the validation loss stops improving.

An async handler (``PostingSink``) posts every event, in batches, to a collector (here a
JSON-lines file, the stand-in for an HTTP endpoint). At the end the script checks that the
sink got every event the bus logged.

Run:  python examples/async_trainer.py --backend trio --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import anyio
import anyio.abc
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream as Receive
from anyio.streams.memory import MemoryObjectSendStream as Send

import monitor_bus as monitor

FEATURES = 8
BATCH = 32

Batch = tuple[np.ndarray, np.ndarray]  # inputs, targets
Snapshot = tuple[int, np.ndarray]  # step, weights


class PostingSink:
    """An async handler: collects events, then posts each batch in one write (``flush``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: list[str] = []
        self.posted = 0

    async def __call__(self, event: monitor.Event) -> None:
        record = {"name": event.name, "ts": event.timestamp.isoformat(), "data": event.data}
        self.pending.append(json.dumps(record))

    async def flush(self) -> None:
        # The bus awaits this after each batch, on its own loop: the trainer never waits here.
        if not self.pending:
            return
        lines, self.pending = self.pending, []
        async with await anyio.open_file(self.path, "a") as f:
            await f.write("\n".join(lines) + "\n")
        self.posted += len(lines)


def log(bus: monitor.EventBus, name: str, **data: float | int | str | bool) -> None:
    bus.log_event(monitor.Event(name, datetime.now(timezone.utc), data))


async def produce(send: Send[Batch], rng: np.random.Generator, w_true: np.ndarray) -> None:
    """Synthetic batches, until the trainer stops reading."""
    async with send:
        try:
            while True:
                x = rng.normal(size=(BATCH, FEATURES))
                y = x @ w_true + rng.normal(scale=0.1, size=BATCH)
                await send.send((x, y))
        except anyio.BrokenResourceError:
            pass


async def train(
    bus: monitor.EventBus,
    batches: Receive[Batch],
    to_eval: Send[Snapshot],
    stop: anyio.Event,
    steps: int,
    eval_every: int,
) -> int:
    """SGD on the batches; returns the number of steps taken."""
    loss_stat = monitor.Stat(
        "train.loss",
        [monitor.Aggregation.MEAN, monitor.Aggregation.MIN, monitor.Aggregation.COUNT],
        timedelta(milliseconds=50),
        bus=bus,
    )
    time_stat = monitor.Stat(
        "train.step_time",
        [monitor.Aggregation.MEAN, monitor.Aggregation.MAX],
        timedelta(milliseconds=50),
        bus=bus,
    )
    w = np.zeros(FEATURES)
    step = 0
    async with batches, to_eval:
        async for x, y in batches:
            if step == steps or stop.is_set():
                break
            t0 = time.perf_counter()
            err = x @ w - y
            loss = float(err @ err / len(y))
            w -= 0.05 * (2 / len(y)) * (x.T @ err)
            step += 1
            time_stat.add(time.perf_counter() - t0)
            loss_stat.add(loss)
            log(bus, "train.step", step=step, loss=loss)
            if step % eval_every == 0:
                await to_eval.send((step, w.copy()))
            await anyio.lowlevel.checkpoint()  # let the other tasks run between steps
    return step


async def evaluate(
    bus: monitor.EventBus, weights: Receive[Snapshot], x_val: np.ndarray, y_val: np.ndarray
) -> int:
    """Score each weight snapshot on the validation set; returns the number of evaluations."""
    n = 0
    async with weights:
        async for step, w in weights:
            err = x_val @ w - y_val
            log(bus, "eval", step=step, val_loss=float(err @ err / len(y_val)))
            n += 1
    log(bus, "eval.done", evals=n)
    return n


# --8<-- [start:stopper]
async def early_stopper(
    bus: monitor.EventBus,
    stop: anyio.Event,
    patience: int,
    results: dict[str, object],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Decide from the event stream alone when validation loss has stopped improving."""
    best, best_step, stale = float("inf"), 0, 0
    async with bus.subscribe(lambda e: e.name in ("eval", "eval.done")) as events:
        task_status.started()  # subscribed: the evaluator may start logging
        async for event in events:
            if event.name == "eval.done":
                break
            val_loss, step = float(event.data["val_loss"]), int(event.data["step"])
            if val_loss < best * (1 - 1e-3):
                best, best_step, stale = val_loss, step, 0
            else:
                stale += 1
            if stale >= patience and not stop.is_set():
                stop.set()
                results["decision"] = (
                    f"early stop: val_loss has not improved for {patience} evals "
                    f"(best {best:.5f} at step {best_step}); stopping after step {step}"
                )
                return
    results["decision"] = f"no early stop: best val_loss {best:.5f} at step {best_step}"


# --8<-- [end:stopper]


async def main(steps: int, eval_every: int, patience: int, sink_path: Path) -> int:
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=FEATURES)
    x_val = rng.normal(size=(512, FEATURES))
    y_val = x_val @ w_true + rng.normal(scale=0.1, size=512)

    async with monitor.EventBus(name="trainer") as bus:
        sink = PostingSink(sink_path)
        bus.register_event_handler(sink, name="posting-sink")
        stop = anyio.Event()
        batch_send, batch_recv = anyio.create_memory_object_stream[Batch](4)
        eval_send, eval_recv = anyio.create_memory_object_stream[Snapshot](4)
        results: dict[str, object] = {}

        async def run(key: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
            results[key] = await fn(*args)

        async with anyio.create_task_group() as tg:
            # start() returns once the stopper has subscribed, so it misses no eval event.
            await tg.start(early_stopper, bus, stop, patience, results)
            tg.start_soon(produce, batch_send, rng, w_true)
            tg.start_soon(run, "steps", train, bus, batch_recv, eval_send, stop, steps, eval_every)
            tg.start_soon(run, "evals", evaluate, bus, eval_recv, x_val, y_val)

        assert await bus.aflush(30), "the bus did not deliver in time"
    stats = bus.stats()  # after the close, which logged the Stats' last windows
    print(results["decision"])
    print(
        f"trained {results['steps']} steps, {results['evals']} evals; "
        f"bus logged {stats['logged']} events, sink posted {sink.posted}, dropped {stats['dropped']}"
    )
    return 0 if sink.posted == stats["logged"] else 1


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--steps", type=int, default=500, help="most training steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--patience", type=int, default=3, help="evals without improvement")
    parser.add_argument("--sink", type=Path, help="JSON-lines file for the posting sink")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.eval_every < 1:
        parser.error("--eval-every must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        sink = args.sink or Path(tmp) / "events.jsonl"
        return anyio.run(
            main, args.steps, args.eval_every, args.patience, sink, backend=args.backend
        )


if __name__ == "__main__":
    sys.exit(cli())
