"""Run lifecycle: the events that open and close a training run, and a helper that logs them.

Convention
----------
Two event names, understood by the sinks (MLflow params and run status, TensorBoard's
HPARAMS tab, JSONL as any event) and emitted by the integrations:

``RUN_START_EVENT`` (``"monitor_bus.run.start"``), data:

- ``run_id`` (str): a fresh hex id; ``run_name`` (str).
- ``host`` (str), ``pid`` (int), ``rank`` (int: the ``rank`` given, else the ``RANK``
  environment variable, else 0).
- ``version.python``, ``version.monitor_bus``, and ``version.<package>`` for each framework
  already imported (torch, lightning, transformers) or passed in ``versions``.
- ``config.<key>`` and ``hparams.<key>``: the configuration and the hyperparameters, nested
  mappings flattened with ``.`` (``hparams.optimizer.lr``). A value that is not a ``str``,
  ``int``, ``float`` or ``bool`` is kept as its ``str()`` (``None`` as ``"None"``).

``RUN_END_EVENT`` (``"monitor_bus.run.end"``), data:

- ``run_id``, ``run_name``: as at the start.
- ``status`` (str): ``"success"``, ``"failed"`` or ``"interrupted"`` (a ``KeyboardInterrupt``).
- ``duration_s`` (float): seconds from start to end (monotonic clock).
- ``exception`` (str): the exception's qualified type name (``"builtins.ValueError"``), or
  ``""`` when there is none.
- ``metrics.<key>``: the run's final metrics (``Run.metrics``, ``end(metrics=...)``), flattened
  as the hparams are: the values a run is compared by (TensorBoard's HPARAMS tab).

``METRICS_EVENT`` (``"monitor_bus.metrics"``): values a framework already reduced (one
``log_metrics`` / ``on_log`` call), as floats, with the training step as the int ``"step"``.

Exit: an open ``Run`` is ended when its process ends, before the buses close (whenever
``multiprocessing`` was imported), in a ``multiprocessing`` child too. An uncaught exception
records ``failed`` (``interrupted`` for Ctrl-C) through ``sys.excepthook``; in IPython or
Jupyter, a cell whose code raised does the same at the cell's end (a cell that does not even
compile ran nothing and ends nothing). A run still open at a normal exit records ``success``,
and so does ``sys.exit()`` with any code (Python tells an exit hook no exit code): end the run
yourself before a failing ``sys.exit``.

SIGTERM (what torchrun's agent, SLURM and Kubernetes send): a ``Run`` started, or a handler
registered on the default bus, in the main thread of a process that is not a
``multiprocessing`` child, while SIGTERM has Python's default disposition (no handler of the
user's), installs a handler (``_lifecycle.py`` holds it; ``Run(handle_sigterm=False)`` opts
the process out: it takes that handler back, and none is installed after). On SIGTERM it
restores the default at once (a second SIGTERM kills immediately), ends the open runs
``interrupted``, delivers what the buses hold within their ``exit_timeout`` (the process's
exit sequence, less waiting for children), and sends itself SIGTERM again: the process
still dies of SIGTERM, as its supervisor expects, without running ``finally`` blocks or
atexit hooks, as before. A handler installed later replaces it; if that handler calls it in
turn (as Lightning's does), it does nothing. SIGKILL runs no Python code and records nothing.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ._check import wrong_type
from ._default import log_event
from ._event import Event, data_value_t
from ._lifecycle import process
from ._version import __version__

if TYPE_CHECKING:
    from types import TracebackType

    from ._bus import EventBus

RUN_START_EVENT = "monitor_bus.run.start"
"""The name of the event that opens a run (its data keys:
[Run start and end](integrations.md#run-start-and-end))."""
RUN_END_EVENT = "monitor_bus.run.end"
"""The name of the event that closes a run, with its ``status``."""
METRICS_EVENT = "monitor_bus.metrics"
"""The name of the events carrying metrics a framework already reduced, with ``"step"``."""
RUN_STATUSES = ("success", "failed", "interrupted")
"""The values of a run end's ``status``."""

_PLAIN = (str, int, float, bool)
_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "transformers")


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, data_value_t]:
    """``params`` as flat event data: nested mappings joined with ``.``, other values kept if
    plain (``str``, ``int``, ``float``, ``bool``), else as their ``str()``.

    Args:
        params: the mapping to flatten (an ``argparse.Namespace`` works through ``vars()``).
        prefix: put before every key, for example ``"hparams."``.

    Raises:
        TypeError: ``params`` is not a mapping.

    Examples:
        >>> flatten_params({"lr": 0.1, "opt": {"name": "adam", "betas": (0.9, 0.99)}}, "hparams.")
        {'hparams.lr': 0.1, 'hparams.opt.name': 'adam', 'hparams.opt.betas': '(0.9, 0.99)'}
    """
    if not isinstance(params, Mapping):
        raise wrong_type("params", "a mapping", params)
    flat: dict[str, data_value_t] = {}
    _flatten(params, prefix, flat, 0)
    return flat


