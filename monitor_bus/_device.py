"""Device values: tensors and arrays logged without reading them on the caller's thread.

Guarantees
----------
- The caller never reads a device value. ``capture`` runs on the caller's thread and only does
  what is asynchronous: for a torch tensor, ``detach()`` and a copy to host memory
  (``non_blocking`` from an accelerator, with a stream event recorded after it), so a later
  in-place update of the caller's tensor cannot change what was logged, and no autograd graph
  is kept. The value is read later, on a thread of the bus (``Deferred.value``).
- One path for every device: a CPU tensor takes the same steps as a CUDA one; its copy is a
  ``clone()``, done when it returns, so ``_mark_copy`` returns None for it.
- Nothing here imports torch or numpy: a value is a torch tensor only if torch is already in
  ``sys.modules`` (whoever made the tensor imported it).
- Host arrays (numpy, or a ``__dlpack__`` object in CPU memory) are read at the call: their
  memory is the host's, so reading them waits for no device, and the read is the copy that
  keeps what was logged.
- Delivery never blocks the loop on a device: the dispatcher asks ``ready()`` and, for a value
  that is not, calls ``wait()`` on a worker thread of its loop. The calls that must deliver
  everything queued first (``flush``, ``close``, registering or unregistering a handler) wait
  for the device on the loop, as long as the device takes.
"""

from __future__ import annotations

import sys
from typing import Any

from ._check import type_name

# Set once a device value has been captured in this process: until then the dispatcher does
# not look for them.
used = False

# DLPack device types whose memory the host reads directly (kDLCPU, kDLCUDAHost, kDLROCMHost).
_HOST_DEVICES = frozenset((1, 3, 11))


