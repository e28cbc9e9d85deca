"""A training step's anatomy: where each step's time goes on this rank, as Stats.

``StepAnatomy`` times each training step, the stages the caller marks inside it, the time the
rank waited in collectives, and Python's GC pauses. In a synchronized job (DDP) the all-reduce
makes every rank's step as long as the slowest one's, so the step time cannot tell which rank
is slow; the wait can (the slow rank waits least), and each stage's time outside the wait says
where the slow rank spends what the others wait for.

Guarantees
----------
- The training thread only reads ``time.perf_counter`` and appends to lists while a step runs;
  the Stats are added when the step ends (``Stat.add``: lock-free unless a window closes). No
  device sync, no collective of its own, no thread of its own.
- The wait is the time covered by the union of the intervals in which a collective was in
  flight, clipped to the step: each bucket of DDP's all-reduce from its launch (the comm hook,
  on the thread running backward) to its future's completion (a ``then`` callback, on the
  thread that completes it), and each ``collective()`` block. Overlapping intervals count once.
  A bucket still in flight when a step ends counts in the next step too, from that step's start.
- GC: while the anatomy is open, a ``gc.callbacks`` callback takes two times per collection
  and appends them to a deque, nothing more (a collection can start anywhere, inside a Stat's
  lock too, so it takes no lock); the training thread turns them into Stats at each step's
  end and at ``close()``. A pause counts in the stage and the step it overlaps.
- torch is imported only when a model is given. ``close()`` removes the gc callback; DDP
  cannot unregister a comm hook, so the hook stays, all-reducing untimed.
- One anatomy is driven by one training thread: ``step``, ``stage`` and ``collective`` are not
  thread-safe (the comm hook's and the gc callback's records are).
- Progress: ``progress()`` says, from any thread, where this process's open anatomies are (the
  seconds since a step last ended, the stage, whether a collective is in flight) by reading
  what the training thread keeps anyway, plus one time it takes already (a step's end): it
  costs the training thread nothing more. Reading races only with a step's edges, where it may
  see the step just ended or just begun. The open anatomies are a snapshot published under a
  lock, at construction and ``close()``.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from ._aggregates import Aggregation
from ._bus import EventBus
from ._check import wrong_type
from ._lifecycle import module_lock
from ._stat import Stat

# The anatomy's clock, a module attribute so tests can step time (the Stats' windows keep
# their own clock, ``_stat._clock``).
_clock: Callable[[], float] = time.perf_counter

#: The aggregations of the per-step Stats: MEAN for the rules comparing ranks, MAX for spikes.
STEP_AGGREGATIONS = (Aggregation.MEAN, Aggregation.MAX)
#: The aggregations of the per-collection GC Stats: COUNT is the collections in a window.
GC_AGGREGATIONS = (Aggregation.COUNT, Aggregation.MEAN, Aggregation.MAX)

_Interval = tuple[float, float]

_lock = module_lock(__name__, "_lock")  # changes to _open
_open: tuple[StepAnatomy, ...] = ()  # the open anatomies: a snapshot, replaced under _lock


class Progress(NamedTuple):
    """Where this process's training is, from its open ``StepAnatomy``s (``progress()``)."""

    #: Seconds since a step last ended (or, before the first, since the anatomy opened).
    seconds: float
    #: The stage it is in; ``""`` in a step outside every stage, or between steps.
    stage: str
    #: Whether it is inside a step (False: between steps, as in an evaluation or a save).
    in_step: bool
    #: Whether it waits in a collective: a DDP bucket launched and not completed, or a
    #: ``collective()`` block.
    waits: bool
    #: Its anatomy's ``hang_after``.
    hang_after: float


