"""TensorBoard: our torch-free SummaryWriter, and TensorboardEventHandler with ours, torch's
and tensorboardX's writers, all read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import importlib.util
import math
import struct
import subprocess
import sys
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

import monitor_bus
from monitor_bus import METRICS_EVENT, STAT_EVENT, Event, EventBus, TensorboardEventHandler, _bus
from monitor_bus.tensorboard import SummaryWriter

from .conftest import WINDOW_SAMPLES, distribution_window, log_windows, real_window, require

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def f32(v: float) -> float:
    """What a float becomes in a ``simple_value`` (a 32-bit float)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def load(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float, float]]:
    return [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]


class FakeWriter:
    """Records add_scalar calls as (tag, value, global_step, walltime)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any, Any]] = []

    def add_scalar(
        self, tag: str, scalar_value: Any, global_step: Any = None, walltime: Any = None
    ) -> None:
        self.calls.append((tag, scalar_value, global_step, walltime))


def stat_event(seconds: float, data: dict[str, Any]) -> Event:
    return Event(STAT_EVENT, T0 + timedelta(seconds=seconds), data)


# -- our SummaryWriter --


def test_writer_scalars_read_back_exactly(tmp_path: Path) -> None:
    """add_scalar's tags, steps, wall times and (32-bit) values come back from EventAccumulator."""
    values = [0.1, -2.5, 1e-7, 123456.789, math.inf]
    with SummaryWriter(tmp_path) as writer:
        for i, v in enumerate(values):
            writer.add_scalar("loss/train", v, global_step=10 * i, walltime=1000.0 + i)
        writer.add_scalar("lr", 3, walltime=2000.5)
    acc = load(tmp_path)
    assert sorted(acc.Tags()["scalars"]) == ["loss/train", "lr"]
    assert scalars(acc, "loss/train") == [
        (10 * i, 1000.0 + i, f32(v)) for i, v in enumerate(values)
    ]
    assert scalars(acc, "lr") == [(0, 2000.5, 3.0)]


def test_writer_new_style_double_precision_keeps_all_bits(tmp_path: Path) -> None:
    """new_style=True, double_precision=True stores a 64-bit tensor of the scalars plugin."""
    with SummaryWriter(tmp_path) as writer:
        writer.add_scalar("x", 0.1, global_step=4, new_style=True, double_precision=True)
    acc = load(tmp_path)
    assert acc.Tags()["tensors"] == ["x"]
    (event,) = acc.Tensors("x")
    assert (event.step, list(event.tensor_proto.double_val)) == (4, [0.1])
    assert acc.SummaryMetadata("x").plugin_data.plugin_name == "scalars"


def test_writer_add_scalars_uses_torch_layout(tmp_path: Path) -> None:
    """add_scalars writes one run per key, <main_tag>_<key>, each holding the main tag."""
    with SummaryWriter(tmp_path) as writer:
        writer.add_scalars("loss/all", {"train": 0.5, "val": 0.75}, global_step=2, walltime=7.0)
        writer.add_scalars("loss/all", {"train": 0.25}, global_step=3, walltime=8.0)
    mux = EventMultiplexer().AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    assert sorted(mux.Runs()) == [".", "loss_all_train", "loss_all_val"]
    assert [(e.step, e.value) for e in mux.Scalars("loss_all_train", "loss/all")] == [
        (2, 0.5),
        (3, 0.25),
    ]
    assert [(e.step, e.value) for e in mux.Scalars("loss_all_val", "loss/all")] == [(2, 0.75)]


