"""Reliability suite helpers: a recorder of each scenario's measured figures, and probes.

Every scenario test takes the ``figures`` fixture, describes its load, faults and bad inputs,
and records what it measured. At teardown one JSON object per test is appended (one per line)
to the file named by ``MONITOR_BUS_RELIABILITY_JSON`` (default ``build/reliability.jsonl``);
``benchmarks/reliability_report.py`` renders ``docs/reliability.md`` from it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS_ENV = "MONITOR_BUS_RELIABILITY_JSON"
DEFAULT_RESULTS = ROOT / "build" / "reliability.jsonl"


class Figures:
    """What one scenario put the bus through, and what came out."""

    def __init__(self, group: str, scenario: str) -> None:
        self.group = group
        self.scenario = scenario
        self.load = ""
        self.faults = ""
        self.bad_inputs = ""
        self.outcome: dict[str, Any] = {}

    def describe(self, *, load: str = "", faults: str = "", bad_inputs: str = "") -> None:
        """Say what the scenario does (shown in the published table)."""
        self.load, self.faults, self.bad_inputs = load, faults, bad_inputs

    def measure(self, **values: Any) -> None:
        """Record measured outcomes (numbers or short strings)."""
        self.outcome.update(values)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_call_report] = report
    return report


_call_report = pytest.StashKey[pytest.TestReport]()


@pytest.fixture(scope="session", autouse=True)
def _fresh_default_results() -> None:
    """Without the env var, the default file holds the latest run only."""
    if not os.environ.get(RESULTS_ENV):
        DEFAULT_RESULTS.unlink(missing_ok=True)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    module = request.node.module.__name__.rsplit(".", 1)[-1].removeprefix("test_reliability_")
    fig = Figures(module, request.node.name)
    start = time.perf_counter()
    yield fig
    report = request.node.stash.get(_call_report, None)
    record = {
        "nodeid": request.node.nodeid,
        "group": fig.group,
        "scenario": fig.scenario,
        "stress": request.node.get_closest_marker("stress") is not None,
        "load": fig.load,
        "faults": fig.faults,
        "bad_inputs": fig.bad_inputs,
        "outcome": fig.outcome,
        "passed": bool(report is not None and report.passed),
        "seconds": round(time.perf_counter() - start, 3),
    }
    path = Path(os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str, allow_nan=True) + "\n")


def rss_bytes() -> int:
    """This process's resident set size."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU time (user + system) a live thread of this process has used so far."""
    import psutil

    tid = thread.native_id
    for t in psutil.Process().threads():
        if t.id == tid:
            return float(t.user_time + t.system_time)
    raise LookupError(f"thread {thread.name} is not running")


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, nearest rank."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def bus_threads(name: str) -> list[threading.Thread]:
    """Live threads whose name starts with ``monitor_bus-`` and contains ``name``."""
    return [
        t for t in threading.enumerate() if t.name.startswith("monitor_bus-") and name in t.name
    ]
