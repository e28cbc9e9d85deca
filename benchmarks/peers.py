"""What a training loop pays for its logging with monitor_bus and with the loggers a user would
pick instead, on one machine in one run.

    pip install -e '.[peers]' && pip install torch==2.13.0      # torch for torch.monitor
    python benchmarks/peers.py                                  # about 15 minutes here
    python benchmarks/peers.py --render --plot docs/img/peers.png    # the page's tables again

The loop: a numpy MLP training step (~0.3 ms, and a larger batch of ~10 ms), then K scalars
(K = 1, 10, 100) logged through one tool (benchmarks/_peers_tools.py has each, set up as its
documentation shows): monitor_bus's ``Stat.add`` and ``log()`` with the JSONL sink, the
TensorBoard sink and the TensorBoard sink in a sink process; torch.monitor's Stats with its
TensorBoard handler; ``SummaryWriter.add_scalar``, torch's (torch.utils.tensorboard) and
tensorboardX's; ``wandb.log`` offline; MLflow's ``log_metrics(..., synchronous=False)`` to a
local file store; the OpenTelemetry SDK's histogram ``record`` and counter ``add`` with a
periodic exporting reader writing JSON lines to a file; prometheus_client's
``Histogram.observe``, single-process (written to a text file at the end) and in
multiprocess mode (its mmap files).

Each round runs every tool once, in a shuffled order, each in a fresh interpreter that runs
its configurations in a shuffled order, each next to the same loop without logging (the one
before the other, alternating). Per configuration: process CPU per step (every thread, and the
tool's helper processes: W&B's service, the sink process), from the first step to the end of
the tool's flush and close, as a ratio to the loop without logging; the training thread's wall
time per step in the loop, the same way; the time the close took; the training thread's CPU
inside the logging calls per scalar logged (the caller's cost); the bytes written. Medians of
the rounds. The figures and the page's tables go to benchmarks/results/peers.json (the page
quotes them); ``--render`` makes the tables and the plot again from that file's figures,
measuring nothing and keeping the run's commit, date and command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _results
from _machine import positive
from _results import RESULTS, load, save

HERE = Path(__file__).resolve().parent
STEPS = {"0.3 ms": 160, "10 ms": 5120}  # the MLP's batch for each step's size
KS = (1, 10, 100)
PACKAGES = (
    "numpy",
    "psutil",
    "orjson",
    "google-crc32c",
    "tensorboard",
    "tensorboardX",
    "torch",
    "wandb",
    "mlflow",
    "opentelemetry-sdk",
    "prometheus_client",
    "matplotlib",
)
# Each tool: its title, what it keeps of the values and where, the modules it needs.
TOOLS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "mb_stat": (
        "monitor_bus `Stat.add`",
        "windows (mean, min, max, count), TensorBoard",
        ("monitor_bus", "tensorboard"),
    ),
    "mb_log_jsonl": ("monitor_bus `log()`, JSONL sink", "every value, JSON lines", ("orjson",)),
    "mb_log_tensorboard": (
        "monitor_bus `log()`, TensorBoard sink",
        "every value, TensorBoard",
        ("tensorboard",),
    ),
    "mb_log_process": (
        "monitor_bus `log()`, TensorBoard sink in a sink process",
        "every value, TensorBoard",
        ("tensorboard",),
    ),
    "torch_monitor": (
        "torch.monitor `Stat.add`, its TensorBoard handler",
        "windows (mean, min, max, count), TensorBoard",
        ("torch", "tensorboard"),
    ),
    "torch_tensorboard": (
        "torch's `SummaryWriter.add_scalar`",
        "every value, TensorBoard",
        ("torch", "tensorboard"),
    ),
    "tensorboardx": (
        "tensorboardX `SummaryWriter.add_scalar`",
        "every value, TensorBoard",
        ("tensorboardX",),
    ),
    "wandb": ("`wandb.log`, offline", "every value, W&B's run file", ("wandb",)),
    "mlflow": (
        "MLflow `log_metrics`, async, file store",
        "every value, MLflow's files",
        ("mlflow",),
    ),
    "otel_histogram": (
        "OpenTelemetry `Histogram.record`",
        "histograms, exported every 250 ms, JSON lines",
        ("opentelemetry.sdk",),
    ),
    "otel_counter": (
        "OpenTelemetry `Counter.add`",
        "sums, exported every 250 ms, JSON lines",
        ("opentelemetry.sdk",),
    ),
    "prometheus": (
        "prometheus_client `Histogram.observe`",
        "histograms in memory, a text file at the end",
        ("prometheus_client",),
    ),
    "prometheus_multiprocess": (
        "prometheus_client `Histogram.observe`, multiprocess mode",
        "histograms, mmap files",
        ("prometheus_client",),
    ),
}
REFERENCE = "otel_histogram"  # the caller's cost is held against its `record`
# Who keeps the same data: monitor_bus's ways, then the others'.
KINDS = {
    "every value": (
        ("mb_log_jsonl", "mb_log_tensorboard", "mb_log_process"),
        ("torch_tensorboard", "tensorboardx", "wandb", "mlflow"),
    ),
    "aggregates": (
        ("mb_stat",),
        (
            "torch_monitor",
            "otel_histogram",
            "otel_counter",
            "prometheus",
            "prometheus_multiprocess",
        ),
    ),
}
CALLER_BAR = 0.25
TABLES = ("cpu", "wall", "caller", "cheapest")  # the page's tables, in its order


def missing(tool: str) -> str | None:
    """The first module ``tool`` needs that is not installed, or None."""
    for module in ("numpy", "psutil", *TOOLS[tool][2]):
        if importlib.util.find_spec(module) is None:
            return module
    return None


# glibc's malloc with fixed thresholds. By default the first free of a block it had mapped
# raises its mmap threshold to that size, so whether the step's temporaries (160 KB at the
# 0.3 ms step) are mapped and faulted in anew each step depends on what the process allocated
# before (an import, a writer): that alone moved the step's CPU by 1.8x between runs here.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def run_tool(tool: str, configs: list[list[Any]], timeout: float) -> tuple[list[dict], str]:
    """One fresh interpreter running ``tool`` on ``configs``: its lines, and its error text
    (empty when it exited 0)."""
    with tempfile.TemporaryDirectory(prefix=f"peers-{tool}-") as work:
        out = subprocess.run(
            [sys.executable, str(HERE / "_peers_tools.py"), tool, json.dumps(configs), work],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=work,
            env={**os.environ, **MALLOC},
        )
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    error = "" if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]
    return lines, error


def measure(args: argparse.Namespace, tools: list[str]) -> dict[str, Any]:
    """The rounds: every tool once per round, in a shuffled order; each run's figures."""
    rng = random.Random(args.seed)
    steps = {"0.3 ms": args.steps, "10 ms": args.long_steps}
    runs: dict[str, list[dict[str, float]]] = {}
    errors: dict[str, str] = {}
    for r in range(args.rounds):
        order = tools[:]
        rng.shuffle(order)
        for tool in order:
            configs = [
                [STEPS[label], steps[label], k, rng.random() < 0.5]
                for label in args.step_sizes
                for k in args.ks
            ]
            rng.shuffle(configs)
            started = time.monotonic()
            lines, error = run_tool(tool, configs, args.timeout)
            if error:
                errors[tool] = error
            print(
                f"round {r + 1}/{args.rounds} {tool}: {time.monotonic() - started:.1f} s"
                + (f", failed: {error}" if error else ""),
                file=sys.stderr,
            )
            label_of = {STEPS[label]: label for label in STEPS}
            for line in lines:
                key = f"{tool}|{label_of[line['batch']]}|{line['k']}"
                runs.setdefault(key, []).append(per_run(line))
    return {"runs": runs, "errors": errors}


