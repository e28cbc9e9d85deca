"""The slowdown rule (monitor_bus/ranks/_slowdown.py): ``SlowdownRule`` fed synthetic series
and a recorded one, and dst naming a slowdown from StepAnatomy's merged step time. The live
torchrun job is in tests/test_slow_rank.py (its last phase slows every rank)."""

from __future__ import annotations

import logging
import math
import random
import statistics
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import monitor_bus as monitor
from monitor_bus.ranks import SLOWDOWN_EVENT, SlowdownRule

from .test_merge_ranks import merge_on
from .test_slow_rank import merge_anatomy, window

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
RECORDED = Path(__file__).resolve().parent / "slowdown_windows.jsonl"


def stamp(i: int) -> datetime:
    return T0 + timedelta(seconds=i)


def named(series: list[float], **kwargs: Any) -> list[tuple[int, int, float, float, float, int]]:
    """Each slowdown a fresh rule names over ``series`` (window i stamped T0 + i s): (the
    window it is named in, the window it began, before, after, ratio, windows)."""
    rule = SlowdownRule(**kwargs)
    out = []
    for i, mean in enumerate(series):
        found = rule.add(stamp(i), mean)
        if found is not None:
            began = int((found.began - T0).total_seconds())
            out.append((i, began, found.before, found.after, found.ratio, found.windows))
    return out


def noisy(n: int, sigma: float, seed: int, level: float = 1.0) -> list[float]:
    """``n`` windows of a job whose step time varies by ``sigma`` (of its log) window to window."""
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def test_a_ten_percent_step_is_named_once_with_its_window_and_ratio() -> None:
    """20 windows at 1.0 s, then 60 at 1.1 s: named once, in the tenth slower window, as
    begun in the first, 1.0 -> 1.1, ratio 1.1; the slower level is then the baseline."""
    assert named([1.0] * 20 + [1.1] * 60) == [(29, 20, 1.0, 1.1, 1.1, 10)]


def test_a_lasting_slowdown_is_named_once_and_a_further_one_again() -> None:
    """1.0, then 1.5 for 40 windows, then 3.0: two slowdowns, the second from the first's level."""
    seen = named([1.0] * 20 + [1.5] * 40 + [3.0] * 40)
    assert seen == [(29, 20, 1.0, 1.5, 1.5, 10), (69, 60, 1.5, 3.0, 2.0, 10)]


def test_a_slowdown_after_a_slower_stretch_began_where_the_step_changed() -> None:
    """Two windows 25% slower and eight 7.5% slower (the sum stands still on them), then the
    step doubles: named once the sum has its evidence, as begun where the step doubled (the
    eight doubled windows are surely slower than the stretch before), 1.0 -> 2.0."""
    series = [1.0] * 30 + [1.25] * 2 + [1.075] * 8 + [2.0] * 20
    assert named(series) == [(47, 40, 1.0, 2.0, 2.0, 8)]


def test_a_slower_stretch_named_on_its_own_level_then_the_change_after_it() -> None:
    """A stretch 20% slower (three windows in four), its evidence slow to gather, then the
    step doubles two windows before it is confirmed: the stretch is named on its own, from
    where it began and at its own level (1.0 -> 1.2, 16 windows); the doubled windows are
    scored again from there and named as begun at the first of them (1.2 -> 2.0)."""
    series = [1.0] * 30 + [1.2, 1.2, 1.2, 1.0] * 4 + [2.0] * 30
    assert named(series) == [(47, 30, 1.0, 1.2, 1.2, 16), (55, 46, 1.2, 2.0, 2.0 / 1.2, 10)]


def test_a_slowdown_right_after_a_speed_up_began_where_the_step_changed() -> None:
    """A baseline mostly of 5 s windows, then 1 s (a speed-up whose evidence gathers slowly,
    as after a stretch of straggler windows), then 3 s two windows before the speed-up is
    confirmed: the baseline moves down to the 1 s windows only, and the slowdown is named as
    begun at the first 3 s window, 1.0 -> 3.0."""
    series = ([5.0] * 3 + [1.0]) * 10 + [1.0] * 16 + [3.0] * 30
    assert named(series) == [(65, 56, 1.0, 3.0, 3.0, 10)]


