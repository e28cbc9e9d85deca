"""SkipReporter: the rate-limited warning every sink gives for a value it skipped."""

from __future__ import annotations

import pytest

from monitor_bus import _skipped
from monitor_bus._skipped import SkipReporter, as_float64, is_utf8


def test_each_key_warns_at_once_then_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A new (reason, key) warns at once; its repeats warn again only once 10 s have passed."""
    now = [100.0]
    monkeypatch.setattr(_skipped, "_clock", lambda: now[0])
    skips = SkipReporter("Sink")
    skips.report("string_value", "a", "value 'a' is a string", 1)
    skips.report("string_value", "a", "value 'a' is a string", 2)  # same instant: quiet
    skips.report("string_value", "b", "value 'b' is a string", 3)  # another key: warns
    skips.report("out_of_range", "a", "value 'a' is too big", 4)  # another reason: warns
    now[0] = 109.9
    skips.report("string_value", "a", "value 'a' is a string", 5)  # within 10 s: quiet
    now[0] = 110.0
    skips.report("string_value", "a", "value 'a' is a string", 6)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "monitor_bus",
            "WARNING",
            f"Sink: {m}: skipped ({n} so far; repeats of this key are logged at most every 10 s)",
        )
        for m, n in [
            ("value 'a' is a string", 1),
            ("value 'b' is a string", 3),
            ("value 'a' is too big", 4),
            ("value 'a' is a string", 6),
        ]
    ]


def test_value_checks() -> None:
    """is_utf8 refuses lone surrogates only; as_float64 refuses only ints beyond float64."""
    assert (is_utf8("abc"), is_utf8("損失 🚀"), is_utf8("a\ud800"), is_utf8("\udc80")) == (
        True,
        True,
        False,
        False,
    )
    assert as_float64(2**1023) == 2.0**1023
    assert as_float64(True) == 1.0
    assert as_float64(2**1024) is None
    assert as_float64(-(2**1100)) is None
