"""MlflowEventHandler against real MLflow stores: a SQLite store, and a real ``mlflow server``
on loopback (behind a proxy that can hold or fail requests) for the HTTP path."""

from __future__ import annotations

import importlib.util
import logging
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import monitor_bus
from monitor_bus import METRICS_EVENT, STAT_EVENT, Run

from .conftest import log_windows, require

# MLflow's SQL store uses SQLAlchemy APIs its newest release deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

ROOT = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _mlflow() -> Any:
    try:
        import mlflow.tracking
    except ImportError:
        require(False, "mlflow is not installed (pip install 'monitor_bus[mlflow]')")
    return mlflow.tracking


def _bench() -> ModuleType:
    """benchmarks/integrations.py, for its proxy and server helpers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_integrations", ROOT / "benchmarks" / "integrations.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    _mlflow()
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store.db'}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _mlflow()
    bench = _bench()
    proc, url = bench.start_mlflow_server(tmp_path_factory.mktemp("server") / "store.db")
    yield url
    bench.stop_server(proc)


def _ms(ts: datetime) -> int:
    return int(ts.timestamp() * 1000)


T1 = T0 + timedelta(seconds=1)


def _train_and_fail(bus: monitor_bus.EventBus, run: Run) -> None:
    with run:
        log = bus.log_event
        log(monitor_bus.Event(STAT_EVENT, T0, {"loss.mean": 0.5, "loss.max": 0.9, "step": 10}))
        log(monitor_bus.Event(STAT_EVENT, T1, {"loss.mean": 0.25, "loss.max": 0.5, "step": 20}))
        log(monitor_bus.Event(METRICS_EVENT, T1, {"acc": 0.75, "step": 20}))
        log(monitor_bus.Event(STAT_EVENT, T0, {"t.mean": 1.0, "phase": "warmup"}))
        log(monitor_bus.Event(STAT_EVENT, T1, {"t.mean": 2.0}))
        raise ValueError("boom")


def test_sqlite_store_gets_metrics_params_tags_and_a_failed_status(
    bus: monitor_bus.EventBus, sqlite_uri: str
) -> None:
    """Windows become metric history at their step and time, the run start params and tags,
    and a run that raised ends FAILED."""
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    handler = MlflowEventHandler(sqlite_uri, experiment_name="failed-run")
    bus.register_event_handler(handler)
    run = Run("exp", hparams={"lr": 0.1}, config={"data": "x"}, rank=0, bus=bus)
    with pytest.raises(ValueError, match="boom"):
        _train_and_fail(bus, run)
    assert bus.flush(60)
    client = _mlflow().MlflowClient(sqlite_uri)
    run = client.get_run(handler.run_id)
    assert run.info.status == "FAILED"
    assert run.info.run_name == "exp"
    assert run.data.params == {"hparams.lr": "0.1", "config.data": "x"}
    assert run.data.tags["rank"] == "0"
    assert run.data.tags["run_name"] == "exp"
    assert run.data.tags["monitor_bus.run_id"] != ""
    assert "run_id" not in run.data.tags  # MLflow's own run id is another thing
    assert run.data.tags["version.monitor_bus"] == monitor_bus.__version__
    history = [
        (m.step, m.value, m.timestamp)
        for m in client.get_metric_history(handler.run_id, "loss.mean")
    ]
    assert history == [(10, 0.5, _ms(T0)), (20, 0.25, _ms(T1))]
    assert [(m.step, m.value) for m in client.get_metric_history(handler.run_id, "acc")] == [
        (20, 0.75)
    ]
    # Without a "step", each key counts its own windows.
    assert [(m.step, m.value) for m in client.get_metric_history(handler.run_id, "t.mean")] == [
        (0, 1.0),
        (1, 2.0),
    ]
    assert handler.skipped_values == 1  # "phase" is a string
    assert handler.written_metrics == 7


def test_http_server_run_ends_finished(bus: monitor_bus.EventBus, server: str) -> None:
    """Over HTTP to a real mlflow server, a run that ends well is FINISHED with its metrics."""
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    handler = MlflowEventHandler(server, experiment_name="http")
    bus.register_event_handler(handler)
    with Run("http-run", hparams={"batch": 8}, bus=bus):
        for step in range(3):
            bus.log_event(
                monitor_bus.Event(METRICS_EVENT, T0, {"loss": 1.0 / (step + 1), "step": step})
            )
    assert bus.flush(60)
    client = _mlflow().MlflowClient(server)
    run = client.get_run(handler.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"hparams.batch": "8"}
    assert [(m.step, m.value) for m in client.get_metric_history(handler.run_id, "loss")] == [
        (0, 1.0),
        (1, 0.5),
        (2, 1.0 / 3),
    ]


def test_down_server_costs_the_loop_nothing_and_is_counted(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the server holds the handler's request, every log_event returns; what overflows is
    counted as dropped, a failed request is counted and its metrics are sent once it is back."""
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    proxy = _bench().SlowProxy(server)
    bus = monitor_bus.EventBus(capacity=10, name="mlflow-down")
    try:
        handler = MlflowEventHandler(proxy.url, experiment_name="down")
        bus.register_event_handler(handler)
        proxy.hold.clear()
        bus.log_event(monitor_bus.Event(METRICS_EVENT, T0, {"x": 0.0, "step": 0}))
        assert proxy.held.wait(30)  # the handler's first request is stuck at the server
        for step in range(1, 101):
            bus.log_event(monitor_bus.Event(METRICS_EVENT, T0, {"x": float(step), "step": step}))
        assert not proxy.hold.is_set()  # all 100 returned while the request was held
        proxy.down.set()
        proxy.hold.set()
        assert bus.flush(60)
        # Each flush while down made one request (no retries here), which failed and counted.
        assert handler.failed_requests == proxy.requests
        assert handler.failed_requests >= 1
        assert handler.run_id is None  # the run could not even be created
        assert handler.pending == bus.stats()["handlers"][0]["delivered"]  # one metric each
        proxy.down.clear()
        bus.log_event(monitor_bus.Event(METRICS_EVENT, T0, {"x": 101.0, "step": 101}))
        assert bus.flush(60)
        (stats,) = bus.stats()["handlers"]
        assert stats["logged"] == 102
        assert stats["dropped"] > 0
        assert stats["delivered"] + stats["dropped"] == 102
        client = _mlflow().MlflowClient(server)
        points = client.get_metric_history(handler.run_id, "x")
        assert len(points) == stats["delivered"] == handler.written_metrics
        assert handler.dropped == 0
        assert handler.pending == 0
    finally:
        proxy.close()
        assert bus.close(30)


