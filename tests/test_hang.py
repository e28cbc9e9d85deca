"""The hang rule (monitor_bus/ranks/_hang.py) and the progress it reads
(``monitor_bus._step_anatomy.progress``): driven on stepped clocks, every rank's progress given
as it travels; the live case, three torchrun ranks with one stuck, is in test_slow_rank.py."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import monitor_bus as monitor
from monitor_bus import _step_anatomy
from monitor_bus._step_anatomy import Progress, progress
from monitor_bus.integrations.torch import HANG_EVENT, StepAnatomy
from monitor_bus.ranks import _frame

from .conftest import StepClock, require
from .test_merge_ranks import ROUTES, closed_records, decode, merge_on

HOUR = timedelta(hours=1)


@pytest.fixture
def times(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepClock]:
    """The anatomies' clock, standing still at 0 until the test moves it; no anatomy is open
    before the test (one left open elsewhere would be this process's progress) or after."""
    assert _step_anatomy._open == ()
    c = StepClock(0.0)
    monkeypatch.setattr(_step_anatomy, "_clock", c)
    yield c
    assert _step_anatomy._open == ()


def entry(
    seconds: float,
    stage: str = "backward",
    *,
    in_step: bool = True,
    waits: bool = True,
    hang_after: float = 10.0,
    silent: float = 0.0,
) -> list[Any]:
    """A rank's progress as it travels."""
    return [seconds, silent, stage, in_step, waits, hang_after]


def message(progress: dict[int, list[Any] | None], *, bye: bool = False) -> dict[str, Any]:
    """A message upstream with no windows, carrying ``progress`` (rank -> its entry)."""
    return {
        "mark": 0.0,
        "bye": bye,
        "windows": [],
        "progress": {str(rank): e for rank, e in progress.items()},
    }


class Dst:
    """dst of a world of ``size`` ranks on a bus of its own, and the hang events it logs."""

    def __init__(self, size: int = 3) -> None:
        self.bus = monitor.EventBus()
        self.seen: list[monitor.Event] = []
        self.bus.register_event_handler(self.seen.append)
        self.merge = merge_on(self.bus, 0, size)

    def hear(self, now: float, progress: dict[int, list[Any] | None], *, bye: bool = False) -> None:
        """dst reads, at ``now``, a message from each rank of ``progress`` with its entry."""
        for rank, e in progress.items():
            self.merge._note_progress(rank, message({rank: e}, bye=bye), now)

    def watch(self, now: float) -> list[dict[str, Any]]:
        """The hang events the rule logs at ``now``."""
        before = len(self.seen)
        self.merge._watch_hang(now)
        assert self.bus.flush()
        return [dict(e.data) for e in self.seen[before:] if e.name == HANG_EVENT]

    def close(self) -> None:
        assert self.bus.close()


@pytest.fixture
def dst() -> Iterator[Dst]:
    """dst of three ranks, closed after the test."""
    d = Dst()
    yield d
    d.close()


def named(rank: int, stage: str, seconds: float, silent_s: float, **kwargs: Any) -> dict[str, Any]:
    """A hang event's data (a rank inside a step, not waiting, two ranks waiting, unless
    given)."""
    return {
        "rank": rank,
        "host": "",
        "stage": stage,
        "in_step": True,
        "waits": False,
        "waiting": 2,
        "seconds": seconds,
        "silent_s": silent_s,
        **kwargs,
    }


# -- what a rank reports: its anatomies' progress ---------------------------------------------


def test_progress_says_where_the_training_is(times: StepClock) -> None:
    """The seconds since a step last ended (or the anatomy opened), the stage (``""`` outside
    every stage), whether in a step, whether a collective is in flight, and ``hang_after`` (as
    set now); None with no anatomy open."""
    assert progress() is None
    times.now = 5.0
    with StepAnatomy(window=HOUR, hang_after=10) as anatomy:
        times.now = 7.0
        assert progress() == Progress(2.0, "", False, False, 10.0)
        with anatomy.step():
            times.now = 8.0
            assert progress() == Progress(3.0, "", True, False, 10.0)
            with anatomy.stage("data"):
                times.now = 9.0
                assert progress() == Progress(4.0, "data", True, False, 10.0)
            with anatomy.stage("backward"), anatomy.collective():
                assert progress() == Progress(4.0, "backward", True, True, 10.0)
            assert progress() == Progress(4.0, "", True, False, 10.0)
            times.now = 12.0
        times.now = 13.0
        anatomy.hang_after = 2.5
        assert progress() == Progress(1.0, "", False, False, 2.5)
    assert progress() is None


def test_of_several_anatomies_a_step_in_any_is_progress_and_the_last_moved_speaks(
    times: StepClock,
) -> None:
    """A training and an evaluation anatomy: the seconds are since the latest step end of
    either; the stage, ``in_step`` and ``hang_after`` are those of the one whose step began
    or ended last; a collective in flight in either is waiting."""
    with StepAnatomy(window=HOUR, hang_after=60) as train:
        with StepAnatomy(window=HOUR, prefix="eval", hang_after=5) as evaluation:
            times.now = 1.0
            with train.step(), train.stage("optimizer"):
                times.now = 2.0
            times.now = 4.0
            assert progress() == Progress(2.0, "", False, False, 60.0)
            with train.step(), train.collective():
                times.now = 5.0
                with evaluation.step(), evaluation.stage("forward"):
                    times.now = 6.0
                    assert progress() == Progress(4.0, "forward", True, True, 5.0)
                assert progress() == Progress(0.0, "", False, True, 5.0)
                times.now = 7.0
            assert progress() == Progress(0.0, "", False, False, 60.0)
            times.now = 8.0
        assert progress() == Progress(1.0, "", False, False, 60.0)  # eval closed


def test_a_ddp_bucket_in_flight_is_waiting(times: StepClock) -> None:
    """A bucket launched (the comm hook's ``_timed``) is waiting until its future completes."""
    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    import torch

    with StepAnatomy(window=HOUR) as anatomy, anatomy.step(), anatomy.stage("backward"):
        future: Any = torch.futures.Future()
        anatomy._timed(0.0, future)
        assert progress() == Progress(0.0, "backward", True, True, 60.0)
        future.set_result(torch.ones(1))
        assert progress() == Progress(0.0, "backward", True, False, 60.0)


def test_hang_after_is_checked_when_set(times: StepClock) -> None:
    """Setting ``hang_after`` checks it as the argument is, and keeps the old value on error."""
    with StepAnatomy(window=HOUR, hang_after=3) as anatomy:
        with pytest.raises(TypeError, match="hang_after must be a number of seconds, not str"):
            anatomy.hang_after = "1"  # type: ignore[assignment]
        with pytest.raises(ValueError, match="hang_after must be a positive number of seconds"):
            anatomy.hang_after = 0
        assert anatomy.hang_after == 3.0


# -- dst's rule ------------------------------------------------------------------------------


def test_the_rank_not_waiting_is_named_once_per_hang(times: StepClock, dst: Dst) -> None:
    """dst (in backward, in a collective) and rank 1 wait; rank 2 is in its data stage. Once
    no step has ended on any rank for 10 s, rank 2 is named, once; after a step ends on it
    the rule re-arms, and names it again 10 s later, in its new stage."""
    with (
        StepAnatomy(window=HOUR, hang_after=10) as anatomy,
        anatomy.step(),
        anatomy.stage("backward"),
        anatomy.collective(),
    ):
        dst.hear(0.0, {1: entry(0.0), 2: entry(0.0, "data", waits=False)})
        dst.hear(9.0, {1: entry(9.0), 2: entry(9.0, "data", waits=False)})
        for now in (9.0, 9.5):
            times.now = now
            assert dst.watch(now) == []
        times.now = 10.0
        assert dst.watch(10.0) == [named(2, "data", 10.0, 1.0)]
        times.now = 30.0
        assert dst.watch(30.0) == []
        times.now = 31.0
        dst.hear(31.0, {2: entry(0.5, "forward", waits=False)})  # its step ended at 30.5
        assert dst.watch(31.0) == []
        times.now = 40.0
        assert dst.watch(40.0) == []
        times.now = 40.5
        assert dst.watch(40.5) == [named(2, "forward", 10.0, 9.5)]


def test_each_rank_is_held_to_its_own_hang_after(times: StepClock, dst: Dst) -> None:
    """A rank with ``hang_after`` 60 holds the rule back until it has 60 s without a step."""
    dst.hear(0.0, {1: entry(0.0, hang_after=60.0), 2: entry(0.0, "data", waits=False)})
    assert dst.watch(59.0) == []
    assert dst.watch(60.0) == [named(2, "data", 60.0, 60.0, waiting=1)]


def test_when_every_rank_waits_every_rank_is_named_waiting(
    times: StepClock, dst: Dst, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank in a collective (one some rank never called, or the network): each rank is
    named, ``waits`` True, with its stage, so a mismatch shows; one warning groups them by
    stage and says which were not heard of lately."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    with (
        StepAnatomy(window=HOUR, hang_after=10) as anatomy,
        anatomy.step(),
        anatomy.stage("backward"),
        anatomy.collective(),
    ):
        dst.hear(0.0, {1: entry(0.0), 2: entry(0.0, "eval")})
        times.now = 10.0
        assert dst.watch(10.0) == [
            named(0, "backward", 10.0, 0.0, waits=True, waiting=3),
            named(1, "backward", 10.0, 10.0, waits=True, waiting=3),
            named(2, "eval", 10.0, 10.0, waits=True, waiting=3),
        ]
    assert [r.getMessage() for r in caplog.records] == [
        "merge_stats_across_ranks: every rank (3) waits in a collective, and no step has ended "
        "on any for its hang_after (a collective not every rank called, or the network?): in "
        "stage 'backward': ranks 0, 1; in stage 'eval': rank 2; not heard of for 5 s or more: "
        "ranks 1, 2"
    ]


def test_the_warning_of_many_ranks_waiting_names_eight_of_each_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eleven ranks waiting in backward: one warning, naming eight of them and counting the
    rest; eleven events."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    d = Dst(size=12)
    try:
        d.hear(0.0, dict.fromkeys(range(1, 12), entry(0.0)))
        assert [e["rank"] for e in d.watch(4.0)] == []
        assert [e["rank"] for e in d.watch(10.0)] == list(range(1, 12))
    finally:
        d.close()
    assert [r.getMessage() for r in caplog.records] == [
        "merge_stats_across_ranks: every rank (11) waits in a collective, and no step has ended "
        "on any for its hang_after (a collective not every rank called, or the network?): in "
        "stage 'backward': ranks 1, 2, 3, 4, 5, 6, 7, 8 and 3 more; not heard of for 5 s or "
        "more: ranks 1, 2, 3, 4, 5, 6, 7, 8 and 3 more"
    ]


def test_a_silent_rank_is_named_in_its_last_stage_with_its_silence(
    times: StepClock, dst: Dst, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 2, last heard of in forward 4 s after its last step, says nothing more (dead or
    stopped): its seconds grow on dst's clock, and it is named with how long it was silent,
    the warning saying so; rank 1's warning says it is between steps."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    with (
        StepAnatomy(window=HOUR, hang_after=10) as anatomy,
        anatomy.step(),
        anatomy.stage("backward"),
        anatomy.collective(),
    ):
        dst.hear(0.0, {2: entry(4.0, "forward", waits=False)})
        dst.hear(5.0, {1: entry(1.0, "", in_step=False, waits=False)})
        times.now = 15.0
        assert dst.watch(15.0) == [
            named(1, "", 11.0, 10.0, in_step=False, waiting=1),
            named(2, "forward", 19.0, 15.0, waiting=1),
        ]
    assert [r.getMessage() for r in caplog.records] == [
        "merge_stats_across_ranks: rank 1 () holds the job up between steps; 1 rank(s) wait in "
        "a collective: no step has ended on it for 11.0 s, nor on any rank for its hang_after; "
        "not heard of for 10.0 s (dead or stopped?)",
        "merge_stats_across_ranks: rank 2 () holds the job up in stage 'forward'; 1 rank(s) "
        "wait in a collective: no step has ended on it for 19.0 s, nor on any rank for its "
        "hang_after; not heard of for 15.0 s (dead or stopped?)",
    ]


def test_the_warnings_say_who_where_and_how_long(
    times: StepClock, dst: Dst, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank heard of lately holding the job up in a stage; ranks all waiting, in one
    warning."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    dst.hear(9.0, {1: entry(9.0), 2: entry(9.0, "data", waits=False)})
    dst.watch(10.0)
    dst.hear(11.0, {2: entry(0.0)})  # its step ended: re-armed
    dst.watch(11.0)
    dst.watch(21.0)
    assert [r.getMessage() for r in caplog.records] == [
        "merge_stats_across_ranks: rank 2 () holds the job up in stage 'data'; 1 rank(s) wait "
        "in a collective: no step has ended on it for 10.0 s, nor on any rank for its "
        "hang_after",
        "merge_stats_across_ranks: every rank (2) waits in a collective, and no step has ended "
        "on any for its hang_after (a collective not every rank called, or the network?): in "
        "stage 'backward': ranks 1, 2; not heard of for 5 s or more: ranks 1, 2",
    ]


def test_ranks_with_no_anatomy_or_done_are_left_out(times: StepClock, dst: Dst) -> None:
    """Rank 1 reports no anatomy (null) and rank 2 said goodbye: dst's own anatomy, between
    steps since it opened, is the only one the rule reads, named alone with no rank waiting;
    with nothing reporting, nothing is ever named."""
    dst.hear(0.0, {1: entry(0.0), 2: entry(0.0, "data", waits=False)})
    dst.hear(1.0, {1: None})
    dst.hear(1.0, {2: entry(1.0, "data", waits=False)}, bye=True)
    assert dst.watch(1000.0) == []
    with StepAnatomy(window=HOUR, hang_after=10):
        times.now = 10.0
        assert dst.watch(10.0) == [named(0, "", 10.0, 0.0, in_step=False, waiting=0)]
    assert dst.watch(2000.0) == []


def test_a_leader_passes_its_host_s_progress_on_grown_by_the_time_it_held_it(
    times: StepClock,
) -> None:
    """Rank 3's progress, held 2.5 s by its leader (rank 2, no anatomy: null), reaches dst
    with its seconds and silence grown by those 2.5 s; dst names it with both grown on its
    own clock too; the leader's word that rank 3 said goodbye takes it out."""
    with monitor.EventBus() as bus:
        leader = merge_on(bus, 2, 4, upstream=ROUTES)
        leader._note_progress(3, message({3: entry(1.0, "data", waits=False)}), 0.0)
        text = leader._progress_out(2.5)
        assert text == '{"2":null,"3":[3.5,2.5,"data",true,false,10.0]}'
    d = Dst(size=4)
    try:
        d.hear(5.0, {1: entry(5.0)})
        d.merge._note_progress(2, {"bye": False, "progress": json.loads(text)}, 5.0)
        assert d.watch(11.0) == []
        assert d.watch(11.5) == [named(3, "data", 10.0, 9.0, waiting=1)]
        leader._note_progress(3, message({}, bye=True), 12.0)
        assert leader._progress_out(12.0) == '{"2":null,"3":null}'
        d.merge._note_progress(2, {"bye": False, "progress": {"2": None, "3": None}}, 12.0)
        d.hear(12.0, {1: entry(0.0)})
        assert d.watch(12.0) == []  # a step ended on rank 1: re-armed
        assert d.watch(100.0) == [named(1, "backward", 88.0, 88.0, waits=True, waiting=1)]
    finally:
        d.close()


# -- on the wire -----------------------------------------------------------------------------


def test_progress_travels_with_the_mark_in_a_frame_of_its_own_if_it_must(
    times: StepClock,
) -> None:
    """A rank's progress goes in the last frame, beside its mark; a window that leaves no room
    for both goes in a frame before, and every frame is within ``FRAME_BYTES``."""
    with monitor.EventBus() as bus:
        merge = merge_on(bus, 1, 3)
        with (
            StepAnatomy(window=HOUR, hang_after=10) as anatomy,
            anatomy.step(),
            anatomy.stage("data"),
        ):
            times.now = 1.25
            progress_text = merge._progress_out(0.0)
        assert progress_text == '{"1":[1.25,0.0,"data",true,false,10.0]}'
        [(frame, sent)] = merge._frames([], 7.0, False, "", progress_text)
        assert decode(frame) == {
            "mark": 7.0,
            "bye": False,
            "windows": [],
            "progress": {"1": [1.25, 0.0, "data", True, False, 10.0]},
        }
        [small] = closed_records("x", [monitor.Aggregation.MEAN], [[1.0]], 7)
        room = _frame._ROOM - len(json.dumps(small))
        [record] = closed_records("x" * (room + 1 - 20), [monitor.Aggregation.MEAN], [[1.0]], 7)
        frames = merge._frames([record], 7.0, False, "", progress_text)
        assert [len(sent) for _, sent in frames] == [1, 0]
        assert all(len(frame) <= _frame.FRAME_BYTES for frame, _ in frames)
        assert [decode(frame)["mark"] for frame, _ in frames] == [None, 7.0]
        assert "progress" in decode(frames[1][0])


def test_long_stage_names_are_cut_and_a_host_s_progress_over_half_a_frame_is_left_out(
    times: StepClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A stage name travels cut to 64 characters; a leader whose host's progress takes over
    half a frame sends none (warned once), not a frame too long."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    with monitor.EventBus() as bus:
        merge = merge_on(bus, 2, 4, upstream=ROUTES)
        with StepAnatomy(window=HOUR) as anatomy, anatomy.step(), anatomy.stage("s" * 100):
            assert json.loads(merge._progress_out(0.0))["2"][2] == "s" * 64
        for rank in range(4, 104):
            merge._progress[rank] = (entry(0.0, "s" * 64), 0.0)
        assert merge._progress_out(0.0) == ""
        assert merge._progress_out(0.0) == ""
    expected = {"2": None, **{str(r): entry(0.0, "s" * 64) for r in range(4, 104)}}
    size = len(json.dumps(expected, separators=(",", ":")))
    assert [r.getMessage() for r in caplog.records] == [
        f"merge_stats_across_ranks: rank 2: the progress of 101 ranks takes {size} bytes, over "
        "half a frame: it is left out of the messages upstream, and the hang rule goes without it"
    ]
