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

``merge_stats_across_ranks`` (in ``_merge``) merges the Stat windows of every
``torch.distributed`` rank into one stream on one rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .._bus import EventBus
from .._default import log_event
from .._event import Event
from .._lifecycle import module_lock
from ._merge import STRAGGLER_EVENT as STRAGGLER_EVENT
from ._merge import RankMerge as RankMerge
from ._merge import merge_stats_across_ranks as merge_stats_across_ranks

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