def per_run(line: dict[str, Any]) -> dict[str, float]:
    """One configuration's figures, the tool's against the loop without logging beside it."""
    none, tool, steps, k = line["none"], line["tool"], line["steps"], line["k"]
    return {
        "cpu_ratio": tool["cpu_s"] / none["cpu_s"],
        "wall_ratio": tool["loop_s"] / none["loop_s"],
        "none_cpu_us": none["cpu_s"] / steps * 1e6,
        "none_wall_us": none["loop_s"] / steps * 1e6,
        "caller_ns": (tool["caller_s"] - none["caller_s"]) / (steps * k) * 1e9,
        "close_ms": tool["close_s"] * 1e3,
        "setup_s": tool["setup_s"],
        "bytes_per_scalar": tool["bytes"] / (steps * k),
    }


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Each configuration's medians over the rounds (the rounds kept beside them)."""
    cells = {}
    for key, rounds in measured["runs"].items():
        cells[key] = {m: statistics.median(r[m] for r in rounds) for m in rounds[0]}
        cells[key]["rounds"] = len(rounds)
        cells[key]["cpu_ratio_each_round"] = [round(r["cpu_ratio"], 3) for r in rounds]
    return cells


# -- the page and the plot, from the results file --


def _cell(cells: dict[str, Any], tool: str, label: str, k: int, what: str, fmt: str) -> str:
    got = cells.get(f"{tool}|{label}|{k}")
    return "n/a" if got is None else format(got[what], fmt)


