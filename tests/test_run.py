"""Run lifecycle: the start and end events, and what an interpreter exit records."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import monitor_bus
from monitor_bus import RUN_END_EVENT, RUN_START_EVENT, Run
from monitor_bus._run import flatten_params

from .conftest import Recorder


def _run_events(recorder: Recorder) -> list[monitor_bus.Event]:
    return [e for e in recorder.events if e.name in (RUN_START_EVENT, RUN_END_EVENT)]


def test_start_event_carries_the_convention_keys(
    bus: monitor_bus.EventBus, recorder: Recorder
) -> None:
    """The start event holds id, name, host, pid, rank, versions, config and hparams."""
    bus.register_event_handler(recorder)
    run = Run(
        "exp",
        config={"data": {"path": "x"}},
        hparams={"lr": 0.1, "layers": [1, 2]},
        rank=3,
        bus=bus,
    )
    run.start()
    assert bus.flush(10)
    (start,) = recorder.events
    assert start.name == RUN_START_EVENT
    frameworks = {
        "version.torch",
        "version.lightning",
        "version.pytorch_lightning",
        "version.transformers",
    }
    # Frameworks this process has imported (other tests') name their versions too.
    assert {k: v for k, v in start.data.items() if k not in frameworks} == {
        "run_id": run.run_id,
        "run_name": "exp",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": 3,
        "version.python": sys.version.split()[0],
        "version.monitor_bus": monitor_bus.__version__,
        "config.data.path": "x",
        "hparams.lr": 0.1,
        "hparams.layers": "[1, 2]",
    }
    run.end()


def test_rank_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a rank argument, the RANK environment variable gives the rank."""
    monkeypatch.setenv("RANK", "5")
    assert Run().rank == 5


@pytest.mark.parametrize(
    ("raised", "status", "exception"),
    [
        (None, "success", ""),
        (ValueError, "failed", "builtins.ValueError"),
        (KeyboardInterrupt, "interrupted", "builtins.KeyboardInterrupt"),
    ],
)
def test_context_manager_records_how_the_block_ended(
    bus: monitor_bus.EventBus,
    recorder: Recorder,
    raised: type[BaseException] | None,
    status: str,
    exception: str,
) -> None:
    """Leaving the block records success, failed on an exception, interrupted on Ctrl-C."""
    bus.register_event_handler(recorder)
    run = Run("exp", bus=bus)
    if raised is None:
        with run:
            pass
    else:
        with pytest.raises(raised), run:
            raise raised()
    assert bus.flush(10)
    start, end = _run_events(recorder)
    assert end.name == RUN_END_EVENT
    assert end.data["status"] == status
    assert end.data["exception"] == exception
    assert end.data["run_id"] == start.data["run_id"] == run.run_id
    assert isinstance(end.data["duration_s"], float)
    assert end.data["duration_s"] >= 0
    assert run.status == status


def test_end_is_logged_once(bus: monitor_bus.EventBus, recorder: Recorder) -> None:
    """A second end() does nothing and says so."""
    bus.register_event_handler(recorder)
    run = Run(bus=bus).start()
    assert run.end("failed") is True
    assert run.end("success") is False
    assert bus.flush(10)
    assert [e.data.get("status") for e in recorder.events] == [None, "failed"]


def test_end_without_start_logs_both(bus: monitor_bus.EventBus, recorder: Recorder) -> None:
    """A run ended before it was started still has its start event first."""
    bus.register_event_handler(recorder)
    Run(bus=bus).end("interrupted")
    assert bus.flush(10)
    assert [e.name for e in recorder.events] == [RUN_START_EVENT, RUN_END_EVENT]


