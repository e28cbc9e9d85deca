"""How often the slowdown rule names something in a clean job, and how soon it names a real
slowdown: from real merged step-time windows recorded on this machine.

    python benchmarks/slowdown_rule.py [TRACE.jsonl ...] [--trials 300] [--save]

The traces (default: ``benchmarks/traces/*.jsonl``, made by ``benchmarks/step_time_trace.py``:
3 gloo ranks training a DDP model under ``StepAnatomy``, merged, nothing slowed on purpose)
are read with ``monitor_bus.read_jsonl``; their series is each window's merged
``step.time_s`` mean, noisy as the shared machine made it. For each rule:

- Clean: the rule run over each trace as recorded (the machine's own load changes included,
  and they are real changes of the job's step time) and over the trace made steady (each
  window over the median of the ``2 * SPAN + 1`` around it: the recorded noise from window
  to window, without the slow changes); names per 1,000 windows.
- Shifts of 5%, 10%, 20% and 50%: ``--trials`` times each, a trace drawn at random and made
  steady (the machine's own changes would name slowdowns of their own), a window ``t``
  drawn at random (at least 40 windows from its start, ``HORIZON`` from its end), every
  window from ``t`` on multiplied by 1 + the shift, the rule run from ``LEAD`` windows
  before ``t``. Detected: a slowdown named within ``HORIZON`` windows from ``t``; its
  delay, the windows from ``t`` to the one it is named in (median, p90); where it began:
  the share of the detected whose first slowdown named began at ``t`` (and within a window
  of it). "Named anyway": the same count on the trial's windows without the shift.

Rules: the package's (``SlowdownRule``, its defaults and half and twice the evidence), and
the simple rule it was chosen over (``K_IN_A_ROW`` windows in a row each at least 1 +
threshold times the median of the ``BASELINE`` windows before, then that level the baseline).
It prints its three tables (the traces, the rules' rates, where the slowdowns they named
began); ``--save`` saves them with the figures they are made of to
``benchmarks/results/slowdown_rule.json``, which the "A slowdown" section of
docs/multihost.md quotes.
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _machine import positive  # noqa: E402

from monitor_bus import read_jsonl  # noqa: E402
from monitor_bus.ranks import SlowdownRule  # noqa: E402
from monitor_bus.ranks import _slowdown as rule_module  # noqa: E402

# The rule's defaults, as its signature gives them.
DEFAULTS = {
    name: p.default for name, p in inspect.signature(rule_module.SlowdownRule).parameters.items()
}

HERE = Path(__file__).resolve().parent
SHIFTS = (0.05, 0.10, 0.20, 0.50)
HORIZON = 60
LEAD = 120
SPAN = 20
THRESHOLD = 0.1
K_IN_A_ROW = 5
BASELINE = 30

# A rule as the benchmark runs it: fed (stamp, mean), the stamp of the window a slowdown
# it names began in, or None.
Rule = Callable[[datetime, float], datetime | None]


def package_rule(evidence: float) -> Callable[[], Rule]:
    def make() -> Rule:
        # The fewest windows: as many as the evidence takes at the most a window scores.
        rule = SlowdownRule(THRESHOLD, evidence=evidence, windows=math.ceil(2 * evidence))

        def add(stamp: datetime, mean: float) -> datetime | None:
            found = rule.add(stamp, mean)
            return None if found is None else found.began

        return add

    return make


def in_a_row_rule() -> Rule:
    """K windows in a row each at least (1 + threshold) x the median of the windows before;
    begun with the first of them."""
    history: deque[float] = deque(maxlen=BASELINE)
    run: list[tuple[datetime, float]] = []

    def add(stamp: datetime, mean: float) -> datetime | None:
        if len(history) < BASELINE // 3:
            history.append(mean)
            return None
        if mean >= (1 + THRESHOLD) * statistics.median(history):
            run.append((stamp, mean))
            if len(run) == K_IN_A_ROW:
                began = run[0][0]
                history.clear()
                history.extend(m for _, m in run)
                run.clear()
                return began
            return None
        history.extend(m for _, m in run)
        history.append(mean)
        run.clear()
        return None

    return add


def names(
    make: Callable[[], Rule], stamps: list[datetime], series: list[float]
) -> list[tuple[int, int]]:
    """Each slowdown a fresh rule names: (the index of the window it is named in, of the
    window it began in)."""
    rule = make()
    where = {stamp: i for i, stamp in enumerate(stamps)}
    found = []
    for i, (stamp, mean) in enumerate(zip(stamps, series, strict=True)):
        began = rule(stamp, mean)
        if began is not None:
            found.append((i, where[began]))
    return found


def steady(series: list[float]) -> list[float]:
    """``series`` without the machine's slow changes: each window over the median of the
    ``2 * SPAN + 1`` around it, times the series' median. What is left is the noise from
    window to window, of the size recorded."""
    middle = statistics.median(series)
    out = []
    for i, mean in enumerate(series):
        around = series[max(0, i - SPAN) : i + SPAN + 1]
        out.append(mean / statistics.median(around) * middle)
    return out


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def measure(
    make: Callable[[], Rule],
    traces: list[tuple[list[datetime], list[float]]],
    trials: int,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    total = sum(len(series) for _, series in traces)
    recorded = sum(len(names(make, stamps, series)) for stamps, series in traces)
    flat = sum(len(names(make, stamps, steady(series))) for stamps, series in traces)
    result: dict[str, Any] = {
        "windows": total,
        "clean_per_1000": 1000 * recorded / total,
        "steady_per_1000": 1000 * flat / total,
        "shifts": {},
    }
    weights = [max(len(series) - 40 - HORIZON, 0) for _, series in traces]
    for shift in SHIFTS:
        detected, anyway, delays, exact, near = 0, 0, [], 0, 0
        for _ in range(trials):
            stamps, recorded_series = rng.choices(traces, weights)[0]
            series = steady(recorded_series)
            t = rng.randrange(40, len(series) - HORIZON)
            start = max(0, t - LEAD)
            part, when = series[start : t + HORIZON], stamps[start : t + HORIZON]
            slower = part[: t - start] + [m * (1 + shift) for m in part[t - start :]]
            found = [(i + start, b + start) for i, b in names(make, when, slower) if i + start >= t]
            if found:
                detected += 1
                delays.append(found[0][0] - t + 1)
                exact += found[0][1] == t
                near += abs(found[0][1] - t) <= 1
            anyway += any(i + start >= t for i, _ in names(make, when, part))
        result["shifts"][f"{shift * 100:g}"] = {
            "trials": trials,
            "detected": detected / trials,
            "named_anyway": anyway / trials,
            "delay_p50": statistics.median(delays) if delays else None,
            "delay_p90": percentile(delays, 0.9) if delays else None,
            "began_at_shift": exact / detected if detected else None,
            "began_within_1": near / detected if detected else None,
        }
    return result


def tables(results: dict[str, Any], traces: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The page's two tables (``_results.table``): the traces, and each rule's rates."""
    trace_rows = [
        [name, str(t["windows"]), f"{t['median_ms']:.2f}", f"{t['noise']:.2f}"]
        for name, t in traces.items()
    ]
    rule_rows = []
    for r in results.values():
        cells = [r["label"], f"{r['clean_per_1000']:.1f} ({r['steady_per_1000']:.1f})"]
        for x in r["shifts"].values():
            cells.append(
                f"{x['detected']:.0%} ({x['named_anyway']:.0%}), "
                f"{_windows(x['delay_p50'])}/{_windows(x['delay_p90'])}"
            )
        rule_rows.append(cells)
    began_rows = [
        [
            r["label"],
            *(
                f"{_share(x['began_at_shift'])} ({_share(x['began_within_1'])})"
                for x in r["shifts"].values()
            ),
        ]
        for r in results.values()
    ]
    return {
        "traces": _results.table(
            [
                "trace",
                "windows",
                "median step, ms",
                "noise from window to window (sigma of the log)",
            ],
            trace_rows,
        ),
        "rules": _results.table(
            [
                "rule",
                "clean, names per 1,000 windows: as recorded (steady)",
                *(f"{s} shift: detected (named anyway), delay p50/p90" for s in _shift_names()),
            ],
            rule_rows,
        ),
        "began": _results.table(
            ["rule", *(f"{s} shift: began at it (within a window)" for s in _shift_names())],
            began_rows,
        ),
    }


