"""Device values: tensors and arrays logged without being read on the caller's thread."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import pytest

from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _device

from .conftest import Recorder, StepClock, require
from .test_stat import step_until_logged

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)
ALL = list(Aggregation)[:6]  # torch.monitor's six (the distributions: test_stat_distributions)
# The Stat clock stands still in every test here (the timer's test moves it): the loops of
# thousands of tensor adds, slow on a loaded machine, cannot cross a window boundary.
pytestmark = pytest.mark.usefixtures("clock")


@pytest.fixture
def torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        require(False, f"torch is not installed: {exc}")
    return torch


@pytest.fixture
def named_bus() -> Iterator[EventBus]:
    with EventBus(name="dev") as bus:
        yield bus


def stat_data(events: list[Event]) -> list[dict[str, object]]:
    return [e.data for e in events if e.name == STAT_EVENT]


def test_stat_logs_the_value_a_tensor_held_at_the_call(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """A tensor changed in place right after Stat.add is logged with the value it had."""
    named_bus.register_event_handler(recorder)
    stat = Stat("loss", ALL, timedelta(hours=1), bus=named_bus)
    loss = torch.tensor(2.0)
    stat.add(loss)
    loss.add_(100.0)
    stat.add(loss)
    loss.fill_(-1.0)
    stat._close()
    assert named_bus.flush(10)
    assert stat_data(recorder.events) == [
        {
            "loss.value": 102.0,
            "loss.mean": 52.0,
            "loss.count": 2,
            "loss.sum": 104.0,
            "loss.max": 102.0,
            "loss.min": 2.0,
        }
    ]


def test_stat_mixes_tensors_and_floats_exactly(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """Floats and tensors in one window fold into the same aggregates; the last sample is
    VALUE whichever kind it was."""
    named_bus.register_event_handler(recorder)
    stat = Stat("x", ALL, timedelta(hours=1), bus=named_bus)
    for v in (1.0, torch.tensor(-3.0), 5.0, torch.tensor(7, dtype=torch.int64), 2.0):
        stat.add(v)
    stat._close()
    for v in (torch.tensor(4.0), torch.tensor(True), 0.5, torch.tensor(9.0)):
        stat.add(v)
    stat._close()
    assert named_bus.flush(10)
    assert stat_data(recorder.events) == [
        {"x.value": 2.0, "x.mean": 2.4, "x.count": 5, "x.sum": 12.0, "x.max": 7.0, "x.min": -3.0},
        {"x.value": 9.0, "x.mean": 3.625, "x.count": 4, "x.sum": 14.5, "x.max": 9.0, "x.min": 0.5},
    ]
    assert stat.get() == dict(zip(ALL, (9.0, 3.625, 4, 14.5, 9.0, 0.5), strict=True))


class _ReadRecorder:
    """What a tensor subclass records: the thread of each read of its value."""

    threads: list[str] = []


def _recording_tensor(torch: Any) -> type:
    class Recorded(torch.Tensor):  # type: ignore[misc, name-defined]
        def item(self) -> Any:
            _ReadRecorder.threads.append(threading.current_thread().name)
            return super().item()

        def __float__(self) -> float:
            _ReadRecorder.threads.append(threading.current_thread().name)
            return super().__float__()  # type: ignore[no-any-return]

        def tolist(self) -> Any:
            _ReadRecorder.threads.append(threading.current_thread().name)
            return super().tolist()

    return Recorded


def test_values_are_read_on_the_dispatcher_thread_never_the_callers(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """Every read of a logged tensor (Stat sample or event value) happens on the bus's
    dispatcher thread."""
    recorded = _recording_tensor(torch)
    _ReadRecorder.threads = []
    named_bus.register_event_handler(recorder)
    stat = Stat("loss", [Aggregation.SUM], timedelta(hours=1), bus=named_bus)
    for i in range(3):
        stat.add(torch.tensor(float(i)).as_subclass(recorded))
    named_bus.log_event(Event("step", TS, {"loss": torch.tensor(0.25).as_subclass(recorded)}))
    assert _ReadRecorder.threads == []  # nothing read yet, on any thread
    stat._close()
    assert named_bus.flush(10)
    assert [e.data for e in recorder.events] == [{"loss": 0.25}, {"loss.sum": 3.0}]
    assert _ReadRecorder.threads == ["monitor_bus-dev"] * 4


def test_int_and_bool_tensors_reach_handlers_as_int_and_bool(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """Event values from integer and bool tensors come back as int and bool."""
    named_bus.register_event_handler(recorder)
    named_bus.log_event(
        Event(
            "e",
            TS,
            {
                "i": torch.tensor(7, dtype=torch.int32),
                "b": torch.tensor([False]),
                "f": torch.tensor(0.5, dtype=torch.float16),
                "s": "text",
            },
        )
    )
    assert named_bus.flush(10)
    data = recorder.events[0].data
    assert data == {"i": 7, "b": False, "f": 0.5, "s": "text"}
    assert [type(v) for v in data.values()] == [int, bool, float, str]


def test_event_tensor_changed_after_the_call_keeps_its_value(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """An event's tensor value is the one it held when the Event was made."""
    named_bus.register_event_handler(recorder)
    acc = torch.zeros(())
    for step in range(3):
        acc += 1.5
        named_bus.log_event(Event("step", TS, {"acc": acc, "step": step}))
    assert named_bus.flush(10)
    assert [e.data for e in recorder.events] == [
        {"acc": 1.5, "step": 0},
        {"acc": 3.0, "step": 1},
        {"acc": 4.5, "step": 2},
    ]


