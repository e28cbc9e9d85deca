"""Property tests: Stat against a reference model, Event against random data, names in sinks."""

from __future__ import annotations

import math
import operator
import tempfile
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction
from functools import reduce
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import monitor_bus
from monitor_bus import STAT_EVENT, Aggregation, Event, EventBus, Stat, _stat

from .conftest import Figures

ALL = list(Aggregation)[:6]  # torch.monitor's six (the distributions: test_stat_distributions)
SPECIAL = [
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    1e-300,
    1e300,
    math.nan,
    math.inf,
    -math.inf,
]
reals = st.one_of(
    st.floats(),  # NaN, infinities, subnormals and negative zero included
    st.sampled_from(SPECIAL),
    st.integers(-(2**1023), 2**1023),
    st.booleans(),
    st.fractions(max_denominator=10**6),
)
bad = st.one_of(
    st.text(max_size=3),
    st.none(),
    st.complex_numbers(),
    st.binary(max_size=3),
    st.just(10**400),
    st.just(Fraction(10**400)),
    st.lists(st.integers(), max_size=2),
)


def tally(figures: Figures, **counts: int) -> None:
    """Add to the counts a property test reports: hypothesis calls it once per example."""
    for key, n in counts.items():
        figures.outcome[key] = figures.outcome.get(key, 0) + n


