"""Deadlock detection: every live process waits inside a channel call and nothing moves.

A graph of bounded channels can wait forever: a process that never reads one of its inputs lets
that channel fill, its writer blocks sending, and everyone downstream of the writer waits for
input. No exception is raised anywhere; the run just stops moving. :class:`DeadlockWatch` is a
daemon thread of the runtime that notices it:

* a process replica is *waiting* while one of its channel ends is inside a blocking ``send`` or
  ``receive`` (``end.waiting``: a parked call). A replica in ``setup``, computing, sleeping, or
  polling with ``*_nowait`` is not waiting: it may still send, so it never counts towards a
  deadlock, however long it takes (the false positive to avoid is a slow stage).
* *progress* is any change of the ends' counters: an item through any end, or a blocking call
  that ended (a ``receive(timeout=...)`` that timed out is activity too).
* the run is *deadlocked* once, for ``timeout_s`` seconds in a row, every live replica was waiting
  at every check and no counter changed. Checks run every ``min(1 s, timeout_s / 4)``.

Then :func:`explain` names the cycle of waits, built from who waits for whom: a replica blocked
sending on channel ``c`` waits for the live readers of ``c``; one waiting to receive on ``c``
waits for its live writers. Every live replica waits for another live one, so the wait-for graph
has a cycle; the shortest is named in the direction of the waits, e.g. ``split[0] blocked sending
on 'b' (full: 1/1), which merge[0] never receives: merge[0] waits to receive on 'a' (empty),
which only split[0] sends``.

The runtime then aborts every channel (each waiting call wakes with ``ChannelAborted``) and ends
the run with status ``"deadlocked"`` and exit code 4 (``csp.runtime.engine.EXIT_DEADLOCK``); the stats
log's final record carries the explanation as ``deadlock`` and ``python -m csp.inspect`` shows it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from time import perf_counter
from typing import Any, Callable, Sequence

log = logging.getLogger("csp.runtime.deadlock")

LIVE_STATES = ("setup", "running")


def _ends(w: Any) -> list[tuple[str, Any, bool]]:
    """``(channel, end, sending)`` for every end of worker ``w``."""
    return ([(w.node.inputs[p], e, False) for p, e in w.raw_inputs.items()]
            + [(w.node.outputs[p], e, True) for p, e in w.raw_outputs.items()])


def is_waiting(w: Any) -> bool:
    """True while replica ``w`` is running and one of its ends is inside a blocking call."""
    return w.state == "running" and any(e.waiting for _, e, _ in _ends(w))


def progress_mark(workers: Sequence[Any]) -> tuple:
    """A value that changes whenever an item moves through, or a blocking call ends on, any end."""
    return tuple((e.items, round(e._blocked, 9)) for w in workers for _, e, _ in _ends(w))


def explain(workers: Sequence[Any]) -> str:
    """Name the shortest cycle of waits among the live replicas of ``workers`` (see module doc).

    Returns one line; when no cycle can be found (a replica stopped waiting meanwhile) it lists
    what each live replica waits on instead."""
    live = [w for w in workers if w.state in LIVE_STATES]
    waits: dict[str, list[tuple[str, bool, Any, list[str]]]] = {}  # qualname -> (chan, sending, end, peers)
    for w in live:
        for chan, end, sending in _ends(w):
            if not end.waiting:
                continue
            peers = [v.qualname for v in live if v is not w and any(
                c == chan and s != sending for c, _, s in _ends(v))]
            waits.setdefault(w.qualname, []).append((chan, sending, end, peers))
    edges = {q: [(p, i) for i, (_, _, _, peers) in enumerate(ws) for p in peers] for q, ws in waits.items()}
    best: list[tuple[str, int]] | None = None
    for start in waits:  # BFS back to start: the shortest cycle through it
        prev: dict[str, tuple[str, int]] = {}
        queue, seen, found = deque([start]), {start}, False
        while queue and not found:
            q = queue.popleft()
            for p, i in edges.get(q, []):
                if p == start:
                    prev[start] = (q, i)
                    found = True
                    break
                if p not in seen and p in waits:
                    seen.add(p)
                    prev[p] = (q, i)
                    queue.append(p)
        if not found:
            continue
        path, node = [], start
        while True:  # walk back from start to start
            q, i = prev[node]
            path.append((q, i))
            node = q
            if node == start:
                break
        path.reverse()
        if best is None or len(path) < len(best):
            best = path
    if best is None:
        return "; ".join(f"{q} {_what(ws[0])}" for q, ws in waits.items()) or "no replica is waiting"
    parts = []
    for k, (q, i) in enumerate(best):
        nxt = best[(k + 1) % len(best)][0]
        chan, sending, end, peers = waits[q][i]
        others = [p for p in peers if p != nxt]
        who = nxt if not others else f"{nxt} (nor {', '.join(others)})"
        verb = "receives" if sending else ("sends" if not others else "send")
        parts.append(f"{q} {_what(waits[q][i])}, which {who} never {verb}")
    return ": ".join(parts)


def _what(wait: tuple[str, bool, Any, list[str]]) -> str:
    chan, sending, end, _ = wait
    st = end.statistics()
    if sending:
        return f"blocked sending on '{chan}' (full: {st.current_fill}/{st.capacity})"
    if st.current_fill:  # an ordered channel holding items, but not the next in sequence
        return (f"waits to receive on '{chan}' (ordered: holds {st.current_fill} items, not the next "
                "in sequence)")
    return f"waits to receive on '{chan}' (empty)"


class DeadlockWatch:
    """The watchdog thread (``csp-deadlock``): calls ``on_deadlock(explanation)`` once when the
    run has been deadlocked for ``timeout_s`` seconds (module doc), then exits.

    Args:
        workers: the runtime's process replicas (read only: states and end counters).
        timeout_s: seconds of continuous deadlock before ``on_deadlock`` (> 0).
        on_deadlock: called from the watchdog thread with the one-line explanation.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, workers: Sequence[Any], timeout_s: float, on_deadlock: Callable[[str], None],
                 clock: Callable[[], float] = perf_counter) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        self.on_deadlock = on_deadlock
        self.clock = clock
        self.tick_s = min(1.0, timeout_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="csp-deadlock", daemon=True)
        self._mark: tuple | None = None
        self._since = clock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (idempotent); waits for it briefly."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def check(self) -> str | None:
        """One check; returns the explanation once the deadlock has lasted ``timeout_s``."""
        now = self.clock()
        live = [w for w in self.workers if w.state in LIVE_STATES]
        mark = progress_mark(self.workers)
        if not live or mark != self._mark or not all(is_waiting(w) for w in live):
            self._mark, self._since = mark, now
            return None
        if now - self._since < self.timeout_s:
            return None
        return explain(self.workers)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                why = self.check()
            except Exception:  # observability must never take the run down
                log.exception("deadlock check failed; checking stops")
                return
            if why is not None:
                self.on_deadlock(f"{why} (nothing moved for {self.timeout_s:g} s while every live "
                                 "process waited on a channel)")
                return


__all__ = ["DeadlockWatch", "explain", "is_waiting", "progress_mark"]
