"""One process replica as the runtime runs it: :class:`Worker` and the helpers of its life.

A worker holds a replica's instance, its cloned channel ends, its state and timing, and runs the
replica's ``setup``, ``run`` and ``teardown``: in the calling thread with its device current on a
stream of its own (:meth:`Worker.run_blocking`), or as an anyio task (:meth:`Worker.run_async`).
It knows nothing of the other replicas: every exception escaping the process goes to the
``on_error`` the engine hands it, which decides whether the run stops. Kept apart from
:mod:`csp.runtime.engine` so the engine holds only the run as a whole (build, supervise, stop).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import traceback
from contextlib import contextmanager, nullcontext
from time import perf_counter
from typing import Any, Callable, Iterator

import anyio

from csp.core.process import Context, is_async
from csp.core.stats import ProcessStatistics
from csp.errors import ProcessFailed
from csp.graph import ProcessNode
from csp.observe.trace import FlowTap, Tracer

log = logging.getLogger("csp.runtime")
stack_log = logging.getLogger("csp.runtime.stack")  # stacks of stuck threads (long, multi-line)

Span = Callable[[int, str], Any]
"""``span(track, name)``: a context manager timing a phase (``Tracer.span``, or :func:`no_span`)."""
OnError = Callable[["Worker", BaseException], None]
"""``on_error(worker, exc)``: where an exception escaping a replica's process goes."""


class Worker:
    """One process replica: its instance, its ends, its timing and state."""

    def __init__(self, node: ProcessNode, replica: int, track: int, ctx: Context) -> None:
        self.node, self.replica, self.track, self.ctx = node, replica, track, ctx
        self.qualname = ctx.qualname
        self.instance: Any = None
        self.raw_inputs: dict[str, Any] = {}
        self.raw_outputs: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.is_async = is_async(node.cls)
        self.thread: threading.Thread | None = None
        self.state = "setup"  # setup | running | done | failed
        self.t_start: float | None = None
        self.t_end: float | None = None

    def statistics(self) -> ProcessStatistics:
        """Summed from the per-end counters of the ends it owns (reads only)."""
        ins, outs = list(self.raw_inputs.values()), list(self.raw_outputs.values())
        wait_in = sum(e.blocked_s for e in ins)
        blocked_out = sum(e.blocked_s for e in outs)
        alive = 0.0 if self.t_start is None else (self.t_end or perf_counter()) - self.t_start
        state = self.state
        if state == "running":
            state = ("waiting_input" if any(e.waiting for e in ins)
                     else "blocked_output" if any(e.waiting for e in outs) else "busy")
        return ProcessStatistics(
            qualname=self.qualname, name=self.node.name, replica=self.replica, state=state,  # type: ignore[arg-type]
            busy_s=max(0.0, alive - wait_in - blocked_out), wait_input_s=wait_in,
            blocked_output_s=blocked_out, items_in=sum(e.items for e in ins),
            items_out=sum(e.items for e in outs),
        )

    def connect(self, channels: dict[str, tuple[Any, Any]], tracer: Tracer | None,
                pending: dict[str, dict[int, int]] | None) -> None:
        """Give the replica its own clones of its channels' ``(sender, receiver)`` ends, and the
        ends its process sees: the clones themselves or, given ``pending`` (per channel, the open
        flow of each item in it), a :class:`FlowTap` on each that leaves the items' flows in
        ``tracer``'s trace."""
        node = self.node
        self.raw_inputs = {p: channels[c][1].clone() for p, c in node.inputs.items()}
        self.raw_outputs = {p: channels[c][0].clone() for p, c in node.outputs.items()}
        self.inputs, self.outputs = dict(self.raw_inputs), dict(self.raw_outputs)
        if pending is not None:
            state: dict[str, Any] = {}
            src, sink = not node.inputs, not node.outputs
            self.inputs = {p: FlowTap(e, tracer, self.track, state, pending[node.inputs[p]],  # type: ignore[arg-type]
                                      src, sink) for p, e in self.raw_inputs.items()}
            self.outputs = {p: FlowTap(e, tracer, self.track, state, pending[node.outputs[p]],  # type: ignore[arg-type]
                                       src, sink) for p, e in self.raw_outputs.items()}

    def close_ends(self) -> None:
        for end in (*self.raw_inputs.values(), *self.raw_outputs.values()):
            end.close()

    def run_blocking(self, span: Span, on_error: OnError) -> None:
        """Run the replica in this thread with its device current (:func:`_device_scope`): setup,
        run, then teardown even when they raised; every exception goes to ``on_error``."""
        self.t_start = perf_counter()
        try:
            with _device_scope(self.ctx):
                try:
                    with span(self.track, "setup"):
                        self.instance.setup()
                    self.state = "running"
                    with span(self.track, "run"):
                        self.instance.run(self.inputs, self.outputs)
                except BaseException as exc:
                    on_error(self, exc)
                finally:
                    try:
                        with span(self.track, "teardown"):
                            self.instance.teardown()
                    except BaseException as exc:
                        on_error(self, exc)
        except BaseException as exc:  # entering the device scope failed
            on_error(self, exc)
        finally:
            self._finish()

    async def run_async(self, span: Span, on_error: OnError) -> None:
        """Run the replica as an anyio task: setup, run, then teardown (shielded from cancellation);
        a cancellation propagates, every other exception goes to ``on_error``."""
        self.t_start = perf_counter()
        try:
            try:
                with span(self.track, "setup"):
                    await _maybe_await(self.instance.setup())
                self.state = "running"
                with span(self.track, "run"):
                    await self.instance.run(self.inputs, self.outputs)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                on_error(self, exc)
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        with span(self.track, "teardown"):
                            await _maybe_await(self.instance.teardown())
                    except Exception as exc:
                        on_error(self, exc)
        finally:
            self._finish()

    def _finish(self) -> None:
        self.close_ends()
        self.t_end = perf_counter()
        if self.state != "failed":
            self.state = "done"