def test_writer_accepts_numpy_scalars(tmp_path: Path) -> None:
    """numpy scalars work as values and steps."""
    import numpy as np

    with SummaryWriter(tmp_path) as writer:
        writer.add_scalar("x", np.float32(0.5), global_step=np.int64(7), walltime=1.0)
    assert scalars(load(tmp_path), "x") == [(7, 1.0, 0.5)]


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    """Bad tags, values and steps raise TypeError naming the argument; nothing is written."""
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="tag"):
            writer.add_scalar(1, 0.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="scalar_value"):
            writer.add_scalar("x", "high")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="global_step"):
            writer.add_scalar("x", 0.5, global_step=1.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="tag_scalar_dict"):
            writer.add_scalars("x", [1.0])  # type: ignore[arg-type]
        writer.add_scalar("ok", 1.0, global_step=1)
    acc = load(tmp_path)
    assert acc.Tags()["scalars"] == ["ok"]


def test_writer_closed_raises_and_close_is_idempotent(tmp_path: Path) -> None:
    """After close(), add_scalar raises RuntimeError; close() and flush() stay no-ops."""
    writer = SummaryWriter(tmp_path)
    writer.add_scalar("x", 1.0, global_step=0)
    writer.close()
    writer.close()
    writer.flush()
    with pytest.raises(RuntimeError, match="closed"):
        writer.add_scalar("x", 2.0)
    assert [v for _, _, v in scalars(load(tmp_path), "x")] == [1.0]


def test_writer_log_dir_that_cannot_be_made(tmp_path: Path) -> None:
    """A log_dir under a regular file raises OSError naming the directory."""
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    with pytest.raises(OSError, match="cannot create log_dir") as info:
        SummaryWriter(blocker / "run")
    assert info.value.filename == str(blocker / "run")
    assert blocker.read_text() == "keep me"


def test_import_monitor_bus_does_not_import_tensorboard() -> None:
    """`import monitor_bus` leaves tensorboard (and numpy) unimported."""
    code = "import sys, monitor_bus; print('tensorboard' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# -- TensorboardEventHandler --


def test_handler_counts_steps_per_tag() -> None:
    """Without a step, each tag gets its own counter 0, 1, 2, ... and the event time as wall time."""
    writer = FakeWriter()
    handler = TensorboardEventHandler(writer)
    handler(stat_event(0, {"a.mean": 1.0, "b.max": 2.0}))
    handler(stat_event(1, {"a.mean": 3.0}))
    handler(stat_event(2, {"a.mean": 4.0, "b.max": 5.0}))
    t = T0.timestamp()
    assert writer.calls == [
        ("a.mean", 1.0, 0, t),
        ("b.max", 2.0, 0, t),
        ("a.mean", 3.0, 1, t + 1),
        ("a.mean", 4.0, 2, t + 2),
        ("b.max", 5.0, 1, t + 2),
    ]


def test_handler_uses_the_events_step() -> None:
    """An int under "step" is the global step of the event's other keys and is not written."""
    writer = FakeWriter()
    handler = TensorboardEventHandler(writer)
    handler(stat_event(0, {"step": 40, "loss.value": 0.5}))
    handler(stat_event(1, {"step": True, "loss.value": 0.25}))  # a bool is not a step
    t = T0.timestamp()
    assert writer.calls == [
        ("loss.value", 0.5, 40, t),
        ("step", True, 0, t + 1),
        ("loss.value", 0.25, 0, t + 1),
    ]


def test_handler_group_prefixes_every_tag() -> None:
    """group="stats" writes each key under "stats/", with or without a step; the default keeps the key."""
    writer = FakeWriter()
    handler = TensorboardEventHandler(writer, group="stats")
    handler(stat_event(0, {"a.mean": 1.0, "b.max": 2.0}))
    handler(stat_event(1, {"step": 40, "a.mean": 3.0}))
    t = T0.timestamp()
    assert writer.calls == [
        ("stats/a.mean", 1.0, 0, t),
        ("stats/b.max", 2.0, 0, t),
        ("stats/a.mean", 3.0, 40, t + 1),
    ]


def test_handler_rejects_a_bad_group() -> None:
    """A group that is not a str, is empty or ends with "/" is refused, naming the argument."""
    with pytest.raises(TypeError, match="group must be a str or None, not int"):
        TensorboardEventHandler(FakeWriter(), group=1)  # type: ignore[arg-type]
    for bad in ("", "stats/"):
        with pytest.raises(ValueError, match="group must be a non-empty tag prefix"):
            TensorboardEventHandler(FakeWriter(), group=bad)