def test_a_bad_metric_name_is_skipped_alone(bus: monitor_bus.EventBus, sqlite_uri: str) -> None:
    """A key MLflow refuses as a name is skipped and counted; the rest of its batch is written."""
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    handler = MlflowEventHandler(sqlite_uri, experiment_name="bad-name")
    bus.register_event_handler(handler)
    bus.log_event(
        monitor_bus.Event(METRICS_EVENT, T0, {"ok": 1.0, "bad@name": 2.0, "../up": 3.0, "step": 0})
    )
    assert bus.flush(60)
    client = _mlflow().MlflowClient(sqlite_uri)
    assert client.get_run(handler.run_id).data.metrics == {"ok": 1.0}
    assert handler.skipped_values == 2
    assert handler.dropped == 0


def _only(events: list[monitor_bus.Event], name: str) -> monitor_bus.Event:
    (event,) = [e for e in events if e.name == name]
    return event


def test_the_mlflow_run_spans_the_runs_own_start_and_end(
    bus: monitor_bus.EventBus, sqlite_uri: str
) -> None:
    """The MLflow run made for a Run starts at the Run's start event, not at the first write
    (the store takes a while to open), ends at its end event, and holds monitor_bus's run id
    in the tag ``monitor_bus.run_id``."""
    from monitor_bus.exporters.mlflow import RUN_ID_TAG, MlflowEventHandler

    seen: list[monitor_bus.Event] = []
    handler = MlflowEventHandler(sqlite_uri, experiment_name="span")
    bus.register_event_handler(seen.append, name="seen")
    bus.register_event_handler(handler, name="mlflow")
    with Run("span", bus=bus) as run:
        bus.log_event(monitor_bus.Event(METRICS_EVENT, T0, {"loss": 1.0, "step": 0}))
    assert bus.flush(60)
    start = _only(seen, monitor_bus.RUN_START_EVENT)
    end = _only(seen, monitor_bus.RUN_END_EVENT)
    info = _mlflow().MlflowClient(sqlite_uri).get_run(handler.run_id)
    assert (info.info.start_time, info.info.end_time) == (_ms(start.timestamp), _ms(end.timestamp))
    assert RUN_ID_TAG == "monitor_bus.run_id"
    assert info.data.tags[RUN_ID_TAG] == run.run_id
    assert "run_id" not in info.data.tags


