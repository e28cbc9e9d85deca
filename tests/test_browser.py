"""The docs site and the demo's TensorBoard run, opened in headless Chromium as a reader would.

The site is built strictly, served on loopback and loaded with every request off the machine
refused (the site must work offline). The demo's run is read back through a real
``tensorboard`` server's HTTP API. Needs Debian's ``chromium`` and the ``playwright`` package
(the test extra); skipped without them, failed under ``CI=true``. With
``MONITOR_BUS_SCREENSHOTS=DIR`` the tests also save screenshots there (``docs/screenshots.py``
does this for docs/img).
"""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monitor_bus import STAT_EVENT, read_jsonl

from .conftest import require

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium")  # Debian's; .ci/run's newcomer stage hides it
SHOTS = os.environ.get("MONITOR_BUS_SCREENSHOTS")
WIDTH = 1280
DEMO_STEPS = 3000 if SHOTS else 400  # a full run for the pictures, a short one otherwise


def shoot(page: Any, name: str, **options: Any) -> None:
    """Save a screenshot as SHOTS/name.png when screenshots are asked for."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), animations="disabled", **options)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require(CHROMIUM is not None, "Chromium is not on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as driver:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site(docs_site: Path) -> Iterator[str]:
    """The docs site, built strictly (the run's one build), served on loopback."""
    out = docs_site
    handler = functools.partial(_Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()
    thread.join()


class Visit:
    """A page opened at 1280 px (or ``width``) with what went wrong recorded: console errors, uncaught
    exceptions, and requests that tried to leave the machine (refused)."""

    def __init__(self, browser: Any, url: str, height: int = 900, width: int = WIDTH) -> None:
        self.errors: list[str] = []
        self.external: list[str] = []
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        local = urllib.parse.urlsplit(url).netloc

        def route(r: Any) -> None:
            if urllib.parse.urlsplit(r.request.url).netloc == local:
                r.continue_()
            else:
                self.external.append(r.request.url)
                r.abort()

        self.page.route("**/*", route)
        self.page.goto(url, wait_until="networkidle")

    def close(self) -> None:
        self.page.close()


# The site's pages, from mkdocs.yml's nav (its paths as served).
PAGES = [
    "",
    "getting-started/",
    "concepts/",
    "async/",
    "migrating/",
    "sinks/",
    "performance/",
    "choosing/",
    "reliability/",
    "multihost/",
    "integrations/",
    "design/",
    "api/",
    "contributing/",
]

_OVERFLOW = """() => {
    const page = document.documentElement.scrollWidth - document.documentElement.clientWidth;
    const code = [...document.querySelectorAll("pre > code")]
        .filter(e => e.scrollWidth > e.clientWidth + 1)
        .map(e => e.textContent.split("\\n")[0].slice(0, 60));
    return {page, code};
}"""

# Code blocks whose rendered lines differ from their source lines: a wrapped line (split
# mid-identifier, or a continuation at column 0 that reads as a dedent) shows as extra lines.
_REFLOWED = """() => [...document.querySelectorAll("article pre > code")].map(code => {
    const style = getComputedStyle(code);
    const height = code.clientHeight - parseFloat(style.paddingTop)
        - parseFloat(style.paddingBottom) - (code.offsetHeight - code.clientHeight);
    const lines = code.textContent.replace(/\\n$/, "").split("\\n").length;
    return {lines, rendered: height / parseFloat(style.lineHeight),
            first: code.textContent.split("\\n")[0].slice(0, 60)};
}).filter(b => Math.abs(b.rendered - b.lines) > 0.5)"""

# Tables wider than the text column (not just scrolling in their own box), and the tallest
# row of each, in lines of its text.
_TABLES = """() => {
    const column = document.querySelector("article").getBoundingClientRect();
    return [...document.querySelectorAll("article table")].map(t => {
        const box = t.getBoundingClientRect();
        const line = parseFloat(getComputedStyle(t.querySelector("td, th")).lineHeight);
        return {
            head: t.querySelector("th").textContent.trim().slice(0, 30),
            beyond: Math.max(0, Math.round(box.right - column.right), t.scrollWidth - t.clientWidth),
            tallest: Math.max(...[...t.querySelectorAll("td")]
                .map(c => c.getBoundingClientRect().height)) / line,
        };
    });
}"""


def test_nav_lists_the_pages_checked() -> None:
    """The pages the browser test visits are the site's nav, so a new page is not missed."""
    nav = re.findall(r"^  - [^:]+: (\S+)\.md$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert [("" if page == "index" else f"{page}/") for page in nav] == PAGES


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p or "home")
def test_page_fits_1280px_and_a_phone_offline_without_errors(
    browser: Any, site: str, path: str
) -> None:
    """At 1280 px the page has no sideways scrollbar, no code block scrolls or wraps, no table is wider than the text column or has rows over 10 lines
    tall, nothing is fetched from outside and the console has no error. Resized to a phone's
    390 px (the layout is CSS: the same as a page loaded at that width, without a second load
    of each page), every code block shows its lines as written: none is wrapped (so none is
    split mid-identifier or sent to column 0; a long line scrolls inside its block), and the
    page does not scroll sideways (a wide table scrolls inside its own box)."""
    visit = Visit(browser, site + path)
    try:
        overflow = visit.page.evaluate(_OVERFLOW)
        assert overflow == {"page": 0, "code": []}
        assert visit.page.evaluate(_REFLOWED) == []
        tables = visit.page.evaluate(_TABLES)
        assert [t for t in tables if t["beyond"] > 0] == []
        assert [t for t in tables if t["tallest"] > 10] == []
        visit.page.set_viewport_size({"width": 390, "height": 900})
        assert visit.page.evaluate(_REFLOWED) == []
        assert visit.page.evaluate(_OVERFLOW)["page"] == 0
        assert visit.external == []
        assert visit.errors == []
    finally:
        visit.close()


# Code in a table cell or a heading shown on more than one line (split inside an identifier:
# `monitor_bu`/`s`), and dotted names in the API headings broken other than after a dot.
_SPLIT_CODE = """() => {
    const split = [...document.querySelectorAll(
            "article td code, article th code, article .doc-heading code")]
        .filter(code => code.getClientRects().length > 1)
        .map(code => code.textContent.slice(0, 60));
    for (const name of document.querySelectorAll("article .doc-heading .doc-object-name")) {
        let top = null, before = "";
        const walker = document.createTreeWalker(name, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode())
            for (let i = 0; i < node.length; i++) {
                const range = document.createRange();
                range.setStart(node, i);
                range.setEnd(node, i + 1);
                const rects = range.getClientRects();
                if (rects.length === 0) continue;  // collapsed white space
                if (top !== null && rects[0].top > top + 1 && before !== ".")
                    split.push(name.textContent.trim());
                top = rects[0].top;
                before = node.data[i];
            }
    }
    return split;
}"""

# The page's images: the file each shows, the link around it, its size and its shown width.
_FIGURES = """() => [...document.querySelectorAll("article img")].map(img => ({
    src: img.currentSrc,
    link: img.closest("a")?.href ?? null,
    natural: img.naturalWidth,
    shown: img.getBoundingClientRect().width,
}))"""

# The page's diagrams (drawn by the theme in place of their source): in a box of their own,
# their width, and whether that box scrolls.
_DIAGRAMS = """() => [...document.querySelectorAll("article .mermaid")].map(d => ({
    boxed: d.parentElement.classList.contains("diagram"),
    shown: d.getBoundingClientRect().width,
    scrolls: d.parentElement.scrollWidth > d.parentElement.clientWidth,
}))"""

# Code blocks whose first line runs under the block's copy button.
_UNDER_COPY_BUTTON = """() => [...document.querySelectorAll("article .md-clipboard")].map(button => {
    const code = button.closest("pre")?.querySelector("code");
    if (!code) return null;
    const range = document.createRange();
    range.selectNodeContents(code);
    const buttonBox = button.getBoundingClientRect();
    const under = [...range.getClientRects()].some(r => r.width > 0
        && r.top < buttonBox.bottom && r.bottom > buttonBox.top && r.right > buttonBox.left);
    return under ? code.textContent.split("\\n")[0].slice(0, 60) : null;
}).filter(line => line !== null)"""


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p or "home")
def test_tables_and_figures_read_at_1280px_and_on_a_phone(
    browser: Any, site: str, path: str
) -> None:
    """At 1280 px and at 390 px, no code in a table cell or a heading is split over lines (a
    wide table scrolls in its box instead) and an API heading's dotted name breaks only after a
    dot; at 1280 px no code line runs under its copy button. Every image links to its own file,
    which is at least as wide as the image is shown at 1280 px: on a phone, where it is shrunk to
    the column, a tap opens it at full size. A diagram fits the column at 1280 px; on a phone it
    is drawn at least 700 px wide (labels of about 10 px, not the 4 px of the column's width)
    and scrolls in its own box."""
    visit = Visit(browser, site + path)
    try:
        page = visit.page
        page.wait_for_function("document.querySelectorAll('pre.mermaid').length === 0")
        diagrams = page.evaluate(_DIAGRAMS)
        assert [d for d in diagrams if not d["boxed"] or d["scrolls"]] == []
        assert page.evaluate(_SPLIT_CODE) == []
        assert page.evaluate(_UNDER_COPY_BUTTON) == []
        figures = page.evaluate(_FIGURES)
        assert [f["src"] for f in figures if f["link"] != f["src"]] == []
        assert [f["src"] for f in figures if f["natural"] < f["shown"]] == []
        for figure in figures:
            served = page.request.get(figure["link"])
            assert served.ok, figure["link"]
            assert served.headers["content-type"].startswith("image/"), figure["link"]
        page.set_viewport_size({"width": 390, "height": 900})
        assert page.evaluate(_SPLIT_CODE) == []
        assert [f["src"] for f in page.evaluate(_FIGURES) if f["link"] != f["src"]] == []
        diagrams = page.evaluate(_DIAGRAMS)
        assert [d for d in diagrams if d["shown"] < 700 or not d["scrolls"]] == []
    finally:
        visit.close()


def test_box_drawing_figures_stay_whole_on_a_phone(browser: Any, site: str) -> None:
    """The figures drawn with box-drawing characters (multihost, design) keep each line on one
    line at 390 px: they scroll inside their box instead of wrapping."""
    for path, first in (("multihost/", "host A: rank 0"), ("design/", " caller's thread")):
        visit = Visit(browser, site + path, width=390)
        try:
            figure = visit.page.locator("pre > code", has_text=first.strip()).first
            lines = figure.evaluate("e => e.textContent.replace(/\\n$/, '').split('\\n').length")
            assert lines >= 6, path
            box = figure.bounding_box()
            assert box is not None
            line = figure.evaluate("e => parseFloat(getComputedStyle(e).lineHeight)")
            assert box["height"] < (lines + 2) * line, path
            assert figure.evaluate("e => e.scrollWidth > e.clientWidth"), path  # it scrolls
        finally:
            visit.close()


def _package_names() -> set[str]:
    """Names the package's modules define at their top level (classes, functions, constants,
    type aliases), private modules included: what a reader may meet in the API page's text."""
    names: set[str] = set()
    callable_names: dict[str, bool] = {}
    for path in (ROOT / "monitor_bus").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                callable_names[node.name] = True
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    # Lower-case assignments are module state (a logger, a singleton), not API. Three private
    # functions share their names with words the page uses otherwise: a key of bus.stats(),
    # MonitorBusHandler.emit's parameter and SlowdownRule.add's.
    return {
        name
        for name in names
        if not name.startswith("_") and (not name.islower() or callable_names.get(name))
    } - {"device_values", "record", "stamp"}


def test_every_name_on_the_api_page_is_defined_there(browser: Any, site: str) -> None:
    """Each of the package's names the API page mentions in code is defined on the page (an
    entry whose anchor ends in that name) or is a link; Aggregation lists its members and
    EventOrigin its fields; nothing points to "the module docs", a private module or a private
    helper."""
    visit = Visit(browser, site + "api/", height=1000)
    try:
        page = visit.page
        undefined = page.evaluate(
            """names => {
                const ids = [...document.querySelectorAll("[id]")].map(e => e.id);
                const found = new Set();
                for (const code of document.querySelectorAll("article code")) {
                    if (code.closest("pre") || code.closest("a")) continue;
                    const name = code.textContent.trim().match(/^[A-Za-z_]\\w*/)?.[0];
                    if (name && names.includes(name) && !ids.some(id => id.endsWith("." + name)))
                        found.add(name);
                }
                return [...found].sort();
            }""",
            sorted(_package_names()),
        )
        assert undefined == []
        ids = set(page.evaluate("() => [...document.querySelectorAll('[id]')].map(e => e.id)"))
        members = {"VALUE", "MEAN", "COUNT", "SUM", "MAX", "MIN"}
        assert {f"monitor_bus.Aggregation.{m}" for m in members} <= ids
        assert {"monitor_bus.EventOrigin.pid", "monitor_bus.EventOrigin.worker"} <= ids
        for field in ("pid", "worker"):
            text = (
                page.locator(f"[id='monitor_bus.EventOrigin.{field}']").locator("..").inner_text()
            )
            assert "process" in text or "worker" in text
        text = page.inner_text("article")
        assert "module docs" not in text
        assert re.search(r"monitor_bus\._[a-z]", text) is None  # a private module
        assert "call_each" not in text
    finally:
        visit.close()


def _svg_in_closed_shadow(page: Any, host_selector: str) -> list[str]:
    """Tag names under the hosts matching the selector, closed shadow roots included (the theme
    draws diagrams into one, out of reach of page scripts)."""
    cdp = page.context.new_cdp_session(page)
    root = cdp.send("DOM.getDocument", {"depth": -1, "pierce": True})["root"]
    hosts = cdp.send("DOM.querySelectorAll", {"nodeId": root["nodeId"], "selector": host_selector})
    wanted = set(hosts["nodeIds"])
    found: list[str] = []

    def walk(node: dict[str, Any], inside: bool) -> None:
        inside = inside or node.get("nodeId") in wanted
        if inside and node.get("nodeType") == 1:
            found.append(node["nodeName"].lower())
        for child in node.get("children", []) + node.get("shadowRoots", []):
            walk(child, inside)

    walk(root, False)
    cdp.detach()
    return found


def test_concepts_diagram_is_an_svg(browser: Any, site: str) -> None:
    """The dispatcher diagram renders as an SVG with the library served by the site itself."""
    visit = Visit(browser, site + "concepts/", height=1000)
    try:
        page = visit.page
        page.wait_for_selector("div.mermaid", state="attached")
        assert page.locator("pre.mermaid").count() == 0  # no diagram left as source text
        tags = _svg_in_closed_shadow(page, "div.mermaid")
        assert "svg" in tags
        assert tags.count("g") > 10  # drawn, not an empty picture
        box = page.locator("div.mermaid").first.bounding_box()
        assert box is not None
        assert box["height"] > 100
        # Down to the section, heading first (scrolling up would show the "back to top" button).
        page.evaluate("document.getElementById('the-dispatcher').scrollIntoView()")
        shoot(page, "concepts")
        assert (visit.external, visit.errors) == ([], [])
    finally:
        visit.close()


@pytest.fixture(scope="module")
def api_page(browser: Any, site: str) -> Iterator[Any]:
    """The API page, opened once for the checks of what it renders."""
    visit = Visit(browser, site + "api/", height=1000)
    yield visit.page
    visit.close()


def test_api_returns_are_one_row_each(api_page: Any) -> None:
    """A Returns (or Yields) table has a row per return, not a row per line of a sentence that
    wraps: no two rows of one table repeat a type (no function documents two returns)."""
    tables = api_page.evaluate("""() => [...document.querySelectorAll(".doc-section-title")]
        .filter(t => ["Returns:", "Yields:"].includes(t.textContent.trim()))
        .map(t => {
            const object = t.closest(".doc-object").querySelector(".doc-heading").id;
            const rows = t.parentElement.nextElementSibling.querySelectorAll("tbody tr");
            return [object, [...rows].map(r => r.querySelector("td").textContent.trim())];
        })""")
    assert len(tables) >= 10
    repeated = {obj: types for obj, types in tables if len(set(types)) < len(types)}
    assert repeated == {}
    assert all(len(types) == 1 for _, types in tables)


def test_api_attributes_show_no_init_code(api_page: Any) -> None:
    """An attribute set in ``__init__`` shows its name and type, not the code that set it
    (``Event.data = plain(copied)``); module constants and class-level defaults keep their
    values."""
    shown = api_page.evaluate("""() => [...document.querySelectorAll(".doc-attribute")]
        .map(a => {
            const heading = a.querySelector(":scope > .doc-heading");
            const labels = [...heading.querySelectorAll(".doc-label")].map(l => l.textContent.trim());
            const signature = a.querySelector(":scope > .doc-signature")?.textContent.trim() ?? "";
            return [heading.id, labels, signature];
        })""")
    assert len(shown) >= 50
    valued = [
        (anchor, signature)
        for anchor, labels, signature in shown
        if "instance-attribute" in labels and "class-attribute" not in labels and "=" in signature
    ]
    assert valued == []
    text = api_page.inner_text("article")
    assert "= plain(" not in text
    assert "= hosts or" not in text
    assert "STAT_EVENT = 'torch.monitor.Stat'" in text  # a constant's value is its meaning


def test_api_signatures_have_no_private_parameter(api_page: Any) -> None:
    """No signature on the page lists a parameter starting with ``_`` (a test seam such as
    ``SystemMetrics``'s ``_nvml``)."""
    signatures = api_page.evaluate("""() => [...document.querySelectorAll(
            ".doc-function > .doc-signature, .doc-class > .doc-signature")]
        .map(s => s.textContent)""")
    assert len(signatures) >= 30
    private = [
        name
        for signature in signatures
        for name in re.findall(r"[(,]\s*\**(_\w*)\s*[:=,)]", signature)
    ]
    assert private == []
    assert any(s.startswith("SystemMetrics(") for s in signatures)


def _public_exports() -> dict[str, list[str]]:
    """Each public module's ``__all__`` (modules with no ``_`` part in their path), read from
    the sources so no optional dependency is imported. ``monitor_bus.ranks`` is left out: it
    is the rank merge's implementation package, whose public entry is
    ``monitor_bus.integrations.torch`` (it re-exports ``RankMerge`` and ``STRAGGLER_EVENT``)."""
    exports: dict[str, list[str]] = {}
    for path in sorted((ROOT / "monitor_bus").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join(parts)
        if any(part.startswith("_") for part in parts) or module == "monitor_bus.ranks":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exports[module] = list(ast.literal_eval(node.value))
    return exports


def test_api_documents_every_public_export(api_page: Any) -> None:
    """Every name in every public module's ``__all__`` has its entry (an anchor with its full
    path) on the API page."""
    exports = _public_exports()
    assert {"monitor_bus", "monitor_bus.system", "monitor_bus.tensorboard"} <= set(exports)
    ids = set(api_page.evaluate("() => [...document.querySelectorAll('[id]')].map(e => e.id)"))
    missing = [f"{m}.{name}" for m, names in exports.items() for name in names]
    assert [anchor for anchor in missing if anchor not in ids] == []


def test_api_examples_are_code(browser: Any, site: str) -> None:
    """Every docstring "Examples:" section of the API page is a highlighted code block (most
    of ``>>>`` lines), without doctest directives, whose copy button copies the code without
    its prompts and output."""
    visit = Visit(browser, site + "api/", height=1000)
    try:
        page = visit.page
        examples = page.evaluate("""() => [...document.querySelectorAll(".doc-section-title")]
            .filter(t => t.textContent.trim() === "Examples:")
            .map(t => {
                const code = t.parentElement.nextElementSibling?.querySelector("pre > code");
                return code ? code.textContent : null;
            })""")
        assert len(examples) >= 10
        assert None not in examples
        assert all(text.strip() for text in examples)
        assert sum(text.startswith(">>> ") for text in examples) >= 10
        assert not any("doctest:" in text for text in examples)
        # The copy button copies what the theme reads while the block is marked as copying:
        # the example's code, without prompts or output.
        copied = page.evaluate("""() => [...document.querySelectorAll(".language-pycon code")]
            .map(code => {
                code.setAttribute("data-md-copying", "");
                const text = code.innerText;
                code.removeAttribute("data-md-copying");
                return text;
            })""")
        assert len(copied) >= 10
        assert not any(">>>" in text or "\n... " in text for text in copied)
        assert "import monitor_bus as monitor" in "\n".join(copied)
        event = next(text for text in copied if "event.name, event.timestamp" in text)
        assert "'train.epoch'" not in event  # the output line is left out
        first = page.locator(".doc-section-title", has_text="Examples:").first
        first.scroll_into_view_if_needed()
        page.evaluate("window.scrollBy(0, 200)")
        shoot(page, "api")
    finally:
        visit.close()


def test_home_page_screenshot(browser: Any, site: str) -> None:
    """The home page opens with the install line, the first example and the demo command."""
    visit = Visit(browser, site, height=1000)
    try:
        text = visit.page.inner_text("article")
        assert "pip install monitor_bus" in text
        assert "monitor.log_event(event)" in text
        assert "python -m monitor_bus demo" in text
        assert "Code blocks in these docs" not in text  # contributor material has its page
        shoot(visit.page, "home")
    finally:
        visit.close()


# -- the demo's run in TensorBoard --


@pytest.fixture(scope="module")
def tensorboard_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A demo run under a log directory, served by a real ``tensorboard`` on loopback."""
    pytest.importorskip("numpy")  # both are in the test extra
    pytest.importorskip("tensorboard")
    # TensorBoard shows its --logdir as given: a relative "runs", not this test's temp path.
    root = tmp_path_factory.mktemp("tensorboard")
    runs = root / "runs"
    # As a user runs it (and off this thread, where the browser driver's event loop runs).
    demo = subprocess.run(
        [sys.executable, "-m", "monitor_bus", "demo", "--steps", str(DEMO_STEPS)]
        + ["--logdir", str(runs / "20261130-120000")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert demo.returncode == 0, demo.stderr
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "tensorboard.main"),
            *("--logdir", "runs", "--host", "127.0.0.1", "--port", "0"),
            "--load_fast=false",
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:  # "TensorBoard 2.x at http://127.0.0.1:PORT/ (Press CTRL+C ...)"
            m = re.search(r" at (http://127\.0\.0\.1:\d+/)", line)
            if m:
                url = m[1]
                break
        assert url, f"tensorboard did not start (exit {proc.poll()})"
        # Keep the pipe drained; ends when the server exits.
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield url, "20261130-120000/demo", root
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


STAT_TAGS = {
    "stats/step_time_ms.mean",
    "stats/step_time_ms.min",
    "stats/step_time_ms.max",
    "stats/step_time_ms.p50",
    "stats/step_time_ms.p99",
    "stats/samples_per_s.mean",
    "stats/train_loss.mean",
}
EPOCH_TAGS = {"epoch/train_loss", "epoch/val_loss", "epoch/val_accuracy"}


def test_demo_run_in_tensorboard(browser: Any, tensorboard_demo: tuple[str, str, Path]) -> None:
    """TensorBoard lists the demo's run by name with Stat tags under stats/ and epoch tags under
    epoch/, every series over the training step (0 to the steps run)."""
    url, run, root = tensorboard_demo
    deadline = time.monotonic() + 60
    tags: dict[str, Any] = {}
    while time.monotonic() < deadline:  # the server loads the run in the background
        tags = get_json(url + "data/plugin/scalars/tags")
        if set(tags.get(run, {})) >= STAT_TAGS | EPOCH_TAGS:
            break
        time.sleep(0.2)
    assert list(tags) == [run]
    # Besides the demo's system metrics (system/*, system.min/*, system.max/*, as many as the
    # host has) and its final metrics (summary/*).
    rest = {t for t in tags[run] if not t.startswith(("system/", "system.m", "summary/"))}
    assert rest == STAT_TAGS | EPOCH_TAGS
    per_epoch = 8192 // 256
    # Each Stat's windows in the JSONL file; its last, partial one is not drawn.
    windows: dict[str, list[Any]] = {}
    for event in read_jsonl(root / "runs" / "20261130-120000" / "events.jsonl"):
        if event.name == STAT_EVENT:
            for key, value in event.data.items():
                windows.setdefault(f"stats/{key}", []).append(value)
    for tag in sorted(STAT_TAGS | EPOCH_TAGS):
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        points = get_json(url + "data/plugin/scalars/scalars?" + query)
        steps = [step for _, step, _ in points]
        assert steps == sorted(steps), tag
        assert steps[0] >= 0, tag
        if tag in EPOCH_TAGS:
            expected = list(range(per_epoch, DEMO_STEPS + 1, per_epoch))
            assert steps == [*expected, DEMO_STEPS] if DEMO_STEPS % per_epoch else expected
        else:
            assert len(steps) >= 2, tag
            assert steps[-1] <= DEMO_STEPS, tag
            drawn = [value for _, _, value in points]
            assert drawn == pytest.approx(windows[tag][:-1], rel=1e-6), tag

    # The step time's histogram, as the HISTOGRAMS and DISTRIBUTIONS tabs load it: one per
    # window, over the training step.
    histogram = "stats/step_time_ms.histogram"
    tags = get_json(url + "data/plugin/histograms/tags")
    assert {name: list(run_tags) for name, run_tags in tags.items()} == {run: [histogram]}
    query = urllib.parse.urlencode({"run": run, "tag": histogram})
    histograms = get_json(url + "data/plugin/histograms/histograms?" + query)
    steps = [step for _, step, _ in histograms]
    assert len(steps) >= 2
    assert steps == sorted(steps)
    assert len(steps) == len(windows["stats/step_time_ms.mean"]) - 1
    assert all(sum(count for _, _, count in buckets) > 0 for _, _, buckets in histograms)

    visit = Visit(browser, url + "#scalars", height=1700)
    try:
        page = visit.page
        # Both sections open at once: the epoch charts and the Stats.
        page.get_by_text("stats/train_loss.mean").wait_for()
        page.get_by_text("epoch/train_loss").wait_for()
        page.wait_for_load_state("networkidle")
        shoot(page, "tensorboard-demo")
        assert visit.errors == []
        assert str(root) not in page.inner_text("body")  # it shows "runs", not the temp path
    finally:
        visit.close()
