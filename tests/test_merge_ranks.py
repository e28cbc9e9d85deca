"""merge_stats_across_ranks in real torchrun jobs of three CPU ranks on gloo (tests/merge_ranks_job.py).

Each job's ranks write what they added, every window their Stats closed, the merge's counters,
and (through a JsonlEventHandler on their bus) what they logged; the tests compare them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import monitor_bus as monitor
from tests.conftest import require

JOB = Path(__file__).resolve().parent / "merge_ranks_job.py"
ROOT = JOB.parent.parent


def torchrun_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return (
        dist.is_available()
        and shutil.which("torchrun", path=os.path.dirname(sys.executable)) is not None
    )


def run_job(tmp_path: Path, *args: str, script: Path = JOB) -> subprocess.CompletedProcess[str]:
    require(torchrun_available(), "torch with torch.distributed is not installed")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            torchrun,
            "--nproc_per_node=3",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,  # well over a job's few seconds plus the merge's 2 s, on a loaded machine
        env=env,
        cwd=tmp_path,
    )


def load(tmp_path: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
    return result


def events(tmp_path: Path, rank: int, name: str = monitor.STAT_EVENT) -> list[dict[str, Any]]:
    """The data of the events named ``name`` that ``rank``'s bus logged."""
    return [
        dict(e.data) for e in monitor.read_jsonl(tmp_path / f"rank{rank}.jsonl") if e.name == name
    ]


WINDOW = 0.25  # as in merge_ranks_job.py
AGGS = {
    "loss": ["value", "mean", "count", "sum", "max", "min"],
    "grad": ["mean"],
    "step_time": ["mean"],
}


def spread(name: str, members: list[tuple[int, list[Any]]]) -> dict[str, Any]:
    """The spread keys: min, median and max of the ranks' window means, and the slowest rank."""
    means = {rank: w[3] / w[2] for rank, w in members}
    slowest = max(means.values())
    return {
        f"{name}.rank_min": min(means.values()),
        f"{name}.rank_p50": statistics.median(means.values()),
        f"{name}.rank_max": slowest,
        f"{name}.slowest_rank": min(rank for rank, mean in means.items() if mean == slowest),
    }


def expected_events(
    windows: list[tuple[int, list[Any]]], *, with_spread: bool = True
) -> Counter[str]:
    """The merged events the ranks' closed windows make: (rank, window) pairs in, as JSON."""
    groups: dict[tuple[str, int], list[tuple[int, list[Any]]]] = {}
    for rank, w in windows:
        groups.setdefault((w[0], w[1]), []).append((rank, w))
    out: Counter[str] = Counter()
    for (name, _), members in groups.items():
        count = sum(w[2] for _, w in members)
        total = sum(w[3] for _, w in members)
        last = max(members, key=lambda m: (m[1][7], m[0]))[1]  # a tie: the higher rank
        values = {
            "value": last[6],
            "mean": total / count,
            "count": count,
            "sum": total,
            "max": max(w[4] for _, w in members),
            "min": min(w[5] for _, w in members),
        }
        data: dict[str, Any] = {f"{name}.{agg}": values[agg] for agg in AGGS[name]}
        data[f"{name}.ranks"] = len({rank for rank, _ in members})
        if with_spread:
            data.update(spread(name, members))
        out[json.dumps(data, sort_keys=True)] += 1
    return out


def as_counter(data: list[dict[str, Any]]) -> Counter[str]:
    return Counter(json.dumps(d, sort_keys=True) for d in data)


def test_every_window_of_every_rank_is_merged_exactly_once(tmp_path: Path) -> None:
    """dst logs one event per (Stat, window) equal to the merge of every rank's windows, whose counts and sums are every sample added, the last ones included (close() flushes them); the other ranks log nothing."""
    proc = run_job(tmp_path, str(tmp_path), "normal")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [load(tmp_path, r) for r in range(3)]
    merged = [d for d in events(tmp_path, 0) if "latency.count" not in d]
    for rank, result in enumerate(results):
        assert result["finished"] is True
        for name in ("loss", "grad"):
            own = [w for w in result["closed"] if w[0] == name]
            assert sum(w[2] for w in own) == len(result["added"][name])
            assert sum(w[3] for w in own) == sum(result["added"][name])
        if rank:
            assert events(tmp_path, rank) == []
            assert result["counters"]["sent"] == len(result["closed"])
    windows = [
        (rank, w)
        for rank, result in enumerate(results)
        for w in result["closed"]
        if w[0] != "latency"
    ]
    for _, w in windows:  # on the wall clock: open when it closed (close() ends one early)
        end = w[1] * WINDOW
        assert end - WINDOW <= w[7] < end + 30
    assert as_counter(merged) == expected_events(windows)
    loss = [d for d in merged if "loss.count" in d]
    assert len(loss) == len({w[1] for _, w in windows if w[0] == "loss"})  # one per window
    added = [v for result in results for v in result["added"]["loss"]]
    assert sum(d["loss.count"] for d in loss) == len(added)
    assert sum(d["loss.sum"] for d in loss) == sum(added)
    assert max(d["loss.max"] for d in loss) == max(added)
    assert min(d["loss.min"] for d in loss) == min(added)
    assert {d["grad.ranks"] for d in merged if "grad.mean" in d} <= {1, 2}  # rank 1 adds none
    counters = results[0]["counters"]
    assert counters["merged"] == len(merged) + 1  # and the latency window
    assert counters["received"] == len(results[1]["closed"]) + len(results[2]["closed"])
    quiet = ("missing", "late", "local", "unsent", "errors")
    assert [counters[k] for k in quiet] == [0] * len(quiet)

    # The distribution: one window of every rank's samples (they differ by rank), its
    # percentiles read from the ranks' Histograms merged, its STDDEV from their moments.
    (latency,) = [d for d in events(tmp_path, 0) if "latency.count" in d]
    samples = sorted(v for result in results for v in result["added"]["latency"])
    assert latency["latency.count"] == len(samples) == 3 * 120
    assert latency["latency.ranks"] == 3
    for q in (0.5, 0.99):
        exact = samples[math.ceil(q * len(samples)) - 1]
        assert latency[f"latency.p{round(q * 100)}"] == pytest.approx(exact, rel=0.01)
    assert latency["latency.stddev"] == pytest.approx(statistics.pstdev(samples), rel=1e-9)