def test_handler_ignores_other_events() -> None:
    """Only STAT_EVENT events are written, as in torch.monitor."""
    writer = FakeWriter()
    TensorboardEventHandler(writer)(Event("train.epoch", T0, {"loss": 1.0}))
    assert writer.calls == []


def test_handler_flush_flushes_the_writer() -> None:
    """flush() calls the writer's flush, and is a no-op for a writer without one."""

    class FlushingWriter(FakeWriter):
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1

    writer = FlushingWriter()
    handler = TensorboardEventHandler(writer)
    handler.flush()
    handler.flush()
    assert writer.flushes == 2
    TensorboardEventHandler(FakeWriter()).flush()


def test_scalars_are_on_disk_once_the_bus_has_flushed(
    bus: monitor_bus.EventBus, tmp_path: Path
) -> None:
    """After bus.flush(), the event file holds every window, with the writer still open."""
    writer = SummaryWriter(tmp_path, flush_secs=3600, max_queue=1000)
    bus.register_event_handler(TensorboardEventHandler(writer), name="tb")
    for i, data in enumerate(WINDOWS):
        bus.log_event(stat_event(i, data))
    assert bus.flush(timeout=10)
    check_windows(tmp_path)
    writer.close()


def test_handler_rejects_a_writer_without_add_scalar() -> None:
    """A writer without add_scalar is a TypeError naming the writer."""
    with pytest.raises(TypeError, match="writer must have an add_scalar"):
        TensorboardEventHandler(object())  # type: ignore[arg-type]


WINDOWS = [
    {"t.mean": 0.5, "t.count": 3},
    {"t.mean": 0.125, "t.count": 1},
    {"t.mean": 2.0, "t.count": 8},
]


def run_windows_through_bus(bus: monitor_bus.EventBus, writer: Any) -> None:
    handle = bus.register_event_handler(TensorboardEventHandler(writer), name="tb")
    for i, data in enumerate(WINDOWS):
        bus.log_event(stat_event(i, data))
    assert bus.unregister_event_handler(handle, timeout=10)
    writer.close()


def check_windows(log_dir: Path) -> None:
    acc = load(log_dir)
    assert sorted(acc.Tags()["scalars"]) == ["t.count", "t.mean"]
    t = T0.timestamp()
    for key in ("t.mean", "t.count"):
        assert scalars(acc, key) == [(i, t + i, f32(d[key])) for i, d in enumerate(WINDOWS)]


