"""The monitor-bus command line: demo, summary, plot, and their error paths."""

from __future__ import annotations

import codecs
import importlib
import io
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import weakref
from array import array
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import monitor_bus
from monitor_bus import METRICS_EVENT, STAT_EVENT, Event, JsonlEventHandler, read_jsonl
from monitor_bus.__main__ import main
from monitor_bus._cli import _ProgressBar
from monitor_bus._cli_plot import _draw_series, _figure, _log_label
from monitor_bus._cli_read import _partial_last
from monitor_bus._cli_summary import _summarize
from monitor_bus._demo import run_demo

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, events: list[Event]) -> Path:
    with JsonlEventHandler(path) as handler:
        for event in events:
            handler(event)
    return path


def stat_run(path: Path) -> Path:
    """Two Stats over three windows, and one other event."""
    events = [Event("train.epoch", T0, {"loss": 0.5})]
    for i, (mean, top, n) in enumerate([(2.0, 5.0, 10), (1.5, 9.0, 12), (1.75, 4.0, 7)]):
        ts = T0 + timedelta(seconds=i + 1)
        events.append(Event(STAT_EVENT, ts, {"lat.mean": mean, "lat.max": top, "lat.count": n}))
        events.append(Event(STAT_EVENT, ts, {"loss.value": 1.0 / (i + 1)}))
    return write_run(path, events)


def summary_of(run: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``monitor-bus summary RUN`` printed on stdout (it exits 0)."""
    assert main(["summary", str(run)]) == 0
    return capsys.readouterr().out


def one_error_line(err: str) -> str:
    """The single line a failing command printed on stderr."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("monitor-bus: error: ")
    return lines[0].removeprefix("monitor-bus: error: ")


# -- demo --


def test_demo_prints_summary_and_tensorboard_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """demo runs, shows progress on stderr, then the table and the exact TensorBoard command."""
    log_dir = tmp_path / "my run"
    assert main(["demo", "--steps", "40", "--logdir", str(log_dir), "--seed", "2"]) == 0
    out, err = capsys.readouterr()
    written = len(read_jsonl(log_dir / "events.jsonl"))
    lines = out.splitlines()
    assert lines[0].startswith("Trained 40 steps (2 epochs) in ")
    # The table's columns are as wide as its longest name: compare the words of each row.
    rows = [" ".join(line.split()) for line in lines]
    assert "demo.epoch 2" in rows
    assert f"written to events.jsonl {written}" in rows
    assert "dropped 0" in rows
    assert "undelivered to handlers 0" in rows
    assert "handler errors 0" in rows
    assert any(
        row.startswith("delivery latency p50 ") and f"({written} events)" in row for row in rows
    )
    assert f"  tensorboard --logdir {shlex.quote(str(log_dir))}" in lines
    assert f"  monitor-bus summary {shlex.quote(str(log_dir / 'events.jsonl'))}" in lines
    # The seeded run is repeatable: the same 40 steps, run again, give the last loss shown.
    losses: list[float] = []
    run_demo(
        40, tmp_path / "again", tensorboard=False, seed=2, progress=lambda *p: losses.append(p[2])
    )
    assert err.splitlines()[-1] == f"[{'#' * 30}] 40/40 steps  loss {losses[-1]:.4f}"
    assert any(p.name.startswith("events.out.tfevents.") for p in (log_dir / "demo").iterdir())


class FakeStream(io.StringIO):
    """A stream that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_off_a_terminal_writes_a_line_per_tenth() -> None:
    """Off a terminal the bar writes one line each time a tenth is reached, and the loss once known."""
    stream = FakeStream(tty=False)
    bar = _ProgressBar(stream, width=10)
    for done in range(0, 21):
        bar(done, 20, math.nan if done == 0 else 1.0 / done)
    bar.end()
    assert stream.getvalue().splitlines() == [
        "[----------] 0/20 steps",
        *[
            f"[{'#' * t}{'-' * (10 - t)}] {2 * t}/20 steps  loss {1 / (2 * t):.4f}"
            for t in range(1, 11)
        ],
    ]


def test_progress_bar_on_a_terminal_redraws_in_place() -> None:
    """On a terminal each call redraws the line after a carriage return, and end() closes it."""
    stream = FakeStream(tty=True)
    bar = _ProgressBar(stream, width=4)
    bar(1, 4, 0.5)
    bar(1, 4, 0.25)
    bar.end()
    assert stream.getvalue() == "\r[#---] 1/4 steps  loss 0.5000\r[#---] 1/4 steps  loss 0.2500\n"


def test_demo_no_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--no-tensorboard writes only events.jsonl and prints no TensorBoard command."""
    assert main(["demo", "--steps", "20", "--logdir", str(tmp_path), "--no-tensorboard"]) == 0
    out, _ = capsys.readouterr()
    assert "tensorboard --logdir" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]


def test_demo_help_explains_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    """demo --help exits 0 and describes --steps, --logdir, --no-tensorboard and --seed."""
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--steps N", "--logdir DIR", "--no-tensorboard", "--seed S"):
        assert option in out
    assert "default: 3000" in out


def test_demo_help_gives_the_demos_window(capsys: pytest.CaptureFixture[str]) -> None:
    """demo --help names the Stat window the demo uses (a quarter second, not one)."""
    from monitor_bus._demo import WINDOW

    assert main(["demo", "--help"]) == 0
    words = " ".join(capsys.readouterr().out.split())
    assert timedelta(seconds=0.25) == WINDOW
    assert "Stats with quarter-second windows" in words