def construct(workers: list[Worker]) -> None:
    """Construct each replica's process instance; when one raises, close every worker's ends and
    raise ProcessFailed naming it (nothing has started yet)."""
    for w in workers:
        try:
            w.instance = w.node.cls(options=w.node.options, ctx=w.ctx)
        except Exception as exc:
            for v in workers:
                v.close_ends()
            raise ProcessFailed(f"process {w.qualname}: constructing {w.node.cls.__name__} "
                                f"failed: {exc!r}", process=w.node.name, replica=w.replica) from exc


def join_threads(workers: list[Worker], timeout_s: float) -> list[str]:
    """Join the workers' threads within ``timeout_s`` in all; log each one still alive with its
    stack (it is left running, a daemon) and return their qualnames."""
    deadline = perf_counter() + timeout_s
    for w in workers:
        if w.thread is not None:
            w.thread.join(timeout=max(0.0, deadline - perf_counter()))
    stuck = [w for w in workers if w.thread is not None and w.thread.is_alive()]
    frames = sys._current_frames()
    for w in stuck:
        frame = frames.get(w.thread.ident)  # type: ignore[union-attr, arg-type]
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        log.error("process thread %s did not stop within %.1f s; it is left running (daemon)",
                  w.qualname, timeout_s)
        stack_log.error("stack of the stuck process thread %s:\n%s", w.qualname, stack)
    return [w.qualname for w in stuck]


@contextmanager
def no_span(track: int, name: str) -> Iterator[None]:
    """The :data:`Span` of a run without a tracer: times nothing."""
    yield


async def _maybe_await(value: Any) -> Any:
    """``value``, awaited when awaitable: an async process's ``setup`` and ``teardown`` may be sync."""
    return await value if inspect.isawaitable(value) else value


def torch_device(dev: str | None) -> Any:
    """``torch.device(dev)``, or None for a node without a device (torch is imported only then)."""
    if dev is None:
        return None
    import torch

    return torch.device(dev)


def _device_scope(ctx: Context) -> Any:
    """Make ``ctx.device`` current with a fresh non-default stream (CUDA only; else no-op)."""
    dev = ctx.device
    if dev is None or dev.type != "cuda":
        return nullcontext()
    return _cuda_scope(ctx)


@contextmanager
def _cuda_scope(ctx: Context) -> Iterator[None]:
    """Set ``ctx.device``, give ``ctx`` a new stream (``ctx.stream``) and make it current for the body."""
    import torch

    torch.cuda.set_device(ctx.device)
    ctx.stream = torch.cuda.Stream(device=ctx.device)
    with torch.cuda.stream(ctx.stream):
        yield


__all__ = ["OnError", "Span", "Worker", "construct", "join_threads", "no_span", "torch_device"]
