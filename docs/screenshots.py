"""Retake the screenshots in docs/img (home, concepts, api, tensorboard-demo) from a real run.

Runs tests/test_browser.py with MONITOR_BUS_SCREENSHOTS=docs/img: the site as built now, and a
full default demo run (3000 steps) in a real TensorBoard. Needs Chromium and the test extra.
Usage: python docs/screenshots.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    env = {**os.environ, "MONITOR_BUS_SCREENSHOTS": str(ROOT / "docs" / "img"), "CI": "true"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_browser.py",
    ]
    sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)