def test_console_script_points_at_main(capsys: pytest.CaptureFixture[str]) -> None:
    """pyproject's monitor-bus script is monitor_bus.__main__:main, which runs the CLI."""
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    match = re.search(r'^monitor-bus = "([\w.]+):(\w+)"$', pyproject, flags=re.M)
    assert match is not None
    target = getattr(importlib.import_module(match[1]), match[2])
    assert target is main
    assert target(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: monitor-bus [-h] [--version] COMMAND ...")
    commands = [line.split()[0] for line in out.splitlines() if re.match(r"^    \w", line)]
    assert commands == ["demo", "summary", "plot"]


def test_python_dash_m_runs_the_demo(tmp_path: Path) -> None:
    """`python -m monitor_bus demo` works as a program (exit 0, JSONL written)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitor_bus",
            "demo",
            "--steps",
            "20",
            "--logdir",
            str(tmp_path),
            "--no-tensorboard",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Trained 20 steps (1 epochs)" in proc.stdout
    assert len(read_jsonl(tmp_path / "events.jsonl")) > 1


def test_ctrl_c_in_the_demo_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT during `monitor-bus demo` prints one 'interrupted' line and exits 130, on every Python."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitor_bus", "demo", "--steps", "1000000"]
        + ["--logdir", str(tmp_path), "--no-tensorboard"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        # The first progress line is drawn from inside the event loop: training has begun.
        assert proc.stderr.readline() == f"[{'-' * 30}] 0/1000000 steps\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (130, "", "monitor-bus: error: interrupted\n")
    assert (tmp_path / "events.jsonl").is_file()


def test_demo_log_dir_that_cannot_be_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log dir under a regular file: one error line naming it, exit 1, the file untouched."""
    blocker = tmp_path / "file"
    blocker.write_text("keep")
    assert main(["demo", "--steps", "5", "--logdir", str(blocker / "run")]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"cannot create log directory: Not a directory: {blocker / 'run'}"
    )
    assert blocker.read_text() == "keep"


def test_demo_jsonl_path_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """If LOGDIR/events.jsonl is a directory: one error line, exit 1, nothing written."""
    (tmp_path / "events.jsonl").mkdir()
    assert main(["demo", "--steps", "5", "--logdir", str(tmp_path)]) == 1
    assert one_error_line(capsys.readouterr().err) == f"Is a directory: {tmp_path / 'events.jsonl'}"
    assert [p.name for p in tmp_path.iterdir()] == ["events.jsonl"]


def hide_modules(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` (and our modules importing it) fail to import, as if not installed."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(sys.modules, "monitor_bus.tensorboard", raising=False)


def test_demo_without_the_tensorboard_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without tensorboard, demo fails in one line naming the extra and --no-tensorboard, before writing anything."""
    hide_modules(monkeypatch, "tensorboard")
    assert main(["demo", "--steps", "5", "--logdir", str(tmp_path / "run")]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        "the demo needs tensorboard: pip install 'monitor_bus[demo]' (or run with --no-tensorboard)"
    )
    assert list(tmp_path.iterdir()) == []
    assert (
        main(["demo", "--steps", "5", "--logdir", str(tmp_path / "run"), "--no-tensorboard"]) == 0
    )


def test_plot_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without matplotlib, plot fails in one line naming the extra."""
    run = stat_run(tmp_path / "run.jsonl")
    hide_modules(monkeypatch, "matplotlib")
    assert main(["plot", str(run)]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        "plot needs matplotlib: pip install 'monitor_bus[plot]'"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["run.jsonl"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the package's version and exits 0."""
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"monitor-bus {monitor_bus.__version__}\n"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad option value or no command is a usage error (exit 2), not a traceback."""
    assert main(["demo", "--steps", "0"]) == 2
    assert "argument --steps: must be at least 1, got 0" in capsys.readouterr().err
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err


# -- summary --


def test_summary_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """summary prints events per name and, per Stat key, windows and last/min/max."""
    run = stat_run(tmp_path / "run.jsonl")
    assert main(["summary", str(run)]) == 0
    assert capsys.readouterr().out == (
        f"{run}: 7 events, 2026-03-01T12:00:00+00:00 to 2026-03-01T12:00:03+00:00\n"
        "  torch.monitor.Stat           6\n"
        "  train.epoch                  1\n"
        "\n"
        "stat  aggregate  windows      last       min  max\n"
        "lat   count            3         7         7   12\n"
        "lat   max              3         4         4    9\n"
        "lat   mean             3      1.75       1.5    2\n"
        "loss  value            3  0.333333  0.333333    1\n"
    )


def test_summary_lists_runs_with_their_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """summary lists each run by name with its status, duration and exception; a run that
    started and never ended is named as such."""
    run = tmp_path / "run.jsonl"
    ts = '"timestamp":"2026-03-01T12:00:00+00:00"'
    start = '"name":"monitor_bus.run.start"'
    end = '"name":"monitor_bus.run.end"'
    lines = [
        f'{{{start},{ts},"data":{{"run_id":"a1","run_name":"first"}}}}',
        f'{{{end},{ts},"data":{{"run_id":"a1","status":"failed","duration_s":12.34,'
        '"exception":"builtins.ValueError"}}',
        f'{{{start},{ts},"data":{{"run_id":"b2","run_name":"second"}}}}',
    ]
    run.write_text("\n".join(lines) + "\n")
    assert main(["summary", str(run)]) == 0
    assert capsys.readouterr().out.split("\n\n")[1] == (
        "runs\n  first   failed            12.3 s  builtins.ValueError\n  second  no end (killed?)"
    )


def test_summary_by_origin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """summary --by-origin counts the events per process and name: this process first, then
    each child by pid and DataLoader worker."""
    run = tmp_path / "run.jsonl"
    ts = '"timestamp":"2026-03-01T12:00:00+00:00"'
    lines = [
        f'{{"name":"train.step",{ts},"data":{{}}}}',
        f'{{"name":"load",{ts},"data":{{}},"origin":{{"pid":12,"worker":1}}}}',
        f'{{"name":"load",{ts},"data":{{}},"origin":{{"pid":12,"worker":1}}}}',
        f'{{"name":"load",{ts},"data":{{}},"origin":{{"pid":7,"worker":0}}}}',
        f'{{"name":"task",{ts},"data":{{}},"origin":{{"pid":300,"worker":null}}}}',
    ]
    run.write_text("\n".join(lines) + "\n")
    assert main(["summary", "--by-origin", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.split("\n\n")[1] == (
        "events by origin\n"
        "  this process       train.step  1\n"
        "  pid 7 (worker 0)   load        1\n"
        "  pid 12 (worker 1)  load        2\n"
        "  pid 300            task        1"
    )


def test_summary_warns_about_a_torn_line_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn last line gives a warning line on stderr; the rest is summarized, exit 0."""
    run = stat_run(tmp_path / "run.jsonl")
    with run.open("ab") as f:
        f.write(b'{"name": "torch.monitor.St')
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert (
        err
        == f"monitor-bus: warning: {run}, line 8: skipped a line that is not valid JSON (a write cut short by a crash or a full disk?)\n"
    )
    assert out.startswith(f"{run}: 7 events")


def test_summary_reports_many_skipped_lines_in_a_few(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past five skipped lines, summary gives one total instead of a warning per line."""
    run = stat_run(tmp_path / "run.jsonl")
    with run.open("ab") as f:
        f.write(b"{\n" * 100)
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    torn = "skipped a line that is not valid JSON (a write cut short by a crash or a full disk?)"
    assert err.splitlines() == [
        *[f"monitor-bus: warning: {run}, line {n}: {torn}" for n in range(8, 13)],
        f"monitor-bus: warning: {run}: 95 more skipped (100 lines, 0 values in all)",
    ]
    assert out.startswith(f"{run}: 7 events")


def test_summary_and_plot_skip_a_stat_value_beyond_float(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Stat value of 10**400 (the handler writes it) is skipped and counted; the rest is summarized and plotted."""
    run = write_run(
        tmp_path / "run.jsonl",
        [
            Event(STAT_EVENT, T0, {"x.sum": 10**400, "x.mean": 1.0}),
            Event(STAT_EVENT, T0 + timedelta(seconds=1), {"x.sum": 3, "x.mean": 2.0}),
            Event("plain", T0, {"n": 10**400}),
        ],
    )
    warning = "monitor-bus: warning: skipped 1 value too large for a float: x.sum (1)\n"
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == warning
    assert out.endswith(
        "stat  aggregate  windows  last  min  max\n"
        "x     mean             2     2    1    2\n"
        "x     sum              1     3    3    3\n"
    )
    assert "  plain                        1\n" in out
    assert main(["plot", str(run), "-o", str(tmp_path / "p.png")]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"wrote {tmp_path / 'p.png'} (2 panels, 2 series)\n", warning)


def test_summary_counts_stat_values_that_are_not_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A string or bool under a Stat event's key is not a Stat value: skipped and counted by key."""
    run = write_run(
        tmp_path / "run.jsonl",
        [Event(STAT_EVENT, T0, {"a.value": "n/a", "b.value": True, "c.value": 1.0})],
    )
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == (
        "monitor-bus: warning: skipped 2 Stat values that are not numbers: a.value (1), b.value (1)\n"
    )
    assert out.endswith("c     value            1     1    1    1\n")


def _command(command: str, run: Path) -> list[str]:
    return [command, str(run)] if command == "summary" else [command, str(run), "-o", f"{run}.png"]


@pytest.mark.parametrize("command", ["summary", "plot"])
@pytest.mark.parametrize("opening", ['{"a":', "["])
def test_deeply_nested_line_is_skipped_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, opening: str
) -> None:
    """A line nested 100,000 deep is skipped with a warning naming file and line; the run is
    read on (no RecursionError, no traceback)."""
    run = stat_run(tmp_path / "run.jsonl")
    with run.open("a") as f:
        f.write(opening * 100_000 + "\n")
    assert main(_command(command, run)) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"monitor-bus: warning: {run}, line 8: skipped a line that is not an event (JSON nested "
        "deeper than an event can be; not a monitor_bus JSONL file?)\n"
    )
    assert out.startswith(f"{run}: 7 events" if command == "summary" else f"wrote {run}.png")


ODD_LINES = [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"x": 1}', "'name' must be a string"),
    ('"text"', "expected a JSON object, got str"),
    (
        '{"name": "a", "timestamp": "2026-03-01T12:00:09+00:00", "data": {"x": [1]}}',
        "data['x'] is not a value: [1]",
    ),
    ('{"name": "a", "timestamp": 7, "data": {}}', "'timestamp' must be a string"),
]


@pytest.mark.parametrize("command", ["summary", "plot"])
def test_lines_of_json_that_are_not_events_are_skipped_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Lines that are JSON but not events (an array, an object without a name, a string, an
    event with a field of the wrong type) are each skipped with a warning naming the file, the
    line and why; the events around and after them are read, exit 0."""
    run = stat_run(tmp_path / "run.jsonl")
    later = Event(STAT_EVENT, T0 + timedelta(seconds=9), {"lat.mean": 3.0})
    with run.open("a") as f:
        f.writelines(line + "\n" for line, _ in ODD_LINES)
    write_run(tmp_path / "later.jsonl", [later])
    with run.open("ab") as f:
        f.write((tmp_path / "later.jsonl").read_bytes())
    assert main(_command(command, run)) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"monitor-bus: warning: {run}, line {8 + i}: skipped a line that is not an event ({why})"
        for i, (_, why) in enumerate(ODD_LINES)
    ]
    if command == "plot":
        assert out == f"wrote {run}.png (3 panels, 4 series)\n"
        assert Path(f"{run}.png").read_bytes().startswith(PNG_MAGIC)
        return
    assert out.splitlines()[:3] == [
        f"{run}: 8 events, 2026-03-01T12:00:00+00:00 to 2026-03-01T12:00:09+00:00",
        "  torch.monitor.Stat           7",
        "  train.epoch                  1",
    ]
    assert "lat   mean             4         3       1.5    3" in out.splitlines()


def test_a_file_of_json_that_holds_no_event_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file whose every line is JSON but none an event is not a run: its lines are named,
    then one error line, exit 1."""
    run = tmp_path / "data.jsonl"
    run.write_text('{"x": 1}\n[2]\n')
    assert main(["summary", str(run)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"monitor-bus: error: {run}: no line is a valid JSON event; not a monitor_bus JSONL file?"
    ]


def test_summary_skips_an_int_too_long_to_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An int over the digit limit is one warning naming line and key; its event still counts."""
    limit = sys.get_int_max_str_digits()
    run = stat_run(tmp_path / "run.jsonl")
    with run.open("a") as f:
        f.write('{"name":"big","timestamp":"2026-03-01T12:00:00+00:00","data":{"n":')
        f.write("1" * (limit + 1) + "}}\n")
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"monitor-bus: warning: {run}, line 8: data['n']: skipped an int of {limit + 1} digits, "
        f"more than sys.get_int_max_str_digits() ({limit}) lets Python read\n"
    )
    assert out.startswith(f"{run}: 8 events")
    assert "  big                          1\n" in out


def test_summary_reads_past_a_bom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file saved with a UTF-8 BOM is summarized whole, with no warning."""
    run = stat_run(tmp_path / "run.jsonl")
    run.write_bytes(codecs.BOM_UTF8 + run.read_bytes())
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert (err, out.splitlines()[0]) == (
        "",
        f"{run}: 7 events, 2026-03-01T12:00:00+00:00 to 2026-03-01T12:00:03+00:00",
    )


class TrackedEvent(Event):
    """An event that can be watched for being freed."""

    __slots__ = ("__weakref__",)


def test_summary_keeps_no_events() -> None:
    """summary folds events one at a time: by the last event, the ones before it are freed."""
    alive: list[weakref.ref[TrackedEvent]] = []

    def events() -> Iterator[Event]:
        for i in range(1000):
            event = TrackedEvent(STAT_EVENT, T0 + timedelta(seconds=i), {"x.mean": float(i)})
            alive.append(weakref.ref(event))
            yield event
            del event

    summary = _summarize(events())
    assert [ref() for ref in alive] == [None] * 1000
    assert (summary.events, summary.names, summary.first, summary.last) == (
        1000,
        {STAT_EVENT: 1000},
        T0,
        T0 + timedelta(seconds=999),
    )
    column = summary.stats["x.mean"]
    assert (column.windows, column.last, column.low, column.high) == (1000, 999.0, 0.0, 999.0)


def test_summary_without_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run without Stat events is summarized by name, with 'no Stat events'."""
    run = write_run(tmp_path / "run.jsonl", [Event("a", T0, {"x": 1})])
    assert main(["summary", str(run)]) == 0
    assert capsys.readouterr().out.endswith("\n  a           1\n\nno Stat events\n")


@pytest.mark.parametrize("command", ["summary", "plot"])
def test_reading_bad_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A directory, a missing file and a non-JSONL file each give one error line and exit 1."""
    missing = tmp_path / "missing.jsonl"
    assert (
        main(
            [command, str(tmp_path), "-o", str(tmp_path / "p.png")]
            if command == "plot"
            else [command, str(tmp_path)]
        )
        == 1
    )
    assert one_error_line(capsys.readouterr().err) == f"Is a directory: {tmp_path}"
    assert main([command, str(missing)]) == 1
    assert one_error_line(capsys.readouterr().err) == f"No such file or directory: {missing}"
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main([command, str(binary)]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"{binary}: no line is a valid JSON event; not a monitor_bus JSONL file?"
    )
    assert binary.read_bytes() == bytes(range(256)) * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


# -- plot --


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """plot draws one panel per Stat (counts apart) into a PNG, with the usual permissions."""
    from matplotlib.image import imread

    run = stat_run(tmp_path / "run.jsonl")
    out = tmp_path / "plot.png"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (3 panels, 4 series)\n"
    assert out.read_bytes().startswith(PNG_MAGIC)
    height, width, _ = imread(out).shape
    assert (width, height) == (800, int(100 * (2.2 * 3 + 0.6)))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_plot_default_output_is_beside_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without -o, the picture is RUN.png next to RUN.jsonl."""
    run = stat_run(tmp_path / "run.jsonl")
    assert main(["plot", str(run)]) == 0
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'run.png'} ")


def test_plot_without_stats_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run with no Stat or metrics events: one error line, exit 1, no picture written."""
    run = write_run(tmp_path / "run.jsonl", [Event("a", T0, {"x": 1.0})])
    assert main(["plot", str(run), "-o", str(tmp_path / "p.png")]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"no Stat or metrics events in {run}: nothing to plot"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl"]


def test_plot_output_errors_leave_files_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output that is a directory, in a missing directory, or of an unknown format fails; an old picture survives."""
    run = stat_run(tmp_path / "run.jsonl")
    (tmp_path / "dir").mkdir()
    assert main(["plot", str(run), "-o", str(tmp_path / "dir")]) == 1
    assert one_error_line(capsys.readouterr().err) == f"output is a directory: {tmp_path / 'dir'}"
    assert main(["plot", str(run), "-o", str(tmp_path / "nowhere" / "p.png")]) == 1
    assert (
        one_error_line(capsys.readouterr().err)
        == f"output directory does not exist: {tmp_path / 'nowhere'}"
    )
    old = tmp_path / "old.xyz"
    old.write_bytes(b"previous picture")
    assert main(["plot", str(run), "-o", str(old)]) == 1
    assert "xyz" in one_error_line(capsys.readouterr().err)
    assert old.read_bytes() == b"previous picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "old.xyz", "run.jsonl"]


def many_stats_run(path: Path, n: int) -> Path:
    """n Stats (s00, s01, ...) of a mean and a count each, over two windows."""
    events = [
        Event(
            STAT_EVENT, T0 + timedelta(seconds=w), {f"s{i:02d}.mean": 1.0 + w, f"s{i:02d}.count": 5}
        )
        for w in range(2)
        for i in range(n)
    ]
    return write_run(path, events)


def test_plot_draws_the_first_panels_and_says_how_to_choose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past --max-panels (default 12) plot draws the first panels by name and says so on stderr."""
    run = many_stats_run(tmp_path / "run.jsonl", 40)
    out_png = tmp_path / "p.png"
    assert main(["plot", str(run), "-o", str(out_png)]) == 0
    out, err = capsys.readouterr()
    assert out == f"wrote {out_png} (12 panels, 12 series)\n"
    assert err == (
        "monitor-bus: note: drew the first 12 of 80 panels, by name; choose with "
        "--stat PATTERN or --max-panels N\n"
    )
    assert main(["plot", str(run), "-o", str(out_png), "--max-panels", "3"]) == 0
    assert capsys.readouterr().out == f"wrote {out_png} (3 panels, 3 series)\n"


def test_plot_stat_patterns_choose_the_panels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stat takes glob patterns on Stat names, repeatable; panels beyond the limit are not drawn."""
    from matplotlib.image import imread

    run = many_stats_run(tmp_path / "run.jsonl", 40)
    out_png = tmp_path / "p.png"
    assert main(["plot", str(run), "-o", str(out_png), "--stat", "s0[12]", "--stat", "s39"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"wrote {out_png} (6 panels, 6 series)\n", "")
    assert imread(out_png).shape[0] == int(100 * (2.2 * 6 + 0.6))


def test_plot_stat_pattern_matching_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --stat that matches no Stat or metric is one error line listing the run's, nothing
    written."""
    run = stat_run(tmp_path / "run.jsonl")
    assert main(["plot", str(run), "-o", str(tmp_path / "p.png"), "--stat", "nope*"]) == 1
    assert one_error_line(capsys.readouterr().err) == (
        f"no Stat or metric in {run} matches --stat nope*; its Stats and metrics: lat, loss"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl"]


def test_log_axis_labels_one_two_five() -> None:
    """A log axis labels 1, 2 and 5 times powers of ten and leaves other ticks bare."""
    labels = [_log_label(v, None) for v in (0.01, 0.02, 0.03, 0.05, 0.5, 1.0, 7.0, 20.0, 0.0)]
    assert labels == ["0.01", "0.02", "", "0.05", "0.5", "1", "", "20", ""]


def test_partial_last_window_is_told_by_its_short_gap() -> None:
    """The last window is partial when it came sooner after the one before than the usual gap."""
    assert _partial_last([0.0, 1.0, 2.0, 3.0, 3.25]) == 0.25
    assert _partial_last([0.0, 1.0, 3.0, 4.0, 4.5]) == 0.5  # a skipped empty window is no gap
    assert _partial_last([0.0, 1.0, 2.0, 3.0, 3.95]) is None  # timer jitter
    assert _partial_last([0.0, 1.0, 2.0, 5.0]) is None  # a longer gap marks nothing
    assert _partial_last([0.0, 0.3]) is None  # nothing to compare with


def test_plot_marks_a_partial_last_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose last window is cut short is drawn with it marked, and stderr says which Stats."""
    events = [
        Event(
            STAT_EVENT,
            T0 + timedelta(seconds=s),
            {"lat.mean": 2.0, "lat.max": 20.0 if s > 3 else 5.0},
        )
        for s in (1.0, 2.0, 3.0, 3.2)
    ]
    events += [Event(STAT_EVENT, T0 + timedelta(seconds=s), {"loss.value": 1.0}) for s in (1, 2, 3)]
    run = write_run(tmp_path / "run.jsonl", events)
    out = tmp_path / "p.png"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    assert capsys.readouterr() == (
        f"wrote {out} (2 panels, 3 series)\n",
        "monitor-bus: note: the last window of lat is partial (the run ended before it was "
        "over): drawn hollow, labelled 'partial'\n",
    )


def test_summary_leaves_a_partial_last_window_out_of_last_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Stat whose last window was cut short by the run's end shows its last whole window as
    "last" (the partial one still counts in windows, min and max), and a line says so."""
    events = [
        Event(STAT_EVENT, T0 + timedelta(seconds=s), {"lat.max": v})
        for s, v in ((1.0, 5.0), (2.0, 6.0), (3.0, 4.0), (3.2, 40.0))
    ]
    events += [Event(STAT_EVENT, T0 + timedelta(seconds=s), {"loss.value": 1.0}) for s in (1, 2, 3)]
    out = summary_of(write_run(tmp_path / "run.jsonl", events), capsys)
    assert out.endswith(
        "stat  aggregate  windows  last  min  max\n"
        "lat   max              4     4    4   40\n"
        "loss  value            3     1    1    1\n"
        "last: the last whole window; that of lat was partial (the run ended during it): "
        "counted in windows, min and max\n"
    )


def test_a_partial_last_window_is_drawn_hollow_and_labelled() -> None:
    """The partial window's point is hollow on a dashed segment with a 'partial' label; a whole series is one line."""
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    _draw_series(ax, [0.0, 1.0, 2.0, 2.3], [1.0, 2.0, 3.0, 9.0], "mean", partial=True)
    whole, cut = ax.get_lines()
    assert list(whole.get_xdata()) == [0.0, 1.0, 2.0]
    assert (list(cut.get_xdata()), cut.get_linestyle(), cut.get_markerfacecolor()) == (
        [2.0, 2.3],
        "--",
        "none",
    )
    assert cut.get_markevery() == [1]
    assert [t.get_text() for t in ax.texts] == ["partial"]
    assert [t.get_text() for t in ax.legend().get_texts()] == ["mean"]
    _draw_series(ax, [0.0, 1.0, 2.0, 2.3], [0.5, 1.0, 1.5, 2.0], "min", partial=True)
    assert [t.get_text() for t in ax.texts] == ["partial"]  # once a panel

    ax = Figure().subplots()
    _draw_series(ax, [0.0, 1.0], [1.0, 2.0], "mean", partial=False)
    assert len(ax.get_lines()) == 1
    assert len(ax.texts) == 0


# -- percentiles and metrics --


def percentile_run(path: Path) -> Path:
    """A Stat with mean, p50 and p99 over three windows."""
    windows = [(2.0, 1.5, 9.0), (2.5, 2.0, 12.0), (1.5, 1.0, 4.0)]
    events = [
        Event(
            STAT_EVENT,
            T0 + timedelta(seconds=i + 1),
            {"lat.mean": mean, "lat.p50": p50, "lat.p99": p99},
        )
        for i, (mean, p50, p99) in enumerate(windows)
    ]
    return write_run(path, events)


def test_summary_shows_a_stats_p50_and_p99(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Stat window's p50 and p99 are rows of the Stat table, beside its mean."""
    out = summary_of(percentile_run(tmp_path / "run.jsonl"), capsys)
    assert out.endswith(
        "stat  aggregate  windows  last  min  max\n"
        "lat   mean             3   1.5  1.5  2.5\n"
        "lat   p50              3     1    1    2\n"
        "lat   p99              3     4    4   12\n"
    )


def test_plot_shades_the_p50_to_p99_band(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Stat with p50 and p99 is one panel: its mean as a line and the band between its p50 and
    p99 shaded, the band's edges at the windows' p50 and p99."""
    from matplotlib.collections import PolyCollection

    run = percentile_run(tmp_path / "run.jsonl")
    out = tmp_path / "p.png"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (1 panels, 3 series)\n"
    events = read_jsonl(run)
    stamps = array_of([e.timestamp.timestamp() for e in events])
    series = {
        key: (stamps, array_of([float(e.data[key]) for e in events]))  # type: ignore[arg-type]
        for key in ("lat.mean", "lat.p50", "lat.p99")
    }
    figure, partial = _figure(series, {"lat": sorted(series)}, {}, [])
    assert partial == []
    (ax,) = figure.axes
    assert [line.get_label() for line in ax.get_lines()] == ["mean"]
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert band.get_label() == "p50-p99"
    ys = {round(float(y), 9) for y in band.get_paths()[0].vertices[:, 1]}
    assert {1.5, 2.0, 1.0, 9.0, 12.0, 4.0} <= ys
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mean", "p50-p99"]


def array_of(values: list[float]) -> array[float]:
    return array("d", values)


def test_summary_and_plot_read_metrics_events_over_their_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Metrics events (as the integrations log them) are summarised per metric with their last
    step, and plotted one panel per metric over the step; step and epoch are not metrics,
    strings are left out, an event without a step is placed by its order."""
    events = [
        Event(METRICS_EVENT, T0, {"loss": 2.0, "epoch": 0, "step": 10, "note": "warm-up"}),
        Event(METRICS_EVENT, T0, {"loss": 1.0, "lr": 0.1, "epoch": 0, "step": 20}),
        Event(METRICS_EVENT, T0, {"loss": 0.5}),
    ]
    run = write_run(tmp_path / "run.jsonl", events)
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.endswith(
        "metric  points  last step  last  min  max\n"
        "loss         3          3   0.5  0.5    2\n"
        "lr           1         20   0.1  0.1  0.1\n"
    )
    png = tmp_path / "p.png"
    assert main(["plot", str(run), "-o", str(png)]) == 0
    assert capsys.readouterr() == (f"wrote {png} (2 panels, 2 series)\n", "")
    metrics = {
        "loss": (array_of([10.0, 20.0, 3.0]), array_of([2.0, 1.0, 0.5])),
        "lr": (array_of([20.0]), array_of([0.1])),
    }
    figure, _ = _figure({}, {}, metrics, ["loss", "lr"])
    loss, lr = figure.axes
    (line,) = loss.get_lines()
    assert (list(line.get_xdata()), list(line.get_ydata())) == ([10.0, 20.0, 3.0], [2.0, 1.0, 0.5])
    assert loss.get_title(loc="left") == "loss (metrics)"
    assert lr.get_xlabel() == "step"


def test_summary_leaves_a_windows_histogram_out_without_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real Stat window with HISTOGRAM: the Histogram is not a number to summarise and is
    left out silently; its percentiles are rows of their own."""
    run = tmp_path / "run.jsonl"
    A = monitor_bus.Aggregation
    with JsonlEventHandler(run) as sink, monitor_bus.EventBus(name="cli") as bus:
        bus.register_event_handler(sink)
        lat = monitor_bus.Stat("lat", [A.P50, A.HISTOGRAM], timedelta(days=3650), bus=bus)
        for i in range(1, 101):
            lat.add(float(i))
    (window,) = read_jsonl(run)
    assert isinstance(window.data["lat.histogram"], monitor_bus.Histogram)
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = [line.split() for line in out.splitlines()]
    assert ["lat", "p50", "1"] in [row[:3] for row in rows]
    assert not any(row[:2] == ["lat", "histogram"] for row in rows)


# -- pipes, numbers beyond a float, long lines --


def test_summary_into_a_pipe_closed_early_exits_quietly(tmp_path: Path) -> None:
    """`monitor-bus summary RUN | head -2`: once the reader has gone the command stops without
    a word on stderr (no traceback, no "Broken pipe") and exits 141, as a command killed by
    SIGPIPE does in a shell."""
    names = [f"event.{i:05d}.{'x' * 40}" for i in range(3000)]  # ~170 KB, past a pipe's buffer
    run = write_run(tmp_path / "run.jsonl", [Event(name, T0, {}) for name in names])
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitor_bus", "summary", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert (
            proc.stdout.readline()
            == f"{run}: 3000 events, 2026-03-01T12:00:00+00:00 to 2026-03-01T12:00:00+00:00\n".encode()
        )
        assert proc.stdout.readline() == f"  {names[0]}           1\n".encode()
        proc.stdout.close()  # what head does after its two lines
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 141
    finally:
        proc.kill()
        proc.stderr.close()
    assert err == b""


def test_summary_reports_a_number_beyond_a_float_and_does_not_count_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A number JSON holds but a float cannot (1e999, which Python reads as infinity) is
    skipped with a warning naming file, line and key and not counted as a window, the rest of
    its event kept, while the Infinity Python's json writes stays infinity."""
    run = stat_run(tmp_path / "run.jsonl")
    ts = '"timestamp":"2026-03-01T12:00:04+00:00"'
    with run.open("a") as f:
        f.write(f'{{"name":"{STAT_EVENT}",{ts},"data":{{"lat.mean":1e999,"lat.max":-2E+999}}}}\n')
        f.write(f'{{"name":"{STAT_EVENT}",{ts},"data":{{"loss.value":Infinity}}}}\n')
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    beyond = "a number beyond a float's range (JSON has no infinity), not read as one"
    assert err.splitlines() == [
        f"monitor-bus: warning: {run}, line 8: data['lat.mean']: skipped 1e999, {beyond}",
        f"monitor-bus: warning: {run}, line 8: data['lat.max']: skipped -2E+999, {beyond}",
    ]
    assert out.startswith(f"{run}: 9 events")
    assert out.endswith(
        "stat  aggregate  windows  last       min  max\n"
        "lat   count            3     7         7   12\n"
        "lat   max              3     4         4    9\n"
        "lat   mean             3  1.75       1.5    2\n"
        "loss  value            4   inf  0.333333  inf\n"
    )


def test_summary_shows_a_step_anatomy_straggler_by_the_time_the_others_waited(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A straggler named from StepAnatomy's Stats (no ratio) is shown by the time the other
    ranks waited for it per step, its stage and its cause."""
    from monitor_bus.ranks import STRAGGLER_EVENT

    named = {"stat": "step.wait_s", "rank": 2, "host": "n1", "windows": 3, "recovered": False}
    events = [
        Event(
            STRAGGLER_EVENT, T0, {**named, "stage": "backward", "exposed_s": 0.02945, "cause": ""}
        ),
        Event(STRAGGLER_EVENT, T0, {**named, "stage": "data", "exposed_s": 0.031, "cause": "gc"}),
        Event(STRAGGLER_EVENT, T0, {**named, "stage": "", "exposed_s": 0.5, "cause": ""}),
    ]
    run = write_run(tmp_path / "run.jsonl", events)
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = [line.strip().split("  ", 1)[1] for line in out.splitlines() if "waited" in line]
    assert lines == [  # the family by its prefix: a line fits a page's code block
        "straggler  step  rank 2 (n1)  others waited 29.4 ms/step in backward  3 windows",
        "straggler  step  rank 2 (n1)  others waited 31.0 ms/step in data (gc)  3 windows",
        "straggler  step  rank 2 (n1)  others waited 500.0 ms/step  3 windows",
    ]


def test_summary_shows_the_rank_merge_s_hangs_and_slowdowns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hung rank is shown with where it is, how long no step ended and how many ranks wait;
    a rank that waits too is said to; a slowdown by its Stat, before and after and when it
    began. Each in a section of its own, after the stragglers."""
    from monitor_bus.ranks import HANG_EVENT, SLOWDOWN_EVENT, STRAGGLER_EVENT

    hang = {"host": "n1", "in_step": True, "waiting": 2, "seconds": 61.54, "silent_s": 0.5}
    began = "2026-01-01T00:00:10+00:00"
    events = [
        Event(HANG_EVENT, T0, {**hang, "rank": 2, "stage": "data", "waits": False}),
        Event(HANG_EVENT, T0, {**hang, "rank": 1, "stage": "", "waits": True}),
        Event(HANG_EVENT, T0, {**hang, "rank": 0, "stage": "", "in_step": False, "waits": False}),
        Event(
            SLOWDOWN_EVENT,
            T0,
            {
                "stat": "step.time_s",
                "before": 0.01,
                "after": 0.0125,
                "ratio": 1.25,
                "began": began,
                "windows": 12,
            },
        ),
        Event(
            STRAGGLER_EVENT, T0, {"stat": "t", "rank": 1, "host": "h", "ratio": 2.0, "windows": 3}
        ),
    ]
    run = write_run(tmp_path / "run.jsonl", events)
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    when = T0.isoformat(timespec="seconds")
    assert (
        f"stragglers\n  {when}  straggler  stat t  rank 1 (h)  2.00x the median  3 windows\n\n"
        f"hangs\n"
        f"  {when}  hang  rank 2 (n1)  in stage 'data'  no step for 61.5 s  2 ranks waiting\n"
        f"  {when}  hang  rank 1 (n1)  in a step, outside every stage, waiting in a "
        "collective  no step for 61.5 s  2 ranks waiting\n"
        f"  {when}  hang  rank 0 (n1)  between steps  no step for 61.5 s  2 ranks waiting\n\n"
        f"slowdowns\n"
        f"  {when}  slowdown  step.time_s  10.00 -> 12.50 ms (1.25x) since {began}  12 windows\n"
    ) in out


def test_summary_and_plot_take_ints_beyond_a_float_in_step_duration_and_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A metrics step, a run's duration_s or a straggler's ratio too large for a float is
    counted and named in one warning, never a traceback: the step's points are skipped, the
    duration and ratio shown as unknown."""
    from monitor_bus import RUN_END_EVENT, RUN_START_EVENT
    from monitor_bus.ranks import STRAGGLER_EVENT

    huge = 10**400
    events = [
        Event(RUN_START_EVENT, T0, {"run_id": "a1", "run_name": "first"}),
        Event(METRICS_EVENT, T0, {"loss": 2.0, "step": huge}),
        Event(METRICS_EVENT, T0, {"loss": 1.0, "step": 20}),
        Event(STRAGGLER_EVENT, T0, {"stat": "t", "rank": 1, "host": "h", "ratio": huge}),
        Event(RUN_END_EVENT, T0, {"run_id": "a1", "status": "success", "duration_s": huge}),
    ]
    run = write_run(tmp_path / "run.jsonl", events)
    warning = (
        "monitor-bus: warning: skipped 3 values too large for a float: duration_s (1), "
        "ratio (1), step (1)\n"
    )
    assert main(["summary", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == warning
    assert "runs\n  first  success\n" in out
    assert "straggler  stat t  rank 1 (h)  ? the median" in out
    assert out.endswith(
        "metric  points  last step  last  min  max\nloss         1         20     1    1    1\n"
    )
    png = tmp_path / "p.png"
    assert main(["plot", str(run), "-o", str(png)]) == 0
    assert capsys.readouterr() == (
        f"wrote {png} (1 panels, 1 series)\n",
        "monitor-bus: warning: skipped 1 value too large for a float: step (1)\n",
    )


@pytest.mark.parametrize("command", ["summary", "plot"])
def test_a_line_past_the_bound_is_skipped_in_bounded_memory(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """A line longer than the reader's bound (here 64 KiB; an 8 MiB line with no newline, then
    one more event) is named as too long and skipped, read in pieces of the bound: the command
    never holds more than a few times the bound, and reads on past it."""
    import tracemalloc

    from monitor_bus import _jsonl_read

    monkeypatch.setattr(_jsonl_read, "MAX_LINE_BYTES", 64 * 1024)
    run = stat_run(tmp_path / "run.jsonl")
    big = b'{"name":"big","timestamp":"2026-03-01T12:00:00+00:00","data":{"s":"'
    big += b"x" * (8 * 2**20) + b'"}}'
    last = f'{{"name":"{STAT_EVENT}","timestamp":"2026-03-01T12:00:04+00:00","data":{{"loss.value":0.2}}}}'
    with run.open("ab") as f:
        f.write(big + b"\n" + last.encode() + b"\n")
    del big
    warning = (
        f"monitor-bus: warning: {run}, line 8: skipped a line of {8 * 2**20 + 70:,} bytes, "
        "longer than the 65,536 a line is read up to"
    )
    if command == "plot":
        assert main(_command(command, run)) == 0
        assert capsys.readouterr().err.splitlines()[0] == warning
        return
    tracemalloc.start()
    try:
        assert main(_command(command, run)) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out, err = capsys.readouterr()
    assert err.splitlines() == [warning]
    assert peak < 8 * 64 * 1024
    assert out.startswith(f"{run}: 8 events")
    assert out.endswith("loss  value            4   0.2  0.2    1\n")