def test_a_slowdown_that_cuts_a_return_to_speed_short_is_named_from_the_faster_level() -> None:
    """A baseline of straggler windows (35 ms, a 6 ms window in six), four clean windows
    (6 ms), then 20 ms: every window still faster than the baseline, so the return to speed
    gathers evidence through the slower ones too. It is taken for the four clean windows
    only, however few: the slowdown is named from 6 ms, begun at the first 20 ms window (it
    went unnamed, the baseline moved to 20 ms with the slower windows in it)."""
    series = ([35.0] * 5 + [6.0]) * 5 + [6.0] * 4 + [20.0] * 20
    assert named(series) == [(43, 34, 6.0, 20.0, 20.0 / 6.0, 10)]


def test_a_five_percent_step_or_drift_names_nothing() -> None:
    """A 5% step, held for 300 windows, and a drift of 5% over 300 windows name nothing; nor
    does either under noise of a steady job's size (5% window to window)."""
    assert named([1.0] * 20 + [1.05] * 300) == []
    assert named([1.0] * 20 + [1.0 + 0.05 * i / 300 for i in range(300)]) == []
    steps = noisy(20, 0.05, 1) + [1.05 * m for m in noisy(300, 0.05, 2)]
    assert named(steps) == []
    drift = [m * (1 + 0.05 * i / 300) for i, m in enumerate(noisy(320, 0.05, 3))]
    assert named(drift) == []


def test_noise_names_nothing() -> None:
    """2,000 windows of noise with no change, at a steady job's size (5%) and at a loaded
    machine's (25% window to window, as in the traces of benchmarks/traces/): nothing."""
    assert named(noisy(2000, 0.05, 4)) == []
    assert named(noisy(2000, 0.25, 5)) == []


def test_a_spike_or_a_short_burst_names_nothing() -> None:
    """One window ten times the step, then nine windows twice it (under the ten a slowdown
    needs at the least): nothing."""
    assert named([1.0] * 20 + [10.0] + [1.0] * 20) == []
    assert named([1.0] * 20 + [2.0] * 9 + [1.0] * 40) == []


def test_a_warm_up_names_nothing_and_a_speed_up_moves_the_baseline() -> None:
    """Ten warm-up windows at 3 s, then 1 s: nothing (the baseline moves down to 1 s, silently);
    a 20% slowdown after that is named from 1 s. Going back to speed names nothing; slowing
    down again from the faster level is named from it."""
    assert named([3.0] * 10 + [1.0] * 40 + [1.25] * 20) == [(59, 50, 1.0, 1.25, 1.25, 10)]
    seen = named([1.0] * 20 + [2.0] * 30 + [1.0] * 30 + [2.0] * 20)
    assert seen == [(29, 20, 1.0, 2.0, 2.0, 10), (89, 80, 1.0, 2.0, 2.0, 10)]


def test_a_slowdown_under_noise_is_named_from_where_it_began() -> None:
    """Under 5% noise, a 50% step after 100 windows is named within 15 windows, begun at it,
    its ratio within 5% of 1.5."""
    series = noisy(100, 0.05, 6) + [1.5 * m for m in noisy(100, 0.05, 7)]
    [(at, began, _before, _after, ratio, _windows)] = named(series)
    assert began == 100
    assert at < 115
    assert abs(ratio - 1.5) < 0.075


def test_windows_without_a_positive_mean_are_left_out() -> None:
    """NaN, 0, negative and infinite means change nothing."""
    junk = [math.nan, 0.0, -1.0, math.inf]
    assert named([1.0] * 20 + junk * 5 + [1.1] * 60) == [(49, 40, 1.0, 1.1, 1.1, 10)]