def test_bus_to_our_writer(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """Stat windows logged on a bus reach our writer's file, one step per window."""
    run_windows_through_bus(bus, SummaryWriter(tmp_path))
    check_windows(tmp_path)


def test_bus_to_torch_writer(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """The same windows through torch.utils.tensorboard.SummaryWriter read back the same."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    from torch.utils.tensorboard import SummaryWriter as TorchWriter

    run_windows_through_bus(bus, TorchWriter(str(tmp_path)))
    check_windows(tmp_path)


def test_bus_to_tensorboardx_writer(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """The same windows through tensorboardX.SummaryWriter read back the same."""
    require(importlib.util.find_spec("tensorboardX") is not None, "tensorboardX is not installed")
    from tensorboardX import SummaryWriter as XWriter

    run_windows_through_bus(bus, XWriter(str(tmp_path)))
    check_windows(tmp_path)


# -- values a writer cannot hold --

ODD = {
    "a.mean": 0.5,
    "note": "text",  # a string: skipped
    "huge.sum": 2**1100,  # beyond float64: skipped
    "bad\ud800.max": 1.0,  # not UTF-8, cannot be a tag: skipped
    "big.sum": 2**64,  # an int past int64 is still a float64
    "past.sum": 2**200,  # beyond float32, which a scalar is stored as: skipped
    "far.max": -1e39,  # the same for a float
    "edge.max": 3.4e38,  # within float32
    "nan.mean": math.nan,
    "inf.max": math.inf,
    "flag.value": True,
    "b.mean": 0.25,
}
WRITTEN = {
    "a.mean": 0.5,
    "big.sum": 2.0**64,
    "edge.max": 3.4e38,
    "nan.mean": math.nan,
    "inf.max": math.inf,
    "flag.value": 1.0,
    "b.mean": 0.25,
}


@pytest.fixture
def still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeze the skip reporter's clock, so repeats fall in one rate-limit interval."""
    monkeypatch.setattr("monitor_bus._skipped._clock", lambda: 100.0)


def skip_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "monitor_bus"]


def make_writer(kind: str, log_dir: Path) -> Any:
    """A SummaryWriter of ours, torch's or tensorboardX's."""
    if kind == "ours":
        return SummaryWriter(log_dir)
    require(importlib.util.find_spec(kind) is not None, f"{kind} is not installed")
    if kind == "torch":
        from torch.utils.tensorboard import SummaryWriter as TorchWriter

        return TorchWriter(str(log_dir))
    from tensorboardX import SummaryWriter as XWriter

    return XWriter(str(log_dir))


@pytest.mark.parametrize("kind", ["ours", "torch", "tensorboardX"])
@pytest.mark.usefixtures("still_clock")
def test_handler_skips_values_it_cannot_write_and_writes_the_rest(
    kind: str, bus: monitor_bus.EventBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Strings, numbers beyond float32 (a scalar's type) and non-UTF-8 keys are skipped and
    counted; the rest, NaN and infinities included, is written."""
    writer = make_writer(kind, tmp_path)
    handler = TensorboardEventHandler(writer)
    handle = bus.register_event_handler(handler, name="tb")
    bus.log_event(stat_event(0, ODD))
    bus.log_event(stat_event(1, ODD))
    assert bus.unregister_event_handler(handle, timeout=10)
    writer.close()
    assert bus.stats()["handler_errors"] == 0
    assert handler.skipped_values == 10
    acc = load(tmp_path)
    assert sorted(acc.Tags()["scalars"]) == sorted(WRITTEN)
    t = T0.timestamp()
    for key, value in WRITTEN.items():
        got = scalars(acc, key)
        assert [(step, wall) for step, wall, _ in got] == [(0, t), (1, t + 1)]
        if math.isnan(value):
            assert all(math.isnan(v) for _, _, v in got)
        else:
            assert [v for _, _, v in got] == [f32(value)] * 2
    assert skip_warnings(caplog) == [
        "TensorboardEventHandler: Stat value 'note' is a string; TensorBoard holds numbers: "
        "skipped (1 so far; repeats of this key are logged at most every 10 s)",
        "TensorboardEventHandler: Stat value 'huge.sum' is an int beyond float64's range: "
        "skipped (2 so far; repeats of this key are logged at most every 10 s)",
        "TensorboardEventHandler: Stat key 'bad\\ud800.max' is not valid UTF-8, so no tag: "
        "skipped (3 so far; repeats of this key are logged at most every 10 s)",
        "TensorboardEventHandler: Stat value 'past.sum' (1.607e+60) is beyond the range of the "
        "32-bit float TensorBoard stores a scalar as (it would read back as an infinity): "
        "skipped (4 so far; repeats of this key are logged at most every 10 s)",
        "TensorboardEventHandler: Stat value 'far.max' (-1e+39) is beyond the range of the "
        "32-bit float TensorBoard stores a scalar as (it would read back as an infinity): "
        "skipped (5 so far; repeats of this key are logged at most every 10 s)",
    ]


def test_handler_hands_the_writer_floats() -> None:
    """Every value reaches the writer as a float, so no writer sees a bool or an int numpy cannot hold."""
    writer = FakeWriter()
    TensorboardEventHandler(writer)(stat_event(0, {"n.count": 3, "f.value": False, "m.sum": 2**64}))
    assert [(tag, type(v), v) for tag, v, _, _ in writer.calls] == [
        ("n.count", float, 3.0),
        ("f.value", float, 0.0),
        ("m.sum", float, 2.0**64),
    ]


def test_step_outside_int64_is_not_a_step(tmp_path: Path) -> None:
    """An int under "step" that protobuf's int64 cannot hold is written like any other key."""
    with SummaryWriter(tmp_path) as writer:
        handler = TensorboardEventHandler(writer)
        handler(stat_event(0, {"step": 2**63, "x.mean": 1.0}))
        handler(stat_event(1, {"step": -(2**63), "x.mean": 2.0}))
    acc = load(tmp_path)
    t = T0.timestamp()
    assert scalars(acc, "step") == [(0, t, f32(2.0**63))]
    assert scalars(acc, "x.mean") == [(0, t, 1.0), (-(2**63), t + 1, 2.0)]
    assert handler.skipped_values == 0


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda w: w.add_scalar("x", 2**1100), ValueError, "scalar_value .* float64"),
        (lambda w: w.add_scalar("x", 1.0, global_step=2**63), ValueError, "global_step .* int64"),
        (lambda w: w.add_scalar("x\ud800", 1.0), ValueError, "tag .* UTF-8"),
        (lambda w: w.add_scalars("m\ud800", {"a": 1.0}), ValueError, "tag .* UTF-8"),
        (lambda w: w.add_scalars("m", {"a": -(2**1100)}), ValueError, "scalar_value"),
    ],
)
def test_writer_values_out_of_range_raise_naming_the_argument(
    tmp_path: Path, call: Any, error: type[Exception], match: str
) -> None:
    """A value, step or tag the event file cannot hold is a ValueError naming it; nothing is written."""
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(error, match=match):
            call(writer)
        writer.add_scalar("ok", 1.0, global_step=2**63 - 1)
    acc = load(tmp_path)
    assert acc.Tags()["scalars"] == ["ok"]
    assert [step for step, _, _ in scalars(acc, "ok")] == [2**63 - 1]


