"""The lock-protected state shared by every end of one channel, and the waiters parked in it.

Private to ``csp.channel`` (see its module doc for the protocol). Every ``Core`` method whose name
does not say otherwise must be called with ``core.lock`` held; methods return the waiters to wake
and the caller wakes them *after* releasing the lock.

Waiter states: ``PENDING`` (parked), ``DONE`` (a sender's offer was taken: its send is complete),
``RETRY`` (woken: retry the operation under the lock).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from time import perf_counter
from typing import Any

from csp.errors import ChannelAborted, ChannelClosed, EndOfStream, PeerGone
from csp.stats import ChannelStatistics

__all__ = ["AsyncWaiter", "Core", "ThreadWaiter", "checkpoint"]

PENDING, DONE, RETRY = 0, 1, 2
_EMPTY: Any = object()  # "nothing to take" marker
_NOTHING = (_EMPTY, None, None)
_allocate_lock = threading.Lock


async def checkpoint() -> None:
    """A cancellation point that yields to the loop once: ``asyncio.sleep(0)``, which is what
    anyio's ``checkpoint()`` does on its asyncio backend, without the backend lookup (~0.7 us)."""
    await asyncio.sleep(0)


_get_ident = threading.get_ident


class ThreadWaiter:
    """A parked call from an OS thread; sleeps on a private lock acquired at creation."""

    __slots__ = ("end", "payload", "nbytes", "seq", "state", "t0", "_lock")

    def __init__(self, end: Any, payload: Any = None, nbytes: int = 0, seq: int | None = None) -> None:
        self.end = end
        self.payload = payload
        self.nbytes = nbytes
        self.seq = seq
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
    """A parked call from an asyncio task (anyio's asyncio backend); sleeps on a future."""

    __slots__ = ("end", "payload", "nbytes", "seq", "state", "t0", "future", "_loop", "_tid")

    def __init__(self, end: Any, payload: Any = None, nbytes: int = 0, seq: int | None = None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "csp async channel operations need an asyncio event loop (anyio's asyncio backend); "
                "from a thread use send()/receive() instead"
            ) from None
        self.end = end
        self.payload = payload
        self.nbytes = nbytes
        self.seq = seq
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


class _Many:
    """Several waiters woken as one."""

    __slots__ = ("waiters",)

    def __init__(self, waiters: list) -> None:
        self.waiters = waiters

    def wake(self) -> None:
        for w in self.waiters:
            w.wake()


