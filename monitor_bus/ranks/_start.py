"""The start of a rank merge (``merge_stats_across_ranks``'s body, once its bus is
resolved): its arguments checked, its gloo group made, each rank's route, the merge started.

Guarantees
----------
- Own group: the windows travel over a gloo group made by ``merge_stats_across_ranks`` (a
  collective), never the training's group.
- Two levels (``two_level``; by default once a host other than ``dst``'s runs two or more
  ranks): a host is a torchrun node (host name and ``GROUP_RANK``).
- Nothing starts before every argument is checked; torch is imported only here, when a
  merge starts, so importing the package costs no torch.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .._check import check_int, check_timeout, type_name, wrong_type
from ._merge import RankMerge
from ._slowdown import check_threshold

if TYPE_CHECKING:
    from .._bus import EventBus


def start_merge(
    bus: EventBus,
    *,
    dst: int,
    timeout: float,
    keep_local: bool,
    spread: bool,
    stragglers: Mapping[str, float] | None,
    straggler_windows: int,
    exposed_fraction: float | None,
    two_level: bool | None,
    slowdown: float | None,
) -> RankMerge:
    """Check the arguments, make the merge's gloo group (a collective) and start merging
    ``bus``'s Stat windows across ranks: ``merge_stats_across_ranks`` once it has its bus,
    which documents the arguments, what is raised and what the merge does.

    Returns:
        The running merge.
    """
    check_int("dst", dst, 0)
    seconds = check_timeout("timeout", timeout, allow_none=False)
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout}")
    if not isinstance(keep_local, bool):
        raise wrong_type("keep_local", "a bool", keep_local)
    if not isinstance(spread, bool):
        raise wrong_type("spread", "a bool", spread)
    factors = _check_stragglers(stragglers)
    check_int("straggler_windows", straggler_windows, 1)
    if exposed_fraction is not None:
        if isinstance(exposed_fraction, bool) or not isinstance(exposed_fraction, (int, float)):
            raise wrong_type("exposed_fraction", "a number or None", exposed_fraction)
        if not 0 < exposed_fraction <= 1:
            raise ValueError(
                f"exposed_fraction must be above 0 and at most 1, got {exposed_fraction}"
            )
        exposed_fraction = float(exposed_fraction)
    if slowdown is not None:
        slowdown = check_threshold("slowdown", slowdown)
    if two_level is not None and not isinstance(two_level, bool):
        raise wrong_type("two_level", "a bool or None", two_level)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "merge_stats_across_ranks needs torch.distributed.init_process_group() first"
        )
    if dst >= dist.get_world_size():
        raise ValueError(
            f"dst must be a rank below the world size {dist.get_world_size()}, got {dst}"
        )
    if bus._window_tap is not None:
        raise RuntimeError(f"bus {bus._name!r} is merged across ranks already")
    # The group's timeout bounds its making (a rank that never calls this); dst's receives
    # pass a timeout of their own.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    # A host is a torchrun node: its host name and node rank (GROUP_RANK).
    nodes: list[Any] = [None] * dist.get_world_size()
    node = (socket.gethostname(), os.environ.get("GROUP_RANK", ""))
    dist.all_gather_object(nodes, node, group=group)
    hosts = [name for name, _ in nodes]
    merge = RankMerge(
        bus,
        dist,
        group,
        dst,
        seconds,
        keep_local,
        spread=spread,
        stragglers=factors,
        straggler_windows=straggler_windows,
        exposed_fraction=exposed_fraction,
        slowdown=slowdown,
        hosts=hosts,
        upstream=_routes([tuple(n) for n in nodes], dst, two_level),
    )
    merge._start()
    return merge


def _routes(
    nodes: list[tuple[str, str]], dst: int, two_level: bool | None
) -> dict[int, int] | None:
    """Where each rank sends its windows in the two-level shape: to its host's leader (the
    lowest rank of its node; on ``dst``'s node, ``dst``), the leaders to ``dst``; None for
    the flat shape (``two_level`` False, or None and no host but ``dst``'s runs two ranks).

    Args:
        nodes: each rank's node, by rank.
        dst: the rank that logs the merged windows.
        two_level: as ``merge_stats_across_ranks`` takes it.

    Returns:
        rank -> the rank it sends to (``dst`` -> itself), or None.
    """
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    if two_level is None:  # a leader only saves dst messages on a host of two or more
        two_level = any(len(members) > 1 for members in ranks.values() if dst not in members)
    if not two_level:
        return None
    routes = {}
    for members in ranks.values():
        leader = dst if dst in members else members[0]
        for rank in members:
            routes[rank] = dst if rank == leader else leader
    return routes


def _check_stragglers(stragglers: object) -> dict[str, float]:
    """``stragglers`` checked: a mapping of Stat names to factors above 1."""
    if stragglers is None:
        return {}
    if not isinstance(stragglers, Mapping):
        raise wrong_type("stragglers", "a mapping of Stat names to factors, or None", stragglers)
    factors = {}
    for name, factor in stragglers.items():
        if not isinstance(name, str):
            raise TypeError(f"stragglers keys must be Stat names (str), not {type_name(name)}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"stragglers[{name!r}] must be a number, not {type_name(factor)}")
        if not (factor > 1 and math.isfinite(factor)):
            raise ValueError(f"stragglers[{name!r}] must be a finite factor above 1, got {factor}")
        factors[name] = float(factor)
    return factors
