"""The relay trusts only the family: authentication, restricted unpickling, the listener's
credentials, a signal in the middle of a message, stale socket directories, and a fuzz test."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone, tzinfo
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import monitor_bus
from monitor_bus import EventBus, EventOrigin
from monitor_bus._ratelimit import Throttle

from . import child_workers, relay_workers
from .conftest import Recorder

ROOT = Path(__file__).parent.parent
HEADER = struct.Struct("<I")


_BUSES: list[EventBus] = []


def target_bus() -> EventBus:
    """The parent's bus named "target", closed when the test ends."""
    bus = EventBus(name="target")
    _BUSES.append(bus)
    return bus


@pytest.fixture(autouse=True)
def _close_target_buses() -> Iterator[None]:
    yield
    while _BUSES:
        assert _BUSES.pop().close(timeout=10)


@pytest.fixture(autouse=True)
def _fresh_refusal_warnings() -> None:
    """Each test sees the relay's refusal warnings afresh: they are throttled per pid, and the
    tests connect from this one process."""
    listener = monitor_bus._lifecycle.process.listener
    if listener is not None:
        listener._throttle = Throttle()


def framed(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def old_frame(message: tuple[object, ...]) -> bytes:
    """A message as children sent it before the relay was authenticated."""
    return framed(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


class Canary:
    """Unpickled, it would create the file ``path``: proof that a message ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.path}",))


def forged(canary: str) -> bytes:
    """A hostile connection's bytes: a child's greeting, a bus, an event, then code to run."""
    return b"".join(
        [
            old_frame((0, 4242, None)),  # HELLO: the pid it claims
            old_frame((1, 1, (1, 1), "target")),  # BUS 1: the parent's bus named "target"
            old_frame((2, 1, "forged", 0, None, {"x": 1})),  # EVENT on it
            old_frame((2, 1, "forged", 0, None, {"x": Canary(canary)})),
        ]
    )


def listener_path() -> str:
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    return listener.path


def run_program(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A program of its own (``subprocess``), as any process of this user could start."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        check=False,
    )


# A connecting program: sends stdin's bytes to the relay (its path taken from the environment
# in either of its forms: the path is its last field, and absolute), then waits until the relay
# closes the connection.
SENDER = """
    import os, socket, sys
    text = os.environ["MONITOR_BUS_PARENT"]
    path = text[text.index("/"):]
    data = sys.stdin.buffer.read()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(path)
        try:
            s.sendall(data)
            while s.recv(4096):
                pass
        except OSError:
            pass
    print(os.getpid())
"""


def test_another_program_cannot_forge_events_or_run_code_in_the_parent(
    tmp_path: Path, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A program of the same user that connects to the relay (a ``subprocess`` inherits its
    path) and sends a child's messages is refused unheard: its event reaches no handler, its
    pickle runs no code, the relay says which process it refused, and goes on serving."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    canary = tmp_path / "canary"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SENDER)],
        input=forged(str(canary)),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout)
    assert bus.flush(10)
    assert recorder.events == []
    assert not canary.exists()
    assert f"the relay refused process {pid}: it sent a message of" in caplog.text
    assert_children_still_arrive(recorder, bus)


def assert_children_still_arrive(recorder: Recorder, bus: EventBus) -> None:
    """A real child's three events on ``bus`` all arrive (and nothing else does)."""
    proc = multiprocessing.get_context("fork").Process(target=log_three_on, args=(bus,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert bus.flush(10)
    got = [(e.name, e.data["i"], e.origin) for e in recorder.events]
    origin = EventOrigin(proc.pid, None)  # type: ignore[arg-type]
    assert got == [("child", i, origin) for i in range(3)]


def log_three_on(bus: EventBus) -> None:
    for i in range(3):
        bus.log_event(monitor_bus.Event("child", child_workers.TS, {"i": i}))


def test_a_subprocess_cannot_prove_it_is_a_child(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``subprocess`` program speaking the protocol exactly as a child does is refused: it
    does not have the family's key (``multiprocessing``'s authkey)."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    result = run_program(
        """
        import os, socket
        from monitor_bus import _wire
        from monitor_bus._relay import parse_environment
        parent = parse_environment()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(60)
            s.connect(parent[2])
            s.sendall(
                _wire.credentials(parent[1])
                + _wire.frame((_wire.HELLO, os.getpid(), None))
                + _wire.frame((_wire.BUS, 1, (1, 1), "target"))
                + _wire.frame((_wire.EVENT, 1, "forged", 0, None, {"x": 1}))
            )
            assert s.recv(1) == b""  # closed by the relay
        print(os.getpid())
        """
    )
    assert result.returncode == 0, result.stderr
    assert bus.flush(10)
    assert recorder.events == []
    pid = int(result.stdout)
    assert f"the relay refused process {pid}: it is not a child of this process" in caplog.text


def test_an_authenticated_peer_cannot_run_code_through_pickle(
    tmp_path: Path, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A body that names any global beyond the relay's plain values is refused before anything
    is made: no code runs, that connection is closed, the relay goes on."""
    from monitor_bus import _wire

    bus = target_bus()
    bus.register_event_handler(recorder)
    canary = tmp_path / "canary"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(listener_path())
        s.sendall(
            _wire.credentials(os.getpid())  # the listener is this process, and so is the peer
            + _wire.frame((_wire.HELLO, os.getpid(), None))
            + _wire.frame((_wire.BUS, 1, (1, 1), "target"))
            + _wire.frame((_wire.EVENT, 1, "taken", 0, None, {"x": 1}))
            + _wire.frame((_wire.EVENT, 1, "evil", 0, None, {"x": Canary(str(canary))}))
            + _wire.frame((_wire.EVENT, 1, "after", 0, None, {"x": 1}))
        )
        assert s.recv(5) == _wire.VERDICT.pack(1, True)
        assert s.recv(1) == b""  # closed by the relay
    assert bus.flush(10)
    assert not canary.exists()
    assert [e.name for e in recorder.events] == ["taken"]
    assert "posix.system is not allowed in a relay message" in caplog.text
    recorder.events.clear()
    assert_children_still_arrive(recorder, bus)


class _Odd(tzinfo):
    """A tzinfo of a class the relay does not unpickle (pytz's and dateutil's are such)."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=3)

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)

    def tzname(self, dt: datetime | None) -> str:
        return "ODD"


class _Stamp(datetime):
    """A datetime subclass (pandas' Timestamp is one)."""


def test_timestamps_of_any_kind_cross_as_plain_values() -> None:
    """A child sends every timestamp in a form the restricted unpickler makes: a zone by its
    key, another tzinfo as its fixed offset and name, a subclass as a datetime; the instant
    and the wall time are kept."""
    from zoneinfo import ZoneInfo

    from monitor_bus import _wire

    for ts in [*child_workers.stamps(), datetime(2026, 5, 1, 8, tzinfo=_Odd())]:
        wire = _wire.loads(pickle.dumps(_wire.stamp(ts), pickle.HIGHEST_PROTOCOL))
        back = _wire.unstamp(*wire)
        assert (back, back.isoformat(), back.fold) == (ts, ts.isoformat(), ts.fold)
        if isinstance(ts.tzinfo, (timezone, ZoneInfo)) or ts.tzinfo is None:
            assert back.tzinfo == ts.tzinfo
    odd = _wire.unstamp(*_wire.stamp(datetime(2026, 5, 1, 8, tzinfo=_Odd())))
    assert odd.tzinfo == timezone(timedelta(hours=3), "ODD")
    sub = _wire.unstamp(*_wire.stamp(_Stamp(2026, 5, 1, 8, 0, 0, 7)))
    assert (sub.__class__, sub) == (datetime, datetime(2026, 5, 1, 8, 0, 0, 7))


IMPOSTOR = """
    import os, socket
    from datetime import datetime
    import monitor_bus
    from monitor_bus import Event
    from monitor_bus._lifecycle import process

    monitor_bus.register_event_handler(print)
    listener = process.listener
    path = listener.path
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: logs once told to, after the listener is gone
        os.read(go_r, 1)
        bus = monitor_bus.get_default_bus()
        for i in range(3):
            monitor_bus.log_event(Event("secret", datetime.now(), {"i": i}))
        stats = bus.stats()
        os.write(out_w, f"{stats['dropped']} {stats['to_parent']}".encode())
        os._exit(0)
    listener.close()  # the listener's directory is gone...
    assert not os.path.exists(os.path.dirname(path))
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()
    impostor = os.fork()
    if impostor == 0:  # ... and another process makes it again and listens there
        if os.environ.get("IMPOSTOR_UID"):  # another user's, even
            os.setgid(int(os.environ["IMPOSTOR_UID"]))
            os.setuid(int(os.environ["IMPOSTOR_UID"]))
        os.mkdir(os.path.dirname(path), 0o700)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen()
        os.write(ready_w, b"!")
        conn, _ = server.accept()
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        os.write(got_w, str(len(got)).encode())
        os._exit(0)
    os.read(ready_r, 1)
    os.write(go_w, b"!")
    print("child", os.read(out_r, 100).decode())
    print("impostor", os.read(got_r, 100).decode())
    os.waitpid(child, 0)
    os.waitpid(impostor, 0)
"""


@pytest.mark.parametrize("uid", [None, 65534], ids=["same user", "another user"])
def test_a_child_sends_nothing_to_another_process_listening_at_the_path(uid: int | None) -> None:
    """When the listener's directory is gone and another process (of this user or another)
    listens at the same path, a child checks who listens (the listener's pid, our uid) before
    sending anything: the impostor receives nothing, the child counts its events as dropped
    and says why."""
    if uid is not None and os.getuid() != 0:
        pytest.skip("only root can listen as another user here")
    result = run_program(IMPOSTOR, **({} if uid is None else {"IMPOSTOR_UID": str(uid)}))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-3:] == ["child 3 0", "impostor 0", ""]
    assert "not by the parent's listener" in result.stderr
    assert f"of uid {os.getuid() if uid is None else uid}, not by" in result.stderr


def test_ctrl_c_in_the_middle_of_a_message_breaks_the_connection_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGINT that interrupts a child's ``log_event`` halfway through a message (its socket
    full) breaks the connection: that event and every later one are counted as dropped,
    nothing more is written after the half message, and the interruption reaches the child."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "relay")
    server.bind(path)
    server.listen()
    server.settimeout(60)
    # This process listens (by hand: it reads only part of the big message).
    monkeypatch.setenv("MONITOR_BUS_PARENT", f"{os.getpid()}:{os.getpid()}:{path}")
    ctx = multiprocessing.get_context("spawn")
    interrupted = ctx.Event()
    out = tmp_path / "stats.txt"
    proc = ctx.Process(target=relay_workers.interrupted_send, args=(interrupted, str(out)))
    proc.start()
    conn, _ = server.accept()
    conn.settimeout(60)
    got = bytearray()
    while len(got) < 1 << 20:  # the big message is being written: the child is inside it
        chunk = conn.recv(65536)
        assert chunk
        got += chunk
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGINT)
    assert interrupted.wait(60)
    while chunk := conn.recv(1 << 20):  # room again: what the child writes now would arrive
        got += chunk
    proc.join(60)
    assert proc.exitcode == 0
    assert out.read_text().split() == ["4", "0"]  # dropped: the big one and the 3 after it
    # What arrived: the credentials, the greeting, the bus, and half of the big message.
    start = HEADER.size + HEADER.unpack_from(got)[0]
    for _ in range(2):
        start += HEADER.size + HEADER.unpack_from(got, start)[0]
    (size,) = HEADER.unpack_from(got, start)
    assert size > relay_workers.BIG
    assert len(got) - start - HEADER.size < size
    conn.close()
    server.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_childs_child_reports_to_the_same_listener(
    method: str, tmp_path: Path, recorder: Recorder
) -> None:
    """A child's own children (whose parent is the child, not the listener) still pass the
    listener check and prove themselves: every event arrives, from each process."""
    monitor_bus.register_event_handler(recorder)
    out = tmp_path / "grandchild.txt"
    ctx = multiprocessing.get_context(method)
    proc = ctx.Process(target=relay_workers.log_then_start_a_grandchild, args=(method, str(out)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    grandchild, exitcode = (int(x) for x in out.read_text().split())
    assert exitcode == 0
    assert monitor_bus.flush(10)
    got = [(e.data.get("tag"), e.data["i"], e.origin) for e in recorder.events]
    assert got == [
        (None, 0, EventOrigin(proc.pid, None)),  # type: ignore[arg-type]
        *[("grandchild", i, EventOrigin(grandchild, None)) for i in range(3)],
    ]


RELAY_FROM_A_CHILD = """
    import multiprocessing, os
    import monitor_bus
    from monitor_bus._lifecycle import process
    origins = []
    monitor_bus.register_event_handler(lambda event: origins.append(event.origin))
    print(os.path.dirname(os.path.dirname(process.listener.path)), flush=True)
    child = multiprocessing.get_context("fork").Process(
        target=monitor_bus.log, args=("from.child",), kwargs={"x": 1}
    )
    child.start()
    child.join()
    assert monitor_bus.flush(60)
    print(sum(1 for o in origins if o is not None and o.pid == child.pid), flush=True)
"""


def test_a_temp_dir_too_long_for_a_socket_puts_the_listener_in_tmp(tmp_path: Path) -> None:
    """Where the socket's path under ``TMPDIR`` would not fit AF_UNIX, the listener's directory
    is made in /tmp instead: the relay listens, a forked child's event reaches the parent's
    handler, and nothing is said on stderr (it used to be "cannot listen for child
    processes", each child running its own copies of the handlers)."""
    temp = tmp_path / ("d" * 100)
    temp.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RELAY_FROM_A_CHILD)],
        env={**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == ["/tmp", "1"]


LISTEN = """
    import os, sys
    import monitor_bus
    from monitor_bus._lifecycle import process
    monitor_bus.register_event_handler(print)
    print(os.path.dirname(process.listener.path), flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory in /tmp with a short path: a socket's path must fit AF_UNIX's 108 bytes, and
    pytest's ``tmp_path`` leaves too little room under pytest-xdist (``popen-gw0/...``)."""
    path = Path(tempfile.mkdtemp(prefix="mb-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def test_a_new_listener_removes_the_directories_of_dead_ones(
    tmp_path: Path, short_tmp: Path
) -> None:
    """A listener killed with SIGKILL leaves its socket's directory; the next listener to start
    removes it, and leaves alone a live listener's, a symlink and another user's directory."""
    temp = short_tmp
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT)}

    def listen() -> tuple[subprocess.Popen[str], Path]:
        program = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(LISTEN)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        assert program.stdout is not None
        return program, Path(program.stdout.readline().strip())

    killed, stale = listen()
    live, alive = listen()
    killed.kill()
    assert killed.wait(60) == -signal.SIGKILL
    for pipe in (killed.stdin, killed.stdout):
        assert pipe is not None
        pipe.close()
    assert stale.is_dir()
    assert alive.is_dir()
    assert stale.parent == temp
    assert stale.name.startswith(f"monitor_bus-{killed.pid}-")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").touch()
    link = temp / f"monitor_bus-{killed.pid}-link"
    link.symlink_to(target)
    others = temp / f"monitor_bus-{killed.pid}-other"
    others.mkdir()
    if os.getuid() == 0:
        os.chown(others, 65534, 65534)
    result = subprocess.run(
        [sys.executable, "-c", "import monitor_bus; monitor_bus.register_event_handler(print)"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert not stale.exists()
    assert alive.is_dir()
    assert link.is_symlink()
    assert (target / "keep").exists()
    if os.getuid() == 0:
        assert others.is_dir()
    else:
        assert not others.exists()  # ours, and its pid is dead: stale
    assert live.stdin is not None
    live.stdin.close()
    assert live.wait(60) == 0
    assert live.stdout is not None
    live.stdout.close()
    assert not alive.exists()  # removed by its own listener at exit
    assert sorted(p.name for p in temp.iterdir()) == sorted(
        [link.name] + ([others.name] if os.getuid() == 0 else [])
    )


# Fuzzing: what a hostile connection may send.
_frames = st.one_of(
    st.binary(max_size=200),  # random bytes
    st.builds(framed, st.binary(max_size=100)),  # random bodies, framed
    st.builds(lambda n: HEADER.pack(n), st.integers(0, 2**32 - 1)),  # any length, huge ones
    st.sampled_from(
        [
            old_frame((0, 4242, None)),
            old_frame((1, 1, (1, 1), "target")),
            old_frame((2, 1, "forged", 0, None, {"x": 1})),
            old_frame((3, 1, "forged-window", 0, None, {"x": 1})),
        ]
    ),
    # Credentials of the right size with a wrong MAC (or claiming another pid).
    st.builds(
        lambda pid, mac: framed(struct.pack("<q32s", pid, mac)),
        st.integers(-1, 2**31),
        st.binary(min_size=32, max_size=32),
    ),
)


def test_fuzz_the_relay_never_fails_runs_code_or_takes_a_forged_event(
    tmp_path: Path, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """Random bytes, huge lengths, half frames, forged credentials, forged events before and
    after a failed handshake, hostile pickles: never an exception in the parent, never code
    run, never a forged event at a handler; a real child's events still all arrive after."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    canary = tmp_path / "canary"
    hostile = old_frame((2, 1, "evil", 0, None, {"x": Canary(str(canary))}))
    path = listener.path

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(_frames, st.just(hostile)), max_size=8), st.booleans())
    def attack(chunks: list[bytes], keep_open: bool) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            for chunk in chunks:
                try:
                    s.sendall(chunk)
                except OSError:  # refused and closed already
                    break
            assert listener.sweep(10)
            if keep_open:  # the relay reads on while it waits for the rest of a frame
                assert listener.sweep(10)
        assert listener.sweep(10)

    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        attack()
    assert bus.flush(10)
    assert not canary.exists()
    assert recorder.events == []
    assert listener._thread.is_alive()
    assert [r for r in caplog.records if r.levelno > logging.WARNING or r.exc_info] == []
    assert_children_still_arrive(recorder, bus)
    threads = [t.name for t in threading.enumerate()]
    assert threads.count("monitor_bus.relay") == 1


# A family member that speaks on command: a fork child (it has the family's key) that, for
# each list of chunks it is sent, connects, proves itself, sends them, and says so.
def family_member(commands: Connection, listener_pid: int, path: str) -> None:
    from monitor_bus import _wire

    while (command := commands.recv()) is not None:
        chunks, keep_open = command
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(60)
            s.connect(path)
            try:
                s.sendall(_wire.credentials(listener_pid))
                for chunk in chunks:
                    s.sendall(chunk)
            except OSError:  # refused and closed already
                pass
            commands.send("sent")
            if keep_open:  # the relay reads on while it waits for the rest of a frame
                commands.recv()
        commands.send("closed")


class Member:
    """The parent's end of ``family_member``."""

    def __init__(self) -> None:
        from monitor_bus._lifecycle import process

        listener = process.listener
        assert listener is not None
        ctx = multiprocessing.get_context("fork")
        self.commands, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=family_member, args=(theirs, os.getpid(), listener.path))
        self.proc.start()
        assert self.proc.pid is not None
        self.pid: int = self.proc.pid

    def send(self, chunks: list[bytes], bus: EventBus, *, keep_open: bool = False) -> None:
        """One connection sends ``chunks``; returns once the parent has handled all of it."""
        self.commands.send((chunks, keep_open))
        assert self.commands.recv() == "sent"
        assert bus.flush(10)
        if keep_open:
            self.commands.send("close")
        assert self.commands.recv() == "closed"
        assert bus.flush(10)

    def stop(self) -> None:
        self.commands.send(None)
        self.proc.join(60)
        assert self.proc.exitcode == 0


def message(*items: object) -> bytes:
    return old_frame(items)


_NAIVE = datetime(2026, 5, 1, 8, 30)
_PLUS_TWO = timezone(timedelta(hours=2))

# Messages a child may not send: (message, why the relay says it refused it). Bus 1 is
# announced (the parent's "target"), bus 2 is not.
MALFORMED = [
    ((0, 4242, None), "it claimed to be process 4242"),
    ((0, 4242), "it sent a HELLO message of 2 items"),
    ((0, "me", None), "it sent a HELLO of str 'me', NoneType None"),
    ((1, 1, (1, 1), "target"), "it announced bus 1 twice"),
    ((1, 2, "creator", "target"), "it announced bus 2 as str 'creator', str 'target'"),
    ((1, 2**32, (1, 1), "target"), "it sent a BUS message for bus int 4294967296"),
    ((1, 2, (1, 1)), "it sent a BUS message of 3 items"),
    ((2, 1, "x", 0, None), "it sent a EVENT message of 5 items"),
    ((2, 2, "x", 0, None, {}), "it sent an event for bus 2, never announced"),
    ((2, 1, 7, 0, None, {}), "it sent a EVENT named int 7"),
    ((2, 1, "x", 10**30, None, {}), "it sent a timestamp that is not one (OverflowError("),
    ((2, 1, "x", 0.5, None, {}), "it sent a timestamp of float 0.5, NoneType None"),
    ((2, 1, "x", None, (_NAIVE, "No/Such_Zone"), {}), "it sent a timestamp that is not one"),
    ((2, 1, "x", 0, None, {"x": [1]}), "it sent a EVENT whose data is not str keys to plain"),
    ((2, 1, "x", 0, None, [("x", 1)]), "it sent a EVENT whose data is not str keys to plain"),
    ((3, 1, "x", 0, None, {1: 1.0}), "it sent a WINDOW whose data is not str keys to plain"),
    ((3, True, "x", 0, None, {}), "it sent a WINDOW message for bus bool True"),
    ((4, 1, -1000), "it reported int -1000 events of bus 1 dropped"),
    ((4, 1, 0), "it reported int 0 events of bus 1 dropped"),
    ((4, 1, "5"), "it reported str '5' events of bus 1 dropped"),
    ((4, 1, 2**63), "it reported int 9223372036854775808 events of bus 1 dropped"),
    ((4, 2, 5), "it reported drops of bus 2, never announced"),
    ((4, 1, 5, 6), "it sent a DROPPED message of 4 items"),
    ((5, 1), "it sent the windows of bus 1 unasked"),
    ((5, 1, 0), "it sent a SENT message of 3 items"),
    ((7, 1), "it sent a message of unknown kind int 7"),
    ((None,), "it sent a message of unknown kind NoneType None"),
    ((), "it sent tuple (), not a message"),
    ([2, 1], "it sent list [2, 1], not a message"),
]


@pytest.mark.parametrize(("bad", "why"), MALFORMED, ids=[why for _, why in MALFORMED])
def test_a_malformed_message_from_a_child_closes_its_connection_with_one_warning(
    bad: object, why: str, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A child of the family (authenticated) that sends a message of the wrong shape or types,
    or for a bus it did not announce, is cut off there: what it sent before arrives, with the
    pid it proved; the bad message and all after it are not taken (no drop count changes);
    the relay says so once, at WARNING with no traceback, naming the child and why."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    member = Member()
    before = bus.stats()["dropped"]
    good = message(2, 1, "before", 0, None, {"x": 1})
    hello = message(0, member.pid, None)  # as a child starts
    chunks = [hello, message(1, 1, (1, 1), "target"), good, old_frame(bad)]  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        member.send([*chunks, message(2, 1, "after", 0, None, {"x": 1})], bus)
    member.stop()
    got = [(e.name, e.origin) for e in recorder.events]
    assert got == [("before", EventOrigin(member.pid, None))]
    assert bus.stats()["dropped"] == before
    records = [r for r in caplog.records if r.name == "monitor_bus"]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.WARNING, None)]
    assert f"the relay refused process {member.pid}: {why}" in records[0].getMessage()


# What a family member sends in the fuzz test: pieces tagged with what the relay must make
# of them (a model: the first piece it may not take ends the connection).
_Piece = tuple[str, tuple[object, ...], bytes]
# The buses a piece may name (1 is announced first, as "target"; 2 and 3 may be announced,
# as "target" or "nowhere").
_INDEX = st.one_of(st.just(1), st.integers(1, 3))
_STAMPS = st.one_of(
    st.tuples(st.integers(-(2**40), 2**52), st.sampled_from([None, 0])),
    st.tuples(st.none(), st.tuples(st.just(_NAIVE), st.sampled_from([None, _PLUS_TWO]))),
)
_DATA = st.dictionaries(
    st.text(max_size=5),
    st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=5)),
    max_size=3,
)