def _flatten(
    params: Mapping[Any, Any], prefix: str, out: dict[str, data_value_t], depth: int
) -> None:
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth < 8:
            _flatten(value, f"{name}.", out, depth + 1)
        elif isinstance(value, _PLAIN):
            out[name] = value
        else:
            out[name] = str(value)


def exception_name(exc: BaseException | type[BaseException] | None) -> str:
    """The qualified type name a run end records (``""`` for None)."""
    if exc is None:
        return ""
    cls = exc if isinstance(exc, type) else type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def status_of(exc: BaseException | type[BaseException] | None) -> str:
    """The run status an exception ends a run with: ``success`` for None, ``interrupted``
    for a ``KeyboardInterrupt``, ``failed`` for anything else."""
    if exc is None:
        return "success"
    cls = exc if isinstance(exc, type) else type(exc)
    return "interrupted" if issubclass(cls, KeyboardInterrupt) else "failed"


def _versions(extra: Mapping[str, str] | None) -> dict[str, data_value_t]:
    versions: dict[str, data_value_t] = {
        "version.python": sys.version.split()[0],
        "version.monitor_bus": __version__,
    }
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)  # never import a framework just to name its version
        version = getattr(module, "__version__", None)
        if isinstance(version, str):
            versions[f"version.{name}"] = version
    for name, version in (extra or {}).items():
        versions[f"version.{name}"] = str(version)
    return versions


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class Run:
    """A training run's start and end, as events on a bus.

    ``start()`` logs a ``RUN_START_EVENT``; ``end(status)`` logs a ``RUN_END_EVENT`` once
    (later calls do nothing and return False). As a context manager, the run starts on
    entry and ends on exit: ``success``, ``failed`` if an exception leaves the block,
    ``interrupted`` for a ``KeyboardInterrupt``; the exception propagates. A started run not
    yet ended is ended at interpreter exit (see
    [Run start and end](integrations.md#run-start-and-end)): a crash is never recorded as
    a success. Methods are thread-safe.

    Args:
        name: the run's name; its id when omitted.
        config: configuration, logged under ``config.``.
        hparams: hyperparameters, logged under ``hparams.``.
        rank: the process's rank; the ``RANK`` environment variable, else 0, when omitted.
        versions: extra ``package: version`` pairs for the start event.
        bus: the bus to log to; the default bus if omitted.
        handle_sigterm: whether ``start()`` may install the SIGTERM handler that ends the run
            and delivers the queued events (see [SIGTERM](integrations.md#sigterm): only in the main thread of
            the main process, and only where SIGTERM has no handler yet). False leaves SIGTERM
            to Python's default for the whole process: ``start()`` takes back the handler the
            default bus installed, and none is installed after.

    Raises:
        TypeError: an argument has the wrong type.

    Examples:
        >>> import monitor_bus as monitor
        >>> with monitor.Run("exp1", hparams={"lr": 0.1}) as run:  # doctest: +SKIP
        ...     train()
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        hparams: Mapping[str, Any] | None = None,
        rank: int | None = None,
        versions: Mapping[str, str] | None = None,
        bus: EventBus | None = None,
        handle_sigterm: bool = True,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise wrong_type("name", "a str", name)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise wrong_type("rank", "an int", rank)
        if not isinstance(handle_sigterm, bool):
            raise wrong_type("handle_sigterm", "a bool", handle_sigterm)
        for argument, value in (("config", config), ("hparams", hparams), ("versions", versions)):
            if value is not None and not isinstance(value, Mapping):
                raise wrong_type(argument, "a mapping", value)
        self.run_id = uuid.uuid4().hex
        self.name = name if name is not None else self.run_id
        self.rank = _env_rank() if rank is None else rank
        self._config = flatten_params(config or {}, "config.")
        self._hparams = flatten_params(hparams or {}, "hparams.")
        self._versions = versions
        self._bus = bus
        self._handle_sigterm = handle_sigterm
        self._lock = threading.Lock()
        self._started: float | None = None
        #: ``None`` until the run ends, then its status.
        self.status: str | None = None
        #: The run's final metrics (final loss, accuracy, ...): set them before the run ends,
        #: and its end event carries them as ``metrics.<key>``.
        self.metrics: dict[str, Any] = {}

    def start_data(self) -> dict[str, data_value_t]:
        """The data of this run's start event."""
        data: dict[str, data_value_t] = {
            "run_id": self.run_id,
            "run_name": self.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "rank": self.rank,
        }
        data.update(_versions(self._versions))
        data.update(self._config)
        data.update(self._hparams)
        return data

    def start(self) -> Run:
        """Log the start event (once) and return the run."""
        with self._lock:
            if self._started is not None:
                return self
            self._started = time.monotonic()
        self._log(RUN_START_EVENT, self.start_data())
        _open(self)
        if self._handle_sigterm:
            process.handle_sigterm()
        else:
            process.leave_sigterm()
        return self

    def end(
        self,
        status: str = "success",
        exception: BaseException | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> bool:
        """Log the end event with ``status``, once; False if the run had already ended.

        A run never started is started first, so every end has its start.

        Args:
            status: one of ``RUN_STATUSES``.
            exception: what ended the run, if anything (its type name is recorded).
            metrics: final metrics, added to ``self.metrics`` (they win over its keys).

        Raises:
            ValueError: ``status`` is not one of ``RUN_STATUSES``.
            TypeError: ``metrics`` is not a mapping.
        """
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}; got {status!r}")
        if metrics is not None and not isinstance(metrics, Mapping):
            raise wrong_type("metrics", "a mapping", metrics)
        self.start()
        with self._lock:
            if self.status is not None:
                return False
            self.status = status
            assert self._started is not None
            duration = time.monotonic() - self._started
        _close(self)
        data: dict[str, data_value_t] = {
            "run_id": self.run_id,
            "run_name": self.name,
            "status": status,
            "duration_s": duration,
            "exception": exception_name(exception),
        }
        data.update(flatten_params({**self.metrics, **(metrics or {})}, "metrics."))
        self._log(RUN_END_EVENT, data)
        return True

    def _log(self, name: str, data: dict[str, data_value_t]) -> None:
        event = Event(name, datetime.now(timezone.utc), data)
        if self._bus is not None:
            self._bus.log_event(event)
        else:
            log_event(event)

    def __enter__(self) -> Run:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end(status_of(exc_type), exc)

    def __repr__(self) -> str:
        state = self.status or ("running" if self._started is not None else "not started")
        return f"<Run {self.name!r} ({state})>"


