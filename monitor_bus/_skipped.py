"""Values a sink cannot represent: each sink skips them, counts them and reports them here.

A sink decides per value whether it can hold it (a gauge holds no string, protobuf's int64 no
2**63, UTF-8 no lone surrogate); one it cannot is skipped, the rest of the event is written, the
sink's public counter goes up and ``SkipReporter`` warns on the ``monitor_bus`` logger, at most
once per key and reason per ``LOG_INTERVAL`` seconds, so a bad key in every window cannot flood
the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

from ._ratelimit import LOG_INTERVAL, Throttle

logger = logging.getLogger("monitor_bus")

# The clock seam: tests replace it to step time.
_clock = time.monotonic

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# The smallest magnitude a float32 rounds to an infinity: halfway between its largest finite
# value, 2**128 - 2**104, and 2**128 (a tie rounds to the even mantissa, here up).
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


class SkipReporter:
    """Warns that a sink skipped a value, at most once per (reason, key) per ``LOG_INTERVAL`` s.

    Thread-safe.

    Args:
        sink: the sink's name, first in every message (``"PrometheusEventHandler"``).
    """

    __slots__ = ("_sink", "_throttle")

    def __init__(self, sink: str) -> None:
        self._sink = sink
        self._throttle = Throttle(LOG_INTERVAL)

    def report(self, reason: str, key: Hashable, message: str, total: int) -> None:
        """Warn ``message`` unless this ``reason`` and ``key`` were reported in the interval.

        Args:
            reason: why the value was skipped (``"string_value"``, ``"out_of_range"``, ...).
            key: the event key (or any hashable naming it), so each bad key is reported
                on its own.
            message: what was skipped and why.
            total: the sink's count of skips so far, quoted in the message.
        """
        if self._throttle.ready((reason, key), now=_clock()):
            logger.warning(
                "%s: %s: skipped (%d so far; repeats of this key are logged at most every %g s)",
                self._sink,
                message,
                total,
                LOG_INTERVAL,
            )


def is_utf8(text: str) -> bool:
    """True if ``text`` encodes to UTF-8, i.e. holds no lone surrogate (``"\\ud800"``)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def as_float64(value: object) -> float | None:
    """``value`` (an int, float or bool) as a float, or None if it is out of float64's range."""
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        return None


def float64_or_why(key: str, value: object, sink: str) -> tuple[float | None, str, str]:
    """``value`` (a data value of ``key``) as a float64 for ``sink``; or None, with the reason
    and a description, if it cannot be one (a string, an int beyond float64's range)."""
    if isinstance(value, str):
        return None, "string_value", f"Stat value {key!r} is a string; {sink} holds numbers"
    number = as_float64(value)
    if number is None:
        return None, "out_of_range", f"Stat value {key!r} is an int beyond float64's range"
    return number, "", ""