def render(results: dict[str, Any]) -> dict[str, Any]:
    """What the page quotes, made from the measured ``results`` (a results file's): its tables
    (``tables``), the caller's-cost verdicts (``bar``, against ``caller_bar``), the sentence
    naming the tools not in the run (``not_run``, empty when all ran) and the steps per run of
    each step size, in the order of ``step_sizes`` (``steps_each``)."""
    cells, tools = results["cells"], results["tools"]
    labels, ks = results["step_sizes"], results["ks"]
    shown = [t for t in TOOLS if tools.get(t, {}).get("status") == "ran"]
    table = _results.table
    steps = [f"{label} step, K = {k}" for label in labels for k in ks]
    cpu = [
        ["no logging, CPU µs/step", ""]
        + [_cell(cells, REFERENCE, lb, k, "none_cpu_us", ".0f") for lb in labels for k in ks]
    ]
    for t in shown:
        title, keeps, _ = TOOLS[t]
        row = [_cell(cells, t, lb, k, "cpu_ratio", ".2f") + "x" for lb in labels for k in ks]
        cpu.append([title, keeps, *row])
    wall = []
    for t in shown:
        row = [_cell(cells, t, lb, k, "wall_ratio", ".2f") + "x" for lb in labels for k in ks]
        wall.append([TOOLS[t][0], *row, _cell(cells, t, labels[0], ks[-1], "close_ms", ".0f")])
    ref = {k: cells.get(f"{REFERENCE}|{labels[0]}|{k}") for k in ks}
    caller = []
    for t in shown:
        ns = [_cell(cells, t, labels[0], k, "caller_ns", ",.0f") for k in ks]
        against = []
        for k in ks:
            got, base = cells.get(f"{t}|{labels[0]}|{k}"), ref[k]
            ok = got is not None and base is not None and base["caller_ns"] > 0
            against.append(f"{got['caller_ns'] / base['caller_ns']:.2f}" if ok else "n/a")
        stored = _cell(cells, t, labels[0], ks[-1], "bytes_per_scalar", ".1f")
        caller.append([TOOLS[t][0], *ns, *against, stored])
    absent = [t for t in TOOLS if t in tools and tools[t]["status"] != "ran"]
    return {
        "tables": {
            "cpu": table(["logger", "keeps", *steps], cpu, "ll" + "r" * len(steps)),
            "wall": table(["logger", *steps, "close, ms"], wall),
            "caller": table(
                [
                    "logger",
                    *(f"K = {k}, ns" for k in ks),
                    *(f"/ `record`, K = {k}" for k in ks),
                    "bytes/scalar",
                ],
                caller,
            ),
            "cheapest": table(
                [
                    "keeps",
                    "step",
                    "K",
                    "monitor_bus, its cheapest",
                    "ratio",
                    "the cheapest other",
                    "ratio",
                    "monitor_bus cheapest",
                ],
                cheapest(cells, shown, labels, ks),
                "llrlrlrl",
            ),
        },
        "bar": bar(cells, shown, labels[0], ks),
        "caller_bar": CALLER_BAR,
        "not_run": (
            "Not in this run: "
            + "; ".join(f"{TOOLS[t][0]}: {tools[t]['status']}" for t in absent)
            + "."
            if absent
            else ""
        ),
        "steps_each": [results["steps"][label] for label in labels],
    }


