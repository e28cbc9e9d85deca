"""Event-file records checksummed in C (google-crc32c) are the bytes tensorboard writes."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from .conftest import require

pytest.importorskip("tensorboard")

from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: E402

from monitor_bus import tensorboard as tb  # noqa: E402


def _records(writer_class: type, payloads: list[bytes]) -> bytes:
    out = io.BytesIO()
    writer = writer_class(out)
    for payload in payloads:
        writer.write(payload)
    return out.getvalue()


def test_c_checksums_give_tensorboards_bytes() -> None:
    """Records of every size from 0 to 300 bytes, and a large one, are byte-identical."""
    require(importlib.util.find_spec("google_crc32c") is not None, "google-crc32c is missing")
    payloads = [bytes(range(256)) * (n // 256) + bytes(range(n % 256)) for n in range(301)]
    payloads.append(b"\x00\xff" * 100_000)
    assert _records(tb._CRecordWriter, payloads) == _records(RecordWriter, payloads)


def test_summary_writer_checksums_in_c(tmp_path: Path) -> None:
    """With google-crc32c installed, a SummaryWriter's records take the C checksum."""
    require(importlib.util.find_spec("google_crc32c") is not None, "google-crc32c is missing")
    writer = tb.SummaryWriter(tmp_path)
    try:
        assert type(writer._writer._async_writer._writer) is tb._CRecordWriter
    finally:
        writer.close()
