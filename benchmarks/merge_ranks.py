"""What merging Stat windows across ranks costs a training loop, how late the merged windows
arrive, and what a rank that dies mid-run does to the others.

    torchrun --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 \\
        benchmarks/merge_ranks.py [--rounds 12] [--steps 300]

Three parts, every rank on CPU with gloo:

1. Step time: a CPU-bound step (a numpy MLP forward + backward + SGD update, as in
   training_loop.py) and an add to each of 3 Stats (windows of 250 ms). Each round runs
   ``--steps`` steps with the Stats on a bus merged across ranks (``merge_stats_across_ranks``)
   and ``--steps`` with them on a bus that is not, in alternating order; both buses have a no-op
   handler. Reported: per rank, the ratio of the median step times (on / off).
2. Delay on dst: for every merged window of part 1, the wall time at which the merged event
   reached dst's handler minus the window's end (p50, p99).
3. A rank dies: a fresh bus merged with ``timeout=2``; all ranks add samples for 4 s, and the
   last rank ends with ``os._exit(0)`` (a zero exit: torchrun stops every rank on a non-zero
   one) at 1.5 s; the others close() with a timeout of 10 s. Reported: when dst named it lost,
   after its death; whether the others' close() finished and how long it took; the samples
   each rank added against what dst merged (in merged windows or ones logged on their own,
   ``late``) and what the live ranks logged themselves (``local``).

Rank 0 prints a markdown table (``--save``: ``benchmarks/results/merge_ranks-<ranks>.json``).
The ranks share results through files in a temporary directory named after the torchrun job.

Scale (issue 23): ``python benchmarks/merge_ranks.py --scale 2,4,8,16 --seconds 6`` starts
one torchrun job per size. In each, every rank adds to 3 Stats (windows of 250 ms) between
5 ms sleeps (a step waiting on its device) for ``--seconds``; dst reports the delay from each
window's end to its merged event (p50, p99), the CPU time of dst's two merge threads per
merged window per rank (their CPU clocks, in the steady part: before close()), and the bytes each
rank sends per window, and projects dst's cost to 1,024 ranks. ``--save`` saves
``benchmarks/results/merge_ranks-scale.json``.

Shapes (issue 23): ``python benchmarks/merge_ranks.py --shapes 4x4 --seconds 6`` runs the same
job as torchrun "nodes" on this machine (4 nodes of 4 ranks), once flat (every rank to dst)
and once two-level (each node's leader merges its node for dst), and reports, for each, the
delay (p50, p99), dst's CPU per merged window per rank, the bytes dst receives per merged
window, and the leaders' CPU (the busiest leader's merge threads per merged window per rank
of its node), and projects both shapes to 1,024 ranks. ``--save`` saves
``benchmarks/results/merge_ranks-shapes.json``.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _results  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _machine import numpy_mlp_step, positive  # noqa: E402

import monitor_bus as monitor  # noqa: E402
from monitor_bus import ranks as merge_module  # noqa: E402
from monitor_bus.integrations.torch import merge_stats_across_ranks  # noqa: E402

WINDOW = 0.25
AGGS = [monitor.Aggregation.MEAN, monitor.Aggregation.MAX]


def make_step() -> Any:
    """A two-layer tanh MLP, forward + backward + SGD update on one minibatch."""
    return numpy_mlp_step(128)


def stats(bus: monitor.EventBus) -> list[monitor.Stat]:
    window = timedelta(seconds=WINDOW)
    return [monitor.Stat(name, AGGS, window, bus=bus) for name in ("step_time", "loss", "grad")]


def run_phase(step: Any, trio: list[monitor.Stat], steps: int) -> float:
    """Median seconds per step of ``steps`` steps, each adding to the three Stats."""
    times = []
    step_time, loss_stat, grad_stat = trio
    for _ in range(steps):
        start = time.perf_counter()
        loss, grad = step()
        step_time.add(time.perf_counter() - start)
        loss_stat.add(loss)
        grad_stat.add(grad)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def delay_recorder(delays: list[float]) -> Any:
    """dst's handler: for each merged window, seconds from the window's end until now."""

    def on_dst(event: monitor.Event) -> None:
        if any(key.endswith(".ranks") for key in event.data):
            end = math.floor(event.timestamp.timestamp() / WINDOW) * WINDOW
            delays.append(time.time() - end)

    return on_dst


def step_cost(rank: int, rounds: int, steps: int) -> tuple[list[float], list[float]]:
    """Part 1 and 2: (on/off ratio per round on this rank, dst's delays)."""
    delays: list[float] = []
    on_dst = delay_recorder(delays)

    merged_bus = monitor.EventBus(name="merged")
    plain_bus = monitor.EventBus(name="plain")
    merged_bus.register_event_handler(on_dst if rank == 0 else (lambda event: None))
    plain_bus.register_event_handler(lambda event: None)
    merge = merge_stats_across_ranks(bus=merged_bus, timeout=30.0)
    merged_stats, plain_stats = stats(merged_bus), stats(plain_bus)
    step = make_step()
    run_phase(step, plain_stats, steps)  # warm-up
    on: list[float] = []
    off: list[float] = []
    for i in range(rounds):
        for merged in (i % 2 == 0, i % 2 == 1):
            (on if merged else off).append(
                run_phase(step, merged_stats if merged else plain_stats, steps)
            )
    assert merge.close()
    merged_bus.flush()
    merged_bus.close()
    plain_bus.close()
    return [statistics.median(on) / statistics.median(off)], delays


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lost_at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "silent for" in record.getMessage() and self.lost_at is None:
            self.lost_at = time.time()


def a_rank_dies(rank: int, world: int, out: Path) -> None:
    """Part 3: every rank but the last runs 4 s; the last exits at 1.5 s."""
    merged: list[dict[str, Any]] = []  # dst: merged and late windows; others: local ones
    bus = monitor.EventBus(name="dies")
    bus.register_event_handler(lambda event: merged.append(dict(event.data)))
    warnings = Warnings()
    logging.getLogger("monitor_bus").addHandler(warnings)
    merge = merge_stats_across_ranks(bus=bus, timeout=2.0)
    loss = monitor.Stat("loss", [monitor.Aggregation.COUNT], timedelta(seconds=WINDOW), bus=bus)
    start = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(start, 0)  # the last collective of the default group: a rank dies next
    t0 = float(start.item())
    dies_at = t0 + 1.5
    added = 0
    step = make_step()
    while time.time() < t0 + 4.0:
        if rank == world - 1 and time.time() >= dies_at:
            (out / f"rank{rank}.json").write_text(json.dumps({"added": added}))
            os._exit(0)
        loss.add(step()[0])
        added += 1
    started = time.monotonic()
    finished = merge.close(timeout=10.0)
    took = time.monotonic() - started
    bus.close()
    result = {
        "added": added,
        "finished": finished,
        "close": took,
        "lost": sorted(merge.lost_ranks),
        "noticed": None if warnings.lost_at is None else warnings.lost_at - dies_at,
        "merged": sum(d["loss.count"] for d in merged),
        "windows": [d["loss.ranks"] for d in merged],
        "missing": merge.missing,
        "late": merge.late,
        "local": merge.local,
        "unfinished": sorted(merge.unfinished_ranks),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def thread_cpu(threads: list[Any]) -> float:
    """CPU seconds the threads used so far, from their own CPU clocks (POSIX; nanoseconds,
    where /proc counts 10 ms ticks)."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads)


def scale_rank(seconds: float, out: Path, two_level: bool | None = None) -> None:
    """One rank of a scale job: add to 3 Stats for ``seconds``; rank 0 writes the figures."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bus = monitor.EventBus(name="scale")
    delays: list[float] = []
    on_dst = delay_recorder(delays)

    bus.register_event_handler(on_dst if rank == 0 else (lambda event: None))
    merge = merge_stats_across_ranks(bus=bus, timeout=30.0, two_level=two_level)
    trio = stats(bus)
    dist.barrier()
    # The merge threads of dst and of a host's leader (they receive and merge).
    threads = [merge._thread, merge._receiver] if merge._receiver is not None else []
    cpu0, merged0, started = thread_cpu(threads), merge.merged, time.time()
    step = 0
    while time.time() < started + seconds:
        for stat in trio:
            stat.add(step % 7)
        step += 1
        time.sleep(0.005)
    cpu, merged = thread_cpu(threads) - cpu0, merge.merged - merged0
    assert merge.close(timeout=30.0)
    bus.flush()
    bus.close()
    sent: list[Any] = [None] * world
    # A host leader's CPU, by the ranks whose windows it merges (its own too).
    host = len(merge._sources) + 1 if rank and merge._sources else 0
    dist.all_gather_object(sent, (merge.frames, merge.sent, cpu, host))
    if rank == 0:
        frames = sum(f for f, *_ in sent[1:])
        windows = sum(w for _, w, *_ in sent[1:])
        leaders = [c / n for _, _, c, n in sent[1:] if n]
        ms = [d * 1000 for d in delays]
        result = {
            "shape": "two-level" if merge.two_level else "flat",
            "ranks": world,
            "windows": merged,
            "p50": percentile(ms, 0.5),
            "p99": percentile(ms, 0.99),
            "cpu_us": cpu / merged / world * 1e6,
            "bytes": frames * merge_module.FRAME_BYTES / windows,
            "bytes_in": merge.frames * merge_module.FRAME_BYTES / merge.merged,
            "leader_us": max(leaders) / merged * 1e6 if leaders else None,
            "frames_per_s": frames / (world - 1) / seconds,
            "load": os.getloadavg()[0],
        }
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def scale(sizes: list[int], seconds: float, save: bool) -> None:
    """One torchrun job per size; print (and with ``save``, save) the figures."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            out = Path(tmp) / f"scale{size}.json"
            subprocess.run(
                [
                    torchrun,
                    f"--nproc_per_node={size}",
                    "--rdzv-backend=c10d",
                    "--rdzv-endpoint=localhost:0",
                    __file__,
                    "--scale-rank",
                    str(out),
                    "--seconds",
                    str(seconds),
                ],
                check=True,
            )
            rows.append(json.loads(out.read_text()))
    results = {
        "seconds": seconds,
        "window_ms": WINDOW * 1000,
        "sizes": {str(r["ranks"]): r for r in rows},
        "projection": project(rows[-1]),
        "tables": {"scale": scale_table(rows)},
    }
    finish("merge_ranks-scale", results, save)


def finish(name: str, results: dict[str, Any], save: bool) -> None:
    """Print a run's tables and projections; with ``save``, save its results file."""
    for table in results["tables"].values():
        print(_results.markdown(table) + "\n")
    print(json.dumps(results["projection"], indent=1))
    if save:
        _results.save(name, results, packages=("torch",))


def shapes(nodes: int, per_node: int, seconds: float, save: bool) -> None:
    """The same job as ``nodes`` torchrun nodes of ``per_node`` ranks, flat then two-level;
    print (and with ``save``, save) both side by side, and the projection."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for two_level in (False, True):
            out = Path(tmp) / f"shape{int(two_level)}.json"
            port = free_port()
            jobs = [
                subprocess.Popen(
                    [
                        torchrun,
                        f"--nnodes={nodes}",
                        f"--node_rank={node}",
                        f"--nproc_per_node={per_node}",
                        "--master_addr=127.0.0.1",
                        f"--master_port={port}",
                        __file__,
                        "--scale-rank",
                        str(out),
                        "--seconds",
                        str(seconds),
                        "--two-level",
                        str(int(two_level)),
                    ]
                )
                for node in range(nodes)
            ]
            if any(job.wait() for job in jobs):
                raise SystemExit("a torchrun node failed")
            rows.append(json.loads(out.read_text()))
    results = {
        "seconds": seconds,
        "window_ms": WINDOW * 1000,
        "nodes": nodes,
        "per_node": per_node,
        "shapes": {r["shape"].replace("-", "_"): r for r in rows},
        "projection": {
            "flat": project(rows[0]),
            "two_level": project_two_level(rows[1], nodes, per_node),
        },
        "tables": {"shapes": shapes_table(rows)},
    }
    finish("merge_ranks-shapes", results, save)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def shapes_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    columns = [
        "shape",
        "ranks",
        "merged windows",
        "window end to merged event, p50 / p99",
        "dst CPU per merged window per rank",
        "bytes dst receives per merged window",
        "busiest leader's CPU per merged window per rank of its node",
    ]
    cells = []
    for r in rows:
        leader = "-" if r["leader_us"] is None else f"{r['leader_us']:.0f} µs"
        cells.append(
            [
                r["shape"],
                str(r["ranks"]),
                str(r["windows"]),
                f"{r['p50']:.0f} ms / {r['p99']:.0f} ms",
                f"{r['cpu_us']:.0f} µs",
                f"{r['bytes_in'] / 1024:.1f} KiB",
                leader,
            ]
        )
    return _results.table(columns, cells, "lllllll")


def project_two_level(row: dict[str, Any], nodes: int, per_node: int) -> dict[str, float]:
    """dst's and a leader's cost at 1,024 ranks (128 hosts of 8) in the two-level shape: dst
    receives from the other hosts' leaders and its own host's ranks; a leader from its host's."""
    per_second = 3 / WINDOW
    sources = (nodes - 1) + per_node  # what dst merged per window in the run (itself too)
    per_source = row["cpu_us"] * row["ranks"] / sources
    at_scale = 127 + 8
    return {
        "per_source_us": per_source,
        "leader_us": row["leader_us"],
        "dst_cpu_s_per_s": per_source * 1e-6 * at_scale * per_second,
        "leader_cpu_s_per_s": row["leader_us"] * 1e-6 * 8 * per_second,
        "inbound_mib_per_s": row["bytes_in"] / sources * at_scale * per_second / 2**20,
    }


def scale_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    columns = [
        "ranks",
        "merged windows",
        "window end to merged event, p50 / p99",
        "dst CPU per merged window per rank",
        "bytes each rank sends per window",
        "messages per rank per second",
    ]
    cells = [
        [
            str(r["ranks"]),
            str(r["windows"]),
            f"{r['p50']:.0f} ms / {r['p99']:.0f} ms",
            f"{r['cpu_us']:.0f} µs",
            f"{r['bytes'] / 1024:.1f} KiB",
            f"{r['frames_per_s']:.1f}",
        ]
        for r in rows
    ]
    return _results.table(columns, cells, "llllll")


def project(row: dict[str, Any]) -> dict[str, float]:
    """dst's cost at 1,024 ranks with 3 Stats of 250 ms windows, from one measured size."""
    per_second = 3 / WINDOW  # merged windows per second of the benchmark's 3 Stats
    return {
        "ranks": row["ranks"],
        "cpu_us": row["cpu_us"],
        "frames_per_s": row["frames_per_s"],
        "frame_kib": merge_module.FRAME_BYTES / 1024,
        "dst_cpu_s_per_s": row["cpu_us"] * 1e-6 * 1024 * per_second,
        "inbound_mib_per_s": row["frames_per_s"] * 1023 * merge_module.FRAME_BYTES / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=12)
    parser.add_argument("--steps", type=positive, default=300)
    parser.add_argument("--scale", help="sizes, comma-separated: one torchrun job each")
    parser.add_argument("--seconds", type=positive, default=6)
    parser.add_argument(
        "--save", action="store_true", help="save the results file under benchmarks/results/"
    )
    parser.add_argument("--shapes", help="NODESxRANKS: flat and two-level side by side")
    parser.add_argument("--scale-rank", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--two-level", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale:
        scale([int(n) for n in args.scale.split(",")], args.seconds, args.save)
        return
    if args.shapes:
        nodes, per_node = (int(n) for n in args.shapes.split("x"))
        shapes(nodes, per_node, args.seconds, args.save)
        return
    if args.scale_rank:
        two_level = None if args.two_level is None else bool(args.two_level)
        scale_rank(args.seconds, args.scale_rank, two_level)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = os.environ.get("TORCHELASTIC_RUN_ID", "") + os.environ.get("MASTER_PORT", "")
    out = Path(tempfile.gettempdir()) / f"merge_ranks_{job}"
    out.mkdir(exist_ok=True)

    ratios, delays = step_cost(rank, args.rounds, args.steps)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, ratios)
    a_rank_dies(rank, world, out)
    if rank != 0:
        return
    deadline = time.monotonic() + 30
    results = {}
    while len(results) < world and time.monotonic() < deadline:
        for r in range(world):
            path = out / f"rank{r}.json"
            if r not in results and path.exists():
                results[r] = json.loads(path.read_text())
        time.sleep(0.1)
    dst = results[0]
    live_added = sum(results[r]["added"] for r in range(world - 1))
    local = sum(results[r]["merged"] for r in range(1, world - 1))
    dead_added = results[world - 1]["added"]
    ms = [d * 1000 for d in delays]
    noticed = dst["noticed"]
    windows = dst["windows"]
    figures = {
        "ranks": world,
        "rounds": args.rounds,
        "steps": args.steps,
        "load": os.getloadavg()[0],
        "step_ratio": [g[0] for g in gathered],
        "step_ratio_range": {
            "min": min(g[0] for g in gathered),
            "max": max(g[0] for g in gathered),
        },
        "delay_ms": {"p50": percentile(ms, 0.5), "p99": percentile(ms, 0.99), "windows": len(ms)},
        "noticed_s": noticed,
        "close_ms": [results[r]["close"] * 1000 for r in range(world - 1)],
        "close_finished": [results[r]["finished"] for r in range(world - 1)],
        "samples": {
            "live": live_added,
            "dead": dead_added,
            "dst": dst["merged"],
            "local": local,
            "beyond_live": dst["merged"] + local - live_added,
        },
        "counters": {k: dst[k] for k in ("missing", "late", "unfinished")},
        "windows_by_ranks": {str(n): windows.count(n) for n in sorted(set(windows))},
    }
    closes = ", ".join(
        f"{results[r]['close'] * 1000:.0f} ms ({'finished' if results[r]['finished'] else 'timed out'})"
        for r in range(world - 1)
    )
    noticed_text = "not named" if noticed is None else f"{noticed:.2f} s"
    rows = [
        [
            f"step time, merged / not merged (median of rounds), ranks 0-{world - 1}",
            ", ".join(f"{g[0]:.3f}" for g in gathered),
        ],
        [
            f"delay from window end to merged event on dst, p50 / p99 ({len(ms)} windows)",
            f"{percentile(ms, 0.5):.1f} ms / {percentile(ms, 0.99):.1f} ms",
        ],
        [f"rank {world - 1} exits at 1.5 s (timeout 2 s): dst names it lost after", noticed_text],
        [f"... close() on ranks 0-{world - 2}", closes],
        [
            f"... samples: added by ranks 0-{world - 2} / by rank {world - 1} before it died / "
            f"reached dst / logged by ranks 1-{world - 2} themselves",
            f"{live_added} / {dead_added} / {dst['merged']} / {local} "
            f"({dst['merged'] + local - live_added} beyond the live ranks' samples)",
        ],
        [
            "... dst's counters: windows merged without a rank (missing) / logged on their own "
            "(late) / ranks whose goodbye did not come",
            f"{dst['missing']} / {dst['late']} / {dst['unfinished']}",
        ],
        [
            "... merged windows by contributing ranks",
            ", ".join(f"{n} ranks: {windows.count(n)}" for n in sorted(set(windows))),
        ],
    ]
    figures["tables"] = {"results": _results.table(["measure", "result"], rows, "ll")}
    print(_results.markdown(figures["tables"]["results"]))
    if args.save:
        command = (
            f"torchrun --nproc_per_node={world} --rdzv-backend=c10d "
            f"--rdzv-endpoint=localhost:0 benchmarks/merge_ranks.py {' '.join(sys.argv[1:])}"
        )
        _results.save(f"merge_ranks-{world}", figures, packages=("torch",), command=command)


if __name__ == "__main__":
    main()
