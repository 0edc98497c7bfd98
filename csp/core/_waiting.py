"""How a channel call waits: the one send/receive algorithm and the waiters it parks.

Private to ``csp.core.channel`` (see its module doc). Every send and receive, from a thread or a task,
blocking or not, is :func:`_step` under the channel lock: try the operation now (the state's
``try_send`` / ``try_receive``); if it can not be done, park a *waiter* in the state. The waiter
sleeps outside the lock and, once woken, the call steps again. ``thread_call`` and ``task_call``
differ only in how they sleep; ``nowait`` steps once and never parks.

A waiter is woken (``wake()``) by whoever changed its ``state``, after the lock is released.
States: ``PENDING`` (parked), ``DONE`` (a sender's offer was taken: its send is complete),
``RETRY`` (woken: step again).
"""

from __future__ import annotations

import asyncio
import threading
from time import perf_counter
from typing import Any, Callable

from csp.errors import ChannelTimeout, NoEventLoop

__all__ = ["BLOCKED", "DONE", "Item", "Outcome", "PENDING", "RETRY", "SENT", "SEQ", "checkpoint",
           "nowait", "task_call", "thread_call", "wake_all"]

PENDING, DONE, RETRY = 0, 1, 2
_allocate_lock = threading.Lock
_get_ident = threading.get_ident


# An item on its way: ``(payload, nbytes, seq)``: the payload in ``csp.cuda.handoff.outbound``'s form,
# its size in bytes, its ``seq`` (None off ordered channels).
Item = tuple  # tuple[Any, int, int | None]
SEQ = 2  # an Item's index of its seq

# What one try of a send or receive did: ``(done, payload, wake)``. ``done``: the item was
# accepted (send) or taken (receive); False: park and try again when woken. ``payload``: the
# taken item's payload (receive), else None. ``wake``: the waiters to wake once the lock is
# released. One shape for both operations, unpacked by name where it is used; a plain tuple, as a
# NamedTuple costs about 0.5 us more per item moved (two are built per item).
Outcome = tuple  # tuple[bool, Any, tuple]
BLOCKED: Outcome = (False, None, ())
SENT: Outcome = (True, None, ())


