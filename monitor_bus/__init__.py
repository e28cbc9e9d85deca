"""Events and windowed counters for training code, with ``torch.monitor``'s API and a
non-blocking dispatcher: ``import monitor_bus as monitor``."""

from __future__ import annotations

import contextlib as _contextlib

from ._aggregates import Aggregation as Aggregation
from ._bus import EventBus as EventBus
from ._default import aflush as aflush
from ._default import configure_default_bus as configure_default_bus
from ._default import flush as flush
from ._default import get_default_bus as get_default_bus
from ._default import log as log
from ._default import log_event as log_event
from ._default import register_event_handler as register_event_handler
from ._default import subscribe as subscribe
from ._default import unregister_event_handler as unregister_event_handler
from ._event import Event as Event
from ._event import EventOrigin as EventOrigin
from ._event import data_value_t as data_value_t
from ._handler import EventHandler as EventHandler
from ._handler import EventHandlerHandle as EventHandlerHandle
from ._histogram import Histogram as Histogram
from ._jsonl import JsonlEventHandler as JsonlEventHandler
from ._jsonl_read import read_jsonl as read_jsonl
from ._process_handler import ProcessHandler as ProcessHandler
from ._run import METRICS_EVENT as METRICS_EVENT
from ._run import RUN_END_EVENT as RUN_END_EVENT
from ._run import RUN_START_EVENT as RUN_START_EVENT
from ._run import RUN_STATUSES as RUN_STATUSES
from ._run import Run as Run
from ._stat import Stat as Stat
from ._subscription import EventFilter as EventFilter
from ._subscription import Subscription as Subscription
from ._tensorboard_handler import TensorboardEventHandler as TensorboardEventHandler
from ._version import __version__ as __version__
from ._window import STAT_EVENT as STAT_EVENT

__all__ = [
    "Aggregation",
    "Event",
    "EventBus",
    "EventFilter",
    "EventHandler",
    "EventHandlerHandle",
    "EventOrigin",
    "Histogram",
    "JsonlEventHandler",
    "METRICS_EVENT",
    "ProcessHandler",
    "RUN_END_EVENT",
    "RUN_START_EVENT",
    "RUN_STATUSES",
    "Run",
    "STAT_EVENT",
    "Stat",
    "Subscription",
    "TensorboardEventHandler",
    "aflush",
    "configure_default_bus",
    "data_value_t",
    "flush",
    "get_default_bus",
    "log",
    "log_event",
    "read_jsonl",
    "register_event_handler",
    "subscribe",
    "unregister_event_handler",
]

# Public objects report the public module, so reprs and tracebacks show monitor_bus.X.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("monitor_bus._"):
        with _contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = __name__
del _name, _obj, _contextlib
