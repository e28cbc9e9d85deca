"""mkdocs hook: a page's measured figures are quoted from benchmark results files at build
time, never typed by hand.

A benchmark saves ``benchmarks/results/<name>.json`` (``benchmarks/_results.py``); a page
quotes it with a token the build replaces:

- ``{{ core:ratios.tp_log:.2f }}``: one figure, the value at a key path (dotted keys, list
  indices as numbers) of the file's ``results``, formatted with a Python format spec (none:
  the value as it is). ``{{ core:medians.log_ours/1000:.1f }}`` divides first (ns to µs).
- ``{{ core:tables.results }}``: a table the benchmark saved (``_results.table``), on a line
  of its own.
- ``{{ demo:output }}`` alone in a ``text`` fence: a program's output the benchmark saved as
  one string, its lines as printed.
- ``{{ measured core }}``: the line saying at which commit, on what machine, with which
  versions and command the file was measured.

A page the build does not render (the README) holds each quote as a block: the template in a
comment, then what it renders to, which ``python docs/hooks/figures.py README.md`` rewrites
(``tests/test_figures.py`` checks it is current)::

    <!-- quote
    {{ demo:output }}
    -->
    ...the rendered text...
    <!-- /quote -->

A token after a backslash is shown as written (``\\{{ core:x }}``: docs about tokens). A
missing file or key, or a value that does not take the format, stops the build with a
message naming the page, the file and the key.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# The results file's format (tables, the "measured" line) lives with the benchmarks.
sys.path.insert(0, str(ROOT / "benchmarks"))
import _results  # noqa: E402

TOKEN = re.compile(
    r"(?P<escape>\\?)\{\{\s*(?:measured\s+(?P<measured>[\w-]+)"
    r"|(?P<name>[\w-]+):(?P<path>[\w.-]+?)(?:/(?P<divisor>\d+(?:\.\d+)?(?:e\d+)?))?"
    r"(?::(?P<spec>[^}\s]*))?)\s*\}\}"
)


class FigureError(Exception):
    """A token that cannot be quoted: its file, key or format is wrong."""


@dataclass(frozen=True)
class Quote:
    """One token of a page and what the build puts in its place."""

    page: str
    #: The results file's name (``benchmarks/results/<name>.json``).
    name: str
    #: The key path in its ``results`` ("" for a "measured" line).
    path: str
    divisor: float
    spec: str
    #: The value at the key path (divided), before formatting.
    value: Any
    text: str


def _record(name: str, page: str, results: Path) -> dict[str, Any]:
    file = results / f"{name}.json"
    try:
        return json.loads(file.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise FigureError(f"{page}: no results file {_shown(file)} (quoted as {name!r})") from None
    except ValueError as exc:
        raise FigureError(f"{page}: {_shown(file)} is not JSON: {exc}") from None


def _shown(file: Path) -> str:
    return str(file.relative_to(ROOT)) if file.is_relative_to(ROOT) else str(file)


def _lookup(record: dict[str, Any], path: str) -> Any:
    value: Any = record["results"]
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise KeyError(key)
    return value


def quote(match: re.Match[str], page: str, results: Path = RESULTS) -> Quote:
    """What the build puts in place of the token ``match`` on ``page``.

    Raises:
        FigureError: the file or key is missing, or the value does not take the format.
    """
    if match["measured"]:
        name = match["measured"]
        record = _record(name, page, results)
        return Quote(page, name, "", 1.0, "", None, _results.measured(record))
    name, path, spec = match["name"], match["path"], match["spec"] or ""
    record = _record(name, page, results)
    file = _shown(results / f"{name}.json")
    try:
        value = _lookup(record, path)
    except KeyError as exc:
        raise FigureError(f"{page}: {file} has no key {path!r} (missing {exc})") from None
    divisor = float(match["divisor"]) if match["divisor"] else 1.0
    if _results.is_table(value):
        if divisor != 1.0 or spec:
            raise FigureError(f"{page}: {file} key {path!r} is a table: no divisor or format")
        return Quote(page, name, path, divisor, spec, value, _results.markdown(value))
    if divisor != 1.0:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise FigureError(f"{page}: {file} key {path!r} is {value!r}, not a number to divide")
        value = value / divisor
    try:
        text = format(value, spec)
    except (ValueError, TypeError) as exc:
        raise FigureError(
            f"{page}: {file} key {path!r} = {value!r} does not take the format {spec!r}: {exc}"
        ) from None
    return Quote(page, name, path, divisor, spec, value, text)


def quotes(markdown: str, page: str, results: Path = RESULTS) -> list[Quote]:
    """Every token of ``markdown`` (the source of ``page``), quoted."""
    return [quote(m, page, results) for m in TOKEN.finditer(markdown) if not m["escape"]]


def render(markdown: str, page: str, results: Path = RESULTS) -> str:
    """``markdown`` with every token replaced by what it quotes (a token after a backslash,
    ``\\{{ ... }}``, is shown as it is, without the backslash)."""

    def replace(m: re.Match[str]) -> str:
        return m[0][1:] if m["escape"] else quote(m, page, results).text

    return TOKEN.sub(replace, markdown)


# A quote block of a page the build does not render: its template, then its rendered body.
BLOCK = re.compile(r"<!-- quote\n(?P<template>.*?)\n-->\n(?P<body>.*?)<!-- /quote -->", re.S)


def render_blocks(text: str, page: str, results: Path = RESULTS) -> str:
    """``text`` with each quote block's body rendered afresh from its template."""

    def replace(m: re.Match[str]) -> str:
        body = render(m["template"], page, results)
        return f"<!-- quote\n{m['template']}\n-->\n{body}\n<!-- /quote -->"

    return BLOCK.sub(replace, text)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown, f"docs/{page.file.src_uri}")
    except FigureError as exc:
        raise PluginError(str(exc)) from None


if __name__ == "__main__":
    for name in sys.argv[1:]:
        file = Path(name)
        file.write_text(render_blocks(file.read_text(), name))
