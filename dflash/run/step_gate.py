"""Steps that may compile run alone in the process; every other step runs beside the others.

Why: ``torch.compile`` traces with ``torch.fx``, whose tracer patches ``nn.Module.__call__`` for the
whole process while it traces. A module called from another thread meanwhile is routed into that
trace, and a compiled function called meanwhile raises "Detected that you are using FX to
symbolically trace a dynamo-optimized function" (measured: a target stage failed so on an H200 while
the drafter stage, in another thread, recompiled for a batch of a new shape). Stages compile on the
first batch of each shape they see: the drafter's compiled layers and flex attention, the target's
compiled layers, transformers' flex attention in an eager target.

So each stage keeps a :class:`StepGate` and runs its model work (the target's forward, the drafter's
optimizer step) through :meth:`StepGate.run` (a :meth:`StepGate.step` hold) with the batch's
shapes: a step on shapes new to that stage holds the process-wide lock exclusively, any other step
holds it shared. Shared steps run
concurrently (the pipeline's overlap is untouched); a waiting exclusive step stops new shared ones
from starting, so it runs once the steps in flight finish (at most one step of each other stage).

What the shapes miss: a recompile on shapes a stage has seen (a guard that fails on a value, a
stride or a dtype, not a shape) traces while other steps run. The engine avoids the ones it knows
(``dflash.model.target`` marks the varlen boundaries dynamic); for the rest, :meth:`StepGate.run`
catches the error that such a trace raises in another stage's compiled call and runs that step
again, alone, once the trace is over (a step is rerun from its start: its inputs are unchanged,
and the caller's ``again`` undoes what the failed attempt left, such as accumulated gradients;
a data-parallel replica, whose steps are collectives, is not rerun but stopped with a line that
says why). A data-parallel replica never holds the lock exclusively either: its step waits in an
all-reduce for the other replicas, which may be waiting for this process's target, and a target
held off by that exclusive hold would never send (a deadlock, seen on two CPU ranks under load). The first compile during a step on seen shapes is said once in the run log, with the
stage and its shapes, so that the guard behind it can be found and avoided.
Hold the gate around compute only, never around a channel ``put``/``get``: a stage blocked on a
channel while holding it shared would keep a waiting exclusive step, and then every stage, waiting.
"""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["StepGate", "is_trace_race", "process_lock"]

log = logging.getLogger("dflash.step_gate")
R = TypeVar("R")
_TRACE_RACE = "symbolically trace a dynamo-optimized function"


def is_trace_race(exc: BaseException) -> bool:
    """Whether ``exc`` is the error a compiled call raises while another thread's ``torch.fx`` trace
    is under way (torch's message: "Detected that you are using FX to symbolically trace a
    dynamo-optimized function")."""
    return isinstance(exc, RuntimeError) and _TRACE_RACE in str(exc)


class _SharedExclusiveLock:
    """A readers-writer lock that prefers a waiting writer (one process; not reentrant)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting: new shared holders wait behind them

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def state(self) -> tuple[int, bool, int]:
        """``(shared holders, exclusive held, exclusive waiting)`` (for tests and debugging)."""
        with self._cond:
            return self._shared, self._exclusive, self._waiting


_LOCK = _SharedExclusiveLock()
_said_lock = threading.Lock()
_said_compiled = False  # the compile-on-seen-shapes warning is said once per process


def _graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (0 before torch._dynamo is used)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]


_held = threading.local()  # a step inside a step (one thread) is part of the outer one


def process_lock() -> _SharedExclusiveLock:
    """The one lock every :class:`StepGate` of this process shares."""
    return _LOCK


class StepGate:
    """One stage's gate: :meth:`step` runs a step exclusively on shapes this gate has not seen
    (the step may compile), shared otherwise. Not shared between stages: each has its own shapes."""

    def __init__(self, lock: _SharedExclusiveLock | None = None, name: str = "a stage", *,
                 data_parallel: bool = False) -> None:
        self._lock = lock or _LOCK
        self._seen: set[Hashable] = set()
        self.name = name
        self.data_parallel = data_parallel
        """A replica whose steps are collectives: every step shared, none rerun (module docstring)."""
        self.reruns = 0
        """Steps run again alone because another thread's compile interrupted them."""

    def is_new(self, shapes: Hashable) -> bool:
        """Whether a step on ``shapes`` would run exclusively."""
        return shapes not in self._seen

    @contextmanager
    def step(self, shapes: Hashable) -> Iterator[None]:
        """Hold the process lock for one step on ``shapes`` (e.g. ``(tuple(input_ids.shape),)``).

        A step that raises leaves its shapes unseen, so the next step on them runs exclusively too.
        Nested calls in one thread run inside the outer hold."""
        if getattr(_held, "on", False):
            yield
            return
        new = shapes not in self._seen
        with self._hold(exclusive=new and not self.data_parallel):
            compiled = _graphs_compiled()  # once held: an exclusive step that ran before is not counted
            try:
                yield
            finally:
                compiled = _graphs_compiled() - compiled  # still held: a later exclusive step is not counted
        if new:
            self._seen.add(shapes)
        elif compiled:
            self._say_compiled(shapes)

    def _say_compiled(self, shapes: Hashable) -> None:
        global _said_compiled
        with _said_lock:
            if _said_compiled:
                return
            _said_compiled = True
        log.warning("%s: torch.compile compiled a graph while this stage ran a step on shapes %s it had seen "
                    "(the compile was this stage's or that of one running beside it: a guard on something other "
                    "than a shape failed, such as a stride, a dtype or a value); such a compile may interrupt "
                    "the other stages' steps, which then run again; TORCH_LOGS=recompiles names the guard",
                    self.name, shapes)

    def run(self, shapes: Hashable, fn: Callable[[], R], again: Callable[[], None] | None = None) -> R:
        """``fn()`` as one step on ``shapes`` (:meth:`step`); if another thread's compile interrupted
        it (:func:`is_trace_race`), ``again()`` and then ``fn()`` once more, exclusively.

        Args:
            shapes: the step's shapes, as for :meth:`step`.
            fn: the step; it must be safe to run again from its start after it raised.
            again: undoes what a failed attempt left behind before the rerun (e.g. ``zero_grad``).
            A data-parallel gate does not rerun (its forward and backward are collectives the
            other replicas would not repeat): the race then stops the stage with a line that says so.

        Raises:
            RuntimeError: the race, on a data-parallel gate, or when the rerun (which runs alone, so no
                other thread traces meanwhile) or a step nested in another meets it.
            Whatever else ``fn`` raises.
        """
        try:
            with self.step(shapes):
                return fn()
        except RuntimeError as e:
            if not is_trace_race(e) or getattr(_held, "on", False):
                raise
            if self.data_parallel:
                raise RuntimeError(f"{self.name}: a torch.compile trace in another thread (a recompile on shapes "
                                   "already seen) interrupted this step, which a data-parallel replica cannot run "
                                   "again; TORCH_LOGS=recompiles names the guard behind the recompile, and the "
                                   "stage's compile = false avoids it") from e
        self.reruns += 1
        if self.reruns == 1:
            log.warning("%s: a step was interrupted by a torch.compile trace in another thread (a recompile "
                        "on shapes already seen) and runs again alone (said once per stage)", self.name)
        if again is not None:
            again()
        with self._hold(exclusive=True):
            return fn()

    @contextmanager
    def _hold(self, *, exclusive: bool) -> Iterator[None]:
        """The process lock, exclusive or shared, marked held for this thread (nested steps run inside)."""
        with self._lock.exclusive() if exclusive else self._lock.shared():
            _held.on = True
            try:
                yield
            finally:
                _held.on = False
