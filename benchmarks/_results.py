"""A benchmark's results file: the one source of every figure a docs page quotes.

``save(name, results)`` writes ``benchmarks/results/<name>.json``: the figures (``results``,
nested dicts of numbers and strings), the commit they were measured at, the machine, the
Python and the versions of the packages that took part, and the command that ran. ``load``
reads one back; ``amend`` adds what a benchmark renders from those figures (its tables, made
afresh) without measuring again, the run's commit, date and command kept. A page never holds a measured figure typed by hand; the docs build quotes
these files (``docs/hooks/figures.py``): a figure by its key path, a table ``table`` made, and
the ``measured`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from _machine import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The commit the sources are at, ``+dirty`` where the tree holds uncommitted changes."""
    root = RESULTS.parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "monitor_bus")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def versions(*packages: str) -> dict[str, str]:
    """Each of ``packages``' installed version ("not installed" where it is not)."""
    found = {}
    for name in ("monitor_bus", "anyio", *packages):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def machine() -> dict[str, Any]:
    """The machine a run measured: its CPU, cores, system and Python."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
    }


def save_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """Give ``parser`` the ``--save [PATH]`` option every benchmark has: save the results file
    (at ``PATH``, by default ``benchmarks/results/<name>.json``); without it, nothing is saved
    (``args.save`` is None), so a trial run leaves the committed file alone."""
    parser.add_argument(
        "--save",
        type=Path,
        nargs="?",
        const=RESULTS / f"{name}.json",
        help=f"save the results file (default benchmarks/results/{name}.json)",
    )


def save(
    name: str,
    results: dict[str, Any],
    *,
    packages: tuple[str, ...] = (),
    path: Path | None = None,
    command: str | None = None,
) -> Path:
    """Write ``results`` with the commit, machine, versions (monitor_bus, anyio and
    ``packages``) and command to ``benchmarks/results/<name>.json`` (or ``path``: a test's
    tiny run writes elsewhere); return the file's path. ``command`` is the script and its
    arguments unless given (a job that torchrun started gives the torchrun command)."""
    target = path if path is not None else RESULTS / f"{name}.json"
    record = {
        "benchmark": name,
        "commit": commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(*packages),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "results": results,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return target


def amend(name: str, results: dict[str, Any], *, path: Path | None = None) -> Path:
    """Add ``results`` (what a benchmark renders from its saved figures: its tables) to the
    record ``save`` wrote for ``name`` (or at ``path``), keeping its commit, date, machine,
    versions and command: the figures are still that run's, nothing was measured again.
    Returns the file's path."""
    target = path if path is not None else RESULTS / f"{name}.json"
    record = load(name, path=target)
    record["results"] = record["results"] | results
    target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return target


def table(columns: list[str], rows: list[list[str]], align: str = "") -> dict[str, Any]:
    """A table for a results file: its column titles, its rows of cells (the figures formatted
    as the page shows them) and each column's alignment, ``l`` or ``r`` (default: the first
    left, the rest right).

    Raises:
        ValueError: a row or ``align`` does not have one entry per column.
    """
    align = align or "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one l or r per column, got {align!r}")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"rows must have {len(columns)} cells, got {row!r}")
    return {"columns": list(columns), "align": align, "rows": [list(r) for r in rows]}


def is_table(value: object) -> bool:
    """Whether ``value`` (from a results file) is a table ``table`` made."""
    return isinstance(value, dict) and set(value) == {"columns", "align", "rows"}


def markdown(spec: dict[str, Any]) -> str:
    """The markdown of a table ``table`` made."""
    rule = "|".join("---:" if a == "r" else "---" for a in spec["align"])
    lines = [f"| {' | '.join(str(c) for c in row)} |" for row in spec["rows"]]
    return "\n".join([f"| {' | '.join(spec['columns'])} |", f"|{rule}|", *lines])


def measured(record: dict[str, Any]) -> str:
    """The sentence saying at which commit, when, on what machine, with which versions and by
    which command ``record`` (as ``save`` wrote it) was measured."""
    m = record["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
    command = record["command"]
    if command.split(" ", 1)[0].endswith(".py"):
        command = f"python benchmarks/{command}"
    return (
        f"Measured at commit `{record['commit']}` on {record['date'][:10]}: {m['cpu']}, "
        f"{m['cores']} cores, {m['system']}; {m['python']}, {versions}; "
        f"by `{command}`."
    )


def load(name: str, *, path: Path | None = None) -> dict[str, Any]:
    """The record ``save`` wrote for ``name`` (or at ``path``)."""
    target = path if path is not None else RESULTS / f"{name}.json"
    return json.loads(target.read_text())