def test_interpreter_exit_closes_a_merge_left_open(tmp_path: Path) -> None:
    """With no rank calling close(), exit still merges every rank's last windows on dst."""
    proc = run_job(tmp_path, str(tmp_path), "at_exit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [load(tmp_path, r) for r in range(3)]
    merged = events(tmp_path, 0)
    added = [v for result in results for v in result["added"]["loss"]]
    assert sum(d["loss.count"] for d in merged if "loss.count" in d) == len(added)
    assert sum(d["loss.sum"] for d in merged if "loss.sum" in d) == sum(added)
    assert "did not finish" not in proc.stderr


def test_a_rank_that_exits_costs_only_what_it_had_not_sent(tmp_path: Path) -> None:
    """With rank 2 gone halfway, rank 1 finishes, dst names rank 2 lost, merges every window of 0 and 1 with a prefix of rank 2's, and its close says (returns False, names rank 2) that rank 2's last windows never came."""
    proc = run_job(tmp_path, str(tmp_path), "peer_dies")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [load(tmp_path, r) for r in range(3)]
    assert results[0]["finished"] is False
    assert results[0]["unfinished"] == [2]
    assert results[1]["finished"] is True
    assert results[0]["lost"] == [2]
    assert "rank 2 silent for" in proc.stderr
    assert "closed without the last windows of rank(s) 2" in proc.stderr
    merged = as_counter(events(tmp_path, 0))
    live = [(rank, w) for rank in (0, 1) for w in results[rank]["closed"]]
    dead = results[2]["closed"]
    matches = [
        n
        for n in range(len(dead) + 1)
        if merged == expected_events(live + [(2, w) for w in dead[:n]])
    ]
    # Rank 2 sent its windows in order: what dst merged is the live ranks' windows and the
    # first of rank 2's, one cut-off only.
    assert len(matches) == 1
    assert matches[0] >= 1
    assert results[0]["counters"]["late"] == 0


def test_when_dst_is_gone_each_rank_logs_its_own_windows_marked(tmp_path: Path) -> None:
    """With dst gone halfway, ranks 1 and 2 log the windows they could not send on their own bus, marked with their rank, and every window is either sent or logged."""
    proc = run_job(tmp_path, str(tmp_path), "dst_dies")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot reach dst rank 0" in proc.stderr
    for rank in (1, 2):
        assert_logged_what_it_could_not_send(tmp_path, rank)


def assert_logged_what_it_could_not_send(tmp_path: Path, rank: int) -> None:
    """``rank`` finished, sent its first windows and logged the rest itself, each marked with
    its rank: every window it closed is sent or logged, once."""
    result = load(tmp_path, rank)
    assert result["finished"] is True
    counters = result["counters"]
    closed = result["closed"]
    local = events(tmp_path, rank)
    assert counters["local"] == len(local) >= 1
    assert counters["sent"] + counters["local"] == len(closed)
    unsent = [(rank, w) for w in closed[counters["sent"] :]]
    expected: Counter[str] = Counter()
    for _, w in unsent:
        one = json.loads(next(iter(expected_events([(rank, w)], with_spread=False))))
        one[f"{w[0]}.rank"] = rank
        expected[json.dumps(one, sort_keys=True)] += 1
    assert as_counter(local) == expected
    assert sum(w[2] for w in closed if w[0] == "loss") == len(result["added"]["loss"])


def test_arguments_are_checked_before_anything_starts() -> None:
    """Bad arguments and a missing process group raise clear errors naming what is wrong."""
    require(torchrun_available(), "torch with torch.distributed is not installed")
    from monitor_bus.integrations.torch import merge_stats_across_ranks

    with pytest.raises(TypeError, match="bus must be"):
        merge_stats_across_ranks(bus="bus")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst must be an int"):
        merge_stats_across_ranks(dst=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dst must be at least 0"):
        merge_stats_across_ranks(dst=-1)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        merge_stats_across_ranks(timeout=0)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        merge_stats_across_ranks(timeout=math.nan)
    with pytest.raises(TypeError, match="keep_local must be a bool"):
        merge_stats_across_ranks(keep_local=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spread must be a bool"):
        merge_stats_across_ranks(spread=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stragglers must be a mapping"):
        merge_stats_across_ranks(stragglers=["step_time"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stragglers keys must be Stat names"):
        merge_stats_across_ranks(stragglers={1: 2.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"stragglers\['step_time'\] must be a number"):
        merge_stats_across_ranks(stragglers={"step_time": "2"})  # type: ignore[dict-item]
    for factor in (1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"stragglers\['step_time'\] must be a finite factor"):
            merge_stats_across_ranks(stragglers={"step_time": factor})
    with pytest.raises(ValueError, match="straggler_windows must be at least 1"):
        merge_stats_across_ranks(straggler_windows=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        merge_stats_across_ranks()


def test_the_torchrun_example_merges_every_rank_s_samples(tmp_path: Path) -> None:
    """examples/torchrun_merge.py under torchrun: rank 0 prints merged windows holding every sample of the three ranks."""
    example = ROOT / "examples" / "torchrun_merge.py"
    proc = run_job(tmp_path, "--steps", "150", script=example)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].endswith(" merged windows; 450 loss samples of 450 added"), proc.stdout
    assert any(line.endswith(" from 3 ranks") for line in lines[:-1])


def test_a_hung_dst_is_given_up_at_close_and_nothing_is_delivered_twice(
    tmp_path: Path,
) -> None:
    """With dst stopped until after their close, ranks 1 and 2 give it up at their close's deadline and log their unsent windows locally; once dst resumes, it merged exactly the windows they count as sent."""
    proc = run_job(tmp_path, str(tmp_path), "dst_hangs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [load(tmp_path, r) for r in range(3)]
    sent_samples = 0
    for rank in (1, 2):
        counters, closed = results[rank]["counters"], results[rank]["closed"]
        assert results[rank]["finished"] is True
        assert counters["local"] == len(events(tmp_path, rank)) >= 1
        assert counters["sent"] + counters["local"] == len(closed)
        sent_samples += sum(w[2] for w in closed[: counters["sent"]] if w[0] == "loss")
    merged = events(tmp_path, 0)
    own = len(results[0]["added"]["loss"])
    assert sum(d["loss.count"] for d in merged if "loss.count" in d) == own + sent_samples
    assert results[0]["lost"] == [1, 2]


def test_a_starved_host_leader_and_its_rank_rejoin_and_every_window_reaches_dst(
    tmp_path: Path,
) -> None:
    """Two nodes of 2 ranks; the second node's leader (rank 2) stopped past the timeout and resumed while dst closes: dst names it lost and takes it back, rank 3 holds its windows while its leader takes none (warned) and sends them once it runs again, none logged locally; every close returns True and dst names no rank lost or unfinished: every sample of every rank reaches dst, in a merged window or one logged on its own (late), and the windows merged without the leader's host count as missing."""
    outputs = run_nodes(tmp_path, str(tmp_path), "starved")
    dst_err, node_err = outputs[0][1], outputs[1][1]
    assert "rank 2 silent for" in dst_err
    assert "rank 2 is heard from again" in dst_err
    assert "rank 3: its host's leader rank 2 has taken no message for" in node_err
    results = [load(tmp_path, r) for r in range(4)]
    assert [r["upstream"] for r in results] == [0, 0, 0, 2]
    assert [r["finished"] for r in results] == [True] * 4
    assert (results[0]["lost"], results[0]["unfinished"]) == ([], [])
    assert (results[2]["lost"], results[2]["unfinished"]) == ([], [])
    assert [r["counters"]["local"] for r in results] == [0] * 4
    merged = events(tmp_path, 0)
    added = [v for result in results for v in result["added"]["loss"]]
    assert sum(d["loss.count"] for d in merged if "loss.count" in d) == len(added)
    assert sum(d["loss.sum"] for d in merged if "loss.sum" in d) == sum(added)
    counters = results[0]["counters"]
    assert counters["missing"] >= 1
    assert counters["late"] >= 1
    # Late windows are marked, hold no spread, and are not counted as merged.
    late = [d for d in merged if any(k.endswith(".late") for k in d)]
    assert late
    assert all(not any(k.endswith(".rank_p50") for k in d) for d in late)
    assert counters["merged"] == len(merged) - len(late)
    assert counters["received"] == sum(len(results[r]["closed"]) for r in (1, 2, 3))
    assert [results[r]["counters"]["sent"] for r in (1, 2, 3)] == [
        len(results[r]["closed"]) for r in (1, 2, 3)
    ]
    assert results[2]["counters"]["relayed"] == len(results[3]["closed"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_nodes(
    tmp_path: Path, *args: str, script: Path = JOB, ranks: tuple[int, int] = (2, 2)
) -> list[tuple[str, str]]:
    """``script`` (merge_ranks_job.py) as two torchrun "nodes" on this machine, of ``ranks``
    ranks each: (stdout, stderr) of each node's torchrun, both asserted to exit 0."""
    require(torchrun_available(), "torch with torch.distributed is not installed")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes=2",
                f"--node_rank={node}",
                f"--nproc_per_node={ranks[node]}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(script),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=120) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    return outputs


def test_two_nodes_merge_exactly_and_name_the_straggler_once_then_its_recovery(
    tmp_path: Path,
) -> None:
    """Two torchrun "nodes" of 2 ranks on one machine, so the two-level shape: rank 2 merges its node's windows for dst, and global rank 0 logs every window exactly as the flat merge of every rank's windows, with the spread across ranks; rank 3, slow for a while behind its leader, is named a straggler once (event, warning, TensorBoard text, `monitor-bus summary`) with its host, then once recovered."""
    outputs = run_nodes(tmp_path, str(tmp_path), "straggler")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = [load(tmp_path, r) for r in range(4)]
    host = socket.gethostname()
    assert [r["hosts"] for r in results] == [[host] * 4] * 4
    windows = [(rank, w) for rank, result in enumerate(results) for w in result["closed"]]
    assert as_counter(events(tmp_path, 0)) == expected_events(windows)
    added = [v for result in results for v in result["added"]["step_time"]]
    merged = [d for d in events(tmp_path, 0) if "step_time.mean" in d]
    assert {d["step_time.slowest_rank"] for d in merged if d["step_time.rank_max"] == 3.0} == {3}
    assert sum(results[r]["counters"]["sent"] for r in range(4)) == len(windows)
    # Two levels: rank 3 sends to its node's leader, which sends every window of it on to dst.
    assert [r["upstream"] for r in results] == [0, 0, 0, 2]
    counters = [r["counters"] for r in results]
    assert counters[2]["received"] == counters[2]["relayed"] == len(results[3]["closed"])
    assert counters[0]["received"] == sum(len(results[r]["closed"]) for r in (1, 2, 3))
    assert [(c["missing"], c["late"], c["local"]) for c in counters] == [(0, 0, 0)] * 4
    assert len(added) == 4 * 160

    named, recovered = events(tmp_path, 0, "monitor_bus.straggler")
    assert named == {
        "stat": "step_time",
        "rank": 3,
        "ratio": 3.0,  # a full slow window: 3.0 over the others' 1.0
        "windows": 2,
        "host": host,
        "recovered": False,
    }
    assert (recovered["stat"], recovered["rank"], recovered["host"]) == ("step_time", 3, host)
    assert recovered["recovered"] is True
    assert recovered["ratio"] <= 1.5
    assert recovered["windows"] >= 2
    assert f"rank 3 ({host}) is a straggler" in outputs[0][1]
    assert f"rank 3 ({host}) has recovered" in outputs[0][1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("stragglers")]
    assert len(texts) == 2
    assert "| rank | 3 |" in texts[0]
    assert "| recovered | False |" in texts[0]
    assert "| recovered | True |" in texts[1]

    summary = subprocess.run(
        [sys.executable, "-m", "monitor_bus", "summary", str(tmp_path / "rank0.jsonl")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    lines = summary.split("stragglers\n", 1)[1].splitlines()
    assert lines[0].endswith(
        f"  straggler  stat step_time  rank 3 ({host})  3.00x the median  2 windows"
    )
    assert f"  recovered  stat step_time  rank 3 ({host})  " in lines[1]


def test_a_dead_host_leader_costs_its_host_only_what_was_in_flight(tmp_path: Path) -> None:
    """Two nodes of 2 ranks, the second node's leader (rank 2) gone halfway: rank 3 logs the windows it cannot send on its own bus, marked; dst names rank 2 lost with its host (lost_ranks 2 and 3, close unfinished for both), merges every window of ranks 0 and 1 with a prefix of each of 2's and 3's, and counts the windows merged without them in missing."""
    outputs = run_nodes(tmp_path, str(tmp_path), "leader_dies")
    dst_err, node_err = outputs[0][1], outputs[1][1]
    assert "cannot reach its host's leader rank 2" in node_err
    assert_logged_what_it_could_not_send(tmp_path, 3)
    results = [load(tmp_path, r) for r in range(4)]
    assert [r["upstream"] for r in results] == [0, 0, 0, 2]
    assert "rank 2 silent for" in dst_err
    assert "merged without rank(s) 2, 3" in dst_err
    assert (results[0]["finished"], results[0]["lost"], results[0]["unfinished"]) == (
        False,
        [2, 3],
        [2, 3],
    )
    assert results[0]["counters"]["missing"] >= 1
    assert results[1]["finished"] is True
    merged = as_counter(events(tmp_path, 0))
    live = [(rank, w) for rank in (0, 1) for w in results[rank]["closed"]]
    dead, behind = results[2]["closed"], results[3]["closed"][: results[3]["counters"]["sent"]]
    matches = [
        (two, three)
        for two in range(len(dead) + 1)
        for three in range(len(behind) + 1)
        if merged
        == expected_events(live + [(2, w) for w in dead[:two]] + [(3, w) for w in behind[:three]])
    ]
    # The leader sent its host's windows on in order: one cut-off each.
    assert len(matches) == 1
    assert min(matches[0]) >= 1


def test_the_find_slow_rank_example_names_the_slow_rank_once_then_its_recovery(
    tmp_path: Path,
) -> None:
    """examples/find_slow_rank.py under torchrun: rank 0 names rank 2 (slowed on purpose, 8 times the others' step) a straggler once, with its host, then once recovered, and the spread names it slowest."""
    proc = run_job(tmp_path, script=ROOT / "examples" / "find_slow_rank.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    host = socket.gethostname()
    named = [line.split(",")[0] for line in lines if line.startswith(("straggler", "recovered"))]
    assert named == [f"straggler: rank 2 on {host}", f"recovered: rank 2 on {host}"]
    assert any(line.endswith("(rank 2)") for line in lines)


# -- dst's and a sender's bookkeeping, without torchrun: a RankMerge whose ``dist`` only names
# the rank and world size (nothing here sends or receives) --


class _World:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.size


def closed_records(
    name: str, aggs: list[monitor.Aggregation], per_rank: list[list[float]], index: int
) -> list[list[Any]]:
    """The merge records of one window of Stat ``name`` per rank, each with ``per_rank``'s
    samples, as window ``index``."""
    from datetime import timedelta

    from monitor_bus import _stat
    from monitor_bus.ranks._frame import _record

    closed: list[Any] = []
    # The Stat clock stands still, so a slow loop cannot cross a window boundary.
    with pytest.MonkeyPatch.context() as mp, monitor.EventBus() as bus:
        mp.setattr(_stat, "_clock", lambda: 1.0)
        bus._window_tap = lambda w: (closed.append(w), True)[1]
        for values in per_rank:
            stat = monitor.Stat(name, aggs, timedelta(seconds=10), bus=bus)
            for v in values:
                stat.add(v)
            stat._close()
    records = []
    for window in closed:
        window.resolve()
        record = _record(window)
        record[3] = index
        records.append(record)
    return records


def merge_on(bus: monitor.EventBus, rank: int, size: int, **kwargs: Any) -> Any:
    from monitor_bus.ranks import RankMerge

    return RankMerge(bus, _World(rank, size), None, 0, 5.0, False, **kwargs)


def merge_due(merge: Any) -> None:
    """dst's round but for receiving: log the windows that are due."""
    merge._log_merged(merge._due(merge._now(), final=False))


def decode(frame: bytes) -> dict[str, Any]:
    (length,) = __import__("struct").unpack_from("<I", frame)
    assert 4 + length <= FRAME
    result: dict[str, Any] = json.loads(frame[4 : 4 + length])
    return result


FRAME = 16384  # monitor_bus.ranks.FRAME_BYTES


def test_a_window_too_wide_for_a_frame_is_sent_with_its_histogram_coarsened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A two-signed window over 32 octaves (scale 6, 2047 buckets a sign of 10 samples each:
    over 16 KB of JSON) reaches dst with every sample, its Histogram a scale coarser, warned
    once per Stat."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    values = [s * 2 ** (k / 64) for k in range(-1023, 1024) for s in (1.0, -1.0)] * 10
    aggs = [monitor.Aggregation.MEAN, monitor.Aggregation.P99]
    fine = monitor.Histogram.of(values)
    assert (fine.scale, len(fine.positive_counts), len(fine.negative_counts)) == (6, 2047, 2047)
    coarse = fine.merge(monitor.Histogram(max_buckets=2046))  # one scale coarser
    with monitor.EventBus() as bus:
        merge = merge_on(bus, 1, 2)
        for _ in range(2):
            [record] = closed_records("adv", aggs, [values], 7)
            frames = merge._frames([record], 0.0, False)
            assert [len(sent) for _, sent in frames] == [1]
            [sent] = decode(frames[0][0])["windows"]
            histogram = monitor.Histogram.from_dict(sent[11])
            assert (histogram.count, histogram.sum, sent[4]) == (len(values), fine.sum, len(values))
            assert coarse.scale == 5
            assert histogram == monitor.Histogram.from_dict(
                {**coarse.to_dict(), "max_buckets": 2048}
            )
            from monitor_bus.ranks._frame import _quantile_error

            p99 = sorted(values)[math.ceil(0.99 * len(values)) - 1]
            assert abs(histogram.quantile(0.99) / p99 - 1) <= _quantile_error(5)
    assert (merge.local, merge.unsent) == (0, 0)
    warnings = [r.getMessage() for r in caplog.records if "too large" in r.getMessage()]
    assert warnings == [
        "merge_stats_across_ranks: a window of Stat 'adv' is too large for a 16384-byte frame: "
        "rank 1 sent its Histogram at scale 5 (from 6), its percentiles within 1.1% (see "
        "docs/multihost.md)"
    ]


@pytest.mark.parametrize("histogram", [False, True], ids=["sum", "sum+histogram"])
def test_a_window_no_frame_can_carry_is_logged_by_its_rank_and_counted_unsent(
    caplog: pytest.LogCaptureFixture, histogram: bool
) -> None:
    """A Stat name longer than a frame: the window is logged by its rank (its Histogram at
    full resolution), marked with the rank, counted in ``unsent`` (not ``local``, which means
    dst is gone) and warned."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    name = "x" * FRAME
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 1, 2)
        aggs = [monitor.Aggregation.SUM] + [monitor.Aggregation.HISTOGRAM] * histogram
        [record] = closed_records(name, aggs, [[1.0, 2.0]], 7)
        frames = merge._frames([record], 0.0, False)
        bus.flush()
    assert [len(sent) for _, sent in frames] == [0]
    assert merge.local == 0
    assert merge.unsent == 1
    whole = {f"{name}.histogram": monitor.Histogram.of([1.0, 2.0])} if histogram else {}
    assert [e.data for e in seen] == [
        {f"{name}.sum": 3.0, **whole, f"{name}.ranks": 1, f"{name}.rank": 1}
    ]
    assert any("does not fit" in r.getMessage() for r in caplog.records)


def test_a_late_window_is_logged_marked_late_and_is_not_counted_merged() -> None:
    """Rank 1's window arriving after its window was merged without it: logged on its own with
    ``"<name>.late": True`` and no spread keys; counted in ``late``, not ``merged``."""
    aggs = [monitor.Aggregation.MEAN, monitor.Aggregation.P99]
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 2)
        index = math.floor(merge._now() / 10.0) - 1  # the window that just ended
        first, late = closed_records("step", aggs, [[1.0, 1.0, 1.0], [9.0, 9.0]], index)
        merge._take(0, first)
        merge._mark[0] = math.inf
        merge._lost.add(1)  # silent past the timeout: merged without it
        merge_due(merge)
        merge._lost.discard(1)  # heard from again
        merge._take(1, late)
        merge_due(merge)
        bus.flush()
    assert [e.data for e in seen] == [
        {
            "step.mean": 1.0,
            "step.p99": 1.0,
            "step.ranks": 1,
            "step.rank_min": 1.0,
            "step.rank_p50": 1.0,
            "step.rank_max": 1.0,
            "step.slowest_rank": 0,
        },
        {"step.mean": 9.0, "step.p99": 9.0, "step.ranks": 1, "step.late": True},
    ]
    assert (merge.merged, merge.late, merge.missing) == (1, 1, 1)


def merge_windows(
    merge: Any, aggs: list[monitor.Aggregation], per_rank: list[list[float]], windows: int
) -> None:
    """dst merges ``windows`` past windows of Stat "step_time", each rank with its samples."""
    for window in range(windows):
        index = math.floor(merge._now() / 10.0) - 10 + window
        for rank, record in enumerate(closed_records("step_time", aggs, per_rank, index)):
            merge._take(rank, record)
        merge._mark = dict.fromkeys(range(len(per_rank)), math.inf)
        merge_due(merge)


@pytest.mark.parametrize(
    "aggs",
    [
        [monitor.Aggregation.P50, monitor.Aggregation.P99, monitor.Aggregation.HISTOGRAM],
        [monitor.Aggregation.STDDEV],
    ],
    ids=["percentiles", "stddev"],
)
def test_stragglers_are_named_on_a_stat_without_mean_from_its_distribution(
    aggs: list[monitor.Aggregation],
) -> None:
    """A watched Stat without MEAN or SUM: each rank's mean comes from its window's Histogram
    or moments, so rank 2, three times slower, is named after three windows."""
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 3, stragglers={"step_time": 1.25}, straggler_windows=3)
        merge_windows(merge, aggs, [[1.0] * 10, [1.0] * 10, [3.0] * 10], 3)
        bus.flush()
    assert [e.data for e in seen if e.name == "monitor_bus.straggler"] == [
        {"stat": "step_time", "rank": 2, "ratio": 3.0, "windows": 3, "host": "", "recovered": False}
    ]


def test_stragglers_on_a_stat_whose_windows_hold_no_mean_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watched Stat of MAX alone carries no mean: dst says so (once), names nobody."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 2, stragglers={"step_time": 1.25}, straggler_windows=1)
        merge_windows(merge, [monitor.Aggregation.MAX], [[1.0], [3.0]], 2)
        bus.flush()
    assert [e.name for e in seen] == [monitor.STAT_EVENT] * 2
    warnings = [r.getMessage() for r in caplog.records if "hold no mean" in r.getMessage()]
    assert warnings == [
        "merge_stats_across_ranks: stragglers['step_time'] watches a Stat whose windows hold "
        "no mean (aggregations MAX): add MEAN, SUM, STDDEV, a percentile or HISTOGRAM to it to "
        "have its stragglers named"
    ]


# -- the two-level shape, without torchrun: a host leader's merge sent on to dst as one record --

# Two torchrun nodes of 2 ranks on one machine, as the two-node tests run them.
NODES = [("vm", "0"), ("vm", "0"), ("vm", "1"), ("vm", "1")]
ROUTES = {0: 0, 1: 0, 2: 0, 3: 2}


def test_ranks_route_to_their_node_s_leader_and_the_default_shape_follows_the_nodes() -> None:
    """Each rank sends to the lowest rank of its node (dst's node: dst), the leaders to dst;
    two nodes on one machine are two hosts. By default the shape is two-level once a node
    other than dst's runs two ranks, flat otherwise; True and False force it."""
    from monitor_bus.ranks._start import _routes

    assert _routes(NODES, 0, None) == ROUTES
    assert _routes(NODES, 3, None) == {0: 3, 1: 0, 2: 3, 3: 3}
    three = [("a", "0"), ("b", "1"), ("b", "1"), ("b", "1"), ("c", "2"), ("c", "2")]
    assert _routes(three, 0, None) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 4}
    assert _routes(NODES, 0, False) is None
    assert _routes([("vm", "")] * 3, 0, None) is None  # one host
    assert _routes([("a", ""), ("b", ""), ("c", "")], 0, None) is None  # one rank a host
    assert _routes([("a", ""), ("b", ""), ("c", "")], 0, True) == {0: 0, 1: 0, 2: 0}
    assert _routes([("a", "")] * 2 + [("b", "")] * 2, 0, None) == ROUTES  # no GROUP_RANK


def wire(record: list[Any]) -> list[Any]:
    """A record as dst gets it: through JSON."""
    result: list[Any] = json.loads(json.dumps(record))
    return result


def host_records(leader: Any, records: dict[int, list[Any]], *, final: bool = True) -> list[Any]:
    """The host records a leader makes of its ranks' ``records`` (rank -> record)."""
    from monitor_bus.ranks._leader import _host_record

    for rank, record in records.items():
        leader._take(rank, record)
    due = leader._due(leader._now(), final=final)
    return [wire(_host_record(key, bucket, behind)) for key, bucket, _, behind in due]


def logged(merge: Any, bus: monitor.EventBus, *, final: bool = True) -> list[dict[str, Any]]:
    seen: list[monitor.Event] = []
    bus.register_event_handler(seen.append)
    merge._log_merged(merge._due(merge._now(), final=final))
    bus.flush()
    return [dict(e.data) for e in seen]


def test_a_host_record_merges_on_dst_exactly_as_its_ranks_windows_would() -> None:
    """dst merging ranks 0 and 1's windows with the record rank 2 made of its own and rank 3's
    logs what dst merging all four logs: counts, sums, max, min, the Histogram (so the
    percentiles), the spread over the four ranks' means (rank 3 slowest), and the VALUE of
    the last close, rank 3's on a tie; STDDEV from the moments, to rounding."""
    aggs = [*list(monitor.Aggregation)[:6], monitor.Aggregation.P50, monitor.Aggregation.P99]
    samples = [[1.0, 2.0, 3.0], [0.5, 4.25], [8.0, 1.5, 2.5, 0.25], [9.75, 6.0, 7.0]]
    index = math.floor(time.time() / 10.0) - 1
    per_rank = closed_records("step", [*aggs, monitor.Aggregation.HISTOGRAM], samples, index)
    spread = closed_records("spread", [monitor.Aggregation.STDDEV], samples, index)
    for record in per_rank + spread:
        record[9] = 1e9  # every window closed at once: the higher rank's VALUE is kept
    outs = []
    for shape in ("flat", "two-level"):
        with monitor.EventBus() as bus:
            dst = merge_on(bus, 0, 4, upstream=ROUTES if shape == "two-level" else None)
            if shape == "flat":
                for rank in range(4):
                    dst._take(rank, wire(per_rank[rank]))
                    dst._take(rank, wire(spread[rank]))
            else:
                leader = merge_on(monitor.EventBus(), 2, 4, upstream=ROUTES)
                leader._mark = dict.fromkeys(leader._mark, math.inf)  # all past the window
                assert (leader.upstream, leader._sources, dst._below) == (0, {3}, {2: {3}})
                theirs = host_records(leader, {2: per_rank[2], 3: per_rank[3]})
                theirs += host_records(leader, {2: spread[2], 3: spread[3]})
                assert [len(r[12]["parts"]) for r in theirs] == [2, 2]
                for rank in (0, 1):
                    dst._take(rank, wire(per_rank[rank]))
                    dst._take(rank, wire(spread[rank]))
                for record in theirs:
                    dst._take(2, record)
            dst._mark = dict.fromkeys(dst._mark, math.inf)
            outs.append(logged(dst, bus))
            assert (dst.merged, dst.missing, dst.late) == (2, 0, 0)
    flat, two = outs
    assert two[0] == flat[0]
    everything = [v for values in samples for v in values]
    assert flat[0]["step.value"] == 7.0  # rank 3's last sample
    assert flat[0]["step.count"] == len(everything)
    assert flat[0]["step.sum"] == sum(everything)
    assert flat[0]["step.histogram"] == monitor.Histogram.of(everything)
    assert (flat[0]["step.slowest_rank"], flat[0]["step.ranks"]) == (3, 4)
    assert flat[0]["step.rank_max"] == sum(samples[3]) / 3
    assert two[1]["spread.stddev"] == pytest.approx(flat[1]["spread.stddev"], rel=1e-12)
    assert flat[1]["spread.stddev"] == pytest.approx(statistics.pstdev(everything), rel=1e-12)


def test_a_rank_lost_at_its_leader_is_counted_and_named_on_dst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 3 silent at its leader: the leader sends its host's window without it, saying so;
    dst counts the window missing, names rank 3 in its warnings and lost_ranks, and waits
    for the goodbye of rank 3 until the leader says it is done; rank 3's window, sent on
    after dst merged it, is logged late, counted once per window."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    aggs = [monitor.Aggregation.MEAN]
    index = math.floor(time.time() / 10.0) - 1
    r0, r2, r3 = closed_records("step", aggs, [[1.0], [2.0], [5.0]], index)
    leader = merge_on(monitor.EventBus(), 2, 4, upstream=ROUTES)
    leader._mark[2] = math.inf  # the leader is past the window; rank 3 never said so
    leader._lost.add(3)
    [first] = host_records(leader, {2: r2}, final=False)
    assert first[12] == {"rank": 2, "parts": [[2, 1, 2.0]], "behind": [3]}
    with monitor.EventBus() as bus:
        dst = merge_on(bus, 0, 4, upstream=ROUTES)
        dst._spoken |= {1, 2}
        dst._finished.add(1)
        assert dst.unfinished_ranks == {2, 3}
        dst._take(0, r0)
        dst._take(2, first)
        dst._mark.update({0: math.inf, 1: math.inf, 2: first[3] * 10.0})
        dst._note_host(2, {"lost": [3], "done": []})
        assert dst.lost_ranks == {3}
        merged = logged(dst, bus, final=False)
        assert merged[0]["step.ranks"] == 2
        assert (dst.merged, dst.missing) == (1, 1)
        # Rank 3 speaks again: the leader sends its window on; dst merged it already.
        leader._lost.discard(3)
        [again] = host_records(leader, {3: r3}, final=False)
        dst._take(2, again)
        assert logged(dst, bus, final=False) == [
            {"step.mean": 5.0, "step.ranks": 1, "step.late": True}
        ]
        assert (dst.merged, dst.missing, dst.late) == (1, 1, 1)
        dst._finished.add(2)
        assert dst.unfinished_ranks == {3}
        dst._note_host(2, {"lost": [], "done": [3]})
        assert (dst.unfinished_ranks, dst.lost_ranks) == (set(), set())
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "merge_stats_across_ranks: rank 3 silent for timeout=5.0 s at its host's leader rank 2; "
        "windows are merged without it from now on"
    ) in messages
    assert any("merged without rank(s) 3 " in m for m in messages)
    assert (
        "merge_stats_across_ranks: rank 3 is heard from again (by its host's leader rank 2)"
        in messages
    )


def test_two_level_is_checked() -> None:
    """two_level must be a bool or None."""
    require(torchrun_available(), "torch with torch.distributed is not installed")
    from monitor_bus.integrations.torch import merge_stats_across_ranks

    with pytest.raises(TypeError, match="two_level must be a bool or None"):
        merge_stats_across_ranks(two_level="auto")  # type: ignore[arg-type]


def test_a_leader_sends_dst_its_host_s_mark_only_past_a_window_end_or_a_heartbeat() -> None:
    """A leader with nothing due sends dst nothing while its host's mark stays inside a
    window, sends once it passes a window end (or a heartbeat is due), and sends each window
    due as a host record with its word on its ranks; a rank that is behind but not lost holds
    the mark back until the leader's patience (half the timeout) is past."""
    sends: list[tuple[list[Any], float, bool, dict[str, Any]]] = []
    leader = merge_on(monitor.EventBus(), 2, 4, upstream=ROUTES)
    leader._send = lambda records, mark, *, bye, host, progress: sends.append(
        (records, mark, bye, json.loads(host))
    )
    index = math.floor(time.time() / 10.0) + 1  # a window that ends in the future
    [record] = closed_records("step", [monitor.Aggregation.MEAN], [[2.0]], index)
    leader._take(2, record)  # the leader has seen windows of 10 s
    now = 10.0 * index - 5.0  # in the middle of the window before
    leader._mark.update({2: now, 3: now})
    leader._send_on([], now, final=False)
    assert [(mark, host) for _, mark, _, host in sends] == [(now, {"lost": [], "done": []})]
    leader._mark.update({2: now + 1.0, 3: now + 1.0})
    leader._send_on([], now + 1.0, final=False)  # the same window: nothing to say
    assert len(sends) == 1
    leader._mark.update({2: now + 6.0, 3: now + 6.0})  # past the window's end
    leader._send_on([], now + 6.0, final=False)
    assert sends[-1][1] == now + 6.0
    leader._last_sent -= leader._heartbeat  # a heartbeat is due
    leader._mark[3] = -math.inf  # rank 3 behind (not lost): dst learns the patience's edge
    leader._send_on([], now + 7.0, final=False)
    assert sends[-1][1] == now + 7.0 - 2.5
    leader._mark[3] = math.inf
    leader._finished.add(3)
    due = leader._due(leader._now(), final=True)
    leader._send_on(due, now + 8.0, final=True)
    records, mark, bye, host = sends[-1]
    assert (mark, bye, host) == (math.inf, True, {"lost": [], "done": [3]})
    assert [r[12] for r in records] == [{"rank": 2, "parts": [[2, 1, 2.0]], "behind": []}]
    assert len(sends) == 4


def test_a_leader_sends_a_window_on_without_a_rank_behind_at_half_the_timeout() -> None:
    """A window of the leader's host that rank 3 (behind, not lost) has not said it is past:
    the leader holds it until half the timeout past its end, then sends it on without rank 3,
    saying so; dst, which waits the whole timeout, still has it in time."""
    leader = merge_on(monitor.EventBus(), 2, 4, upstream=ROUTES)
    index = math.floor(time.time() / 10.0) - 1
    [record] = closed_records("step", [monitor.Aggregation.MEAN], [[2.0]], index)
    leader._take(2, record)
    end = 10.0 * index
    leader._mark[2] = end + 1.0
    assert leader._due(end + 2.4, final=False) == []  # timeout 5.0: patience 2.5
    [(key, bucket, late, behind)] = leader._due(end + 2.6, final=False)
    assert (key[0], set(bucket.parts), late, behind) == ("step", {2}, False, {3})
    assert merge_on(monitor.EventBus(), 0, 4, upstream=ROUTES)._patience == 5.0


class _Arrivals(_World):
    """A world whose receives, in turn, fail (an exception) or bring a frame from a rank:
    gloo cannot be made to fail one receive on purpose."""

    def __init__(self, rank: int, size: int, arrivals: list[Any]) -> None:
        super().__init__(rank, size)
        self.arrivals = arrivals

    def irecv(self, buf: Any, src: None, group: None, tag: int) -> Any:
        import torch

        arrival = self.arrivals.pop(0)

        class Work:
            def wait(self, timeout: object) -> None:
                if isinstance(arrival, Exception):
                    raise arrival
                frame = arrival[1]
                buf[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)

            def _source_rank(self) -> int:
                rank: int = arrival[0]
                return rank

        return Work()


@pytest.mark.parametrize("failures", [1, 3])
def test_a_failed_receive_does_not_end_dst_s_receiving_but_three_in_a_row_do(
    caplog: pytest.LogCaptureFixture, failures: int
) -> None:
    """A receive that fails (matched to a rank that died mid-send) is warned about and dst
    receives on: the next rank's frame reaches its inbox. Three failures in a row end the
    receiving thread, logged."""
    require(torchrun_available(), "torch with torch.distributed is not installed")
    from monitor_bus.ranks import RankMerge
    from monitor_bus.ranks._frame import _encode

    caplog.set_level(logging.WARNING, logger="monitor_bus")
    bye = _encode([], 5.0, True)
    closed = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    world = _Arrivals(0, 2, [closed] * failures + [(1, bye)])
    merge = RankMerge(monitor.EventBus(), world, None, 0, 5.0, False)
    merge._receive()
    messages = [r.getMessage() for r in caplog.records]
    if failures == 1:
        assert list(merge._inbox) == [(1, {"mark": 5.0, "bye": True, "windows": []})]
        assert merge.frames == 1
        assert messages == [
            "merge_stats_across_ranks: rank 0: a receive failed (Connection closed by peer "
            "[127.0.0.1]:1234); receiving on"
        ]
    else:
        assert (list(merge._inbox), merge.frames) == ([], 0)
        assert messages[-1] == (
            "merge_stats_across_ranks: rank 0: receive failed 3 times in a row; it receives no more"
        )


NAN = math.nan


@pytest.mark.parametrize(
    "per_rank",
    [[[1.0, NAN, 3.0]], [[NAN], [1.0], [3.0]], [[1.0], [2.0, NAN], [3.0]], [[1.0], [3.0], [NAN]]],
    ids=["one rank", "first of three", "second of three", "last of three"],
)
def test_a_nan_max_or_min_of_any_rank_makes_the_merged_one_nan(per_rank: list[list[float]]) -> None:
    """A rank's window with a NaN sample has MAX and MIN NaN (as the Stat reports them); merged over one rank or several, whichever rank holds it, the merged MAX and MIN are NaN too."""
    aggs = [monitor.Aggregation.COUNT, monitor.Aggregation.MAX, monitor.Aggregation.MIN]
    with monitor.EventBus() as bus:
        merge = merge_on(bus, 0, len(per_rank))
        index = math.floor(merge._now() / 10.0) - 1
        records = closed_records("step", aggs, per_rank, index)
        assert [math.isnan(r[6]) and math.isnan(r[7]) for r in records] == [
            any(map(math.isnan, values)) for values in per_rank
        ]
        for rank, record in enumerate(records):
            merge._take(rank, wire(record))
        merge._mark = dict.fromkeys(merge._mark, math.inf)
        [data] = logged(merge, bus)
    assert data["step.count"] == sum(map(len, per_rank))
    assert math.isnan(data["step.max"])
    assert math.isnan(data["step.min"])


@pytest.mark.parametrize("path", ["local", "late after close", "late after merge"])
def test_a_nan_max_or_min_logged_outside_the_merge_stays_nan(path: str) -> None:
    """A window with MAX and MIN NaN that a rank logs itself (dst gone), or that dst logs on its own as late (after its close, or after its window was merged), keeps them NaN."""
    aggs = [monitor.Aggregation.MAX, monitor.Aggregation.MIN]
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0 if path != "local" else 1, 2)
        index = math.floor(merge._now() / 10.0) - 1
        first, nan = closed_records("step", aggs, [[1.0], [2.0, NAN]], index)
        if path == "local":
            merge._log_local([wire(nan)])
        elif path == "late after close":
            merge._log_late(1, {"windows": [wire(nan)]})
        else:
            merge._take(0, first)
            merge._mark[0] = math.inf
            merge._lost.add(1)
            merge_due(merge)
            merge._take(1, wire(nan))
            merge_due(merge)
        bus.flush()
    [data] = [e.data for e in seen if "step.late" in e.data or "step.rank" in e.data]
    assert math.isnan(data["step.max"])
    assert math.isnan(data["step.min"])


def merge_means(merge: Any, windows: list[dict[int, float]]) -> None:
    """dst merges one past window of Stat "step_time" (MEAN) per item: rank -> its one sample."""
    for number, means in enumerate(windows):
        index = math.floor(merge._now() / 10.0) - 20 + number
        records = closed_records(
            "step_time", [monitor.Aggregation.MEAN], [[m] for m in means.values()], index
        )
        for rank, record in zip(means, records, strict=True):
            merge._take(rank, record)
        merge._mark = dict.fromkeys(merge._mark, math.inf)
        merge_due(merge)


def test_of_two_ranks_one_3_9_times_slower_is_named_at_a_factor_of_2() -> None:
    """Two ranks: each is compared with the other's mean (not a median that holds itself), so rank 1 at 3.9 times rank 0's step is named at a factor of 2.0 after straggler_windows windows, ratio 3.9."""
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 2, stragglers={"step_time": 2.0}, straggler_windows=3)
        merge_means(merge, [{0: 1.0, 1: 3.9}] * 4)
        bus.flush()
    assert [e.data for e in seen if e.name == "monitor_bus.straggler"] == [
        {"stat": "step_time", "rank": 1, "ratio": 3.9, "windows": 3, "host": "", "recovered": False}
    ]
    assert merge.straggling == {("step_time", 1)}


def test_a_straggler_does_not_flap_as_ranks_die_and_recovers_once_back() -> None:
    """Four ranks, rank 3 four times slower: named once; ranks 1 then 2 die (their windows stop), and rank 3, still four times the others, is not called recovered; back at their pace, it recovers once."""
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        merge = merge_on(bus, 0, 4, stragglers={"step_time": 2.0}, straggler_windows=2)
        all_four = {0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0}
        merge_means(
            merge,
            [all_four] * 2
            + [{0: 1.0, 2: 1.0, 3: 4.0}] * 2
            + [{0: 1.0, 3: 4.0}] * 2
            + [{0: 1.0, 3: 1.0}],
        )
        bus.flush()
    assert [e.data for e in seen if e.name == "monitor_bus.straggler"] == [
        {
            "stat": "step_time",
            "rank": 3,
            "ratio": 4.0,
            "windows": 2,
            "host": "",
            "recovered": False,
        },
        {"stat": "step_time", "rank": 3, "ratio": 1.0, "windows": 6, "host": "", "recovered": True},
    ]


class _Sends(_World):
    """A world whose sends complete at once, keeping each frame's bytes as its peer gets them."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.frames: list[bytes] = []

    def isend(self, tensor: Any, dst: int, group: None, tag: int) -> Any:
        self.frames.append(tensor.numpy().tobytes())

        class Work:
            def wait(self, timeout: object) -> bool:
                return True

        return Work()


def test_a_host_record_too_long_to_fit_beside_the_leader_s_word_is_sent_whole() -> None:
    """Every length of host record in the band where it fits a frame on its own but not beside the leader's mark and word on its host: the leader sends it whole, uncoarsened, every frame within FRAME bytes, the last with the mark and the word, and it goes on sending to dst."""
    require(torchrun_available(), "torch with torch.distributed is not installed")
    from monitor_bus.ranks import RankMerge

    index = math.floor(time.time() / 10.0) - 1
    [record] = closed_records("x", [monitor.Aggregation.MEAN], [[2.0]], index)
    leader = merge_on(monitor.EventBus(), 2, 4, upstream=ROUTES)
    leader._mark = dict.fromkeys(leader._mark, math.inf)
    [host_record] = host_records(leader, {2: record})
    base = len(json.dumps(host_record)) - len("x")
    mark = index * 10.0 + 0.123456789
    word = json.dumps({"lost": [], "done": []}, separators=(",", ":"))
    # A frame: its length (4 bytes), then the envelope around the windows' JSON.
    alone = 4 + len('{"mark":null,"bye":false,"windows":[]}')
    beside = 4 + len(f'{{"mark":{json.dumps(mark)},"bye":false,"windows":[],"host":{word}}}')
    band = range(FRAME - beside + 1, FRAME - alone + 1)
    for length in band:
        wide = [f"x{'x' * (length - base - 1)}", *host_record[1:]]
        assert len(json.dumps(wide)) == length
        world = _Sends(2, 4)
        leader = RankMerge(monitor.EventBus(), world, None, 0, 5.0, False, upstream=ROUTES)
        leader._send([wide], mark, bye=False, host=word)
        assert all(len(frame) == FRAME for frame in world.frames)
        messages = [decode(frame) for frame in world.frames]
        assert [w for m in messages for w in m["windows"]] == [wide]
        assert (messages[-1]["mark"], messages[-1]["host"]) == (mark, json.loads(word))
        assert (leader._dst_gone, leader.sent, leader.local, leader.unsent) == (False, 1, 0, 0)


def test_a_frame_that_cannot_be_encoded_costs_its_windows_only_and_not_dst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A leader's word on its host too long for any frame: the window goes in a frame of its own, the word's frame is warned about, and the leader goes on sending to dst (an encoding error is not taken for dst being gone)."""
    require(torchrun_available(), "torch with torch.distributed is not installed")
    from monitor_bus.ranks import RankMerge

    caplog.set_level(logging.WARNING, logger="monitor_bus")
    index = math.floor(time.time() / 10.0) - 1
    [record] = closed_records("step", [monitor.Aggregation.SUM], [[2.0]], index)
    word = json.dumps({"lost": list(range(4000)), "done": []}, separators=(",", ":"))
    seen: list[monitor.Event] = []
    with monitor.EventBus() as bus:
        bus.register_event_handler(seen.append)
        world = _Sends(2, 4)
        leader = RankMerge(bus, world, None, 0, 5.0, False, upstream=ROUTES)
        leader._send([record], 1.0, bye=False, host=word)
        leader._send([], 2.0, bye=False)
        bus.flush()
    assert [decode(frame) for frame in world.frames] == [
        {"mark": None, "bye": False, "windows": [wire(record)]},
        {"mark": 2.0, "bye": False, "windows": []},
    ]
    assert seen == []
    assert (leader._dst_gone, leader.sent, leader.unsent, leader.local) == (False, 1, 0, 0)
    assert any("could not encode a frame" in r.getMessage() for r in caplog.records)