def _shift_names() -> list[str]:
    return [f"{s:.0%}" for s in SHIFTS]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _windows(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--trials", type=positive, default=300)
    parser.add_argument("--seed", type=int, default=0)
    _results.save_argument(parser, "slowdown_rule")
    args = parser.parse_args()
    paths = args.traces or sorted((HERE / "traces").glob("*.jsonl"))
    traces, info = [], {}
    for path in paths:
        events = [e for e in read_jsonl(path) if "step.time_s.mean" in e.data]
        series = [float(e.data["step.time_s.mean"]) for e in events]
        logs = [math.log(m) for m in series]
        steps = [abs(b - a) for a, b in zip(logs, logs[1:], strict=False)]
        traces.append(([e.timestamp for e in events], series))
        info[path.name] = {
            "windows": len(series),
            "median_ms": 1e3 * statistics.median(series),
            "noise": 1.4826 * statistics.median(steps) / math.sqrt(2),
        }
    evidence = DEFAULTS["evidence"]
    rules: dict[str, tuple[str, Callable[[], Rule]]] = {
        "default": (f"SlowdownRule (default, evidence {evidence:g})", package_rule(evidence)),
        "half_evidence": (f"SlowdownRule, evidence {evidence / 2:g}", package_rule(evidence / 2)),
        "twice_evidence": (f"SlowdownRule, evidence {evidence * 2:g}", package_rule(evidence * 2)),
        "in_a_row": (
            f"{K_IN_A_ROW} windows in a row each >= {1 + THRESHOLD:g}x",
            lambda: in_a_row_rule(),
        ),
    }
    results = {
        key: {"label": label, **measure(make, traces, args.trials, args.seed)}
        for key, (label, make) in rules.items()
    }
    settings = {
        "threshold": THRESHOLD,
        "shifts": list(SHIFTS),
        "trials": args.trials,
        "horizon": HORIZON,
        "lead": LEAD,
        "steady_windows": 2 * SPAN + 1,
        "seed": args.seed,
        "in_a_row": {"windows": K_IN_A_ROW, "baseline": BASELINE},
        "rule": {
            "evidence": evidence,
            "windows": DEFAULTS["windows"],
            "baseline": DEFAULTS["baseline"],
            "first": DEFAULTS["first"],
            "reference": rule_module.REFERENCE,
            "confidence": rule_module.CONFIDENCE,
        },
    }
    made = tables(results, info)
    print(*(_results.markdown(made[k]) for k in ("traces", "rules", "began")), sep="\n\n")
    print(f"\n{args.trials} trials a shift, horizon {HORIZON} windows; threshold {THRESHOLD:g}.")
    if args.save is not None:
        _results.save(
            "slowdown_rule",
            {"traces": info, "rules": results, "settings": settings, "tables": made},
            path=args.save,
        )


if __name__ == "__main__":
    main()