def progress() -> Progress | None:
    """Where this process's training is now, from its open ``StepAnatomy``s; None if none is.

    With several open (a training and an evaluation anatomy), a step ended in any of them is
    progress: ``seconds`` is since the latest one; the stage, ``in_step`` and ``hang_after``
    are those of the anatomy that moved last (its step began or ended last); ``waits`` is
    whether any has a collective in flight. Thread-safe; it takes no lock the training
    thread takes.
    """
    anatomies = _open
    if not anatomies:
        return None
    now = _clock()
    last = max(anatomies, key=StepAnatomy._moved)
    stage = last._stage
    return Progress(
        seconds=now - max(a._last_end for a in anatomies),
        stage=stage or "",
        in_step=last._step_start is not None,
        waits=any(w[1] == math.inf for a in anatomies for w in list(a._waits)),
        hang_after=last.hang_after,
    )


class StepAnatomy:
    """Where each training step's time goes on this rank: its stages, the wait, GC, as Stats.

    Wrap each training step in ``step()``, its parts in ``stage(name)``, and a collective
    called by hand in ``collective()``. Given a ``DistributedDataParallel`` model, it also times
    the wait in DDP's gradient all-reduce: a communication hook doing what the default one
    (``allreduce_hook``) does, the bucket divided by the group's size and summed across it,
    notes when each bucket is launched and when it completes. A model that
    already has a communication hook is refused (one hook per model, as DDP allows).

    Each Stat below is added once per step (a stage's, once per step the stage ran in, its
    blocks summed), in seconds, with MEAN and MAX, over ``window``:

    - ``<prefix>.time_s``: the step, from entering ``step()`` to leaving it.
    - ``<prefix>.wait_s``: the time in it a collective was in flight (DDP's buckets,
      ``collective()`` blocks), overlaps counted once. The slow rank waits least.
    - ``<prefix>.gc_s``: the GC pauses in the step.
    - ``<prefix>.<stage>.time_s``: the stage's time.
    - ``<prefix>.<stage>.busy_s``: the stage's time outside the wait, what the rank spent on
      its own work (with DDP, backward's computation; the rest of backward is the wait).
    - ``<prefix>.<stage>.gc_s``: the GC pauses in the stage.

    And, with COUNT, MEAN and MAX, one value per collection while the
    anatomy is open: ``<prefix>.gc.gen<N>_s``, the pause of a collection of generation N.

    Merged across ranks (``merge_stats_across_ranks``), the Stats' spread compares the ranks.

    The anatomy is open from construction to ``close()`` (or the end of its ``with`` block);
    ``step``, ``stage`` and ``collective`` are meant for the training thread only.

    Args:
        model: a ``torch.nn.parallel.DistributedDataParallel`` whose all-reduce wait is
            timed, or None (then only ``collective()`` blocks are waits).
        window: the Stats' window, at least one millisecond.
        prefix: the start of the Stats' names.
        bus: the bus of the Stats; the default bus if omitted.
        hang_after: seconds without a step ending, on any rank, after which the job counts
            as hung: ``merge_stats_across_ranks()`` then names each rank not waiting in a
            collective by a ``HANG_EVENT`` (see docs/multihost.md, "A hung rank"). The
            default, a minute, is far past any step of a healthy job and far under the
            timeouts of gloo (30 minutes) and NCCL (10), so a hang is named while the job
            still runs. Read at each report (about once a second): it may be changed.

    Raises:
        TypeError: an argument has the wrong type (``model`` not a DDP model).
        ValueError: ``window`` is under a millisecond, ``prefix`` is empty, ``hang_after`` is
            not a positive number of seconds, or ``model`` already has a communication hook.
        ImportError: a model is given and torch is not installed.

    Examples:
        >>> from datetime import timedelta
        >>> with StepAnatomy(window=timedelta(seconds=10)) as anatomy:
        ...     for batch in range(3):
        ...         with anatomy.step():
        ...             with anatomy.stage("data"):
        ...                 pass
        ...             with anatomy.stage("forward"):
        ...                 pass
        >>> sorted(anatomy.stats)[:4]
        ['step.data.busy_s', 'step.data.gc_s', 'step.data.time_s', 'step.forward.busy_s']
    """

    def __init__(
        self,
        model: Any = None,
        *,
        window: timedelta = timedelta(seconds=1),
        prefix: str = "step",
        bus: EventBus | None = None,
        hang_after: float = 60.0,
    ) -> None:
        if not isinstance(window, timedelta):
            raise wrong_type("window", "a timedelta", window)
        if window < timedelta(milliseconds=1):
            raise ValueError(f"window must be at least 1 millisecond, got {window!r}")
        if not isinstance(prefix, str):
            raise wrong_type("prefix", "a str", prefix)
        if not prefix:
            raise ValueError("prefix must not be empty")
        if bus is not None and not isinstance(bus, EventBus):
            raise wrong_type("bus", "a monitor_bus.EventBus or None", bus)
        self.hang_after = hang_after
        #: The Stats' window.
        self.window = window
        #: The start of the Stats' names.
        self.prefix = prefix
        #: The DDP model whose all-reduce is timed, or None.
        self.model = model
        self._bus = bus
        self._closed = False
        self._step_start: float | None = None
        self._stage: str | None = None
        self._stage_start = 0.0
        self._waits: list[list[float]] = []  # [launched, completed or inf], any thread appends
        self._blocks: list[tuple[str, float, float]] = []  # this step's stages
        self._pauses: deque[tuple[int, float, float]] = deque()  # (generation, start, end)
        self._gc_began: float | None = None
        self._stats: dict[str, Stat] = {}
        self._stage_stats: dict[str, tuple[Stat, Stat, Stat]] = {}
        self._gc_stats: dict[int, Stat] = {}
        self._step_cm = _Step(self)
        if model is not None:
            self._hook(model)
        self._time = self._stat("time_s")
        self._wait = self._stat("wait_s")
        self._gc = self._stat("gc_s")
        for generation in range(3):
            self._gc_stat(generation)
        self._on_gc = self._gc_callback  # the one bound method to remove at close
        gc.callbacks.append(self._on_gc)
        self._last_end = _clock()  # when the last step ended, or the anatomy opened
        global _open
        with _lock:
            _open = (*_open, self)

    @property
    def hang_after(self) -> float:
        """Seconds without a step ending, on any rank, after which the job counts as hung.

        Settable from any thread (checked as the argument is): raise it around a long
        evaluation or save between steps, which would otherwise count as a hang.
        """
        return self._hang_after

    @hang_after.setter
    def hang_after(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise wrong_type("hang_after", "a number of seconds", seconds)
        if not 0 < seconds < math.inf:
            raise ValueError(f"hang_after must be a positive number of seconds, got {seconds}")
        self._hang_after = float(seconds)

    @property
    def stats(self) -> dict[str, Stat]:
        """The Stats made so far, by name (a stage's appear once its first step ends)."""
        return dict(self._stats)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def step(self) -> _Step:
        """A context manager around one training step; its Stats are added as it ends.

        Raises:
            RuntimeError: (on entering) a step is open already, or the anatomy is closed.
        """
        return self._step_cm

    def stage(self, name: str) -> _Stage:
        """A context manager around one part of the step, named ``name``.

        Stages do not nest; a stage may run several times in a step (gradient accumulation):
        its Stats get the step's sum. Time in the step outside every stage is in the step's
        time only.

        Args:
            name: ``"data"``, ``"forward"``, ``"backward"``, ``"optimizer"`` or any other
                non-empty name without a dot (the dot separates the parts of a Stat's name).

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: ``name`` is empty or holds a dot.
            RuntimeError: (on entering) no step is open, a stage is open already, or the
                anatomy is closed.
        """
        if not isinstance(name, str):
            raise wrong_type("name", "a str", name)
        if not name or "." in name:
            raise ValueError(f"name must be a non-empty stage name without a dot, got {name!r}")
        return _Stage(self, name)

    def collective(self) -> _Collective:
        """A context manager around a collective called by hand: its time counts as wait.

        Raises:
            RuntimeError: (on entering) no step is open, or the anatomy is closed.
        """
        return _Collective(self)

    def close(self) -> None:
        """Stop timing GC (remove the gc callback) and add the pauses not yet added.

        Idempotent. A DDP comm hook stays registered (DDP cannot remove one) but times nothing.
        """
        if self._closed:
            return
        self._closed = True
        global _open
        with _lock:
            _open = tuple(a for a in _open if a is not self)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._drain_pauses()

    def __enter__(self) -> StepAnatomy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        model = "" if self.model is None else f"{type(self.model).__name__}, "
        return f"<StepAnatomy {model}prefix={self.prefix!r} ({state})>"

    # -- the training thread's side ------------------------------------------------------------

    def _check_open(self, what: str, *, in_step: bool = True) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on a closed StepAnatomy")
        if in_step and self._step_start is None:
            raise RuntimeError(f"{what} is only valid inside step()")

    def _begin_step(self) -> None:
        self._check_open("step()", in_step=False)
        if self._step_start is not None:
            raise RuntimeError("step() inside step(): steps do not nest")
        self._step_start = _clock()

    def _begin_stage(self, name: str) -> None:
        self._check_open(f"stage({name!r})")
        if self._stage is not None:
            raise RuntimeError(f"stage({name!r}) inside stage({self._stage!r}): stages do not nest")
        self._stage = name
        self._stage_start = _clock()

    def _end_stage(self) -> None:
        if self._stage is not None:  # None: its step ended first
            self._blocks.append((self._stage, self._stage_start, _clock()))
            self._stage = None

    def _end_step(self) -> None:
        end = _clock()
        start, self._step_start = self._step_start, None
        if start is None:
            return
        self._last_end = end
        if self._stage is not None:  # a stage left open: it ends with the step
            self._blocks.append((self._stage, self._stage_start, end))
            self._stage = None
        waits = self._waits
        self._waits = [w for w in waits if w[1] == math.inf]  # in flight: the next step's too
        waited = _union(waits, start, end)
        pauses = self._drain_pauses()
        self._time.add(end - start)
        self._wait.add(sum(e - s for s, e in waited))
        self._gc.add(_overlap(pauses, start, end))
        blocks, self._blocks = self._blocks, []
        totals: dict[str, list[float]] = {}
        for name, s, e in blocks:
            total = totals.setdefault(name, [0.0, 0.0, 0.0])
            took = e - s
            total[0] += took
            # Most steps have no wait or pause in a stage: no overlap to compute.
            total[1] += max(0.0, took - _overlap(waited, s, e) if waited else took)
            if pauses:
                total[2] += _overlap(pauses, s, e)
        for name, values in totals.items():
            stats = self._stage_stats.get(name) or self._add_stage(name)
            for stat, value in zip(stats, values, strict=True):
                stat.add(value)

    def _drain_pauses(self) -> list[_Interval]:
        """The GC pauses recorded since the last drain, each added to its generation's Stat."""
        pauses = []
        while self._pauses:  # the gc callback may append meanwhile: those are taken too
            generation, s, e = self._pauses.popleft()
            (self._gc_stats.get(generation) or self._gc_stat(generation)).add(e - s)
            pauses.append((s, e))
        return pauses

    def _stat(self, suffix: str, aggregations: tuple[Aggregation, ...] = STEP_AGGREGATIONS) -> Stat:
        name = f"{self.prefix}.{suffix}"
        stat = self._stats[name] = Stat(name, aggregations, self.window, bus=self._bus)
        return stat

    def _add_stage(self, name: str) -> tuple[Stat, Stat, Stat]:
        stats = self._stage_stats[name] = (
            self._stat(f"{name}.time_s"),
            self._stat(f"{name}.busy_s"),
            self._stat(f"{name}.gc_s"),
        )
        return stats

    def _gc_stat(self, generation: int) -> Stat:
        stat = self._gc_stats[generation] = self._stat(f"gc.gen{generation}_s", GC_AGGREGATIONS)
        return stat

    # -- other threads' side: the gc callback, the comm hook and progress() ------------------

    def _moved(self) -> float:
        """When this anatomy last moved: its open step's start, or its last step's end."""
        start = self._step_start
        return self._last_end if start is None else max(start, self._last_end)

    def _gc_callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = _clock()
        elif self._gc_began is not None:
            self._pauses.append((info["generation"], self._gc_began, _clock()))
            self._gc_began = None

    def _hook(self, model: Any) -> None:
        """Register the comm hook timing ``model``'s all-reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise wrong_type("model", "a torch.nn.parallel.DistributedDataParallel or None", model)
        taken = ValueError(
            "model already has a communication hook (DDP takes one): StepAnatomy times the"
            " default all-reduce only; pass model=None and wrap your collectives in collective()"
        )
        if getattr(model, "_comm_hooks", None):
            raise taken

        def timed_allreduce(group: Any, bucket: Any) -> Any:
            launched = _clock()
            tensor = bucket.buffer()
            if tensor.is_complex():  # all_reduce's own handling of a complex bucket
                future = allreduce_hook(group, bucket)
                first = False
            else:
                # allreduce_hook's work without torch.distributed.all_reduce's Python layers
                # (their checks and logging cost more than the rest of a bucket's hook): the
                # bucket divided by the group's size (by 1, the same bucket), summed across it.
                size = group.size()
                if size != 1:
                    tensor.div_(size)
                future = group.allreduce([tensor]).get_future()  # its value: [tensor]
                first = True
            if self._step_start is None or self._closed:
                return future.then(_first_value) if first else future
            return self._timed(launched, future, first=first)

        # DDP checks the hook's annotations against its own types, and this module's are strings.
        timed_allreduce.__annotations__.clear()
        try:
            model.register_comm_hook(model.process_group, timed_allreduce)
        except RuntimeError as exc:  # a built-in hook (not in _comm_hooks) was registered
            if "only be called once" not in str(exc):
                raise
            raise taken from None

    def _timed(self, launched: float, future: Any, *, first: bool = False) -> Any:
        """``future`` chained to note when it completes, as a wait from ``launched``; the
        chained future's value is its value (its first, a process group's list, with
        ``first``): DDP's bucket, or the all-reduce's error."""
        interval = [launched, math.inf]
        self._waits.append(interval)

        def completed(done: Any) -> Any:
            interval[1] = _clock()
            return done.value()[0] if first else done.value()

        return future.then(completed)


class _Step:
    """``StepAnatomy.step()``'s context manager (one per anatomy, reused)."""

    __slots__ = ("_anatomy",)

    def __init__(self, anatomy: StepAnatomy) -> None:
        self._anatomy = anatomy

    def __enter__(self) -> None:
        self._anatomy._begin_step()

    def __exit__(self, *exc: object) -> None:
        self._anatomy._end_step()


