"""monitor_bus.tensorboard.SummaryWriter on a full disk: the event file stays whole records
(tensorboard's own loader reads every one), what is not written is kept within a bound and
written when space returns, and what is refused is counted as dropped by its handler."""

from __future__ import annotations

import logging
import struct
from datetime import datetime, timezone
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_file_loader import (  # noqa: E402
    LegacyEventFileLoader,
)

from monitor_bus import (  # noqa: E402
    STAT_EVENT,
    Event,
    EventBus,
    TensorboardEventHandler,
    _event_file,  # noqa: E402
)
from monitor_bus.tensorboard import SummaryWriter  # noqa: E402

from .full_disk import small_disk  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def window(step: int) -> Event:
    return Event(STAT_EVENT, T0, {"step": step, "loss.mean": 0.5})


def steps(path: Path) -> list[int]:
    """The steps of the scalars in the event file, read by tensorboard's own loader, after
    checking that the file is whole records and nothing else."""
    data = path.read_bytes()
    end = 0
    while end < len(data):  # each record: length (8), its crc (4), data, data crc (4)
        (length,) = struct.unpack_from("<Q", data, end)
        end += 16 + length
    assert end == len(data), "the file ends in a torn record"
    events = list(LegacyEventFileLoader(str(path)).Load())
    assert events[0].file_version == "brain.Event:2"
    assert all(e.summary.value[0].simple_value == 0.5 for e in events[1:])
    return [e.step for e in events[1:]]


def counts(bus: EventBus) -> tuple[int, int, int, int]:
    (h,) = bus.stats()["handlers"]
    return h["logged"], h["delivered"], h["dropped"], h["pending"]


def test_a_full_disk_leaves_whole_records_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a real full disk (a 64 KiB tmpfs) the event file is cut back to whole records, 100
    records (the bound here) are kept and the events refused past them are counted as dropped;
    once space is freed the kept records follow, readable: delivered == scalars in the file,
    delivered + dropped == logged."""
    caplog.set_level(logging.WARNING, logger="monitor_bus")
    monkeypatch.setattr(_event_file, "KEEP_RECORDS", 100)
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        writer = SummaryWriter(disk / "tb")
        (path,) = (disk / "tb").iterdir()
        filler = disk / "filler"
        filler.write_bytes(b"x" * 56 * 1024)  # room for some 150 records
        handler = TensorboardEventHandler(writer)
        bus = EventBus(name="disk")
        handle = bus.register_event_handler(handler, name="tb")
        for i in range(600):
            bus.log_event(window(i))
        assert bus.flush(10)
        written = steps(path)
        assert 0 < len(written) < 400
        assert written == list(range(len(written)))
        refused = 600 - len(written) - 100
        assert (handler.dropped, writer.dropped_records) == (refused, refused)
        assert counts(bus) == (600, 600 - refused, refused, 0)
        assert bus.stats()["handler_errors"] >= 1

        filler.unlink()  # space returns: the next flush writes the kept records
        bus.log_event(window(600))
        assert bus.flush(10)
        assert steps(path) == [*range(len(written) + 100), 600]
        assert counts(bus) == (601, len(written) + 101, refused, 0)
        assert bus.close(10)
        assert (handle._handler.delivered, handle._handler.dropped) == (
            len(written) + 101,
            refused,
        )
        reports = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
        assert reports[-1].endswith(f"{refused} in all")
        writer.close()
        assert writer.dropped_records == refused


def test_close_on_a_full_disk_counts_and_raises(tmp_path: Path) -> None:
    """close() writes what it can and counts the records it cannot write, raising the error;
    the file it leaves is whole records."""
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        writer = SummaryWriter(disk / "tb", max_queue=1000)
        (path,) = (disk / "tb").iterdir()
        (disk / "filler").write_bytes(b"x" * 60 * 1024)
        for i in range(200):
            writer.add_scalar("loss.mean", 0.5, global_step=i)
        with pytest.raises(OSError, match="No space left"):
            writer.close()
        written = steps(path)
        assert written == list(range(len(written)))
        assert writer.dropped_records == 200 - len(written) > 0
        writer.close()  # idempotent
