"""TensorBoard as a sink, through any writer with ``add_scalar``."""

from __future__ import annotations

from typing import Any, Protocol

from ._event import Event
from ._stat import STAT_EVENT


class ScalarWriter(Protocol):
    """What ``TensorboardEventHandler`` needs of a writer (torch's and tensorboardX's
    ``SummaryWriter`` qualify)."""

    def add_scalar(
        self, tag: str, scalar_value: Any, global_step: Any = ..., walltime: Any = ...
    ) -> Any: ...


class TensorboardEventHandler:
    """Write every ``Stat`` window to TensorBoard as scalars.

    Each ``STAT_EVENT`` becomes ``writer.add_scalar(key, value, global_step=step,
    walltime=...)`` per key, with the event's timestamp as wall time; other events are
    ignored, as in ``torch.monitor``.

    Steps: an event whose data holds an int under the key ``"step"`` gives that step to all
    its other keys (``"step"`` itself is not written). Otherwise each tag counts its own
    steps, 0, 1, 2, ..., so the n-th window of a Stat is drawn at x = n. (torch.monitor passes
    no step, which puts every point of a series at step 0.) A bool is not a step.

    The bus calls ``flush()`` after each delivered batch, which flushes the writer (if it
    has a ``flush`` method): once ``bus.flush()`` returns, the scalars are in the event file.

    Args:
        writer: a ``SummaryWriter`` (``monitor_bus.tensorboard``, torch's or tensorboardX's).

    Example:
        >>> import monitor_bus as monitor
        >>> from torch.utils.tensorboard import SummaryWriter  # doctest: +SKIP
        >>> monitor.register_event_handler(monitor.TensorboardEventHandler(SummaryWriter()))  # doctest: +SKIP
    """

    def __init__(self, writer: ScalarWriter) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer must have an add_scalar method, not {type(writer).__name__}")
        self._writer = writer
        # Next step per tag; touched only by the handler's own thread.
        self._steps: dict[str, int] = {}

    def __call__(self, event: Event) -> None:
        if event.name != STAT_EVENT:
            return
        walltime = event.timestamp.timestamp()
        add_scalar = self._writer.add_scalar
        data = event.data
        step = data.get("step")
        if step.__class__ is int:
            for key, value in data.items():
                if key != "step":
                    add_scalar(key, value, global_step=step, walltime=walltime)
            return
        steps = self._steps
        for key, value in data.items():
            n = steps.get(key, 0)
            steps[key] = n + 1
            add_scalar(key, value, global_step=n, walltime=walltime)

    def flush(self) -> None:
        """Flush the writer, if it has a ``flush`` method (the bus calls this after each batch)."""
        flush = getattr(self._writer, "flush", None)
        if callable(flush):
            flush()
