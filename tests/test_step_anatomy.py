"""StepAnatomy: a step's stages, its wait and its GC pauses as Stats, on injected times, in a
real single-rank DDP model, and in a torchrun job of three ranks with one slow in backward."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from monitor_bus import STAT_EVENT, Aggregation, EventBus
from monitor_bus import _step_anatomy as anatomy_module
from monitor_bus.integrations.torch import StepAnatomy

from .conftest import Recorder, StepClock, require

HOUR = timedelta(hours=1)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def times(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    """The anatomy's clock, standing still until the test moves it."""
    c = StepClock(0.0)
    monkeypatch.setattr(anatomy_module, "_clock", c)
    return c


class Ticks:
    """A clock that moves one second each time it is read, so every time taken is known."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def no_auto_gc() -> Iterator[None]:
    """Only the collections the test makes: an automatic one, which may come at any allocation,
    would add a value to a GC Stat."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def anatomy(clock: StepClock, no_auto_gc: None) -> Iterator[StepAnatomy]:
    """An open anatomy whose Stats' window is an hour of the standing Stat clock, with only the
    collections the test makes."""
    with StepAnatomy(window=HOUR) as a:
        yield a


def windows(a: StepAnatomy, clock: StepClock) -> dict[str, dict[Aggregation, Any]]:
    """Each Stat's aggregates once its open window is over (Stats without a window left out)."""
    clock.now += HOUR.total_seconds()
    return {name: got for name, stat in a.stats.items() if (got := stat.get())}


def test_a_step_s_stages_wait_and_time_outside_the_wait(
    anatomy: StepAnatomy, times: StepClock, clock: StepClock
) -> None:
    """Per step: its time, its wait (collective blocks), each stage's time and time outside the
    wait; a stage's Stats get one value per step, MEAN and MAX over the steps."""
    for scale in (1.0, 2.0):  # two steps, the second twice as long in every part
        times.now = 100.0 * scale
        with anatomy.step():
            for name, length, waits in [
                ("data", 1.0, []),
                ("forward", 2.0, []),
                ("backward", 4.0, [(1.0, 2.0)]),  # a 2 s collective from 1 s in
                ("optimizer", 1.0, []),
            ]:
                with anatomy.stage(name):
                    for start, wait in waits:
                        times.now += start * scale
                        with anatomy.collective():
                            times.now += wait * scale
                        times.now += (length - start - wait) * scale
                    if not waits:
                        times.now += length * scale
            times.now += 0.5 * scale  # between stages
            with anatomy.collective():
                times.now += 0.5 * scale  # a collective outside every stage
    assert windows(anatomy, clock) == {
        "step.time_s": {Aggregation.MEAN: 13.5, Aggregation.MAX: 18.0},
        "step.wait_s": {Aggregation.MEAN: 3.75, Aggregation.MAX: 5.0},
        "step.gc_s": {Aggregation.MEAN: 0.0, Aggregation.MAX: 0.0},
        "step.data.time_s": {Aggregation.MEAN: 1.5, Aggregation.MAX: 2.0},
        "step.data.busy_s": {Aggregation.MEAN: 1.5, Aggregation.MAX: 2.0},
        "step.data.gc_s": {Aggregation.MEAN: 0.0, Aggregation.MAX: 0.0},
        "step.forward.time_s": {Aggregation.MEAN: 3.0, Aggregation.MAX: 4.0},
        "step.forward.busy_s": {Aggregation.MEAN: 3.0, Aggregation.MAX: 4.0},
        "step.forward.gc_s": {Aggregation.MEAN: 0.0, Aggregation.MAX: 0.0},
        "step.backward.time_s": {Aggregation.MEAN: 6.0, Aggregation.MAX: 8.0},
        "step.backward.busy_s": {Aggregation.MEAN: 3.0, Aggregation.MAX: 4.0},
        "step.backward.gc_s": {Aggregation.MEAN: 0.0, Aggregation.MAX: 0.0},
        "step.optimizer.time_s": {Aggregation.MEAN: 1.5, Aggregation.MAX: 2.0},
        "step.optimizer.busy_s": {Aggregation.MEAN: 1.5, Aggregation.MAX: 2.0},
        "step.optimizer.gc_s": {Aggregation.MEAN: 0.0, Aggregation.MAX: 0.0},
    }


