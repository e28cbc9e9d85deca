"""Every measured figure on a page is quoted from a benchmark's results file by the docs build
(docs/hooks/figures.py), none typed by hand, and two pages quoting one measure agree."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("figures_hook", ROOT / "docs/hooks/figures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


figures = _hook()

# A number with a unit of measurement: time, a rate, a size, a ratio ("1.05x"), a share (%).
_FIGURE = re.compile(
    r"(?<![\w./=<>~^])(?P<figure>\d[\d,]*(?:\.\d+)?"
    r"(?:\s?(?:ns|µs|us|ms|s|events/s|KiB|MiB|MB)\b|x\b|%))"
)
# Code (not output): its numbers are arguments and settings.
_CODE_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_TEXT = {"", "text"}
# A bound or a target ("<= 1.05x", "at most 1%") is a requirement, not a measurement.
_BOUND = re.compile(r"(?:[<>]=?|≤|≥|at most|at least|under|within|up to)\s*~?$")

# Figures on the pages that are not measurements, each with why. (page, pattern, reason): the
# figure is allowed where it lies inside a match of the pattern on its line.
ALLOWED: list[tuple[str, str, str]] = [
    ("*", r"\d+ ms windows?|windows? of \d+ ms|\d+(?:\.\d+)? s windows", "a Stat's window size"),
    ("*", r"linger\w*\W.{0,40}?\d+ m?s\b|up to 100 ms|\b20 ms is|gather for 20 ms", "the linger"),
    ("*", r"(?:once )?(?:per|every) 10 s", "the rate limit of a report on the logger"),
    ("*", r"`\w+` \(\d+ s\)|\(default \d+ s|, and 1 s\)|\d+ s by default", "a timeout's default"),
    ("*", r"\d+ s of its minute", "the soak test's length in CI"),
    ("*", r"16 MiB", "the JSONL sink's buffer and the reader's line limit"),
    ("*", r"16 KiB", "the size of the rank merge's frames"),
    ("*", r"chunk \(64 KiB\)", "the relay's read size"),
    ("*", r"\d+ ms ticks", "the kernel's CPU clock tick"),
    (
        "*",
        r"\d\.\d+% at (?:scale )?-?\d|\d\.\d+% at$|^\| bound \|.*",
        "a percentile's error bound, a formula",
    ),
    ("*", r"for 2\.0 s`", "a warning's text with the example's timeout"),
    ("*", r"\ba 1 ms$", "a timed wait in the explanation of a cancelled send"),
    ("performance.md", r"sleeps \d+ ms|pauses [\d.]+ ms", "measure 7's workload"),
    ("performance.md", r"delays by \d+ ms", "the MLflow proxy's delay, a setting"),
    ("performance.md", r"[\d.]+ s into a \d+ s run", "when the merge benchmark's rank dies"),
    ("performance.md", r"^10 s\)", "the close() timeout of the 16-rank run"),
    ("performance.md", r"between 5 ms$", "the scale job's step, a sleep"),
    ("multihost.md", r"sleeping \d+ ms more", "the slowdown phase's delay in a test"),
    ("multihost.md", r"for 61\.0 s, nor on", "the hang warning's text, an example"),
    (
        "multihost.md",
        r"loading 20 ms slower|spends 20 ms more|step 20 ms longer",
        "the example's delay, a setting",
    ),
    ("multihost.md", r"rank 2? ?30 ms slower per", "the tests' delay, a setting"),
    ("multihost.md", r"^40% of the delay", "the tests' bound"),
    (
        "multihost.md",
        r"[13]\.00x the median  \d windows",
        "the summary's format shown on the two-node test's run, whose rank 3 sleeps 3x by design",
    ),
    ("performance.md", r"fraction of a 10 ms step", "the step StepAnatomy's cost is held against"),
    ("performance.md", r"one bucket per 25 MB", "DDP's default bucket size, torch's setting"),
    (
        "choosing.md",
        r"(?:exported|Exporting) every 250 ms",
        "the OpenTelemetry reader's export interval in the peers benchmark, a setting",
    ),
]
# Sections whose figures come from runs not saved to a results file yet, each with why; the
# figures of the rest of the page are checked.
PENDING: dict[tuple[str, str], str] = {}


def figures_typed_in(page: Path) -> list[str]:
    """The measured-looking figures of ``page`` outside quotes, code and the allowed list, as
    ``page:line: figure (the line)``."""
    found = []
    in_code = False
    code_is_program = False
    # A quote block's body is rendered from its template (checked to be current apart).
    source = figures.BLOCK.sub(lambda m: "\n" * m[0].count("\n"), page.read_text())
    section = ""
    for number, line in enumerate(source.splitlines(), 1):
        if line.startswith("## ") and not in_code:
            section = line.strip()
        if (page.name, section) in PENDING:
            continue
        fence = _CODE_FENCE.match(line)
        if fence:
            in_code = not in_code
            code_is_program = in_code and fence["lang"] not in _TEXT
            continue
        if in_code and code_is_program:
            continue
        text = figures.TOKEN.sub(lambda m: "#" * len(m[0]), line)
        for m in _FIGURE.finditer(text):
            if _BOUND.search(text[: m.start()].rstrip()):
                continue
            if _allowed(page.name, text, m.span()):
                continue
            found.append(f"{page.name}:{number}: {m['figure']} ({line.strip()[:120]})")
    return found


def _allowed(page: str, line: str, span: tuple[int, int]) -> bool:
    for where, pattern, _reason in ALLOWED:
        if where not in ("*", page):
            continue
        for m in re.finditer(pattern, line):
            if m.start() <= span[0] and span[1] <= m.end():
                return True
    return False


def _results_file(directory: Path, name: str, results: object) -> None:
    record = {
        "benchmark": name,
        "commit": "0123456789ab",
        "date": "2026-12-04T08:00:00+00:00",
        "machine": {"cpu": "a CPU", "cores": 2, "system": "Linux 6", "python": "CPython 3.11.7"},
        "versions": {"monitor_bus": "0.1.0", "anyio": "4.16.0"},
        "command": f"{name}.py --rounds 5",
        "results": results,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(record))


def test_a_token_quotes_a_figure_a_table_and_the_measured_line(tmp_path: Path) -> None:
    """A figure is formatted (and divided) as its token says, a table renders as markdown, the
    measured line gives the commit, date, machine, versions and command, and a token after a
    backslash is shown as written."""
    table = {"columns": ["a", "b"], "align": "lr", "rows": [["x", "1.50"]]}
    _results_file(tmp_path, "bench", {"m": {"ns": 5963.0, "n": 387531}, "t": table, "l": [7]})
    page = (
        "{{ bench:m.ns/1000:.1f }} µs, {{ bench:m.n:, }} events/s, {{bench:l.0}}\n\n"
        "{{ bench:t }}\n\n{{ measured bench }} \\{{ bench:m.ns }}\n"
    )
    assert figures.render(page, "p.md", tmp_path) == (
        "6.0 µs, 387,531 events/s, 7\n\n| a | b |\n|---|---:|\n| x | 1.50 |\n\n"
        "Measured at commit `0123456789ab` on 2026-12-04: a CPU, 2 cores, Linux 6; "
        "CPython 3.11.7, monitor_bus 0.1.0, anyio 4.16.0; by `python benchmarks/bench.py "
        "--rounds 5`. {{ bench:m.ns }}\n"
    )


def test_a_saved_output_quoted_in_a_text_block_keeps_its_lines(tmp_path: Path) -> None:
    """A program's output saved as one string, quoted alone in a ``text`` fence, renders as its
    lines exactly as printed (spaces, blank lines and all), and the fence around it stays."""
    output = "stragglers\n  rank 2 (vm)  others waited 15.3 ms/step\n\nrank  wait\n0     11.3"
    _results_file(tmp_path, "run", {"output": output})
    page = "Its output:\n\n```text\n{{ run:output }}\n```\n"
    assert figures.render(page, "p.md", tmp_path) == f"Its output:\n\n```text\n{output}\n```\n"


def test_a_missing_file_key_or_bad_format_names_the_page_file_and_key(tmp_path: Path) -> None:
    """The build stops at a token it cannot quote, naming the page, the file and the key."""
    _results_file(tmp_path, "bench", {"m": {"ns": 5963.0, "label": "x"}})
    cases = {
        "{{ nothing:m.ns }}": "p.md: no results file .*nothing.json",
        "{{ bench:m.us }}": r"p.md: .*bench.json has no key 'm.us' \(missing 'us'\)",
        "{{ bench:m.label:.2f }}": "p.md: .*bench.json key 'm.label' = 'x' does not take",
        "{{ bench:m.label/10 }}": "p.md: .*bench.json key 'm.label' is 'x', not a number",
    }
    for token, message in cases.items():
        with pytest.raises(figures.FigureError, match=message):
            figures.render(token, "p.md", tmp_path)


def test_the_hook_fails_the_build_naming_the_page() -> None:
    """mkdocs' page hook turns a token it cannot quote into a build error on that page."""
    from mkdocs.exceptions import PluginError

    page = SimpleNamespace(file=SimpleNamespace(src_uri="performance.md"))
    with pytest.raises(PluginError, match="docs/performance.md: .*no_such_run.json"):
        figures.on_page_markdown("{{ no_such_run:x }}", page=page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_token_on_a_page_quotes_a_results_file(page: Path) -> None:
    """Every token on every page finds its results file and key (the build would stop)."""
    figures.quotes(page.read_text(), page.name)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quote_blocks_hold_what_their_templates_render(page: Path) -> None:
    """A page the build does not render (the README) holds each quote as rendered from the
    results files now: ``python docs/hooks/figures.py README.md`` has been run."""
    text = page.read_text()
    assert figures.render_blocks(text, page.name) == text


def test_a_quote_block_is_rendered_from_its_template(tmp_path: Path) -> None:
    """Rewriting a page's quote blocks replaces each body with its template's rendering and
    leaves the rest of the page as it was."""
    _results_file(tmp_path, "bench", {"ratio": 1.1634})
    page = "a\n<!-- quote\n{{ bench:ratio:.2f }}x\n-->\n0.99x\n<!-- /quote -->\nb 1.5x\n"
    assert figures.render_blocks(page, "p.md", tmp_path) == (
        "a\n<!-- quote\n{{ bench:ratio:.2f }}x\n-->\n1.16x\n<!-- /quote -->\nb 1.5x\n"
    )


def test_the_check_finds_typed_figures_and_passes_quotes_code_bounds_and_settings(
    tmp_path: Path,
) -> None:
    """A typed figure with a unit is found in prose, tables and output listings; a quoted one,
    one in code, a target and an allowed setting are not."""
    page = tmp_path / "p.md"
    page.write_text(
        "It took 3,103 ns, or 1.16x, at 13% of a core.\n"
        "| a | 42.8 ms |\n"
        "```text\nlatency p50 52.23 ms\n```\n"
        "```python\ntime.sleep(0.01)  # 10 ms\n```\n"
        "{{ core:ratios.tp_log:.2f }}x against a target of <= 1.5x, at most 1%, "
        "250 ms windows.\n"
    )
    assert [f.split(" (")[0] for f in figures_typed_in(page)] == [
        "p.md:1: 3,103 ns",
        "p.md:1: 1.16x",
        "p.md:1: 13%",
        "p.md:2: 42.8 ms",
        "p.md:4: 52.23 ms",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_types_a_measured_figure(page: Path) -> None:
    """A number with a unit on a page is quoted from a results file, or is a setting or a
    target the allowed list names."""
    assert figures_typed_in(page) == []


def quoted_differently(pages: list[Path], results: Path = figures.RESULTS) -> list[str]:
    """The keys ``pages`` quote in more than one way (divisor or format): one measure is
    shown as one figure everywhere, not 1.2 on one page and 1.16 on another."""
    ways: dict[tuple[str, str], set[tuple[float, str]]] = {}
    where: dict[tuple[str, str], list[str]] = {}
    for page in pages:
        for q in figures.quotes(page.read_text(), page.name, results):
            if q.path and not isinstance(q.value, dict):
                ways.setdefault((q.name, q.path), set()).add((q.divisor, q.spec))
                where.setdefault((q.name, q.path), []).append(f"{page.name}: {q.text}")
    return [f"{n}:{k} quoted as {where[n, k]}" for (n, k), w in ways.items() if len(w) > 1]


def test_a_measure_quoted_two_ways_is_found(tmp_path: Path) -> None:
    """The same key quoted with two formats, on one page or two, is reported."""
    _results_file(tmp_path / "r", "bench", {"ratio": 1.1634})
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("{{ bench:ratio:.2f }} and {{ bench:ratio:.2f }}")
    b.write_text("{{ bench:ratio:.1f }}")
    assert quoted_differently([a], tmp_path / "r") == []
    assert quoted_differently([a, b], tmp_path / "r") == [
        "bench:ratio quoted as ['a.md: 1.16', 'a.md: 1.16', 'b.md: 1.2']"
    ]


def test_one_measure_is_quoted_one_way_on_every_page() -> None:
    """No key of a results file is quoted with two formats or divisors across the pages."""
    assert quoted_differently(PAGES) == []