# ---- waiters --------------------------------------------------------------------------------------
class ThreadWaiter:
    """A call parked by an OS thread; sleeps on a private lock acquired at creation.

    ``item`` is the offer of a parked send, None for a receive; ``t0`` (``perf_counter`` seconds)
    is set when it is parked."""

    __slots__ = ("end", "item", "state", "t0", "_lock")

    def __init__(self, end: Any, item: Item | None) -> None:
        self.end = end
        self.item = item
        self.state = PENDING
        self.t0 = 0.0
        lock = _allocate_lock()
        lock.acquire()
        self._lock = lock

    def wait(self, timeout: float) -> bool:
        """Sleep until woken (True) or ``timeout`` seconds pass (False); -1 waits forever."""
        return self._lock.acquire(True, timeout)

    def wake(self) -> None:
        """Wake the thread (called at most once per waiter, by whoever changed its state)."""
        self._lock.release()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class AsyncWaiter:
    """A call parked by an asyncio task (anyio's asyncio backend); sleeps on a future.

    Raises:
        NoEventLoop (a RuntimeError): created outside a running event loop.
    """

    __slots__ = ("end", "item", "state", "t0", "future", "_loop", "_tid")

    def __init__(self, end: Any, item: Item | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise NoEventLoop(
                "csp async channel operations need an asyncio event loop (anyio's asyncio backend); "
                "from a thread use send()/receive() instead"
            ) from None
        self.end = end
        self.item = item
        self.state = PENDING
        self.t0 = 0.0
        self.future = loop.create_future()
        self._loop = loop
        self._tid = _get_ident()

    def wake(self) -> None:
        """Resolve the future: directly on the loop's thread, else via call_soon_threadsafe."""
        if _get_ident() == self._tid:
            _resolve(self.future)
        else:
            try:
                self._loop.call_soon_threadsafe(_resolve, self.future)
            except RuntimeError:  # the loop is closed: nobody awaits this future any more
                pass


Waiter = ThreadWaiter | AsyncWaiter
"""A parked send or receive: a blocked thread's or a suspended task's (what a channel state queues)."""


def wake_all(waiters: tuple | list) -> None:
    """Wake every waiter (call after releasing the channel lock)."""
    for w in waiters:
        w.wake()


async def checkpoint() -> None:
    """A cancellation point that yields to the loop once: ``asyncio.sleep(0)``, which is what
    anyio's ``checkpoint()`` does on its asyncio backend, without the backend lookup (~0.7 us)."""
    await asyncio.sleep(0)


# ---- the one algorithm: try now, else park a waiter and retry when woken --------------------------
Attempt = Callable[[Any, Any], Outcome]  # the state's try_send or try_receive


def _step(end: Any, attempt: Attempt, item: Item | None, w: Waiter | None, new_waiter: Callable,
          timeout: float | None, deadline: float | None) -> tuple[Outcome, Any]:
    """One try of a send (``item`` set) or receive (``item`` None), under the channel lock.

    ``w`` is the waiter this call parked last (None on the first try); it has been woken, or
    its thread's wait timed out while it was still PENDING. Returns the outcome and the waiter now
    parked (None when the call is done); the caller wakes the outcome's waiters after this returns.

    Raises:
        ChannelTimeout (a TimeoutError): ``deadline`` (``perf_counter`` seconds) passed with the call not done.
        And the errors of ``attempt``.
    """
    state = end._core
    with state.lock:
        if w is not None:
            if w.state == DONE:  # a receiver took this offer: the send is complete
                return SENT, None
            if w.state == PENDING:  # the thread's wait timed out
                state.withdraw(w)
                raise _timed_out(state, item, timeout)
        out = attempt(end, item)
        if out[0]:
            return out, None
        if deadline is not None and perf_counter() >= deadline:
            raise _timed_out(state, item, timeout)
        w = new_waiter(end, item)
        return state.park(w), w


def _timed_out(state: Any, item: Item | None, timeout: float | None) -> ChannelTimeout:
    what, why = ("send", "channel full") if item is not None else ("receive", "channel empty")
    return ChannelTimeout(f"channel {state.name!r}: {what} timed out after {timeout} s ({why})", state.name)


def _give_up(end: Any, w: Waiter) -> None:
    """The parked call was cancelled or interrupted: withdraw it, pass a wake-up on."""
    with end._core.lock:
        wake = end._core.cancel(w)
    wake_all(wake)


def thread_call(end: Any, attempt: Attempt, item: Item | None, timeout: float | None) -> Any:
    """Run a send or receive from an OS thread, blocking it while the call can not be done.

    Returns the received payload (None for a send). Raises as ``attempt``, and ChannelTimeout."""
    deadline = None if timeout is None or timeout > 0 else perf_counter()  # <= 0: never park
    (_, payload, wake), w = _step(end, attempt, item, None, ThreadWaiter, timeout, deadline)
    wake_all(wake)
    if w is None:
        return payload
    end._wait_t0 = w.t0
    if timeout is not None:  # counted from parking, so a timed-out call was blocked >= timeout
        deadline = w.t0 + timeout
    try:
        while True:
            try:
                w.wait(-1 if deadline is None else max(0.0, deadline - perf_counter()))
            except BaseException:  # KeyboardInterrupt in the main thread
                _give_up(end, w)
                raise
            (_, payload, wake), w = _step(end, attempt, item, w, ThreadWaiter, timeout, deadline)
            wake_all(wake)
            if w is None:
                return payload
    finally:
        end._end_wait()


async def task_call(end: Any, attempt: Attempt, item: Item | None) -> Any:
    """Run a send or receive from an asyncio task, awaiting while the call can not be done (no
    checkpoint of its own: the caller makes one before it prepares the call). Returns as
    :func:`thread_call`; cancelling it withdraws the call (see ``ChannelState.cancel``)."""
    (_, payload, wake), w = _step(end, attempt, item, None, AsyncWaiter, None, None)
    wake_all(wake)
    if w is None:
        return payload
    end._wait_t0 = w.t0
    try:
        while True:
            try:
                await w.future
            except BaseException:  # cancelled
                _give_up(end, w)
                raise
            (_, payload, wake), w = _step(end, attempt, item, w, AsyncWaiter, None, None)
            wake_all(wake)
            if w is None:
                return payload
    finally:
        end._end_wait()


def nowait(end: Any, attempt: Attempt, item: Item | None) -> Outcome:
    """Try a send or receive once, never parking; wakes the outcome's waiters."""
    state = end._core
    with state.lock:
        out = attempt(end, item)
    if out[2]:
        wake_all(out[2])
    return out
