"""What the benchmark scripts share: the machine they ran on, their arguments' checks, the
numpy training step they log from, and how they put their output on a docs page."""

from __future__ import annotations

import argparse
import math
import platform
from collections.abc import Callable
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def numpy_mlp_step(batch: int = 64) -> Callable[[], tuple[float, float]]:
    """A two-layer tanh MLP, forward + backward + SGD update on one minibatch (~100-180 us at
    64 rows); each call returns the loss and the gradient norm."""
    import numpy as np

    rng = np.random.default_rng(0)
    d_in, hidden, d_out = 96, 256, 10
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    y = rng.standard_normal((batch, d_out)).astype(np.float32)
    w1 = (rng.standard_normal((d_in, hidden)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((hidden, d_out)) * 0.1).astype(np.float32)

    def step() -> tuple[float, float]:
        nonlocal w1, w2
        h = np.tanh(x @ w1)
        err = h @ w2 - y
        loss = float((err * err).mean())
        g_out = err * np.float32(2.0 / err.size)
        g_w2 = h.T @ g_out
        g_w1 = x.T @ ((g_out @ w2.T) * (1 - h * h))
        w1 -= np.float32(0.01) * g_w1
        w2 -= np.float32(0.01) * g_w2
        return loss, math.sqrt(float((g_w1 * g_w1).sum() + (g_w2 * g_w2).sum()))

    return step


def write_between(page: Path, text: str, marker: str) -> None:
    """Replace what ``page`` holds between ``<!-- {marker}:begin -->`` and
    ``<!-- {marker}:end -->`` with ``text``: a page's figures are a run's own output."""
    doc = page.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{begin}\n{text}{end}{tail}")


def publish(lines: list[str], page: Path | None, marker: str) -> None:
    """Print a run's text (``lines``) and, given a ``page``, put it between its markers."""
    text = "\n".join(lines) + "\n"
    print(text)
    if page is not None:
        write_between(page, text, marker)
