"""``log(name, **data)``: the cheap way in gives handlers the events ``Event`` + ``log_event``
would, from this process and from a forked child through the relay."""

from __future__ import annotations

import importlib.util
import multiprocessing
import pickle
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

import monitor_bus
from monitor_bus import (
    Event,
    EventBus,
    EventOrigin,
    JsonlEventHandler,
    _bus,
    read_jsonl,
)

from . import child_workers
from .conftest import Recorder, local_zone, require

# A time.time() value with a fraction that rounds to whole microseconds as datetime does.
NOW = 1767225600.123456


class SubStr(str):
    pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> float:
    """``log`` (the bus's, and the module's through it) reads the wall clock as ``NOW``."""
    monkeypatch.setattr(_bus, "_now", lambda: NOW)
    return NOW


def cases() -> list[tuple[str, dict[str, object]]]:
    """Events as callers log them: plain values, big ints, NaN, numpy scalars and arrays, a
    str subclass as name (keys are keyword names:
    Python makes them ``str``)."""
    return [
        ("train.step", {"loss": 0.25, "lr": 1e-3, "step": 7, "ok": True, "tag": "a"}),
        ("big", {"n": 2**80, "neg": -(2**70), "nan": float("nan"), "inf": float("inf")}),
        ("numpy", {"f": np.float32(0.5), "i": np.int64(3), "b": np.bool_(True)}),
        ("arrays", {"one": np.array([2.5]), "two": np.array([True])}),
        (SubStr("sub"), {"key": 1}),
        ("empty", {}),
        ("name", {"name": "a key named name", "self": 1}),
    ]


def same(a: list[Event], b: list[Event]) -> None:
    """Equal events, NaN included, with the same value types (a bool stays a bool)."""
    assert [(e.name, e.timestamp, e.origin) for e in a] == [
        (e.name, e.timestamp, e.origin) for e in b
    ]
    assert [repr(e.data) for e in a] == [repr(e.data) for e in b]
    assert [[type(v) for v in e.data.values()] for e in a] == [
        [type(v) for v in e.data.values()] for e in b
    ]
    assert {type(e.name) for e in a} == {str}
    assert {type(k) for e in a for k in e.data} <= {str}


def logged_both_ways(
    clock: float, events: list[tuple[str, dict[str, object]]]
) -> tuple[list[Event], list[Event]]:
    """What a handler gets from ``bus.log(name, **data)`` and from
    ``bus.log_event(Event(name, datetime.fromtimestamp(now), data))``, for each of ``events``."""
    fast, slow = Recorder(), Recorder()
    with EventBus(name="fast") as a, EventBus(name="slow") as b:
        a.register_event_handler(fast)
        b.register_event_handler(slow)
        for name, data in events:
            a.log(name, **data)  # type: ignore[arg-type]
            b.log_event(Event(name, datetime.fromtimestamp(clock), dict(data)))  # type: ignore[arg-type]
        assert a.flush(10)
        assert b.flush(10)
    return fast.events, slow.events


def test_bus_log_delivers_what_event_and_log_event_deliver(clock: float) -> None:
    """For each kind of value, ``bus.log(name, **data)`` hands every handler the event that
    ``bus.log_event(Event(name, datetime.fromtimestamp(now), data))`` hands it."""
    fast, slow = logged_both_ways(clock, cases())
    assert len(fast) == len(cases())
    same(fast, slow)
    stamp = fast[0].timestamp
    assert (stamp.tzinfo, stamp.microsecond) == (None, 123456)


