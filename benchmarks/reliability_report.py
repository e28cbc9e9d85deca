"""Run the reliability suite and save its figures, which ``docs/reliability.md`` quotes.

Usage::

    python benchmarks/reliability_report.py            # run tests/reliability, then save
    python benchmarks/reliability_report.py --no-run   # save from the last run's results
    python benchmarks/reliability_report.py -- -m "not stress"   # extra pytest arguments

Each scenario test appends its figures (load, faults, bad inputs, measured outcome) to a
JSON-lines file (``MONITOR_BUS_RELIABILITY_JSON``, see ``tests/reliability/conftest.py``);
pytest's JUnit XML gives every test's result and time. Both go into
``benchmarks/results/reliability.json``, with the tables and lists the page shows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import _results
from _machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
# Not the tests' default file, which any plain pytest run starts afresh.
RESULTS = ROOT / "build" / "reliability-report.jsonl"
JUNIT = ROOT / "build" / "reliability-junit.xml"
META = ROOT / "build" / "reliability-run.json"
PACKAGES = ["monitor_bus", "anyio", "torch", "tensorboard", "hypothesis", "pytest", "psutil"]


def run_suite(extra: list[str]) -> dict[str, Any]:
    """Run pytest on tests/reliability with the recorder on; return when and how it ran."""
    for path in (RESULTS, JUNIT):
        path.unlink(missing_ok=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MONITOR_BUS_RELIABILITY_JSON=str(RESULTS))
    env.pop("MONITOR_BUS_SOAK_SECONDS", None)  # the page publishes the whole minute's soak
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/reliability",
        "-m",
        "",  # the stress scenarios too (the default run leaves them out); extra may narrow
        "-p",
        "no:cacheprovider",
        f"--junitxml={JUNIT}",
        "-q",
        *extra,
    ]
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    meta = {
        "command": " ".join(["python", "-m", "pytest", "tests/reliability", "-m", "''", *extra]),
        "exit_code": code,
        "wall_s": round(time.monotonic() - start, 1),
        "finished": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--", "monitor_bus")),
    }
    META.write_text(json.dumps(meta))
    return meta


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> list[tuple[str, str]]:
    rows = [("OS", f"{platform.system()} {platform.release()} ({platform.machine()})")]
    rows.append(("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores (shared with other jobs)"))
    try:
        import psutil

        rows.append(("Memory", f"{psutil.virtual_memory().total / 2**30:.1f} GiB"))
    except ImportError:
        pass
    rows.append(("Python", f"{platform.python_implementation()} {platform.python_version()}"))
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    rows.append(("Packages", ", ".join(versions)))
    return rows


def load_results() -> list[dict[str, Any]]:
    if not RESULTS.exists():
        return []
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def load_junit() -> list[dict[str, Any]]:
    if not JUNIT.exists():
        return []
    tests = []
    for case in ET.parse(JUNIT).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            result = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            result = "FAILED"
        else:
            result = "passed"
        module = case.get("classname", "").rsplit(".", 1)[-1]
        tests.append(
            {
                "module": module,
                "name": case.get("name", ""),
                "result": result,
                "seconds": float(case.get("time", 0)),
            }
        )
    return tests


def _cell(text: object) -> str:
    return _line(text).replace("|", "\\|")


def _line(text: object) -> str:
    return str(text).replace("\n", " ") or "-"


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)


def outcome(values: dict[str, Any]) -> str:
    return "; ".join(f"{k.replace('_', ' ')}: {_fmt(v)}" for k, v in values.items())


def report(meta: dict[str, Any]) -> dict[str, Any]:
    """The run's results file: its command, time and counts, each scenario's recorded figures,
    every test's result and time, and the tables and lists the page shows of them."""
    results = load_results()
    tests = load_junit()
    stress_ids = {r["scenario"] for r in results if r["stress"]}
    seconds = {t["name"]: t["seconds"] for t in tests}
    passed = sum(t["result"] == "passed" for t in tests)
    failed = [t for t in tests if t["result"] == "FAILED"]
    run = {
        "command": meta.get("command", "?"),
        "exit_code": meta.get("exit_code"),
        "wall_s": meta.get("wall_s"),
        "finished": meta.get("finished", "?"),
        "tests": len(tests),
        "passed": passed,
        "failed": len(failed),
        "skipped": len(tests) - passed - len(failed),
        "default_s": sum(t["seconds"] for t in tests if t["name"] not in stress_ids),
        "stress_s": sum(t["seconds"] for t in tests if t["name"] in stress_ids),
    }
    rows = [
        ["Command", f"`{run['command']}`"],
        ["Finished", run["finished"]],
        ["Tests", f"{len(tests)}: {passed} passed, {len(failed)} failed, {run['skipped']} skipped"],
        [
            "Time",
            f"{run['wall_s']} s in all; default tests {run['default_s']:.1f} s, "
            f"`stress` tests {run['stress_s']:.1f} s",
        ],
        *([key, _cell(value)] for key, value in machine()),
    ]
    out: list[str] = []
    w = out.append
    if failed:
        w(
            "**Failing in this run** (each is a package bug reported to the maintainers, or a "
            "bound the package does not meet yet; the tests stay as they are until it is fixed):"
        )
        w("")
        for t in failed:
            w(f"- `{t['module']}::{t['name']}`")
        w("")
    # A list per group, not one wide table: eight columns of sentences made rows 20 lines tall
    # and wider than the page's column even at 1280 px.
    group = None
    for r in results:
        if r["group"] != group:
            if group is not None:
                w("")
            group = r["group"]
            w(f"### {_line(group)}")
            w("")
        result = "pass" if r["passed"] else "**FAIL**"
        stress = ", stress" if r["stress"] else ""
        w(
            f"- `{_line(r['scenario'])}`: {result}, "
            f"{seconds.get(r['scenario'], r['seconds']):.1f} s{stress}"
        )
        w(f"    - Load: {_line(r['load'])}")
        w(f"    - Faults: {_line(r['faults'])}")
        if _line(r["bad_inputs"]) != "-":
            w(f"    - Bad inputs: {_line(r['bad_inputs'])}")
        w(f"    - Measured: {_line(outcome(r['outcome']))}")
    return {
        "run": run,
        "scenarios": results,
        "tests": tests,
        "tables": {
            "run": _results.table(["", ""], rows, "ll"),
            "tests": _results.table(
                ["Module", "Test", "Result", "s"],
                [
                    [t["module"], f"`{_cell(t['name'])}`", t["result"], f"{t['seconds']:.2f}"]
                    for t in tests
                ],
                "lllr",
            ),
        },
        # Markdown lists: the failing tests (empty when none) and the scenarios by group.
        "markdown": {"scenarios": "\n".join(out)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-run", action="store_true", help="save from the last run's results")
    parser.add_argument(
        "--save",
        type=Path,
        default=_results.RESULTS / "reliability.json",
        help="the results file to write (default benchmarks/results/reliability.json)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    if args.no_run:
        if not META.exists():
            print(f"error: no results at {META}; run without --no-run first", file=sys.stderr)
            return 2
        meta = json.loads(META.read_text())
    else:
        meta = run_suite(args.pytest_args)
    packages = tuple(p for p in PACKAGES if p not in ("monitor_bus", "anyio"))
    saved = _results.save("reliability", report(meta), packages=packages, path=args.save)
    print(f"wrote {saved.relative_to(ROOT) if saved.is_relative_to(ROOT) else saved}")
    return 0 if meta.get("exit_code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
