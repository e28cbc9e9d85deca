"""The README's first example runs and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_prints_the_event_and_the_full_window() -> None:
    """The python block of README.md prints the logged event, then the Stat window it filled."""
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", block],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert [line.split(",")[0] for line in out] == [
        "Event(name='train.epoch'",
        "Event(name='torch.monitor.Stat'",
    ]
    assert out[1].endswith("data={'step_time.mean': 0.014, 'step_time.max': 0.016})")