def _piece(kind: str, *items: object) -> _Piece:
    return (kind, items, message(*items))


def _good(pid: int) -> st.SearchStrategy[_Piece]:
    """Messages a child (of pid ``pid``) may send (events the most)."""
    event = st.builds(
        lambda kind, i, name, ts, data: _piece("event", kind, i, name, *ts, data),
        st.sampled_from([2, 3]),
        _INDEX,
        st.text(max_size=5),
        _STAMPS,
        _DATA,
    )
    return st.one_of(
        st.builds(
            lambda i, name: _piece("bus", 1, i, (1, 1), name),
            _INDEX,
            st.sampled_from(["target", "nowhere"]),
        ),
        event,
        event,
        st.builds(lambda i, n: _piece("dropped", 4, i, n), _INDEX, st.integers(1, 2**63 - 1)),
        st.builds(lambda w: _piece("hello", 0, pid, w), st.one_of(st.none(), st.integers(0, 64))),
    )


def _bad(pid: int) -> st.SearchStrategy[_Piece]:
    """Bytes a child may not send (the relay must refuse them or wait for more)."""
    return st.one_of(
        st.sampled_from(
            # Those wrong in any state (not those about bus 2, which may be announced here).
            [
                _piece("bad", *bad)
                for bad, why in MALFORMED
                if not why.endswith(("announced", "twice"))
            ]
        ),
        st.builds(lambda body: ("bad", (), framed(body)), st.binary(max_size=100)),  # random bodies
        st.builds(lambda raw: ("bad", (), raw), st.binary(min_size=1, max_size=50)),  # random bytes
        st.builds(lambda n: ("bad", (), HEADER.pack(n)), st.integers(0, 2**32 - 1)),  # any length
        st.builds(
            lambda i, n: _piece("bad", 4, i, n),
            _INDEX,
            st.one_of(st.integers(max_value=0), st.integers(min_value=2**63)),
        ),
        st.builds(  # half frames
            lambda piece, cut: ("bad", (), piece[2][: max(1, len(piece[2]) * cut // 100)]),
            _good(pid),
            st.integers(0, 99),
        ),
    )


def _expected(pieces: list[_Piece], pid: int) -> tuple[list[tuple[object, ...]], int]:
    """What the relay must deliver of ``pieces`` (the target bus's events, as handlers see
    them) and the drops it must count, if it takes each piece up to the first it may not."""
    buses: dict[object, str] = {}
    worker = None
    events: list[tuple[object, ...]] = []
    dropped = 0
    for kind, items, _ in pieces:
        if kind == "bad" or (kind == "bus" and items[1] in buses):
            break
        if kind in ("event", "dropped") and items[1] not in buses:
            break
        if kind == "hello":
            worker = items[2]
        elif kind == "bus":
            buses[items[1]] = items[3]  # type: ignore[assignment]
        elif kind == "dropped":
            dropped += items[2] if buses[items[1]] == "target" else 0  # type: ignore[operator]
        elif buses[items[1]] == "target":
            _, _, name, micros, zone, data = items
            if micros is None:
                naive, tz = zone  # type: ignore[misc]
                ts = naive.replace(tzinfo=tz)
            else:
                ts = datetime(1970, 1, 1) + timedelta(microseconds=micros)  # type: ignore[arg-type]
                ts = ts if zone is None else ts.replace(tzinfo=timezone.utc)
            events.append((name, ts, data, EventOrigin(pid, worker)))
    return events, dropped


def test_fuzz_an_authenticated_child_never_fails_the_relay_runs_code_or_forges_an_event(
    tmp_path: Path, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A child of the family (it passes the handshake) sends random and hostile frames: well
    formed messages, random bodies and bytes, huge lengths, half frames, hostile pickles,
    messages of every kind with wrong types or arity, events and drops of buses it never
    announced, drop counts that are negative, huge or not ints. Exactly its well-formed
    events of a bus it announced reach a handler, with the pid it proved (not one a frame
    claims); the drop count changes by exactly its well-formed reports; no code runs; nothing
    fails in the parent; the relay goes on, and a real child's events still all arrive."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    canary = tmp_path / "canary"
    hostile = ("bad", (), message(2, 1, "evil", 0, None, {"x": Canary(str(canary))}))
    member = Member()
    announce = _piece("bus", 1, 1, (1, 1), "target")
    good = _good(member.pid)
    # Well-formed pieces, then (most often) bad ones, then well-formed ones that must not count.
    bad = st.one_of(_bad(member.pid), st.just(hostile))
    pieces = st.builds(
        lambda *parts: [piece for part in parts for piece in part],
        st.lists(good, max_size=6),
        st.lists(bad, max_size=2),
        st.lists(good, max_size=3),
    )

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(pieces, st.booleans())
    def attack(chosen: list[_Piece], keep_open: bool) -> None:
        sent = [announce, *chosen]  # bus 1 is the target: most pieces name it
        recorder.events.clear()
        dropped = bus.stats()["dropped"]
        member.send([piece[2] for piece in sent], bus, keep_open=keep_open)
        events, more = _expected(sent, member.pid)
        got = [(e.name, e.timestamp, e.data, e.origin) for e in recorder.events]
        assert got == events
        assert bus.stats()["dropped"] == dropped + more
        assert listener._thread.is_alive()

    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        attack()
    member.stop()
    assert not canary.exists()
    assert [r for r in caplog.records if r.levelno > logging.WARNING or r.exc_info] == []
    threads = [t.name for t in threading.enumerate()]
    assert threads.count("monitor_bus.relay") == 1
    recorder.events.clear()
    assert_children_still_arrive(recorder, bus)


# A listener with no descriptor left (a real RLIMIT_NOFILE) while a child connects: the
# relay's CPU over a second of that, its warnings, then what arrives once descriptors free.
OUT_OF_DESCRIPTORS = """
    import logging, os, resource, threading, time, types
    import multiprocessing as mp
    from datetime import datetime
    import monitor_bus
    from monitor_bus import _ratelimit
    from monitor_bus._lifecycle import process

    # The warnings' rate limit reads a clock that stands still: "once" does not rest on 10 s
    # outlasting the time with no descriptor, however slow the machine.
    _ratelimit.time = types.SimpleNamespace(monotonic=lambda: 0.0)

    warned = threading.Event()

    class Warned(logging.Handler):
        def emit(self, record):
            if "could not accept" in record.getMessage():
                print("warning:", record.getMessage(), flush=True)
                warned.set()

    logging.getLogger("monitor_bus").addHandler(Warned())
    got = []
    monitor_bus.register_event_handler(got.append)
    relay = process.listener._thread
    go_r, go_w = os.pipe()
    sent_r, sent_w = os.pipe()

    def child():
        os.read(go_r, 1)
        for i in range(3):
            monitor_bus.log_event(monitor_bus.Event("child", datetime(2026, 1, 1), {"i": i}))
        os.write(sent_w, b"!")

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    clock = time.pthread_getcpuclockid(relay.ident)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    spare = os.open(os.devnull, os.O_RDONLY)
    hog = []
    try:
        while True:
            hog.append(os.dup(spare))
    except OSError:
        pass
    os.write(go_w, b"!")
    os.read(sent_r, 1)  # its events are in its socket, its connection in the backlog
    print("warned", warned.wait(30), flush=True)
    cpu, wall = time.clock_gettime(clock), time.monotonic()
    threading.Event().wait(1.0)  # a second with no descriptor: the relay should idle
    print("cpu", time.clock_gettime(clock) - cpu, time.monotonic() - wall, flush=True)
    for fd in hog:
        os.close(fd)
    proc.join(60)
    print("flushed", monitor_bus.flush(10))
    print("got", [(e.data["i"], e.origin.pid == proc.pid) for e in got], proc.exitcode)
"""


@pytest.fixture(scope="module")
def out_of_descriptors() -> list[str]:
    result = run_program(OUT_OF_DESCRIPTORS)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_out_of_descriptors_the_relay_warns_once_and_accepts_the_child_later(
    out_of_descriptors: list[str],
) -> None:
    """With no descriptor left (EMFILE) when a child connects, the relay says once that it
    could not accept it (though it tries again meanwhile), and once a descriptor frees it
    accepts the child, whose events all arrive with its pid."""
    warnings = [line for line in out_of_descriptors if line.startswith("warning:")]
    assert warnings == [
        "warning: monitor_bus: the relay could not accept a child process's connection (Too "
        "many open files); it tries again, its events wait in its socket meanwhile"
    ]
    assert "warned True" in out_of_descriptors
    assert out_of_descriptors[-2:] == [
        "flushed True",
        "got [(0, True), (1, True), (2, True)] 0",
    ]


@pytest.mark.stress
def test_out_of_descriptors_the_relay_does_not_spin(out_of_descriptors: list[str]) -> None:
    """With no descriptor left and a child waiting to connect, the relay's thread idles (it
    waits out a back-off instead of finding the server socket readable at once): under a
    tenth of a second of CPU over a second (it spun a whole core)."""
    cpu, wall = next(line for line in out_of_descriptors if line.startswith("cpu ")).split()[1:]
    assert float(wall) >= 1.0
    assert float(cpu) < 0.1


def doubling(levels: int) -> list[object]:
    """A list holding itself twice over, ``levels`` deep: 2**levels leaves in a pickle of a
    few bytes per level (pickle writes each shared list once)."""
    crafted: list[object] = [0]
    for _ in range(levels):
        crafted = [crafted, crafted]
    return crafted


def test_describing_a_refused_message_costs_work_bounded_by_its_size() -> None:
    """The refusal of a message whose full repr is huge (2**18 leaves of shared lists, a
    pickle of 125 bytes) describes its start without making that repr: a bounded text, and
    the memory it takes stays a few kilobytes (the repr's was megabytes)."""
    import tracemalloc

    from monitor_bus import _wire

    body = pickle.dumps(doubling(18), pickle.HIGHEST_PROTOCOL)
    assert len(body) == 125
    crafted = _wire.loads(body)
    tracemalloc.start()
    try:
        with pytest.raises(_wire.Refused) as refused:
            _wire.check(crafted)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(refused.value) == f"it sent list {'[' * 19}0], [0]], [[0], [0..., not a message"
    assert peak < 64 * 1024


def test_a_crafted_message_of_shared_references_is_refused_and_the_relay_goes_on(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A child's 141-byte frame holding 2**20 leaves of shared lists is refused with a short
    description, what it sent before arrives, and another child's events still arrive."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    member = Member()
    crafted = old_frame(doubling(20))  # type: ignore[arg-type]
    assert len(crafted) == 141
    chunks = [
        message(0, member.pid, None),
        message(1, 1, (1, 1), "target"),
        message(2, 1, "before", 0, None, {"x": 1}),
        crafted,
    ]
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        member.send(chunks, bus)
    member.stop()
    assert [(e.name, e.origin) for e in recorder.events] == [
        ("before", EventOrigin(member.pid, None))
    ]
    records = [r.getMessage() for r in caplog.records if r.name == "monitor_bus"]
    assert len(records) == 1
    assert (
        f"refused process {member.pid}: it sent list {'[' * 21}0], [0]], [[0], ..., not"
        in records[0]
    )
    recorder.events.clear()
    assert_children_still_arrive(recorder, bus)


class _HalfBuilt:
    """Pickles as a ``Histogram`` made by NEWOBJ, then given ``state`` (BUILD) if any."""

    def __init__(self, *state: object) -> None:
        self.state = state

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # what pickle checks NEWOBJ's class against
        return monitor_bus.Histogram

    def __reduce__(self) -> tuple[object, ...]:
        import copyreg

        return (copyreg.__newobj__, (monitor_bus.Histogram,), *self.state)


_GOOD_STATE = monitor_bus.Histogram.of([1.0, 2.0]).to_dict()
BAD_HISTOGRAMS = [
    (_HalfBuilt(), "it sent a WINDOW whose data['h'] is a Histogram without its state"),
    (
        _HalfBuilt({**_GOOD_STATE, "count": 3}),
        "its message was refused (ValueError('count must be the total of the counts (2), got 3'",
    ),
    (_HalfBuilt([1, 2]), "its message was refused (TypeError('d must be a dict"),
]


@pytest.mark.parametrize(("bad", "why"), BAD_HISTOGRAMS, ids=["no state", "count", "not a dict"])
def test_a_window_with_a_half_built_or_inconsistent_histogram_is_refused(
    bad: _HalfBuilt, why: str, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """A child's window whose Histogram was made without its state (NEWOBJ, no BUILD) or with
    a state its constructor refuses is refused like any bad message, counted in the relay's
    ``refused``: no handler gets it, what came before arrives."""
    bus = target_bus()
    bus.register_event_handler(recorder)
    listener = monitor_bus._lifecycle.process.listener
    assert listener is not None
    refused = listener.refused
    good = monitor_bus.Histogram.of([3.0])
    crafted = message(3, 1, "window", 0, None, {"x": 1.0, "h": bad})
    member = Member()
    chunks = [
        message(0, member.pid, None),
        message(1, 1, (1, 1), "target"),
        message(3, 1, "window", 0, None, {"h": good}),
        crafted,
    ]
    with caplog.at_level(logging.WARNING, logger="monitor_bus"):
        member.send(chunks, bus)
    member.stop()
    assert [(e.name, e.data) for e in recorder.events] == [("window", {"h": good})]
    assert listener.refused == refused + 1
    assert bus.stats()["dropped"] == 0
    records = [r.getMessage() for r in caplog.records if r.name == "monitor_bus"]
    assert len(records) == 1
    assert f"the relay refused process {member.pid}: {why}" in records[0]
