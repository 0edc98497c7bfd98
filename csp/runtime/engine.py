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
import logging
import threading
from contextlib import nullcontext
from pathlib import Path
from time import perf_counter
from typing import Any, Callable

import anyio
import msgspec

from csp.core.channel import channel
from csp.core.process import Context
from csp.core.stats import ChannelStatistics, ProcessStatistics
from csp.errors import ChannelAborted, EndOfStream, ProcessFailed, ProcessStuck, RuntimeReused
from csp.graph import Graph, TraceSpec
from csp.observe.statslog import StatsWriter, unwritable
from csp.observe.trace import Tracer
from csp.runtime import signals
from csp.runtime.deadlock import DeadlockWatch
from csp.runtime.result import (EXIT_BAD_GRAPH, EXIT_DEADLOCK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STUCK,
                                RunResult, outcome)
from csp.runtime.worker import Span, Worker, construct, join_threads, no_span, torch_device

log = logging.getLogger("csp.runtime")
DRAIN_REPORT_S = 10.0
"""Seconds between the lines that say what a graceful stop still waits for."""

JOIN_TIMEOUT_S = 10.0  # default Runtime.join_timeout_s (seconds)


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
        self._failure: tuple[Worker, BaseException] | None = None
        self._signals = 0
        self._stopped_by: str | None = None
        self._signals_installed = False
        self._workers: list[Worker] = []
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
        old_handlers = signals.take(self._on_signal)
        self._signals_installed = bool(old_handlers)
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
            signals.restore(old_handlers)
            stuck = join_threads(self._workers, self.join_timeout_s)
            for w in self._workers:
                w.close_ends()
            status, exit_code = outcome(failed=self._failure is not None, deadlocked=self._deadlock is not None,
                                        aborted=self._aborted or bool(stuck), stopped=self._stop.is_set())
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
        pending: dict[str, dict[int, int]] | None = {name: {} for name in g.channels} if flows else None
        for node in g.processes.values():
            for r in range(node.replicas):
                if self.instances is not None and (node.name, r) not in self.instances:
                    continue
                dev = node.devices[r] if node.devices else None
                ctx = Context(node.name, r, node.replicas, device=torch_device(dev),
                              run_dir=self.run_dir, app=self.app, stop_event=self._stop,
                              tracer=self.tracer, track=len(self._workers) + 1,
                              statistics=self.statistics)
                w = Worker(node, r, ctx._track, ctx)
                w.connect(self._channels, self.tracer, pending)
                self._workers.append(w)
        for send, recv in self._channels.values():  # only the replicas' clones stay open
            send.close()
            recv.close()
        construct(self._workers)

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
        # While the loop runs, the signals reach _on_signal as a loop callback, outside any channel code.
        with signals.through_loop(self._loop, self._on_signal) if self._signals_installed else nullcontext():
            await self._run_workers(threaded)

    async def _run_workers(self, threaded: list[Worker]) -> None:
        if self._aborted and not self._shutting_down:  # second signal before the loop ran
            self._shutdown("run aborted")
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self._shutting_down:  # aborted before the loop existed: start nothing
                return
            span = self.tracer.span if self.tracer is not None else no_span
            for w in self._workers:
                if w.is_async:
                    tg.start_soon(w.run_async, span, self._on_error, name=w.qualname)
            for w in threaded:
                w.thread = threading.Thread(target=self._run_thread, args=(w, span), name=w.qualname,
                                            daemon=True)
                w.thread.start()
            if threaded:
                await self._threads_done.wait()

    def _run_thread(self, w: Worker, span: Span) -> None:
        try:
            w.run_blocking(span, self._on_error)
        finally:
            with self._lock:
                self._threads_left -= 1
                last = self._threads_left == 0
            if last:
                self._call_in_loop(self._threads_done.set)  # type: ignore[union-attr]

    def _on_error(self, w: Worker, exc: BaseException) -> None:
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

    # -- signals ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Outside the loop this runs in the main thread between bytecodes, possibly inside channel
        # code holding a lock: only set flags or defer to the loop, never touch channels here.
        self._signals += 1
        self._stopped_by = signals.announce(signum, self._signals, self._workers)
        loop = self._loop
        if self._signals == 1:
            self.request_stop()
            if loop is not None:  # while it drains, say every DRAIN_REPORT_S what is still running
                signals.report_drain(loop, self._workers, DRAIN_REPORT_S,
                                     lambda: self._shutting_down or self._loop is None)
        elif loop is not None:
            loop.call_soon_threadsafe(self.abort)
        else:  # the loop is not running yet or any more: flag it, run() checks the flag
            self._aborted = True
            self._stop.set()


__all__ = ["EXIT_BAD_GRAPH", "EXIT_DEADLOCK", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_STUCK",
           "RunResult", "Runtime"]
