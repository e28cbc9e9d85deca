"""The demo: a small numpy network trained in an anyio loop, logging through a bus.

A producer task shuffles a synthetic two-spirals data set into minibatches and sends them
over a memory stream; the training task fits a two-layer tanh network with Adam, logs one
``demo.epoch`` event per epoch (losses, held-out accuracy) and feeds ``Stat`` windows of a
quarter second for step time, throughput and training loss; a ``SystemMetrics`` adds the
process's and the host's CPU and memory as ``system.*`` Stats. The bus writes everything to a
JSON-lines file and to TensorBoard under the log directory, and a tally handler measures how
long events take to reach a handler. Needs the ``demo`` extra (numpy; tensorboard unless disabled).

In TensorBoard every chart's x axis is the training step: an epoch is drawn at the steps done
by its end (its ``"step"`` key), a Stat window at the steps done when it closed (added to the
window as ``"step"``, which ``TensorboardEventHandler`` takes as the global step). Stat tags are
grouped under ``stats/``, the system metrics under ``system/`` (their min and max under
``system.min/`` and ``system.max/``, each metric's mean and band on one chart in the CUSTOM
SCALARS tab) and the epoch metrics under ``epoch/``, one section each; the step time's
histogram is in the HISTOGRAMS and DISTRIBUTIONS tabs. The run's final metrics (losses,
accuracy, the step time's p50 and p99 over the run) are the HPARAMS tab's metrics, under
``summary/``. The files go in the run's own subdirectory, ``<log dir>/demo``.

Each Stat's last window (partial: cut short by the run's end, or closed just after it) is left
out of TensorBoard, where it would be a point at the last step standing for a fraction of a
window, often a spike; a Stat with no other window keeps it. They
are in the JSON-lines file, where ``monitor-bus summary`` and ``plot`` mark a partial last
window.
"""

from __future__ import annotations

import bisect
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio

from ._aggregates import Aggregation
from ._bus import EventBus
from ._event import Event, from_slots
from ._jsonl import JsonlEventHandler
from ._run import RUN_END_EVENT, Run
from ._stat import Stat
from ._tensorboard_handler import TensorboardEventHandler
from ._window import STAT_EVENT
from .system import SystemMetrics

EPOCH_EVENT = "demo.epoch"
JSONL_NAME = "events.jsonl"
#: TensorBoard's run name: the subdirectory of the log directory the event files go in.
TENSORBOARD_RUN = "demo"
#: TensorBoard's section of the Stat tags (``stats/step_time_ms.mean``, ...).
STAT_GROUP = "stats"
# A quarter second: a default run (about 4 s) draws some 16 points per chart, not 4.
WINDOW = timedelta(milliseconds=250)
# Seconds between system metrics samples: a few per window.
SYSTEM_INTERVAL = 0.1
BATCH = 256
HIDDEN = 128
SAMPLES = 8192
HOLDOUT = 2048

#: Called about ten times a second with (steps done, steps in all, last training loss).
ProgressCallback = Callable[[int, int, float], None]


@dataclass
class DemoResult:
    """What a demo run did; the CLI prints it."""

    log_dir: str
    jsonl_path: str
    tensorboard: bool
    steps: int
    epochs: int
    seconds: float
    final_accuracy: float
    events_by_name: dict[str, int]
    stat_windows: dict[str, int]
    written: int
    dropped: int
    """Events the bus's full queue turned away (no handler got them)."""
    undelivered: int
    """Summed over handlers: events a handler did not get (queue drops count once per handler)."""
    handler_errors: int
    trained_until: datetime
    """When the training ended: Stat windows stamped later are left out of TensorBoard."""
    latencies_ms: list[float] = field(repr=False)

    def latency_percentile(self, q: float) -> float:
        """The q-th percentile (0-100) of delivery latency in milliseconds (nearest rank)."""
        if not self.latencies_ms:
            return math.nan
        ordered = sorted(self.latencies_ms)
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        return ordered[rank - 1]