class _RunWriter(FakeWriter):
    """Also records ``add_run_event`` calls, as monitor_bus's SummaryWriter takes them."""

    def add_run_event(self, event: Event) -> None:
        self.calls.append(("run", event.name, dict(event.data), event.timestamp))


def test_through_a_bus_the_writer_gets_what_direct_calls_give(bus: monitor_bus.EventBus) -> None:
    """Registered on a bus (which hands it batches as queued, building Events only for the
    windows and run events), the handler makes the writer calls that calling it with each
    delivered event makes, and none for the other events."""
    from monitor_bus import RUN_START_EVENT

    from .conftest import Recorder

    writer = _RunWriter()
    recorder = Recorder()
    bus.register_event_handler(TensorboardEventHandler(writer), name="tb")
    bus.register_event_handler(recorder, name="recorder")
    for i in range(300):
        bus.log_event(Event("train.step", T0 + timedelta(seconds=i), {"loss": 1.0 / (i + 1)}))
        if i % 100 == 0:
            bus.log_event(stat_event(i, {"t.mean": i / 10, "t.count": i, "step": i // 100}))
    bus.log_event(Event(RUN_START_EVENT, T0, {"lr": 0.1}))
    stat = monitor_bus.Stat("x", [monitor_bus.Aggregation.MAX], timedelta(hours=1), bus=bus)
    stat.add(4.0)
    assert bus.close(10)
    direct = _RunWriter()
    handler = TensorboardEventHandler(direct)
    for event in recorder.events:
        handler(event)
    assert len(recorder.events) == 305
    assert [c[0] for c in direct.calls] == ["t.mean", "t.count"] * 3 + ["run", "x.max"]
    assert writer.calls == direct.calls


class _StepsToo(TensorboardEventHandler):
    """Also writes each "train.step" event's loss: a subclass that changes ``__call__``."""

    def __init__(self, writer: FakeWriter) -> None:
        super().__init__(writer)
        self.steps_writer = writer

    def __call__(self, event: Event) -> None:
        if event.name == "train.step":
            self.steps_writer.add_scalar("loss", event.data["loss"])
        else:
            super().__call__(event)


def test_the_bus_calls_a_subclass_that_redefines_call(bus: monitor_bus.EventBus) -> None:
    """A subclass's ``__call__`` gets every event from the bus, not only those the
    handler's own batch call would pick."""
    writer = FakeWriter()
    bus.register_event_handler(_StepsToo(writer), name="tb")
    bus.log_event(Event("train.step", T0, {"loss": 0.5}))
    bus.log_event(stat_event(1, {"t.mean": 2.0}))
    bus.log_event(Event("train.step", T0, {"loss": 0.25}))
    assert bus.flush(10)
    assert writer.calls == [
        ("loss", 0.5, None, None),
        ("t.mean", 2.0, 0, T0.timestamp() + 1),
        ("loss", 0.25, None, None),
    ]


class _PoppingWriter(FakeWriter):
    """A writer whose ``add_run_event`` changes the event's data, as user code may."""

    def add_run_event(self, event: Event) -> None:
        event.data.pop("lr")
        event.data["extra"] = 1.0


def test_a_writer_that_changes_an_events_data_changes_no_other_handlers(
    bus: monitor_bus.EventBus,
) -> None:
    """The writer gets each run event with its own ``data``: what it does to it reaches no
    other handler."""
    from monitor_bus import RUN_START_EVENT

    from .conftest import Recorder

    recorder = Recorder()
    bus.register_event_handler(TensorboardEventHandler(_PoppingWriter()), name="tb")
    bus.register_event_handler(recorder, name="recorder")
    for _ in range(50):
        bus.log_event(Event(RUN_START_EVENT, T0, {"lr": 0.1}))
    assert bus.close(10)
    assert [e.data for e in recorder.events] == [{"lr": 0.1}] * 50


@pytest.mark.usefixtures("still_clock")
def test_metrics_beyond_float32_are_skipped_and_counted(
    bus: monitor_bus.EventBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A METRICS_EVENT number a scalar cannot hold (2**200) is skipped and counted, not written
    as an infinity; its other numbers are written."""
    with SummaryWriter(tmp_path) as writer:
        handler = TensorboardEventHandler(writer)
        handle = bus.register_event_handler(handler, name="tb")
        for step in (1, 2):
            data = {"step": step, "loss": 0.5, "grad_norm": 2**200, "phase": "train"}
            bus.log_event(Event(monitor_bus.METRICS_EVENT, T0, data))
        assert bus.unregister_event_handler(handle, timeout=10)
    assert handler.skipped_values == 2
    acc = load(tmp_path)
    assert sorted(acc.Tags()["scalars"]) == ["loss"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.5)]
    assert skip_warnings(caplog) == [
        "TensorboardEventHandler: Stat value 'grad_norm' (1.607e+60) is beyond the range of the "
        "32-bit float TensorBoard stores a scalar as (it would read back as an infinity): "
        "skipped (1 so far; repeats of this key are logged at most every 10 s)",
    ]


# -- distributions: a window's Histogram, percentiles and stddev --


def in_bucket(samples: list[float], i: int, edges: list[float]) -> int:
    """How many samples TensorBoard's bucket ``i`` spans: from ``edges[i]`` (the first from
    ``min``, included) up to ``edges[i + 1]``."""
    low, high = edges[i], edges[i + 1]
    return sum(low < s <= high or (i == 0 and s == low) for s in samples)


@pytest.mark.parametrize("kind", ["ours", "torch", "tensorboardX"])
def test_histogram_becomes_a_histogram_summary(
    kind: str, bus: monitor_bus.EventBus, tmp_path: Path
) -> None:
    """A window's Histogram becomes a histogram summary (the HISTOGRAMS and DISTRIBUTIONS
    tabs) that EventAccumulator reads back with its count, sum, min, max and buckets, each
    spanning exactly its samples; the percentiles and stddev become scalars."""
    writer = make_writer(kind, tmp_path)
    bus.register_event_handler(TensorboardEventHandler(writer))
    windows = log_windows(bus, T0)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert (tags["histograms"], tags["distributions"]) == (["lat.histogram"], ["lat.histogram"])
    assert sorted(tags["scalars"]) == ["lat.p50", "lat.p99", "lat.stddev"]
    events = acc.Histograms("lat.histogram")
    for step, (samples, window, event) in enumerate(
        zip(WINDOW_SAMPLES, windows, events, strict=True)
    ):
        got = event.histogram_value
        assert (event.step, event.wall_time) == (step, window.timestamp.timestamp())
        assert (got.min, got.max, got.num, got.sum) == (
            min(samples),
            max(samples),
            len(samples),
            math.fsum(samples),
        )
        edges = [got.min, *got.bucket_limit]
        assert list(got.bucket) == [in_bucket(samples, i, edges) for i in range(len(got.bucket))]
        # The non-empty buckets are the Histogram's own, edge for edge.
        nonempty = [(limit, n) for limit, n in zip(got.bucket_limit, got.bucket, strict=True) if n]
        histogram = window.data["lat.histogram"]
        assert nonempty == [(upper, n) for _, upper, n in histogram.buckets()]
    for key in ("lat.p50", "lat.p99", "lat.stddev"):
        assert [v for _, _, v in scalars(acc, key)] == [f32(w.data[key]) for w in windows]


@pytest.mark.usefixtures("still_clock")
def test_histogram_without_finite_samples_or_writer_support_is_skipped(
    bus: monitor_bus.EventBus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NaN and infinite samples are left out of a histogram summary (its edges stay finite); a
    histogram with no other sample, or for a writer without add_histogram_raw, is skipped and
    counted, the scalars written."""
    writer = SummaryWriter(tmp_path)
    ours = TensorboardEventHandler(writer)
    fake = FakeWriter()
    plain = TensorboardEventHandler(fake)
    bus.register_event_handler(ours)
    bus.register_event_handler(plain)
    samples = [1.5, 3.3, math.inf, -math.inf, math.nan]
    bus.log_event(distribution_window(samples))
    bus.log_event(distribution_window([math.nan]))
    assert bus.flush(10)
    writer.close()
    assert (ours.skipped_values, plain.skipped_values) == (1, 2)
    assert [tag for tag, *_ in fake.calls] == ["lat.p50", "lat.p99", "lat.stddev"] * 2
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    acc.Reload()
    (event,) = acc.Histograms("lat.histogram")
    got = event.histogram_value
    histogram = monitor_bus.Histogram.of(samples)
    (low, _, _), (_, high, _) = histogram.buckets()[1], histogram.buckets()[-2]
    assert (got.num, got.min, got.max) == (2, low, high)
    assert math.isnan(got.sum)  # inf + -inf
    assert list(got.bucket_limit) == [histogram.buckets()[1][1], histogram.buckets()[2][0], high]
    assert sorted(skip_warnings(caplog)) == [  # the two handlers' threads, in either order
        "TensorboardEventHandler: Stat value 'lat.histogram' is a histogram and the writer has "
        "no add_histogram_raw: skipped (1 so far; repeats of this key are logged at most every "
        "10 s)",
        "TensorboardEventHandler: Stat value 'lat.histogram' is a histogram without a finite "
        "sample: skipped (1 so far; repeats of this key are logged at most every 10 s)",
    ]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"bucket_counts": [1]}, ValueError, r"bucket_limits \(2\) and bucket_counts \(1\)"),
        ({"bucket_limits": [], "bucket_counts": []}, ValueError, "not empty"),
        ({"bucket_limits": [1.0, "x"]}, TypeError, "bucket_limits must hold real numbers"),
        ({"sum": None}, TypeError, "sum must hold real numbers"),
        ({"tag": 3}, TypeError, "tag must be a str"),
        ({"global_step": 2**63}, ValueError, "outside int64"),
    ],
)
def test_add_histogram_raw_rejects_bad_arguments_naming_them(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], match: str
) -> None:
    """add_histogram_raw raises on a bad argument, naming it, and writes nothing."""
    args: dict[str, Any] = {
        "tag": "h",
        "min": 0.5,
        "max": 3.0,
        "num": 2,
        "sum": 3.5,
        "sum_squares": 9.25,
        "bucket_limits": [1.0, 4.0],
        "bucket_counts": [1, 1],
        **change,
    }
    with SummaryWriter(tmp_path) as writer, pytest.raises(error, match=match):
        writer.add_histogram_raw(**args)
    assert load(tmp_path).Tags()["histograms"] == []


