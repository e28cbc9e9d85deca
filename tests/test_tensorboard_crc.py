"""Event-file records checksummed in C (google-crc32c) are the bytes tensorboard writes."""

from __future__ import annotations

import importlib.util
import io

import pytest

from .conftest import require

pytest.importorskip("tensorboard")

from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: E402

from monitor_bus import _event_file  # noqa: E402


def _records(payloads: list[bytes]) -> bytes:
    out = io.BytesIO()
    writer = RecordWriter(out)
    for payload in payloads:
        writer.write(payload)
    return out.getvalue()


PAYLOADS = [bytes(range(256)) * (n // 256) + bytes(range(n % 256)) for n in range(301)]
PAYLOADS.append(b"\x00\xff" * 100_000)


def test_records_are_tensorboards_bytes() -> None:
    """Records of every size from 0 to 300 bytes, and a large one, are byte-identical to
    tensorboard's RecordWriter's."""
    assert b"".join(map(_event_file.record, PAYLOADS)) == _records(PAYLOADS)


def test_c_checksums_give_tensorboards_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With google-crc32c installed, records take the C checksum, and are the same bytes."""
    require(importlib.util.find_spec("google_crc32c") is not None, "google-crc32c is missing")
    assert _event_file._masked is _event_file._masked_c
    monkeypatch.setattr(_event_file, "_masked", _event_file.masked_crc32c)
    python = b"".join(map(_event_file.record, PAYLOADS))
    monkeypatch.undo()
    assert b"".join(map(_event_file.record, PAYLOADS)) == python == _records(PAYLOADS)
