"""The slow rank named from StepAnatomy's Stats (monitor_bus/ranks/_anatomy.py): the rule driven
on synthetic per-rank windows, and a real torchrun job of three DDP ranks on gloo in phases
(tests/slow_rank_job.py) merged with ``merge_stats_across_ranks()`` and no ``stragglers``."""

from __future__ import annotations

import json
import logging
import math
import statistics
from datetime import datetime
from typing import Any

import pytest

import monitor_bus as monitor
from monitor_bus.ranks import STRAGGLER_EVENT

from .test_merge_ranks import ROOT, closed_records, merge_due, merge_on, run_job

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
    empty; so it is when no stage of its is busier than the others'."""
    bare = window({0: 0.75, 1: 0.75, 2: 0.125})
    assert [e["stage"] for e in stragglers([bare] * 3)] == [""]
    idle = window({0: 0.75, 1: 0.75, 2: 0.125}, busy={"forward": {0: 0.25, 1: 0.25, 2: 0.25}})
    assert [e["stage"] for e in stragglers([idle] * 3)] == [""]


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


def test_exposed_fraction_is_checked() -> None:
    """A fraction that is not a number in (0, 1] is refused before anything starts."""
    from monitor_bus.integrations.torch import merge_stats_across_ranks

    with pytest.raises(TypeError, match="exposed_fraction must be a number or None"):
        merge_stats_across_ranks(exposed_fraction="0.2")  # type: ignore[arg-type]
    for fraction in (0, 1.5, math.nan):
        with pytest.raises(ValueError, match="exposed_fraction must be above 0 and at most 1"):
            merge_stats_across_ranks(exposed_fraction=fraction)


# -- three ranks under torchrun, in phases --------------------------------------------------


WINDOW = 0.5  # as in slow_rank_job.py


def end_of(stamp: float) -> float:
    """The end of the window a merged window (or an event about it) stamped ``stamp`` is of:
    a window closes after its end, within the next window."""
    return math.floor(stamp / WINDOW) * WINDOW


def exposed_fractions(windows: list[dict[str, Any]]) -> dict[float, float]:
    """Window end -> the rule's exposed time over the step in that merged window of three
    ranks, from the spread keys: the least-waiting rank's wait is rank_min, the others' median
    the mean of rank_p50 and rank_max."""
    steps = {end_of(w["stamp"]): w["step.time_s.mean"] for w in windows if "step.time_s.mean" in w}
    out = {}
    for w in windows:
        end = end_of(w["stamp"])
        if "step.wait_s.mean" in w and end in steps:
            others = (w["step.wait_s.rank_p50"] + w["step.wait_s.rank_max"]) / 2
            out[end] = (others - w["step.wait_s.rank_min"]) / steps[end]
    return out


@pytest.fixture(scope="module")
def phased_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of tests/slow_rank_job.py (its rank 0's result), shared by the tests below."""
    out = tmp_path_factory.mktemp("slow_rank")
    proc = run_job(out, str(out), script=ROOT / "tests" / "slow_rank_job.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "rank0.json").read_text())
    return result


def test_the_slow_rank_is_named_with_its_stage_and_gc_cause_then_recovered(
    phased_job: dict[str, Any],
) -> None:
    """3 gloo ranks, DDP, merged with ``merge_stats_across_ranks()`` and no ``stragglers``:
    clean, then rank 2 sleeping 30 ms per step in backward, clean, then rank 2 collecting
    garbage for 30 ms per step in its data stage, clean. Exactly four events: rank 2 named in
    backward, in its third slow window, with an exposed time within 40% of 30 ms, recovered in
    the first clean window; named in data with cause "gc", recovered. The clean windows before
    name nobody."""
    result = phased_job
    starts = [start for _, start in result["phases"]]
    # The phases up to the slowdown rule's (its 30 clean windows and the slower phase come
    # after them): the first 4 windows of the clean phase after the storm, as before it.
    result = {
        **result,
        "stragglers": [e for e in result["stragglers"] if e["stamp"] < starts[4] + 4 * WINDOW],
        "windows": [w for w in result["windows"] if w["stamp"] < starts[4] + 4 * WINDOW],
    }
    fractions = exposed_fractions(result["windows"])
    report = {
        "events": result["stragglers"],
        "fractions": {round(end - starts[0], 1): round(f, 3) for end, f in fractions.items()},
    }
    events = [(e["rank"], e["stage"], e["cause"], e["recovered"]) for e in result["stragglers"]]
    assert events == [
        (2, "backward", "", False),
        (2, "backward", "", True),
        (2, "data", "gc", False),
        (2, "data", "gc", True),
    ], report
    ends = [end_of(e["stamp"]) for e in result["stragglers"]]
    assert ends == [
        starts[1] + 3 * WINDOW,
        starts[2] + WINDOW,
        starts[3] + 3 * WINDOW,
        starts[4] + WINDOW,
    ], report
    assert abs(result["stragglers"][0]["exposed_s"] - 0.030) <= 0.4 * 0.030, report
    assert all(f < 0.2 for end, f in fractions.items() if end <= starts[1]), report


@pytest.mark.stress
def test_every_rank_slower_is_a_slowdown_named_once_from_where_it_began(
    phased_job: dict[str, Any],
) -> None:
    """The job's last phase: every rank sleeps 10 ms more per step, after 30 clean windows.
    ``dst`` names one slowdown of ``step.time_s`` in it, begun in the phase's first window,
    at least 1.5 times the step before, its ``after`` within 20% of the phase's median merged
    step time. (The machine's own load can make the clean phases slower too, a slowdown of
    its own, begun before the phase; none is named from the phase but that one.)"""
    result = phased_job
    starts = [start for _, start in result["phases"]]
    steps = {
        end_of(w["stamp"]): w["step.time_s.mean"]
        for w in result["windows"]
        if "step.time_s.mean" in w
    }
    slower = statistics.median(v for end, v in steps.items() if end > starts[-1])
    report = {"events": result["slowdowns"], "steps": steps, "slower": slower}
    began = {end_of(datetime.fromisoformat(e["began"]).timestamp()): e for e in result["slowdowns"]}
    [event] = [e for end, e in began.items() if end > starts[-1]]
    assert end_of(datetime.fromisoformat(event["began"]).timestamp()) == starts[-1] + WINDOW, report
    assert event["stat"] == "step.time_s", report
    assert event["ratio"] >= 1.5, report
    assert abs(event["after"] / slower - 1) < 0.2, report