def test_a_stage_run_twice_in_a_step_gets_the_step_s_sum(
    anatomy: StepAnatomy, times: StepClock, clock: StepClock
) -> None:
    """Gradient accumulation: two forward blocks in one step make one value, their sum."""
    with anatomy.step():
        for length in (1.0, 3.0):
            with anatomy.stage("forward"):
                times.now += length
            times.now += 10.0
    got = windows(anatomy, clock)
    assert got["step.forward.time_s"] == {Aggregation.MEAN: 4.0, Aggregation.MAX: 4.0}
    assert got["step.time_s"] == {Aggregation.MEAN: 24.0, Aggregation.MAX: 24.0}


def test_overlapping_waits_count_once(
    anatomy: StepAnatomy, times: StepClock, clock: StepClock
) -> None:
    """A collective nested in another adds nothing: the wait is the time they cover."""
    with anatomy.step(), anatomy.stage("backward"):
        times.now += 1.0
        with anatomy.collective():
            times.now += 1.0
            with anatomy.collective():
                times.now += 1.0
            times.now += 1.0
        times.now += 1.0
    got = windows(anatomy, clock)
    assert got["step.wait_s"][Aggregation.MEAN] == 3.0
    assert got["step.backward.busy_s"][Aggregation.MEAN] == 2.0


