"""A Hugging Face ``Trainer`` callback that puts what the Trainer logs on a bus.

Needs the ``transformers`` extra: ``pip install 'monitor_bus[transformers]'``. ``import
monitor_bus`` does not import this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "monitor_bus.integrations.transformers needs the transformers package: "
        "pip install 'monitor_bus[transformers]'",
        name="transformers",
    ) from exc

from .._check import check_timeout
from .._default import flush, log_event
from .._event import Event, _plain_value, data_value_t
from .._run import METRICS_EVENT, Run

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["MonitorBusCallback"]


class MonitorBusCallback(TrainerCallback):
    """A ``TrainerCallback`` whose hooks become events on a bus, off the training thread.

    - ``on_train_begin``: the run-start event (``RUN_START_EVENT``) with the
      ``TrainingArguments`` as ``hparams.*`` (``args.to_dict()``), the model's config as
      ``config.*`` (``model.config.to_dict()``), ``version.transformers`` and the process
      index as ``rank``. The run's name is ``run_name``, else ``args.run_name``.
    - ``on_log``: one ``METRICS_EVENT`` per call with the logged numbers and
      ``state.global_step`` as ``"step"``. A value that is not a number is skipped and counted
      in ``skipped_values``.
    - ``on_train_end``: the run-end event with ``success``, then the bus is flushed for at
      most ``flush_timeout`` seconds. The Trainer has no hook for a failure: a ``train()``
      that raises leaves the run open, and the interpreter's exit records it ``failed``
      (``interrupted`` for Ctrl-C) if the exception is not caught; code that catches it calls
      ``callback.end_run("failed", exc)``.

    Processes: only the world's process zero logs (``state.is_world_process_zero``), as the
    Trainer's own integrations do; ``all_processes=True`` logs from every process, each on its
    own bus, its run-start event carrying its ``rank``.

    Args:
        bus: the bus to log to; the default bus if omitted.
        run_name: the run's name.
        all_processes: log from every process, not only process zero.
        flush_timeout: seconds ``on_train_end`` waits for the bus; None for no limit.

    Examples:
        >>> from transformers import Trainer
        >>> from monitor_bus.integrations.transformers import MonitorBusCallback
        >>> trainer = Trainer(model, args, callbacks=[MonitorBusCallback()])  # doctest: +SKIP
    """

    def __init__(
        self,
        bus: EventBus | None = None,
        *,
        run_name: str | None = None,
        all_processes: bool = False,
        flush_timeout: float | None = 10.0,
    ) -> None:
        if run_name is not None and not isinstance(run_name, str):
            raise TypeError(f"run_name must be a str, not {type(run_name).__name__}")
        self._bus = bus
        self._run_name = run_name
        self._all = bool(all_processes)
        self._flush_timeout = check_timeout("flush_timeout", flush_timeout)
        #: The current run (None before ``on_train_begin``).
        self.run: Run | None = None
        #: Logged values skipped because they are not numbers.
        self.skipped_values = 0

    def _here(self, state: Any) -> bool:
        return self._all or bool(getattr(state, "is_world_process_zero", True))

    def _log(self, event: Event) -> None:
        if self._bus is not None:
            self._bus.log_event(event)
        else:
            log_event(event)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Open the run (see the class docs)."""
        if not self._here(state):
            return
        model = kwargs.get("model")
        config = getattr(model, "config", None)
        to_dict = getattr(config, "to_dict", None)
        self.run = Run(
            self._run_name or getattr(args, "run_name", None) or None,
            config=to_dict() if callable(to_dict) else None,
            hparams=args.to_dict() if hasattr(args, "to_dict") else None,
            rank=int(getattr(args, "process_index", 0)),
            versions={"transformers": transformers.__version__},
            bus=self._bus,
        ).start()

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Log the Trainer's ``logs`` as one metrics event at ``state.global_step``."""
        if not self._here(state) or not logs:
            return
        data: dict[str, data_value_t] = {}
        for key, value in logs.items():
            try:
                plain = _plain_value(str(key), value)
            except TypeError:
                plain = None
            if plain is None or isinstance(plain, str):
                self.skipped_values += 1
                continue
            data[str(key)] = float(plain) if not isinstance(plain, bool) else plain
        data["step"] = int(state.global_step)
        self._log(Event(METRICS_EVENT, datetime.now(timezone.utc), data))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End the run with ``success`` and flush the bus."""
        if not self._here(state):
            return
        self.end_run("success")

    def end_run(self, status: str, exception: BaseException | None = None) -> None:
        """End the current run with ``status`` (if it is open) and flush the bus.

        Args:
            status: ``"success"``, ``"failed"`` or ``"interrupted"``.
            exception: what ended the run, if anything.
        """
        if self.run is not None:
            self.run.end(status, exception)
        if self._bus is not None:
            self._bus.flush(self._flush_timeout)
        else:
            flush(self._flush_timeout)
