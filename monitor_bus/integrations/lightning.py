"""A PyTorch Lightning logger that puts what Lightning logs on a bus.

Needs the ``lightning`` extra: ``pip install 'monitor_bus[lightning]'``. ``import monitor_bus``
does not import this module.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

try:
    import lightning
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.loggers.logger import Logger
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "monitor_bus.integrations.lightning needs the lightning package: "
        "pip install 'monitor_bus[lightning]'",
        name="lightning",
    ) from exc

from .._check import check_timeout
from .._default import get_default_bus
from .._event import Event, _plain_value, data_value_t
from .._run import METRICS_EVENT, Run

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["MonitorBusLogger"]

# What Lightning's finalize(status) says, as a run status; "failed" is refined by the
# exception being handled (Lightning calls finalize("failed") for Ctrl-C too).
_STATUS = {"success": "success", "failed": "failed", "finished": "interrupted"}


class MonitorBusLogger(Logger):
    """A ``lightning`` logger whose calls become events on a bus, off the training thread.

    - ``log_metrics(metrics, step)``: one ``METRICS_EVENT`` per call, holding every metric
      as a float and ``"step"``. Lightning has already reduced these values (per step or per
      epoch, as ``self.log`` asked), so they are not put through a ``Stat`` window, which
      would average averages and lose the step. A value an event cannot hold is skipped and
      counted in ``skipped_values``.
    - ``log_hyperparams(params)``: the run-start event (``RUN_START_EVENT``), with the
      params as ``hparams.*`` and ``version.lightning``.
    - ``finalize(status)``: the run-end event. Lightning's ``"success"`` is ``success``;
      ``"failed"`` is ``interrupted`` when the exception being handled is a
      ``KeyboardInterrupt`` (Lightning reports Ctrl-C as failed) and ``failed`` otherwise, with
      the exception's type; ``"finished"`` (a requeue signal) is ``interrupted``. Then the bus
      is flushed, for at most ``finalize_timeout`` seconds. A later ``log_*`` call (a
      ``trainer.test`` after ``fit``) opens a new run.

    Ranks: like Lightning's own loggers, only global rank 0 logs; with ``all_ranks=True`` every
    rank does, each process on its own bus, its run-start event carrying its ``rank``.
    Several loggers: pass it with others (``Trainer(logger=[MonitorBusLogger(), CSVLogger()])``).
    The ``pytorch_lightning`` package's ``Trainer`` (installed with ``lightning``) takes it too.

    Args:
        bus: the bus to log to; the default bus if omitted.
        name: the logger's name, also the run's name.
        version: the logger's version.
        all_ranks: log from every rank, not only rank 0.
        finalize_timeout: seconds ``finalize`` waits for the bus to deliver; None for no limit.

    Examples:
        >>> import lightning as L
        >>> from monitor_bus.integrations.lightning import MonitorBusLogger
        >>> trainer = L.Trainer(logger=MonitorBusLogger())  # doctest: +SKIP
    """

    def __init__(
        self,
        bus: EventBus | None = None,
        *,
        name: str = "monitor_bus",
        version: int | str | None = None,
        all_ranks: bool = False,
        finalize_timeout: float | None = 10.0,
    ) -> None:
        super().__init__()
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        self._bus = bus
        self._name = name
        self._version = version
        self._all_ranks = bool(all_ranks)
        self._finalize_timeout = check_timeout("finalize_timeout", finalize_timeout)
        self._run: Run | None = None
        #: Metric values skipped because an event cannot hold them.
        self.skipped_values = 0

    @property
    def name(self) -> str:
        """The logger's name."""
        return self._name

    @property
    def version(self) -> int | str | None:
        """The logger's version."""
        return self._version

    @property
    def experiment(self) -> EventBus:
        """The bus this logger logs to."""
        if self._bus is not None:
            return self._bus
        return get_default_bus()

    def _logs_here(self) -> bool:
        return self._all_ranks or getattr(rank_zero_only, "rank", 0) == 0

    def _current_run(self, params: Mapping[str, Any] | None = None) -> Run:
        run = self._run
        if run is None or run.status is not None:
            run = self._run = Run(
                self._name,
                hparams=params,
                rank=getattr(rank_zero_only, "rank", 0),
                versions={"lightning": lightning.__version__},
                bus=self._bus,
            ).start()
        return run

    def log_hyperparams(
        self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any
    ) -> None:
        """Open the run with ``params`` as its hyperparameters (see the class docs)."""
        if not self._logs_here():
            return
        if isinstance(params, Namespace):
            params = vars(params)
        self._current_run(params)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log one ``METRICS_EVENT`` with ``metrics`` and ``step`` (see the class docs)."""
        if not self._logs_here():
            return
        self._current_run()
        data: dict[str, data_value_t] = {}
        for key, value in metrics.items():
            try:
                data[str(key)] = _plain_value(str(key), value)
            except TypeError:
                self.skipped_values += 1
        if step is not None:
            data["step"] = int(step)
        event = Event(METRICS_EVENT, datetime.now(timezone.utc), data)
        self.experiment.log_event(event)

    def finalize(self, status: str) -> None:
        """End the run with Lightning's ``status`` and flush the bus (see the class docs)."""
        if not self._logs_here():
            return
        run = self._run
        if run is not None and run.status is None:
            exc = sys.exc_info()[1]
            mapped = _STATUS.get(status, "failed")
            if mapped == "failed" and isinstance(exc, KeyboardInterrupt):
                mapped = "interrupted"
            run.end(mapped, exc if mapped != "success" else None)
        self.experiment.flush(self._finalize_timeout)
