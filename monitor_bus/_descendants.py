"""The live descendants of a process, read from Linux's ``/proc``, for ``SystemMetrics``'
process tree.

Guarantees: each process's parent is read once, and again only once its parent ended (it was
reparented); a pid that left ``/proc`` is forgotten; a process that ends while it is read is
left out, never an error.
"""

from __future__ import annotations

import os

__all__ = ["Descendants"]


class Descendants:
    """The live descendants of a process, from Linux's ``/proc``.

    Listing ``/proc`` is cheap; reading a process's parent is a file read per process, which on
    a host of a thousand processes costs more than the rest of a sample (psutil's
    ``children(recursive=True)`` reads them all each time). So each process's parent is read
    once, and again only once its parent ended (it was reparented); a pid that left the
    listing is forgotten.
    """

    def __init__(self, root: int) -> None:
        self._root = root
        self._parents: dict[int, int] = {}

    def __call__(self) -> list[int]:
        pids = {int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()}
        parents = self._parents
        for pid in [pid for pid in parents if pid not in pids]:
            del parents[pid]
        for pid in pids:
            parent = parents.get(pid)
            if parent is None or (parent and parent not in pids):  # new, or reparented
                parent = _parent(pid)
                if parent is None:  # ended meanwhile
                    continue
                parents[pid] = parent
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        found: list[int] = []
        todo = [self._root]
        while todo:
            for child in children.get(todo.pop(), ()):
                found.append(child)
                todo.append(child)
        return found


def _parent(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc/<pid>/stat``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses: split after the last.
    return int(stat.rsplit(b")", 1)[1].split(None, 2)[1])
