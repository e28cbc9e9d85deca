"""``monitor-bus summary`` and ``plot`` on StepAnatomy's breakdown (monitor_bus/_cli_anatomy.py):
where each rank's step goes and the time lost waiting for the slowest rank, from dst's
``monitor_bus.anatomy`` events."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from monitor_bus import STAT_EVENT, Event
from monitor_bus.__main__ import main
from monitor_bus._cli_anatomy import Anatomy
from monitor_bus._cli_plot import _figure
from monitor_bus._cli_read import _StatSkips
from monitor_bus.ranks import ANATOMY_EVENT

from .test_cli import PNG_MAGIC, one_error_line, write_run

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def ranks(**parts: tuple[float, float, float]) -> dict[str, float]:
    """Each rank's means: rank -> (time, wait, backward busy), ``data`` busy 1 ms throughout."""
    data = {}
    for rank, (time, wait, backward) in parts.items():
        data |= {
            f"{rank}.time_s": time,
            f"{rank}.wait_s": wait,
            f"{rank}.gc_s": 0.0,
            f"{rank}.data.busy_s": 0.001,
            f"{rank}.backward.busy_s": backward,
        }
    return data


# Two windows: rank 2 slow in backward for 10 steps of 40 ms (the others lose 30 ms a step),
# then 30 clean steps of 10 ms (rank 0 waited for by 1 ms a step, in no stage).
SLOW = {
    "prefix": "step",
    "window_s": 1.0,
    "ranks": 3,
    "step_s": 0.04,
    "steps": 10,
    "lost_s": 0.03,
    "lost_to_rank": 2,
    "host": "node1",
    "stage": "backward",
    **ranks(rank0=(0.04, 0.034, 0.004), rank1=(0.04, 0.034, 0.004), rank2=(0.04, 0.004, 0.034)),
}
CLEAN = {
    **SLOW,
    "step_s": 0.01,
    "steps": 30,
    "lost_s": 0.001,
    "lost_to_rank": 0,
    "host": "node0",
    "stage": "",
    **ranks(rank0=(0.01, 0.002, 0.004), rank1=(0.01, 0.004, 0.004), rank2=(0.01, 0.002, 0.004)),
}


def anatomy_run(path: Path, *windows: dict[str, Any]) -> Path:
    """A run of dst's anatomy events, one a second, with a Stat window beside each."""
    events = []
    for i, data in enumerate(windows):
        ts = T0 + timedelta(seconds=i + 1)
        events.append(Event(STAT_EVENT, ts, {"step.time_s.mean": data["step_s"]}))
        events.append(Event(ANATOMY_EVENT, ts, data))
    return write_run(path, events)


def test_summary_shows_where_each_rank_s_step_goes_and_the_time_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per rank, ms per step over the run's 40 steps (each window weighs its steps): each
    stage's time outside the wait, the wait, the rest and the step; then the time lost per
    rank and stage, lost_s x steps summed (0.3 s to rank 2 in backward, 0.03 s to rank 0 in
    no stage), most first, with its share of the job's step time (0.7 s)."""
    run = anatomy_run(tmp_path / "run.jsonl", SLOW, CLEAN)
    assert main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    section = out.split("where each rank's step goes", 1)[1].split("\n\nstat", 1)[0]
    assert section.splitlines() == [
        " (step: ms per step over 2 windows)",
        "rank  data  backward  wait  other  step",
        "0      1.0       4.0  10.0    2.5  17.5",
        "1      1.0       4.0  11.5    1.0  17.5",
        "2      1.0      11.5   2.5    2.5  17.5",
        "",
        "time lost waiting for the slowest rank (step: 0.33 s over 2 windows, 47.1% of the "
        "step time)",
        "rank       stage     lost s  windows",
        "2 (node1)  backward   0.300        1",
        "0 (node0)  -          0.030        1",
    ]


def test_a_breakdown_value_that_is_not_a_number_is_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank's mean that is a string is left out of the breakdown (as 0) and reported; a
    window without steps adds nothing."""
    bad = {**SLOW, "rank1.wait_s": "34 ms"}
    run = anatomy_run(tmp_path / "run.jsonl", bad, {**CLEAN, "steps": 0})
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "skipped 1 Stat value that is not a number: rank1.wait_s (1)" in err
    assert "(step: ms per step over 1 windows)" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["1", "1.0", "4.0", "0.0", "35.0", "40.0"] in rows


def test_plot_draws_a_stacked_bar_per_rank(tmp_path: Path) -> None:
    """The family's panel holds a bar per rank for each part, stacked in ms per step (rank
    2's backward 11.5 ms on its 1 ms of data), the legend outside the axes, top part first,
    and the rank the job lost most time waiting for, with its host, in the title."""
    anatomy = Anatomy()
    skips = _StatSkips()
    for data in (SLOW, CLEAN):
        anatomy.add(Event(ANATOMY_EVENT, T0, data), skips)
    figure, _ = _figure({}, {}, {}, [], families=anatomy.families)
    (ax,) = figure.axes
    bars = {c.get_label(): c for c in ax.containers}
    assert list(bars) == ["data (outside the wait)", "backward (outside the wait)", "wait", "other"]
    backward = [bar.get_height() for bar in bars["backward (outside the wait)"]]
    assert backward == pytest.approx([4.0, 4.0, 11.5])
    assert [bar.get_y() for bar in bars["backward (outside the wait)"]] == pytest.approx([1.0] * 3)
    tops = [bar.get_y() + bar.get_height() for bar in bars["other"]]
    assert tops == pytest.approx([17.5] * 3)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax.get_ylabel() == "ms per step"
    assert "the others lost 0.3 s waiting for rank 2 (node1) in backward" in ax.get_title(
        loc="left"
    )
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == list(bars)[::-1]
    assert legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1  # outside the bars


def test_plot_anatomy_draws_only_the_bars_and_stat_patterns_leave_them_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--anatomy`` writes the bars alone; ``--stat`` draws the chosen Stats without them;
    by default they come first, beside the Stats."""
    run = anatomy_run(tmp_path / "run.jsonl", SLOW, CLEAN)
    out = tmp_path / "a.png"
    assert main(["plot", str(run), "-o", str(out), "--anatomy"]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert capsys.readouterr().out == f"wrote {out} (1 panels, 1 with a bar per rank, 0 series)\n"
    assert main(["plot", str(run), "-o", str(out), "--stat", "step.*"]) == 0
    assert capsys.readouterr().out == f"wrote {out} (1 panels, 1 series)\n"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (2 panels, 1 with a bar per rank, 1 series)\n"


def test_plot_anatomy_without_a_breakdown_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--anatomy`` on a run without anatomy events is one error line, and writes nothing."""
    run = write_run(tmp_path / "run.jsonl", [Event(STAT_EVENT, T0, {"lat.mean": 1.0})])
    out = tmp_path / "a.png"
    assert main(["plot", str(run), "-o", str(out), "--anatomy"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"no StepAnatomy breakdown in {run} (the monitor_bus.anatomy "
        "events that merge_stats_across_ranks logs on dst): nothing to plot"
    )
    assert not out.exists()
