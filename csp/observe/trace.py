"""Chrome/Perfetto trace recording: process spans, channel fill counters, item flows.

The output is the Chrome trace-event JSON format (``{"traceEvents": [...]}``; spec: "Trace Event
Format", Google, docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU),
which ui.perfetto.dev and chrome://tracing open. One track (``tid``) per process replica:

* ``"X"`` complete events for ``setup``, ``run``, ``teardown`` and every ``ctx.span(name)``;
* ``"C"`` counter events ``fill <channel>`` sampled by the stats sampler;
* ``"s"``/``"t"``/``"f"`` flow events following every N-th item a source sends across each hop.

Recording never blocks a process: events are appended to a list (a GIL-atomic operation) and
written once, at the end of the run. When tracing is off, :meth:`csp.Context.span` returns a
shared no-op context manager and no Tracer exists at all.
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import msgspec

PID = 1  # one trace "process" per run; tracks (tid) are process replicas


class Tracer:
    """Collects trace events in memory; :meth:`write` dumps them as Chrome trace JSON.

    Args:
        max_events: events beyond this are dropped (counted in ``dropped``) so a long run cannot
            exhaust memory.
        flow_every: sources start a flow on every N-th item they send (only used by
            :class:`FlowTap` ends).

    Timestamps are microseconds since the tracer was created (``time.perf_counter``).
    """

    def __init__(self, *, max_events: int = 1_000_000, flow_every: int = 100) -> None:
        self._t0 = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._max = max_events
        self.dropped = 0
        self.flow_every = flow_every
        self._flow_ids = itertools.count(1)
        self._tracks: dict[int, str] = {}

    def now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def _add(self, event: dict[str, Any]) -> None:
        if len(self._events) < self._max:
            self._events.append(event)  # list.append is atomic under the GIL: no lock needed
        else:
            self.dropped += 1

    def name_track(self, track: int, name: str) -> None:
        """Label track ``track`` (a replica) as ``name`` (its qualname) in the viewer."""
        self._tracks[track] = name

    @contextmanager
    def span(self, track: int, name: str, args: dict[str, Any] | None = None) -> Iterator[None]:
        """Record an ``"X"`` event covering the ``with`` body on ``track``."""
        start = self.now_us()
        try:
            yield
        finally:
            ev = {"name": name, "ph": "X", "ts": start, "dur": self.now_us() - start,
                  "pid": PID, "tid": track}
            if args:
                ev["args"] = args
            self._add(ev)

    def counter(self, name: str, values: dict[str, float], ts_us: float | None = None) -> None:
        """Record a ``"C"`` counter sample (one counter track per ``name``, one line per key)."""
        self._add({"name": name, "ph": "C", "ts": self.now_us() if ts_us is None else ts_us,
                   "pid": PID, "args": values})

    def new_flow(self) -> int:
        return next(self._flow_ids)

    def flow(self, phase: str, flow_id: int, track: int, name: str = "item") -> None:
        """Record a flow event: ``phase`` is "s" (start), "t" (step) or "f" (finish)."""
        ev = {"name": name, "cat": "flow", "ph": phase, "id": flow_id, "ts": self.now_us(),
              "pid": PID, "tid": track}
        if phase != "s":
            ev["bp"] = "e"  # bind to the enclosing slice
        self._add(ev)

    def events(self) -> list[dict[str, Any]]:
        """A copy of the recorded events plus the track-name metadata events."""
        meta = [{"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "csp"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": n}}
                 for tid, n in sorted(self._tracks.items())]
        meta += [{"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                  "args": {"sort_index": tid}} for tid in sorted(self._tracks)]
        return meta + list(self._events)

    def write(self, path: Path) -> Path:
        """Write ``{"traceEvents": [...], "otherData": {...}}`` atomically to ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms",
               "otherData": {"dropped_events": self.dropped}}
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(msgspec.json.encode(doc))
        os.replace(tmp, path)
        return path


class FlowTap:
    """Wraps a channel end so sampled items leave flow events in the trace.

    A source replica (no inputs) starts a flow on every ``flow_every``-th item it sends; every
    later hop is linked by item identity on the channel (an item object sent is the object
    received) and, inside a process, by "the last flow this replica received goes with its next
    send". That follows one item exactly through 1:1 stages and approximately through batching
    stages. Everything else is delegated to the wrapped end unchanged.
    """

    def __init__(self, end: Any, tracer: Tracer, track: int, state: dict[str, Any],
                 pending: dict[int, int], is_source: bool, is_sink: bool) -> None:
        self._end = end
        self._tracer = tracer
        self._track = track
        self._state = state  # per replica: {"flow": id or None, "sent": count}
        self._pending = pending  # per channel: id(item) -> flow id
        self._is_source = is_source
        self._is_sink = is_sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self._end, name)

    def __enter__(self) -> "FlowTap":
        return self

    def __exit__(self, *exc: object) -> None:
        self._end.close()

    # -- send side ----------------------------------------------------------------------------
    def _on_send(self, item: Any) -> None:
        st = self._state
        flow = st.get("flow")
        if self._is_source:
            st["sent"] = st.get("sent", 0) + 1
            if (st["sent"] - 1) % self._tracer.flow_every == 0:
                flow = self._tracer.new_flow()
                self._tracer.flow("s", flow, self._track)
                self._pending[id(item)] = flow
            return
        if flow is not None:
            st["flow"] = None
            self._tracer.flow("t", flow, self._track)
            self._pending[id(item)] = flow

    def _undo(self, item: Any) -> None:
        self._pending.pop(id(item), None)

    def send(self, item: Any, *args: Any, **kw: Any) -> None:
        self._on_send(item)
        try:
            self._end.send(item, *args, **kw)
        except BaseException:
            self._undo(item)
            raise

    def send_nowait(self, item: Any, *args: Any, **kw: Any) -> None:
        self._on_send(item)
        try:
            self._end.send_nowait(item, *args, **kw)
        except BaseException:
            self._undo(item)
            raise

    async def asend(self, item: Any, *args: Any, **kw: Any) -> None:
        self._on_send(item)
        try:
            await self._end.asend(item, *args, **kw)
        except BaseException:
            self._undo(item)
            raise

    # -- receive side -------------------------------------------------------------------------
    def _on_receive(self, item: Any) -> Any:
        flow = self._pending.pop(id(item), None)
        if flow is not None:
            self._tracer.flow("f" if self._is_sink else "t", flow, self._track)
            if not self._is_sink:
                self._state["flow"] = flow
        return item

    def receive(self, *args: Any, **kw: Any) -> Any:
        return self._on_receive(self._end.receive(*args, **kw))

    def receive_nowait(self) -> Any:
        return self._on_receive(self._end.receive_nowait())

    async def areceive(self) -> Any:
        return self._on_receive(await self._end.areceive())

    def __iter__(self) -> Iterator[Any]:
        from csp.errors import EndOfStream

        while True:
            try:
                yield self.receive()
            except EndOfStream:
                return

    def __aiter__(self) -> "FlowTap":
        return self

    async def __anext__(self) -> Any:
        from csp.errors import EndOfStream

        try:
            return await self.areceive()
        except EndOfStream:
            raise StopAsyncIteration from None


__all__ = ["FlowTap", "Tracer"]