def printed(results: dict[str, Any]) -> str:
    """The text a run prints: the page's tables, the verdicts and the tools not run."""
    parts = [_results.markdown(results["tables"][name]) for name in TABLES]
    parts.append(results["bar"])
    if results["not_run"]:
        parts.append(results["not_run"])
    return "\n\n".join(parts)


def bar(cells: dict[str, Any], shown: list[str], label: str, ks: list[int]) -> str:
    """Which of monitor_bus's ways meet the caller's-cost bar, at which K."""
    said = []
    for t in shown:
        if not t.startswith("mb_"):
            continue
        verdicts: dict[bool, list[str]] = {True: [], False: []}
        for k in ks:
            got, ref = cells.get(f"{t}|{label}|{k}"), cells.get(f"{REFERENCE}|{label}|{k}")
            if got is None or ref is None or ref["caller_ns"] <= 0:
                continue
            verdicts[got["caller_ns"] / ref["caller_ns"] <= CALLER_BAR].append(str(k))
        parts = [
            f"{'met' if met else 'not met'} at K = {', '.join(k)}"
            for met, k in verdicts.items()
            if k
        ]
        said.append(f"{TOOLS[t][0]}: {'; '.join(parts)}")
    return f"The caller's cost at most {CALLER_BAR} of `record`'s: " + ". ".join(said) + "."


def cheapest(
    cells: dict[str, Any], shown: list[str], labels: list[str], ks: list[int]
) -> list[list[str]]:
    """monitor_bus's cheapest way against the cheapest other tool keeping the same kind of
    data, by process CPU per step, for each step and K: the rows of the page's last table."""
    rows = []
    for kind, (ours, theirs) in KINDS.items():
        for label in labels:
            for k in ks:
                best = []
                for group in (ours, theirs):
                    ran = [t for t in group if t in shown]
                    if not ran:
                        break
                    best.append(min(ran, key=lambda t: cells[f"{t}|{label}|{k}"]["cpu_ratio"]))
                if len(best) < 2:
                    continue
                mine, other = (cells[f"{t}|{label}|{k}"] for t in best)
                a, b = mine["cpu_ratio"], other["cpu_ratio"]
                # Half the widest range of either's rounds: a gap under it is the machine's noise.
                spread = max(
                    (max(c["cpu_ratio_each_round"]) - min(c["cpu_ratio_each_round"])) / 2
                    for c in (mine, other)
                )
                verdict = (
                    "yes" if a <= b else "within the rounds' spread" if a - b <= spread else "no"
                )
                rows.append(
                    [kind, label, str(k), TOOLS[best[0]][0], f"{a:.2f}x"]
                    + [TOOLS[best[1]][0], f"{b:.2f}x", verdict]
                )
    return rows