# -- ending the runs left open when the process ends --

_runs_lock = threading.Lock()
_open_runs: dict[int, Run] = {}  # strong: a run nobody holds still ends
_previous_excepthook: Any = None
_cells_watched = False


def _open(run: Run) -> None:
    global _previous_excepthook
    with _runs_lock:
        _open_runs[id(run)] = run
        if _previous_excepthook is None:
            _previous_excepthook = sys.excepthook
            sys.excepthook = _excepthook
    # The exit sequence (_lifecycle's at_exit) ends the runs before the buses close; a
    # multiprocessing child runs it from its finalizers, registered here if not yet.
    if "multiprocessing" in sys.modules:
        process.finalize_with_multiprocessing()
    if "IPython" in sys.modules:
        _watch_cells()


def _close(run: Run) -> None:
    with _runs_lock:
        _open_runs.pop(id(run), None)


def end_open_runs(status: str, exception: BaseException | None) -> None:
    """End every run still open with ``status`` (the exit sequence, a crash, SIGTERM)."""
    with _runs_lock:
        runs = list(_open_runs.values())
    for run in runs:
        run.end(status, exception)


process.enders.append(lambda status: end_open_runs(status, None))  # at exit, before the Stats


def _forget_parent_runs() -> None:
    """A forked child does not end its parent's runs (it inherits the dict, not the runs)."""
    global _runs_lock
    _runs_lock = threading.Lock()
    _open_runs.clear()


os.register_at_fork(after_in_child=_forget_parent_runs)


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    try:
        end_open_runs(status_of(exc_type), exc)
    finally:
        previous = _previous_excepthook or sys.__excepthook__
        previous(exc_type, exc, tb)


def _watch_cells() -> None:
    """In IPython (Jupyter's kernel included), which shows a cell's exception itself rather
    than through ``sys.excepthook``: end the open runs when a cell's code raised."""
    global _cells_watched
    get_ipython = getattr(sys.modules["IPython"], "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    if shell is None or _cells_watched:
        return
    shell.events.register("post_run_cell", _after_cell)
    _cells_watched = True


def _after_cell(result: Any) -> None:
    exc = getattr(result, "error_in_exec", None)  # error_before_exec: nothing ran
    if exc is not None:
        end_open_runs(status_of(exc), exc)