def test_multi_element_values_are_refused_naming_the_key_or_the_stat(
    named_bus: EventBus, torch: Any
) -> None:
    """A tensor or array of several elements is a TypeError at the call naming where it went."""
    stat = Stat("loss", [Aggregation.MEAN], timedelta(hours=1), bus=named_bus)
    with pytest.raises(
        TypeError,
        match=r"^v must hold one value, not a torch.Tensor of 2 elements \(Stat 'loss'\)$",
    ):
        stat.add(torch.zeros(2, requires_grad=True))
    with pytest.raises(
        TypeError, match=r"^data\['grad'\] must hold one value, not a torch.Tensor of 0 elements$"
    ):
        Event("e", TS, {"ok": torch.tensor(1.0), "grad": torch.zeros(0)})
    with pytest.raises(
        TypeError, match=r"^data\['c'\] must be a real number, not a complex tensor$"
    ):
        Event("e", TS, {"c": torch.tensor(1 + 2j)})
    assert stat.count == 0


def test_the_graph_of_a_logged_loss_is_freed(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """Logging a loss that requires grad keeps neither its graph nor the tensors it saved."""
    named_bus.register_event_handler(recorder)
    stat = Stat("loss", [Aggregation.MEAN], timedelta(hours=1), bus=named_bus)
    w = torch.ones(4, requires_grad=True)
    hidden = w * 3.0
    loss = (hidden * hidden).sum()  # the graph saves `hidden`
    saved = weakref.ref(hidden)
    stat.add(loss)
    assert named_bus.stats()["device_values"] == 1  # the open window's sample, unread
    named_bus.log_event(Event("step", TS, {"loss": loss}))
    del hidden, loss
    gc.collect()
    assert saved() is None  # the window is still open: its sample holds no graph
    stat._close()
    assert named_bus.flush(10)
    assert [e.data for e in recorder.events] == [{"loss": 36.0}, {"loss.mean": 36.0}]
    assert named_bus.stats()["device_values"] == 0


def test_windows_holding_tensors_close_on_the_timer(
    named_bus: EventBus, recorder: Recorder, torch: Any, clock: StepClock
) -> None:
    """With no add after it, a window of tensor samples is logged by the dispatcher's timer.
    (The Stat clock stands still until the test moves it: all four adds fall in one window.)"""
    named_bus.register_event_handler(recorder)
    stat = Stat(
        "t", [Aggregation.COUNT, Aggregation.SUM], timedelta(milliseconds=50), bus=named_bus
    )
    for v in range(1, 5):
        stat.add(torch.tensor(float(v)))
    assert step_until_logged(clock, recorder)
    assert recorder.events[0].data == {"t.count": 4, "t.sum": 10.0}


def test_numpy_values_are_taken_at_the_call() -> None:
    """A numpy one-element array changed in place after the call is logged as it was."""
    with EventBus() as bus:
        seen: list[Event] = []
        bus.register_event_handler(seen.append)
        stat = Stat("n", [Aggregation.SUM], timedelta(hours=1), bus=bus)
        arr = np.array([1.5])
        stat.add(arr)
        event = Event("e", TS, {"a": arr, "i": np.int16(3), "b": np.bool_(True)})
        arr[0] = 100.0
        bus.log_event(event)
        stat._close()
        assert bus.flush(10)
    assert [e.data for e in seen] == [{"a": 1.5, "i": 3, "b": True}, {"n.sum": 1.5}]
    assert [type(v) for v in seen[0].data.values()] == [float, int, bool]


class HostDlpack:
    """A one-element array in host memory known only through the DLPack protocol."""

    def __init__(self, value: float) -> None:
        self.array = np.array([value])

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    ndim = 1

    @property
    def size(self) -> int:
        return 1

    def item(self) -> float:
        return float(self.array[0])


class DeviceArray:
    """An array a library keeps on an accelerator (as CuPy does): DLPack device 2 (CUDA),
    a device-side ``copy()``, and an ``item()`` that records the thread of each read."""

    reads: list[str] = []

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    ndim = 1

    @property
    def size(self) -> int:
        return len(self.values)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("device memory")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def copy(self) -> DeviceArray:
        return DeviceArray(self.values)

    def item(self) -> float:
        DeviceArray.reads.append(threading.current_thread().name)
        return self.values[0]


class OnlyDlpack:
    """A host array known only through ``__dlpack__`` (no ``ndim``, no ``item``)."""

    def __init__(self, value: int) -> None:
        self.array = np.array([value], dtype=np.int64)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class OnlyArray:
    """A value known only through ``__array__``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return np.array([[self.value]], dtype=dtype)


def test_protocol_only_objects_are_taken_through_numpy(
    named_bus: EventBus, recorder: Recorder
) -> None:
    """Objects with only ``__dlpack__`` or only ``__array__`` give the value they hold; more
    than one element is refused naming the key."""
    named_bus.register_event_handler(recorder)
    stat = Stat("p", [Aggregation.SUM], timedelta(hours=1), bus=named_bus)
    stat.add(OnlyDlpack(4))
    stat.add(OnlyArray(0.5))
    named_bus.log_event(Event("e", TS, {"d": OnlyDlpack(3), "a": OnlyArray(1.25)}))
    with pytest.raises(
        TypeError, match=r"^data\['a'\] must hold one value, not a numpy.ndarray of 2 elements$"
    ):
        Event("e", TS, {"a": _Two()})
    stat._close()
    assert named_bus.flush(10)
    assert [e.data for e in recorder.events] == [{"d": 3, "a": 1.25}, {"p.sum": 4.5}]
    assert [type(v) for v in recorder.events[0].data.values()] == [int, float]


class _Two:
    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return np.array([1.0, 2.0], dtype=dtype)


def test_dlpack_objects_on_host_and_on_a_device(named_bus: EventBus, recorder: Recorder) -> None:
    """A host DLPack array is taken at the call; a device one is copied at the call and read
    off the caller's thread; either logs the value it held at the call."""
    DeviceArray.reads = []
    named_bus.register_event_handler(recorder)
    stat = Stat("d", [Aggregation.SUM, Aggregation.COUNT], timedelta(hours=1), bus=named_bus)
    host = HostDlpack(2.5)
    device = DeviceArray([4.0])
    stat.add(host)
    stat.add(device)
    named_bus.log_event(Event("e", TS, {"h": host, "d": device}))
    host.array[0] = -1.0
    device.values[0] = -1.0
    assert DeviceArray.reads == []
    with pytest.raises(
        TypeError, match=r"^data\['d'\] must hold one value, not a .*DeviceArray of 2 elements$"
    ):
        Event("e", TS, {"d": DeviceArray([1.0, 2.0])})
    stat._close()
    assert named_bus.flush(10)
    assert [e.data for e in recorder.events] == [
        {"h": 2.5, "d": 4.0},
        {"d.sum": 6.5, "d.count": 2},
    ]
    assert len(DeviceArray.reads) == 2
    assert all(name != threading.current_thread().name for name in DeviceArray.reads)


class SlowMark:
    """A stream event whose copy finishes when the test says so."""

    def __init__(self, done: threading.Event, waiting: threading.Event) -> None:
        self.done = done
        self.waiting = waiting
        self.waited_on: list[str] = []

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited_on.append(threading.current_thread().name)
        self.waiting.set()
        self.done.wait()


def test_a_device_not_done_is_waited_for_off_the_loop(
    named_bus: EventBus, recorder: Recorder, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values whose device is not done hold their event and the ones after it, in order,
    while the loop stays free; the wait happens on a worker thread of the loop."""
    done, waiting = threading.Event(), threading.Event()
    marks: list[SlowMark] = []

    def slow_mark(tensor: Any, torch: Any) -> SlowMark:
        marks.append(SlowMark(done, waiting))
        return marks[-1]

    named_bus.register_event_handler(recorder)
    named_bus.log_event(Event("before", TS, {"x": 1}))
    assert named_bus.flush(10)
    monkeypatch.setattr(_device, "_mark_copy", slow_mark)
    named_bus.log_event(Event("loss", TS, {"loss": torch.tensor(0.5)}))
    named_bus.log_event(Event("after", TS, {"x": 2}))
    assert waiting.wait(10)
    assert named_bus._dispatcher.in_loop(lambda: "loop answers", timeout=10) == "loop answers"
    assert [e.name for e in recorder.events] == ["before"]
    assert (named_bus.stats()["queued"], named_bus.stats()["device_values"]) == (2, 1)
    done.set()
    assert recorder.wait_for(3)
    assert [(e.name, e.data) for e in recorder.events] == [
        ("before", {"x": 1}),
        ("loss", {"loss": 0.5}),
        ("after", {"x": 2}),
    ]
    assert marks[0].waited_on == ["AnyIO worker thread"]


def _child_logs_tensors() -> None:
    import torch

    import monitor_bus as monitor

    stat = monitor.Stat("w", [Aggregation.SUM, Aggregation.COUNT], timedelta(hours=1))
    stat.add(torch.tensor(2.0))
    stat.add(3.0)
    stat.add(torch.tensor(4))
    monitor.log_event(Event("c", TS, {"t": torch.tensor(7), "b": torch.tensor(True)}))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_processes_send_their_tensors_values(method: str, torch: Any) -> None:
    """A child's tensor events and windows reach the parent's handlers as plain values."""
    import multiprocessing

    import monitor_bus as monitor

    seen: list[Event] = []
    monitor.register_event_handler(seen.append)
    child = multiprocessing.get_context(method).Process(target=_child_logs_tensors)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert monitor.flush(10)
    assert [(e.name, e.data, e.origin.pid if e.origin else None) for e in seen] == [
        ("c", {"t": 7, "b": True}, child.pid),
        (STAT_EVENT, {"w.sum": 9.0, "w.count": 3}, child.pid),
    ]
    assert [type(v) for v in seen[0].data.values()] == [int, bool]


class BrokenDeviceArray(DeviceArray):
    """A device array whose read fails (a device error)."""

    def copy(self) -> BrokenDeviceArray:
        return BrokenDeviceArray(self.values)

    def item(self) -> float:
        raise RuntimeError("device lost")


def test_a_value_that_cannot_be_read_drops_its_event_counted_and_reported(
    named_bus: EventBus, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """An event whose device value fails to read is dropped, counted and logged once (not as
    a full queue); the events around it are delivered without waiting for a flush."""
    named_bus.register_event_handler(recorder, name="rec")
    with caplog.at_level("WARNING", logger="monitor_bus"):
        named_bus.log_event(Event("a", TS, {"x": 1}))
        named_bus.log_event(Event("broken", TS, {"x": BrokenDeviceArray([1.0])}))
        named_bus.log_event(Event("b", TS, {"x": 2}))
        assert recorder.wait_for(2)  # the distributor alone gets past the broken value
        named_bus.log_event(Event("c", TS, {"x": 3}))
        assert named_bus.flush(10)
    assert [e.name for e in recorder.events] == ["a", "b", "c"]
    stats = named_bus.stats()
    [handler] = stats["handlers"]
    assert (stats["logged"], stats["dropped"], stats["dispatcher_restarts"]) == (4, 1, 0)
    assert (handler["logged"], handler["delivered"], handler["dropped"]) == (4, 3, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "EventBus 'dev': 1 events dropped: a device value could not be read "
        "(event 'broken': RuntimeError('device lost'))"
    ]


def test_an_open_window_reads_its_device_values_as_they_pile_up(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """Past 4,096 unread samples, the dispatcher reads an open window's device values, so
    they do not all wait for the window's end; the window's aggregates stay exact."""
    named_bus.register_event_handler(recorder)
    stat = Stat(
        "m",
        [Aggregation.SUM, Aggregation.COUNT, Aggregation.MAX],
        timedelta(hours=1),
        bus=named_bus,
    )
    for i in range(5000):
        stat.add(torch.tensor(float(i)))
    # The loop has run what the adds asked of it.
    named_bus._dispatcher.in_loop(lambda: None, timeout=10)
    # 1 + 4,096 samples were folded and read on the loop; the last 903 wait in the buffer.
    assert (len(stat._pending), named_bus.stats()["device_values"]) == (0, 903)
    stat._close()
    assert named_bus.flush(10)
    assert stat_data(recorder.events) == [{"m.sum": 12497500.0, "m.count": 5000, "m.max": 4999.0}]


def test_value_read_early_is_logged_as_a_float(
    named_bus: EventBus, recorder: Recorder, torch: Any
) -> None:
    """A window whose samples were all read early (the last one too) logs VALUE as a float."""
    named_bus.register_event_handler(recorder)
    stat = Stat("v", [Aggregation.VALUE, Aggregation.COUNT], timedelta(hours=1), bus=named_bus)
    for i in range(4097):  # the 4,097th add folds, and the loop reads every sample
        stat.add(torch.tensor(float(i)))
    named_bus._dispatcher.in_loop(lambda: None, timeout=10)
    assert (len(stat._buf), len(stat._pending)) == (0, 0)
    stat._close()
    assert named_bus.flush(10)
    [data] = stat_data(recorder.events)
    assert data == {"v.value": 4096.0, "v.count": 4097}
    assert type(data["v.value"]) is float


def test_a_flush_while_the_device_is_awaited_delivers_each_value_once(
    named_bus: EventBus, recorder: Recorder, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush that comes while the distributor waits for the device on a worker thread waits
    too; when the device is done, both read the same values and every event arrives once."""
    done, waiting = threading.Event(), threading.Event()
    monkeypatch.setattr(_device, "_mark_copy", lambda tensor, torch: SlowMark(done, waiting))
    named_bus.register_event_handler(recorder)
    for i in range(50):
        named_bus.log_event(Event("loss", TS, {"loss": torch.tensor(float(i))}))
    assert waiting.wait(10)  # the worker thread waits for the first value's device
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(named_bus.flush(30)))
    flusher.start()
    done.set()
    flusher.join(30)
    assert flushed == [True]
    assert [e.data["loss"] for e in recorder.events] == [float(i) for i in range(50)]
    stats = named_bus.stats()
    assert (stats["dropped"], stats["handler_dropped"], stats["device_values"]) == (0, 0, 0)


def test_a_window_of_tensors_is_never_evicted(torch: Any) -> None:
    """Under drop_oldest, a queued window whose samples are not read yet is kept like any
    Stat window; the oldest plain events make room instead."""
    entered, gate = threading.Event(), threading.Event()
    seen: list[Event] = []

    async def blocking(event: Event) -> None:
        seen.append(event)
        if event.name == "first":
            entered.set()
            gate.wait(30)  # holds the loop: the queue fills behind it

    with EventBus(capacity=4, overflow="drop_oldest", name="evict") as bus:
        bus.register_event_handler(blocking)
        bus.log_event(Event("first", TS, {}))
        assert entered.wait(10)
        stat = Stat("loss", [Aggregation.SUM], timedelta(hours=1), bus=bus)
        stat.add(torch.tensor(1.5))
        stat._close()
        for i in range(5):
            bus.log_event(Event("plain", TS, {"i": i}))
        gate.set()
        assert bus.flush(10)
        assert [(e.name, e.data) for e in seen] == [
            ("first", {}),
            (STAT_EVENT, {"loss.sum": 1.5}),
            ("plain", {"i": 2}),
            ("plain", {"i": 3}),
            ("plain", {"i": 4}),
        ]
        assert bus.stats()["dropped"] == 2


def test_get_reports_a_window_of_tensors_with_no_handler(torch: Any) -> None:
    """With no handler to log it, a closed window of tensor samples still reaches get() (read
    there, as asked), and a later window of floats replaces it."""
    with EventBus(name="quiet") as bus:
        stat = Stat("x", [Aggregation.SUM, Aggregation.COUNT], timedelta(hours=1), bus=bus)
        stat.add(torch.tensor(2.0))
        stat.add(0.5)
        stat._close()
        assert stat.get() == {Aggregation.SUM: 2.5, Aggregation.COUNT: 2}
        stat.add(torch.tensor(4.0))
        stat._close()
        stat.add(1.0)
        stat._close()  # a window of floats after one of tensors nobody read
        assert stat.get() == {Aggregation.SUM: 1.0, Aggregation.COUNT: 1}


def test_the_callers_own_event_reads_its_placeholder_on_demand(torch: Any) -> None:
    """The caller's Event holds a placeholder that compares, converts and formats as the
    value it captured."""
    loss = torch.tensor(0.125)
    event = Event("e", TS, {"loss": loss, "n": torch.tensor(3)})
    loss.fill_(9.0)
    v, n = event.data["loss"], event.data["n"]
    assert (v == 0.125, float(v), int(n), bool(n), f"{v:.2f}", repr(v)) == (
        True,
        0.125,
        3,
        True,
        "0.12",
        "0.125",
    )


def _child_logs_an_unreadable_value(out: Any) -> None:
    import monitor_bus as monitor

    monitor.log_event(Event("broken", TS, {"x": BrokenDeviceArray([1.0])}))
    stat = monitor.Stat("w", [Aggregation.SUM], timedelta(hours=1))
    stat.add(BrokenDeviceArray([2.0]))
    stat._close()
    monitor.log_event(Event("fine", TS, {"x": 1}))
    out.put(monitor.get_default_bus().stats()["dropped"])


def test_a_child_whose_value_cannot_be_read_counts_it_and_goes_on() -> None:
    """In a child that sends to its parent, a value that fails to read as it is sent drops
    that event or window, counted in the child, and never raises into its caller."""
    import multiprocessing

    import monitor_bus as monitor

    seen: list[Event] = []
    monitor.register_event_handler(seen.append)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_logs_an_unreadable_value, args=(out,))
    child.start()
    dropped = out.get(timeout=60)
    child.join(60)
    assert (child.exitcode, dropped) == (0, 2)
    assert monitor.flush(10)
    assert [(e.name, e.data) for e in seen] == [("fine", {"x": 1})]