class Core:
    """Buffer, parked waiters, open-end counts and counters of one channel."""

    def __init__(self, item_type: Any, capacity: int, name: str, ordered: bool) -> None:
        self.lock = threading.Lock()
        self.item_type = item_type
        self.capacity = capacity
        self.name = name
        self.ordered = ordered
        self.window = max(capacity, 1)  # ordered: seqs admitted ahead of the next expected one
        self.check_type = _checkable(item_type)
        self.buf: deque = deque()  # unordered: (payload, nbytes)
        self.pending: dict[int, tuple[Any, int]] = {}  # ordered: seq -> (payload, nbytes)
        self.next_seq = 0
        self.senders: deque = deque()  # unordered: parked offers, oldest first
        self.osenders: dict[int, Any] = {}  # ordered: seq -> parked offer
        self.receivers: deque = deque()  # parked receivers not yet woken, oldest first
        self.send_ends = 1
        self.recv_ends = 1
        self.aborted: str | None = None
        self.peak = 0
        self.items_moved = 0
        self.bytes_moved = 0
        self.send_blocked = 0.0
        self.recv_wait = 0.0

    # ---- errors -------------------------------------------------------------------------------
    def _check(self, end: Any, what: str) -> None:
        if self.aborted is not None:
            raise ChannelAborted(
                f"channel {self.name!r} was aborted: {self.aborted}", self.name, self.aborted
            )
        if end._closed:
            raise ChannelClosed(
                f"channel {self.name!r}: this {what} end is closed; clone() it before closing if "
                "someone still needs it",
                self.name,
            )

    def raise_type(self, item: Any) -> None:
        """Raise the TypeError for an item of the wrong type (called without the lock)."""
        want = getattr(self.item_type, "__qualname__", repr(self.item_type))
        raise TypeError(
            f"channel {self.name!r} carries {want}, got {type(item).__qualname__}; send a {want} "
            "or declare the channel with a matching item_type"
        )

    # ---- sending ------------------------------------------------------------------------------
    def admit(self, end: Any, payload: Any, nbytes: int, seq: int | None) -> Any:
        """Try to put an item in. Returns False (no room), True, or a receiver waiter to wake."""
        if self.aborted is not None or end._closed:
            self._check(end, "send")
        if self.recv_ends == 0:
            raise PeerGone(
                f"channel {self.name!r}: every receive end is closed; nobody will receive this item",
                self.name,
            )
        if self.ordered:
            return self._admit_ordered(payload, nbytes, seq)
        buf = self.buf
        if len(buf) < self.capacity or self.receivers:
            buf.append((payload, nbytes))
            if len(buf) > self.peak:
                self.peak = len(buf)
            if self.receivers:
                w = self.receivers.popleft()
                w.state = RETRY
                return w
            return True
        return False

    def _admit_ordered(self, payload: Any, nbytes: int, seq: int | None) -> Any:
        if seq is None or isinstance(seq, bool) or not isinstance(seq, int):
            raise ValueError(
                f"channel {self.name!r} is ordered: pass seq=<int> (0, 1, 2, ... per run) to send, "
                f"got {seq!r}"
            )
        nxt = self.next_seq
        if seq < nxt or seq in self.pending or seq in self.osenders:
            raise ValueError(
                f"channel {self.name!r}: seq {seq} was already sent on this ordered channel (next "
                f"expected is {nxt}); every item needs its own seq"
            )
        if seq >= nxt + self.window:
            return False
        self.pending[seq] = (payload, nbytes)
        if len(self.pending) > self.peak:
            self.peak = len(self.pending)
        if seq == nxt and self.receivers:
            w = self.receivers.popleft()
            w.state = RETRY
            return w
        return True

    def park_sender(self, w: Any) -> Any:
        """Park a send offer. Returns a receiver to wake if that lets it skip an ordered gap."""
        w.t0 = perf_counter()
        if not self.ordered:
            self.senders.append(w)
            return None
        self.osenders[w.seq] = w
        if self.receivers and len(self.osenders) >= self.send_ends:
            r = self.receivers.popleft()
            r.state = RETRY
            return r
        return None

    def unpark_sender(self, w: Any) -> None:
        """Withdraw a PENDING offer (timeout or cancellation): its item stays with the sender."""
        if self.ordered:
            del self.osenders[w.seq]
        else:
            self.senders.remove(w)

    # ---- receiving ----------------------------------------------------------------------------
    def take(self, end: Any) -> tuple[Any, Any, Any]:
        """Take the next payload: ``(payload | _EMPTY, waiter to wake | None, another | None)``."""
        if self.aborted is not None or end._closed:
            self._check(end, "receive")
        if self.ordered:
            return self._take_ordered()
        buf = self.buf
        w = None
        if buf:
            payload, nbytes = buf.popleft()
            if self.senders and len(buf) < self.capacity:
                w = self.senders.popleft()  # move the oldest offer into the freed slot
                w.state = DONE
                buf.append((w.payload, w.nbytes))
        elif self.senders:  # rendezvous (or a slot freed by a woken receiver): take the offer
            w = self.senders.popleft()
            w.state = DONE
            payload, nbytes = w.payload, w.nbytes
        elif self.send_ends == 0:
            raise EndOfStream(
                f"channel {self.name!r}: every send end is closed and the buffer is empty", self.name
            )
        else:
            return _NOTHING
        self.items_moved += 1
        self.bytes_moved += nbytes
        return payload, w, None

    def _take_ordered(self) -> tuple[Any, Any, Any]:
        pending = self.pending
        entry = pending.pop(self.next_seq, None)
        w1 = None
        if entry is None:
            if len(self.osenders) < self.send_ends:
                return _NOTHING  # an open, unblocked sender may still send the missing seq
            # Nobody left who could fill the gap: deliver the lowest seq that exists.
            if pending:
                seq = min(pending)
                entry = pending.pop(seq)
            elif self.osenders:
                seq = min(self.osenders)
                w1 = self.osenders.pop(seq)
                w1.state = DONE
                entry = (w1.payload, w1.nbytes)
            else:
                raise EndOfStream(
                    f"channel {self.name!r}: every send end is closed and the buffer is empty",
                    self.name,
                )
            self.next_seq = seq
        self.next_seq += 1
        woken = [] if w1 is None else [w1]
        w = self.osenders.pop(self.next_seq + self.window - 1, None)
        if w is not None:  # the window slid: admit the offer that now fits
            w.state = DONE
            pending[w.seq] = (w.payload, w.nbytes)
            woken.append(w)
        if self.receivers and (self.next_seq in pending or len(self.osenders) >= self.send_ends):
            r = self.receivers.popleft()  # the next item is ready (or another gap skip is due)
            r.state = RETRY
            woken.append(r)
        payload, nbytes = entry
        self.items_moved += 1
        self.bytes_moved += nbytes
        if not woken:
            return payload, None, None
        if len(woken) == 1:
            return payload, woken[0], None
        return payload, woken[0], _Many(woken[1:])

    def park_receiver(self, w: Any) -> None:
        w.t0 = perf_counter()
        self.receivers.append(w)

    def unpark_receiver(self, w: Any) -> None:
        """Remove a PENDING receiver (timeout)."""
        self.receivers.remove(w)

    def abandon_receiver(self, w: Any) -> Any:
        """A receiver gives up (cancelled). If it had been woken for an item, pass the wake-up on:
        returns the next receiver to wake, or None."""
        if w.state == PENDING:
            self.receivers.remove(w)
            return None
        if self.receivers:
            r = self.receivers.popleft()
            r.state = RETRY
            return r
        return None

    # ---- ends ---------------------------------------------------------------------------------
    def check_clone(self, end: Any, sending: bool) -> None:
        self._check(end, "send" if sending else "receive")
        if sending:
            self.send_ends += 1
        else:
            self.recv_ends += 1

    def close_end(self, end: Any, sending: bool) -> list:
        """Account for a closed end; returns the waiters to wake."""
        woken = []
        if sending:
            self.send_ends -= 1
            parked = self.osenders.values() if self.ordered else self.senders
            mine = [w for w in parked if w.end is end]
            for w in mine:
                self.unpark_sender(w)
            woken += mine
            if self.send_ends == 0 or self.ordered:
                woken += self.receivers
                self.receivers.clear()
        else:
            self.recv_ends -= 1
            woken += self.receivers  # its own calls fail; others re-check (pass-on after a close)
            self.receivers.clear()
            if self.recv_ends == 0:
                woken += self.senders
                woken += self.osenders.values()
                self.senders.clear()
                self.osenders.clear()
                self.buf.clear()
                self.pending.clear()
        for w in woken:
            w.state = RETRY
        return woken

    def abort(self, reason: str) -> list:
        """Abort the channel (takes the lock itself); returns the waiters to wake."""
        with self.lock:
            if self.aborted is not None:
                return []
            self.aborted = reason or "aborted"
            woken = [*self.senders, *self.osenders.values(), *self.receivers]
            for q in (self.senders, self.osenders, self.receivers, self.buf, self.pending):
                q.clear()
            for w in woken:
                w.state = RETRY
            return woken

    # ---- statistics ---------------------------------------------------------------------------
    def add_wait(self, seconds: float, sending: bool) -> None:
        """Add a finished blocking call's duration (takes the lock itself)."""
        with self.lock:
            if sending:
                self.send_blocked += seconds
            else:
                self.recv_wait += seconds

    def statistics(self) -> ChannelStatistics:
        """Snapshot (takes the lock itself)."""
        with self.lock:
            now = perf_counter()
            senders = [*self.senders, *self.osenders.values()]
            return ChannelStatistics(
                name=self.name,
                capacity=self.capacity,
                current_fill=len(self.pending) if self.ordered else len(self.buf),
                peak_fill=self.peak,
                open_send_ends=self.send_ends,
                open_receive_ends=self.recv_ends,
                waiting_senders=len(senders),
                waiting_receivers=len(self.receivers),
                items_moved=self.items_moved,
                bytes_moved=self.bytes_moved,
                send_blocked_s=self.send_blocked + sum(now - w.t0 for w in senders),
                receive_wait_s=self.recv_wait + sum(now - w.t0 for w in self.receivers),
            )


def _checkable(item_type: Any) -> type | None:
    """The class to isinstance-check items against, or None when the type can't be checked."""
    if item_type is object or not isinstance(item_type, type):
        return None
    try:
        isinstance(None, item_type)
    except TypeError:  # generic aliases such as list[int]
        return None
    return item_type
