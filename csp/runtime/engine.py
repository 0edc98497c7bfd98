"""The runtime: runs a validated :class:`csp.Graph` with structured concurrency.

Every process replica runs either in its own named thread (blocking ``run``) or as an anyio task
on one asyncio event loop owned by :meth:`Runtime.run` (``async def run``). Channels connect them;
the runtime hands each replica its own cloned ends and closes them when its ``run`` returns or
raises, so end-of-stream propagates downstream by itself.

Devices and streams: a replica of a process whose graph node names a device (``device = "cuda:1"``,
or ``devices = [...]``, one per replica) runs in its own thread with that device current and a
fresh non-default CUDA stream of its own (``ctx.device``, ``ctx.stream``); everything the replica
launches goes to that stream, so replicas on one GPU overlap and no replica waits on the default
stream. Tensors that cross a channel are ordered between the sender's and the receiver's streams
by CUDA events, never by ``synchronize()`` (:mod:`csp.cuda.handoff`); a replica with no device, or a
CPU one, runs with no stream at all. Async (``async def run``) processes share one event loop and
bind no device.

Stopping:

* **completed** - every source returned and everything drained.
* **graceful stop** - :meth:`Runtime.request_stop` or the first SIGINT or SIGTERM (when ``run()``
  is called from the main thread; SIGTERM is what ``docker stop``, SLURM preemption and
  torchrun's agent send): sources see ``ctx.stopping()`` and return, in-flight items drain through
  the graph, every process ends normally.
* **failure** - the first exception escaping a process (``setup``, ``run`` or ``teardown``)
  aborts every channel (each blocked send/receive wakes with ``ChannelAborted``), requests stop,
  cancels the async tasks, joins the threads (bounded by ``join_timeout_s``) and ``run()`` raises
  :class:`csp.ProcessFailed` naming ``process[replica]``, chained to the original exception.
  ``ChannelAborted`` raised in other processes because of it is not reported.
* **abort** - :meth:`Runtime.abort` or a second signal (SIGINT or SIGTERM, either order): the
  same teardown, without an error.
* **deadlock** - every live process has waited inside a channel call with nothing moving for
  ``deadlock_timeout_s`` (``[runtime]``, default 30 s; 0 = off; :mod:`csp.runtime.deadlock`): the cycle of
  waits is logged and kept in ``RunResult.deadlock`` and the stats log, then the same teardown;
  ``run()`` returns status "deadlocked".

Exit codes (``RunResult.exit_code``; ``python -m csp.run`` exits with it):

====  ==========================================================================
0     completed
130   stopped (graceful drain after SIGINT, SIGTERM or ``request_stop``) or aborted; SIGTERM
      also gives 130, not the shell's 143, so callers test one code for "stopped, drained"
1     a process failed (``run()`` raises ProcessFailed; the CLI exits 1)
2     bad graph or config (GraphError before anything starts; set by the CLI)
3     a process did not stop: after an abort a thread was still running ``join_timeout_s`` later
      (``run()`` raises ProcessStuck naming it; the CLI prints one line and exits 3)
4     deadlocked: every live process waited on a channel and nothing moved for
      ``deadlock_timeout_s``; ``RunResult.deadlock`` names the cycle of waits
====  ==========================================================================

No thread is left behind silently: after the loop ends every process thread is joined; one still
alive after ``join_timeout_s`` (stuck outside any channel call, where an abort cannot reach it:
a ``time.sleep``, a hung collective) is logged with its stack (logger ``csp.runtime.stack``) and
``run()`` raises :class:`csp.ProcessStuck` naming it (or, after a failure, ProcessFailed whose
message names it too).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import sys
import threading
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from time import perf_counter
from typing import Any, Callable, Iterator

import anyio
import msgspec

from csp.core.channel import channel
from csp.core.process import Context, is_async
from csp.core.stats import ChannelStatistics, ProcessStatistics
from csp.errors import ChannelAborted, EndOfStream, ProcessFailed, ProcessStuck, RuntimeReused
from csp.graph import Graph, ProcessNode, TraceSpec
from csp.observe.statslog import StatsWriter, unwritable
from csp.observe.trace import FlowTap, Tracer
from csp.runtime.deadlock import DeadlockWatch

log = logging.getLogger("csp.runtime")
DRAIN_REPORT_S = 10.0
"""Seconds between the lines that say what a graceful stop still waits for."""
stack_log = logging.getLogger("csp.runtime.stack")  # stacks of stuck threads (long, multi-line)

EXIT_OK, EXIT_FAILED, EXIT_BAD_GRAPH, EXIT_STUCK, EXIT_DEADLOCK, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
JOIN_TIMEOUT_S = 10.0  # default Runtime.join_timeout_s (seconds)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """How a run ended: ``status`` ("completed" | "stopped" | "failed" | "aborted" |
    "deadlocked"), ``exit_code`` (see the module doc), ``duration_s`` (wall seconds of ``run()``),
    ``stopped_by``: what stopped or aborted it ("SIGINT", "SIGTERM", "request_stop", "abort",
    "deadlock"; for an abort by a second signal, the second signal), None when it completed; and
    ``deadlock``: the cycle of waits of a deadlocked run (one line, :func:`csp.runtime.deadlock.explain`)."""

    status: str
    exit_code: int
    duration_s: float
    stopped_by: str | None = None
    deadlock: str | None = None


class _Worker:
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

    def close_ends(self) -> None:
        for end in (*self.raw_inputs.values(), *self.raw_outputs.values()):
            end.close()


class Runtime:
    """Runs a :class:`csp.Graph` once.

    Args:
        graph: the graph (validated again by :meth:`run`).
        run_dir: where ``csp/stats.jsonl`` and ``csp/trace.json`` go; None writes nothing.
        app: any object handed to every process as ``ctx.app``.
        trace: None follows ``graph.trace``; a bool switches ``trace.json`` on/off; a TraceSpec
            replaces ``graph.trace``.
        join_timeout_s: after a failure or abort, how long to wait for process threads to stop
            (seconds; None: :data:`JOIN_TIMEOUT_S`, 10 s).
        instances: run only these ``(process name, replica)`` instances (``csp.distributed`` runs each
            rank's share of the graph this way); None runs every instance.
        channel_factory: ``f(item_type=, capacity=, name=, ordered=) -> (Sender, Receiver)`` used
            instead of :func:`csp.core.channel` to build each channel (``csp.distributed`` builds cross-rank
            channels with it); None uses :func:`csp.core.channel`.
        deadlock_timeout_s: seconds of "every live process waits on a channel, nothing moves"
            before the run stops as deadlocked (:mod:`csp.runtime.deadlock`); 0 = off; None follows
            ``graph.runtime.deadlock_timeout_s``. Off whenever ``instances`` or
            ``channel_factory`` is given: this runtime then sees only part of the graph, and a
            peer it cannot see may be busy.
        exit_code_of: the application's exit code for a run that ended with ``status`` and, for
            a failure, the process's exception (``ProcessFailed.__cause__``), or None to keep
            csp's (module doc). ``RunResult.exit_code`` and the stats log's final line then carry
            the code the application exits with (``dflash.run`` gives a full disk 4, a deadlock 5).
    """

    def __init__(self, graph: Graph, *, run_dir: Path | str | None = None, app: Any = None,
                 trace: bool | TraceSpec | None = None, join_timeout_s: float | None = None,
                 instances: Any = None, channel_factory: Any = None,
                 deadlock_timeout_s: float | None = None,
                 exit_code_of: Callable[[str, BaseException | None], int | None] | None = None) -> None:
        self.graph = graph
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.app = app
        spec = graph.trace if not isinstance(trace, TraceSpec) else trace
        if isinstance(trace, bool):
            spec = msgspec.structs.replace(spec, perfetto=trace)
        self.trace_spec = spec
        self.join_timeout_s = JOIN_TIMEOUT_S if join_timeout_s is None else join_timeout_s
        self.instances = None if instances is None else set(instances)
        self.channel_factory = channel_factory if channel_factory is not None else channel
        partial = instances is not None or channel_factory is not None
        timeout = graph.runtime.deadlock_timeout_s if deadlock_timeout_s is None else deadlock_timeout_s
        self.deadlock_timeout_s = 0.0 if partial else float(timeout)
        self.exit_code_of = exit_code_of
        self._deadlock: str | None = None
        self.tracer: Tracer | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._aborted = False
        self._shutting_down = False
        self._failure: tuple[_Worker, BaseException] | None = None
        self._signals = 0
        self._stopped_by: str | None = None
        self._signals_installed = False
        self._workers: list[_Worker] = []
        self._channels: dict[str, tuple[Any, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: Any = None
        self._threads_left = 0
        self._threads_done: anyio.Event | None = None

    # -- public control -----------------------------------------------------------------------
    def request_stop(self) -> None:
        """Graceful stop (thread-safe, idempotent): sources see ``ctx.stopping()``; items drain."""
        self._stopped_by = self._stopped_by or "request_stop"
        self._stop.set()

    def abort(self) -> None:
        """Immediate stop (thread-safe): abort every channel and cancel every task."""
        with self._lock:
            self._aborted = True
            if self._signals < 2:
                self._stopped_by = "abort"
        self._shutdown("run aborted")

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Live ``{"channels": {name: ChannelStatistics}, "processes": {qualname: ProcessStatistics}}``."""
        return {"channels": self._channel_stats(), "processes": self._process_stats()}

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run the graph to its end (blocking). Call from a thread without a running event loop.

        Returns:
            RunResult (status "completed", "stopped" or "aborted").

        Raises:
            GraphError: the graph is invalid (nothing started).
            ProcessFailed: a process raised; ``__cause__`` is its exception.
            ProcessStuck: after an abort, a process thread did not stop within ``join_timeout_s``.
            RuntimeReused (a RuntimeError): ``run()`` was called twice.
        """
        if self._started:
            raise RuntimeReused("a Runtime runs once; build a new Runtime for another run")
        self._started = True
        self.graph.validate()
        t0 = perf_counter()
        spec = self.trace_spec
        if self.run_dir is not None and spec.perfetto:
            self.tracer = Tracer(max_events=spec.max_events, flow_every=spec.flow_every)
        self._build()
        statslog = self._start_observers()
        old_handlers = self._install_signals()
        status, exit_code, stuck = "failed", EXIT_FAILED, []
        watch = None
        if self.deadlock_timeout_s > 0:
            watch = DeadlockWatch(self._workers, self.deadlock_timeout_s, self._on_deadlock)
            watch.start()
        try:
            if not self._aborted:
                anyio.run(self._supervise, backend="asyncio")
        finally:
            if watch is not None:
                watch.stop()
            self._loop = None
            for sig, old in old_handlers.items():
                signal.signal(sig, old)
            stuck = self._join_threads()
            for w in self._workers:
                w.close_ends()
            if self._failure is not None:
                status, exit_code = "failed", EXIT_FAILED
            elif self._deadlock is not None:
                status, exit_code = "deadlocked", EXIT_DEADLOCK
            elif self._aborted or stuck:
                status, exit_code = "aborted", EXIT_INTERRUPTED
            elif self._stop.is_set():
                status, exit_code = "stopped", EXIT_INTERRUPTED
            else:
                status, exit_code = "completed", EXIT_OK
            if self.exit_code_of is not None:  # the application's own codes, so its log and its exit agree
                own = self.exit_code_of(status, self._failure[1] if self._failure is not None else None)
                exit_code = exit_code if own is None else own
            if statslog is not None:
                statslog.close(status, exit_code, deadlock=self._deadlock)
            if self.tracer is not None and self.run_dir is not None:
                path = self.run_dir / "csp" / "trace.json"
                try:
                    self.tracer.write(path)
                except OSError as exc:  # a full disk: one line, and the run's outcome stands
                    log.error("%s", unwritable(path, exc, "the run has no Perfetto trace"))
        stuck_note = f"; threads still running: {', '.join(stuck)}" if stuck else ""
        if self._failure is not None:
            w, exc = self._failure
            raise ProcessFailed(f"process {w.qualname} failed: {type(exc).__name__}: {exc}{stuck_note}",
                                process=w.node.name, replica=w.replica) from exc
        if stuck:
            raise ProcessStuck(f"process {', '.join(stuck)} did not stop within {self.join_timeout_s:g} s "
                               "after the abort (stuck outside any channel call: a sleep, a hung "
                               "collective, a blocking read); its thread was abandoned; its stack is "
                               "logged", stuck, self.join_timeout_s)
        return RunResult(status=status, exit_code=exit_code, duration_s=perf_counter() - t0,
                         stopped_by=None if status == "completed" else self._stopped_by,
                         deadlock=self._deadlock)

    def _build(self) -> None:
        g = self.graph
        for name, c in g.channels.items():
            self._channels[name] = self.channel_factory(item_type=g.item_type(name), capacity=c.capacity,
                                                        name=name, ordered=c.ordered)
        flows = self.trace_spec.flows and self.tracer is not None
        pending: dict[str, dict[int, int]] = {name: {} for name in g.channels}
        for node in g.processes.values():
            for r in range(node.replicas):
                if self.instances is not None and (node.name, r) not in self.instances:
                    continue
                dev = node.devices[r] if node.devices else None
                ctx = Context(node.name, r, node.replicas, device=_torch_device(dev),
                              run_dir=self.run_dir, app=self.app, stop_event=self._stop,
                              tracer=self.tracer, track=len(self._workers) + 1,
                              statistics=self.statistics)
                w = _Worker(node, r, ctx._track, ctx)
                w.raw_inputs = {p: self._channels[c][1].clone() for p, c in node.inputs.items()}
                w.raw_outputs = {p: self._channels[c][0].clone() for p, c in node.outputs.items()}
                w.inputs, w.outputs = dict(w.raw_inputs), dict(w.raw_outputs)
                if flows:
                    state: dict[str, Any] = {}
                    src, sink = not node.inputs, not node.outputs
                    w.inputs = {p: self._tap(e, w, state, pending[node.inputs[p]], src, sink)
                                for p, e in w.raw_inputs.items()}
                    w.outputs = {p: self._tap(e, w, state, pending[node.outputs[p]], src, sink)
                                 for p, e in w.raw_outputs.items()}
                self._workers.append(w)
        for send, recv in self._channels.values():  # only the replicas' clones stay open
            send.close()
            recv.close()
        for w in self._workers:
            try:
                w.instance = w.node.cls(options=w.node.options, ctx=w.ctx)
            except Exception as exc:
                for v in self._workers:
                    v.close_ends()
                raise ProcessFailed(f"process {w.qualname}: constructing {w.node.cls.__name__} "
                                    f"failed: {exc!r}", process=w.node.name, replica=w.replica) from exc

    def _tap(self, end: Any, w: _Worker, state: dict, pending: dict, src: bool, sink: bool) -> Any:
        return FlowTap(end, self.tracer, w.track, state, pending, src, sink)  # type: ignore[arg-type]

    def _start_observers(self) -> StatsWriter | None:
        spec = self.trace_spec
        if self.run_dir is None:
            return None
        if self.tracer is not None:
            for w in self._workers:
                self.tracer.name_track(w.track, w.qualname)
        statslog = StatsWriter(self.run_dir / "csp" / "stats.jsonl", self.graph, self._channel_stats,
                            self._process_stats, spec.stats_interval_s, self.tracer)
        statslog.start()
        return statslog

    def _channel_stats(self) -> dict[str, ChannelStatistics]:
        return {name: ends[1].statistics() for name, ends in self._channels.items()}

    def _process_stats(self) -> dict[str, ProcessStatistics]:
        return {w.qualname: w.statistics() for w in self._workers}

    # -- supervision --------------------------------------------------------------------------
    async def _supervise(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads_done = anyio.Event()
        threaded = [w for w in self._workers if not w.is_async]
        self._threads_left = len(threaded)
        if self._signals_installed:
            # While the loop runs, let asyncio take the signals: it wakes the selector (wakeup fd)
            # and runs the handler as a loop callback, outside any channel code.
            for sig in _STOP_SIGNALS:
                self._loop.add_signal_handler(sig, self._on_signal, sig, None)
        try:
            await self._run_workers(threaded)
        finally:
            if self._signals_installed:
                for sig in _STOP_SIGNALS:
                    self._loop.remove_signal_handler(sig)
                    signal.signal(sig, self._on_signal)

    async def _run_workers(self, threaded: list[_Worker]) -> None:
        if self._aborted and not self._shutting_down:  # second signal before the loop ran
            self._shutdown("run aborted")
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self._shutting_down:  # aborted before the loop existed: start nothing
                return
            for w in self._workers:
                if w.is_async:
                    tg.start_soon(self._run_async, w, name=w.qualname)
            for w in threaded:
                w.thread = threading.Thread(target=self._run_thread, args=(w,), name=w.qualname,
                                            daemon=True)
                w.thread.start()
            if threaded:
                await self._threads_done.wait()

    def _run_thread(self, w: _Worker) -> None:
        w.t_start = perf_counter()
        try:
            with _device_scope(w.ctx):
                span = self.tracer.span if self.tracer is not None else _no_span
                try:
                    with span(w.track, "setup"):
                        w.instance.setup()
                    w.state = "running"
                    with span(w.track, "run"):
                        w.instance.run(w.inputs, w.outputs)
                except BaseException as exc:
                    self._on_error(w, exc)
                finally:
                    try:
                        with span(w.track, "teardown"):
                            w.instance.teardown()
                    except BaseException as exc:
                        self._on_error(w, exc)
        except BaseException as exc:  # entering the device scope failed
            self._on_error(w, exc)
        finally:
            self._finish(w)
            with self._lock:
                self._threads_left -= 1
                last = self._threads_left == 0
            if last:
                self._call_in_loop(self._threads_done.set)  # type: ignore[union-attr]

    async def _run_async(self, w: _Worker) -> None:
        w.t_start = perf_counter()
        span = self.tracer.span if self.tracer is not None else _no_span
        try:
            try:
                with span(w.track, "setup"):
                    await _maybe_await(w.instance.setup())
                w.state = "running"
                with span(w.track, "run"):
                    await w.instance.run(w.inputs, w.outputs)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                self._on_error(w, exc)
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        with span(w.track, "teardown"):
                            await _maybe_await(w.instance.teardown())
                    except Exception as exc:
                        self._on_error(w, exc)
        finally:
            self._finish(w)

    def _finish(self, w: _Worker) -> None:
        w.close_ends()
        w.t_end = perf_counter()
        if w.state != "failed":
            w.state = "done"

    def _on_error(self, w: _Worker, exc: BaseException) -> None:
        """Classify an exception escaping a process: normal end, consequence, or the failure."""
        if isinstance(exc, EndOfStream):
            return  # an input ran dry: a normal return
        if isinstance(exc, ChannelAborted) and self._shutting_down:
            return  # woken by the abort that another failure (or abort()) caused
        w.state = "failed"
        with self._lock:
            first = self._failure is None and not self._aborted
            if first:
                self._failure = (w, exc)
        if not first:
            log.warning("process %s also raised during shutdown: %r", w.qualname, exc)
            return
        log.error("process %s failed: %r; stopping the graph", w.qualname, exc, exc_info=exc)
        self._shutdown(f"process {w.qualname} failed: {exc!r}")

    def _on_deadlock(self, why: str) -> None:
        """From the deadlock watch: record the cycle of waits and stop everything (exit 4)."""
        with self._lock:
            if self._failure is not None or self._shutting_down:
                return
            self._deadlock = why
            self._stopped_by = "deadlock"
        own = self.exit_code_of("deadlocked", None) if self.exit_code_of is not None else None
        log.error("deadlock: %s; stopping the graph (exit %d)", why, EXIT_DEADLOCK if own is None else own)
        self._shutdown(f"deadlock: {why}")

    def _shutdown(self, reason: str) -> None:
        self._shutting_down = True
        self._stop.set()
        for send, _ in self._channels.values():
            send.abort(reason)
        self._call_in_loop(self._cancel_tasks)

    def _cancel_tasks(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def _call_in_loop(self, fn: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop already closed: nothing left to wake
            pass

    def _join_threads(self) -> list[str]:
        deadline = perf_counter() + self.join_timeout_s
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(timeout=max(0.0, deadline - perf_counter()))
        stuck = [w for w in self._workers if w.thread is not None and w.thread.is_alive()]
        frames = sys._current_frames()
        for w in stuck:
            frame = frames.get(w.thread.ident)  # type: ignore[union-attr, arg-type]
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            log.error("process thread %s did not stop within %.1f s; it is left running (daemon)",
                      w.qualname, self.join_timeout_s)
            stack_log.error("stack of the stuck process thread %s:\n%s", w.qualname, stack)
        return [w.qualname for w in stuck]

    # -- signals ------------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, Any]:
        """Take SIGINT and SIGTERM (main thread only); returns the handlers to restore."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        self._signals_installed = True
        return {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}

    def _report_drain(self, since: float) -> None:
        """One line naming the processes a graceful stop still waits for, then again every
        :data:`DRAIN_REPORT_S` until none is left (a loop callback; it dies with the loop)."""
        running = [w.qualname for w in self._workers if w.state in ("setup", "running")]
        if not running or self._shutting_down or self._loop is None or self._loop.is_closed():
            return
        log.warning("draining: %s still running, %.0f s after the stop (Ctrl-C again aborts)",
                    ", ".join(running), perf_counter() - since)
        self._loop.call_later(DRAIN_REPORT_S, self._report_drain, since)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Outside the loop this runs in the main thread between bytecodes, possibly inside channel
        # code holding a lock: only set flags or defer to the loop, never touch channels here.
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals == 1:
            log.warning("%s: graceful stop requested (sources stop, items drain); "
                        "press Ctrl-C (or send SIGTERM) again to abort", name)
            self._stopped_by = name
            self.request_stop()
            if self._loop is not None:  # while it drains, say every DRAIN_REPORT_S what is still running
                self._loop.call_soon_threadsafe(self._loop.call_later, DRAIN_REPORT_S, self._report_drain,
                                                perf_counter())
        else:
            running = [w.qualname for w in self._workers if w.state in ("setup", "running")]
            self._stopped_by = name
            log.warning("second stop signal (%s): aborting the run%s", name,
                        f" (still running: {', '.join(running)})" if running else "")
            loop = self._loop
            if loop is not None:
                loop.call_soon_threadsafe(self.abort)
            else:  # the loop is not running yet or any more: flag it, run() checks the flag
                self._aborted = True
                self._stop.set()


@contextmanager
def _no_span(track: int, name: str) -> Iterator[None]:
    yield


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _torch_device(dev: str | None) -> Any:
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
    import torch

    torch.cuda.set_device(ctx.device)
    ctx.stream = torch.cuda.Stream(device=ctx.device)
    with torch.cuda.stream(ctx.stream):
        yield


__all__ = ["EXIT_BAD_GRAPH", "EXIT_DEADLOCK", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_STUCK",
           "RunResult", "Runtime"]
