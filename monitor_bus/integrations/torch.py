"""Forward ``torch.monitor`` events into a monitor_bus bus.

``torch.monitor`` calls its handlers synchronously, in the thread that logged the event, and an
exception in a handler propagates to that caller. The handler registered here only converts the
event and appends it to a bus (``log_event`` returns at once), so PyTorch-internal events
(torchelastic, torchx) get the bus's non-blocking fan-out to slow sinks.

What passes through, as torch hands it out:

- ``name`` unchanged; torch's own Stat windows are named ``"torch.monitor.Stat"``, which is
  ``monitor_bus.STAT_EVENT``, so the exporters treat them as Stat windows.
- ``timestamp`` as a naive ``datetime`` in local time: torch drops the ``tzinfo`` of an aware
  timestamp (keeping its clock reading) and returns naive local time.
- ``data`` values as torch stores them: ``bool`` comes back as ``float`` (``True`` is ``1.0``),
  and a torch ``Stat``'s aggregates, ``count`` included, are ``float``.

``merge_stats_across_ranks`` merges the Stat windows of every ``torch.distributed`` rank into
one stream on one rank: it resolves the bus, and the package ``monitor_bus.ranks`` does the rest.

``StepAnatomy`` (from ``monitor_bus._step_anatomy``) times where each training step's time goes
on a rank (its stages, the wait in DDP's all-reduce, GC pauses) as Stats, which the merge
compares across ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from .._bus import EventBus
from .._check import wrong_type
from .._default import get_default_bus, log_event
from .._event import Event
from .._lifecycle import module_lock
from .._step_anatomy import StepAnatomy as StepAnatomy
from ..ranks import ANATOMY_EVENT as ANATOMY_EVENT
from ..ranks import HANG_EVENT as HANG_EVENT
from ..ranks import SLOWDOWN_EVENT as SLOWDOWN_EVENT
from ..ranks import STRAGGLER_EVENT as STRAGGLER_EVENT
from ..ranks import RankMerge as RankMerge
from ..ranks import start_merge

logger = logging.getLogger("monitor_bus")

# Failed conversions are logged at most this often (they reach torch's caller otherwise).
_ERROR_LOG_INTERVAL = 10.0

_lock = module_lock(__name__, "_lock")  # forward/stop registrations
_active: dict[int, TorchMonitorForwarding] = {}  # id(bus) (0: the default bus) -> forwarding


class TorchMonitorForwarding:
    """A registered ``torch.monitor`` handler that re-logs into a bus; see ``forward_torch_monitor``.

    ``forwarded`` counts events re-logged and ``errors`` events that could not be converted.
    ``close()`` (or leaving a ``with`` block) undoes the forwarding, as
    ``stop_forwarding_torch_monitor`` does.
    """

    def __init__(self, bus: EventBus | None, key: int) -> None:
        self.bus = bus
        self._key = key
        self._handle: Any = None
        self._last_error = -float("inf")
        #: Events re-logged into the bus.
        self.forwarded = 0
        #: torch events that could not be converted (logged, never raised into torch's caller).
        self.errors = 0

    def __call__(self, torch_event: Any) -> None:
        try:
            event = Event(torch_event.name, torch_event.timestamp, torch_event.data)
            if self.bus is None:
                log_event(event)
            else:
                self.bus.log_event(event)
            self.forwarded += 1
        except Exception:
            # torch would raise this in the code that logged the event: log it instead.
            self.errors += 1
            now = time.monotonic()
            if now - self._last_error >= _ERROR_LOG_INTERVAL:
                self._last_error = now
                logger.exception("forwarding a torch.monitor event failed (error %d)", self.errors)

    @property
    def active(self) -> bool:
        """Whether the handler is still registered with ``torch.monitor``."""
        return self._handle is not None

    def close(self) -> None:
        """Unregister from ``torch.monitor``. Idempotent; thread-safe."""
        stop_forwarding_torch_monitor(self)

    def __enter__(self) -> TorchMonitorForwarding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        target = "default bus" if self.bus is None else repr(self.bus)
        return f"<TorchMonitorForwarding to {target} ({'active' if self.active else 'stopped'})>"


def forward_torch_monitor(bus: EventBus | None = None) -> TorchMonitorForwarding:
    """Re-log every ``torch.monitor`` event into ``bus``, from now until undone.

    Forwarding to a bus that already receives ``torch.monitor`` events returns the existing
    forwarding instead of registering a second handler, so running the call twice (a notebook
    cell) does not double every event.

    Args:
        bus: the bus to log into; None follows the default bus (``monitor_bus.log_event``),
            whichever it is when each event arrives.

    Returns:
        The forwarding; pass it to ``stop_forwarding_torch_monitor`` or call its ``close()``.

    Raises:
        TypeError: ``bus`` is not an ``EventBus``.
        ImportError: torch is not installed.

    Examples:
        >>> from monitor_bus.integrations.torch import forward_torch_monitor
        >>> forwarding = forward_torch_monitor()  # doctest: +SKIP
        >>> forwarding.close()  # doctest: +SKIP
    """
    if bus is not None and not isinstance(bus, EventBus):
        raise TypeError(f"bus must be an EventBus or None, not {type(bus).__name__}")
    import torch.monitor

    key = 0 if bus is None else id(bus)
    with _lock:
        existing = _active.get(key)
        if existing is not None:
            return existing
        forwarding = TorchMonitorForwarding(bus, key)
        forwarding._handle = torch.monitor.register_event_handler(forwarding)
        _active[key] = forwarding
    return forwarding


def stop_forwarding_torch_monitor(forwarding: TorchMonitorForwarding) -> None:
    """Undo ``forward_torch_monitor``: unregister its ``torch.monitor`` handler.

    Idempotent (torch itself crashes the process when a handle is unregistered twice, so the
    handle is released exactly once). Events torch logs after this returns are not forwarded;
    those already forwarded stay in the bus.

    Raises:
        TypeError: ``forwarding`` is not what ``forward_torch_monitor`` returned.
    """
    if not isinstance(forwarding, TorchMonitorForwarding):
        raise TypeError(
            f"forwarding must be a TorchMonitorForwarding, not {type(forwarding).__name__}"
        )
    with _lock:
        handle, forwarding._handle = forwarding._handle, None
        if _active.get(forwarding._key) is forwarding:
            del _active[forwarding._key]
        if handle is None:
            return
        import torch.monitor

        torch.monitor.unregister_event_handler(handle)


def merge_stats_across_ranks(
    *,
    bus: EventBus | None = None,
    dst: int = 0,
    timeout: float = 30.0,
    keep_local: bool = False,
    spread: bool = True,
    stragglers: Mapping[str, float] | None = None,
    straggler_windows: int = 3,
    exposed_fraction: float | None = 0.2,
    two_level: bool | None = None,
    slowdown: float | None = 0.1,
) -> RankMerge:
    """Merge the Stat windows of every ``torch.distributed`` rank into one stream on ``dst``.

    Call it on every rank, after ``torch.distributed.init_process_group`` (any backend): it
    makes a gloo group of its own (a collective: it waits up to ``timeout`` for every rank to
    call it), moves the bus's Stat windows to wall-clock
    multiples of their size, and from then on each closed window goes to ``dst`` on a thread
    of the merge, never the caller's. ``dst`` logs one ``"torch.monitor.Stat"`` event per
    (Stat name, window) with the usual keys (``"loss.mean"``) plus ``"<name>.ranks"``, the
    number of ranks that contributed. COUNT and SUM add up, MAX and MIN are the max of maxes
    and min of mins (NaN if any rank's is), MEAN is SUM / COUNT, VALUE is the one of the rank whose window closed
    last (on a tie, the higher rank). The event's timestamp is when that window closed.
    Stats merge by name, aggregations and window size (Stats of one name with other
    aggregations make events of their own).
    Plain events are not merged.

    With ``spread`` (the default), the merged window of a Stat with MEAN also holds
    ``"<name>.rank_min"``, ``"<name>.rank_p50"`` and ``"<name>.rank_max"`` over the window
    means of the ranks that contributed, and ``"<name>.slowest_rank"`` (an int: the rank of the
    highest mean; on a tie, the lower rank); ``RankMerge.hosts`` names each rank's host.

    ``stragglers`` maps Stat names to a factor: ``dst`` names a rank whose window mean of that
    Stat exceeds the median of the other ranks' means by the factor for ``straggler_windows`` merged
    windows in a row, once, by a ``STRAGGLER_EVENT`` (``"monitor_bus.straggler"``: ``stat``,
    ``rank``, ``ratio``, ``windows``, ``host``, ``recovered``) and a rate-limited warning, and
    once more (``recovered`` True) when it falls back under the factor. A Stat without MEAN
    or SUM gives a rank's mean from its Histogram or moments (a percentile, HISTOGRAM or
    STDDEV); one with none of them is warned about on ``dst``.

    ``StepAnatomy``'s Stats need no argument: in each merged window of a ``<prefix>.wait_s``
    with a ``<prefix>.time_s`` of the same prefix (both with MEAN, as ``StepAnatomy`` makes
    them), the rank that waits least is over the rule when the median of the other ranks'
    wait means minus its own, its exposed time per step, is at least ``exposed_fraction`` of
    the merged step time. After ``straggler_windows`` such windows in a row ``dst`` logs a
    ``STRAGGLER_EVENT`` with ``stat`` (``"<prefix>.wait_s"``), ``rank``, ``host``, ``stage``
    (the stage whose ``busy_s`` on that rank exceeds the median of the others' the most, when
    that is at least half the exposed time; ``""`` otherwise, as in a step without stages),
    ``exposed_s`` (its mean exposed seconds per step
    over the windows so far), ``cause`` (``"gc"`` when its ``<prefix>.gc_s`` over the others'
    median is at least half of that, else ``""``), ``windows`` and ``recovered``, and once
    more, ``recovered`` True, in its first window back under the rule. With ``spread``, rule
    on or off, the merged ``<prefix>.wait_s`` also holds ``"<prefix>.wait_s.lost_s"`` (the
    median of the other ranks' wait means minus the lowest: what the job lost per step waiting
    for that rank) and ``"<prefix>.wait_s.lost_to_rank"`` (that rank), and after the family's
    windows ``dst`` logs an ``ANATOMY_EVENT`` with each rank's means (what ``monitor-bus
    summary`` and ``plot`` read).

    A hang is named while it lasts: each rank's open ``StepAnatomy``s report, about once a
    second, how long since a step last ended on it, its stage and whether it waits in a
    collective. Once no step has ended on any rank for its ``hang_after`` (a minute by
    default), ``dst`` logs a ``HANG_EVENT`` (``"monitor_bus.hang"``: ``rank``, ``host``,
    ``stage``, ``in_step``, ``waits``, ``waiting``, ``seconds``, ``silent_s``) and a warning for
    each rank not waiting in a collective, the one the others wait for; if every rank waits,
    for each rank. Once per hang: it is named again after a step has ended on some rank.

    ``dst`` also watches each StepAnatomy family's merged step time (the MEAN of
    ``<prefix>.time_s``) for a lasting change: when the job gets and stays ``slowdown``
    (default 10%) slower it logs a ``SLOWDOWN_EVENT`` (``"monitor_bus.slowdown"``: ``stat``,
    ``before`` and ``after``, the median step times in seconds, ``ratio``, ``began``, the
    stamp of the first slower window, ISO 8601, and ``windows``) and a rate-limited
    warning, once; then the slower level is the baseline. Noise, a single spike, a shift of
    half ``slowdown`` or a slow drift names nothing, nor does the first windows' warm-up or
    a speed-up (the rule: ``monitor_bus.ranks.SlowdownRule``, in docs/multihost.md).

    With ``two_level`` (by default, once a host other than ``dst``'s runs two or more ranks),
    the lowest rank of each host (a torchrun node: ``GROUP_RANK``, so two nodes on one machine
    are two hosts) merges its host's windows and sends ``dst`` one record per window, holding
    each rank's count and sum, so everything above, the spread and stragglers included, comes
    out as in the flat shape (every rank to ``dst``), but ``dst`` receives from hosts, not
    ranks. The ranks of ``dst``'s own host send to it directly.

    The other ranks do not log their Stat windows (``keep_local=True`` logs them too). A rank
    that dies or hangs costs only what it had not sent: ``dst`` waits ``timeout`` past a
    window's end at most, merges the window among the ranks that reported it and logs a
    warning naming the others. If ``dst`` is gone, each rank logs its own windows with
    ``"<name>.rank"`` (its rank) added, and counts them in ``local``; one stopped or starved
    (taking no message for ``timeout``) is warned about and waited for, each rank holding its
    windows until it runs again or the rank's ``close()`` gives it up. A rank named lost
    may only be starved of CPU: when it speaks again it rejoins, and ``dst``'s ``close()``
    waits (within its timeout) for every rank it has heard from; windows that come after
    theirs was merged are logged on their own, marked ``"<name>.late": True``, and counted in
    ``late``. A window too large for a frame is sent with its Histogram coarsened (warned);
    one that cannot fit even so is logged by its rank and counted in ``unsent``.

    Args:
        bus: the bus whose Stats are merged; the default bus if omitted.
        dst: the rank that logs the merged windows.
        timeout: seconds any wait of the exchange may take: how long past a window's
            end dst waits for a rank, how long a rank may stay silent before dst stops
            waiting for it (or a send untaken before it is warned about), and
            ``close()``'s default.
        keep_local: also log each rank's own windows on its bus, as without the merge.
        spread: add the spread across ranks to each merged window of a Stat with MEAN.
        stragglers: Stat name -> factor (a number above 1) for naming straggling ranks.
        straggler_windows: how many merged windows in a row make a straggler (at least 1).
        exposed_fraction: the part of the step the other ranks wait for a rank that puts it
            over ``StepAnatomy``'s rule (above 0, at most 1); None turns that rule off.
        slowdown: the part slower (0.1: 10%) the job's step (each StepAnatomy family's
            merged ``<prefix>.time_s``) must get and stay for ``dst`` to name a slowdown
            (a positive number); None turns the rule off.
        two_level: True: each host's leader merges its host first; False: every rank sends
            to ``dst`` (flat); None: two-level once a host other than ``dst``'s has two or
            more ranks.

    Returns:
        The running merge: ``close()`` it (or use it as a context manager) before the
        process group is destroyed; it is closed at interpreter exit otherwise.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``dst`` is not a rank of the job, ``timeout`` is not positive, a factor of
            ``stragglers`` is not above 1, ``straggler_windows`` is below 1 or
            ``exposed_fraction`` is not in (0, 1] or ``slowdown`` is not positive.
        RuntimeError: ``torch.distributed`` is not initialized, or the bus is merged already.
        ImportError: torch is not installed.

    Examples:
        >>> from monitor_bus.integrations.torch import merge_stats_across_ranks
        >>> with merge_stats_across_ranks(timeout=10.0):  # doctest: +SKIP
        ...     train()
    """
    if bus is None:
        bus = get_default_bus()
    elif not isinstance(bus, EventBus):
        raise wrong_type("bus", "a monitor_bus.EventBus or None", bus)
    return start_merge(
        bus,
        dst=dst,
        timeout=timeout,
        keep_local=keep_local,
        spread=spread,
        stragglers=stragglers,
        straggler_windows=straggler_windows,
        exposed_fraction=exposed_fraction,
        two_level=two_level,
        slowdown=slowdown,
    )