def test_a_real_stat_window_becomes_a_histogram(bus: monitor_bus.EventBus, tmp_path: Path) -> None:
    """A window of a real Stat with HISTOGRAM reaches EventAccumulator as a histogram of all
    its samples, its percentiles and stddev as scalars."""
    writer = SummaryWriter(tmp_path)
    bus.register_event_handler(TensorboardEventHandler(writer))
    real_window(bus, WINDOW_SAMPLES[0])
    assert bus.flush(10)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    acc.Reload()
    (event,) = acc.Histograms("lat.histogram")
    got = event.histogram_value
    samples = WINDOW_SAMPLES[0]
    assert (got.num, got.min, got.max) == (len(samples), min(samples), max(samples))
    assert sorted(acc.Tags()["scalars"]) == ["lat.p50", "lat.p99", "lat.stddev"]


def test_a_run_event_from_log_has_its_wall_time_in_tensorboard(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The TensorBoard sink takes a ``log`` event's wall time from the float, as the datetime
    would give it: rounded to the microsecond, here into the next second."""
    clock = 1767225600.9999997
    monkeypatch.setattr(_bus, "_now", lambda: clock)
    with SummaryWriter(tmp_path) as writer, EventBus() as bus:
        bus.register_event_handler(TensorboardEventHandler(writer))
        bus.log(METRICS_EVENT, loss=0.5, step=3)
        assert bus.flush(10)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(s.wall_time, s.step, s.value) for s in acc.Scalars("loss")] == [
        (datetime.fromtimestamp(clock).timestamp(), 3, 0.5)
    ]
    assert datetime.fromtimestamp(clock).timestamp() == 1767225601.0


class _NoOffset(tzinfo):
    """A zone whose offset cannot be had: an event stamped with it has no wall time."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise ValueError("this zone has no offset")

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)


def test_a_window_that_cannot_be_written_costs_that_window_only(tmp_path: Path) -> None:
    """On a bus, one window of a batch of 400 that cannot be written (its timestamp has no
    offset) is the only one lost: the 399 others reach the event file, the bad one counts as
    dropped by the sink and on the bus, and as one error."""
    writer = SummaryWriter(str(tmp_path))
    sink = TensorboardEventHandler(writer)
    bus = EventBus(name="encode")
    bus._linger = 30.0  # one batch: drained at flush
    bus.register_event_handler(sink, name="tb")
    for i in range(400):
        when = datetime(2026, 1, 1, tzinfo=_NoOffset()) if i == 200 else T0
        bus.log_event(Event(STAT_EVENT, when + timedelta(seconds=i), {"x": float(i)}))
    assert bus.flush(10)
    (stats,) = bus.stats()["handlers"]
    assert bus.close(10)
    writer.close()
    assert (stats["delivered"], stats["dropped"], stats["errors"]) == (399, 1, 1)
    assert sink.dropped == 1
    got = [value for _, _, value in scalars(load(tmp_path), "x")]
    assert got == [float(i) for i in range(400) if i != 200]