def test_a_bucket_is_a_wait_from_its_launch_to_its_completion(
    anatomy: StepAnatomy, times: StepClock, clock: StepClock
) -> None:
    """A DDP bucket's future, chained by the hook's ``_timed``, is a wait from launch to
    completion, union with a collective it overlaps, and one still in flight at a step's end
    counts in the next step from its start; the chained future gives DDP the bucket."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch

    bucket = torch.ones(3)
    with anatomy.step():  # [0, 10]: a bucket in flight from 2 to 7, a collective from 6 to 8
        times.now = 2.0
        future: Any = torch.futures.Future()
        chained = anatomy._timed(times.now, future)
        times.now = 6.0
        with anatomy.collective():
            times.now = 7.0
            future.set_result(bucket)
            times.now = 8.0
        times.now = 10.0
    assert chained.wait() is bucket
    times.now = 20.0
    with anatomy.step():  # [20, 30]: launched at 25 in the step, in flight past its end
        late: Any = torch.futures.Future()
        anatomy._timed(25.0, late)
        times.now = 30.0
    times.now = 40.0
    with anatomy.step():  # [40, 50]: it completes at 44
        times.now = 44.0
        late.set_result(bucket)
        times.now = 50.0
    got = windows(anatomy, clock)
    assert got["step.wait_s"] == {Aggregation.MEAN: 5.0, Aggregation.MAX: 6.0}  # 6, 5, 4 s


def test_gc_pauses_count_in_their_generation_stage_and_step(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch, no_auto_gc: None
) -> None:
    """Each collection while the anatomy is open is a value of ``gc.gen<N>_s``; one inside a
    stage counts in the stage's and the step's ``gc_s``, one between stages in the step's only,
    one between steps in neither."""
    ticks = Ticks()  # every read of the clock is one second later
    monkeypatch.setattr(anatomy_module, "_clock", ticks)
    with StepAnatomy(window=HOUR) as anatomy:
        with anatomy.step():  # 0
            with anatomy.stage("forward"):  # 1
                gc.collect(0)  # 2, 3: one second
                gc.collect(2)  # 4, 5
            # forward ends at 6
            gc.collect(1)  # 7, 8
        # the step ends at 9
        gc.collect(0)  # 10, 11: between steps
        with anatomy.step(), anatomy.stage("forward"):  # 12, 13
            pass  # 14
        # 15
        got = windows(anatomy, clock)
    one = {Aggregation.MEAN: 1.0, Aggregation.MAX: 1.0}
    assert got["step.gc.gen0_s"] == {Aggregation.COUNT: 2, **one}
    assert got["step.gc.gen1_s"] == {Aggregation.COUNT: 1, **one}
    assert got["step.gc.gen2_s"] == {Aggregation.COUNT: 1, **one}
    assert got["step.gc_s"] == {Aggregation.MEAN: 1.5, Aggregation.MAX: 3.0}
    assert got["step.forward.gc_s"] == {Aggregation.MEAN: 1.0, Aggregation.MAX: 2.0}
    assert got["step.forward.time_s"] == {Aggregation.MEAN: 3.0, Aggregation.MAX: 5.0}
    assert got["step.time_s"] == {Aggregation.MEAN: 6.0, Aggregation.MAX: 9.0}


def test_a_real_collection_is_timed(anatomy: StepAnatomy, clock: StepClock) -> None:
    """On the real clock, a forced full collection in a stage is a pause above zero there."""
    with anatomy.step(), anatomy.stage("data"):
        garbage = [[i] for i in range(100_000)]
        gc.collect()
        del garbage
    got = windows(anatomy, clock)
    assert got["step.gc.gen2_s"][Aggregation.COUNT] == 1
    pause = got["step.data.gc_s"][Aggregation.MEAN]
    assert 0 < pause <= got["step.data.time_s"][Aggregation.MEAN]
    assert got["step.gc_s"][Aggregation.MEAN] == pause


def test_close_stops_timing_gc_and_is_idempotent(clock: StepClock) -> None:
    """``close()`` removes the gc callback (twice is fine), and a closed anatomy refuses steps."""
    before = list(gc.callbacks)
    anatomy = StepAnatomy(window=HOUR)
    assert len(gc.callbacks) == len(before) + 1
    anatomy.close()
    anatomy.close()
    assert gc.callbacks == before
    assert anatomy.closed
    collections = anatomy.stats["step.gc.gen2_s"].count
    gc.collect()
    assert anatomy.stats["step.gc.gen2_s"].count == collections
    with pytest.raises(RuntimeError, match="closed"), anatomy.step():
        pass
    assert "closed" in repr(anatomy)


def test_stats_go_to_the_bus_given(
    bus: EventBus, recorder: Recorder, clock: StepClock, no_auto_gc: None
) -> None:
    """The Stats log their windows on ``bus``, named after ``prefix``, with MEAN and MAX."""
    bus.register_event_handler(recorder)
    with StepAnatomy(window=timedelta(seconds=10), prefix="train", bus=bus) as anatomy:
        with anatomy.step():
            pass
        clock.now += 10
        with anatomy.step():
            pass
    assert bus.flush()
    keys = {key for e in recorder.events if e.name == STAT_EVENT for key in e.data}
    assert keys == {
        f"train.{name}.{agg}" for name in ("time_s", "wait_s", "gc_s") for agg in ("mean", "max")
    }


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"window": 1.0}, TypeError, "window must be a timedelta, not float"),
        ({"window": timedelta(0)}, ValueError, "window must be at least 1 millisecond"),
        ({"window": timedelta(microseconds=999)}, ValueError, "window must be at least"),
        ({"prefix": 3}, TypeError, "prefix must be a str, not int"),
        ({"prefix": ""}, ValueError, "prefix must not be empty"),
        ({"bus": "default"}, TypeError, "bus must be a monitor_bus.EventBus or None, not str"),
        ({"hang_after": "60"}, TypeError, "hang_after must be a number of seconds, not str"),
        ({"hang_after": True}, TypeError, "hang_after must be a number of seconds, not bool"),
        ({"hang_after": 0}, ValueError, "hang_after must be a positive number of seconds"),
        ({"hang_after": -1.0}, ValueError, "hang_after must be a positive"),
        ({"hang_after": math.nan}, ValueError, "hang_after must be a positive"),
        ({"hang_after": math.inf}, ValueError, "hang_after must be a positive"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type, match: str) -> None:
    """Each bad argument raises an error naming it, and leaves no gc callback behind."""
    before = list(gc.callbacks)
    with pytest.raises(error, match=match):
        StepAnatomy(**kwargs)
    assert gc.callbacks == before


def test_hang_after_is_kept(anatomy: StepAnatomy) -> None:
    """``hang_after`` is kept as float seconds (60 by default) for the hang rule."""
    assert anatomy.hang_after == 60.0
    with StepAnatomy(hang_after=5) as other:
        assert other.hang_after == 5.0
        assert type(other.hang_after) is float


def test_misplaced_blocks_are_refused(anatomy: StepAnatomy) -> None:
    """A stage or collective outside a step, a nested step or stage, and a bad stage name are
    refused with an error saying which; the anatomy stays usable."""
    with pytest.raises(TypeError, match="name must be a str, not int"):
        anatomy.stage(1)  # type: ignore[arg-type]
    for bad in ("", "a.b"):
        with pytest.raises(ValueError, match="name must be a non-empty stage name without a dot"):
            anatomy.stage(bad)
    outside = r"stage\('data'\) is only valid inside step\(\)"
    with pytest.raises(RuntimeError, match=outside), anatomy.stage("data"):
        pass
    outside = r"collective\(\) is only valid inside step\(\)"
    with pytest.raises(RuntimeError, match=outside), anatomy.collective():
        pass
    with anatomy.step():
        with pytest.raises(RuntimeError, match="steps do not nest"), anatomy.step():
            pass
        with (
            anatomy.stage("forward"),
            pytest.raises(RuntimeError, match="stages do not nest"),
            anatomy.stage("x"),
        ):
            pass
    with anatomy.step(), anatomy.stage("data"):
        pass
    assert anatomy._step_start is None


def test_no_torch_import_without_a_model() -> None:
    """StepAnatomy comes from monitor_bus.integrations.torch and works without importing torch."""
    code = (
        "import sys\n"
        "from monitor_bus.integrations.torch import StepAnatomy\n"
        "with StepAnatomy() as a, a.step(), a.stage('data'):\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\n"


# -- a real DDP model in this process: one rank of gloo ----------------------------------------


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[Any]:
    """A one-rank gloo process group (a FileStore: no port), destroyed after the test."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch.distributed as dist

    require(dist.is_available(), "torch.distributed is not available")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def ddp_model() -> Any:
    import torch

    return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))


