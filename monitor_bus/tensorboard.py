"""A torch-free ``SummaryWriter`` for scalars, on the ``tensorboard`` package's own writer.

Event files are written by ``tensorboard.summary.writer.event_file_writer.EventFileWriter``
(the writer torch's ``SummaryWriter`` wraps) from ``tensorboard.compat.proto`` messages, so
TensorBoard, ``EventAccumulator`` and every other reader of the format load them.

Needs the ``tensorboard`` extra: ``pip install 'monitor_bus[tensorboard]'``. ``import
monitor_bus`` does not import this module.

Examples:
    >>> import monitor_bus as monitor
    >>> from monitor_bus.tensorboard import SummaryWriter
    >>> writer = SummaryWriter("runs/exp1")  # doctest: +SKIP
    >>> monitor.register_event_handler(monitor.TensorboardEventHandler(writer))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsIndex

try:
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2  # type: ignore[import-untyped]
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "monitor_bus.tensorboard needs the tensorboard package: "
        "pip install 'monitor_bus[tensorboard]'",
        name="tensorboard",
    ) from exc

from ._skipped import INT64_MAX, INT64_MIN, is_utf8

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["SummaryWriter"]


class SummaryWriter:
    """Write scalars to a TensorBoard event file, with the interface of torch's writer.

    Each writer makes a new ``events.out.tfevents.*`` file in ``log_dir``; several writers
    (or runs) may share a directory. Writes go through a background thread of the
    ``tensorboard`` package and reach the disk at ``flush()``, ``close()``, every
    ``flush_secs`` seconds or when ``max_queue`` records are pending. All methods are
    thread-safe.

    Args:
        log_dir: the directory to write to, made if missing; default
            ``runs/<date>_<time>_<hostname><comment>``, as in torch.
        comment: appended to the default ``log_dir``; ignored when ``log_dir`` is given.
        max_queue: records held before a write is forced.
        flush_secs: seconds between automatic flushes.
        filename_suffix: appended to the event file names.

    Raises:
        TypeError: an argument has the wrong type.
        OSError: ``log_dir`` cannot be created (the message names it).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        comment: str = "",
        max_queue: int = 10,
        flush_secs: float = 120,
        filename_suffix: str = "",
    ) -> None:
        if log_dir is None:
            stamp = datetime.now().strftime("%b%d_%H-%M-%S")
            log_dir = os.path.join("runs", f"{stamp}_{socket.gethostname()}{comment}")
        elif not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir must be a str or path, not {type(log_dir).__name__}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive int, got {max_queue!r}")
        self._log_dir = os.fspath(log_dir)
        self._max_queue = max_queue
        self._flush_secs = flush_secs
        self._suffix = filename_suffix
        self._lock = threading.Lock()
        self._closed = False
        self._writer = self._open(self._log_dir)
        # add_scalars keeps one file per (main_tag, tag) pair, in its own subdirectory.
        self._sub_writers: dict[str, EventFileWriter] = {}

    def _open(self, log_dir: str) -> EventFileWriter:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot create log_dir: {exc.strerror}", log_dir) from None
        return EventFileWriter(log_dir, self._max_queue, self._flush_secs, self._suffix)

    @property
    def log_dir(self) -> str:
        """The directory this writer writes to."""
        return self._log_dir

    def get_logdir(self) -> str:
        """The directory this writer writes to (torch's spelling)."""
        return self._log_dir

    def add_scalar(
        self,
        tag: str,
        scalar_value: SupportsFloat,
        global_step: SupportsIndex | None = None,
        walltime: float | None = None,
        new_style: bool = False,
        double_precision: bool = False,
    ) -> None:
        """Record one scalar.

        By default the value is stored as a 32-bit float in ``simple_value``, as torch does;
        ``new_style=True`` stores it as a tensor of the scalars plugin (64-bit with
        ``double_precision=True``), which readers list under tensors instead of scalars.

        Args:
            tag: the series name, for example ``"loss/train"``.
            scalar_value: a real number (numpy and torch scalars work).
            global_step: the x coordinate; 0 when omitted.
            walltime: seconds since the epoch; now when omitted.
            new_style: store a tensor instead of a ``simple_value``.
            double_precision: with ``new_style``, keep all 64 bits.

        Raises:
            TypeError: ``tag`` is not a str, or ``scalar_value`` is not a real number.
            ValueError: ``tag`` is not valid UTF-8 (holds a lone surrogate), ``scalar_value``
                is an int beyond float64's range, or ``global_step`` is outside int64.
            RuntimeError: the writer is closed.
        """
        value = _summary_value(tag, scalar_value, new_style, double_precision)
        event = _event(value, global_step, walltime)
        with self._lock:
            self._check_open()
            self._writer.add_event(event)

    def add_scalars(
        self,
        main_tag: str,
        tag_scalar_dict: Mapping[str, SupportsFloat],
        global_step: SupportsIndex | None = None,
        walltime: float | None = None,
    ) -> None:
        """Record several scalars to draw on one chart, as torch does.

        Each key gets a file in ``<log_dir>/<main_tag>_<key>`` (``/`` in ``main_tag``
        becomes ``_``) holding the scalar under the tag ``main_tag``, so TensorBoard shows
        one chart with one line per key.

        Raises:
            TypeError: ``main_tag`` is not a str, ``tag_scalar_dict`` not a mapping, or a
                value not a real number.
            ValueError: as for ``add_scalar``.
            RuntimeError: the writer is closed.
        """
        if not isinstance(tag_scalar_dict, Mapping):
            raise TypeError(
                f"tag_scalar_dict must be a mapping, not {type(tag_scalar_dict).__name__}"
            )
        walltime = time.time() if walltime is None else walltime
        events = [
            (str(key), _event(_summary_value(main_tag, value, False, False), global_step, walltime))
            for key, value in tag_scalar_dict.items()
        ]
        with self._lock:
            self._check_open()
            for key, event in events:
                # Same directory naming as torch, so both writers' runs line up.
                sub_dir = os.path.join(self._log_dir, f"{main_tag.replace('/', '_')}_{key}")
                writer = self._sub_writers.get(sub_dir)
                if writer is None:
                    writer = self._sub_writers[sub_dir] = self._open(sub_dir)
                writer.add_event(event)

    def flush(self) -> None:
        """Write everything recorded so far to disk. A no-op once closed."""
        with self._lock:
            if self._closed:
                return
            for writer in (self._writer, *self._sub_writers.values()):
                writer.flush()

    def close(self) -> None:
        """Flush and close the event files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for writer in (self._writer, *self._sub_writers.values()):
                writer.close()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SummaryWriter {self._log_dir!r} ({state})>"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")


def _summary_value(tag: Any, scalar_value: Any, new_style: bool, double_precision: bool) -> Any:
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, not {type(tag).__name__}")
    if not is_utf8(tag):
        raise ValueError(f"tag {tag!r} is not valid UTF-8, which event files need")
    try:
        value = float(scalar_value)
    except (TypeError, ValueError):
        raise TypeError(
            f"scalar_value must be a real number, not {type(scalar_value).__name__}"
        ) from None
    except OverflowError:
        raise ValueError("scalar_value is an int beyond float64's range") from None
    if not new_style:
        return summary_pb2.Summary.Value(tag=tag, simple_value=value)
    if double_precision:
        tensor = tensor_pb2.TensorProto(dtype="DT_DOUBLE", double_val=[value])
    else:
        tensor = tensor_pb2.TensorProto(dtype="DT_FLOAT", float_val=[value])
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)


def _event(value: Any, global_step: Any, walltime: float | None) -> Any:
    event = event_pb2.Event(
        wall_time=time.time() if walltime is None else float(walltime),
        summary=summary_pb2.Summary(value=[value]),
    )
    if global_step is not None:
        if isinstance(global_step, bool):
            raise TypeError("global_step must be an int, not bool")
        try:
            step = int(global_step.__index__())
        except (AttributeError, TypeError):
            raise TypeError(
                f"global_step must be an int, not {type(global_step).__name__}"
            ) from None
        if not INT64_MIN <= step <= INT64_MAX:
            raise ValueError(f"global_step {step} is outside int64, the event file's step type")
        event.step = step
    return event
