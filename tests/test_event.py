"""Event construction, validation, copying, equality."""

from __future__ import annotations

import copy
import importlib.util
import pickle
from collections import OrderedDict
from datetime import datetime, timedelta, timezone
from enum import IntEnum

import numpy as np
import pytest

from monitor_bus import Event, EventBus, Stat

from .conftest import require

TS = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_fields_and_types_are_kept() -> None:
    """str, int, float and bool values come back with their own types; a bool stays a bool."""
    e = Event("n", TS, {"s": "x", "i": 3, "f": 1.5, "b": True})
    assert (e.name, e.timestamp) == ("n", TS)
    assert e.data == {"s": "x", "i": 3, "f": 1.5, "b": True}
    assert [type(v) for v in e.data.values()] == [str, int, float, bool]


def test_data_is_copied() -> None:
    """The caller may reuse its dict after constructing the event."""
    data = {"a": 1}
    e = Event("n", TS, data)
    data["a"] = 2
    data["b"] = 3
    assert e.data == {"a": 1}


def test_numpy_scalars_are_converted() -> None:
    """numpy ints become int, floats become float, bools stay bool."""
    e = Event("n", TS, {"i": np.int64(7), "f": np.float32(0.5), "b": np.bool_(True)})
    assert e.data == {"i": 7, "f": 0.5, "b": True}
    assert [type(v) for v in e.data.values()] == [int, float, bool]


def test_subclasses_are_normalized() -> None:
    """IntEnum members and str subclasses are stored as plain int and str; mappings are accepted."""

    class Color(IntEnum):
        RED = 1

    class Name(str):
        pass

    e = Event("n", TS, OrderedDict([(Name("k"), Color.RED)]))
    assert e.data == {"k": 1}
    assert type(next(iter(e.data))) is str
    assert type(e.data["k"]) is int


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (None, "NoneType"),
        ([1], "list"),
        ({"x": 1}, "dict"),
        (b"x", "bytes"),
        (1j, "complex"),
    ],
)
def test_bad_value_names_the_key_and_type(value: object, type_name: str) -> None:
    """A value that is not a plain scalar is a TypeError naming the key and the type."""
    with pytest.raises(
        TypeError, match=rf"data\['bad'\] must be str, int, float or bool, not {type_name}"
    ):
        Event("n", TS, {"ok": 1, "bad": value})