def plot(record: dict[str, Any], path: Path) -> None:
    """CPU per step against no logging, against K, one panel per step size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    res = record["results"]
    cells, labels, ks = res["cells"], res["step_sizes"], res["ks"]
    shown = [t for t in TOOLS if res["tools"].get(t, {}).get("status") == "ran"]
    fig, axes = plt.subplots(1, len(labels), figsize=(12, 5), sharey=True, squeeze=False)
    colors = plt.get_cmap("tab20").colors
    markers = "os^Dv<>pXh*P"
    lowest, highest = 1.0, 1.0
    for ax, label in zip(axes[0], labels, strict=True):
        for n, t in enumerate(shown):
            ys = [cells[f"{t}|{label}|{k}"]["cpu_ratio"] for k in ks]
            lowest, highest = min(lowest, *ys), max(highest, *ys)
            mine = t.startswith("mb_")
            ax.plot(
                ks,
                ys,
                marker=markers[n % len(markers)],
                linestyle="-" if mine else "--",
                linewidth=2.2 if mine else 1.2,
                color=colors[2 * n if n < 10 else 2 * (n - 10) + 1],
                label=TOOLS[t][0].replace("`", ""),
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(k) for k in ks])
        ax.set_xlabel("scalars logged per step (K)")
        ax.set_title(f"{label} training step")
        ax.grid(True, which="major", alpha=0.3)
    steps = (0.5, 0.7, 1, 1.2, 1.5, 2, 3, 5, 10, 20, 50, 100, 200)
    ticks = [t for t in steps if lowest / 1.1 <= t <= highest * 1.1 or t == 1]
    axes[0][0].yaxis.set_major_locator(FixedLocator(ticks))
    axes[0][0].yaxis.set_minor_formatter(NullFormatter())
    axes[0][0].set_yticklabels([f"{t:g}x" for t in ticks])
    axes[0][0].set_ylabel("process CPU per step / no logging")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=positive, default=5, help="rounds (default 5)")
    parser.add_argument(
        "--steps", type=positive, default=1000, help="steps of the 0.3 ms step (default 1,000)"
    )
    parser.add_argument(
        "--long-steps", type=positive, default=100, help="steps of the 10 ms step (default 100)"
    )
    parser.add_argument("--ks", type=positive, nargs="+", default=list(KS), help="K values")
    parser.add_argument(
        "--step-sizes", nargs="+", choices=list(STEPS), default=list(STEPS), help="steps to run"
    )
    parser.add_argument(
        "--tools", nargs="+", choices=list(TOOLS), default=list(TOOLS), help="tools to run"
    )
    parser.add_argument("--seed", type=int, default=0, help="the shuffles' seed")
    parser.add_argument(
        "--timeout", type=float, default=1200.0, help="seconds for one tool's interpreter"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS / "peers.json",
        help="the results file (default benchmarks/results/peers.json)",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: make the tables again from the results file's figures",
    )
    parser.add_argument("--plot", type=Path, metavar="PNG", help="plot CPU per step against K")
    args = parser.parse_args()
    if args.render:
        _results.amend(
            "peers", render(load("peers", path=args.results)["results"]), path=args.results
        )
    else:
        status = {t: missing(t) for t in TOOLS}
        tools = [t for t in args.tools if status[t] is None]
        load_before = os.getloadavg()[0]
        measured = measure(args, tools)
        results = {
            "step_sizes": args.step_sizes,
            "ks": args.ks,
            "rounds": args.rounds,
            "steps": {"0.3 ms": args.steps, "10 ms": args.long_steps},
            "batches": STEPS,
            "tools": {
                t: {
                    "status": (
                        f"not installed ({status[t]})"
                        if status[t] is not None
                        else f"failed: {measured['errors'][t]}"
                        if t in measured["errors"]
                        else "ran"
                    )
                }
                for t in args.tools
            },
            "cells": summarize(measured),
            "load": [load_before, os.getloadavg()[0]],
        }
        save("peers", results | render(results), packages=PACKAGES, path=args.results)
    record = load("peers", path=args.results)
    print(printed(record["results"]))
    if args.plot is not None:
        plot(record, args.plot)
    failed = [t for t, s in record["results"]["tools"].items() if s["status"].startswith("failed")]
    return 1 if failed and not args.render else 0


if __name__ == "__main__":
    sys.exit(main())
