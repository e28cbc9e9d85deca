from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pytest

import monitor_bus
from monitor_bus import _default, _stat

IN_CI = os.environ.get("CI", "").lower() == "true"

# A shell starts a background job (`cmd &`, nohup) with SIGINT ignored, and an ignored signal
# stays ignored through exec: the Ctrl-C tests' children would never see theirs. Caught here,
# it is reset to the default in every child this process starts (xdist's workers too).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def require(condition: bool, reason: str) -> None:
    """Skip when a real dependency is missing, except in CI, where that is a failure."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)


@contextmanager
def local_zone(name: str) -> Iterator[None]:
    """Run the block with ``name`` as the process's local time zone."""
    require(
        os.path.exists(os.path.join("/usr/share/zoneinfo", name)),
        f"the tz database has no {name}",
    )
    old = os.environ.get("TZ")
    os.environ["TZ"] = name
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()


@pytest.fixture(autouse=True)
def fresh_default_bus() -> Iterator[None]:
    """Every test starts with no default bus and leaves no bus thread behind."""
    _default._reset_default_bus()
    yield
    _default._reset_default_bus()


@pytest.fixture
def bus() -> Iterator[monitor_bus.EventBus]:
    b = monitor_bus.EventBus(name="test")
    yield b
    assert b.close(timeout=10), "the test left a handler that does not finish"


class Recorder:
    """A sync handler that records events and lets a test wait for a count."""

    def __init__(self) -> None:
        self.events: list[monitor_bus.Event] = []
        self._cv = threading.Condition()

    def __call__(self, event: monitor_bus.Event) -> None:
        with self._cv:
            self.events.append(event)
            self._cv.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: len(self.events) >= n, timeout)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


class StepClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    """The Stat clock, standing still until the test moves it: windows are aligned to
    multiples of their size, so on the real clock a boundary may fall between any two adds
    (a loop slowed by a loaded machine splits one window in two). Forked children inherit it."""
    c = StepClock()
    monkeypatch.setattr(_stat, "_clock", c)
    return c


@pytest.fixture(scope="session")
def docs_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site, built once per run with ``mkdocs build --strict`` (test_docs checks the
    build, test_browser serves it)."""
    import subprocess
    import sys

    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        require(False, f"the docs tooling is missing: {exc}")
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    return site


class LoopGate:
    """An async handler that records events and blocks the dispatcher's loop on each event
    named "gate", so a test can fill the queue with nothing drained meanwhile."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[monitor_bus.Event] = []

    async def __call__(self, event: monitor_bus.Event) -> None:
        self.events.append(event)
        if event.name == "gate":
            self.entered.set()
            self.release.wait()  # blocks the whole loop: nothing is drained meanwhile

    def hold(self, bus: monitor_bus.EventBus) -> None:
        """Log a gate event and return once the loop is blocked on it."""
        self.entered.clear()
        self.release.clear()
        bus.log_event(monitor_bus.Event("gate", datetime.now(timezone.utc), {"name": "gate"}))
        assert self.entered.wait(10)


class LogSeen(logging.Handler):
    """Sets ``seen`` once a record holding ``text`` in its message is emitted (add it to the
    ``monitor_bus`` logger to wait for a warning instead of polling the log)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


def distribution_window(
    samples: list[float], when: datetime | None = None, name: str = "lat"
) -> monitor_bus.Event:
    """The event a Stat with P50, P99, STDDEV and HISTOGRAM logs for a window of ``samples``,
    built as the Stat builds it: ``Event()`` takes a ``Histogram`` from no caller."""
    import math
    import statistics

    from monitor_bus._event import from_slots

    histogram = monitor_bus.Histogram.of(samples)
    data = {
        f"{name}.p50": histogram.quantile(0.5),
        f"{name}.p99": histogram.quantile(0.99),
        f"{name}.stddev": (
            statistics.pstdev(samples) if all(map(math.isfinite, samples)) else math.nan
        ),
        f"{name}.histogram": histogram,
    }
    stamp = when or datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
    return from_slots(monitor_bus.STAT_EVENT, stamp, data)


#: Two windows of samples away from bucket edges, of both signs, with a zero and a wide span.
WINDOW_SAMPLES = (
    [0.0, -2.5, 0.3, 1.7, 3.3, 5.1, 12.9, 250.4],
    [0.6, 7.7, -0.1, 1e6 + 3.1, 3.3],
)


def real_window(bus: monitor_bus.EventBus, samples: list[float], name: str = "lat") -> None:
    """Close one window of a real ``Stat`` with P50, P99, STDDEV and HISTOGRAM on ``bus``."""
    from datetime import timedelta

    agg = monitor_bus.Aggregation
    stat = monitor_bus.Stat(
        name,
        [agg.P50, agg.P99, agg.STDDEV, agg.HISTOGRAM],
        timedelta(hours=1),
        max_samples=len(samples),
        bus=bus,
    )
    for sample in samples:
        stat.add(sample)


def log_windows(bus: monitor_bus.EventBus, start: datetime) -> list[monitor_bus.Event]:
    """Log a ``distribution_window`` of each of ``WINDOW_SAMPLES``, a second apart from
    ``start``, wait until the bus has delivered them, and return them."""
    from datetime import timedelta

    windows = [
        distribution_window(samples, start + timedelta(seconds=i))
        for i, samples in enumerate(WINDOW_SAMPLES)
    ]
    for window in windows:
        bus.log_event(window)
    assert bus.flush(60)
    return windows