class _Tally:
    """Counts events by name and Stat windows by stat, and measures delivery latency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: Counter[str] = Counter()
        self.windows: Counter[str] = Counter()
        self.latencies_ms: list[float] = []

    def __call__(self, event: Event) -> None:
        latency = (datetime.now(timezone.utc) - event.timestamp).total_seconds() * 1000.0
        with self.lock:
            self.latencies_ms.append(latency)
            self.names[event.name] += 1
            if event.name == STAT_EVENT:
                self.windows.update({key.rpartition(".")[0] for key in event.data})


class _Progress:
    """When each training step finished, for the handlers: written by the training task only."""

    def __init__(self) -> None:
        # Wall time (seconds since the epoch) at which step i + 1 was done; appends only.
        self.done_at: list[float] = []
        # Wall time at which the training ended: its last step was done (set before its last,
        # partial windows are logged).
        self.ended_at = math.inf

    def steps_by(self, timestamp: datetime) -> int:
        """How many steps were done at ``timestamp``."""
        return bisect.bisect_right(self.done_at, timestamp.timestamp())


class _AtStep:
    """Gives each Stat window the training step at its close, then hands it on.

    A window holds no step, so TensorBoard would count windows; with ``"step"`` added, the
    TensorBoard handler draws it at the same x as the epoch metrics. Each Stat's latest window
    is held until the next one comes: at the run's end the one held is its Stat's last,
    partial window (cut short by the end, or closed just after it), left out unless it is its
    Stat's only one. Which window is last is known then whatever the delivery's timing.
    """

    def __init__(self, handler: TensorboardEventHandler, progress: _Progress) -> None:
        self._handler = handler
        self._progress = progress
        self._held: dict[str, tuple[Event, bool]] = {}  # per Stat: its latest window, if first

    def __call__(self, event: Event) -> None:
        if event.name == STAT_EVENT:
            stat = next(iter(event.data), "").rpartition(".")[0]
            held = self._held.get(stat)
            self._held[stat] = (event, held is None)
            if held is not None:
                self._draw(held[0])
            return
        if event.name == RUN_END_EVENT:
            last, self._held = self._held, {}
            for window, first in last.values():
                if first:  # a Stat's only window: drawn, partial or not
                    self._draw(window)
        self._handler(event)

    def _draw(self, event: Event) -> None:
        step = self._progress.steps_by(event.timestamp)
        # from_slots: a window may hold a Histogram, which Event() takes from no caller.
        self._handler(from_slots(event.name, event.timestamp, {**event.data, "step": step}))

    def flush(self) -> None:
        self._handler.flush()


class _EpochScalars:
    """Writes each ``demo.epoch`` event's metrics (not its counters) to TensorBoard under
    ``epoch/``, at the training step the epoch ended."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def __call__(self, event: Event) -> None:
        if event.name != EPOCH_EVENT:
            return
        data = event.data
        walltime = event.timestamp.timestamp()
        for key, value in data.items():
            if key not in ("epoch", "step"):
                self._writer.add_scalar(
                    f"epoch/{key}", value, global_step=data["step"], walltime=walltime
                )

    def flush(self) -> None:
        self._writer.flush()


def default_log_dir() -> str:
    """``runs/<local date-time>`` under the working directory."""
    return os.path.join("runs", datetime.now().strftime("%Y%m%d-%H%M%S"))


