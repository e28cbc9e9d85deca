"""MLflow as a sink: Stat windows and framework metrics as metrics, a run's start as params
and tags, its end as the MLflow run status.

Needs the ``mlflow`` extra: ``pip install 'monitor_bus[mlflow]'`` (``mlflow-skinny`` is
enough for a remote server). ``import monitor_bus`` does not import this module.
"""

from __future__ import annotations

import logging
import posixpath
import re
import threading
from collections import deque
from typing import Any

try:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "monitor_bus.exporters.mlflow needs the mlflow package: pip install 'monitor_bus[mlflow]'",
        name="mlflow",
    ) from exc

from .._event import Event, epoch_seconds
from .._handler import call_each
from .._histogram import Histogram
from .._ratelimit import Throttle
from .._run import METRICS_EVENT, RUN_END_EVENT, RUN_START_EVENT
from .._skipped import INT64_MAX, INT64_MIN, SkipReporter, float64_or_why
from .._window import STAT_EVENT

__all__ = ["RUN_ID_TAG", "MlflowEventHandler"]

logger = logging.getLogger("monitor_bus")

# MLflow's limits for one log_batch call (mlflow.utils.validation).
_METRICS_PER_BATCH = 1000
_PARAMS_TAGS_PER_BATCH = 100
_PARAM_VALUE_LENGTH = 6000
_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
RUN_ID_TAG = "monitor_bus.run_id"
"""The MLflow tag holding monitor_bus's run id (``Run.run_id``): a plain ``run_id`` would read
as MLflow's own."""
# MLflow's rule for metric, param and tag names (mlflow.utils.validation): checked here, so
# one bad name is skipped alone instead of the server refusing its whole batch.
_NAME = re.compile(r"[/\w.\- :]{1,250}")
# Run-start keys that are params (the rest are tags).
_PARAM_PREFIXES = ("config.", "hparams.")


