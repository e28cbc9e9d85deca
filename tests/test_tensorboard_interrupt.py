"""monitor_bus.tensorboard.SummaryWriter interrupted in the middle of a write (Ctrl-C): the
event file keeps whole records only, each written once, through later interrupts and failed
writes, as tensorboard's own reader reads it back; what ``close()`` could not write is counted.

The OS is real; the interrupt is a stand-in for the signal: the write call writes part (or
all) of what it is given through the real ``os.write``, then raises ``KeyboardInterrupt``,
as Python does when Ctrl-C arrives while a write is under way."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from monitor_bus import _event_file  # noqa: E402
from monitor_bus.tensorboard import SummaryWriter  # noqa: E402

from .full_disk import fill, small_disk  # noqa: E402


def whole_records(path: Path) -> int:
    """The number of records in the event file, after checking it ends on a whole one."""
    data = path.read_bytes()
    end, n = 0, 0
    while end + 8 <= len(data):  # each record: length (8), its crc (4), data, data crc (4)
        (length,) = struct.unpack_from("<Q", data, end)
        end += 16 + length
        n += 1
    assert end == len(data), "the file ends in a torn record"
    return n


def scalar_steps(log_dir: Path) -> list[int]:
    """The steps of the scalars ``loss`` as tensorboard's EventAccumulator reads them (every
    one kept, none purged), each checked to hold its step as its value."""
    reader = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    reader.Reload()
    scalars = reader.Scalars("loss")
    assert all(s.value == s.step for s in scalars)
    return [s.step for s in scalars]


def interrupting(cut: Callable[[int], int]) -> Callable[[int, object], int]:
    """A write that writes ``cut(len(data))`` bytes of its data for real, then is interrupted."""

    def write(fd: int, data: memoryview) -> int:
        os.write(fd, bytes(data[: cut(len(data))]))
        raise KeyboardInterrupt

    return write


def test_interrupted_and_failed_writes_leave_each_record_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write interrupted after all its bytes, one interrupted in the middle of a record and
    a write failed on a real full disk leave the file whole records; the next flushes write
    each record exactly once: 400 scalars in, the 400 read back in order, none dropped."""
    with small_disk(tmp_path / "disk", 256 * 1024) as disk:
        writer = SummaryWriter(disk / "tb", max_queue=10_000, flush_secs=3600)
        (path,) = (disk / "tb").iterdir()

        for step in range(100):
            writer.add_scalar("loss", step, step)
        monkeypatch.setattr(_event_file, "_write", interrupting(lambda n: n))
        with pytest.raises(KeyboardInterrupt):
            writer.flush()
        monkeypatch.undo()
        assert whole_records(path) == 101  # the file version, then the 100 scalars

        for step in range(100, 200):
            writer.add_scalar("loss", step, step)
        monkeypatch.setattr(_event_file, "_write", interrupting(lambda n: n // 2 + 7))
        with pytest.raises(KeyboardInterrupt):
            writer.flush()
        monkeypatch.undo()
        assert 101 < whole_records(path) < 201

        for step in range(200, 300):
            writer.add_scalar("loss", step, step)
        filler = disk / "filler"
        fill(filler)
        with pytest.raises(OSError, match="No space left"):
            writer.flush()
        whole_records(path)
        filler.unlink()

        for step in range(300, 400):
            writer.add_scalar("loss", step, step)
        writer.close()
        assert whole_records(path) == 401
        assert scalar_steps(disk / "tb") == list(range(400))
        assert writer.dropped_records == 0


def test_an_interrupted_close_counts_what_it_did_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() interrupted in the middle of its write leaves whole records and counts the
    records it did not write in ``dropped_records``: in the file plus dropped == added."""
    writer = SummaryWriter(tmp_path, max_queue=10_000, flush_secs=3600)
    (path,) = tmp_path.iterdir()
    for step in range(50):
        writer.add_scalar("loss", step, step)
    monkeypatch.setattr(_event_file, "_write", interrupting(lambda n: n // 3))
    with pytest.raises(KeyboardInterrupt):
        writer.close()
    monkeypatch.undo()
    written = whole_records(path) - 1
    assert scalar_steps(tmp_path) == list(range(written))
    assert 0 < written < 50
    assert writer.dropped_records == 50 - written
