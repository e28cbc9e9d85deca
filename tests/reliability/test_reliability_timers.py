"""Timers at scale: 10,000 live Stats with 100 ms windows, each window logged on time."""

from __future__ import annotations

import multiprocessing

from .conftest import Figures
from .timers_scenario import LATE_LIMIT, ROUNDS, STATS


def test_ten_thousand_stats_log_each_window_on_time(figures: Figures) -> None:
    """With 10,000 Stats of 100 ms windows, each getting one value every other window (so
    that only the dispatcher's timer can close its windows), every window with data is logged
    within 50 ms of its end, exactly once (measured in a fresh interpreter)."""
    figures.describe(
        load=f"{STATS:,} live Stats, 100 ms windows, {ROUNDS} windows; each Stat gets one add "
        "every other window (5,000 adds per window); run in a fresh interpreter",
        faults="no add in the window after one with data: only the dispatcher's timer closes it",
    )
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        from .timers_scenario import run

        result = pool.apply_async(run).get(timeout=90)
    figures.measure(**result["figures"])
    assert result["dropped"] == 0
    assert result["counted"] == result["added"]  # every add is in exactly one logged window
    assert result["clean_not_logged"] == 0
    assert result["earliest"] > -0.005  # never before its end (clock-offset tolerance)
    assert result["latest"] <= LATE_LIMIT, (
        f"a window was logged {result['latest'] * 1000:.1f} ms late"
    )
