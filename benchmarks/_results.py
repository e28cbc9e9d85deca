"""A benchmark's results file: the one source of every figure a docs page quotes.

``save(name, results)`` writes ``benchmarks/results/<name>.json``: the figures (``results``,
nested dicts of numbers and strings), the commit they were measured at, the machine, the
Python and the versions of the packages that took part, and the command that ran. ``load``
reads one back. A page never holds a measured figure typed by hand; the docs build quotes
these files.
"""

from __future__ import annotations

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


def save(
    name: str, results: dict[str, Any], *, packages: tuple[str, ...] = (), path: Path | None = None
) -> Path:
    """Write ``results`` with the commit, machine, versions (monitor_bus, anyio and
    ``packages``) and command to ``benchmarks/results/<name>.json`` (or ``path``: a test's
    tiny run writes elsewhere); return the file's path."""
    target = path if path is not None else RESULTS / f"{name}.json"
    record = {
        "benchmark": name,
        "commit": commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(*packages),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "results": results,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return target


def load(name: str, *, path: Path | None = None) -> dict[str, Any]:
    """The record ``save`` wrote for ``name`` (or at ``path``)."""
    target = path if path is not None else RESULTS / f"{name}.json"
    return json.loads(target.read_text())
