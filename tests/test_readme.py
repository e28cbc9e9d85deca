"""The README's first example runs and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_readme_block(max_samples: str = "2") -> list[str]:
    """The python block of README.md run as written (with ``max_samples`` changed), its
    output lines."""
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert "max_samples=2)" in block
    block = block.replace("max_samples=2)", f"max_samples={max_samples})")
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", block],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()


def test_readme_example_prints_the_event_and_the_full_window() -> None:
    """The python block of README.md prints the logged event, then the Stat window it filled."""
    out = _run_readme_block()
    assert [line.split(",")[0] for line in out] == [
        "Event(name='train.epoch'",
        "Event(name='torch.monitor.Stat'",
    ]
    assert out[1].endswith("data={'step_time.mean': 0.014, 'step_time.max': 0.016})")


def test_readme_example_delivers_a_window_that_did_not_fill() -> None:
    """The README's shutdown (flush, then unregister) delivers a Stat window that never
    filled: unregistering the last handler logs the open window to it first."""
    out = _run_readme_block(max_samples="3")
    assert [line.split(",")[0] for line in out] == [
        "Event(name='train.epoch'",
        "Event(name='torch.monitor.Stat'",
    ]
    assert out[1].endswith("data={'step_time.mean': 0.014, 'step_time.max': 0.016})")