class MlflowEventHandler:
    """Write events to one MLflow run, in ``log_batch`` calls made off the training thread.

    What is written:

    - ``STAT_EVENT`` windows and ``METRICS_EVENT`` events: one metric per key (a Stat's keys
      are already one per aggregation, ``"loss.mean"``), with the event's timestamp. The step
      is the event's int ``"step"`` when it has one (not written itself); otherwise each key
      counts its own steps 0, 1, 2, ... A value that is not a number (a string, an int beyond
      float64) is skipped and counted in ``skipped_values``, and so is a key MLflow refuses
      as a name (other than letters, digits, ``_ - . / :`` and spaces; at most 250). A
      window's percentiles and stddev (``"step_time.p99"``, ``"step_time.stddev"``) are
      metrics like any other; its ``Histogram`` (``"step_time.histogram"``) is not, MLflow
      having no histogram metric: each is skipped and counted in ``skipped_histograms``, with
      one warning for the first.
    - ``RUN_START_EVENT``: ``config.*`` and ``hparams.*`` as params (values cut to MLflow's
      6000 characters), the other keys (host, pid, rank, versions) as tags, monitor_bus's run
      id as the tag ``monitor_bus.run_id`` (``RUN_ID_TAG``; earlier versions wrote ``run_id``,
      which a run they made keeps, untouched, when resumed), and the run's name as
      ``mlflow.runName``. Params and
      tags are sent apart from metrics: MLflow refuses to change a param already logged (a
      resumed run whose hyperparameters changed), and such a param is dropped, counted in
      ``dropped`` and named in one warning, while the metrics are written.
    - ``RUN_END_EVENT``: the run's status, ``success`` -> ``FINISHED``, ``failed`` ->
      ``FAILED``, ``interrupted`` -> ``KILLED``, with the event's time as the end time.
    - Other events are ignored.

    The run: ``run_id`` if given (a resumed run keeps its start time), else a run created in
    ``experiment_name`` (made if missing; MLflow's default experiment when omitted) at the
    first write, starting at the time of the run-start event if one came before (else at its
    creation). Each later ``Run`` (a run-start event with another monitor_bus run id) gets a
    run of its own, made the same way, so two Runs in a row never share params or metric
    steps. ``run_id`` tells the run written to last.

    Delivery: ``__call__`` only collects; ``flush()``, which the bus calls after each
    delivered batch on this handler's own thread, sends what was collected. A tracking server
    that is down or slow holds up this thread only: the training loop's ``log_event`` still
    returns at once, and what piles up meanwhile is dropped by the bus and counted in its
    ``stats()``. A request that fails is retried by MLflow's own client (its
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT`` environment
    variables); if it still fails, what it held is kept and sent again at the next flush,
    up to ``max_pending`` entries (the oldest past that are dropped and counted in
    ``dropped``); a batch of metrics the server refuses as invalid (a 4xx answer) is dropped
    and counted, and so is a param it refuses to change (with any store: the file store
    answers that refusal as an internal error, which would otherwise be retried for ever).
    Failures are logged on the ``monitor_bus`` logger at most once per 10 seconds.

    Args:
        tracking_uri: where MLflow tracks (``"sqlite:///mlflow.db"``, ``"http://host:5000"``,
            a directory); MLflow's default (``MLFLOW_TRACKING_URI``) when omitted.
        run_id: an existing run to write to (the first ``Run``'s).
        experiment_name: the experiment of the runs created.
        run_name: their name (each run-start event's ``run_name`` when omitted).
        max_pending: entries kept for a retry while the server fails.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        run_id: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        max_pending: int = 100_000,
    ) -> None:
        for name, value in (
            ("tracking_uri", tracking_uri),
            ("run_id", run_id),
            ("experiment_name", experiment_name),
            ("run_name", run_name),
        ):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self._tracking_uri = tracking_uri
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._max_pending = max_pending
        self._client: Any = None  # made on the handler's thread: it may reach the server
        self._lock = threading.Lock()
        # What is collected, per MLflow run: the last collects, the earlier ones are Runs
        # already over whose entries are still to be sent (a server that failed), in order.
        self._runs: deque[_Pending] = deque([_Pending(run_id, run_name)])
        self._skips = SkipReporter("MlflowEventHandler")
        self._throttle = Throttle()
        #: The MLflow run written to last (None until it is known).
        self.run_id = run_id
        #: Values skipped because MLflow metrics are numbers.
        self.skipped_values = 0
        #: Histograms (``<stat>.histogram``) skipped: MLflow has no histogram metric.
        self.skipped_histograms = 0
        #: Entries (metrics, params, tags) dropped: past ``max_pending``, or refused as invalid.
        self.dropped = 0
        #: Requests to the tracking server that failed (after MLflow's own retries).
        self.failed_requests = 0
        #: Metrics written.
        self.written_metrics = 0

    def handle_batch(self, events: list[Event]) -> None:
        """Take a batch of events (the bus's batch call); ``flush()`` sends them."""
        call_each(events, self)

    def __call__(self, event: Event) -> None:
        name = event.name
        if name in (STAT_EVENT, METRICS_EVENT):
            self._add_metrics(event)
        elif name == RUN_START_EVENT:
            owner = event.data.get("run_id")
            with self._lock:
                run = self._runs[-1]
                if run.owner is not None and owner != run.owner:  # the next Run: its own run
                    run = _Pending(None, self._run_name)
                    self._runs.append(run)
                if isinstance(owner, str):
                    run.owner = owner
                for key, value in event.data.items():
                    if not _valid_name(key):
                        self._skip("invalid_name", key, f"{key!r} is not a valid MLflow name")
                    elif key.startswith(_PARAM_PREFIXES):
                        run.params[key] = Param(key, str(value)[:_PARAM_VALUE_LENGTH])
                    else:
                        tag = RUN_ID_TAG if key == "run_id" else key
                        run.tags[tag] = RunTag(tag, str(value))
                if run.start_ms is None:
                    run.start_ms = _ms(event)
                run_name = event.data.get("run_name")
                if isinstance(run_name, str) and run.run_name is None:
                    run.run_name = run_name
                    run.tags["mlflow.runName"] = RunTag("mlflow.runName", run_name)
        elif name == RUN_END_EVENT:
            status = _STATUS.get(str(event.data.get("status")), "FAILED")
            with self._lock:
                self._runs[-1].end = (status, _ms(event))

    def _add_metrics(self, event: Event) -> None:
        data = event.data
        timestamp = _ms(event)
        step = data.get("step")
        fixed = isinstance(step, int) and step.__class__ is int and INT64_MIN <= step <= INT64_MAX
        metrics = []
        with self._lock:
            run = self._runs[-1]  # this thread alone adds runs (the bus's for this handler)
        for key, value in data.items():
            if fixed and key == "step":
                continue
            if isinstance(value, Histogram):  # a window's (data_value_t is torch's alias)
                self._skip_histogram(key)
                continue
            if not _valid_name(key):
                self._skip("invalid_name", key, f"{key!r} is not a valid MLflow metric name")
                continue
            number, reason, why = float64_or_why(key, value, "MLflow")
            if number is None:
                self._skip(reason, key, why)
                continue
            if fixed:
                at = int(step)  # type: ignore[arg-type]
            else:
                at = run.steps.get(key, 0)
                run.steps[key] = at + 1
            metrics.append(Metric(key, number, timestamp, at))
        with self._lock:
            run.metrics.extend(metrics)
            excess = sum(len(r.metrics) for r in self._runs) - self._max_pending
            if excess > 0:
                self.dropped += excess
                for oldest in self._runs:  # the oldest first
                    while excess and oldest.metrics:
                        oldest.metrics.popleft()
                        excess -= 1

    def _skip_histogram(self, key: str) -> None:
        """Count a histogram, which an MLflow metric cannot hold; warn of the first only."""
        self.skipped_histograms += 1
        if self.skipped_histograms == 1:
            logger.warning(
                "MlflowEventHandler: Stat value %r is a histogram, which MLflow cannot hold: "
                "it and every later histogram are skipped, counted in skipped_histograms and "
                "not warned of again (its percentiles and stddev are metrics)",
                key,
            )

    def _skip(self, reason: str, key: str, why: str) -> None:
        self.skipped_values += 1
        self._skips.report(reason, key, why, self.skipped_values)

    @property
    def pending(self) -> int:
        """Entries (metrics, params, tags, a run status) collected and not yet sent: after the
        bus has stopped, what a server that never came back did not get (``flush()`` tries
        again)."""
        with self._lock:
            return sum(
                len(r.metrics) + len(r.params) + len(r.tags) + (r.end is not None)
                for r in self._runs
            )

    def flush(self) -> None:
        """Send what was collected (the bus calls this after each batch, on this handler's
        thread). Never raises: a failure is counted, logged and retried at the next flush."""
        try:
            self._send()
        except Exception as exc:  # noqa: BLE001 - counted and retried, never into the bus
            self.failed_requests += 1
            if self._throttle.ready(type(exc)):
                logger.warning(
                    "MlflowEventHandler: the tracking server failed (%s: %s; %d failed "
                    "requests so far); what it held is sent again at the next flush",
                    type(exc).__name__,
                    str(exc)[:200],
                    self.failed_requests,
                )

    def _send(self) -> None:
        if self._client is None:
            self._client = MlflowClient(self._tracking_uri)
        client = self._client
        with self._lock:
            runs = list(self._runs)
        for run in runs:  # in order: a failure leaves this one and the later ones for later
            self._send_run(client, run)
            with self._lock:
                if run is not self._runs[-1] and run.sent():
                    self._runs.popleft()  # over, and all sent

    def _send_run(self, client: Any, run: _Pending) -> None:
        if run.run_id is None:
            run.run_id = self._create_run(client, run)
        self.run_id = run.run_id
        # Apart: a param MLflow refuses to change must not take metrics down with it.
        self._send_params_and_tags(client, run)
        self._send_metrics(client, run)
        with self._lock:
            end = run.end
        if end is not None:
            client.set_terminated(run.run_id, status=end[0], end_time=end[1])
            with self._lock:
                if run.end == end:
                    run.end = None

    def _send_params_and_tags(self, client: Any, run: _Pending) -> None:
        while True:
            with self._lock:
                params = list(run.params.values())[:_PARAMS_TAGS_PER_BATCH]
                tags = list(run.tags.values())[: _PARAMS_TAGS_PER_BATCH - len(params)]
            if not (params or tags):
                return
            try:
                client.log_batch(run.run_id, params=params, tags=tags)
            except MlflowException as exc:
                if params and self._drop_refused_params(client, run, params):
                    continue  # the rest goes again, without them
                self._refused(exc, run, [], params, tags)
                continue
            self._forget(run, [], params, tags)

    def _drop_refused_params(self, client: Any, run: _Pending, params: list[Any]) -> bool:
        """Drop the params of ``params`` already logged to the run with another value, which
        MLflow refuses to change; True if there were any. Raises if the run cannot be read
        (the store is down: everything is sent again at the next flush)."""
        logged = client.get_run(run.run_id).data.params
        refused = [p for p in params if p.key in logged and logged[p.key] != p.value]
        if not refused:
            return False
        self._forget(run, [], refused, [])
        self.dropped += len(refused)
        # Once per refused param: it is dropped, never sent again.
        logger.warning(
            "MlflowEventHandler: MLflow refuses to change params already logged to run %s "
            "(a resumed run with changed hyperparameters?): %s; the metrics are written "
            "(entries dropped so far: %d)",
            run.run_id,
            ", ".join(f"{p.key} ({logged[p.key]!r} logged, {p.value!r} dropped)" for p in refused),
            self.dropped,
        )
        return True

    def _send_metrics(self, client: Any, run: _Pending) -> None:
        while True:
            with self._lock:
                metrics = [run.metrics[i] for i in range(min(len(run.metrics), _METRICS_PER_BATCH))]
            if not metrics:
                return
            try:
                client.log_batch(run.run_id, metrics=metrics)
            except MlflowException as exc:
                self._refused(exc, run, metrics, [], [])
                continue
            self._forget(run, metrics, [], [])
            self.written_metrics += len(metrics)

    def _refused(
        self,
        exc: MlflowException,
        run: _Pending,
        metrics: list[Any],
        params: list[Any],
        tags: list[Any],
    ) -> None:
        """Drop and count a batch the server refused as invalid (a 4xx answer): sending it
        again cannot help. Anything else is raised, and the batch sent again later."""
        status = exc.get_http_status_code()  # type: ignore[no-untyped-call]
        if not 400 <= status < 500:
            raise exc
        self._forget(run, metrics, params, tags)
        self.dropped += len(metrics) + len(params) + len(tags)
        if self._throttle.ready("refused"):
            logger.warning(
                "MlflowEventHandler: the tracking server refused a batch of %d "
                "entries (%s); they are dropped (%d so far)",
                len(metrics) + len(params) + len(tags),
                str(exc)[:200],
                self.dropped,
            )

    def _forget(
        self, run: _Pending, metrics: list[Any], params: list[Any], tags: list[Any]
    ) -> None:
        with self._lock:
            for _ in metrics:
                run.metrics.popleft()
            # By identity: a newer run-start event may have put another value under the key.
            for kept, sent in ((run.params, params), (run.tags, tags)):
                for entry in sent:
                    key = entry.key
                    if kept.get(key) is entry:
                        del kept[key]

    def _create_run(self, client: Any, run: _Pending) -> str:
        experiment_id = "0"
        if self._experiment_name is not None:
            experiment = client.get_experiment_by_name(self._experiment_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                experiment_id = client.create_experiment(self._experiment_name)
        with self._lock:
            start, name = run.start_ms, run.run_name
        # The run's own start, not this first write's (the store may take seconds to open).
        made = client.create_run(experiment_id, start_time=start, run_name=name)
        return str(made.info.run_id)

    def __repr__(self) -> str:
        return f"<MlflowEventHandler run_id={self.run_id!r}>"


class _Pending:
    """What is collected for one MLflow run (one ``Run``) and not sent yet."""

    __slots__ = (
        "end",
        "metrics",
        "owner",
        "params",
        "run_id",
        "run_name",
        "start_ms",
        "steps",
        "tags",
    )

    def __init__(self, run_id: str | None, run_name: str | None) -> None:
        self.run_id = run_id  # MLflow's; None until the run is made
        self.run_name = run_name
        self.owner: str | None = None  # the monitor_bus run id of its run-start event
        self.metrics: deque[Any] = deque()
        self.params: dict[str, Any] = {}
        self.tags: dict[str, Any] = {}
        self.end: tuple[str, int] | None = None
        self.start_ms: int | None = None  # the run-start event's time, for a run made here
        self.steps: dict[str, int] = {}

    def sent(self) -> bool:
        return not (self.metrics or self.params or self.tags or self.end is not None)


def _ms(event: Event) -> int:
    """The event's time in milliseconds since the epoch, as MLflow takes it."""
    return int(epoch_seconds(event) * 1000)


def _valid_name(name: str) -> bool:
    """Whether MLflow takes ``name`` as a metric, param or tag name."""
    if _NAME.fullmatch(name) is None:
        return False
    norm = posixpath.normpath(name)
    return norm == name and norm != "." and not norm.startswith(("..", "/"))
