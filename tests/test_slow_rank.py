"""The slow rank named from StepAnatomy's Stats (monitor_bus/ranks/_anatomy.py): the rule and
what it cost driven on synthetic per-rank windows, and a real torchrun job of three DDP ranks
on gloo, two nodes, in phases (tests/slow_rank_job.py) merged with
``merge_stats_across_ranks()`` and no ``stragglers``, whose last phase is a hang (the hang
rule, monitor_bus/ranks/_hang.py, is tested in test_hang.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import socket
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

import monitor_bus as monitor
from monitor_bus.ranks import ANATOMY_EVENT, STRAGGLER_EVENT, SlowdownRule

from .conftest import require
from .test_merge_ranks import ROOT, closed_records, merge_due, merge_on, run_nodes

STEP_AGGS = [monitor.Aggregation.MEAN, monitor.Aggregation.MAX]


def window(
    waits: dict[int, float],
    step: float = 1.0,
    busy: dict[str, dict[int, float]] | None = None,
    gc: dict[int, float] | None = None,
    prefix: str = "step",
) -> dict[str, dict[int, float]]:
    """One window of StepAnatomy's Stats, each rank's one sample by Stat name: the wait, the
    step (``step`` on every rank), each stage's busy time, the step's GC."""
    stats = {f"{prefix}.wait_s": waits, f"{prefix}.time_s": dict.fromkeys(waits, step)}
    for stage, means in (busy or {}).items():
        stats[f"{prefix}.{stage}.busy_s"] = means
        stats[f"{prefix}.{stage}.gc_s"] = dict.fromkeys(means, 0.0)
    stats[f"{prefix}.gc_s"] = gc or dict.fromkeys(waits, 0.0)
    return stats


def merge_anatomy(merge: Any, windows: list[dict[str, dict[int, float]]]) -> None:
    """dst merges one past window per item, of each Stat named in it (MEAN and MAX): rank ->
    its one sample."""
    for number, stats in enumerate(windows):
        index = math.floor(merge._now() / 10.0) - 20 + number
        for name, means in stats.items():
            records = closed_records(name, STEP_AGGS, [[m] for m in means.values()], index)
            for rank, record in zip(means, records, strict=True):
                merge._take(rank, record)
        merge._mark = dict.fromkeys(merge._mark, math.inf)
        merge_due(merge)


def stragglers(windows: list[dict[str, dict[int, float]]], **kwargs: Any) -> list[dict[str, Any]]:
    """The straggler events dst logs merging ``windows`` of three ranks (``straggler_windows``
    3 and the default rule unless given)."""
    seen: list[monitor.Event] = []
    kwargs = {"straggler_windows": 3, "exposed_fraction": 0.2, **kwargs}
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge_anatomy(merge_on(bus, 0, 3, **kwargs), windows)
        bus.flush()
    return [e.data for e in seen if e.name == STRAGGLER_EVENT]


# Binary fractions, so every mean and median is exact.
CLEAN = window(
    {0: 0.75, 1: 0.6875, 2: 0.71875},
    busy={"forward": {0: 0.125, 1: 0.125, 2: 0.125}, "backward": {0: 0.0625, 1: 0.125, 2: 0.0625}},
)
SLOW_BACKWARD = window(
    {0: 0.75, 1: 0.6875, 2: 0.0625},  # rank 2 waits least; the others' median is 0.71875
    busy={"forward": {0: 0.125, 1: 0.125, 2: 0.125}, "backward": {0: 0.0625, 1: 0.0625, 2: 0.75}},
)


def test_a_rank_the_others_wait_for_is_named_once_with_its_stage_then_recovered() -> None:
    """Rank 2 waits 0.65625 s per 1 s step less than the others' median for four windows: named
    once after three, in stage backward (its busy time there is over the others'), with the
    mean exposed time over those windows, then once recovered in the first clean window, over
    the four; the clean windows around name nobody."""
    seen = stragglers([CLEAN, *[SLOW_BACKWARD] * 4, CLEAN, CLEAN])
    named = {
        "stat": "step.wait_s",
        "rank": 2,
        "host": "",
        "stage": "backward",
        "exposed_s": 0.65625,
        "cause": "",
        "windows": 3,
        "recovered": False,
    }
    assert seen == [named, {**named, "windows": 4, "recovered": True}]


def test_exposed_s_is_the_mean_over_the_windows_it_was_named_in() -> None:
    """Exposed times of 0.5, 0.25 and 0.75 s per step in the three windows it is named after:
    ``exposed_s`` is their mean, 0.5; recovered after a fourth of 0.5, still 0.5."""
    slow = [window({0: 0.75, 1: 0.75, 2: 0.75 - exposed}) for exposed in (0.5, 0.25, 0.75, 0.5)]
    seen = stragglers([*slow, CLEAN])
    assert [(e["exposed_s"], e["windows"], e["recovered"]) for e in seen] == [
        (0.5, 3, False),
        (0.5, 4, True),
    ]


def test_gc_pauses_that_explain_half_the_exposed_time_are_the_cause() -> None:
    """Rank 2's GC per step, 0.375 s, is 0.3125 over the others' median: half of its exposed
    0.625, so ``cause`` is "gc"; its stage is data, where the pauses fell. With 0.25 s over the
    others' (under half), no cause."""
    storm = window(
        {0: 0.75, 1: 0.75, 2: 0.125},
        busy={"data": {0: 0.0, 1: 0.0, 2: 0.625}, "forward": {0: 0.125, 1: 0.125, 2: 0.125}},
        gc={0: 0.0625, 1: 0.0625, 2: 0.375},
    )
    seen = stragglers([storm] * 3)
    assert [(e["stage"], e["cause"], e["exposed_s"]) for e in seen] == [("data", "gc", 0.625)]
    less = {**storm, "step.gc_s": {0: 0.0625, 1: 0.0625, 2: 0.3125}}  # 0.25 over: not half
    assert [e["cause"] for e in stragglers([less] * 3)] == [""]


def test_a_step_without_stages_names_the_rank_with_no_stage() -> None:
    """No ``<prefix>.<stage>.busy_s`` Stats: the rank is named all the same, its ``stage``
    empty; so it is when no stage of its is busier than the others', or when the busiest
    explains under half the exposed time (0.1875 of 0.625 s: a few stray samples); at half
    (0.3125) it is the stage."""
    bare = window({0: 0.75, 1: 0.75, 2: 0.125})
    assert [e["stage"] for e in stragglers([bare] * 3)] == [""]
    idle = window({0: 0.75, 1: 0.75, 2: 0.125}, busy={"forward": {0: 0.25, 1: 0.25, 2: 0.25}})
    assert [e["stage"] for e in stragglers([idle] * 3)] == [""]
    for busy, stage in ((0.25, ""), (0.375, "optimizer")):
        stray = window(
            {0: 0.75, 1: 0.75, 2: 0.125}, busy={"optimizer": {0: 0.0625, 1: 0.0625, 2: busy}}
        )
        assert [e["stage"] for e in stragglers([stray] * 3)] == [stage]


def test_a_clean_job_and_a_rank_under_the_fraction_name_nobody() -> None:
    """Windows whose least-waiting rank changes, or stays but is waited for under the fraction
    of the step (0.1875 of it, the default 0.2), or over it for fewer windows than
    ``straggler_windows``, name nobody; at 0.25 of the step it is named."""
    shuffled = [
        window({0: 0.75, 1: 0.125, 2: 0.75}),
        window({0: 0.125, 1: 0.75, 2: 0.75}),
        window({0: 0.75, 1: 0.75, 2: 0.125}),
    ]
    under = window({0: 0.5, 1: 0.5, 2: 0.3125})
    assert stragglers([CLEAN] * 5 + shuffled * 2 + [under] * 5) == []
    assert [e["exposed_s"] for e in stragglers([window({0: 0.5, 1: 0.5, 2: 0.25})] * 3)] == [0.25]


def test_the_fraction_is_the_user_s_and_none_turns_the_rule_off() -> None:
    """``exposed_fraction=0.75`` names no rank waited for 0.65625 of the step; None names none
    at all; the ``stragglers`` rule is unaffected by either."""
    assert stragglers([SLOW_BACKWARD] * 3, exposed_fraction=0.75) == []
    assert stragglers([SLOW_BACKWARD] * 3, exposed_fraction=None) == []
    seen = stragglers(
        [SLOW_BACKWARD] * 3, exposed_fraction=None, stragglers={"step.backward.busy_s": 2.0}
    )
    assert [(e["stat"], e["rank"], e["ratio"]) for e in seen] == [("step.backward.busy_s", 2, 12.0)]


def test_each_prefix_is_its_own_family_and_two_ranks_compare_with_each_other() -> None:
    """Two StepAnatomy prefixes in one window are watched apart (only "train"'s rank 1 is
    slow); of two ranks, each is compared with the other's wait."""
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 2, straggler_windows=2, exposed_fraction=0.2)
        both = {
            **window({0: 0.5, 1: 0.5}, prefix="eval"),
            **window({0: 0.5, 1: 0.0}, prefix="train"),
        }
        merge_anatomy(merge, [both] * 2)
        bus.flush()
    named = [e.data for e in seen if e.name == STRAGGLER_EVENT]
    assert [(e["stat"], e["rank"], e["exposed_s"]) for e in named] == [("train.wait_s", 1, 0.5)]
    assert merge.straggling == {("train.wait_s", 1)}


