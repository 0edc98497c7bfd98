"""The plumbing of stop signals for :class:`csp.runtime.engine.Runtime`: SIGINT and SIGTERM.

What a signal does is the engine's (its module doc: the first one stops gracefully, a second one
aborts; ``Runtime._on_signal`` decides). This module holds how the signals reach it: taken in
the main thread only, handed to the event loop while it runs (so the handler runs as a loop
callback, outside any channel code) and given back afterwards; the line each signal logs; and
the line a graceful stop logs every ``DRAIN_REPORT_S`` naming the replicas it still waits for.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from contextlib import contextmanager
from time import perf_counter
from typing import Any, Callable, Iterator, Sequence

from csp.runtime.worker import Worker

log = logging.getLogger("csp.runtime")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run."""

Handler = Callable[[int, Any], None]
"""``handler(signum, frame)``, as :func:`signal.signal` calls it."""


def take(handler: Handler) -> dict[int, Any]:
    """Route SIGINT and SIGTERM to ``handler``; returns the handlers to :func:`restore`. Only the
    main thread may take signals: from any other thread nothing changes and ``{}`` comes back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def restore(old: dict[int, Any]) -> None:
    """Put back the handlers :func:`take` returned."""
    for sig, handler in old.items():
        signal.signal(sig, handler)


@contextmanager
def through_loop(loop: asyncio.AbstractEventLoop, handler: Handler) -> Iterator[None]:
    """While the body runs, let ``loop`` take the signals: it wakes its selector (wakeup fd) and
    runs ``handler(signum, None)`` as a loop callback. Afterwards ``handler`` takes them directly."""
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handler, sig, None)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


def still_running(workers: Sequence[Worker]) -> list[str]:
    """The qualnames of the replicas not done yet (in ``setup`` or ``run``)."""
    return [w.qualname for w in workers if w.state in ("setup", "running")]


def announce(signum: int, count: int, workers: Sequence[Worker]) -> str:
    """Log what the ``count``-th stop signal does (the first: a graceful stop; a later one: an
    abort, naming the replicas still running) and return the signal's name."""
    name = signal.Signals(signum).name
    if count == 1:
        log.warning("%s: graceful stop requested (sources stop, items drain); "
                    "press Ctrl-C (or send SIGTERM) again to abort", name)
    else:
        running = still_running(workers)
        log.warning("second stop signal (%s): aborting the run%s", name,
                    f" (still running: {', '.join(running)})" if running else "")
    return name


def report_drain(loop: asyncio.AbstractEventLoop, workers: Sequence[Worker], every_s: float,
                 over: Callable[[], bool]) -> None:
    """From any thread, when a graceful stop begins: in ``every_s`` seconds and again every
    ``every_s``, one line naming the replicas still running, until none is or ``over()`` (the run
    is shutting down); loop callbacks, so they die with the loop."""
    loop.call_soon_threadsafe(loop.call_later, every_s, _report, loop, workers, every_s, over, perf_counter())


def _report(loop: asyncio.AbstractEventLoop, workers: Sequence[Worker], every_s: float,
            over: Callable[[], bool], since: float) -> None:
    running = still_running(workers)
    if not running or over() or loop.is_closed():
        return
    log.warning("draining: %s still running, %.0f s after the stop (Ctrl-C again aborts)",
                ", ".join(running), perf_counter() - since)
    loop.call_later(every_s, _report, loop, workers, every_s, over, since)


__all__ = ["STOP_SIGNALS", "announce", "report_drain", "restore", "still_running", "take", "through_loop"]