def test_a_ddp_model_s_all_reduce_is_the_wait_inside_backward(
    process_group: Any, clock: StepClock
) -> None:
    """With a DDP model the all-reduce is timed: each step's wait lies in backward (its time
    minus its time outside the wait), and the gradients are those of the default all-reduce."""
    import torch

    model = ddp_model()
    with StepAnatomy(model, window=HOUR) as anatomy:
        for _ in range(3):
            with anatomy.step():
                with anatomy.stage("forward"):
                    loss = model(torch.ones(4, 8)).sum()
                with anatomy.stage("backward"):
                    loss.backward()
        grad = model.module.weight.grad.clone()
        got = windows(anatomy, clock)
    assert torch.equal(grad, torch.full((2, 8), 12.0))  # 3 steps of 4 ones, world size 1
    wait = got["step.wait_s"][Aggregation.MEAN]
    backward = got["step.backward.time_s"][Aggregation.MEAN]
    assert 0 < wait <= backward
    assert got["step.backward.busy_s"][Aggregation.MEAN] == pytest.approx(backward - wait)
    assert got["step.forward.busy_s"] == got["step.forward.time_s"]


def test_a_model_with_a_comm_hook_is_refused(process_group: Any) -> None:
    """A DDP model with a comm hook of its own (Python or built-in) is refused by a ValueError
    saying so; anything but a DDP model is a TypeError."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    hooked = ddp_model()
    hooked.register_comm_hook(None, allreduce_hook)
    builtin = ddp_model()
    builtin._register_builtin_comm_hook(process_group.BuiltinCommHookType.ALLREDUCE)
    for model in (hooked, builtin):
        with pytest.raises(ValueError, match="model already has a communication hook"):
            StepAnatomy(model)
    with pytest.raises(TypeError, match="model must be a torch.nn.parallel.Distributed"):
        StepAnatomy(ddp_model().module)


# -- three ranks under torchrun: rank 2 slow in backward ---------------------------------------


def test_the_slow_rank_waits_least_and_its_backward_is_busy(tmp_path: Path) -> None:
    """3 gloo ranks, DDP: rank 2 sleeps 30 ms per step in backward. The all-reduce evens the
    step times out, but rank 2 waits >= 20 ms less per step than the others, and its backward
    outside the wait is >= 20 ms longer. The timed all-reduce averages the gradients as DDP's
    allreduce_hook does: every rank's weights end equal to a twin's trained with it."""
    from .test_merge_ranks import run_job

    proc = run_job(tmp_path, str(tmp_path), script=ROOT / "tests" / "step_anatomy_job.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [rank.pop("same_weights") for rank in ranks] == [True, True, True]
    means = [
        {name: aggs["mean"] for name, aggs in rank.items() if "mean" in aggs} for rank in ranks
    ]
    ms = {r: {k: round(v * 1e3, 1) for k, v in m.items()} for r, m in enumerate(means)}
    slow, others = means[2], means[:2]
    for other in others:
        assert other["step.wait_s"] - slow["step.wait_s"] >= 0.020, ms
        assert slow["step.backward.busy_s"] - other["step.backward.busy_s"] >= 0.020, ms
    steps = [m["step.time_s"] for m in means]
    assert max(steps) - min(steps) <= 0.005, ms
    assert min(steps) >= 0.030, ms  # every rank's step holds rank 2's delay
