"""What logging a training step's tensors costs: ``Stat.add(loss)`` (the tensor, copied at the
call and read on a thread of the bus) against ``Stat.add(loss.item())`` and against no logging.

    python benchmarks/device_values.py                  # the full run, about a minute
    python benchmarks/device_values.py --quick          # a fast, rough run
    python benchmarks/device_values.py --device cuda    # the same on a GPU

The step: a two-layer torch MLP, forward + backward + gradient clipping + SGD update on one
fixed minibatch (torch on one thread). It produces three scalar tensors, the loss, the
gradient norm and the batch accuracy, and each step adds them to 3 Stats (``MEAN``, ``MAX``,
``SUM``, ``COUNT`` over 100 ms windows) on a bus of its own with one handler, which totals
the windows. Variants, in an order that rotates from round to round:

- (a) ``stat.add(loss.item())``: the caller reads each value;
- (b) ``stat.add(loss)``: the tensors themselves;
- (c) no logging: the same step, its tensors unread.

Per step: wall time and process CPU (``time.process_time``: every thread, the bus's included)
over the loop and ``flush()`` (which waits for the deferred reads), medians of ``--rounds``
rounds, and each as a ratio to (c). Every run starts from the same weights, so (a) and (b) log
the same values: the script checks that their windows count every sample and total the same,
and exits 1 if not. Then the caller's ns per ``Stat.add`` and per ``Event`` + ``log_event``
with a tensor, its ``.item()`` or a float.

On CUDA, (a) waits for the device at every ``.item()``, once per value per step, and (b) and
(c) never do in the loop: the copies and their stream events are queued behind the step.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import _results
from _machine import positive

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat

try:
    import torch
except ImportError:  # main() says so
    torch = None  # type: ignore[assignment]

WINDOW = timedelta(milliseconds=100)
AGGREGATIONS = [Aggregation.MEAN, Aggregation.MAX, Aggregation.SUM, Aggregation.COUNT]
SCALARS = ("loss", "grad_norm", "accuracy")
VARIANTS = ("none", "item", "tensor")
TITLES = {
    "none": "(c) no logging",
    "item": "(a) `stat.add(t.item())`",
    "tensor": "(b) `stat.add(t)`",
}
TS = datetime(2026, 1, 1)


class Totals:
    """The handler: totals each Stat's windows (``COUNT`` and ``SUM``) as they arrive, and
    counts values that are not plain Python numbers (handlers must only see those)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = dict.fromkeys(SCALARS, 0)
        self.sum: dict[str, float] = dict.fromkeys(SCALARS, 0.0)
        self.windows = 0
        self.not_plain = 0
        self.lost = 0  # windows dropped or failed in the handler (from the bus's stats)
        self.timed_out = False  # flush() or close() gave up

    def __call__(self, event: Any) -> None:
        if event.name != STAT_EVENT:
            return
        self.windows += 1
        for key, value in event.data.items():
            if value.__class__ not in (int, float):
                self.not_plain += 1
            name, _, agg = key.rpartition(".")
            if agg == "count":
                self.count[name] += value
            elif agg == "sum":
                self.sum[name] += value