def same(a: float | int, b: float | int) -> bool:
    """Equal as floats, NaN equal to NaN, and 0.0 told from -0.0."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def reference(values: list[float]) -> dict[Aggregation, float | int]:
    """The documented semantics, in plain Python: SUM in add order; MEAN the exact mean where
    that sum overflowed from finite samples (see ``mean_matches``); MAX and MIN NaN if any
    sample is."""
    total = reduce(operator.add, values, 0.0)
    nan = any(map(math.isnan, values))
    overflowed = math.isinf(total) and all(map(math.isfinite, values))
    return {
        Aggregation.VALUE: values[-1],
        Aggregation.MEAN: exact_mean(values) if overflowed else total / len(values),
        Aggregation.COUNT: len(values),
        Aggregation.SUM: total,
        Aggregation.MAX: math.nan if nan else max(values),
        Aggregation.MIN: math.nan if nan else min(values),
    }


def exact_mean(values: list[float]) -> float:
    return float(sum(map(Fraction, values)) / len(values))


def mean_matches(got: float | int, values: list[float]) -> bool:
    """MEAN of a window whose sum overflowed: the samples summed before the overflow are
    rounded in add order, so within one ulp of the largest sample per sample of the mean."""
    if not isinstance(got, float) or not math.isfinite(got):
        return False
    largest = max(map(abs, values))
    return abs(got - exact_mean(values)) <= len(values) * math.ulp(largest)


class StepClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    inputs=st.lists(st.one_of(reals, bad), min_size=1, max_size=60),
    repeat=st.sampled_from([1, 1, 80]),
)
def test_stat_matches_reference_model(figures: Figures, inputs: list[Any], repeat: int) -> None:
    """Each aggregate of a window equals the reference model for any real values (negative
    zero, huge, tiny, NaN, inf; folded across 4096-sample chunks when repeated), and a bad
    value raises TypeError without touching the window."""
    figures.describe(
        load="hypothesis: one window per example, up to 60 values, repeated 80 times in some "
        "examples (folded across 4096-sample chunks); stepped clock",
        bad_inputs="NaN, +-inf, -0.0, subnormals, 1e308, ints up to 2**1023, Fractions, bools "
        "as values; str, bytes, complex, None, lists, 10**400 and Fraction(10**400) refused",
    )
    inputs = inputs * repeat
    clock = StepClock()
    accepted: list[float] = []
    events: list[Event] = []
    with pytest.MonkeyPatch.context() as mp, EventBus(name="prop") as bus:
        mp.setattr(_stat, "_clock", clock)
        bus.register_event_handler(events.append)
        stat = Stat("p", ALL, timedelta(seconds=10), bus=bus)
        for v in inputs:
            try:
                stat.add(v)
            except TypeError:
                continue
            accepted.append(float(v))
        assert stat.count == len(accepted)
        tally(
            figures,
            windows=1,
            values_added=len(accepted),
            values_refused=len(inputs) - len(accepted),
        )
        clock.now += 10.0
        got = stat.get()
        assert bus.flush(timeout=10)
    if not accepted:
        assert got == {}
        assert events == []
        return
    want = reference(accepted)
    assert set(got) == set(ALL)
    overflowed = math.isinf(want[Aggregation.SUM]) and all(map(math.isfinite, accepted))
    (event,) = events
    assert event.name == STAT_EVENT
    for agg in ALL:
        logged = event.data[f"p.{agg.name.lower()}"]
        if agg is Aggregation.MEAN and overflowed:
            assert mean_matches(got[agg], accepted), (got[agg], exact_mean(accepted))
            assert same(logged, got[agg])
        else:
            assert same(got[agg], want[agg]), (agg, got[agg], want[agg])
            assert same(logged, want[agg])


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.complex_numbers(),
    st.fractions(),
    st.decimals(),
    st.just(Fraction(10**400)),
    st.just(Decimal("sNaN")),
    st.just(Decimal("1e400")),
)
nested = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), children, max_size=3),
    ),
    max_leaves=10,
)
flat = st.dictionaries(st.text(max_size=8), scalars, max_size=4)
mappings = st.dictionaries(
    st.one_of(st.text(max_size=8), st.integers(), st.none()), nested, max_size=5
)


def _check_event(name: Any, stamp: Any, data: Any) -> bool:
    """Check one Event construction; return whether it built an event (else: TypeError)."""
    before = repr(data)
    try:
        event = Event(name, stamp, data)
    except TypeError:
        assert repr(data) == before
        return False
    assert type(event.name) is str
    assert event.name == name
    assert event.timestamp is stamp
    assert repr(data) == before
    assert event.data is not data
    assert all(type(k) is str for k in event.data)
    assert all(type(v) in (str, int, float, bool) for v in event.data.values())
    assert len(event.data) == len(data)
    return True


EVENT_BAD_INPUTS = (
    "nested lists/dicts/tuples, bytes, complex, None, Fraction(10**400), Decimal sNaN and "
    "1e400, non-str keys"
)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.one_of(flat, flat, mappings, nested))
def test_event_data_accepts_or_raises_type_error(figures: Figures, data: Any) -> None:
    """Event(name, timestamp, data) with random nested data either builds an event of plain
    str keys and str/int/float/bool values, leaving the input untouched, or raises TypeError;
    never any other exception."""
    figures.describe(load="hypothesis: random event data", bad_inputs=EVENT_BAD_INPUTS)
    built = _check_event("e", datetime.now(timezone.utc), data)
    tally(figures, events_built=built, refused_with_type_error=not built)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.one_of(st.text(max_size=10), st.integers(), st.none(), st.binary(max_size=3)),
    stamp=st.one_of(st.datetimes(), st.floats(), st.none(), st.text(max_size=3)),
    data=st.one_of(mappings, nested),
)
def test_event_arguments_accept_or_raise_type_error(
    figures: Figures, name: Any, stamp: Any, data: Any
) -> None:
    """Random names, timestamps and data: an Event or a TypeError, never anything else."""
    figures.describe(
        load="hypothesis: random event names, timestamps and data",
        bad_inputs=f"int/None/bytes names; float/None/str timestamps; {EVENT_BAD_INPUTS}",
    )
    built = _check_event(name, stamp, data)
    tally(figures, events_built=built, refused_with_type_error=not built)


names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12
) | st.sampled_from(
    ["\x00", "a\nb", "\t\r\x1b[31m", "\u2028\u2029", "é/ü", "🚀.loss", "\ufeff", "\x7f"]
)


def _read_tensorboard(log_dir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [s.value for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(name=names)
def test_names_survive_every_bundled_sink(figures: Figures, name: str) -> None:
    """A name with unicode and control characters comes back unchanged from every bundled
    sink: a plain handler, JsonlEventHandler/read_jsonl, a subscription, and TensorBoard
    (TensorboardEventHandler on monitor_bus.tensorboard.SummaryWriter, read by tensorboard)."""
    from monitor_bus.tensorboard import SummaryWriter

    figures.describe(
        load="hypothesis: an event and a Stat window per name, through a plain handler, "
        "JSONL, a subscription and TensorBoard",
        bad_inputs="names with control characters, NUL, BOM, line separators, emoji",
    )

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(_stat, "_clock", clock)
        jsonl = Path(tmp) / "events.jsonl"
        writer = SummaryWriter(str(Path(tmp) / "tb"))
        seen: list[Event] = []
        subscribed: list[Event] = []
        with EventBus(name="names") as bus, monitor_bus.JsonlEventHandler(jsonl) as sink:
            bus.register_event_handler(seen.append, name=name)
            bus.register_event_handler(sink, name=name + "/jsonl")
            bus.register_event_handler(
                monitor_bus.TensorboardEventHandler(writer), name=name + "/tb"
            )
            stat = Stat(name, [Aggregation.SUM], timedelta(seconds=1), bus=bus)

            async def consume() -> None:
                async with bus.subscribe(name) as events:
                    bus.log_event(Event(name, datetime.now(timezone.utc), {name: 1.5}))
                    stat.add(2.0)
                    clock.now += 1.0
                    stat.get()
                    async for event in events:
                        subscribed.append(event)
                        if len(subscribed) == 1:
                            break

            anyio.run(consume)
            assert bus.flush(timeout=10)
            handlers = {h["name"] for h in bus.stats()["handlers"]}
            assert {name, name + "/jsonl", name + "/tb"} <= handlers
        writer.close()
        expected = [(name, {name: 1.5}), (STAT_EVENT, {f"{name}.sum": 2.0})]
        assert [(e.name, e.data) for e in seen] == expected
        assert [(e.name, e.data) for e in monitor_bus.read_jsonl(jsonl)] == expected
        assert [(e.name, e.data) for e in subscribed] == expected[:1]
        assert _read_tensorboard(str(Path(tmp) / "tb")) == {f"{name}.sum": [2.0]}
    tally(figures, names_checked=1)
