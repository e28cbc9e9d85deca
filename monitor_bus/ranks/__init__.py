"""Stat windows of every ``torch.distributed`` rank merged into one stream on ``dst``.

The package is the rank merge; ``monitor_bus.integrations.torch.merge_stats_across_ranks``
is its public entry (it resolves the bus, then calls ``start_merge``). Each module holds a
role and opens with the guarantees it keeps:

- ``_frame``: the wire format; every frame, envelope and host word within ``FRAME_BYTES``,
  so every sample travels (coarsened if it must) or is logged and counted by its rank.
- ``_bucket``: the one merge rule, exact (counts and sums add, max of maxes, Histograms
  merged), the same on dst, a leader, a rank's own and a late window.
- ``_state``: the shared state, and the tap: a Stat's closed window only enters a deque on
  the thread that closed it; a forked child's windows are not merged.
- ``_sending``: a rank's sends, bounded: upstream gone, its windows are logged locally;
  stalled, they are held until it runs again or ``close()`` gives them up.
- ``_receiving``: dst's and a leader's receiving: from any rank, a dead one holding up none;
  each window merged once, a lost rank rejoining, late windows logged on their own.
- ``_leader`` and ``_dst``: the two-level shape merges as the flat one does; dst logs the
  merged windows.
- ``_stragglers``: the spread across ranks, the straggler rule on the ``stragglers`` given,
  and the episode bookkeeping every straggler rule shares.
- ``_anatomy``: the straggler rule on ``StepAnatomy``'s Stats, given nothing: the rank the
  others wait for, its stage, the time it cost them, GC as a cause; and what each window
  cost (``lost_s``) with each rank's breakdown (``ANATOMY_EVENT``).
- ``_hang``: the hang rule: each rank's ``StepAnatomy`` progress sent upstream with its
  messages, and on dst, once no step has ended on any rank for ``hang_after``, the rank not
  waiting in a collective named while the job hangs.
- ``_slowdown``: the slowdown rule, a pure object fed each window's step time: the job named
  once when it gets and stays ``slowdown`` slower, nothing for noise, a spike or a drift.
- ``_merge``: ``RankMerge``, its start (windows lined up on the wall clock) and ``close()``.
- ``_start``: the arguments checked, the merge's own gloo group, each rank's route.
"""

from __future__ import annotations

from ._anatomy import ANATOMY_EVENT as ANATOMY_EVENT
from ._frame import FRAME_BYTES as FRAME_BYTES
from ._hang import HANG_EVENT as HANG_EVENT
from ._merge import RankMerge as RankMerge
from ._slowdown import SLOWDOWN_EVENT as SLOWDOWN_EVENT
from ._slowdown import SlowdownRule as SlowdownRule
from ._start import start_merge as start_merge
from ._stragglers import STRAGGLER_EVENT as STRAGGLER_EVENT

__all__ = [
    "ANATOMY_EVENT",
    "FRAME_BYTES",
    "HANG_EVENT",
    "RankMerge",
    "SLOWDOWN_EVENT",
    "STRAGGLER_EVENT",
    "SlowdownRule",
    "start_merge",
]
