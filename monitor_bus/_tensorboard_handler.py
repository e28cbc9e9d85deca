"""TensorBoard as a sink, through any writer with ``add_scalar``."""

from __future__ import annotations

from typing import Any, Protocol

from ._event import Event
from ._stat import STAT_EVENT


class ScalarWriter(Protocol):
    """What ``TensorboardEventHandler`` needs of a writer (torch's and tensorboardX's
    ``SummaryWriter`` qualify)."""

    def add_scalar(self, tag: str, scalar_value: Any, global_step: Any = ..., walltime: Any = ...) -> Any: ...


class TensorboardEventHandler:
    """Write every ``Stat`` window to TensorBoard as scalars.

    Each ``STAT_EVENT`` becomes ``writer.add_scalar(key, value, walltime=...)`` per key, with
    the event's timestamp as wall time; other events are ignored, as in ``torch.monitor``.

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

    def __call__(self, event: Event) -> None:
        if event.name != STAT_EVENT:
            return
        walltime = event.timestamp.timestamp()
        add_scalar = self._writer.add_scalar
        for key, value in event.data.items():
            add_scalar(key, value, walltime=walltime)
