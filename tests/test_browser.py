"""The docs site and the demo's TensorBoard run, opened in headless Chromium as a reader would.

The site is built strictly, served on loopback and loaded with every request off the machine
refused (the site must work offline). The demo's run is read back through a real
``tensorboard`` server's HTTP API. Needs Debian's ``chromium`` and the ``playwright`` package
(the test extra); skipped without them, failed under ``CI=true``. With
``MONITOR_BUS_SCREENSHOTS=DIR`` the tests also save screenshots there (``docs/screenshots.py``
does this for docs/img).
"""

from __future__ import annotations

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
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The docs site, built strictly into a temporary directory and served on loopback."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    handler = functools.partial(_Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()
    thread.join()


class Visit:
    """A page opened at 1280 px with what went wrong recorded: console errors, uncaught
    exceptions, and requests that tried to leave the machine (refused)."""

    def __init__(self, browser: Any, url: str, height: int = 900) -> None:
        self.errors: list[str] = []
        self.external: list[str] = []
        self.page = browser.new_page(viewport={"width": WIDTH, "height": height})
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


def test_nav_lists_the_pages_checked() -> None:
    """The pages the browser test visits are the site's nav, so a new page is not missed."""
    nav = re.findall(r"^  - [^:]+: (\S+)\.md$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert [("" if page == "index" else f"{page}/") for page in nav] == PAGES


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p or "home")
def test_page_fits_1280px_offline_without_errors(browser: Any, site: str, path: str) -> None:
    """At 1280 px the page has no sideways scrollbar, no code block scrolls, nothing is fetched
    from outside and the console has no error."""
    visit = Visit(browser, site + path)
    try:
        overflow = visit.page.evaluate(_OVERFLOW)
        assert overflow == {"page": 0, "code": []}
        assert visit.external == []
        assert visit.errors == []
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


def test_api_examples_are_code(browser: Any, site: str) -> None:
    """Every docstring "Examples:" section of the API page is a highlighted code block (most
    of ``>>>`` lines), without doctest directives."""
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
def tensorboard_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A demo run under a log directory, served by a real ``tensorboard`` on loopback."""
    pytest.importorskip("numpy")  # both are in the test extra
    pytest.importorskip("tensorboard")
    runs = tmp_path_factory.mktemp("runs")
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
            *("--logdir", str(runs), "--host", "127.0.0.1", "--port", "0"),
            "--load_fast=false",
        ],
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
        yield url, "20261130-120000/demo"
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


def test_demo_run_in_tensorboard(browser: Any, tensorboard_demo: tuple[str, str]) -> None:
    """TensorBoard lists the demo's run by name with Stat tags under stats/ and epoch tags under
    epoch/, every series over the training step (0 to the steps run)."""
    url, run = tensorboard_demo
    deadline = time.monotonic() + 60
    tags: dict[str, Any] = {}
    while time.monotonic() < deadline:  # the server loads the run in the background
        tags = get_json(url + "data/plugin/scalars/tags")
        if len(tags.get(run, {})) == len(STAT_TAGS | EPOCH_TAGS):
            break
        time.sleep(0.2)
    assert list(tags) == [run]
    assert set(tags[run]) == STAT_TAGS | EPOCH_TAGS
    per_epoch = 8192 // 256
    for tag in sorted(STAT_TAGS | EPOCH_TAGS):
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        points = get_json(url + "data/plugin/scalars/scalars?" + query)
        steps = [step for _, step, _ in points]
        assert steps == sorted(steps), tag
        assert steps[0] >= 0, tag
        assert steps[-1] == DEMO_STEPS, tag  # the last epoch and the last windows end the run
        if tag in EPOCH_TAGS:
            expected = list(range(per_epoch, DEMO_STEPS + 1, per_epoch))
            assert steps == [*expected, DEMO_STEPS] if DEMO_STEPS % per_epoch else expected
        else:
            assert len(steps) >= 2, tag

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
    assert steps[-1] == DEMO_STEPS
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
    finally:
        visit.close()
