"""One home for rate-limited logging: a broken sink or a full queue must not flood the log."""

from __future__ import annotations

import threading
import time

# A repeated report (the same error of a handler, drops of a queue) goes out at most once per
# this many seconds; what happened in between is summed into the next report.
LOG_INTERVAL = 10.0


class Throttle:
    """Says when a report keyed by ``key`` may go out again: at most once per ``interval``.

    Thread-safe. Remembers at most ``max_keys`` keys, so a stream of distinct keys (one per
    bad event key, say) cannot grow it without bound: past that, new keys share one slot.
    """

    __slots__ = ("_interval", "_last", "_lock", "_max_keys")

    def __init__(self, interval: float = LOG_INTERVAL, *, max_keys: int = 1000) -> None:
        self._interval = interval
        self._max_keys = max_keys
        self._last: dict[object, float] = {}
        self._lock = threading.Lock()

    def ready(self, key: object = None, *, now: float | None = None) -> bool:
        """True (and the key's clock restarts) if ``key`` was not reported in the interval."""
        if now is None:
            now = time.monotonic()
        with self._lock:
            if key not in self._last and len(self._last) >= self._max_keys:
                key = Throttle  # the overflow slot
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                return False
            self._last[key] = now
            return True