def run_demo(
    steps: int = 3000,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    tensorboard: bool = True,
    seed: int = 0,
    progress: ProgressCallback | None = None,
) -> DemoResult:
    """Train the demo network for ``steps`` steps, logging under ``log_dir``.

    Args:
        steps: optimizer steps (minibatches of 256); 32 make an epoch.
        log_dir: where ``events.jsonl`` goes, and the TensorBoard files in its subdirectory
            ``demo`` (the run's name in TensorBoard); made if missing; default
            ``runs/<date-time>``. An existing ``events.jsonl`` is appended to.
        tensorboard: also write TensorBoard event files.
        seed: seeds the data set, the initial weights and the shuffling.
        progress: called about ten times a second, on the calling thread (the loop runs there).

    Raises:
        ValueError: ``steps`` is below 1.
        OSError: ``log_dir`` cannot be made or written (the message names it).
        ImportError: numpy, or tensorboard when asked for, is not installed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    # Missing dependencies fail here, before anything is made.
    import numpy  # noqa: F401

    make_writer: Callable[[str], Any] | None = None
    if tensorboard:
        from .tensorboard import SummaryWriter as make_writer

    log_dir = os.fspath(log_dir) if log_dir is not None else default_log_dir()
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        raise type(exc)(
            exc.errno, f"cannot create log directory: {exc.strerror}", log_dir
        ) from None
    jsonl_path = os.path.join(log_dir, JSONL_NAME)
    jsonl = JsonlEventHandler(jsonl_path)
    writer = None
    if make_writer is not None:
        try:
            writer = make_writer(os.path.join(log_dir, TENSORBOARD_RUN))
        except BaseException:
            jsonl.close()
            raise

    tally = _Tally()
    progress_of_steps = _Progress()
    bus = EventBus(name="demo")
    try:
        bus.register_event_handler(jsonl, name="jsonl")
        if writer is not None:
            stat_scalars = TensorboardEventHandler(writer, group=STAT_GROUP)
            bus.register_event_handler(_AtStep(stat_scalars, progress_of_steps), name="tensorboard")
            bus.register_event_handler(_EpochScalars(writer), name="tensorboard-epochs")
        bus.register_event_handler(tally, name="tally")
        started = time.perf_counter()
        # The run's start and end (success, or interrupted by Ctrl-C) for every sink.
        config = {"steps": steps, "seed": seed, "samples": SAMPLES, "holdout": HOLDOUT}
        hparams = {"batch": BATCH, "hidden": HIDDEN}
        # The machine as the run used it: system.* Stats, drawn next to the training's (their
        # last windows logged before the run's end).
        state = _State()
        with (
            Run("demo", config=config, hparams=hparams, bus=bus) as run,
            SystemMetrics(SYSTEM_INTERVAL, bus=bus, window=WINDOW),
        ):
            try:
                epochs, accuracy = _run_interruptible(
                    _train, bus, steps, seed, progress, progress_of_steps, state
                )
            finally:  # what the run is compared by, in the HPARAMS tab: interrupted or not
                run.metrics.update(state.final_metrics())
        seconds = time.perf_counter() - started
        bus.flush()
        stats = bus.stats()
    finally:
        bus.close(timeout=10.0)
        jsonl.close()
        if writer is not None:
            writer.close()
    with tally.lock:
        return DemoResult(
            log_dir=log_dir,
            jsonl_path=jsonl_path,
            tensorboard=writer is not None,
            steps=steps,
            epochs=epochs,
            seconds=seconds,
            final_accuracy=accuracy,
            events_by_name=dict(tally.names),
            stat_windows=dict(tally.windows),
            written=jsonl.written,
            dropped=stats["dropped"],
            undelivered=stats["handler_dropped"],
            handler_errors=stats["handler_errors"],
            trained_until=datetime.fromtimestamp(progress_of_steps.ended_at, timezone.utc),
            latencies_ms=list(tally.latencies_ms),
        )


def _run_interruptible(
    train: Callable[..., Awaitable[tuple[int, float]]], *args: Any
) -> tuple[int, float]:
    """``anyio.run(train, *args)``, where Ctrl-C ends in ``KeyboardInterrupt`` on every Python.

    The demo takes SIGINT itself (in the main thread): the first one cancels the training, whose
    ``finally`` blocks run (the last Stat windows get logged), then ``KeyboardInterrupt`` is
    raised. Left to the event loop's runner, the cancellation it makes escaped as
    ``CancelledError`` on 3.10, and under load on 3.13 was now and then absorbed by a cancel
    scope, so the training went on.
    """
    interrupted = False
    result: tuple[int, float] = (0, math.nan)

    async def main() -> None:
        nonlocal interrupted, result
        async with anyio.create_task_group() as tg:

            async def on_sigint() -> None:
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT) as signals:
                    async for _ in signals:
                        interrupted = True
                        tg.cancel_scope.cancel()
                        return

            async def run() -> None:
                nonlocal result
                result = await train(*args)
                tg.cancel_scope.cancel()

            if threading.current_thread() is threading.main_thread():
                tg.start_soon(on_sigint)
            tg.start_soon(run)

    anyio.run(main)
    if interrupted:
        raise KeyboardInterrupt
    return result


def _spirals(rng: Any, n: int) -> tuple[Any, Any]:
    """Two interleaved noisy spirals in the plane, labels 0 and 1."""
    import numpy as np

    t = np.sqrt(rng.uniform(0.0, 1.0, n)) * 4.0 * np.pi
    label = rng.integers(0, 2, n)
    sign = np.where(label == 1, 1.0, -1.0)
    x = np.stack([sign * t * np.cos(t), sign * t * np.sin(t)], axis=1) / (4.0 * np.pi)
    x += rng.normal(0.0, 0.04, x.shape)
    return x.astype(np.float64), label.astype(np.float64)[:, None]


class _Net:
    """2 -> HIDDEN -> HIDDEN -> 1, tanh hidden layers, sigmoid output, trained with Adam."""

    def __init__(self, rng: Any) -> None:
        import numpy as np

        self.params = [
            rng.normal(0.0, 1.0, (2, HIDDEN)) * 2.0,
            np.zeros(HIDDEN),
            rng.normal(0.0, 1.0 / math.sqrt(HIDDEN), (HIDDEN, HIDDEN)),
            np.zeros(HIDDEN),
            rng.normal(0.0, 1.0 / math.sqrt(HIDDEN), (HIDDEN, 1)),
            np.zeros(1),
        ]
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.t = 0

    def forward(self, x: Any) -> tuple[Any, Any, Any]:
        import numpy as np

        w1, b1, w2, b2, w3, b3 = self.params
        h1 = np.tanh(x @ w1 + b1)
        h2 = np.tanh(h1 @ w2 + b2)
        logits = h2 @ w3 + b3
        return h1, h2, logits

    @staticmethod
    def loss(logits: Any, y: Any) -> float:
        import numpy as np

        # Binary cross-entropy from logits, stable for large |logits|.
        return float(np.mean(np.logaddexp(0.0, logits) - y * logits))

    def step(self, x: Any, y: Any, lr: float = 0.01) -> float:
        import numpy as np

        w1, b1, w2, b2, w3, b3 = self.params
        h1, h2, logits = self.forward(x)
        loss = self.loss(logits, y)
        d3 = (1.0 / (1.0 + np.exp(-logits)) - y) / len(x)
        d2 = (d3 @ w3.T) * (1.0 - h2 * h2)
        d1 = (d2 @ w2.T) * (1.0 - h1 * h1)
        grads = [x.T @ d1, d1.sum(0), h1.T @ d2, d2.sum(0), h2.T @ d3, d3.sum(0)]
        self.t += 1
        c1 = 1.0 - 0.9**self.t
        c2 = 1.0 - 0.999**self.t
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= lr * (m / c1) / (np.sqrt(v / c2) + 1e-8)
        return loss


@dataclass
class _State:
    """Progress of the training task, read by the progress task."""

    done: int = 0
    loss: float = math.nan
    epochs: int = 0
    accuracy: float = math.nan
    #: The last epoch's losses.
    train_loss: float = math.nan
    val_loss: float = math.nan
    #: Every step's time (ms): the run's percentiles, exactly.
    step_times_ms: list[float] = field(default_factory=list)

    def final_metrics(self) -> dict[str, float]:
        """The run's final losses and accuracy, and its step time's p50 and p99 over the run
        (those known)."""
        import numpy as np

        metrics = {
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "val_accuracy": self.accuracy,
        }
        if self.step_times_ms:
            p50, p99 = np.percentile(self.step_times_ms, [50, 99])
            metrics |= {"step_time_ms_p50": float(p50), "step_time_ms_p99": float(p99)}
        return {key: value for key, value in metrics.items() if not math.isnan(value)}


async def _train(
    bus: EventBus,
    steps: int,
    seed: int,
    progress: ProgressCallback | None,
    done: _Progress,
    state: _State,
) -> tuple[int, float]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x, y = _spirals(rng, SAMPLES + HOLDOUT)
    x_train, y_train, x_test, y_test = x[:SAMPLES], y[:SAMPLES], x[SAMPLES:], y[SAMPLES:]
    per_epoch = SAMPLES // BATCH
    net = _Net(rng)

    step_time = Stat(
        "step_time_ms",
        [
            Aggregation.MEAN,
            Aggregation.MIN,
            Aggregation.MAX,
            Aggregation.P50,
            Aggregation.P99,
            Aggregation.HISTOGRAM,
        ],
        WINDOW,
        bus=bus,
    )
    throughput = Stat("samples_per_s", [Aggregation.MEAN], WINDOW, bus=bus)
    train_loss = Stat("train_loss", [Aggregation.MEAN], WINDOW, bus=bus)
    stats = (step_time, throughput, train_loss)

    send, receive = anyio.create_memory_object_stream[tuple[Any, Any, bool]](max_buffer_size=8)

    async def produce() -> None:
        async with send:
            sent = 0
            while sent < steps:
                order = rng.permutation(SAMPLES)
                for i in range(per_epoch):
                    if sent == steps:
                        break
                    idx = order[i * BATCH : (i + 1) * BATCH]
                    sent += 1
                    last = i == per_epoch - 1 or sent == steps
                    await send.send((x_train[idx], y_train[idx], last))

    async def train() -> None:
        epoch_losses: list[float] = []
        async with receive:
            async for xb, yb, epoch_end in receive:
                began = time.perf_counter()
                loss = net.step(xb, yb)
                elapsed = time.perf_counter() - began
                step_time.add(elapsed * 1000.0)
                state.step_times_ms.append(elapsed * 1000.0)
                throughput.add(len(xb) / elapsed)
                train_loss.add(loss)
                # After the adds: a window closed by one of them (stamped then) holds the
                # steps before this one, and so is drawn at their count.
                done.done_at.append(time.time())
                epoch_losses.append(loss)
                state.done += 1
                state.loss = loss
                if epoch_end:
                    state.epochs += 1
                    _, _, logits = net.forward(x_test)
                    accuracy = float(np.mean((logits > 0.0) == (y_test > 0.5)))
                    state.accuracy = accuracy
                    state.train_loss = float(np.mean(epoch_losses))
                    state.val_loss = net.loss(logits, y_test)
                    bus.log_event(
                        Event(
                            EPOCH_EVENT,
                            datetime.now(timezone.utc),
                            {
                                "epoch": state.epochs,
                                "step": state.done,
                                "train_loss": state.train_loss,
                                "val_loss": state.val_loss,
                                "val_accuracy": accuracy,
                            },
                        )
                    )
                    epoch_losses = []

    async def report() -> None:
        assert progress is not None
        while True:
            progress(state.done, steps, state.loss)
            await anyio.sleep(0.1)

    try:
        async with anyio.create_task_group() as tg:
            if progress is not None:
                tg.start_soon(report)
            async with anyio.create_task_group() as work:
                work.start_soon(produce)
                work.start_soon(train)
            tg.cancel_scope.cancel()
    finally:
        # The training ended with its last step: the windows logged after it (the open ones,
        # below) are cut short by the end.
        done.ended_at = done.done_at[-1] if done.done_at else time.time()
        # Log the last, partial windows, also when interrupted: the bus writes them out.
        for stat in stats:
            stat._close()
    if progress is not None:
        progress(state.done, steps, state.loss)
    return state.epochs, state.accuracy