def test_bad_arguments() -> None:
    """A non-str name, a non-datetime timestamp, a non-mapping data or a non-str key is a TypeError naming it."""
    with pytest.raises(TypeError, match="name must be a str"):
        Event(1, TS, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timestamp must be a datetime"):
        Event("n", 0, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data must be a mapping"):
        Event("n", TS, [("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data keys must be str"):
        Event("n", TS, {1: 1})  # type: ignore[dict-item]


def test_equality_and_repr() -> None:
    """Events compare by name, timestamp and data, and have a readable repr."""
    a = Event("n", TS, {"x": 1})
    assert a == Event("n", TS, {"x": 1})
    assert a != Event("n", TS, {"x": 2})
    assert a != Event("m", TS, {"x": 1})
    assert a != Event("n", datetime(2026, 1, 1, tzinfo=timezone.utc), {"x": 1})
    assert a != "n"
    assert repr(a) == (
        "Event(name='n', timestamp=datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc), "
        "data={'x': 1})"
    )


def test_one_element_arrays_and_numpy_scalars_become_python_values() -> None:
    """One-element numpy arrays are accepted like numpy scalars; a bool stays a bool."""
    data = {
        "f": np.array([1.5]),
        "i": np.array([[3]]),
        "b": np.array([True]),
        "f32": np.float32(0.5),
        "b_": np.bool_(False),
    }
    e = Event("n", TS, data)
    assert e.data == {"f": 1.5, "i": 3, "b": True, "f32": 0.5, "b_": False}
    assert [type(v) for v in e.data.values()] == [float, int, bool, float, bool]


def test_arrays_of_more_than_one_element_name_the_key() -> None:
    """An array of several elements is a TypeError naming the key and the size."""
    with pytest.raises(
        TypeError, match=r"data\['bad'\] must hold one value, not a numpy.ndarray of 2 elements"
    ):
        Event("n", TS, {"ok": 1, "bad": np.zeros(2)})


def test_torch_values_and_objects() -> None:
    """One-element tensors reach handlers as Python values (a bool tensor a bool), and
    torch.monitor objects get a message naming their module and what to use instead."""
    try:
        import torch
        import torch.monitor
    except ImportError as exc:
        require(False, f"torch is not installed: {exc}")
    e = Event("n", TS, {"b": torch.tensor(True), "f": torch.tensor([0.5]), "i": torch.tensor(7)})
    seen: list[Event] = []
    with EventBus() as bus:
        bus.register_event_handler(seen.append)
        bus.log_event(e)
        assert bus.flush(10)
    assert seen[0].data == {"b": True, "f": 0.5, "i": 7}
    assert [type(v) for v in seen[0].data.values()] == [bool, float, int]
    assert e.data == {"b": True, "f": 0.5, "i": 7}  # the caller's own event reads on demand
    with pytest.raises(TypeError, match="must hold one value, not a torch.Tensor of 3 elements"):
        Event("n", TS, {"t": torch.zeros(3)})
    hint = "monitor_bus does not take torch.monitor objects; use the monitor_bus ones"
    torch_event = torch.monitor.Event("n", TS, {"x": 1.0})
    with EventBus() as bus:
        bus.register_event_handler(lambda e: None)
        with pytest.raises(
            TypeError, match=f"event must be a monitor_bus.Event, not torch.monitor.Event: {hint}"
        ):
            bus.log_event(torch_event)  # type: ignore[arg-type]
        torch_handle = torch.monitor.register_event_handler(lambda e: None)
        try:
            with pytest.raises(
                TypeError,
                match="handle must be a monitor_bus.EventHandlerHandle, not "
                f"torch.monitor.EventHandlerHandle: {hint}",
            ):
                bus.unregister_event_handler(torch_handle)  # type: ignore[arg-type]
        finally:
            torch.monitor.unregister_event_handler(torch_handle)
        with pytest.raises(
            TypeError,
            match="aggregations must be monitor_bus.Aggregation members, not "
            f"torch.monitor.Aggregation: {hint}",
        ):
            Stat(
                "x",
                [torch.monitor.Aggregation.MEAN],
                window_size=timedelta(seconds=1),
                bus=bus,
            )  # type: ignore[list-item]


class _Tagged(Event):
    """A subclass with a slot of its own, a name-mangled one and an instance dict."""

    __slots__ = ("__secret", "__dict__", "tag")

    def __init__(self, *args: object, tag: str) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.tag = tag
        self.__secret = tag.upper()

    def secret(self) -> str:
        return self.__secret


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_copies_and_pickles_keep_the_subclass_and_its_state(how: str) -> None:
    """A copy or a pickle round trip of an Event subclass is of that subclass, with its own
    slots (a name-mangled one too) and attributes, equal fields and its origin."""
    event = _Tagged("e", datetime(2026, 1, 1), {"x": 1}, tag="t")
    event.note = "n"  # type: ignore[attr-defined]
    copied = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda e: pickle.loads(pickle.dumps(e)),
    }[how](event)
    assert type(copied) is _Tagged
    assert (copied.name, copied.timestamp, copied.data, copied.origin) == (
        "e",
        datetime(2026, 1, 1),
        {"x": 1},
        None,
    )
    assert (copied.tag, copied.secret(), copied.note) == ("t", "T", "n")


def test_an_event_holding_a_device_value_copies_and_pickles() -> None:
    """``copy.copy`` keeps a tensor's deferred value as it is; a pickle reads it."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch

    event = Event("t", datetime(2026, 1, 1), {"v": torch.tensor(1.5)})
    copied = copy.copy(event)
    assert copied.data is event.data
    assert pickle.loads(pickle.dumps(event)).data == {"v": 1.5}
