"""A real full disk for the sink tests: a small tmpfs mounted for the test.

Mounting needs root. Outside CI a test that needs it is skipped when not root; with ``CI`` set
(CI runs as root) it must run, so a failure to mount fails the test.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``where`` (made), unmounted afterwards."""
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("mounting a small tmpfs needs root (CI runs these as root)")
    where.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        check=True,
        capture_output=True,
    )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill(path: Path) -> int:
    """Write ``path`` until the disk is full; return its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    size = 0
    try:
        while True:
            size += os.write(fd, b"x" * 4096)
    except OSError:
        return size
    finally:
        os.close(fd)
