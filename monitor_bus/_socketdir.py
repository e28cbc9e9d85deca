"""The private directory that holds a listener's socket, and the ones dead listeners left.

Guarantees
----------
- Private: ``monitor_bus-<pid>-<random>`` in the temp dir, made by ``mkdtemp`` (mode 0700),
  named after the process that listens in it. Where the socket's path under the temp dir
  would not fit ``AF_UNIX`` (a long ``TMPDIR``), the directory is made in ``/tmp`` instead,
  as ``multiprocessing`` does from Python 3.13: a socket that cannot bind would leave every
  child to run its own copies of the handlers.
- Leftovers: a listener removes its directory when the relay closes; one killed (SIGKILL, or
  SIGTERM with no handler) leaves it behind, and the next listener to start removes it: each
  directory of that shape owned by this user (checked with ``lstat``: a symlink is never
  followed, another user's never touched) whose socket nobody listens on and whose process is
  gone, or (its pid reused since) whose socket refuses connections. A listener of a live
  process that has not bound its socket yet is left alone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import sys
import tempfile

SOCKET = "relay"  # the socket's name in its directory

# The longest socket path AF_UNIX takes: sun_path less its NUL (108 bytes on Linux, 104 on
# macOS and the BSDs).
_MAX_PATH = 107 if sys.platform.startswith("linux") else 103
_FALLBACK = "/tmp"


def make() -> str:
    """A new private directory for this process's socket, after removing stale ones."""
    top = _top()
    _remove_stale(top)
    return tempfile.mkdtemp(prefix=f"monitor_bus-{os.getpid()}-", dir=top)


def _top() -> str:
    """The temp dir, or ``/tmp`` where a socket's path under the temp dir would be too long."""
    top = tempfile.gettempdir()
    # mkdtemp's random part is 8 characters.
    longest = os.path.join(top, f"monitor_bus-{os.getpid()}-{'x' * 8}", SOCKET)
    if len(os.fsencode(longest)) <= _MAX_PATH or not os.path.isdir(_FALLBACK):
        return top
    return _FALLBACK


_STALE = re.compile(r"monitor_bus-(\d+)-\w+")


def _remove_stale(top: str) -> None:
    """Remove the socket directories in ``top`` of this user's listeners that died without
    closing."""
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        match = _STALE.fullmatch(name)
        if match is None or int(match[1]) == os.getpid():
            continue
        path = os.path.join(top, name)
        try:
            info = os.lstat(path)  # a symlink is not a directory here: never followed
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if _stale(int(match[1]), os.path.join(path, SOCKET)):
            shutil.rmtree(path, ignore_errors=True)  # does not follow symlinks inside


def _stale(pid: int, path: str) -> bool:
    """Whether nobody listens at ``path``, a listener of process ``pid``, nor will: its process
    is gone, or (its pid reused) the socket is left but nobody listens on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except OSError as exc:
            refused = exc.errno == errno.ECONNREFUSED
            if not refused and exc.errno != errno.ENOENT:
                return False  # a full backlog, say: someone listens
        else:
            return False  # a live listener (perhaps of another pid namespace)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: ours, the directory's creator, is gone
        return True
    return refused  # alive: a listener starting up (no socket yet) is not stale