def test_a_tensor_is_read_on_the_bus_side(clock: float) -> None:
    """A torch tensor logged with ``log`` reaches handlers as the Python value it held, as
    with ``Event``."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch

    fast, slow = logged_both_ways(clock, [("t", {"t": torch.tensor(4.0), "i": torch.tensor(3)})])
    same(fast, slow)
    assert fast[0].data == {"t": 4.0, "i": 3}


def test_module_log_uses_the_default_bus(clock: float, recorder: Recorder) -> None:
    """``monitor_bus.log`` queues on the default bus, as ``monitor_bus.log_event`` does."""
    monitor_bus.register_event_handler(recorder)
    monitor_bus.log("train.step", loss=0.5, step=np.int64(2))
    assert monitor_bus.flush(10)
    assert recorder.events == [
        Event("train.step", datetime.fromtimestamp(clock), {"loss": 0.5, "step": 2})
    ]


def test_the_timestamp_is_now_in_local_time(recorder: Recorder) -> None:
    """Without the seam, the timestamp is the naive local time of the call, as
    ``datetime.now()`` gives it."""
    with EventBus() as bus:
        bus.register_event_handler(recorder)
        before = datetime.now()
        bus.log("e")
        after = datetime.now()
        assert bus.flush(10)
    (event,) = recorder.events
    assert event.timestamp.tzinfo is None
    assert before <= event.timestamp <= after


def test_jsonl_reads_back_what_log_wrote(clock: float, tmp_path: Path) -> None:
    """The JSONL sink writes the float timestamp as the local time it stands for: the file
    reads back equal (a naive timestamp as its local time, as for ``log_event``)."""
    path = tmp_path / "e.jsonl"
    with EventBus() as bus, JsonlEventHandler(path) as sink:
        bus.register_event_handler(sink)
        bus.log("train.step", loss=0.5, n=2**70)
        assert bus.flush(10)
    assert list(read_jsonl(path)) == [
        Event("train.step", datetime.fromtimestamp(clock).astimezone(), {"loss": 0.5, "n": 2**70})
    ]


def test_the_datetime_is_made_when_the_timestamp_is_first_read(clock: float) -> None:
    """An event from ``log`` reaches a handler holding the float; its first read of
    ``timestamp`` makes the datetime (once), equal to what ``log_event`` would have given."""
    recorder = Recorder()
    with EventBus() as bus:
        bus.register_event_handler(recorder)
        bus.log("e", x=1)
        assert bus.flush(10)
    (event,) = recorder.events
    assert event._timestamp.__class__ is float
    assert event == Event("e", datetime.fromtimestamp(clock), {"x": 1})
    assert event.timestamp == datetime.fromtimestamp(clock)
    assert event._timestamp is event.timestamp  # made once


def test_a_pickled_event_keeps_the_time_of_the_zone_it_was_logged_in(clock: float) -> None:
    """Pickling makes the datetime where the event was logged: unpickled under another local
    zone, it is the same naive local time, not the float read again there."""
    recorder = Recorder()
    with local_zone("Europe/Berlin"):
        with EventBus() as bus:
            bus.register_event_handler(recorder)
            bus.log("e", x=1)
            assert bus.flush(10)
        (event,) = recorder.events
        body = pickle.dumps(event)
        berlin = datetime.fromtimestamp(clock)
    with local_zone("America/St_Johns"):
        back = pickle.loads(body)
        assert back.timestamp == berlin
        assert back.timestamp != datetime.fromtimestamp(clock)
    assert (back.name, back.data, back.origin) == ("e", {"x": 1}, None)


@pytest.mark.parametrize("where", ["bus", "module", "module without a bus"])
def test_bad_input_raises_what_event_raises_naming_the_argument(where: str) -> None:
    """A name that is no str, or a value of no accepted type, raises the TypeError ``Event``
    raises, naming the argument or the key; with no handler too (checked all the same)."""
    bus = EventBus()
    if where == "module":
        monitor_bus.get_default_bus()
    log = bus.log if where == "bus" else monitor_bus.log
    with pytest.raises(TypeError, match=r"^name must be a str, not int$"):
        log(3)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^data\['bad'\] must be str, int, float or bool, not list$"
    ):
        log("e", ok=1, bad=[1])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^data\['bad'\] must be str, int, float or bool, not list$"
    ):
        Event("e", datetime.now(), {"ok": 1, "bad": [1]})  # type: ignore[dict-item]
    bus.close()


@pytest.mark.parametrize("where", ["bus", "module", "module without a bus"])
def test_an_empty_name_is_a_value_error_naming_the_argument(where: str) -> None:
    """``log("")`` raises a ValueError naming ``name``, with no handler too; ``Event("")``
    stays accepted, as torch.monitor accepts it."""
    bus = EventBus()
    seen: list[Event] = []
    if where == "bus":
        bus.register_event_handler(seen.append)
    elif where == "module":
        monitor_bus.register_event_handler(seen.append)
    log = bus.log if where == "bus" else monitor_bus.log
    with pytest.raises(ValueError, match=r"^name must not be empty$"):
        log("", x=1)
    assert Event("", datetime.now(), {}).name == ""
    assert bus.close(10)
    monitor_bus.flush(10)
    assert seen == []


def test_a_forked_child_logs_through_the_relay(clock: float, recorder: Recorder) -> None:
    """A forked child's ``monitor_bus.log`` reaches the parent's handler with the timestamp
    it would have had in the child and the child's pid as its origin."""
    monitor_bus.register_event_handler(recorder)
    proc = multiprocessing.get_context("fork").Process(target=child_workers.log_fast, args=(3,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert monitor_bus.flush(10)
    want = [
        Event("fast", datetime.fromtimestamp(clock), {"i": i, "loss": 0.5, "tag": "child"})
        for i in range(3)
    ]
    for event in want:
        event._origin = EventOrigin(proc.pid, None)  # type: ignore[arg-type]
    assert recorder.events == want
