"""One home for argument checks: every message names the argument and what was given."""

from __future__ import annotations

import math
import os


def type_name(value: object) -> str:
    """``int`` for builtins, ``module.Qualname`` otherwise (``torch.monitor.Event``)."""
    cls = type(value)
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    if module.startswith("torch._C._monitor") or module == "torch.monitor":
        module = "torch.monitor"  # where users import it from
    return f"{module}.{cls.__qualname__}"


def wrong_type(name: str, expected: str, value: object) -> TypeError:
    """A TypeError for argument ``name``, with a migration hint for torch.monitor objects."""
    message = f"{name} must be {expected}, not {type_name(value)}"
    if type_name(value).startswith("torch.monitor."):
        message += (
            ": monitor_bus does not take torch.monitor objects; use the monitor_bus ones of the"
            " same name (import monitor_bus as monitor)"
        )
    return TypeError(message)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; bools are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(name, "an int", value)
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_timeout(name: str, value: object, *, allow_none: bool = True) -> float | None:
    """Seconds as a float, or None for no limit (``math.inf`` means no limit too)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expected = "a number of seconds" + (" or None" if allow_none else "")
        raise wrong_type(name, expected, value)
    if not value >= 0:  # NaN fails this too
        raise ValueError(f"{name} must be >= 0, got {value}")
    return None if math.isinf(value) else float(value)


def check_path(name: str, value: str | os.PathLike[str]) -> str:
    """``value`` as the str of a file system path: a str or an ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or path, not {type(value).__name__}")
    return os.fspath(value)
