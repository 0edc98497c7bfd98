"""Periodic statistics snapshots -> ``RUN_DIR/csp/stats.jsonl``.

One JSON object per line (format fixed by ``docs/architecture.md``):

1. ``{"kind": "header", "t0": <unix s>, "graph": {"channels": [{"name", "capacity", "ordered"}],
   "processes": [{"name", "replicas", "inputs": {port: channel}, "outputs": {...}}]}}``
2. ``{"kind": "snapshot", "t": <s since start>, "channels": {name: ChannelStatistics},
   "processes": {"target[0]": ProcessStatistics}}`` every ``stats_interval_s`` seconds;
3. ``{"kind": "final", ...same as a snapshot..., "status": "completed", "exit_code": 0}``; a
   deadlocked run's also has ``"deadlock": "<the cycle of waits>"`` (status "deadlocked", exit 4).

The sampler is one daemon thread that only *reads* statistics (channel cores take their own lock
for a few microseconds; process statistics are plain attribute reads), so it never blocks a
process. Each line is flushed as it is written: a live run can be inspected with ``tail -f``.
The same tick records the channel fill counters of the trace, when tracing is on.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import msgspec

from csp.core.stats import ChannelStatistics, ProcessStatistics
from csp.observe.trace import Tracer

log = logging.getLogger("csp.observe.statslog")

ChannelsFn = Callable[[], Mapping[str, ChannelStatistics]]
ProcessesFn = Callable[[], Mapping[str, ProcessStatistics]]


def unwritable(path: Path, exc: BaseException | None, what: str) -> str:
    """The one line for an observability file that cannot be written (a full disk, a quota, a
    vanished directory): the path, the OS's reason, the free space left there, and what is lost."""
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    cause = getattr(exc, "strerror", None) or (str(exc) if exc is not None else "write failed")
    return f"cannot write {path} ({cause}; {free}); {what}"


class GraphShape(Protocol):
    """What the header reads of a graph (a :class:`csp.Graph` is one): its channels (``name``,
    ``capacity``, ``ordered``) and processes (``name``, ``replicas``, ``inputs``, ``outputs``,
    ``devices``) by name. Observing needs no graph file, so this room does not import :mod:`csp.graph`."""

    @property
    def channels(self) -> Mapping[str, Any]: ...

    @property
    def processes(self) -> Mapping[str, Any]: ...


def graph_header(graph: GraphShape) -> dict[str, Any]:
    """The ``graph`` object of the header line for a :class:`csp.Graph`."""
    return {
        "channels": [{"name": c.name, "capacity": c.capacity, "ordered": c.ordered}
                     for c in graph.channels.values()],
        "processes": [{"name": p.name, "replicas": p.replicas, "inputs": dict(p.inputs),
                       "outputs": dict(p.outputs), "devices": list(p.devices)}
                      for p in graph.processes.values()],
    }


class StatsWriter:
    """Writes the header now, snapshots every ``interval_s`` from a thread, the final line on
    :meth:`close`.

    Args:
        path: the JSONL file (parent directories are created).
        graph: the :class:`csp.Graph` being run (for the header).
        channels: returns channel name -> ChannelStatistics now.
        processes: returns qualname -> ProcessStatistics now.
        interval_s: snapshot period in seconds.
        tracer: a :class:`csp.observe.trace.Tracer` to receive ``fill <channel>`` counters, or None.
    """

    def __init__(self, path: Path, graph: GraphShape, channels: ChannelsFn, processes: ProcessesFn,
                 interval_s: float, tracer: Tracer | None = None) -> None:
        self.path = path
        self._channels = channels
        self._processes = processes
        self._interval = interval_s
        self._tracer = tracer
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # serialises lines from the sampler and close()
        self.failed: OSError | None = None  # the write that failed; later lines are dropped
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("wb")
        self._write({"kind": "header", "t0": time.time(), "graph": graph_header(graph),
                     "host": {"cpus": os.cpu_count() or 0}})
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the sampler thread (``csp-stats``)."""
        self._thread = threading.Thread(target=self._loop, name="csp-stats", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, Any]:
        """The current snapshot record (also feeds the trace's channel fill counters)."""
        channels = self._channels()
        if self._tracer is not None:
            ts = self._tracer.now_us()
            for name, st in channels.items():
                self._tracer.counter(f"fill {name}", {"fill": st.current_fill}, ts)
        return {
            "kind": "snapshot",
            "t": time.perf_counter() - self._t0,
            "channels": {n: msgspec.structs.asdict(s) for n, s in channels.items()},
            "processes": {q: msgspec.structs.asdict(s) for q, s in self._processes().items()},
        }

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._write(self.snapshot())
            except Exception:  # observability must never take the run down
                log.exception("stats snapshot failed; sampling continues")

    def _write(self, record: dict[str, Any]) -> None:
        """Append one line. A write the OS refuses (a full disk) is said once, as one line, and
        every later line is dropped: observability never stops the run it observes."""
        with self._lock:
            if self._file.closed or self.failed is not None:
                return
            try:
                self._file.write(msgspec.json.encode(record) + b"\n")
                self._file.flush()
            except OSError as exc:
                self.failed = exc
                log.error("%s", unwritable(self.path, exc, "the stats log stops here (csp.inspect reads "
                                                          "what it holds); the run goes on"))

    def close(self, status: str, exit_code: int, deadlock: str | None = None) -> None:
        """Stop the sampler, write the ``final`` line (with ``deadlock``, the cycle of waits of a
        deadlocked run, when given) and close the file. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():
                log.error("stats sampler thread did not stop within 10 s")
        if self._file.closed:
            return
        record = self.snapshot()
        record.update(kind="final", status=status, exit_code=exit_code)
        if deadlock is not None:
            record["deadlock"] = deadlock
        self._write(record)
        with self._lock:
            try:
                self._file.close()
            except OSError:  # the buffered bytes of a write that already failed and was said
                pass


__all__ = ["GraphShape", "StatsWriter", "graph_header", "unwritable"]