def test_the_warning_says_who_where_and_how_much(caplog: pytest.LogCaptureFixture) -> None:
    """dst warns as it names the rank, and as it recovers."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    stragglers([*[SLOW_BACKWARD] * 3, CLEAN])
    assert [r.getMessage() for r in caplog.records] == [
        "merge_stats_across_ranks: rank 2 () is a straggler: the other ranks waited 656.2 ms per "
        "step for it, in stage 'backward' (3 merged windows in a row at 0.2 of the step or more)",
        "merge_stats_across_ranks: rank 2 () has recovered: the other ranks waited 656.2 ms per "
        "step for it, in stage 'backward' (3 merged windows)",
    ]


def merged(
    windows: list[dict[str, dict[int, float]]], ranks: int = 3, **kwargs: Any
) -> list[monitor.Event]:
    """Every event dst logs merging ``windows`` of ``ranks`` ranks."""
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge_anatomy(merge_on(bus, 0, ranks, **kwargs), windows)
        bus.flush()
    return seen


def test_the_merged_wait_carries_the_time_lost_and_dst_logs_each_rank_s_breakdown() -> None:
    """The merged ``step.wait_s`` holds ``lost_s`` (the others' median wait, 0.71875, minus
    rank 2's 0.0625) and ``lost_to_rank`` 2, the rule on or off; no other Stat does (a wait
    outside a family neither). After the family's windows, one ``monitor_bus.anatomy`` event
    holds each rank's means, the time lost, to whom, in which stage and over how many
    steps."""
    lone = {"io.wait_s": {0: 0.5, 1: 0.25, 2: 0.0}}
    seen = merged([{**SLOW_BACKWARD, **lone}], exposed_fraction=None)
    lost = {
        key: value
        for e in seen
        if e.name == monitor.STAT_EVENT
        for key, value in e.data.items()
        if key.endswith((".lost_s", ".lost_to_rank"))
    }
    assert lost == {"step.wait_s.lost_s": 0.65625, "step.wait_s.lost_to_rank": 2}
    assert [e.data for e in seen if e.name == ANATOMY_EVENT] == [
        {
            "prefix": "step",
            "window_s": 10.0,
            "ranks": 3,
            "step_s": 1.0,
            "steps": 1,
            "lost_s": 0.65625,
            "lost_to_rank": 2,
            "host": "",
            "stage": "backward",
            **{
                f"rank{rank}.{key}": value
                for rank in range(3)
                for key, value in {
                    "time_s": 1.0,
                    "wait_s": SLOW_BACKWARD["step.wait_s"][rank],
                    "gc_s": 0.0,
                    "forward.busy_s": 0.125,
                    "backward.busy_s": SLOW_BACKWARD["step.backward.busy_s"][rank],
                }.items()
            },
        }
    ]
    assert [e.name for e in seen][-1] == ANATOMY_EVENT  # after the family's windows


def test_without_spread_no_cost_travels_and_one_rank_loses_nothing() -> None:
    """``spread=False``: no ``lost_s`` key, no anatomy event (the rule still names the rank).
    A single rank's breakdown comes without a loss: nobody waited for anyone."""
    seen = merged([SLOW_BACKWARD] * 3, spread=False, exposed_fraction=0.2)
    assert not [k for e in seen for k in e.data if k.endswith(".lost_s")]
    assert [e.name for e in seen if e.name != monitor.STAT_EVENT] == [STRAGGLER_EVENT]
    (alone,) = [e.data for e in merged([window({0: 0.5})], ranks=1) if e.name == ANATOMY_EVENT]
    assert alone == {
        "prefix": "step",
        "window_s": 10.0,
        "ranks": 1,
        "step_s": 1.0,
        "steps": 1,
        "rank0.time_s": 1.0,
        "rank0.wait_s": 0.5,
        "rank0.gc_s": 0.0,
    }


