"""Where a child reports: the variable that names its family's listener.

Guarantees
----------
- Who reports where: the first process of a family to register a handler (on any bus) listens
  on a Unix socket in a private directory and names it in the environment variable
  ``MONITOR_BUS_PARENT`` (``<parent pid>:<listener pid>:<path>``). Its ``multiprocessing``
  children (fork, spawn and forkserver: ``Process``, ``Pool``, ``ProcessPoolExecutor``,
  DataLoader workers) and its ``os.fork`` children find it there, and so do theirs: a whole
  family reports to its first listening process. Other programs it starts (``subprocess``)
  are not its children here: they inherit the variable but check that ``multiprocessing``
  started them. A forkserver child that logs before ``multiprocessing`` has set it up (while
  its task's module is imported) reports nowhere.
"""

from __future__ import annotations

import os

ENVIRONMENT = "MONITOR_BUS_PARENT"
# Each step of a connection waits at most this long: a child's connect and its checks, a last
# message, the relay thread's end at the listener's close.
CONNECT_TIMEOUT = 1.0


def parse_environment() -> tuple[int, int, str] | None:
    """The parent's pid, its listener's pid and the listener's path named by
    ``MONITOR_BUS_PARENT``, if another process set it."""
    pid, _, rest = os.environ.get(ENVIRONMENT, "").partition(":")
    listener, _, path = rest.partition(":")
    if not (pid.isdigit() and listener.isdigit()) or not path or int(pid) == os.getpid():
        return None
    return int(pid), int(listener), path