class Trainer:
    """A small MLP on one fixed batch; ``reset()`` puts back the first weights, so every run
    computes the same sequence of values."""

    def __init__(self, device: str) -> None:
        assert torch is not None
        gen = torch.Generator().manual_seed(0)
        batch, d_in, hidden, classes = 64, 96, 256, 10
        self.x = torch.randn(batch, d_in, generator=gen).to(device)
        self.y = torch.randint(0, classes, (batch,), generator=gen).to(device)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes)
        ).to(device)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.01)
        self.first = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.device = device

    def reset(self) -> None:
        self.model.load_state_dict(self.first)

    def step(self) -> tuple[Any, Any, Any]:
        """One training step; returns the loss, gradient norm and accuracy as tensors."""
        assert torch is not None
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.x)
        loss = torch.nn.functional.cross_entropy(logits, self.y)
        loss.backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        accuracy = (logits.detach().argmax(1) == self.y).float().mean()
        return loss, norm, accuracy

    def sync(self) -> None:
        """Wait for the device: only around a timed region, never inside it."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


# -- one run per variant --


class Run(NamedTuple):
    wall: float  # seconds over the loop (and the flush)
    cpu: float  # process CPU seconds, every thread
    totals: Totals | None  # the handler's, for a logged variant


def run_none(trainer: Trainer, steps: int) -> Run:
    step = trainer.step
    trainer.reset()
    trainer.sync()
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        loss, norm, accuracy = step()
    trainer.sync()  # the queued device work is part of the steps' time
    cpu1, wall1 = time.process_time(), time.perf_counter()
    del loss, norm, accuracy
    return Run(wall1 - wall0, cpu1 - cpu0, None)


def run_logged(trainer: Trainer, steps: int, *, item: bool) -> Run:
    bus = EventBus(name="device_values")
    totals = Totals()
    bus.register_event_handler(totals, name="totals")
    s_loss, s_norm, s_acc = (Stat(name, AGGREGATIONS, WINDOW, bus=bus) for name in SCALARS)
    add_loss, add_norm, add_acc = s_loss.add, s_norm.add, s_acc.add
    step = trainer.step
    trainer.reset()
    trainer.sync()
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    # On CUDA each .item() waits for the device (three syncs per step); the tensors do not.
    if item:
        for _ in range(steps):
            loss, norm, accuracy = step()
            add_loss(loss.item())
            add_norm(norm.item())
            add_acc(accuracy.item())
    else:
        for _ in range(steps):
            loss, norm, accuracy = step()
            add_loss(loss)
            add_norm(norm)
            add_acc(accuracy)
    trainer.sync()
    flushed = bus.flush(600)  # the closed windows' values read and delivered
    cpu1, wall1 = time.process_time(), time.perf_counter()
    closed = bus.close(600)  # logs the open windows
    stats = bus.stats()
    totals.timed_out = not (flushed and closed)
    totals.lost = stats["handler_dropped"] + stats["handler_errors"] + stats["dropped"]
    if stats["device_values"]:
        raise RuntimeError(f"{stats['device_values']} device values still unread after close()")
    del loss, norm, accuracy
    return Run(wall1 - wall0, cpu1 - cpu0, totals)


# -- the caller's ns per call --


def per_call(device: str, n: int) -> dict[str, float]:
    """ns per call for each way of logging one value, on a bus with one no-op handler."""
    assert torch is not None
    t = torch.tensor(0.25, device=device)
    results: dict[str, float] = {}

    def stat_case(name: str, make: Callable[[], Any], read: bool) -> None:
        bus = EventBus(name="per_call")
        bus.register_event_handler(lambda e: None, name="noop")
        add = Stat("x", [Aggregation.MEAN], timedelta(hours=1), bus=bus).add
        gc.collect()
        start = time.perf_counter_ns()
        if read:
            for _ in range(n):
                add(t.item())
        else:
            value = make()
            for _ in range(n):
                add(value)
        results[name] = (time.perf_counter_ns() - start) / n
        bus.close(600)

    def event_case(name: str, make: Callable[[], Any], read: bool) -> None:
        bus = EventBus(capacity=n + 16, name="per_call")
        seen = [0]

        def check(event: Any) -> None:
            if event.data["loss"].__class__ is float:
                seen[0] += 1

        bus.register_event_handler(check, name="check")
        log = bus.log_event
        gc.collect()
        start = time.perf_counter_ns()
        if read:
            for _ in range(n):
                log(Event("e", TS, {"loss": t.item()}))
        else:
            value = make()
            for _ in range(n):
                log(Event("e", TS, {"loss": value}))
        results[name] = (time.perf_counter_ns() - start) / n
        bus.close(600)
        if seen[0] != n:
            raise RuntimeError(f"{name}: {seen[0]:,} of {n:,} events delivered with a float")

    stat_case("Stat.add(0.25)", lambda: 0.25, False)
    stat_case("Stat.add(t.item())", lambda: None, True)
    stat_case("Stat.add(t)", lambda: t, False)
    event_case('log_event(Event(..., {"loss": 0.25}))', lambda: 0.25, False)
    event_case('log_event(Event(..., {"loss": t.item()}))', lambda: None, True)
    event_case('log_event(Event(..., {"loss": t}))', lambda: t, False)
    return results


# -- rounds, table --


def run(args: argparse.Namespace) -> tuple[dict[str, list[Run]], dict[str, list[float]]]:
    trainer = Trainer(args.device)
    for _ in range(50):  # warm up: first calls allocate and fill caches
        trainer.step()
    loops: dict[str, Callable[[Trainer, int], Run]] = {
        "none": run_none,
        "item": lambda tr, n: run_logged(tr, n, item=True),
        "tensor": lambda tr, n: run_logged(tr, n, item=False),
    }
    runs: dict[str, list[Run]] = {}
    calls: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            runs.setdefault(v, []).append(loops[v](trainer, args.steps))
            print(".", end="", file=sys.stderr, flush=True)
        for name, ns in per_call(args.device, args.calls).items():
            calls.setdefault(name, []).append(ns)
    print(file=sys.stderr)
    return runs, calls


def ratio(runs: dict[str, list[Run]], v: str, cpu: bool) -> float:
    """Median over rounds of variant ``v``'s wall time (or CPU) over no logging's."""
    pairs = zip(runs[v], runs["none"], strict=True)
    return statistics.median((o.cpu / b.cpu) if cpu else (o.wall / b.wall) for o, b in pairs)


def totals_over_rounds(runs: list[Run]) -> tuple[dict[str, int], dict[str, float]]:
    """Each Stat's windows' COUNT and SUM, summed over the runs."""
    count = dict.fromkeys(SCALARS, 0)
    total = dict.fromkeys(SCALARS, 0.0)
    for _, _, t in runs:
        assert t is not None
        for name in SCALARS:
            count[name] += t.count[name]
            total[name] += t.sum[name]
    return count, total


# Each per-call measure's key in the results file (a page's key path splits at dots).
CALL_KEYS = {
    "Stat.add(0.25)": "stat_float",
    "Stat.add(t.item())": "stat_item",
    "Stat.add(t)": "stat_tensor",
    'log_event(Event(..., {"loss": 0.25}))': "event_float",
    'log_event(Event(..., {"loss": t.item()}))': "event_item",
    'log_event(Event(..., {"loss": t}))': "event_tensor",
}


def results_of(
    args: argparse.Namespace, runs: dict[str, list[Run]], calls: dict[str, list[float]]
) -> dict[str, Any]:
    """The run's figures for its results file, with the tables the page shows."""
    per_step = {
        v: {
            "wall_us": statistics.median(r.wall for r in runs[v]) / args.steps * 1e6,
            "cpu_us": statistics.median(r.cpu for r in runs[v]) / args.steps * 1e6,
            "wall_ratio": ratio(runs, v, cpu=False),
            "cpu_ratio": ratio(runs, v, cpu=True),
        }
        for v in VARIANTS
    }
    step_rows = [
        [
            TITLES[v],
            f"{f['wall_us']:.1f}",
            f"{f['wall_ratio']:.2f}x",
            f"{f['cpu_us']:.1f}",
            f"{f['cpu_ratio']:.2f}x",
        ]
        for v, f in per_step.items()
    ]
    ns = {CALL_KEYS[name]: statistics.median(values) for name, values in calls.items()}
    vs_float = {
        key: value / ns["event_float" if key.startswith("event") else "stat_float"]
        for key, value in ns.items()
    }
    call_rows = [
        [f"`{name}`", f"{ns[CALL_KEYS[name]]:,.0f}", f"{vs_float[CALL_KEYS[name]]:.2f}x"]
        for name in calls
    ]
    added = args.steps * args.rounds
    count_a, sum_a = totals_over_rounds(runs["item"])
    count_b, sum_b = totals_over_rounds(runs["tensor"])
    sample_rows = [
        [
            name,
            f"{count_a[name]:,} / {added:,}",
            f"{count_b[name]:,} / {added:,}",
            "yes" if math.isclose(sum_a[name], sum_b[name], rel_tol=1e-6) else "no",
        ]
        for name in SCALARS
    ]
    wall_none = per_step["none"]["wall_us"]
    return {
        "steps": args.steps,
        "rounds": args.rounds,
        "calls": args.calls,
        "device": args.device,
        "window_ms": WINDOW.total_seconds() * 1000,
        "per_step": per_step,
        # Wall time a step's 3 values add over no logging, per value, µs.
        "added_per_value_us": {
            v: (per_step[v]["wall_us"] - wall_none) / len(SCALARS) for v in ("item", "tensor")
        },
        "added_per_step_us": {v: per_step[v]["wall_us"] - wall_none for v in ("item", "tensor")},
        "call_ns": ns,
        "call_vs_float": vs_float,
        "tables": {
            "steps": _results.table(
                ["variant", "wall us/step", "wall / no logging", "CPU us/step", "CPU / no logging"],
                step_rows,
            ),
            "calls": _results.table(["call", "ns/call", "vs the float"], call_rows),
            "samples": _results.table(
                ["Stat", "(a) `t.item()`", "(b) `t`", "(b)'s SUM = (a)'s"], sample_rows, "lrrl"
            ),
        },
    }


