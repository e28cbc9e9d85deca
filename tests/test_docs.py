"""The documentation: the site builds strictly, every code block runs or says why not, every
public name has a docstring."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import monitor_bus

from . import conftest
from .conftest import require

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)(?P<rest>.*)$"
)
# Not code: output listings and figures (no language or "text") and diagrams.
_NOT_CODE = {"", "text", "mermaid"}
_MARKER = "<!-- not-run"


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marked: bool

    @property
    def includes(self) -> list[str]:
        """Files included with pymdownx.snippets (``--8<-- "path:section"``)."""
        return re.findall(r'^\s*--8<--\s+"([^":]+)[^"]*"\s*$', self.body, flags=re.M)

    def __str__(self) -> str:
        return f"{self.page.name}:{self.line} ({self.lang or 'no language'})"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence))
            and lines[j].strip().strip(fence[0]) == ""
        ):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append(Block(page, i + 1, m["lang"], "\n".join(body), prev.startswith(_MARKER)))
        i = j + 1
    return found


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python" and not b.marked and not b.includes]


def test_docs_pages_exist() -> None:
    """The pages this project's site is made of are all there."""
    names = {p.name for p in PAGES}
    assert {
        "index.md",
        "getting-started.md",
        "concepts.md",
        "async.md",
        "migrating.md",
        "api.md",
        "sinks.md",
        "performance.md",
        "reliability.md",
        "multihost.md",
        "design.md",
        "contributing.md",
    } <= names