def test_a_recorded_series_names_what_dst_named_live() -> None:
    """A real run's merged ``step.time_s`` windows (3 gloo ranks, DDP, StepAnatomy, 0.5 s
    windows) and the slowdowns its dst named, read back with ``read_jsonl``. Recorded with
    tests/slow_rank_job.py on one node (its phases: the straggler phases, 30 clean windows,
    slower; then the hang):

        torchrun --nproc_per_node=3 tests/slow_rank_job.py OUT && cp OUT/merged.jsonl \\
            tests/slowdown_windows.jsonl

    Fed to a fresh ``SlowdownRule``, the windows name exactly the slowdowns dst named live:
    the straggler phases as one; every rank sleeping 10 ms more per step, measured from the
    30 clean windows before it (the return to speed after the straggler phases), begun in
    the phase's first window."""
    events = monitor.read_jsonl(RECORDED)
    phases = [(e.data["phase"], e.timestamp) for e in events if e.name == "slow_rank_job.phase"]
    live = [e.data for e in events if e.name == SLOWDOWN_EVENT]
    windows = [
        (e.timestamp, float(e.data["step.time_s.mean"]))
        for e in events
        if e.name == monitor.STAT_EVENT
    ]
    rule = SlowdownRule()
    found = [f for f in (rule.add(s, m) for s, m in windows) if f is not None]
    replayed = [
        {
            "stat": "step.time_s",
            "before": f.before,
            "after": f.after,
            "ratio": f.ratio,
            "began": f.began.isoformat(),
            "windows": f.windows,
        }
        for f in found
    ]
    assert replayed == live
    assert len(live) == 2
    # The phase's slowdown is measured from the 30 clean windows before it, all of them.
    clean = [m for s, m in windows if phases[-2][1] < s <= phases[-1][1]]
    assert len(clean) == 30
    assert found[1].before == statistics.median(clean)
    slower = phases[-1]
    assert slower[0] == "slower"
    # A window's stamp is when it closed, just after its end: the phase's first ends 0.5 s in.
    first = min(s for s, _ in windows if s > slower[1] + timedelta(seconds=0.5))
    assert found[-1].began == first


# -- dst ----------------------------------------------------------------------------------


def slowdowns(
    steps: list[float], caplog: pytest.LogCaptureFixture | None = None, **kwargs: Any
) -> tuple[list[dict[str, Any]], list[str]]:
    """The slowdown events dst logs merging one window of StepAnatomy's Stats of three ranks
    per step time in ``steps`` (and the stamps of the merged ``step.time_s`` windows)."""
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 3, **kwargs)
        merge_anatomy(merge, [window({0: 0.0, 1: 0.0, 2: 0.0}, step=s) for s in steps])
        bus.flush()
    stamps = [
        e.timestamp.isoformat()
        for e in seen
        if e.name == monitor.STAT_EVENT and "step.time_s.mean" in e.data
    ]
    return [e.data for e in seen if e.name == SLOWDOWN_EVENT], stamps


def test_dst_names_a_slowdown_of_the_merged_step_time() -> None:
    """dst, given nothing but StepAnatomy's Stats: 20 windows of 0.5 s steps, then 0.75 s:
    one ``SLOWDOWN_EVENT`` with the family's Stat, 0.5 -> 0.75, ratio 1.5, begun at the first
    slower merged window, after 10 windows."""
    events, stamps = slowdowns([0.5] * 20 + [0.75] * 15, slowdown=0.1)
    assert events == [
        {
            "stat": "step.time_s",
            "before": 0.5,
            "after": 0.75,
            "ratio": 1.5,
            "began": stamps[20],
            "windows": 10,
        }
    ]


def test_the_threshold_is_the_user_s_and_none_turns_the_rule_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``slowdown=0.6`` names no 50% slowdown, None names none, and the default names it with
    a warning saying how much slower since when."""
    steps = [0.5] * 20 + [0.75] * 15
    assert slowdowns(steps, slowdown=0.6)[0] == []
    assert slowdowns(steps, slowdown=None)[0] == []
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    _, stamps = slowdowns(steps, slowdown=0.1)
    assert [r.getMessage() for r in caplog.records] == [
        "merge_stats_across_ranks: the job's 'step.time_s' is 1.50 times what it was "
        f"(750.00 ms per step, from 500.00 ms) since the window stamped {stamps[20]} "
        "(10 merged windows)"
    ]


def test_slowdown_is_checked() -> None:
    """A threshold that is not a positive, finite number (or None) is refused before anything
    starts, and so are a rule's bad arguments."""
    from monitor_bus.integrations.torch import merge_stats_across_ranks

    with pytest.raises(TypeError, match="slowdown must be a number, not str"):
        merge_stats_across_ranks(slowdown="0.1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="slowdown must be a number, not bool"):
        merge_stats_across_ranks(slowdown=True)
    for threshold in (0, -0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="slowdown must be a positive, finite number"):
            merge_stats_across_ranks(slowdown=threshold)
        with pytest.raises(ValueError, match="slowdown must be a positive, finite number"):
            SlowdownRule(threshold)
    with pytest.raises(ValueError, match="evidence must be a positive, finite number"):
        SlowdownRule(evidence=0)
    for name in ("windows", "baseline", "first"):
        with pytest.raises(ValueError, match=f"{name} must be at least 1, got 0"):
            SlowdownRule(**{name: 0})
        with pytest.raises(TypeError, match=f"{name} must be an int, not float"):
            SlowdownRule(**{name: 2.0})