def failures(args: argparse.Namespace, runs: dict[str, list[Run]]) -> list[str]:
    """What (a) or (b) lost or got wrong, one sentence each (empty: nothing)."""
    problems = []
    added = args.steps * args.rounds
    results = {v: totals_over_rounds(runs[v]) for v in ("item", "tensor")}
    for v, (count, _) in results.items():
        for name in SCALARS:
            if count[name] != added:
                problems.append(f"{TITLES[v]}: {name} windows count {count[name]:,} of {added:,}")
        for _, _, t in runs[v]:
            assert t is not None
            if t.not_plain:
                problems.append(f"{TITLES[v]}: the handler got {t.not_plain} non-number values")
            if t.lost:
                problems.append(f"{TITLES[v]}: {t.lost} windows dropped or failed in the handler")
            if t.timed_out:
                problems.append(f"{TITLES[v]}: flush() or close() timed out")
    for name in SCALARS:
        a, b = results["item"][1][name], results["tensor"][1][name]
        if not math.isclose(a, b, rel_tol=1e-6):
            problems.append(f"{name}: (b)'s windows total {b!r}, (a)'s {a!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a fast, rough run: 300 steps, 1 round"
    )
    parser.add_argument("--steps", type=positive, help="steps per run (default 3,000)")
    parser.add_argument("--rounds", type=positive, help="rounds to take the median of (default 7)")
    parser.add_argument(
        "--calls", type=positive, help="calls per ns-per-call measure (default 50,000)"
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    _results.save_argument(parser, "device_values")
    args = parser.parse_args()
    if torch is None:
        parser.error("needs torch: pip install torch")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: not a torch device: {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    defaults = (300, 1, 5_000) if args.quick else (3_000, 7, 50_000)
    args.steps = args.steps or defaults[0]
    args.rounds = args.rounds or defaults[1]
    args.calls = args.calls or defaults[2]
    # Two cores shared with the bus's threads: torch's own pool would only contend.
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    runs, calls = run(args)
    load_after = os.getloadavg()
    results = results_of(args, runs, calls)
    results["load"] = {"before": load_before[0], "after": load_after[0]}
    results["torch_threads"] = torch.get_num_threads()
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    for name in ("steps", "calls", "samples"):
        print(_results.markdown(results["tables"][name]) + "\n")
    if args.save is not None:
        _results.save("device_values", results, packages=("torch",), path=args.save)
    problems = failures(args, runs)
    for problem in problems:
        print(f"device_values.py: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