def test_fence_parser_classifies_blocks(tmp_path: Path) -> None:
    """The block finder sees languages, markers and snippet includes as the docs convention says."""
    page = tmp_path / "p.md"
    page.write_text(
        "intro\n\n```python\nx = 1\n```\n\n<!-- not-run: needs torch -->\n```python\nimport torch\n```\n"
        '\n```text\nout\n```\n\n```python\n--8<-- "examples/a.py:part"\n```\n\n```bash\nls\n```\n'
    )
    found = blocks(page)
    assert [(b.lang, b.marked, b.includes) for b in found] == [
        ("python", False, []),
        ("python", True, []),
        ("text", False, []),
        ("python", False, ["examples/a.py"]),
        ("bash", False, []),
    ]
    assert [b.body for b in runnable(page)] == ["x = 1"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_is_run_or_marked(page: Path) -> None:
    """Each code block is run by a test (python, or an include of a tested example) or marked not-run."""
    unaccounted = []
    for block in blocks(page):
        if block.marked or block.lang in _NOT_CODE:
            continue
        if block.includes:
            bad = [
                f
                for f in block.includes
                if not (f.startswith("examples/") and (ROOT / f).is_file())
            ]
            if bad:
                unaccounted.append(f"{block}: includes {bad}, not a tested example")
            continue
        if block.lang != "python":
            unaccounted.append(f"{block}: {block.lang} block without a `{_MARKER}: why -->` marker")
    assert unaccounted == []


_SEP = "=== end of block {} ==="


def expected_outputs(page: Path) -> dict[int, str]:
    """For each runnable block followed directly by a ``text`` block: that text, by block index."""
    all_blocks = blocks(page)
    run = runnable(page)
    out = {}
    for k, block in enumerate(run):
        i = all_blocks.index(block)
        if i + 1 < len(all_blocks) and all_blocks[i + 1].lang == "text":
            out[k] = all_blocks[i + 1].body
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    """A page's python blocks, joined in order, run as one script; a ``text`` block right after
    one is exactly what it prints."""
    run = runnable(page)
    script = "\n\n".join(
        f"# {b}\n{b.body}\nprint({_SEP.format(k)!r}, flush=True)" for k, b in enumerate(run)
    )
    path = tmp_path / f"{page.stem}.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    printed: dict[int, str] = {}
    rest = proc.stdout
    for k in range(len(run)):
        head, found, rest = rest.partition(_SEP.format(k) + "\n")
        if not found:
            break  # block k did not finish
        printed[k] = head.rstrip("\n")
    for k, text in expected_outputs(page).items():
        if k in printed:
            assert printed[k] == text.rstrip("\n"), (
                f"{run[k]} prints something else than the text after it"
            )
    if proc.returncode != 0 and (missing := missing_module(proc.stderr)):
        stopped = run[min(len(printed), len(run) - 1)]
        require(False, f"{stopped} needs {missing}, which is not installed (later blocks not run)")
    assert proc.returncode == 0, f"{page.name}:\n{proc.stderr}"
    assert len(printed) == len(run)


_NO_MODULE = re.compile(r"^ModuleNotFoundError: No module named '([\w.]+)'$", re.M)


def missing_module(stderr: str) -> str | None:
    """The optional package a failed script lacked: named by ModuleNotFoundError, not installed."""
    m = _NO_MODULE.search(stderr)
    if m is None:
        return None
    top = m[1].partition(".")[0]
    return top if top != "monitor_bus" and importlib.util.find_spec(top) is None else None


def test_missing_module_names_only_an_absent_package() -> None:
    """A docs block that fails for lack of a package is told apart from any other failure."""
    tail = "Traceback (most recent call last):\n  ...\n"
    absent = "no_such_package_for_monitor_bus"
    assert missing_module(f"{tail}ModuleNotFoundError: No module named '{absent}.sub'\n") == absent
    assert missing_module(f"{tail}ModuleNotFoundError: No module named 'pytest'\n") is None
    assert missing_module(f"{tail}ModuleNotFoundError: No module named 'monitor_bus.x'\n") is None
    assert missing_module(f"{tail}NameError: name 'torch' is not defined\n") is None


def test_a_block_needing_an_absent_package_skips_outside_ci_and_fails_in_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page whose block imports a package that is not installed is skipped, or failed under CI,
    after checking the blocks before it."""
    page = tmp_path / "p.md"
    page.write_text(
        "```python\nprint('ran')\n```\n\n```text\nran\n```\n\n"
        "```python\nimport no_such_package_for_monitor_bus\n```\n"
    )
    monkeypatch.setattr(conftest, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match=r"p.md:9 \(python\) needs no_such_package"):
        test_python_blocks_run(page, tmp_path)
    monkeypatch.setattr(conftest, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI=true but p.md:9"):
        test_python_blocks_run(page, tmp_path)
    page.write_text(page.read_text().replace("```text\nran", "```text\nsomething else"))
    with pytest.raises(AssertionError, match="prints something else"):
        test_python_blocks_run(page, tmp_path)


def test_mkdocs_builds_strictly(docs_site: Path) -> None:
    """`mkdocs build --strict` succeeds and the API page documents every public name with a docstring."""
    site = docs_site
    api = (site / "api" / "index.html").read_text()
    for name in ("EventBus", "Stat", "log_event", "register_event_handler", "subscribe"):
        assert f'id="monitor_bus.{name}"' in api, name
    concepts = (site / "concepts" / "index.html").read_text()
    assert '<pre class="mermaid">' in concepts
    # The diagram library is served by the site (the theme fetches it only if it is missing).
    assert '<script src="../assets/javascripts/mermaid.min.js"></script>' in concepts
    script = (site / "assets" / "javascripts" / "mermaid.min.js").read_bytes()
    assert len(script) > 1_000_000
    assert b"mermaid" in script[:10_000]
    assert "fonts.googleapis.com" not in concepts  # nothing is loaded from the internet


# An issue or pull request cited by number ("issue 23", "issues 22-25", "PR 7", "#23"), which a
# reader of the pages cannot look up. Not: an anchor ("page.md#16-ranks", "#23-foo"), an HTML
# entity ("&#123;"), a CSS colour ("color: #123456", "fill:#333"), a heading's "## ".
_ISSUE_WORD = re.compile(r"\b(?:issues?|pull requests?)\s+#?\d+|\b(?:PRs?|GH)[\s-]#?\d+", re.I)
_ISSUE_HASH = re.compile(r"(?<![\w&#/.\]):])(?<!: )#\d+(?![\w-])")


def issue_references(text: str) -> list[str]:
    """The issue references in ``text``, as written ("issue #7" once, not also as "#7")."""
    words = list(_ISSUE_WORD.finditer(text))
    hashes = [
        m
        for m in _ISSUE_HASH.finditer(text)
        if not any(w.start() <= m.start() < w.end() for w in words)
    ]
    return [m.group() for m in (*words, *hashes)]


def test_issue_references_are_told_from_anchors_and_colours() -> None:
    """The pattern finds issue numbers however they are cited, and leaves anchors, entities,
    colours and headings alone."""
    cited = "issue 23; (issue 25's bound); Issues 22-25; issue #7; PR 12; fixed in #120, see #9."
    assert issue_references(cited) == [
        *("issue 23", "issue 25", "Issues 22", "issue #7", "PR 12"),
        *("#120", "#9"),
    ]
    legitimate = (
        "[Performance](performance.md#16-ranks-on-2-cores) [top](#23-ranks) &#123; "
        "color: #123456; fill:#333; ## 16 ranks; x = 1  # 2 steps; rank 3 of 4; an issue-free run"
    )
    assert issue_references(legitimate) == []


def test_no_page_cites_an_issue_number() -> None:
    """No page (README.md, docs/*.md, their headings included) cites an issue by number: it says
    what was measured and links where it is measured. CHANGELOG.md is not a page."""
    found = {
        f"{page.name}:{i}": refs
        for page in [ROOT / "README.md", *PAGES]
        for i, line in enumerate(page.read_text().splitlines(), 1)
        if (refs := issue_references(line))
    }
    assert found == {}


def test_no_built_page_cites_an_issue_number(docs_site: Path) -> None:
    """Nor does any page as built, the API page's docstrings and the included files too."""
    found = {}
    for page in sorted(docs_site.rglob("index.html")):
        source = page.read_text()
        article = source[source.find("<article") : source.find("</article>")]
        article = re.sub(r"<(script|style)\b.*?</\1>", "", article, flags=re.S)
        text = html.unescape(re.sub(r"<[^>]+>", "", article))
        if refs := issue_references(text):
            found[str(page.relative_to(docs_site))] = refs
    assert found == {}


def test_every_public_name_has_a_docstring() -> None:
    """Each name in monitor_bus.__all__ has a docstring the API reference can render."""
    try:
        import griffe
    except ImportError as exc:
        require(False, f"griffe (from mkdocstrings[python]) is missing: {exc}")
    package = griffe.load("monitor_bus", search_paths=[str(ROOT)])
    missing = []
    for name in monitor_bus.__all__:
        obj = package[name]
        try:
            doc = obj.docstring
        except Exception:  # an alias griffe cannot resolve
            doc = None
        if doc is None or not doc.value.strip():
            missing.append(name)
    assert missing == []


def _module_map() -> object:
    """docs/module_map.py, the design page's map generator, as a module."""
    spec = importlib.util.spec_from_file_location("module_map", DOCS / "module_map.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_design_page_holds_the_module_map_as_the_sources_give_it() -> None:
    """docs/design.md's module map is what docs/module_map.py makes of the sources now."""
    module_map: Any = _module_map()
    page = (DOCS / "design.md").read_text()
    start = page.index(module_map.BEGIN)
    end = page.index(module_map.END) + len(module_map.END)
    assert page[start:end] == module_map.render(), "run: python docs/module_map.py"


def test_no_import_climbs_back_up() -> None:
    """No module imports, even inside a function, a module that imports it (directly or
    through others): where a low module must call up, a higher one joins its registry."""
    module_map: Any = _module_map()
    assert module_map.climbs(module_map.modules()) == set()