@pytest.fixture(params=["sqlite", "file", "http"])
def store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    sqlite_uri: str,
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    """A tracking store of each kind: SQLite, MLflow's file store, a server over HTTP."""
    if request.param == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # in maintenance, still used
        return str(tmp_path / "mlruns")
    if request.param == "http":
        return str(request.getfixturevalue("server"))
    return sqlite_uri


def test_a_param_mlflow_refuses_to_change_costs_no_metric(
    bus: monitor_bus.EventBus, store: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Resuming a run with a changed hyperparameter: MLflow refuses the changed param, which is
    dropped, counted and named in one warning; every metric, the other params and the tags
    are written, and nothing is retried (the file store answers the refusal as an internal
    error: before, it was retried at every flush, for ever)."""
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    client = _mlflow().MlflowClient(store)
    experiment = client.create_experiment(f"resume-{uuid.uuid4().hex}")
    first = client.create_run(experiment)
    client.log_param(first.info.run_id, "hparams.lr", "0.1")  # the first session's
    client.set_tag(first.info.run_id, "run_id", "old-session")  # as earlier versions wrote it
    handler = MlflowEventHandler(store, run_id=first.info.run_id)
    bus.register_event_handler(handler, name="mlflow")
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        with Run("resumed", hparams={"lr": 0.2, "batch": 8}, bus=bus) as run:
            for step in range(1500):  # past one log_batch of metrics
                bus.log_event(
                    monitor_bus.Event(METRICS_EVENT, T0, {"x": float(step), "step": step})
                )
        assert bus.flush(120)
        bus.log_event(monitor_bus.Event(METRICS_EVENT, T1, {"x": -1.0, "step": 1500}))
        assert bus.flush(120)
    got = client.get_run(first.info.run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(handler.run_id, "x")] == [
        *((step, float(step)) for step in range(1500)),
        (1500, -1.0),
    ]
    assert got.data.params == {"hparams.lr": "0.1", "hparams.batch": "8"}
    assert got.data.tags["monitor_bus.run_id"] == run.run_id
    assert got.data.tags["run_id"] == "old-session"  # the earlier tag is left as it was
    assert got.info.status == "FINISHED"
    assert (handler.dropped, handler.failed_requests, handler.pending) == (1, 0, 0)
    assert handler.written_metrics == 1501
    warnings = [r.getMessage() for r in caplog.records if r.name == "monitor_bus"]
    assert warnings == [
        f"MlflowEventHandler: MLflow refuses to change params already logged to run "
        f"{first.info.run_id} (a resumed run with changed hyperparameters?): hparams.lr "
        "('0.1' logged, '0.2' dropped); the metrics are written (entries dropped so far: 1)"
    ]


def test_bad_arguments_name_themselves() -> None:
    """Wrong argument types and values are errors naming the argument."""
    _mlflow()
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    with pytest.raises(TypeError, match="run_id must be a str"):
        MlflowEventHandler(run_id=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending must be a positive int"):
        MlflowEventHandler(max_pending=0)


def test_percentiles_are_metrics_and_histograms_are_skipped_with_one_warning(
    bus: monitor_bus.EventBus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A window's percentiles and stddev reach a file store as metrics; its Histogram, which
    MLflow cannot hold, is skipped and counted, with one warning for all of them."""
    _mlflow()
    from monitor_bus.exporters.mlflow import MlflowEventHandler

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = str(tmp_path / "mlruns")
    handler = MlflowEventHandler(uri, experiment_name="distributions")
    bus.register_event_handler(handler)
    windows = log_windows(bus, T0)
    client = _mlflow().MlflowClient(uri)
    for key in ("lat.p50", "lat.p99", "lat.stddev"):
        history = client.get_metric_history(handler.run_id, key)
        assert [(m.step, m.value, m.timestamp) for m in history] == [
            (i, w.data[key], _ms(w.timestamp)) for i, w in enumerate(windows)
        ]
    assert "lat.histogram" not in client.get_run(handler.run_id).data.metrics
    assert (handler.skipped_histograms, handler.skipped_values, handler.dropped) == (2, 0, 0)
    assert [r.getMessage() for r in caplog.records if "histogram" in r.getMessage()] == [
        "MlflowEventHandler: Stat value 'lat.histogram' is a histogram, which MLflow cannot "
        "hold: it and every later histogram are skipped, counted in skipped_histograms and not "
        "warned of again (its percentiles and stddev are metrics)"
    ]


def _run_of(client: Any, experiment: str, name: str) -> Any:
    """The one MLflow run named ``name`` in ``experiment``."""
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    (run,) = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return run


def _two_runs(bus: monitor_bus.EventBus, flush_between: bool) -> list[Run]:
    """Two Runs in a row, with other hyperparameters, logging a loss at steps 0 to 2."""
    runs = []
    for name, lr in (("first", 0.1), ("second", 0.2)):
        with Run(name, hparams={"lr": lr}, bus=bus) as run:
            for step in range(3):
                bus.log_event(
                    monitor_bus.Event(METRICS_EVENT, T0, {"loss": lr * step, "step": step})
                )
        runs.append(run)
        if flush_between:
            assert bus.flush(60)
    return runs


@pytest.mark.parametrize("flush_between", [True, False], ids=["flushed", "one-batch"])
def test_each_run_gets_its_own_mlflow_run(
    sqlite_uri: str, caplog: pytest.LogCaptureFixture, flush_between: bool
) -> None:
    """Two Runs in a row on one handler land in two MLflow runs, each with its own params,
    tags, one loss per step and status, with no warning: sent after each Run, or both
    collected before one flush."""
    from monitor_bus.exporters.mlflow import RUN_ID_TAG, MlflowEventHandler

    experiment = f"two-runs-{uuid.uuid4().hex}"
    handler = MlflowEventHandler(sqlite_uri, experiment_name=experiment)
    bus = monitor_bus.EventBus(name="two-runs")
    if flush_between:
        bus.register_event_handler(handler, name="mlflow")
        runs = _two_runs(bus, flush_between=True)
    else:  # the events of both Runs reach the handler before it flushes once
        seen: list[monitor_bus.Event] = []
        bus.register_event_handler(seen.append, name="seen")
        runs = _two_runs(bus, flush_between=False)
        assert bus.flush(60)
        handler.handle_batch(seen)
        handler.flush()
    assert bus.close(60)
    client = _mlflow().MlflowClient(sqlite_uri)
    for run, lr in zip(runs, (0.1, 0.2), strict=True):
        got = _run_of(client, experiment, run.name)
        assert got.data.params == {"hparams.lr": str(lr)}
        assert got.data.tags[RUN_ID_TAG] == run.run_id
        assert got.info.status == "FINISHED"
        history = client.get_metric_history(got.info.run_id, "loss")
        assert [(m.step, m.value) for m in history] == [(s, lr * s) for s in range(3)]
    assert handler.run_id == _run_of(client, experiment, "second").info.run_id
    assert (handler.written_metrics, handler.dropped, handler.pending) == (6, 0, 0)
    assert [r.getMessage() for r in caplog.records if r.name == "monitor_bus"] == []