def test_tensorboard_gets_the_stage_stats_with_their_spread_and_the_time_lost(
    tmp_path: Path,
) -> None:
    """Merged windows written by TensorboardEventHandler and read back with TensorBoard's own
    EventAccumulator: each stage's Stats with their spread across ranks (min, median, max,
    slowest rank) and the wait's ``lost_s`` and ``lost_to_rank``, a point per window."""
    require(importlib.util.find_spec("tensorboard") is not None, "tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from monitor_bus.tensorboard import SummaryWriter

    with monitor.EventBus() as bus, SummaryWriter(tmp_path) as writer:
        bus.register_event_handler(monitor.TensorboardEventHandler(writer))
        merge_anatomy(merge_on(bus, 0, 3, exposed_fraction=0.2), [CLEAN, SLOW_BACKWARD])
        assert bus.flush()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()

    def values(tag: str) -> list[float]:
        return [point.value for point in acc.Scalars(tag)]

    assert values("step.backward.busy_s.rank_min") == [0.0625, 0.0625]
    assert values("step.backward.busy_s.rank_p50") == [0.0625, 0.0625]
    assert values("step.backward.busy_s.rank_max") == [0.125, 0.75]
    assert values("step.backward.busy_s.slowest_rank") == [1, 2]
    assert values("step.forward.busy_s.rank_max") == [0.125, 0.125]
    assert values("step.wait_s.lost_s") == [0.046875, 0.65625]
    assert values("step.wait_s.lost_to_rank") == [1, 2]


def test_exposed_fraction_is_checked() -> None:
    """A fraction that is not a number in (0, 1] is refused before anything starts."""
    from monitor_bus.integrations.torch import merge_stats_across_ranks

    with pytest.raises(TypeError, match="exposed_fraction must be a number or None"):
        merge_stats_across_ranks(exposed_fraction="0.2")  # type: ignore[arg-type]
    for fraction in (0, 1.5, math.nan):
        with pytest.raises(ValueError, match="exposed_fraction must be above 0 and at most 1"):
            merge_stats_across_ranks(exposed_fraction=fraction)


# -- three ranks on two torchrun nodes, in phases (one launch) ----------------------------------


WINDOW = 0.5  # as in slow_rank_job.py
HANG_AFTER = 2.0  # as in slow_rank_job.py
DELAY = 0.030
SLOW_PHASES = ["backward", "gc", "data", "forward", "optimizer", "nostages", "collective"]
BASELINE = 30  # clean windows before the slower phase, as in slow_rank_job.py
# The stage each slow phase is named in, and its cause.
NAMED = {
    "backward": ("backward", ""),
    "gc": ("data", "gc"),
    "data": ("data", ""),
    "forward": ("forward", ""),
    "optimizer": ("optimizer", ""),
    "nostages": ("", ""),
    "collective": ("forward", ""),
}


def end_of(stamp: float) -> float:
    """The end of the window a merged window (or an event about it) stamped ``stamp`` is of:
    a window closes after its end, within the next window."""
    return math.floor(stamp / WINDOW) * WINDOW


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/slow_rank_job.py as two torchrun nodes on this machine (rank 0; ranks 1 and 2):
    what rank 0 (dst) wrote, with ``starts``, each phase's (name, start, end)."""
    tmp_path = tmp_path_factory.mktemp("slow_rank")
    run_nodes(tmp_path, str(tmp_path), script=ROOT / "tests" / "slow_rank_job.py", ranks=(1, 2))
    result: dict[str, Any] = json.loads((tmp_path / "rank0.json").read_text())
    starts = [start for _, start in result["phases"]] + [result["end"]]
    result["spans"] = [
        (name, start, starts[i + 1]) for i, (name, start) in enumerate(result["phases"])
    ]
    return result


def report(job: dict[str, Any]) -> dict[str, Any]:
    """What a failing assertion shows: the events and each window's exposed fraction."""
    start = job["spans"][0][1]
    return {
        "events": job["stragglers"],
        "fractions": {
            round(end_of(w["stamp"]) - start, 1): round(w.get("lost_s", 0.0) / w["step_s"], 3)
            for w in job["anatomy"]
        },
    }


@pytest.mark.stress
def test_a_delay_in_each_stage_names_the_rank_its_stage_and_host_then_recovered(
    job: dict[str, Any],
) -> None:
    """3 gloo ranks on two torchrun nodes (so two-level: rank 2 behind its node's leader), DDP,
    merged with ``merge_stats_across_ranks()`` and no ``stragglers``: rank 2 30 ms slower per
    step in backward (inside the backward pass), GC, data, forward, optimizer, a step without
    stages, and forward in steps whose only wait is a hand all-reduce in ``collective()``,
    each phase followed by clean windows. Exactly two events a phase, with rank 2's host: named
    in its third slow window with that stage (GC: data, cause "gc"; no stages: none) and an
    exposed time within 40% of 30 ms, and recovered in the first clean window. The clean
    windows before the first phase name nobody. (The slowdown rule's phases come after: their
    windows are left to it.)"""
    host = socket.gethostname()
    assert job["hosts"] == [host] * 3
    expected, ends = [], []
    for name, start, end in job["spans"]:
        if name in NAMED:
            stage, cause = NAMED[name]
            expected += [(2, host, stage, cause, False), (2, host, stage, cause, True)]
            ends += [start + 3 * WINDOW, end + WINDOW]
    baseline = job["spans"][-2][1]  # the slowdown rule's clean phase starts
    events = [e for e in job["stragglers"] if end_of(e["stamp"]) <= baseline]
    got = [(e["rank"], e["host"], e["stage"], e["cause"], e["recovered"]) for e in events]
    assert got == expected, report(job)
    assert [end_of(e["stamp"]) for e in events] == ends, report(job)
    named = {phase: e for phase, e in zip(SLOW_PHASES, events[::2], strict=True)}
    assert all(abs(e["exposed_s"] - DELAY) <= 0.4 * DELAY for e in named.values()), report(job)


@pytest.mark.stress
def test_the_slow_rank_waits_least_and_its_stage_is_busiest(job: dict[str, Any]) -> None:
    """dst's ``monitor_bus.anatomy`` events, over each slow phase with stages: the all-reduce
    evens the step times out (within 5 ms, all holding the delay), but rank 2 waits at least
    20 ms less per step than each other rank, and its time outside the wait in the slow stage
    is at least 20 ms over each other rank's; every window's ``lost_s`` on the merged wait is
    the rule's, from the spread keys (three ranks: the others' median is the mean of p50 and
    max)."""
    for name, start, end in job["spans"]:
        stage = NAMED.get(name, ("", ""))[0]
        if not stage:
            continue
        windows = [  # a stall past a window can leave a rank out of one: those are skipped
            w
            for w in job["anatomy"]
            if start < end_of(w["stamp"]) <= end and w["ranks"] == 3 and "rank0.time_s" in w
        ]
        assert len(windows) >= 3, name
        steps = sum(w["steps"] for w in windows)

        def mean(key: str, windows: list[dict[str, Any]] = windows, steps: int = steps) -> float:
            return sum(w[key] * w["steps"] for w in windows) / steps

        ms = {k: round(mean(k) * 1e3, 1) for k in windows[0] if k.startswith("rank")}
        for other in (0, 1):
            assert mean(f"rank{other}.wait_s") - mean("rank2.wait_s") >= 0.020, (name, ms)
            busy = mean(f"rank2.{stage}.busy_s") - mean(f"rank{other}.{stage}.busy_s")
            assert busy >= 0.020, (name, ms)
        times = [mean(f"rank{r}.time_s") for r in range(3)]
        assert max(times) - min(times) <= 0.005, (name, ms)
        assert min(times) >= DELAY, (name, ms)
    for w in job["windows"]:
        if "step.wait_s.lost_s" in w:
            others = (w["step.wait_s.rank_p50"] + w["step.wait_s.rank_max"]) / 2
            assert w["step.wait_s.lost_s"] == pytest.approx(others - w["step.wait_s.rank_min"])


@pytest.mark.stress  # the job's other tests are: one launch serves them all
def test_a_rank_stuck_in_its_data_stage_is_named_while_it_hangs(job: dict[str, Any]) -> None:
    """Rank 2 stuck in its data stage, ``hang_after`` 2 s, ranks 0 and 1 blocked in DDP's
    all-reduce: dst names it once, by a hang event it logs while rank 2 is stuck (rank 2 waits
    for dst's handler to see it), in stage data, inside a step, not waiting, two ranks
    waiting, after at least ``hang_after`` seconds; the job then trains on, ends cleanly, and
    names no hang again."""
    [hang] = job["hangs"]
    assert hang["seconds"] >= HANG_AFTER, hang
    assert hang["silent_s"] < hang["seconds"], hang  # heard of in the data stage, since
    assert {k: v for k, v in hang.items() if k not in ("seconds", "silent_s")} == {
        "rank": 2,
        "host": job["hosts"][2],
        "stage": "data",
        "in_step": True,
        "waits": False,
        "waiting": 2,
    }


@pytest.mark.stress  # the job's other tests are: one launch serves them all
def test_the_timed_all_reduce_averages_the_gradients_as_ddp_s_own_hook(
    job: dict[str, Any],
) -> None:
    """StepAnatomy's comm hook does DDP's all-reduce itself: on every rank, a model trained
    under it ends bit for bit equal to a twin trained on the same batches under DDP's
    ``allreduce_hook``."""
    assert job["same_weights"] is True


@pytest.mark.stress
def test_every_rank_slower_is_a_slowdown_named_once_from_where_it_began(
    job: dict[str, Any],
) -> None:
    """The straggler phases' last: every rank sleeps 10 ms more per step, after 30 clean
    windows. ``dst`` names exactly the slowdowns a fresh ``SlowdownRule`` names from the
    merged windows it logged, and one of them begins with the phase: in its first window, or
    in the one before (a rank's windows keep their own phase, so that one can hold its first
    slower steps). It is at least 1.5 times the step before, its ``after`` within 20% of the
    phase's median merged step time. (The machine's own load can make the clean phases
    slower too, a slowdown of its own, begun and named before the phase; none is named from
    the phase but that one.)"""
    _, slower_start, slower_end = job["spans"][-1]
    merged = [
        (datetime.fromtimestamp(w["stamp"], timezone.utc), w["step.time_s.mean"])
        for w in job["windows"]
        if "step.time_s.mean" in w
    ]
    steps = {end_of(s.timestamp()): v for s, v in merged if end_of(s.timestamp()) <= slower_end}
    slower = statistics.median(v for end, v in steps.items() if end > slower_start)
    report = {"events": job["slowdowns"], "steps": steps, "slower": slower}
    rule = SlowdownRule()
    replayed = [f for f in (rule.add(s, v) for s, v in merged) if f is not None]
    assert [(end_of(f.began.timestamp()), f.after) for f in replayed] == [
        (end_of(datetime.fromisoformat(e["began"]).timestamp()), e["after"])
        for e in job["slowdowns"]
    ], report
    began = {end_of(datetime.fromisoformat(e["began"]).timestamp()): e for e in job["slowdowns"]}
    earliest = slower_start  # the window before the phase's first
    named = [e for end, e in began.items() if earliest <= end <= slower_end]
    assert len(named) == 1, report
    (event,) = named
    assert end_of(datetime.fromisoformat(event["began"]).timestamp()) <= slower_start + WINDOW, (
        report
    )
    assert event["stat"] == "step.time_s", report
    assert event["ratio"] >= 1.5, report
    assert abs(event["after"] / slower - 1) < 0.2, report