class Deferred:
    """A device value captured at ``log_event`` or ``Stat.add``, read on a thread of the bus."""

    __slots__ = ("_copy", "_mark", "_read", "_value")

    def __init__(self, copy: Any, mark: Any, read: Any) -> None:
        self._copy = copy  # the caller's value as it was at the call: a copy of its own
        self._mark = mark  # a stream event recorded after the copy, or None (nothing to wait)
        self._read = read  # the copy's Python scalar; called once, off the caller's thread
        self._value: Any = UNREAD

    def ready(self) -> bool:
        """Whether reading the value now waits for no device (the loop asks this)."""
        mark = self._mark
        return mark is None or mark.query()

    def wait(self) -> None:
        """Read the value, waiting for the device: only on a worker thread, never the loop."""
        if self._value is UNREAD:
            mark = self._mark
            if mark is not None:
                mark.synchronize()
            self._resolve()

    def value(self) -> float | int | bool:
        """The Python scalar (after ``ready()`` or ``wait()``). Frees the copy."""
        if self._value is UNREAD:
            self._resolve()
        return self._value  # type: ignore[no-any-return]

    def _resolve(self) -> None:
        # Two threads may read at once (a flush on the loop while a worker waits for the
        # device; the caller comparing its own Event): the value is stored before the copy is
        # let go, so whoever finds the copy gone finds the value.
        copy = self._copy
        if copy is None:
            return
        self._value = self._read(copy)
        self._copy = self._mark = None  # device and host memory go as soon as the value is read

    # The caller's own Event holds this in its data: comparing or converting it reads the
    # value there, on the caller's thread, as the caller asked. The bus never does.

    def __eq__(self, other: object) -> bool:
        self.wait()
        return self._value == other  # type: ignore[no-any-return]

    __hash__ = None  # type: ignore[assignment]

    def __float__(self) -> float:
        self.wait()
        return float(self._value)

    def __int__(self) -> int:
        self.wait()
        return int(self._value)

    def __bool__(self) -> bool:
        self.wait()
        return bool(self._value)

    def __format__(self, spec: str) -> str:
        self.wait()
        return format(self._value, spec)

    def __repr__(self) -> str:
        self.wait()
        return repr(self._value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (a child process sending to its parent): as the value, read now.
        self.wait()
        return (_identity, (self._value,))


UNREAD = object()  # a Deferred's value before it is read


def _identity(value: Any) -> Any:
    return value


ARRAY_CLASSES: dict[type, bool] = {}


def array_class(cls: type) -> bool:
    """Whether values of ``cls`` are arrays or tensors for ``capture`` (by the protocols the
    class has; remembered per class, for the classes ``Stat.add`` sees again and again)."""
    known = ARRAY_CLASSES.get(cls)
    if known is None:
        known = getattr(cls, "__dlpack_device__", None) is not None or (
            getattr(cls, "__array__", None) is not None and getattr(cls, "ndim", None) is None
        )
        if len(ARRAY_CLASSES) < 256:  # a bound, should classes be made on the fly
            ARRAY_CLASSES[cls] = known
    return known


def capture(name: str, value: object) -> Any:
    """What to log for ``value``: a ``Deferred`` for a value on a device, the Python scalar
    for a host array or scalar that holds one element, ``value`` itself for anything else.

    Raises:
        TypeError: ``value`` is an array or tensor holding more or fewer than one element, or
            a complex one; the message names ``name``.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _capture_tensor(name, value, torch)
    device = getattr(value, "__dlpack_device__", None)
    if device is not None and device()[0] not in _HOST_DEVICES:
        return _capture_array(name, value)
    if getattr(value, "ndim", None) is None and (
        device is not None or getattr(value, "__array__", None) is not None
    ):
        # Known only through a protocol: numpy reads it (host memory; imported only here).
        import numpy

        value = numpy.from_dlpack(value) if device is not None else numpy.asarray(value)  # type: ignore[arg-type]
    return one_value(name, value)


def _capture_tensor(name: str, value: Any, torch: Any) -> Deferred:
    global used
    used = True
    tensor = value.detach()
    n = tensor.numel()
    if n != 1:
        raise TypeError(f"{name} must hold one value, not a {type_name(value)} of {n} elements")
    if tensor.is_complex():
        raise TypeError(f"{name} must be a real number, not a complex tensor")
    # Host memory of its own: a clone on the CPU; from an accelerator a copy queued on the
    # current stream (non_blocking copies to pinned memory).
    copy = tensor.clone() if tensor.is_cpu else tensor.to("cpu", non_blocking=True, copy=True)
    return Deferred(copy, _mark_copy(tensor, torch), _read_tensor)


def _mark_copy(tensor: Any, torch: Any) -> Any:
    """A stream event recorded after the copy, or None where the copy is already done."""
    if tensor.is_cpu:  # 0.05 us, against 0.3 us for device.type
        return None
    kind = tensor.device.type
    if kind == "cuda":
        event = torch.cuda.Event()
        event.record()
        return event
    # Another accelerator (mps, xpu): its module's synchronize() waits for the copy.
    return _Unmarked(getattr(getattr(torch, kind, None), "synchronize", None))


class _Unmarked:
    """A device without a stream event to poll: the value is read on a worker thread, after
    ``sync`` (None: reading the copy waits for the device by itself)."""

    __slots__ = ("_done", "_sync")

    def __init__(self, sync: Any = None) -> None:
        self._sync = sync
        self._done = False

    def query(self) -> bool:
        # False until a worker has waited: then the loop reads, and a read that fails there
        # is counted (the worker's attempt is not).
        return self._done

    def synchronize(self) -> None:
        if self._sync is not None:
            self._sync()
        self._done = True


def _read_tensor(copy: Any) -> float | int | bool:
    return copy.item()  # type: ignore[no-any-return]


def _capture_array(name: str, array: Any) -> Deferred:
    """An array on a device, from a library this package does not know (CuPy, JAX)."""
    global used
    used = True
    size = getattr(array, "size", None)
    if isinstance(size, int) and size != 1:
        raise TypeError(f"{name} must hold one value, not a {type_name(array)} of {size} elements")
    copy = getattr(array, "copy", None)
    # The library's own copy is a device-side one, queued like any kernel; JAX arrays are
    # immutable and need none.
    return Deferred(copy() if callable(copy) else array, _Unmarked(), _read_array)


def _read_array(copy: Any) -> float | int | bool:
    value = one_value("value", copy)
    return value if value.__class__ in (float, int, bool) else float(value)  # type: ignore[arg-type]


def one_value(name: str, value: object) -> object:
    """The Python scalar held by a one-element host array or numpy scalar (via its ``item()``);
    any other value unchanged.

    Raises:
        TypeError: ``value`` holds more than one element (or none); the message names ``name``.
    """
    ndim = getattr(value, "ndim", None)
    item = getattr(value, "item", None) if ndim is not None else None
    if item is None or value.__class__ in (str, int, float, bool):
        return value
    if ndim == 0:  # a numpy scalar or a 0-d array
        kind = getattr(getattr(value, "dtype", None), "kind", None)  # numpy's: no item() call
        if kind == "f":
            return float(value)  # type: ignore[arg-type]
        if kind == "i" or kind == "u":
            return int(value)  # type: ignore[call-overload]
        if kind == "b":
            return bool(value)
        return item()
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", None)
    if not isinstance(size, int):
        return value
    if size != 1:
        raise TypeError(f"{name} must hold one value, not a {type_name(value)} of {size} elements")
    return item()