def test_end_carries_the_run_s_final_metrics(bus: monitor_bus.EventBus, recorder: Recorder) -> None:
    """Run.metrics, and end(metrics=...) over them, are the end event's metrics.<key>,
    flattened as the hparams are; a run without them has none."""
    bus.register_event_handler(recorder)
    with Run(bus=bus) as run:
        run.metrics.update({"loss": 0.25, "acc": 0.5, "eval": {"top5": 0.9}})
    Run(bus=bus).end(metrics={"loss": 0.5})
    Run(bus=bus).end()
    assert bus.flush(10)
    ends = [e.data for e in recorder.events if e.name == RUN_END_EVENT]
    assert [{k: v for k, v in end.items() if k.startswith("metrics.")} for end in ends] == [
        {"metrics.loss": 0.25, "metrics.acc": 0.5, "metrics.eval.top5": 0.9},
        {"metrics.loss": 0.5},
        {},
    ]
    with pytest.raises(TypeError, match="metrics"):
        Run(bus=bus).end(metrics=[("loss", 1.0)])  # type: ignore[arg-type]


def test_bad_status_names_the_argument() -> None:
    """An unknown status is a ValueError naming status."""
    with pytest.raises(ValueError, match="status must be one of success, failed, interrupted"):
        Run().end("finished")


def test_bad_arguments_name_themselves() -> None:
    """A wrong name or rank type is a TypeError naming the argument."""
    with pytest.raises(TypeError, match="name must be a str"):
        Run(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rank must be an int"):
        Run(rank=True)
    with pytest.raises(TypeError, match="handle_sigterm must be a bool"):
        Run(handle_sigterm=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="params must be a mapping"):
        flatten_params([1])  # type: ignore[arg-type]


@pytest.mark.parametrize("argument", ["config", "hparams", "versions"])
def test_a_mapping_argument_that_is_not_one_names_itself(argument: str) -> None:
    """Run(config=[1]) (or hparams, versions) is a TypeError naming that argument."""
    with pytest.raises(TypeError, match=f"^{argument} must be a mapping"):
        Run(**{argument: [1]})  # type: ignore[arg-type]


def test_flatten_params_joins_nested_keys() -> None:
    """Nested mappings join with '.', plain values stay, others become their str()."""
    assert flatten_params({"a": {"b": {"c": 1}}, "d": None, "e": True}, "p.") == {
        "p.a.b.c": 1,
        "p.d": "None",
        "p.e": True,
    }


_SCRIPT = """
import sys
import monitor_bus as monitor
monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
run = monitor.Run("exp").start()
how = sys.argv[2]
if how == "raise":
    raise ValueError("boom")
if how == "ctrl-c":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize(
    ("how", "status", "exception", "returncode"),
    [
        ("raise", "failed", "builtins.ValueError", 1),
        ("ctrl-c", "interrupted", "builtins.KeyboardInterrupt", -2),
        ("exit", "success", "", 0),
    ],
)
def test_interpreter_exit_records_the_status(
    tmp_path: Path, how: str, status: str, exception: str, returncode: int
) -> None:
    """An uncaught exception or Ctrl-C at exit records failed/interrupted; a clean exit success."""
    out = tmp_path / "run.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(out), how],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == returncode, proc.stderr
    events = list(monitor_bus.read_jsonl(out))
    assert [e.name for e in events] == [RUN_START_EVENT, RUN_END_EVENT]
    assert events[1].data["status"] == status
    assert events[1].data["exception"] == exception


def test_a_real_ctrl_c_records_interrupted(tmp_path: Path) -> None:
    """SIGINT delivered to a training loop with an open run ends it interrupted at exit."""
    out = tmp_path / "run.jsonl"
    script = textwrap.dedent(
        """
        import sys, time
        import monitor_bus as monitor
        monitor.register_event_handler(monitor.JsonlEventHandler(sys.argv[1]))
        monitor.Run("exp").start()
        print("ready", flush=True)
        while True:
            time.sleep(0.01)  # the training loop
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == -signal.SIGINT
    events = list(monitor_bus.read_jsonl(out))
    assert [e.data.get("status") for e in events] == [None, "interrupted"]
