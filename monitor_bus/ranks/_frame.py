"""The rank merge's wire format: records, frames and their encoding, each within its limit.

A window travels as a record (a JSON list); records travel in frames of ``FRAME_BYTES``, each
a 4-byte length and a JSON envelope. ``_fit`` and ``_pack`` make every frame, envelope and
host word fit by construction; the rank that sends them (``_sending``) logs what cannot.

Guarantees
----------
- Every sample travels: every frame is within ``FRAME_BYTES`` (the mark, a leader's word
  on its host and the ranks' progress, ``_hang``'s, bounded there to half a frame, go in a
  frame of their own when they do not fit beside the windows; a frame
  that cannot be encoded costs its own windows, logged and counted in ``unsent``, never
  upstream). A window too large for a frame goes with its
  Histogram coarsened a scale at a time until it fits (each scale doubles the percentiles'
  error bound), warned per Stat (rate-limited); one that cannot fit even so (a Stat name about
  a frame long) is logged by its rank, marked ``"<name>.rank"``, counted in ``unsent``.
"""

from __future__ import annotations

import json
import math
import struct
from datetime import timedelta
from typing import Any

from .._histogram import Histogram
from .._window import ClosedWindow

# Every message is one frame of this many bytes: a 4-byte length, then JSON. One fixed size
# lets dst take a frame from any rank with a single receive (gloo needs sizes to match).
_FRAME = FRAME_BYTES = 16384
# The most JSON a window may be: a frame less its length and the envelope of a frame that
# carries no mark (``_encode``'s); the mark and a leader's word go in a frame of
# their own when they do not fit beside the windows.
_ROOM = _FRAME - 4 - len('{"mark":null,"bye":false,"windows":[]}')
_TAG = 7301
# dst's receive waits this long: a timed-out gloo wait fails every peer of the group, so it
# must not time out while the ranks are merely quiet.
_FOREVER = timedelta(days=365)

# Record fields: name, aggregation values, window size, window index, count, sum, max, min,
# value, close time (wall seconds), moments (STDDEV), Histogram.to_dict() or None; a host
# record (a leader's merge of its host's windows) adds a 13th: {"rank": the rank whose value
# it kept, "parts": [[rank, count, sum], ...] of the ranks it merged, "behind": the ranks of
# its host it was merged without}.
_Record = list[Any]


def _record(window: ClosedWindow) -> _Record:
    stat = window.stat
    size = stat._window
    return [
        stat._name,
        [agg.value for agg in stat._aggregations],
        size,
        round(window.end / size),
        window.count,
        _window_sum(window),
        window.high,
        window.low,
        window.value,
        window.stamp.timestamp(),
        list(window.moments),
        None if window.histogram is None else window.histogram.to_dict(),
    ]


def _window_sum(window: ClosedWindow) -> float:
    """The window's sum; for a Stat without SUM or MEAN (which folds no sum), the one its
    Histogram or moments hold, so a straggler watch has each rank's mean all the same."""
    if window.stat._want_sum:
        return window.total
    if window.histogram is not None:
        return window.histogram.sum
    n, shift, mean, _ = window.moments
    return (shift + mean) * n if n else window.total


def _windows_in(record: _Record) -> int:
    """How many ranks' windows a record holds: one, or a host record's parts."""
    return len(record[12]["parts"]) if len(record) > 12 else 1


def _encode(
    batch: list[str], mark: float | None, bye: bool, host: str = "", progress: str = ""
) -> bytes:
    windows = ",".join(batch)
    extra = (f',"host":{host}' if host else "") + (f',"progress":{progress}' if progress else "")
    body = f'{{"mark":{json.dumps(mark)},"bye":{json.dumps(bye)},"windows":[{windows}]{extra}}}'
    data = body.encode()
    return struct.pack("<I", len(data)) + data


def _tensor(frame: bytes) -> Any:
    import torch

    if len(frame) > _FRAME:
        raise ValueError(f"a frame of {len(frame)} bytes, over {_FRAME}")
    buf = torch.zeros(_FRAME, dtype=torch.uint8)
    buf[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    return buf


def _fit(record: _Record) -> tuple[str, tuple[int, int] | None] | None:
    """The record's JSON, within a frame: its Histogram coarsened (``Histogram.merge``'s own
    coarsening, a scale at a time) until it fits, with the scales it went from and to (None:
    it fit as it was); None if even that does not do (the record left as it was)."""
    text = json.dumps(record)
    if len(text) <= _ROOM:
        return text, None
    original = record[11]
    if original is None:
        return None
    histogram = Histogram.from_dict(original)
    start = histogram.scale
    while len(text) > _ROOM:
        widest = max(len(histogram.positive_counts), len(histogram.negative_counts))
        if widest <= 3:  # as coarse as a Histogram gets: logged here at full resolution
            record[11] = original
            return None
        # An empty Histogram of one bucket fewer: the merge coarsens by one scale.
        histogram = histogram.merge(Histogram(max_buckets=widest - 1))
        coarse = histogram.to_dict()
        coarse["max_buckets"] = original["max_buckets"]  # merges on dst as before
        record[11] = coarse
        text = json.dumps(record)
    return text, (start, histogram.scale)


def _pack(
    fitted: list[tuple[str, _Record]], mark: float, bye: bool, host: str = "", progress: str = ""
) -> list[tuple[bytes, list[_Record]]]:
    """The frames carrying the ``fitted`` records (each its JSON and itself), each within
    ``_FRAME`` bytes (but for a ``host`` longer than a frame); only the last one says how far
    this rank is and carries ``host`` and ``progress``, JSON objects, on its own if they do not
    fit beside the windows."""
    frames: list[tuple[bytes, list[_Record]]] = []
    batch: list[str] = []
    batch_records: list[_Record] = []
    size = 0  # the batch's JSON: its windows and the commas between them
    for text, record in fitted:
        # ASCII (json.dumps escapes the rest): a character is a byte.
        if batch and size + 1 + len(text) > _ROOM:
            frames.append((_encode(batch, None, False), batch_records))
            batch, batch_records, size = [], [], 0
        size += len(text) + (1 if batch else 0)
        batch.append(text)
        batch_records.append(record)
    if batch and len(_encode([], mark, bye, host, progress)) + size > _FRAME:
        frames.append((_encode(batch, None, False), batch_records))
        batch, batch_records = [], []
    frames.append((_encode(batch, mark, bye, host, progress), batch_records))
    return frames


def _quantile_error(scale: int) -> float:
    """The bound on a percentile's relative error at ``scale`` (see ``Histogram.quantile``)."""
    r = math.pow(2.0, math.ldexp(1.0, -scale))
    return (r - 1) / (r + 1)