class _Stage:
    """``StepAnatomy.stage(name)``'s context manager."""

    __slots__ = ("_anatomy", "_name")

    def __init__(self, anatomy: StepAnatomy, name: str) -> None:
        self._anatomy = anatomy
        self._name = name

    def __enter__(self) -> None:
        self._anatomy._begin_stage(self._name)

    def __exit__(self, *exc: object) -> None:
        self._anatomy._end_stage()


class _Collective:
    """``StepAnatomy.collective()``'s context manager: its block is a wait."""

    __slots__ = ("_anatomy", "_interval")

    def __init__(self, anatomy: StepAnatomy) -> None:
        self._anatomy = anatomy
        self._interval = [0.0, math.inf]

    def __enter__(self) -> None:
        self._anatomy._check_open("collective()")
        self._interval[0] = _clock()
        self._anatomy._waits.append(self._interval)

    def __exit__(self, *exc: object) -> None:
        self._interval[1] = _clock()


def _first_value(future: Any) -> Any:
    """A process group's future's first value: the bucket, as DDP takes it."""
    return future.value()[0]


def _union(intervals: list[list[float]], lo: float, hi: float) -> list[_Interval]:
    """The time ``intervals`` cover inside [lo, hi], as sorted disjoint intervals."""
    merged: list[_Interval] = []
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def _overlap(intervals: list[_Interval], lo: float, hi: float) -> float:
    """How much of [lo, hi] the disjoint ``intervals`` cover."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)
